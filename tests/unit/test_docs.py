"""The documents hold together: every relative link in README.md and docs/ names a file that
exists (and a heading that exists, for `#anchor` links), and the README stays a page a
newcomer reads in one sitting."""
from __future__ import annotations

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
