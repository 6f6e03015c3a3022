"""The engine that reads a spec: typed, frozen dataclasses checked field by field, built from
YAML or a mapping, with `--set` overrides and one-line errors. It knows no field of the spec;
`titanc/model/spec.py` declares the schema and binds it here (`Schema(Spec)`).

A schema is a tree of dataclasses in which every dataclass appears exactly once, so each one
has its own dotted prefix (`Schema.prefix`) and validates itself in `__post_init__` through
`Schema.check`: a spec built in Python, by `dataclasses.replace`, or from YAML passes the same
checks. Validation, in order:

1. structure (`Schema.build`): unknown keys (with the closest known key as a suggestion),
   missing required fields, sections that are not mappings;
2. each field (`Schema.check`): its type (a bool is not an int; an int is accepted for a
   float), then the bounds declared next to it (`bounded(ge=..., gt=..., lt=..., choices=...)`);
3. rules across fields, in the schema's own `__post_init__`.

Every failure is a `SpecError` whose one-line message names the dotted field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import reprlib
import stat
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, field, fields
from typing import Any

import yaml

from titanc.bounds import SPEC_FLOAT_MAX
from titanc.errors import SpecError

F32_MAX = 3.4028234663852886e38


# ------------------------------------------------------------------------------ declaring


def bounded(default: Any = MISSING, **bounds: Any) -> Any:
    """A dataclass field with validation bounds: ge, gt, lt, le (numbers), most (a cap on
    what the code downstream takes, stated on its own: `must be at most N`) or choices
    (strings)."""
    return field(default=default, metadata=bounds)


def section(cls: type) -> Any:
    """A field holding a nested section of the schema (all defaults when absent)."""
    return field(default_factory=cls)


def not_in_file(default: Any = None) -> Any:
    """A field that is not part of the content: never read from a file, written, compared or
    checked (e.g. the path a spec was read from)."""
    return field(default=default, compare=False, metadata={"in_file": False})


def _in_file(f: dataclasses.Field) -> bool:
    return f.metadata.get("in_file", True)


def _keys(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if _in_file(f)]


# ------------------------------------------------------------------------------- messages


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# repr() bounded in depth and width before it is built: a YAML alias bomb expands to a value
# whose full repr would take hours, and a message only ever shows its first 60 characters
def _int_repr(value: int) -> str:
    if value.bit_length() <= 256:
        return repr(value)
    return f"{'minus ' if value < 0 else ''}an integer of {value.bit_length()} bits"  # repr()
    #                                                       refuses ints past 4300 digits


class _BoundedRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        return _int_repr(x)


_REPR = _BoundedRepr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 60


def _brepr(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return _short(_REPR.repr(value))
    # linear in the input: keep the plain prefix
    return _short(_int_repr(value) if isinstance(value, int) else repr(value))


def _show(value: Any) -> str:
    """A value as it would be written in YAML, on one line and short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        value = list(value)
    return _brepr(value)


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    kinds = [(bool, "a boolean"), (int, "the integer"), (float, "the number"),
             (str, "the string"), ((list, tuple), "the list")]
    for kind, words in kinds:
        if isinstance(value, kind):
            return f"{words} {_show(value)}"
    if isinstance(value, Mapping):
        return "a mapping"
    return f"a {type(value).__name__} {_brepr(value)}"


def _type_error(path: str, want: str, value: Any) -> SpecError:
    hint = ""
    if want == "a string" and isinstance(value, (bool, int, float)):
        hint = "; put it in quotes"
    return SpecError(f"{path}: expected {want}, got {_describe(value)}{hint}")


# --------------------------------------------------------------------------------- checks


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_scalar(value: Any, tp: Any, path: str) -> Any:
    """Return `value` as the scalar type `tp` (an int is accepted for a float) or raise."""
    if tp is bool:
        if not isinstance(value, bool):
            raise _type_error(path, "true or false", value)
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(path, "an integer", value)
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(path, "a number", value)
        value = float(value)
        if not math.isfinite(value):
            raise SpecError(f"{path}: {_show(value)} must be a finite number")
    elif tp is str:
        if not isinstance(value, str):
            raise _type_error(path, "a string", value)
    else:  # pragma: no cover - the schema uses no other types
        raise AssertionError(f"unsupported schema type {tp!r} at {path}")
    return value


