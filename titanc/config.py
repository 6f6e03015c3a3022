"""The settings titanc reads from its environment, as one typed object with a scoped override.

No other module reads or writes `os.environ` (tests/unit/test_architecture.py checks it): the CLI
entry point reads the environment once and runs its command in those settings (`using`); a
program that never runs the CLI gets the same settings, read the first time it asks
(`current`); code that wants other settings for a while says so in a scope:

    with config.override(debug=2):          # fusion refusals printed, for this block only
        fuse(g)

| field          | variable              | meaning                                                   |
|----------------|-----------------------|-----------------------------------------------------------|
| `debug`        | `TITANC_DEBUG`        | 1: each pass and its time; 2: the IR after each pass and every refusal with its reason; 3: the generated kernels |
| `scan_kernels` | `TITANC_SCAN_KERNELS` | 0: the triton target runs every scan as a host loop        |
| `group_launches` | `TITANC_GROUP_LAUNCHES` | 0: the triton target launches every kernel alone (no launch groups, `codegen/horizontal.py`) |
| `split_k`      | `TITANC_SPLIT_K`      | 1: split-K for matmuls with few output tiles and a long K (`codegen/meta.py` `split_k`; off by default: not yet measured on a GPU) |
| `scan_cost`    | `TITANC_SCAN_COST`    | 0: every chunk recurrence that renders as one scan kernel is one, however many serial rounds it runs (no cost rule: `codegen/scan/kernel.py` `scan_kernel_for`; the A/B of a GPU call) |
| `scan_split`   | `TITANC_SCAN_SPLIT`   | P > 1: a chunk recurrence's scan kernel may split each slice of its independent axes over P programs (at most 132 in all; `codegen/scan/kernel.py`, "Split kernels"), weighed by the cost rule against the unsplit kernel and the host loop; default 1 (off until a GPU measures it) |
| `gpu_blocks`   | `TITANC_GPU_BLOCKS`   | 0: pointwise, reduction, cumsum and cross-entropy kernels launch on CUDA with the interpreter's blocks, not their own (`codegen/meta.py` `cuda_flat_block`; the A/B of a GPU call) |
| `cache_dir`    | `TITANC_CACHE_DIR`    | where generated kernel modules and compiled programs are written (default: a per-user temp dir); created 0700, refused when another user owns it or may write it (titanc/cache_files.py) |
| `compile_cache` | `TITANC_COMPILE_CACHE` | 0: compile every time instead of reading `cache_dir/compiled` (titanc/compile_cache.py) |
| `threads`      | `TITANC_THREADS`      | torch CPU threads of `titanc train` (a positive integer)  |
| `api_key`    | `TITANC_API_KEY`      | the key `titanc serve` requires as `Authorization: Bearer KEY` when no `--api-key` is given (runtime/serve/guard.py) |
| `compile_jobs` | `TITANC_COMPILE_JOBS` | the most kernel-compile workers at once on this machine, over every titanc process (a positive integer; default: this process's cores) |
| `torchrun`     | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` | the process group torchrun (or `titanc train --nproc`) describes |

Two variables belong to libraries that read only their environment, so this module is also
the one place that writes it: Triton's `TRITON_INTERPRET` (`triton_interpret`,
`triton_interpret_mode`: Triton reads it when a kernel is decorated and launched) and the
tokenizers library's `TOKENIZERS_PARALLELISM` (`set_worker_environment`, in a pool worker).
"""
from __future__ import annotations

import os
import sys
import tempfile
import contextlib
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping

