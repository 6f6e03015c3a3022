# titanc: `make demo` and `make test` each build .venv from nothing, then run.
# The venv is (re)built only when pyproject.toml or constraints.txt change (stamp file);
# constraints.txt pins torch's version; which build (CPU or CUDA) is the one the package index
# serves: PyPI serves the CUDA build on Linux x86-64. `make demo TORCH_INDEX=URL` installs torch
# from URL first, e.g. https://download.pytorch.org/whl/cpu for the CPU-only build.
# Modules are byte-compiled once, on first import: this environment sets
# PYTHONDONTWRITEBYTECODE, and without .pyc files every process a test starts would compile
# torch's modules again on import (3-4 CPU-s each), so the targets below unset it for the
# processes they start (.pyc files land in __pycache__ beside the sources: the venv's, and the
# repository's, which git ignores). Only what is imported is compiled (about 4,000 of the
# venv's 19,600 modules, 13 CPU-s once, against 42 s to byte-compile all of it up front).
export PYTHONDONTWRITEBYTECODE =

PYTHON ?= python3
TORCH_INDEX ?=
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast test-all venv gpu-check clean distclean

demo: $(STAMP)
	$(BIN)/titanc compile examples/tiny.yaml -o build/tiny
	$(BIN)/python -m titanc.tools.demo --out runs/demo

# `make test-fast`: tests/unit/ alone, by layer, under a minute (no whole-example compiles).
# `make test`: every tier but `slow` (CI; under 12 minutes on a 2-core machine), one pytest
# worker per core (pytest-xdist, a test file per worker: module fixtures and compiled
# programs stay in one process; the kernel cache is shared safely), the longest files first
# (tests/conftest.py LONGEST_FIRST).
# `make test-all`: the slow tier too (other block kinds of the parity sweeps, the recall run,
# the 1B-parameter compile); TITANC_AOT_FULL=1 adds every kernel of every example to the AOT test.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -m "not slow" -n $(TEST_WORKERS)

test-all: $(STAMP)
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

venv: $(STAMP)

# on a CUDA machine: triton vs cpu target parity, decode parity, throughput (benchmarks/gpu_check.py)
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(BIN)/pip install --no-compile -c constraints.txt torch --index-url $(TORCH_INDEX))
	$(BIN)/pip install --no-compile -c constraints.txt -e '.[dev]'
	touch $@

clean:
	rm -rf build runs .pytest_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
