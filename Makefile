# Set-up and entry points. Both targets create .venv and install pinned versions;
# then, two jobs at a time: the packages' bytecode, mcrdl's compiled hot path and
# (`make test`) DeepSpeed's CPU shm op for its DeepSpeed tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := $(VENV)/.packages
BYTECODE := $(VENV)/.bytecode
STAMP := $(VENV)/.installed
DS_OP := $(VENV)/torch_extensions/.built
ONECCL := $(VENV)/.oneccl
MAKEFLAGS += -j2

.PHONY: demo test clean

$(PACKAGES): pyproject.toml requirements-pinned.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -r requirements-pinned.txt
	$(BIN)/pip install -q --no-compile -e '.[test,plot]'
	touch $@

# what pip compiles on one core, on all of them; like pip, it passes over a file
# this Python cannot compile (torch ships one in 3.12 syntax)
$(BYTECODE): $(PACKAGES)
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > $(VENV)/compileall.log || \
	  echo "some files did not compile (as pip would skip them): $(VENV)/compileall.log"
	touch $@

# Intel oneCCL for the ccl backend, from PyPI (scripts/install_oneccl.sh says how); a
# failure stops make here, and without it the backend says why it is not live
$(ONECCL): $(PACKAGES) scripts/install_oneccl.sh
	bash scripts/install_oneccl.sh $(VENV)
	touch $@

$(STAMP): $(PACKAGES) $(ONECCL)
	$(BIN)/mcrdl info  # builds the compiled hot path and the shm kernels once (docs/design.md, docs/backends.md)
	touch $@

# tests/test_frameworks.py copies it into each session's own TORCH_EXTENSIONS_DIR
$(DS_OP): $(PACKAGES)
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(dir $@) $(BIN)/python -c \
	  "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None"
	touch $@

demo: $(STAMP) $(BYTECODE) $(ONECCL)
	$(BIN)/mcrdl info
	$(BIN)/mcrdl demo

test: $(STAMP) $(BYTECODE) $(DS_OP) $(ONECCL)
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q -ra --durations=25 tests

clean:
	rm -rf $(VENV) build src/*.egg-info
