# titanc: `make demo` and `make test` each build .venv from nothing, then run.
# The venv is (re)built only when pyproject.toml or constraints.txt change (stamp file);
# constraints.txt pins torch's version; which build (CPU or CUDA) is the one the package index
# serves: PyPI serves the CUDA build on Linux x86-64. `make demo TORCH_INDEX=URL` installs torch
# from URL first, e.g. https://download.pytorch.org/whl/cpu for the CPU-only build.
# Installed modules are byte-compiled once: this environment sets PYTHONDONTWRITEBYTECODE, so
# without .pyc files every process a test starts would compile torch's modules again on import
# (3-4 CPU-s each). pip compiles them one at a time (about 50 s of a 109 s build here);
# `compileall -j 0` compiles the same files on every core after `pip install --no-compile`
# (58 s + 32 s here). Only a speed-up, so a failure does not stop the build (torch ships a
# file for a newer Python that no 3.11 compiles; pip skips it the same way). All of it: leaving
# transformers, sympy, pandas ... to compile on import costs each process that imports them
# more than the build saves (transformers 10.2 s instead of 6.8, torch._dynamo 6.5 for 3.7).

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
	$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') > /dev/null || true
	touch $@

clean:
	rm -rf build runs .pytest_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
