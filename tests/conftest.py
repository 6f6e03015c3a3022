"""Shared pytest fixtures and markers.

Markers (declared in pyproject.toml): `slow` for longer tests that `make test` leaves out
(`make test-all` runs them: the other block kinds of parity sweeps whose fast case stays in
`make test`, the recall run, the 1B-parameter compile), `gpu` for tests that need CUDA; `gpu`
tests are skipped when no CUDA device is present.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import titanc.compiler
from titanc.model.spec import Spec, load_spec
from tests.helpers import SERVE_SETS, memoize_compiles, memoize_for_batch

# one compile per distinct model and options in a test run, and one per model at each other
# batch a program runs (tests/helpers.py says why that is safe); patched before any test module
# imports `compile_graphs` by name
titanc.compiler.compile_graphs = memoize_compiles(titanc.compiler.compile_graphs)
titanc.compiler.Compiled.for_batch = memoize_for_batch(titanc.compiler.Compiled.for_batch)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


# The longest test files, longest first (per-file times of a whole run with empty kernel and
# compile caches, as from a fresh clone): with `--dist loadfile --no-loadscope-reorder` (the
# Makefile's) pytest-xdist hands files to the workers in collection order, so these start
# first and the many short files fill in behind them (longest-processing-time-first).
# xdist's own reordering sorts files by their number of tests, which put a 3-test file of
# interpreted training steps last, alone on one worker.
LONGEST_FIRST = (
    "test_scan_kernel.py", "test_aot.py", "test_documents.py", "test_readme.py",
    "test_flash_attention.py", "test_codegen.py", "test_remat_segment.py", "test_precision.py",
    "test_remat_group.py", "test_gpu_blocks.py", "test_linear_cross_entropy.py",
    "test_decode.py", "test_pipeline.py", "test_lowered.py", "test_run_input.py",
    "test_sessions.py", "test_distributed.py", "test_bench.py",
    "test_corpus_e2e.py", "test_precompile.py", "test_objective.py", "test_serve.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), order[item]))
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: keeps spec/CLI-only runs fast

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`titanc compile examples/tiny.yaml` at SERVE_SETS, once per test process: every
    serving test reads it and none writes into it."""
    from titanc.tools.cli import main

    out = tmp_path_factory.mktemp("serve") / "art"
    argv = ["compile", str(EXAMPLES / "tiny.yaml"), "-o", str(out)]
    for s in SERVE_SETS:
        argv += ["--set", s]
    assert main(argv) == 0
    return out


@pytest.fixture
def repo_root() -> Path:
    """The repository root (where pyproject.toml lives)."""
    return ROOT


@pytest.fixture
def examples_dir() -> Path:
    return EXAMPLES


@pytest.fixture
def tiny_spec() -> Spec:
    """examples/tiny.yaml: the tiny MAC model every quick test can use."""
    return load_spec(EXAMPLES / "tiny.yaml")
