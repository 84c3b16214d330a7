# k3train: `make train` runs the default recipe, `make test` runs the whole suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RECIPE ?= tiny_cpu
ARGS ?=
# Two pytest workers (pytest-xdist); work stealing evens out the long multi-process tests. XDIST= runs in one process.
XDIST ?= -n 2 --dist worksteal

.PHONY: setup train test test-fast clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# CPU torch 2.13.0 where there is no CUDA; the CUDA build of 2.13 otherwise.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/pip install -q "torch>=2.13,<2.14"; \
	else \
	  $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e ".[test,slurm,fla]"
	touch $@

setup: $(VENV)/.installed

train: setup
	$(BIN)/python -m k3train.train --config-name $(RECIPE) $(ARGS)

test: setup
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(XDIST) tests

test-fast: setup
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(XDIST) -m "not slow" tests

clean:
	rm -rf $(VENV) outputs runs