def _bounds_text(bounds: Mapping[str, Any]) -> str:
    if "lt" in bounds or "le" in bounds:
        lo, bracket = (bounds["ge"], "[") if "ge" in bounds else (bounds["gt"], "(")
        hi, close = (bounds["lt"], ")") if "lt" in bounds else (bounds["le"], "]")
        return f"in {bracket}{lo}, {hi}{close}"
    return f">= {bounds['ge']}" if "ge" in bounds else f"> {bounds['gt']}"


def _check_bounds(value: Any, bounds: Mapping[str, Any], path: str) -> None:
    if value is None or not bounds:
        return
    if isinstance(value, tuple):
        for i, item in enumerate(value):
            _check_bounds(item, bounds, f"{path}[{i}]")
        return
    if "choices" in bounds:
        if value not in bounds["choices"]:
            raise SpecError(f"{path}: {_show(value)} must be one of {', '.join(bounds['choices'])}")
        return
    ok = (("ge" not in bounds or value >= bounds["ge"])
          and ("gt" not in bounds or value > bounds["gt"])
          and ("lt" not in bounds or value < bounds["lt"])
          and ("le" not in bounds or value <= bounds["le"]))
    if not ok:
        raise SpecError(f"{path}: {_show(value)} must be {_bounds_text(bounds)}")
    if "most" in bounds and value > bounds["most"]:
        if bounds["most"] == SPEC_FLOAT_MAX:    # a graph scalar: float32 when the masters are
            raise SpecError(f"{path}: {value:g} overflows float32 (largest {F32_MAX:.4g}); "
                            f"use a smaller value")
        raise SpecError(f"{path}: {_show(value)} must be at most {_show(bounds['most'])}")




# ------------------------------------------------------------------------------- a schema


