"""The README and the docs run as written.

Every command block of README.md (fenced ```sh, ```bash or ```python) runs, in order, in one
bash process in a temporary directory that links the repository's `examples/`, `docs/` and
`.venv/` (so `source .venv/bin/activate` works as the README says). Outputs (build/, runs/,
data/, tok.json) land in the temporary directory, never in the checkout. The first command
block of each docs/*.md page runs the same way, each page in its own directory, with `.venv`
active (the pages assume the README's setup).

Step counts come from one variable the README documents: `STEPS` (the README's
`N=${STEPS:-500}`, data.md's `${STEPS:-100}`), set to 4 here. Nothing rewrites a command.

A block that cannot run here says so on the line before it, with the reason:
    <!-- readme-test: skip (a server runs until it is stopped) -->
and a block too slow for `make test` (each titanc process costs 5-10 CPU-s here) runs only in
the slow tier (`make test-all`), also with its reason:
    <!-- readme-test: slow (three processes: two ranks and their launcher) -->
The default tier runs the rest, in order: compile, inspect, train, generate, the corpus path
(tokenizer, shards, train, evaluate) and the Python API. The slow tier runs every block that
is not skipped, and the first command block of each docs page.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LANGS = {"sh": "sh", "bash": "sh", "python": "python"}
MARK = re.compile(r"<!--\s*readme-test:\s*(skip|slow)\b(.*?)-->")
STEPS = "4"
LINKED = ("examples", "docs", "benchmarks")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int                 # of the opening fence, 1-based
    lang: str                 # "sh" or "python"
    text: str
    skip: str | None          # the stated reason, when marked skip
    slow: str | None = None   # the stated reason, when marked slow


def command_blocks(path: Path) -> list[Block]:
    """The fenced sh/bash/python blocks of a Markdown file, each with its skip or slow reason
    (from a `readme-test: skip (REASON)` or `slow (REASON)` comment on the line before its
    fence)."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        lang = LANGS.get(m.group(1))
        if lang is not None:
            prev = lines[i - 1] if i else ""
            mark = MARK.search(prev)
            reason = mark.group(2).strip(" ()") if mark else None
            assert mark is None or reason, f"{path.name}:{i}: a {mark.group(1)} needs its reason"
            kind = mark.group(1) if mark else None
            out.append(Block(path, i + 1, lang, "\n".join(lines[i + 1:j]),
                             reason if kind == "skip" else None,
                             reason if kind == "slow" else None))
        i = j + 1
    return out


def script(blocks: list[Block], activate: bool = False) -> str:
    """One bash script running `blocks` in order; each announces itself on stderr. With
    `activate`, `.venv` is activated first (the docs pages assume it, as the README says)."""
    parts = ["set -eo pipefail"] + (["source .venv/bin/activate"] if activate else [])
    for b in blocks:
        parts.append(f"echo '>>> {b.path.name}:{b.line}' >&2")
        if b.lang == "python":
            parts.append(f"python - <<'README_PYTHON'\n{b.text}\nREADME_PYTHON")
        else:
            parts.append(b.text)
    return "\n".join(parts) + "\n"


