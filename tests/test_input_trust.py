"""Every input checked where it enters (issue 55): temp files of killed writers, swaps through
symbolic links, JSON lines with invalid Unicode, damaged document offsets, spec fields past
their bounds, and the Python API's tensors and document inputs.

Each test names the row of the issue's table it guards; each failed on the code before it."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import titanc
from titanc.errors import SpecError, TitancError
from titanc.files import remove_stale_temps, temp_writer_alive
from titanc.model.spec import leaf_paths, load_spec
from titanc.runtime.api_checks import check_token_ids
from titanc.runtime.data.prepare import prepare
from titanc.runtime.data.shards import HEADER, ShardData
from titanc.runtime.train.checkpoint import (checkpoint_path, load_checkpoint,
                                             save_checkpoint)
from tests.test_run_input import cli

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny.yaml"
S = ["--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.seq_len=32",
     "--set", "model.attention.segment=16", "--set", "model.memory.chunk_size=8",
     "--set", "train.batch_size=2", "--set", "compile.target=cpu"]
SMALL = {"model.d_model": 32, "model.n_layers": 1, "model.seq_len": 32,
         "model.attention.segment": 16, "model.memory.chunk_size": 8, "train.batch_size": 2,
         "compile.target": "cpu"}


def dead_pid() -> int:
    """The pid of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def doc_prog() -> Any:
    """A data.documents program (one compile for the module: its plain calls default to one
    document per row)."""
    return titanc.compile(SPEC, **SMALL, **{"data.documents": True})


@pytest.fixture(scope="module")
def prog(doc_prog: Any) -> Any:
    return doc_prog


def ids(p: Any, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, p.spec.model.vocab_size, (p.batch_size, p.seq_len + 1),
                         generator=torch.Generator().manual_seed(seed))


# --- row 10: temp files of a killed save ----------------------------------------------------


def test_a_killed_saves_temp_is_removed_by_the_next_reader(prog: Any, tmp_path: Path) -> None:
    """Row 10: a kill -9 during a checkpoint save left `.checkpoint.safetensors.PID.tmp`
    (checkpoint-sized) through later runs that resumed from the run into another --out;
    the next read of a checkpoint there removes it, as a directory without one does."""
    ckpt = save_checkpoint(tmp_path / "run" / "checkpoint.safetensors", prog)
    stale = tmp_path / "run" / f".checkpoint.safetensors.{dead_pid()}.tmp"
    stale.write_bytes(ckpt.read_bytes())
    load_checkpoint(ckpt)
    assert not stale.exists()
    (tmp_path / "empty").mkdir()                     # killed during the first save
    stale = tmp_path / "empty" / f".checkpoint.safetensors.{dead_pid()}.tmp"
    stale.write_bytes(b"partial")
    with pytest.raises(TitancError, match="no checkpoint in it"):
        checkpoint_path(tmp_path / "empty")
    assert not stale.exists()


