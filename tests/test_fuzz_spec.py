"""Property-based fuzzing of `titanc compile` over spec documents and `--set` values (issue 17).

Any input ends in either a successful compile (exit 0, report.json written) or exit 2 with a
single `titanc: error: ...` line on stderr: never a traceback, never a hang. Documents start
from a tiny valid spec and take up to three mutations (a field set to a legal value, to junk
of any YAML type, or deleted; an unknown key added), or carry hostile YAML text in one field
(an alias bomb, a 5000-digit int, deep nesting, tags, 10^12-sized dimensions), or are replaced
by arbitrary text; up to two `--set` items follow, with the same kinds of values. The examples are derandomized, so CI sees the same cases each run.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from titanc.tools.cli import main  # noqa: E402
from titanc.model.spec import leaf_paths  # noqa: E402

BASE: dict[str, Any] = {
    "name": "fuzz",
    "model": {"vocab_size": 32, "d_model": 8, "n_layers": 1, "block": "attn", "seq_len": 8,
              "ffn_hidden": 8,
              "attention": {"heads": 2, "window": 4, "segment": 4, "persistent_tokens": 1},
              "memory": {"heads": 2, "depth": 1, "expansion": 1, "chunk_size": 4}},
    "train": {"batch_size": 1},
}
PATHS = sorted(leaf_paths())
LEGAL = {int: [0, 1, 2, 4, 8], float: [0.0, 0.5, 1e-3, 0.99], bool: [True, False],
         str: ["attn", "cpu", "byte", "none", "float64", "synthetic:recall", "x\x1b[0m"]}

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False)
           | st.text(max_size=12))   # no subnormals: a torch flush-denormal mode may be on
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
legal = st.sampled_from([v for vs in LEGAL.values() for v in vs])
values = st.one_of(legal, legal, junk)
paths = st.sampled_from(PATHS) | st.text(alphabet="abcdemnotrl._", min_size=1, max_size=16)
BOMB = "[" + ", ".join(["&a [1,1,1,1,1,1,1,1,1]"] + [
    f"&{c} [" + ",".join([f"*{p}"] * 9) + "]" for p, c in zip("abcdefgh", "bcdefghi")]) + "]"
# YAML text that has broken the validator before: an alias bomb, an int past Python's digit
# limit, nesting past the recursion limit, tags, sizes that cannot fit any machine
hostile = st.one_of(
    st.just(BOMB), st.integers(4301, 6000).map(lambda n: "7" * n),
    st.integers(300, 3000).map(lambda n: "[" * n + "]" * n),
    st.sampled_from(["!!binary aGk=", "!!set {a, b}", "2024-01-01", "!!python/tuple [1]", "~",
                     "1e39", ".nan", "-.inf", "0x10", "1_000", "'\x1b[2J'", "&x [*x]",
                     "1000000000000", "2199023255552", "{a: 1, a: 2}", "[1, 2, 3]"]))


@st.composite
def documents(draw: st.DrawFn) -> str:
    kind = draw(st.integers(0, 9))
    if kind == 0:                                      # arbitrary text for the YAML parser
        return draw(st.text(max_size=80))
    doc = json.loads(json.dumps(BASE))
    if kind == 1:                                      # hostile YAML text as one field's value
        section, _, rest = draw(st.sampled_from(PATHS)).partition(".")
        head = {k: v for k, v in doc.items() if k != section}
        body = draw(hostile)
        for name in reversed(rest.split(".") if rest else []):
            body = f"{{{name}: {body}}}"
        return yaml.safe_dump(head) + f"{section}: {body}\n"
    for _ in range(draw(st.integers(0, 3))):
        *sections, leaf = draw(paths).split(".")
        node: Any = doc
        for name in sections:
            if not isinstance(node, dict):
                break
            node = node.setdefault(name, {})
        if isinstance(node, dict):
            if draw(st.booleans()) and leaf in node:
                del node[leaf]
            else:
                node[leaf] = draw(values)
    return yaml.safe_dump(doc, allow_unicode=False)


@st.composite
def set_items(draw: st.DrawFn) -> list[str]:
    items = []
    for _ in range(draw(st.integers(0, 2))):
        value = draw(st.one_of(st.text(max_size=20), hostile,
                               values.map(lambda v: yaml.safe_dump(v, default_flow_style=True)
                                          .strip().removesuffix("...").strip())))
        items.append(f"--set={draw(paths)}={value}")
    return items


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(doc=documents(), sets=set_items())
def test_compile_either_succeeds_or_fails_with_one_line(doc: str, sets: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.yaml"
        spec.write_text(doc, encoding="utf-8", errors="surrogateescape")
        out, err = io.StringIO(), io.StringIO()
        # CPU seconds: "no hang" is the work a case costs, which a loaded CI machine's wall
        # clock stretches (two workers and the pure-Python YAML parser took a failing case past
        # 10 wall-seconds in a fresh-clone run, and hypothesis then spent minutes shrinking it)
        t0 = time.process_time()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["compile", str(spec), "-o", str(Path(tmp) / "build"), *sets])
        seconds = time.process_time() - t0
        text = err.getvalue()
        event(f"exit {code}")
        assert "Traceback" not in text, text
        if code == 0:
            assert (Path(tmp) / "build" / "report.json").exists()
            assert seconds < 60
            return
        assert code == 2, (code, text)
        lines = text.splitlines()
        assert lines[-1].startswith(("titanc: error: ", "titanc compile: error: ")), text
        if lines[-1].startswith("titanc: error: "):
            assert len(lines) == 1, text
        assert seconds < 10, (seconds, text)