from titanc.errors import TitancError

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Config:
    debug: int = 0
    scan_kernels: bool = True
    group_launches: bool = True
    split_k: bool = False
    gpu_blocks: bool = True
    scan_cost: bool = True
    scan_split: int = 1
    cache_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir())
                            / f"titanc-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}")
    compile_cache: bool = True
    threads: int | None = None
    compile_jobs: int | None = None
    api_key: str | None = field(default=None, repr=False)     # TITANC_API_KEY, never printed
    torchrun: Mapping[str, str] = field(default_factory=dict)
    invalid: Mapping[str, str] = field(default_factory=dict)   # variable -> its bad value

    def threads_or_none(self) -> int | None:
        """`threads`; TitancError naming TITANC_THREADS when it was set to something else
        than a positive integer (raised where the count is used, so no other command fails)."""
        if "TITANC_THREADS" in self.invalid:
            raise TitancError(f"TITANC_THREADS={self.invalid['TITANC_THREADS'][:20]!r}: "
                              f"expected a positive integer; unset it for the default")
        return self.threads

    def compile_slots(self) -> int:
        """How many kernel compiles may run at once on this machine (`compile_jobs`, default
        the cores this process may use); TitancError naming TITANC_COMPILE_JOBS when it was
        set to something else than a positive integer."""
        if "TITANC_COMPILE_JOBS" in self.invalid:
            raise TitancError(f"TITANC_COMPILE_JOBS={self.invalid['TITANC_COMPILE_JOBS'][:20]!r}: "
                              f"expected a positive integer; unset it for one per core")
        if self.compile_jobs is not None:
            return self.compile_jobs
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:             # not Linux
            return os.cpu_count() or 1

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Config":
        """The settings `env` names (a missing variable keeps its default; a malformed
        TITANC_THREADS is kept in `invalid`, the others fall back to their default)."""
        try:
            debug = int(env.get("TITANC_DEBUG", "0") or 0)
        except ValueError:
            debug = 0
        threads, invalid = None, {}
        text = env.get("TITANC_THREADS", "").strip()
        if text:
            if not text.isdigit() or len(text) > 4 or int(text) < 1:
                invalid["TITANC_THREADS"] = text
            else:
                threads = int(text)
        more: dict[str, Any] = {}
        jobs = env.get("TITANC_COMPILE_JOBS", "").strip()
        if jobs:
            if not jobs.isdigit() or len(jobs) > 4 or int(jobs) < 1:
                invalid["TITANC_COMPILE_JOBS"] = jobs
            else:
                more["compile_jobs"] = int(jobs)
        split = env.get("TITANC_SCAN_SPLIT", "").strip()
        if split.isdigit() and 1 <= int(split) <= 132:
            more["scan_split"] = int(split)
        if env.get("TITANC_API_KEY", "").strip():
            more["api_key"] = env["TITANC_API_KEY"].strip()
        if env.get("TITANC_CACHE_DIR"):
            more["cache_dir"] = Path(env["TITANC_CACHE_DIR"])
        return cls(debug=debug, scan_kernels=env.get("TITANC_SCAN_KERNELS", "1") != "0",
                   group_launches=env.get("TITANC_GROUP_LAUNCHES", "1") != "0",
                   split_k=env.get("TITANC_SPLIT_K", "0") == "1",
                   gpu_blocks=env.get("TITANC_GPU_BLOCKS", "1") != "0",
                   scan_cost=env.get("TITANC_SCAN_COST", "1") != "0",
                   compile_cache=env.get("TITANC_COMPILE_CACHE", "1") != "0", threads=threads, torchrun={k: env[k] for k in TORCHRUN if k in env},
                   invalid=invalid, **more)


_DEFAULT: list[Config] = []                       # the process default, once loaded
_SCOPED: ContextVar[Config | None] = ContextVar("titanc_config", default=None)


def load_environment(env: Mapping[str, str] | None = None) -> Config:
    """Read the environment (or `env`) into the process default (`current` does it on first
    use)."""
    cfg = Config.from_env(os.environ if env is None else env)
    _DEFAULT[:] = [cfg]
    return cfg


@contextmanager
def using(cfg: Config) -> Iterator[Config]:
    """`cfg` in force inside the block (the CLI runs each command in the environment's)."""
    token = _SCOPED.set(cfg)
    try:
        yield cfg
    finally:
        _SCOPED.reset(token)


def current() -> Config:
    """The settings in force: the innermost `override`, else the process default."""
    scoped = _SCOPED.get()
    if scoped is not None:
        return scoped
    if not _DEFAULT:
        load_environment()
    return _DEFAULT[0]


def override(**changes: Any) -> "contextlib.AbstractContextManager[Config]":
    """The current settings with `changes` (field names of `Config`) inside the block only."""
    return using(replace(current(), **changes))


def debug_level() -> int:
    return current().debug


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment plus `extra`, for a subprocess titanc starts."""
    return {**os.environ, **extra}


# `python -m` without its first path entry (the current directory): see module_command
_RUN_MODULE = ("import runpy, sys; del sys.path[0]; sys.argv = sys.argv[1:]; "
               "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def module_command(module: str, *args: str) -> list[str]:
    """The command line of a subprocess titanc starts to run `module` as `python -m` would,
    less `-m`'s first import path, the current directory: in a checkout (or any folder with a
    `titanc/` of its own) that folder's titanc/ would shadow the package (pyproject's
    package-dir maps the subpackages in from beside it), and `titanc.runtime` would not import."""
    return [sys.executable, "-c", _RUN_MODULE, module, *args]


# -- variables other libraries read from the environment -----------------------------------------

def triton_interpret() -> bool:
    """Does Triton run kernels under its interpreter (`TRITON_INTERPRET`, as Triton sees it now)?"""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE


@contextmanager
def triton_interpret_mode(on: bool | None) -> Iterator[None]:
    """`TRITON_INTERPRET` set to `on` inside (unset for None), restored after. Triton reads it
    when a kernel is decorated and again while launching (its interpreter imports modules
    lazily), so a caller loads and runs interpreted kernels inside this; nothing outside sees
    it."""
    old = os.environ.get("TRITON_INTERPRET")
    if on is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def set_worker_environment(**values: str) -> None:
    """Set variables a library reads, in a pool worker process that titanc started (e.g.
    TOKENIZERS_PARALLELISM=false: one process per core already)."""
    os.environ.update(values)
