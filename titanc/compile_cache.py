"""Compiled programs kept on disk: a second compile of the same model is a file read.

`compile_graphs` looks here before it lowers anything. An entry is the `Compiled` of the
training kinds (forward, training, optimizer: graphs, schedules, buffer plans and the pass
log's records, without per-pass graph dumps), pickled under
`<config.cache_dir>/compiled/<key>.pickle`, beside the generated kernel modules. A cold
compile of tiny.yaml takes 2-3 CPU-s here, a read about 0.03 s: `titanc train`, `serve`,
`generate` and each rank of `--nproc` reuse what an earlier process compiled.

The key (`compile_key`) is everything a compile's result depends on:
- the spec, less the fields no compile reads (`NOT_COMPILED`: run control, the data source,
  where it runs; tests/unit/test_compile_cache.py checks that the compiler's modules never
  read them);
- the batch and whether the pattern passes run;
- the source of the compiler itself (every module and template of the package, hashed once
  per process) and the Python version (the pickle format).
So an edited pass never meets an entry of the code before it. Entries are written atomically
(temp file + rename: concurrent processes share the directory) and the directory keeps the
`MAX_BYTES` most recently used.

An entry is trusted only as far as `titanc/cache_files.py` checks it: the cache directory is
this user's and private (else a one-line TitancError), the entry a regular file of at most
`MAX_BYTES` (a FIFO, a symlink or a device is a miss, never read), sealed with the user's
key for this very key (an entry copied from another spec's name, damaged, or planted by
anyone else is a miss and never unpickled) and recording its key. A miss compiles, and the
compile's entry replaces the bad one. `TITANC_COMPILE_CACHE=0` (`config.compile_cache`) turns it
off; `TITANC_DEBUG` does too (a compile then prints what it does), and a caller that asks for
per-pass dumps (`titanc compile`) always compiles.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import pickle
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from titanc.cache_files import (drop_stale_temporaries, private_directory, read_regular,
                                seal, unseal)
from titanc.config import current
from titanc.files import trim_directory, write_bytes_atomic
from titanc.model.spec import Spec, spec_to_dict

# Spec fields a compile never reads, by section ("": top level): specs that differ only in
# these share one entry. `data.documents` and `data.pack` are not here: they add graph inputs.
NOT_COMPILED: dict[str, tuple[str, ...]] = {
    "": ("name",),
    "train": ("steps", "lr", "warmup", "seed", "grad_accum", "eval_every", "eval_batches",
              "checkpoint_every", "log_every", "bucket_mb", "zero", "dist_timeout_s",
              "memory_stats_every", "tensorboard"),
    "data": ("source", "val_fraction", "tokenizer"),
    "compile": ("target", "cuda_graphs", "allow_tf32"),
}
# the packages whose code decides a compile's result (the runtime is there too: `fit`'s
# planned bytes and the ops' registry entries reach through it)
PACKAGES = ("titanc", "titanc.ir", "titanc.passes", "titanc.codegen", "titanc.runtime")
MAX_BYTES = 256 << 20


def compile_key(spec: Spec, batch: int | None, patterns: bool) -> str:
    """What a compile's result depends on, as text: the spec less `NOT_COMPILED`, the batch
    and the pattern passes (`verify_each` and dumps only add checks and copies)."""
    fields = spec_to_dict(spec)
    for section, names in NOT_COMPILED.items():
        table = fields[section] if section else fields
        for name in names:
            table.pop(name, None)
    return json.dumps([fields, batch or spec.train.batch_size, patterns], sort_keys=True)


@lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """A hash of every module and template of the compiler's packages, and the Python version."""
    h = hashlib.sha256(sys.version.encode())
    roots = []
    for name in PACKAGES:
        found = importlib.util.find_spec(name)
        roots += list(found.submodule_search_locations or []) if found else []
    for root in sorted(set(roots)):
        for path in sorted(Path(root).rglob("*")):
            if path.suffix in (".py", ".jinja", ".j2") and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Entry:
    compiled: Any
    verified: bool          # compiled with verify_each: every pass's output was verified
    key: str = ""           # what it was compiled from: the source fingerprint and the key


def enabled(dumps: bool) -> bool:
    cfg = current()
    return cfg.compile_cache and not cfg.debug and not dumps


def _where(key: str) -> tuple[Path, Path, str]:
    """(the cache root, the entry's file, its full key: the source fingerprint and `key`);
    TitancError when the cache directory is not this user's alone."""
    full = f"{source_fingerprint()}\n{key}"
    root = private_directory(current().cache_dir)
    digest = hashlib.sha256(full.encode()).hexdigest()[:32]
    return root, root / "compiled" / f"{digest}.pickle", full


def load(key: str, verify_each: bool) -> Any | None:
    """The cached `Compiled` of `key`, or None (absent, not a regular file, damaged, sealed
    for another key or by someone else, or unverified where the caller asks for
    verification)."""
    try:
        root, path, full = _where(key)
        payload = unseal(root, "compiled", full, read_regular(path, MAX_BYTES))
    except OSError:                     # no cache directory or key (a read-only disk): compile
        return None
    if payload is None:
        return None
    try:
        entry = pickle.loads(payload)
    except Exception:                   # sealed by this user's titanc, yet unreadable now
        return None
    if not isinstance(entry, Entry) or entry.key != full or (verify_each and not entry.verified):
        return None
    try:
        os.utime(path)                  # most recently used
    except OSError:
        pass
    return entry.compiled


def store(key: str, compiled: Any, verified: bool) -> None:
    """Write `compiled` (without its pass log's dumps and callbacks) under `key`, sealed;
    best effort: a full or read-only disk leaves the compile as it was."""
    log = dataclasses.replace(compiled.log, callbacks=[], dumps=[])
    try:
        root, path, full = _where(key)
        data = pickle.dumps(Entry(dataclasses.replace(compiled, log=log), verified, full),
                            protocol=pickle.HIGHEST_PROTOCOL)
        _write(path, seal(root, "compiled", full, data))
    except OSError:
        return


def _write(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically (replacing whatever was there, a FIFO or a symlink
    too), then keep the directory's `MAX_BYTES` most recently used entries."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, data)
        trim_directory(path.parent, "*.pickle", MAX_BYTES, keep=path)
        drop_stale_temporaries(path.parent)
    except OSError:
        return
