"""Rendering kernel templates: the one Jinja2 environment, name/comment sanitising, loading.

Every string that reaches a generated kernel passes through this module:

- `sanitize_identifier` turns any text (a spec name, an IR label) into a safe Python identifier;
  `Namer` hands out unique sanitised names that never collide with the names a template binds
  itself (listed per family in `families.TEMPLATE_LOCALS`).
- `sanitize_comment` turns any text into one printable-ASCII comment line; `render` applies it
  to `header_lines`, so a hostile spec value can neither end the comment nor add a line.
- `render(template, **context)` renders `codegen/templates/<template>` with `StrictUndefined`:
  a variable the hook forgot is an error, never empty text.
- `load_module(source, name)` writes a rendered module into the kernel cache (Triton's JIT
  reads kernel source through `inspect`, so it must live in a real file) and runs it: the
  source it was given, never what the file holds (a file that differs, is damaged or is not a
  regular file is written again). The cache holds at most `KERNELS_MAX_BYTES` of kernel
  files, the least recently used dropped first.
- `load_rendered(key)` / `store_rendered(key, entries)`: what a target rendered for one plan,
  kept in `<cache_dir>/rendered/` under a key the caller vouches for (the triton target: what
  the plan was compiled from, its dtype and tf32), so a later process binds without rendering;
  sealed with the user's key (`titanc/cache_files.py`), so only an entry this user's titanc
  wrote for that key is ever unpickled.

The cache directory is `cache_files.private_directory`: this user's, 0700, or refused.

Rendering is deterministic: the same context gives byte-identical source.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import hashlib
import importlib.util
import keyword
import linecache
import os
import pickle
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from titanc.cache_files import (drop_stale_temporaries, private_directory, read_regular,
                                seal, unseal)
from titanc.config import current, triton_interpret, triton_interpret_mode
from titanc.errors import TitancError, printable
from titanc.files import os_reason, trim_directory, write_bytes_atomic

__all__ = [
    "TEMPLATE_DIR",
    "Namer",
    "cache_dir",
    "kernel_name",
    "load_module",
    "load_rendered",
    "render",
    "sanitize_comment",
    "sanitize_identifier",
    "store_rendered",
]

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"

_ENV = Environment(
    loader=FileSystemLoader(str(TEMPLATE_DIR)),
    undefined=StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)

# Module names every generated file imports; with keywords and builtins, never a user name.
_MODULE_NAMES = frozenset({"tl", "triton", "torch", "math"})
_RESERVED: frozenset[str] = frozenset(
    set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins)) | _MODULE_NAMES
)

_INVALID_CHARS = re.compile(r"[^A-Za-z0-9_]")


def sanitize_identifier(s: str, prefix: str = "v_") -> str:
    """`s` as a safe Python identifier.

    Characters outside [A-Za-z0-9_] become `_`; a name that is empty, starts with a digit or
    an underscore, is a keyword, a builtin or a module a kernel imports gets `prefix` in front.
    The result is never a dunder, so `__import__('os')` becomes `v___import___os__`.
    """
    name = _INVALID_CHARS.sub("_", str(s))
    if not name or name[0].isdigit() or name[0] == "_" or name in _RESERVED:
        name = prefix + name
    return name


def sanitize_comment(s: object, max_len: int = 160) -> str:
    """`s` as the text of one comment line: printable ASCII only, at most `max_len` chars.

    Line breaks, tabs and every other control or non-ASCII character are written as visible
    escapes (`\\n`, `\\x1b`, `\\u2028`), so the text cannot end the comment or start a new line.
    """
    out: list[str] = []
    for ch in str(s):
        code = ord(ch)
        if 0x20 <= code < 0x7F:
            out.append(ch)
        elif ch == "\n":
            out.append("\\n")
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    text = "".join(out)
    if len(text) > max_len:
        text = text[: max_len - 3] + "..."
    return text


def kernel_name(category: str, ops: Sequence[str], n: int) -> str:
    """`titanc_{poi|red|mm|tem}_fused_<ops>_<n>`, every part sanitised."""
    if category not in ("poi", "red", "mm", "tem"):
        raise ValueError(f"kernel category {category!r} must be one of poi, red, mm, tem")
    parts = [re.sub("_+", "_", _INVALID_CHARS.sub("_", str(op))).strip("_") for op in ops]
    body = "_".join(p for p in parts if p) or "kernel"
    return f"titanc_{category}_fused_{body}_{int(n)}"


class Namer:
    """Hands out unique, sanitised identifiers for one kernel.

    `reserved` are the names the family's template binds itself (its kernel and launcher
    locals); a hint equal to one of them is prefixed (`mask` becomes `v_mask`). `fresh("w")`
    gives `w`, a second `fresh("w")` gives `w_1`. `derived` patterns reserve the names a
    template builds from the result too: `fresh("x", ("{}_ptr",))` also takes `x_ptr`.
    """

    def __init__(self, reserved: Iterable[str] = ()) -> None:
        self._reserved = frozenset(reserved)
        self._taken: set[str] = set()

    def _free(self, name: str) -> bool:
        return name not in self._taken and name not in self._reserved

    def fresh(self, hint: str, derived: Sequence[str] = ()) -> str:
        base = sanitize_identifier(hint)
        if base in self._reserved:
            base = "v_" + base
        name, i = base, 0
        while not (self._free(name) and all(self._free(d.format(name)) for d in derived)):
            i += 1
            name = f"{base}_{i}"
        self._taken.add(name)
        self._taken.update(d.format(name) for d in derived)
        return name


def render(template: str, **context: Any) -> str:
    """Render `codegen/templates/<template>`; `header_lines` are sanitised comment lines."""
    if "header_lines" in context:
        context["header_lines"] = [sanitize_comment(line) for line in context["header_lines"]]
    if "name" in context:
        context["name"] = sanitize_identifier(context["name"], prefix="titanc_")
    return with_helpers(_ENV.get_template(template).render(**context))


_IMPORT_TL = "import triton.language as tl\n"


def with_helpers(source: str) -> str:
    """`source` with the definitions of the helpers its kernels call (`_bf16`,
    templates/_bf16.py.jinja), after its Triton import."""
    if "_bf16(" not in source or "def _bf16(" in source or _IMPORT_TL not in source:
        return source
    head, tail = source.split(_IMPORT_TL, 1)
    helper = _ENV.get_template("_bf16.py.jinja").render()
    return f"{head}{_IMPORT_TL}\n{helper}\n\n{tail}"


def cache_dir() -> Path:
    """Where `load_module` writes kernel files: `config.current().cache_dir`
    (`TITANC_CACHE_DIR`, else a per-user temp dir), created 0700 if missing; TitancError if
    another user owns it or may write it, or it cannot be created."""
    path = current().cache_dir
    try:
        return private_directory(path)
    except OSError as e:
        raise TitancError(f"cannot create the cache directory {printable(str(path))}: "
                          f"{os_reason(e)}; set TITANC_CACHE_DIR to a writable directory"
                          ) from None


_LOADED: dict[str, ModuleType] = {}
KERNELS_MAX_BYTES = 256 << 20      # kernel files kept in the cache, least recently used dropped
KERNEL_MAX_BYTES = 16 << 20        # one kernel file read back (a larger one is written again)
_TRIM_EVERY = 64                   # new kernel files between two trims of the directory
_written = [0]


def swap_loaded_modules(table: dict[str, ModuleType]) -> dict[str, ModuleType]:
    """Install `table` as this process's loaded kernel modules and return the table it
    replaces (`aot.fresh_kernel_modules` loads a step's kernels afresh, then restores)."""
    global _LOADED
    previous, _LOADED = _LOADED, table
    return previous


def load_module(source: str, name: str, interpret: bool | None = None) -> ModuleType:
    """Write `source` to `<cache_dir>/<name>_<hash>.py` and import it as a module.

    The file name carries a hash of the source, so identical sources share one file and one
    module object, and a changed source never reuses a stale import. What runs is `source`
    itself (compiled under the file's name, and handed to `inspect` through `linecache`), so
    a file changed behind this process's back runs nothing; a file that does not hold exactly
    `source` is written again (atomically: concurrent processes share the cache).

    Triton decides when a kernel is decorated whether it runs under its interpreter, from
    `TRITON_INTERPRET`: `interpret` (True / False) sets that variable for the import only and
    restores it after (`config.triton_interpret_mode`); None leaves it as the caller set it.
    """
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    mod_name = f"titanc_kernel_{sanitize_identifier(name, prefix='k_')}_{digest}"
    interpreted = triton_interpret() if interpret is None else interpret
    # never hand a module loaded in one mode to a caller in the other
    key = f"{mod_name}:{'interpret' if interpreted else 'compile'}"
    if key in _LOADED:
        return _LOADED[key]
    path = _kernel_file(source, mod_name)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    lines = source.splitlines(keepends=True)
    linecache.cache[str(path)] = (len(source), None, lines, str(path))   # what inspect reads
    code = compile(source, str(path), "exec")
    with triton_interpret_mode(interpreted):
        exec(code, module.__dict__)
    if interpreted:
        _drop_dead_overflow_checks()
    _LOADED[key] = module
    return module


def _kernel_file(source: str, mod_name: str) -> Path:
    """`<cache_dir>/<mod_name>.py` holding exactly `source`: kept when it does (marked most
    recently used), else written again; the directory trimmed to `KERNELS_MAX_BYTES` now and
    then. A disk that refuses the write is a one-line TitancError."""
    root = cache_dir()
    path = root / f"{mod_name}.py"
    data = source.encode()
    if read_regular(path, KERNEL_MAX_BYTES) == data:
        with contextlib.suppress(OSError):
            os.utime(path)
        return path
    try:
        write_bytes_atomic(path, data)
    except OSError as e:
        raise TitancError(f"cannot write the kernel module {printable(str(path))}: "
                          f"{os_reason(e)}; free some space or set TITANC_CACHE_DIR to a "
                          f"writable directory") from None
    if _written[0] % _TRIM_EVERY == 0:
        with contextlib.suppress(OSError):
            trim_directory(root, "titanc_kernel_*.py", KERNELS_MAX_BYTES, keep=path)
            drop_stale_temporaries(root)
    _written[0] += 1
    return path


RENDERED_MAX_BYTES = 256 << 20     # the rendered/ folder keeps its most recently used entries


def _rendered_path(key: str) -> Path:
    return cache_dir() / "rendered" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pickle"


def load_rendered(key: str) -> dict[Any, Any]:
    """The entries `store_rendered` kept under `key`, or {} (none, damaged, another key's,
    or not sealed by this user's titanc: nothing else is unpickled)."""
    path = _rendered_path(key)
    try:
        payload = unseal(path.parent.parent, "rendered", key,
                         read_regular(path, RENDERED_MAX_BYTES))
    except OSError:                    # no key can be made (a read-only cache): render
        return {}
    if payload is None:
        return {}
    try:
        entries = pickle.loads(payload)
    except Exception:                  # sealed by an older titanc whose classes moved
        return {}
    with contextlib.suppress(OSError):
        os.utime(path)                 # most recently used
    return entries if isinstance(entries, dict) else {}


def store_rendered(key: str, entries: dict[Any, Any]) -> None:
    """Keep `entries` (rendered kernels, picklable) under `key`, sealed; best effort: a full
    or read-only disk leaves things as they were."""
    path = _rendered_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)
        write_bytes_atomic(path, seal(path.parent.parent, "rendered", key, payload))
        trim_directory(path.parent, "*.pickle", RENDERED_MAX_BYTES, keep=path)
        drop_stale_temporaries(path.parent)
    except OSError:
        return


def _drop_dead_overflow_checks() -> None:
    """Stop Triton's interpreter computing overflow checks it then throws away.

    For every int32 add, sub and mul (every index computation), the interpreter casts both
    operands to int64, redoes the operation and compares it with the int32 range, then hands
    the condition to `device_assert`, which returns without asserting unless the builder's
    `options.debug` is set, and the interpreter never sets it. The check is dead work (a fifth
    of an interpreted MAC step); with `sanitize_overflow` off the same kernels run the same
    arithmetic. Nothing changes if a debugging interpreter ever does assert."""
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    options = builder.options
    if options.sanitize_overflow and not options.debug:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