def test_a_temp_under_a_reused_pid_is_stale(tmp_path: Path) -> None:
    """Row 10: a temp named after a pid that a later process now holds (pids are reused,
    in containers within seconds) stayed forever: the writer seemed alive. The shared
    helper (titanc.files, used by checkpoints and session files) compares the process's
    start with the file's last write."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        old = tmp_path / f".sess.safetensors.{sleeper.pid}.tmp"
        live = tmp_path / f".other.safetensors.{sleeper.pid}.tmp"
        old.write_bytes(b"x" * 100)
        live.write_bytes(b"y")
        hour_ago = time.time() - 3600
        os.utime(old, (hour_ago, hour_ago))             # written before the process began
        assert not temp_writer_alive(sleeper.pid, hour_ago)
        pattern = r"\.(sess|other)\.safetensors\.(?P<pid>\d+)\.tmp"
        assert remove_stale_temps(tmp_path, pattern) == [old]
        assert live.exists()                             # its writer may still be writing
        mine = tmp_path / f".sess.safetensors.{os.getpid()}.tmp"
        mine.write_bytes(b"z")
        os.utime(mine, (hour_ago, hour_ago))             # this pid, before this process
        gone = remove_stale_temps(tmp_path, pattern, keep_live=False)   # a lock holder's
        assert sorted(gone) == sorted([live, mine])
    finally:
        sleeper.kill()
        sleeper.wait()


# --- row 11: a swap through a symbolic link -------------------------------------------------


def test_prepare_into_a_symlink_replaces_its_target(tmp_path: Path) -> None:
    """Row 11: `ln -s real LINK; data prepare other/ -o LINK --overwrite` made LINK a real
    directory, left `real` with its old shards, moved the user's NOTES.txt out of `real`
    and left a `.LINK.old-PID` link. Now the directory the link names is the one replaced."""
    (tmp_path / "a.txt").write_text("first corpus " * 20)
    (tmp_path / "b.txt").write_text("second corpus, other text " * 20)
    real, link = tmp_path / "real", tmp_path / "LINK"
    prepare([tmp_path / "a.txt"], real, progress=False, workers=1)
    (real / "NOTES.txt").write_text("mine")
    link.symlink_to(real)
    prepare([tmp_path / "b.txt"], link, progress=False, workers=1, overwrite=True)
    assert link.is_symlink() and os.readlink(link) == str(real)
    header = json.loads((real / HEADER).read_text())
    assert [s["path"] for s in header["sources"]] == [str(tmp_path / "b.txt")]
    assert (real / "NOTES.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LINK", "a.txt", "b.txt", "real"]


# --- row 17: JSON lines with invalid Unicode ------------------------------------------------


def test_lone_surrogate_in_jsonl_is_one_line(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Row 17: `{"text": "lone \\ud800"}` is valid JSON but no Unicode: data prepare and
    tokenizer train raised UnicodeEncodeError. Refused like non-UTF-8 text, naming file:line."""
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "a fine record"}\n{"text": "lone \\ud800 here"}\n')
    code, _, err = cli(["data", "prepare", src, "-o", tmp_path / "s"], capsys)
    assert code == 2 and f"{src}:2: field 'text' holds a lone surrogate" in err
    code, _, err = cli(["tokenizer", "train", src, "--vocab-size", "300", "-o",
                        tmp_path / "tok.json"], capsys)
    assert code == 2 and f"{src}:2" in err and "surrogate" in err
    src.write_text('{"text": "a pair \\ud83d\\ude00 is fine"}\n' * 4)
    prepare([src], tmp_path / "ok", progress=False, workers=1)


# --- row 18: document offsets under a checksum ----------------------------------------------


def test_damaged_document_offsets_are_refused(tmp_path: Path) -> None:
    """Row 18: a low bit flipped in train.docs[1] kept the offsets increasing, and training
    used wrong document boundaries. The header records each .docs file's sha256."""
    (tmp_path / "in").mkdir()
    for i, n in enumerate((40, 30, 50, 20)):
        (tmp_path / "in" / f"{i}.txt").write_text("abcdefgh"[i] * n)
    prepare([tmp_path / "in"], tmp_path / "s", progress=False, workers=1, val_fraction=0.0)
    docs = tmp_path / "s" / "train.docs"
    assert ShardData(tmp_path / "s", 8, 256).doc_starts("train").tolist() == [0, 40, 70, 120]
    arr = np.fromfile(docs, dtype="<i8")
    arr[1] ^= 1                                          # 41: still increasing
    arr.tofile(docs)
    with pytest.raises(TitancError, match=r"train\.docs do not match the checksum in "
                                          r"header\.json .*data prepare"):
        ShardData(tmp_path / "s", 8, 256).doc_starts("train")
    header = json.loads((tmp_path / "s" / HEADER).read_text())
    del header["docs"]["train"]["sha256"]                # shards without the checksum
    (tmp_path / "s" / HEADER).write_text(json.dumps(header))
    with pytest.raises(TitancError, match="records no checksum .*data.documents=false"):
        ShardData(tmp_path / "s", 8, 256).doc_starts("train")
    header["docs"]["train"]["sha256"] = hashlib.sha256(docs.read_bytes()).hexdigest()
    (tmp_path / "s" / HEADER).write_text(json.dumps(header))
    assert ShardData(tmp_path / "s", 8, 256).doc_starts("train").tolist() == [0, 41, 70, 120]


