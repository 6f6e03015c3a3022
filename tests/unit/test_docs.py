"""The documents hold together: every relative link in README.md and docs/ names a file that
exists (and a heading that exists, for `#anchor` links), and the README stays a page a
newcomer reads in one sitting."""
from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(doc: Path) -> None:
    bad = []
    for link in _links(doc):
        if re.match(r"^[a-z]+:", link):          # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        dest = (doc.parent / target).resolve() if target else doc
        if not dest.exists():
            bad.append(f"{link}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{link}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert bad == [], f"{doc.relative_to(ROOT)}: " + "; ".join(bad)


def test_a_broken_link_is_seen(tmp_path: Path) -> None:
    """The check above can fail: a link to a missing file and to a missing heading."""
    (tmp_path / "a.md").write_text("# Title\n[x](b.md) [y](#nope) [z](#title)\n")
    assert _links(tmp_path / "a.md") == ["b.md", "#nope", "#title"]
    assert not (tmp_path / "b.md").exists()
    assert "nope" not in _anchors(tmp_path / "a.md") and "title" in _anchors(tmp_path / "a.md")


def test_the_readme_fits_on_a_screen_or_two() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


# ---------------------------------------------------------------- references to the code
# A doc (README.md, docs/*.md) or a docstring or comment of the product packages and
# benchmarks/ that cites code names something that exists. Cited in backticks:
# - a dotted name under a package root, `titanc.runtime.program.Program` or
#   `runtime.targets.aot` (`titanc.X` and `X` are the same package for ir, passes, codegen and
#   runtime): its module file exists and defines the first name after it; every further
#   name (a method, an attribute) is defined somewhere in the product;
# - a path, `runtime/program.py`, `tests/test_x.py::test_y`, `scan/kernel.py` (a path under a
#   package, found by its tail), optionally followed by a name in backticks
#   (`runtime/program.py` `Program`): the file exists and defines the name;
# - `Class.attribute` of a class of ours (CamelCase): the class and the attribute exist.
# "Defines" is read from the syntax tree: a def, a class, an assignment, an import, a field.

PRODUCT = ("titanc", "ir", "passes", "codegen", "runtime")
TOP = {*PRODUCT, "tests", "benchmarks", "docs", "examples"}
# names a walkthrough asks the reader to create
EXAMPLES = {"ir/tril.py", "codegen/templates/foo.py.jinja", "Value.softplus()",
            "codegen/templates/memory_state.py.jinja", "codegen/lower/memory.py"}
# classes of other libraries cited as Class.method
EXTERNAL = {"JITFunction", "InterpretedFunction"}
SPAN = re.compile(r"`([^`\n]+)`(?:\s+`([A-Za-z_]\w*(?:\.\w+)*)`)?")
DOTTED = re.compile(r"^(?:titanc|ir|passes|codegen|runtime)(?:\.[A-Za-z_]\w*)+(?:\(\))?$")
CLASS_ATTR = re.compile(r"^_?[A-Z][a-z]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?$")
PATH = re.compile(r"^((?:[\w.-]+/)+[\w.-]+\.(?:py|jinja|sh|yaml|md))(?:::(\w+)(?:::(\w+))?)?$")


def _sources() -> list[Path]:
    return [*(p for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))),
            *sorted((ROOT / "benchmarks").glob("*.py"))]


# what a line of Python defines: a def or class, an assignment or annotation (a field, a
# constant, `self.x = ...`, a tuple's names), a loop target, an import (read without parsing:
# parsing every module took seconds)
DEFINES = re.compile(
    r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+(\w+)"
    r"|^[ \t]*((?:self\.)?\w+(?:[ \t]*,[ \t]*\*?\w+)*)[ \t]*(?::[^=\n]*)?=(?!=)"
    r"|^[ \t]*(\w+)[ \t]*:"
    r"|\bself\.(\w+)[ \t]*(?::[^=\n]*)?=(?!=)"
    r"|^[ \t]*for[ \t]+([\w, ]+?)[ \t]+in\b"
    r"|^[ \t]*(?:from[ \t]+\S+[ \t]+)?import[ \t]+(\([^)]*\)|.+)", re.M)


@functools.lru_cache(maxsize=None)
def _defined(path: Path) -> frozenset[str]:
    """Every name `path` defines (DEFINES)."""
    names: set[str] = set()
    for m in DEFINES.finditer(path.read_text()):
        text = next(g for g in m.groups() if g is not None)
        if m.group(6) is not None:                       # an import: its names, `as` names
            text = re.sub(r"\b\w+[ \t]+as[ \t]+", "", re.sub(r"#.*", "", text))
        names.update(w.split(".")[0] for w in re.findall(r"[A-Za-z_][\w.]*", text)
                     if w not in ("self", "as"))
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def _defined_anywhere() -> frozenset[str]:
    return frozenset().union(*map(_defined, _sources()))


@functools.lru_cache(maxsize=None)
def _classes() -> frozenset[str]:
    return frozenset(m for p in _sources()
                     for m in re.findall(r"^[ \t]*class[ \t]+(\w+)", p.read_text(), re.M))


