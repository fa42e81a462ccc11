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

# two pytest-xdist workers, a test file each at a time: one worker's jobs wait (timeouts, faults,
# services) while the other's compute, and a file's session fixtures and memos stay in one process
test: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=25 -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) build src/*.egg-info