def workdir(tmp: Path) -> Path:
    """A temporary directory that looks like the repository root for the commands."""
    tmp.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        (tmp / name).symlink_to(ROOT / name)
    venv = ROOT / ".venv"
    if (venv / "bin" / "activate").exists() and (venv / "bin" / "titanc").exists():
        (tmp / ".venv").symlink_to(venv)
    else:                    # another environment runs the tests: activate means this one
        bin_dir = tmp / ".venv" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "activate").write_text(
            f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    return tmp


def run_blocks(blocks: list[Block], cwd: Path, timeout: float = 900,
               activate: bool = False) -> tuple[int, str]:
    """Run the blocks; (exit status, the last lines of the output and the failing block)."""
    env = dict(os.environ, STEPS=STEPS, TITANC_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(["bash", "-c", script(blocks, activate)], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    where = [ln for ln in proc.stderr.splitlines() if ln.startswith(">>> ")]
    tail = "\n".join(out.splitlines()[-25:])
    return proc.returncode, f"block {where[-1][4:] if where else '?'} failed:\n{tail}"


def runnable(blocks: list[Block], slow: bool = False) -> list[Block]:
    """The blocks to run: not skipped, and not slow unless `slow`."""
    return [b for b in blocks if b.skip is None and (slow or b.slow is None)]


# ---------------------------------------------------------------------------------- structure


def test_every_readme_block_runs_or_says_why_not() -> None:
    blocks = command_blocks(README)
    assert len(runnable(blocks)) >= 3 and len(runnable(blocks, slow=True)) >= 5
    for b in blocks:
        if b.skip is None:
            assert "make test" not in b.text, f"README.md:{b.line} would run the suite itself"
    # the install and the first-day path are spelled out
    text = README.read_text()
    for phrase in ("source .venv/bin/activate", "download.pytorch.org/whl/cpu", "--resume",
                   "--reschedule", "--until", "titanc data prepare", "titanc eval", "STEPS"):
        assert phrase in text, phrase


def test_a_broken_command_fails_and_names_its_block(tmp_path: Path) -> None:
    md = tmp_path / "page.md"
    md.write_text("text\n\n```sh\necho fine\n```\n\n<!-- readme-test: skip (never) -->\n"
                  "```sh\nexit 3\n```\n\n```sh\ntitanc no-such-command\n```\n")
    blocks = command_blocks(md)
    assert [b.skip for b in blocks] == [None, "never", None]
    code, why = run_blocks(runnable(blocks), workdir(tmp_path / "w"))
    assert code != 0 and "block page.md:12 failed" in why


# ---------------------------------------------------------------------------------- the runs


def test_the_readme_runs_as_written(tmp_path: Path) -> None:
    """The README's default-tier blocks in order: compile, inspect, train, generate;
    tokenizer, shards, train (its tokenizer from the shards), eval; the Python API."""
    cwd = workdir(tmp_path / "readme")
    code, why = run_blocks(runnable(command_blocks(README)), cwd)
    assert code == 0, why
    from titanc.runtime.train.checkpoint import load_checkpoint

    assert (cwd / "build/tiny/report.json").exists()
    assert load_checkpoint(cwd / "runs/notes/checkpoint.safetensors")[1]["step"] == int(STEPS)
    corpus = load_checkpoint(cwd / "runs/corpus/checkpoint.safetensors")[1]["spec"]
    assert corpus["model"]["vocab_size"] == 4096 and corpus["data"]["tokenizer"] == "tok.json"
    assert not (ROOT / "notes.txt").exists()          # nothing written into the checkout


@pytest.mark.slow
def test_every_readme_block_runs_as_written(tmp_path: Path) -> None:
    """Every block that is not skipped, the slow ones too: stop with --until and resume, a
    larger --steps on the checkpoint's schedule, bench, two ranks."""
    cwd = workdir(tmp_path / "readme")
    code, why = run_blocks(runnable(command_blocks(README), slow=True), cwd)
    assert code == 0, why
    from titanc.runtime.train.checkpoint import load_checkpoint

    n = int(STEPS)
    assert load_checkpoint(cwd / "runs/half/checkpoint.safetensors")[1]["step"] == n
    meta = load_checkpoint(cwd / "runs/notes/checkpoint.safetensors")[1]
    assert meta["step"] == 2 * n and meta["spec"]["train"]["steps"] == n   # the schedule kept
    assert (cwd / "runs/ddp/checkpoint.safetensors").exists()


DOC_BLOCKS = {p.name: bs[0] for p in DOCS if (bs := command_blocks(p))}


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(DOC_BLOCKS))
def test_the_first_block_of_each_doc_runs(page: str, tmp_path: Path) -> None:
    block = DOC_BLOCKS[page]
    if block.skip is not None:
        pytest.skip(f"docs/{page}:{block.line}: {block.skip}")
    cwd = workdir(tmp_path / "doc")
    code, why = run_blocks([block], cwd, activate=True)
    assert code == 0, why