@functools.lru_cache(maxsize=None)
def _files() -> tuple[str, ...]:
    return tuple(p.relative_to(ROOT).as_posix() for d in (*PRODUCT, "benchmarks", "tests")
                 for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _module(parts: list[str]) -> tuple[Path | None, list[str]]:
    """The file of the longest module prefix of `parts`, and the names after it."""
    if parts[0] == "titanc" and len(parts) > 1 and parts[1] in PRODUCT[1:]:
        parts = parts[1:]
    path, i = ROOT / parts[0], 1
    while i < len(parts) and (path / parts[i]).is_dir():
        path, i = path / parts[i], i + 1
    if i < len(parts) and (path / f"{parts[i]}.py").is_file():
        return path / f"{parts[i]}.py", parts[i + 1:]
    init = path / "__init__.py"
    return (init if init.is_file() else None), parts[i:]


def _path(cited: str) -> Path | None | bool:
    """The file a cited path names; None if it names none; False if it is not a path into
    the repository (an output such as `out_dir/program.py`)."""
    head = cited.split("/")[0]
    if head in TOP:
        return ROOT / cited if (ROOT / cited).exists() else None
    if not any(f"/{head}/" in f"/{f}" for f in _files()):
        return False
    hits = [f for f in _files() if f.endswith("/" + cited)]
    return ROOT / hits[0] if hits else None


def _check(span: str, name: str | None) -> str | None:
    """Why the cited `span` (and the `name` cited right after it) resolves to nothing."""
    if span in EXAMPLES:
        return None
    if DOTTED.match(span):
        file, rest = _module(span.removesuffix("()").split("."))
        if file is None:
            return "no such module"
        if rest and rest[0] not in _defined(file):
            return f"{file.relative_to(ROOT)} defines no {rest[0]}"
        missing = [a for a in rest[1:] if a not in _defined_anywhere()]
        return f"nothing defines {missing[0]}" if missing else None
    if m := PATH.match(span):
        file = _path(m.group(1))
        if file is None:
            return "no such file"
        if file is False or file.suffix != ".py":
            return None
        for n in filter(None, (m.group(2), m.group(3), name)):
            if n.split(".")[0] not in _defined(file):
                return f"{m.group(1)} defines no {n.split('.')[0]}"
        return None
    if CLASS_ATTR.match(span):
        cls, *attrs = span.removesuffix("()").split(".")
        if cls in EXTERNAL:
            return None
        if cls not in _classes():
            return f"no class {cls}"
        missing = [a for a in attrs if a not in _defined_anywhere()]
        return f"nothing defines {missing[0]}" if missing else None
    return None


def stale_references(text: str) -> list[str]:
    """Every cited name of `text` that resolves to nothing, with the reason."""
    bad = []
    for m in SPAN.finditer(text):
        why = _check(m.group(1).strip(), m.group(2))
        if why:
            bad.append(f"`{m.group(1)}`: {why}")
    return bad


TRIPLE = re.compile(r'"""(.*?)"""|\'\'\'(.*?)\'\'\'', re.S)


def _prose(path: Path) -> str:
    """The docstrings (triple-quoted strings) and comments of a Python file."""
    text = path.read_text()
    strings = [a or b for a, b in TRIPLE.findall(text)]
    return "\n".join([*strings, *re.findall(r"#[^\n]*", TRIPLE.sub("", text))])


def test_every_name_a_doc_cites_exists() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [f"{doc.relative_to(ROOT)}: {b}" for doc in docs
           for b in stale_references(FENCE.sub("", doc.read_text()))]
    assert bad == [], ("stale references (a walkthrough's new file goes in EXAMPLES):\n"
                       + "\n".join(bad))


def test_every_name_a_docstring_or_comment_cites_exists() -> None:
    bad = [f"{p.relative_to(ROOT)}: {b}" for p in _sources() for b in stale_references(_prose(p))]
    assert bad == [], "stale references:\n" + "\n".join(bad)


def test_the_reference_check_catches_stale_names() -> None:
    """Each kind of stale reference the check exists for, as they were found in the tree."""
    stale = ["`_Analysis.pax_of`", "`runtime.tokenizer.load_tokenizer`",
             "`runtime.triton_executor.count_launches`", "`codegen.scan.KERNEL_ROLES`",
             "`passes/memory_plan.py`", "`ir/shapes.py` `infer_type`",
             "`tests/test_hardening.py`", "`tests/test_bench.py::test_no_such_test`"]
    for cited in stale:
        assert stale_references(cited), cited
    fine = ["`titanc.runtime.program.Program`", "`runtime/program.py` `Program`",
            "`codegen.scan.kernel.KERNEL_ROLES`", "`scan/kernel.py`", "`Program.advance`",
            "`ir/infer.py` `infer_type`", "`titanc.tools.aot`", "`out_dir/program.py`",
            "`tests/test_bench.py::test_mfu_counts_the_models_flops_not_the_recompute`"]
    assert [c for c in fine if stale_references(c)] == []