# --- row 19: every spec field bounded -------------------------------------------------------


def _numeric(tp: Any) -> Any:
    """int, float, a tuple of floats, or None for the schema's other leaf types."""
    if typing.get_origin(tp) is tuple:
        return tuple
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    return base if base in (int, float) else None


def test_every_numeric_spec_field_is_bounded() -> None:
    """Row 19 (and the hidden sample's "spec fields without a bound"): a value past any
    field's range is one SpecError naming that field, before anything is compiled."""
    seen = 0
    for path, tp in leaf_paths().items():
        kind = _numeric(tp)
        if kind is None:
            continue
        value = {int: 10**20, float: 1e300, tuple: [1e300, 0.9]}[kind]
        extra = {"train.remat": "budget"} if path == "train.remat_budget_mb" else {}
        with pytest.raises(SpecError) as e:
            load_spec(SPEC, {path: value, **extra})
        assert str(e.value).startswith(path) and "\n" not in str(e.value), str(e.value)
        seen += 1
    assert seen >= 35


def test_huge_batch_size_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Row 19: `titanc train … --set train.batch_size=99999999999999999999` was a size
    overflow traceback at compiler.py `_finish`."""
    (tmp_path / "c.txt").write_text("hello world " * 200)
    code, _, err = cli(["train", SPEC, *S, "--set", "train.batch_size=99999999999999999999",
                        "--data", tmp_path / "c.txt", "--steps", "2", "--out", tmp_path / "r"],
                       capsys)
    assert code == 2 and "train.batch_size: 99999999999999999999 must be at most 65536" in err
    assert not (tmp_path / "r").exists()


def test_memory_lr_max_past_float32_names_itself() -> None:
    """Also seen: `memory.lr_max=1e300` trained to NaN and said "lower train.lr"."""
    with pytest.raises(SpecError, match=r"^model\.memory\.lr_max: 1e\+300 overflows float32"):
        load_spec(SPEC, {"model.memory.lr_max": 1e300})


def test_sizes_past_torch_while_compiling_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 19: fields each within bounds may still multiply past what torch indexes; the
    compile's overflow is a TitancError, as `titanc compile --force` already made it."""
    import titanc.compiler

    def overflow(*a: Any, **k: Any) -> Any:
        raise TypeError("empty(): argument 'size' failed to unpack the object at pos 1 with "
                        "error \"Overflow when unpacking long long")

    monkeypatch.setattr(titanc.compiler, "compile_graphs", overflow)
    with pytest.raises(TitancError, match="past what torch can index .*train.batch_size"):
        titanc.compile(SPEC, **SMALL)


# --- row 20 and the tokens' dtype: the API's tensors ----------------------------------------


def test_sparse_tensors_are_named(prog: Any, doc_prog: Any) -> None:
    """Row 20: `prog.train_step(tokens.to_sparse())` raised NotImplementedError from
    program.py; a sparse state or document tensor likewise reached torch."""
    toks = ids(prog)
    with pytest.raises(TitancError, match=r"^tokens is a sparse_coo tensor; pass a dense"):
        prog.train_step(toks.to_sparse())
    with pytest.raises(TitancError, match=r"^tokens is a sparse_csr tensor"):
        prog.loss(toks.to_sparse_csr())
    sd = {k: v.clone() for k, v in prog.state_dict().items()}
    name = next(k for k in sd if k.startswith("param."))
    sd[name] = sd[name].to_sparse()
    with pytest.raises(TitancError, match=rf"state_dict\['{name}'\] is a sparse_coo tensor"):
        prog.load_state_dict(sd)
    mask = torch.ones(doc_prog.batch_size, doc_prog.seq_len).to_sparse()
    with pytest.raises(TitancError, match=r"docs\['loss_mask'\] is a sparse_coo tensor"):
        doc_prog.loss(ids(doc_prog), {"loss_mask": mask})


