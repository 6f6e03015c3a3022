"""Compiled artifacts kept in the compile cache: a second `titanc compile` of a spec is a copy.

`write_artifact` (titanc/tools/artifact.py) asks `restore` before it compiles and hands the
directory it wrote to `save` after. An entry is every text file of the artifact (report.json,
manifest.json, ir/, kernels/, program.py, memory_plan.txt, tokenizer.json) as one JSON object,
stored under `<config.cache_dir>/artifacts/<digest>.json`, sealed with the user's key
(titanc/cache_files.py: an entry written by anyone else, damaged or for another key is a miss)
and keyed by the whole spec (the artifact records its name and path), the tokenizer's hash,
`--force`, and titanc's source (`compile_cache.source_fingerprint`): an edited pass never
meets an artifact of the code before it. Only manifest.json's `argv` is rewritten on a hit.

Off with the compile cache (`TITANC_COMPILE_CACHE=0`, `TITANC_DEBUG`), and for `--arch`
(which fills the kernel caches as it compiles). A full or read-only cache directory leaves
the compile as it was. The directory keeps the `MAX_BYTES` most recently used entries.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from titanc import compile_cache
from titanc.cache_files import private_directory, read_regular, seal, unseal
from titanc.config import current
from titanc.files import trim_directory, write_bytes_atomic, write_text_atomic
from titanc.model.spec import spec_to_dict

__all__ = ["restore", "save", "MAX_BYTES"]

MAX_BYTES = 256 << 20          # the directory
ENTRY_BYTES = 64 << 20         # one entry: a larger artifact is compiled every time
_KIND = "artifact"


def _key(spec: Any, tok_hash: str, force: bool) -> str:
    return json.dumps([compile_cache.source_fingerprint(), spec_to_dict(spec), spec.path,
                       tok_hash, force], sort_keys=True, default=str)


def _where(key: str) -> tuple[Path, Path]:
    root = private_directory(current().cache_dir)
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return root, root / "artifacts" / f"{digest}.json"


def _usable(arch: int | None) -> bool:
    return arch is None and compile_cache.enabled(False)


def restore(spec: Any, tok_hash: str, force: bool, arch: int | None,
            stage: Path) -> dict[str, Any] | None:
    """Write the cached artifact of `spec` into the empty directory `stage` and return its
    report, or None (a miss: compile)."""
    if not _usable(arch):
        return None
    key = _key(spec, tok_hash, force)
    try:
        root, path = _where(key)
        payload = unseal(root, _KIND, key, read_regular(path, ENTRY_BYTES))
        files = json.loads(payload) if payload is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(files, dict) or "report.json" not in files:
        return None
    for rel, text in files.items():
        target = stage / rel
        if not isinstance(text, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(target, text)
    manifest = json.loads(files.get("manifest.json", "{}"))
    if isinstance(manifest, dict):               # the command line of this compile
        manifest["argv"] = sys.argv[1:]
        write_text_atomic(stage / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    try:
        os.utime(path)                           # most recently used
    except OSError:
        pass
    return json.loads(files["report.json"])


def save(spec: Any, tok_hash: str, force: bool, arch: int | None, stage: Path) -> None:
    """Keep the artifact compiled into `stage`; best effort (a full disk keeps nothing)."""
    if not _usable(arch):
        return
    files: dict[str, str] = {}
    for path in sorted(stage.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            try:
                files[path.relative_to(stage).as_posix()] = path.read_text()
            except (OSError, UnicodeDecodeError):
                return                            # not all text: not kept
    payload = json.dumps(files).encode()
    if len(payload) > ENTRY_BYTES:
        return
    key = _key(spec, tok_hash, force)
    try:
        root, path = _where(key)
        path.parent.mkdir(exist_ok=True)
        write_bytes_atomic(path, seal(root, _KIND, key, payload))
        trim_directory(path.parent, "*.json", MAX_BYTES, keep=path)
    except OSError:
        return