class Schema:
    """A tree of spec dataclasses rooted at `root`, in which each dataclass appears once: its
    sections' dotted prefixes, every settable leaf path with its type, and the checks,
    construction, overrides and conversion over them."""

    def __init__(self, root: type) -> None:
        self.root = root
        self.prefix: dict[type, str] = {}      # each section's dotted prefix ("" the root)
        self.leaves: dict[str, Any] = {}       # every settable dotted path (no sections) -> type
        self._walk(root, "")

    def _walk(self, cls: type, prefix: str) -> None:
        self.prefix[cls] = prefix
        hints = _hints(cls)
        for name in _keys(cls):
            path, tp = _join(prefix, name), hints[name]
            if dataclasses.is_dataclass(tp):
                self._walk(tp, path)
            else:
                self.leaves[path] = tp

    # -- fields

    def check(self, obj: Any) -> None:
        """Type-check, normalise and bound-check every field of a spec dataclass, in order."""
        cls = type(obj)
        hints = _hints(cls)
        for f in fields(cls):
            if not _in_file(f):
                continue
            path = _join(self.prefix[cls], f.name)
            value = self._check_type(getattr(obj, f.name), hints[f.name], path)
            _check_bounds(value, f.metadata, path)
            object.__setattr__(obj, f.name, value)

    def _check_type(self, value: Any, tp: Any, path: str) -> Any:
        """Return `value` as type `tp` (int -> float, list -> tuple, mapping -> section) or
        raise."""
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (types.UnionType, typing.Union):  # only `X | None` occurs in a schema
            (inner,) = [a for a in args if a is not type(None)]
            return None if value is None else self._check_type(value, inner, path)
        if origin is tuple and args[1:] == (Ellipsis,):   # tuple[X, ...]: a list of any length
            if not isinstance(value, (list, tuple)):
                raise _type_error(path, "a list", value)
            return tuple(self._check_type(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if origin is tuple:
            if not isinstance(value, (list, tuple)) or len(value) != len(args):
                raise _type_error(path, f"a list of {len(args)} numbers", value)
            return tuple(self._check_type(v, a, f"{path}[{i}]")
                         for i, (v, a) in enumerate(zip(value, args)))
        if dataclasses.is_dataclass(tp):
            if isinstance(value, tp):
                return value
            if value is None or isinstance(value, Mapping):
                return self.build(tp, value)
            raise _type_error(path, "a mapping", value)
        return _check_scalar(value, tp, path)

    # -- structure

    def suggest(self, path: str) -> str | None:
        """The known dotted path that an unknown `path` most likely meant, or None.

        A known name in the wrong place wins (`model.chunk_size` -> `model.memory.chunk_size`);
        otherwise each unknown part is replaced by its closest sibling (`modl.d_modle`).
        """
        name = path.rsplit(".", 1)[-1]
        for known in [*filter(None, self.prefix.values()), *self.leaves]:
            if known.rsplit(".", 1)[-1] == name:
                return known
        cls: Any = self.root
        fixed = []
        for part in path.split("."):
            keys = _keys(cls) if cls is not None else []
            close = [part] if part in keys else difflib.get_close_matches(part, keys, n=1,
                                                                          cutoff=0.6)
            if not close:
                return None
            fixed.append(close[0])
            tp = _hints(cls)[close[0]]
            cls = tp if dataclasses.is_dataclass(tp) else None
        return ".".join(fixed)

    def _unknown_key(self, path: str, fallback_hint: str) -> SpecError:
        guess = self.suggest(path)
        hint = f"did you mean {guess!r}?" if guess else fallback_hint
        return SpecError(f"unknown key {_short(repr(path))}; {hint}")

    def build(self, cls: type, raw: Mapping[str, Any] | None) -> Any:
        """Construct `cls` from a mapping: structure checks here, field checks in
        __post_init__."""
        prefix = self.prefix[cls]
        raw = {} if raw is None else raw  # an empty section (`train:` alone) means all defaults
        known = _keys(cls)
        for key in raw:
            if key not in known:
                where = f" in {prefix}" if prefix else ""
                raise self._unknown_key(_join(prefix, str(key)),
                                        f"known keys{where}: {', '.join(known)}")
        for f in fields(cls):
            required = f.default is MISSING and f.default_factory is MISSING
            if required and f.name not in raw:
                raise SpecError(f"{_join(prefix, f.name)}: required field is missing")
        hints = _hints(cls)
        kwargs = {k: self._check_type(v, hints[k], _join(prefix, k))  # sections first;
                  if dataclasses.is_dataclass(hints[k]) else v      # leaves in cls()
                  for k, v in raw.items()}
        return cls(**kwargs)

    def to_dict(self, obj: Any) -> dict[str, Any]:
        """A spec dataclass as plain YAML/JSON data (tuples as lists, no field that is not in
        the file); `build` reads it back."""

        def convert(value: Any) -> Any:
            if dataclasses.is_dataclass(value):
                return {name: convert(getattr(value, name)) for name in _keys(type(value))}
            if isinstance(value, tuple):
                return [convert(v) for v in value]
            return value

        return convert(obj)

    # -- overrides

    def apply_override(self, raw: dict[str, Any], key: Any, value: Any) -> None:
        """Set the dotted path `key` of the raw mapping `raw` to `value` (copied)."""
        if key in self.prefix.values():
            example = next(p for p in self.leaves if p.startswith(f"{key}."))
            raise SpecError(f"{key}: is a section; override one of its fields, e.g. {example}")
        if not isinstance(key, str) or key not in self.leaves:
            raise self._unknown_key(
                str(key), "overrides name a field by its dotted path, e.g. model.d_model")
        *sections, leaf = key.split(".")
        node, path = raw, ""
        for name in sections:
            path = _join(path, name)
            if node.get(name) is None:
                node[name] = {}
            if not isinstance(node[name], dict):
                raise _type_error(path, "a mapping", node[name])
            node[name] = dict(node[name])  # the section may be a YAML alias shared with another
            node = node[name]
        node[leaf] = plain(value)

    def parse_set_args(self, items: Iterable[str]) -> dict[str, Any]:
        """Parse CLI `--set KEY=VALUE` strings into an overrides mapping.

        A value is read as YAML (`128` -> int, `[0.9,0.99]` -> list, `null` -> None), except
        for string fields, which take the text verbatim (`--set name=2024` stays a string).
        Later items win over earlier ones.
        """
        out: dict[str, Any] = {}
        for item in items:
            key, sep, text = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise SpecError(f"--set {_short(repr(item))}: expected KEY=VALUE, e.g. "
                                f"--set model.d_model=128")
            if self.leaves.get(key) is str:
                out[key] = text
                continue
            try:
                out[key] = _load_yaml(text)
            except yaml.YAMLError as exc:
                raise SpecError(
                    f"--set {key}: value {_short(repr(text))} is not valid YAML: "
                    f"{_yaml_problem(exc)[1]}"
                ) from None
        return out


# ----------------------------------------------------------------------------------- YAML


MAX_YAML_DEPTH = 64   # a spec nests 4 levels; deeper input is refused before it is parsed further


class _Loader(yaml.SafeLoader):
    """safe_load, plus YAML 1.2 floats without a dot (`3e-3`), an error on duplicate keys, and
    one on nesting past MAX_YAML_DEPTH. The depth cap makes deep input (`[[[[...`) fail fast
    and alike whatever Python's recursion limit is: the pure-Python composer recurses per
    level, and under a raised limit (hypothesis raises it while a test runs) 3,000 levels
    took seconds per parse instead of failing."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        depth = getattr(self, "_depth", 0)
        if depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nesting deeper than {MAX_YAML_DEPTH} levels",
                self.peek_event().start_mark)
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {_brepr(key)}", key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_problem(exc: yaml.YAMLError) -> tuple[str, str]:
    """(' line:col', problem) of a YAML error, for a one-line message."""
    mark = getattr(exc, "problem_mark", None)
    where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc)
    return where, " ".join(str(problem).split())


MAX_SPEC_BYTES = 1 << 20  # a spec is a page of YAML; anything near this is not one


def _load_yaml(text: str) -> Any:
    """yaml.load with our loader; every failure (including ints past Python's digit limit and
    nesting past the recursion limit) is a yaml.YAMLError."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except (ValueError, RecursionError) as exc:
        raise yaml.YAMLError(" ".join(str(exc).split()) or type(exc).__name__) from None


def read_yaml(path: str) -> dict[str, Any]:
    try:
        st = os.stat(path)  # before open(): opening a FIFO for reading blocks
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"{path}: not a regular file (a device, FIFO or socket); "
                            f"pass a YAML spec file")
        if st.st_size > MAX_SPEC_BYTES:
            raise SpecError(f"{path}: {st.st_size} bytes is too large for a spec (at most "
                            f"{MAX_SPEC_BYTES}); pass a YAML spec file")
        with open(path, "rb") as fh:
            data = fh.read(MAX_SPEC_BYTES + 1)
        if len(data) > MAX_SPEC_BYTES:
            raise SpecError(f"{path}: too large for a spec (over {MAX_SPEC_BYTES} bytes)")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a directory, not a spec file") from None
    except PermissionError:
        raise SpecError(f"{path}: permission denied; cannot read the spec file") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise SpecError(f"{path}: cannot read the spec file: {reason}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not a text file (invalid UTF-8 at byte {exc.start})") from None
    empty = (f"{path}: file is empty; a spec is a YAML mapping with at least name and model "
             f"(see examples/tiny.yaml)")
    if not text.strip():
        raise SpecError(empty)
    try:
        doc = _load_yaml(text)
    except yaml.YAMLError as exc:
        where, problem = _yaml_problem(exc)
        raise SpecError(f"{path}{where}: not valid YAML: {problem}") from None
    if doc is None:
        raise SpecError(empty)
    if not isinstance(doc, dict):
        raise SpecError(
            f"{path}: the top level must be a mapping (name: ..., model: ...), "
            f"got {_describe(doc)}")
    return doc


def plain(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """A deep copy of nested mappings/lists as dicts/lists, safe to edit. Shared sub-values
    (YAML aliases) stay shared, so an alias bomb is copied in time linear in its text."""
    if not isinstance(value, (Mapping, list, tuple)):
        return value
    memo = {} if memo is None else memo
    if id(value) not in memo:
        # the copy is in the memo before its items are copied: a value that contains itself
        # (`--set 'model.d_model=&a [*a]'`) is copied as such, not recursed into forever
        if isinstance(value, Mapping):
            out: Any = memo.setdefault(id(value), {})
            out.update((k, plain(v, memo)) for k, v in value.items())
        else:
            out = memo.setdefault(id(value), [])
            out.extend(plain(v, memo) for v in value)
    return memo[id(value)]