def test_token_dtype_must_hold_the_vocabulary(prog: Any) -> None:
    """Also seen: int16 and uint8 tokens were accepted whatever the vocabulary: ids cut by a
    cast to a narrower type trained silently. An integer dtype that holds every id passes."""
    toks = ids(prog)
    assert prog.loss(toks.to(torch.uint8)) == pytest.approx(prog.loss(toks))    # 256 ids
    assert prog.loss(toks.to(torch.int16)) == pytest.approx(prog.loss(toks))
    with pytest.raises(TitancError, match=r"^tokens is a int8 tensor, which cannot hold the "
                                          r"ids of model.vocab_size=256"):
        prog.loss(toks.to(torch.int8))
    with pytest.raises(TitancError, match="uint8 tensor, which cannot hold"):
        check_token_ids(torch.zeros(1, 4, dtype=torch.uint8), 4096)
    with pytest.raises(TitancError, match="int16 tensor, which cannot hold"):
        check_token_ids(torch.zeros(1, 4, dtype=torch.int16), 50257)
    check_token_ids(torch.zeros(1, 4, dtype=torch.int32), 1 << 21)


def test_api_numbers_past_their_bounds_are_named(prog: Any) -> None:
    """The hidden sample's "numbers beyond what the code downstream accepts" in the API: an
    `opt.step` of 10**30 overflowed the device step counter's fill_, a batch of 10**20 rows
    reached the compiler."""
    sd = dict(prog.state_dict())
    with pytest.raises(TitancError, match=r"opt.step must be one integer in \[0, 10+\]"):
        prog.load_state_dict({**sd, "opt.step": 10**30})
    with pytest.raises(TitancError, match=r"^batch: expected a number of sequences"):
        prog.graph("forward", 10**20)


# --- row 22: document inputs at the API boundary --------------------------------------------


@pytest.mark.parametrize("name, value", [
    ("loss_mask", -1.0), ("loss_mask", float("nan")), ("loss_mask", 0.5),
    ("doc_start", float("nan")), ("doc_start", -5.0), ("doc_start", 0.5),
    ("doc_start", 3.0),
])
def test_document_inputs_are_checked(doc_prog: Any, name: str, value: float) -> None:
    """Row 22: `loss_mask` of −1s gave a loss of −354, a NaN mask NaN; a NaN, −5 or 0.5
    `doc_start` was accepted (only shape and device were checked). Now one TitancError
    naming the key, the position and the rule, from every entry point."""
    B, T = doc_prog.batch_size, doc_prog.seq_len
    docs = {"doc_start": torch.zeros(B, T), "loss_mask": torch.ones(B, T)}
    docs[name][1, 5] = value                 # doc_start 3 at position 5: no start at 3..4
    toks = ids(doc_prog)
    for call in (doc_prog.loss, doc_prog.train_step, doc_prog.grads):
        with pytest.raises(TitancError, match=rf"^docs\['{name}'\]\[1, 5\] is "):
            call(toks, docs)
    if name == "doc_start":                  # logits and logprobs take no loss mask
        with pytest.raises(TitancError, match=r"^docs\['doc_start'\]\[1, 5\] is "):
            doc_prog.logits(toks, {"doc_start": docs["doc_start"]})


def test_valid_document_inputs_pass(doc_prog: Any) -> None:
    """What the loader makes passes: documents starting at 0, 7 and 20 in a row, a mask of
    0 and 1 in any dtype."""
    B, T = doc_prog.batch_size, doc_prog.seq_len
    start = torch.zeros(B, T)
    start[0, 7:20], start[0, 20:] = 7.0, 20.0
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 6] = mask[0, 19] = False
    loss = doc_prog.loss(ids(doc_prog), {"doc_start": start.long(), "loss_mask": mask})
    assert np.isfinite(loss) and loss > 0


# --- also seen: a file that is not a checkpoint ---------------------------------------------


def test_a_text_file_is_not_a_checkpoint(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`titanc generate notes.txt` said "resume from another copy"; it is no checkpoint."""
    (tmp_path / "notes.txt").write_text("some notes, not weights\n" * 10)
    code, _, err = cli(["generate", tmp_path / "notes.txt", "--prompt", "hi"], capsys)
    assert code == 2 and "notes.txt is not a checkpoint (not a safetensors file)" in err
    assert "another copy" not in err
