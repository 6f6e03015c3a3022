"""The command line under bad input: spec validation, compile and the data tools' outputs.

Each test reproduces one bug a user could hit: a traceback or a hang where one line and exit
2 were due, or files lost (a compile or a tokenizer written over someone's files, an output
directory swapped out from under the shell)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from titanc.errors import SpecError
from titanc.model.spec import load_spec
from titanc.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
LMM = ROOT / "examples" / "tiny_lmm.yaml"
SMALL = ["--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "model.seq_len=16",
         "--set", "model.memory.chunk_size=4"]


def one_error_line(err: str) -> str:
    """stderr is one `titanc: error: ...` line (after notes at most), no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("titanc: error: "), err
    assert sum("error:" in line for line in lines) == 1, err
    return lines[-1]


def cli(args: list[Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main([str(a) for a in args])
    _, err = capsys.readouterr()
    return code, (one_error_line(err) if code else err)


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def beside(d: Path) -> list[str]:
    """Staging or set-aside directories a run left next to `d`."""
    return [p.name for p in d.parent.iterdir() if p.name.startswith(f".{d.name}.")]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- --set ------------------------------------------------------------------------------------


def test_set_value_that_contains_itself_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A YAML anchor inside its own value (`&a [*a]`) made _plain recurse until a
    RecursionError traceback."""
    code, err = cli(["compile", LMM, "--set", "model.d_model=&a [*a]"], capsys)
    assert code == 2
    assert err.startswith("titanc: error: model.d_model: expected an integer, got the list")
    code, err = cli(["compile", LMM, "--set", "train.betas=&a [1, *a]"], capsys)
    assert code == 2 and err.startswith("titanc: error: train.betas[1]: expected a number")
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(SpecError, match="^model.d_model: expected an integer"):
        load_spec({"name": "x", "model": {"d_model": loop, "n_layers": 1, "block": "lmm",
                                          "seq_len": 16}})


def test_a_seq_len_past_the_token_bound_is_refused_at_once() -> None:
    """model.seq_len 2**40 passed validation and the memory check (which counts no
    activations), then the compile's chunk split looped over 2**36 chunks: a hang."""
    r = subprocess.run([sys.executable, "-m", "titanc", "compile", str(LMM), "-o", "unused",
                        "--set", f"model.seq_len={2 ** 40}"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2
    assert one_error_line(r.stderr) == ("titanc: error: model.seq_len: 1099511627776 must be "
                                        "at most 1048576")


# -- titanc compile -o DIR ---------------------------------------------------------------------


def test_compile_into_a_directory_of_other_files_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """compile deleted DIR/kernels/*.py, DIR/ir/*.txt and DIR/tokenizer.json of any -o
    directory (a source tree, a run directory) and overwrote its report.json, program.py."""
    proj = tmp_path / "proj"
    (proj / "kernels").mkdir(parents=True)
    (proj / "ir").mkdir()
    (proj / "kernels" / "mine.py").write_text("print('mine')\n")
    (proj / "ir" / "notes.txt").write_text("notes\n")
    (proj / "tokenizer.json").write_text("{}\n")
    (proj / "program.py").write_text("# my program\n")
    before = snapshot(proj)
    code, err = cli(["compile", LMM, "-o", proj, *SMALL], capsys)
    assert code == 2
    assert err.startswith(f"titanc: error: -o {proj} holds files and is not a titanc artifact")
    assert "choose a new or empty directory" in err
    assert snapshot(proj) == before and not beside(proj)


def test_a_failed_recompile_leaves_the_artifact_whole_and_keeps_other_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A recompile deleted the old ir/*.txt first and rewrote file by file: a failure (a full
    disk) left half an artifact. Now it is built beside and swapped in; files compile did
    not write (notes, inspect's graphs) move into the new artifact."""
    art = tmp_path / "art"
    assert cli(["compile", LMM, "-o", art, *SMALL], capsys)[0] == 0
    (art / "NOTES").write_text("mine\n")
    (art / "ir" / "user.md").write_text("mine\n")
    before = snapshot(art)

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))     # every larger write: EFBIG
    try:
        code, err = cli(["compile", LMM, "-o", art, *SMALL, "--set", "model.d_model=32"],
                        capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert code == 2 and err.startswith(f"titanc: error: cannot write the artifact directory "
                                        f"{art}: ") and "File too large" in err
    assert snapshot(art) == before and not beside(art)

    assert cli(["compile", LMM, "-o", art, *SMALL, "--set", "model.d_model=32"], capsys)[0] == 0
    after = snapshot(art)
    assert after["NOTES"] == b"mine\n" and after["ir/user.md"] == b"mine\n"
    assert after["report.json"] != before["report.json"] and not beside(art)


def test_a_compile_killed_inside_its_swap_is_finished_by_the_next(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = tmp_path / "art"
    assert cli(["compile", LMM, "-o", art, *SMALL], capsys)[0] == 0
    (art / "NOTES").write_text("mine\n")
    before = snapshot(art)
    art.rename(tmp_path / f".art.old-{dead_pid()}")              # killed between the renames
    assert cli(["compile", LMM, "-o", art, *SMALL], capsys)[0] == 0
    assert snapshot(art)["NOTES"] == b"mine\n" and set(snapshot(art)) == set(before)
    assert not beside(art)


def test_compile_into_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """An empty working directory is filled in place (the shell's directory stays valid); a
    full one would be renamed away from under the shell, so it is refused."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert cli(["compile", LMM, "-o", ".", *SMALL], capsys)[0] == 0
    assert os.getcwd() == str(work) and (work / "manifest.json").is_file()
    code, err = cli(["compile", LMM, "-o", ".", *SMALL], capsys)
    assert code == 2 and err.startswith("titanc: error: -o . is the current directory")
    assert os.getcwd() == str(work) and (work / "manifest.json").is_file()


# -- titanc tokenizer train -o FILE ------------------------------------------------------------


def test_tokenizer_train_never_overwrites_a_file_that_is_not_a_tokenizer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`titanc tokenizer train notes.txt -o notes.txt` replaced the corpus with the
    tokenizer's JSON."""
    corpus = tmp_path / "notes.txt"
    corpus.write_text("the old man and the sea, the old boat and the sea\n" * 50)
    text = corpus.read_bytes()
    code, err = cli(["tokenizer", "train", corpus, "--vocab-size", 300, "-o", corpus], capsys)
    assert code == 2
    assert err.startswith(f"titanc: error: -o {corpus} already exists and is not a "
                          f"tokenizer.json")
    assert corpus.read_bytes() == text
    tok = tmp_path / "tok.json"
    for _ in range(2):                                   # a tokenizer may be trained again
        code, _ = cli(["tokenizer", "train", corpus, "--vocab-size", 300, "-o", tok], capsys)
        assert code == 0


# -- titanc data prepare -o DIR ----------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("the old man and the sea\n" * 200)
    return d


def prepare(args: list[Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    return cli(["data", "prepare", *args, "--no-progress", "--workers", 1], capsys)


def test_prepare_with_an_empty_out_is_refused(corpus: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`-o ''` was the working directory: the shards went there, and the directory itself
    was renamed aside and replaced, leaving the shell in a deleted directory."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("mine\n")
    monkeypatch.chdir(work)
    code, err = prepare([corpus, "-o", ""], capsys)
    assert code == 2 and err == ("titanc: error: -o: an empty path; pass the directory for "
                                 "the shards, e.g. -o data/corpus")
    assert os.getcwd() == str(work) and sorted(os.listdir(work)) == ["mine.txt"]


def test_prepare_into_the_working_directory(corpus: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert prepare([corpus, "-o", "."], capsys)[0] == 0
    assert os.getcwd() == str(work) and (work / "header.json").is_file()
    code, err = prepare([corpus, "-o", ".", "--overwrite"], capsys)
    assert code == 2 and err.startswith("titanc: error: -o . is the current directory")
    assert os.getcwd() == str(work) and (work / "header.json").is_file()


def test_prepare_into_an_unwritable_place_names_the_fix(
        corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The staging directory's failed mkdir reached the CLI's catch-all as
    `titanc: error: /proc/.x.partial-PID: No such file or directory` (no -o, no fix)."""
    code, err = prepare([corpus, "-o", "/proc/titanc_shards"], capsys)
    assert code == 2
    assert err.startswith("titanc: error: cannot create -o /proc/titanc_shards: ")
    assert err.endswith("; choose a writable directory")


def test_a_prepare_killed_inside_its_swap_is_finished_by_the_next(
        corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A kill while the other files of -o moved into the new set left them in a staging
    directory that the next run deleted as stale. Now they wait in `.DIR.old-PID`, which the
    next run puts back (killed between the renames) or empties into DIR."""
    out = tmp_path / "shards"
    assert prepare([corpus, "-o", out], capsys)[0] == 0
    (out / "notes.txt").write_text("mine\n")
    before = snapshot(out)
    out.rename(tmp_path / f".shards.old-{dead_pid()}")             # killed between renames
    code, err = prepare([corpus, "-o", out], capsys)
    assert code == 2 and "already holds shards" in err
    assert snapshot(out) == before and not beside(out)

    aside = tmp_path / f".shards.old-{dead_pid()}"              # killed moving notes.txt
    aside.mkdir()
    (out / "notes.txt").rename(aside / "notes.txt")
    assert prepare([corpus, "-o", out, "--overwrite"], capsys)[0] == 0
    assert (out / "notes.txt").read_text() == "mine\n" and not beside(out)


# -- titanc generate --session FILE ------------------------------------------------------------


def test_generate_session_path_is_checked_before_the_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --session that cannot be saved to was found only after the turn ran (and was lost):
    '' became `could not write session file .: Device or resource busy`, a directory or a
    FIFO `session file X does not exist`. RUN does not exist here: the session is checked
    first."""
    run = tmp_path / "no_run"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "file").write_text("x")
    for session, message in [
            ("", "--session: an empty path; pass a file such as conv.safetensors"),
            (tmp_path, f"--session {tmp_path} is a directory; pass a file such as "
                       f"{tmp_path / 'conv.safetensors'}"),
            (fifo, f"--session {fifo} is not a regular file (a device, FIFO or socket)"),
            (tmp_path / "file" / "conv.st", f"--session {tmp_path / 'file' / 'conv.st'}: "
                                            f"cannot write in {tmp_path / 'file'} (Not a "
                                            f"directory)")]:
        code, err = cli(["generate", run, "--prompt", "hi", "--session", session], capsys)
        assert code == 2 and err.startswith(f"titanc: error: {message}"), err
    code, err = cli(["generate", run, "--prompt", "hi", "--session", tmp_path / "new" / "c.st"],
                    capsys)
    assert code == 2 and "no_run" in err                 # a new file in a new folder is fine


def test_a_train_seed_past_int64_is_refused_by_the_spec(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """train.seed had no upper bound: 2**64 - 1 compiled, then training died in a traceback
    (`ValueError: Overflow when unpacking long long`, the loader seeds seed + split)."""
    code, err = cli(["train", LMM, "--out", tmp_path / "run", "--steps", 1, *SMALL,
                     "--set", "train.seed=18446744073709551615"], capsys)
    assert code == 2 and err == ("titanc: error: train.seed: 18446744073709551615 must be at "
                                 "most 9223372036854775807")
    assert load_spec(LMM, {"train.seed": 2 ** 63 - 1}).train.seed == 2 ** 63 - 1


def test_nproc_ranks_get_the_threads_flag() -> None:
    """`titanc train --nproc 2 --threads 2` started its ranks without --threads, so each
    rank took the automatic count instead of the one asked for."""
    from titanc.tools.cli import _train_argv, build_parser

    args = build_parser().parse_args(["train", str(LMM), "--out", "r", "--nproc", "2",
                                      "--threads", "2", "--steps", "3"])
    argv = _train_argv(args)
    assert argv[argv.index("--threads") + 1] == "2" and "--nproc" not in argv
    assert "--threads" not in _train_argv(build_parser().parse_args(
        ["train", str(LMM), "--out", "r", "--nproc", "2"]))


def test_a_reader_that_closes_stdout_gets_no_error_line(tmp_path: Path) -> None:
    """`titanc inspect --pipeline | head -1`: the reader goes away while titanc still writes;
    that was `titanc: error: Broken pipe` on stderr (exit 2). Now it stops quietly with 141
    (128 + SIGPIPE, as a shell reports a command its reader closed)."""
    proc = subprocess.Popen([sys.executable, "-m", "titanc", "inspect", "--pipeline"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    proc.stdout.close()                                  # the reader is gone before it writes
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 141 and err.decode() == "", (proc.returncode, err)


def test_the_inspect_help_names_a_kernel_every_artifact_has() -> None:
    """`titanc inspect --help`'s `--kernel` example named a kernel no artifact had any more."""
    from titanc.compiler import compile_graphs
    from titanc.tools.cli import INSPECT_KERNEL_EXAMPLE

    c = compile_graphs(load_spec(LMM), verify_each=False)
    names = {k.name for s in c.schedules.values() for k in s.kernels}
    assert INSPECT_KERNEL_EXAMPLE in names
