# Set-up and entry points. Both targets create .venv and install pinned versions.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test clean

$(STAMP): pyproject.toml requirements-pinned.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-pinned.txt
	$(BIN)/pip install -q -e '.[test,plot]'
	$(BIN)/mcrdl info  # builds the compiled hot path once (docs/design.md, "The hot path")
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mcrdl info
	$(BIN)/mcrdl demo

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q -ra --durations=25 tests

clean:
	rm -rf $(VENV) build src/*.egg-info
