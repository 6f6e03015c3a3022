"""Hypothesis over the command line: every command with random flags and values (huge
integers, nan, negative numbers, text with invalid Unicode) and paths of the wrong kind (a
device, a directory, an empty file, a file that is not UTF-8, a missing path). Each run ends
with exit 0 or 2 and, on 2, exactly one error line, never a traceback, within a bounded time
(an alarm fails an example that hangs).

The positional paths are never a usable input, so no example trains, serves or writes an
artifact: the point is that every refusal is clean, whatever the flags."""
from __future__ import annotations

import contextlib
import io
import signal
from pathlib import Path
from typing import Any

import pytest

from titanc.tools.cli import main

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLE_S = 60                   # an example that runs longer is a hang

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("fuzz_cli")
    (d / "empty.txt").write_text("")
    (d / "latin1.txt").write_bytes(b"caf\xe9\n")
    (d / "emptydir").mkdir()
    (d / "spec.yaml").write_text("model: [1, 2\n")
    return {"missing": str(d / "missing"), "devzero": "/dev/zero", "devnull": "/dev/null",
            "dir": str(d / "emptydir"), "empty": str(d / "empty.txt"),
            "latin1": str(d / "latin1.txt"), "badspec": str(d / "spec.yaml"),
            "surrogate": str(d / "bad\udcff.txt")}


TEXT = st.text(st.characters(exclude_categories=()), max_size=12)   # lone surrogates too
NUMBER = st.one_of(
    st.integers(), st.sampled_from([0, -1, 2**31, 2**63, 2**64, 10**30, 10**5000]),
    st.floats(allow_nan=True, allow_infinity=True),
).map(lambda v: str(v) if not isinstance(v, int) or abs(v) < 10**4000 else "9" * 5000)
VALUE = st.one_of(NUMBER, TEXT, st.sampled_from(["nan", "-inf", "1e308", "", "0x10", "８"]))

# command -> (positional path slots, flags that take a value, switches)
COMMANDS: dict[tuple[str, ...], tuple[int, list[str], list[str]]] = {
    ("compile",): (1, ["-o", "--set"], ["--force"]),
    ("train",): (1, ["--out", "--steps", "--until", "--nproc", "--threads", "--data", "--set",
                     "--resume"], ["--strict", "--profile"]),
    ("generate",): (1, ["--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
                        "--seed", "--stop"], ["--stream"]),
    ("serve",): (1, ["--port", "--slots", "--max-queue", "--max-prompt-tokens", "--max-tokens",
                     "--max-body-bytes", "--grace", "--threads"], []),   # --host: DNS
    ("inspect",): (1, ["--kernel", "--pass", "--limit"], ["--graph", "--memory"]),
    ("bench",): (1, ["--steps", "--warmup", "--threads", "--set"], ["--json"]),
    ("tokenizer", "train"): (2, ["--vocab-size", "-o", "--min-frequency", "--ext",
                                 "--text-field"], []),
    ("data", "prepare"): (2, ["-o", "--tokenizer", "--val-fraction", "--workers", "--ext"],
                          ["--overwrite", "--no-progress"]),
    ("eval",): (1, ["--data", "--batches", "--split", "--task", "--distances",
                    "--recall-layout"], ["--recall"]),
}


@st.composite
def argv(draw: Any, paths: dict[str, str]) -> list[str]:
    command = draw(st.sampled_from(sorted(COMMANDS)))
    n_paths, flags, switches = COMMANDS[command]
    path = st.sampled_from(sorted(paths.values()))
    out = [*command, *(draw(path) for _ in range(draw(st.integers(1, n_paths))))]
    for flag in draw(st.lists(st.sampled_from(flags), max_size=4)):
        out += [flag, draw(st.one_of(VALUE, path))]
    out += draw(st.lists(st.sampled_from(switches or ["--help"]), max_size=1, unique=True))
    return out


def _alarm(*_: Any) -> None:
    raise AssertionError(f"an example ran longer than {EXAMPLE_S} s")


def check_one_line_or_success(args: list[str]) -> int:
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(EXAMPLE_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    text = err.getvalue()
    assert "Traceback" not in text, text
    assert code in (0, 2), (args, code, text)
    if code == 2:
        lines = [x for x in text.splitlines() if x.strip() and not x.startswith(" ")]
        errors = [x for x in lines if "error:" in x]
        assert len(errors) == 1 and lines[-1] == errors[0], text
        assert len(errors[0]) < 2000, errors[0][:200]      # a bounded message
    return code


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_command_refuses_bad_arguments_in_one_line(data: Any, paths: dict[str, str]) -> None:
    event(f"exit {check_one_line_or_success(data.draw(argv(paths)))}")


@pytest.mark.parametrize("kind", ["devzero", "devnull", "dir", "empty", "latin1", "missing",
                                  "surrogate"])
def test_a_path_of_the_wrong_kind_is_one_line_for_every_command(kind: str,
                                                                paths: dict[str, str]) -> None:
    p = paths[kind]
    for args in (["compile", p], ["train", p, "--out", paths["missing"]], ["generate", p,
                 "--prompt", "x"], ["serve", p, "--port", "0"], ["inspect", p],
                 ["bench", p], ["tokenizer", "train", p, "--vocab-size", "300", "-o", p],
                 ["data", "prepare", p, "-o", p], ["eval", p, "--data", p],
                 ["eval", p, "--task", "recall"]):
        check_one_line_or_success(args)
