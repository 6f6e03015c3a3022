"""Data loading under bad input for training and evaluation (text files, .jsonl and .parquet
inputs, token shards, documents, `titanc eval`). Each test failed before its fix."""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from titanc.errors import TitancError
from titanc.model.spec import load_spec
from titanc.runtime.data import datasets
from titanc.runtime.data import prepare as prepare_module
from titanc.runtime.data import tokenizer as tokenizer_module
from titanc.runtime.data.datasets import TextData
from titanc.runtime.data.prepare import prepare
from titanc.runtime.data.shards import HEADER, ShardData, read_header
from titanc.runtime.data.tokenizer import ByteTokenizer, train_bpe
from titanc.runtime.train.evaluate import evaluate
from titanc.tools.cli import main

from tests.helpers import set_at
from tests.test_run_input import cli, one_error_line

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.yaml"
T, B = 32, 2


def _jsonl(path: Path, texts: list) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def _docs(n: int, seed: int = 0) -> list[str]:
    """`n` documents of 1 to 60 bytes (some shorter, some longer than a row of 33)."""
    rng = np.random.default_rng(seed)
    return ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(1, 61))))
            for _ in range(n)]


def _spec(**over):
    return load_spec(TINY, {"model.seq_len": T, "train.batch_size": B, **over})


# --- .jsonl records with empty text -----------------------------------------------------------


def test_empty_jsonl_text_is_no_document(tmp_path: Path) -> None:
    """A record {"text": ""} under the byte tokenizer made a zero-length document: train.docs
    repeated an offset and every data.documents run on the shards was refused ("prepare them
    again", which wrote the same)."""
    src = _jsonl(tmp_path / "c.jsonl", ["hello world, a first document", "", "second one here",
                                        None, "", "third and last document of the corpus"])
    prepare([src], tmp_path / "s", progress=False, val_fraction=0.0)
    data = ShardData(tmp_path / "s", 8, 256)
    docs = data.doc_starts("train")
    assert docs.tolist() == [0, 29, 44]
    toks, d = data.batch_documents(16, "train", torch.Generator().manual_seed(0), pack=False)
    assert (d["loss_mask"].sum(1) > 0).all()           # no row is all padding


def test_repeated_document_starts_of_older_shards_load(tmp_path: Path) -> None:
    """Shards prepared before that fix hold repeated starts: they load, as if each empty
    document were absent (never drawn as a row of padding)."""
    _jsonl(tmp_path / "c.jsonl", ["a" * 40, "b" * 40, "c" * 40])
    prepare([tmp_path / "c.jsonl"], tmp_path / "s", progress=False, val_fraction=0.0)
    def write_docs(starts: list[int]) -> None:          # the offsets and the header's count
        raw = np.asarray(starts, dtype="<i8").tobytes()  # and checksum of them
        (tmp_path / "s" / "train.docs").write_bytes(raw)
        h = json.loads((tmp_path / "s" / HEADER).read_text())
        h["docs"]["train"].update(count=len(starts), sha256=hashlib.sha256(raw).hexdigest())
        (tmp_path / "s" / HEADER).write_text(json.dumps(h))

    write_docs([0, 40, 40, 80, 80])
    data = ShardData(tmp_path / "s", 8, 256)
    assert data.doc_starts("train").tolist() == [0, 40, 80]
    write_docs([0, 40, 30])
    with pytest.raises(TitancError, match="not increasing offsets"):   # still refused
        ShardData(tmp_path / "s", 8, 256).doc_starts("train")


# --- damaged headers ----------------------------------------------------------------------------


@pytest.mark.parametrize("mutate, field", [
    (set_at("splits", "train", "tokens", "abc"), "splits.train.tokens"),
    (set_at("splits", "train", "tokens", None), "splits.train.tokens"),
    (set_at("splits", "train", 5), "splits.train"),
    (set_at("tokenizer", "vocab_size", "x"), "tokenizer.vocab_size"),
    (set_at("docs", "train", "count", "x"), "docs.train.count"),
    (set_at("docs", [1]), "docs"),
])
def test_damaged_header_field_is_one_line(tmp_path: Path, mutate, field: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A header field of the wrong type was a ValueError / TypeError / AttributeError
    traceback out of `titanc train` and `titanc eval`; now one line naming the field."""
    _jsonl(tmp_path / "c.jsonl", _docs(40))
    prepare([tmp_path / "c.jsonl"], tmp_path / "s", progress=False)
    h = json.loads((tmp_path / "s" / HEADER).read_text())
    mutate(h)
    (tmp_path / "s" / HEADER).write_text(json.dumps(h))
    with pytest.raises(TitancError, match=rf"header.json: {field} is .*damaged"):
        ShardData(tmp_path / "s", 8, 256).doc_starts("train")
    rc = main(["train", str(TINY), "--data", str(tmp_path / "s"), "--steps", "1", "--out",
               str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and field in err[0], err


# --- parquet ------------------------------------------------------------------------------------


def test_dictionary_encoded_parquet_text(tmp_path: Path) -> None:
    """A text column written dictionary-encoded (a pandas Categorical) was refused as 'not
    string'; its rows are text like any other (null and "" skipped)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = ["first row of text", "second row", None, "", "first row of text"]
    pq.write_table(pa.table({"text": pa.array(rows).dictionary_encode()}), tmp_path / "d.parquet")
    prepare([tmp_path / "d.parquet"], tmp_path / "s", progress=False, val_fraction=0.0)
    got = np.fromfile(tmp_path / "s" / "train.bin", dtype=np.uint16).astype(np.uint8).tobytes()
    assert got == "".join(r for r in rows if r).encode()
    assert ShardData(tmp_path / "s", 4, 256).doc_starts("train").tolist() == [0, 17, 27]


# --- a file read as bytes must be text -----------------------------------------------------------


def test_text_data_refuses_what_is_not_text(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`--data FILE` trained silently on the raw bytes of a .jsonl (JSON syntax and all), a
    .parquet file, a shard's train.bin (passed instead of its directory) or any binary file;
    docs/hardening.md promises a corpus that is not UTF-8 is refused with its offset."""
    text = ("naïve café, 東京 and 🚀 in UTF-8 text. " * 20).encode()
    (tmp_path / "ok.txt").write_bytes(text)
    (tmp_path / "bad.txt").write_bytes(text[:300] + b"\xff" + text[300:])
    _jsonl(tmp_path / "c.jsonl", _docs(40))
    prepare([tmp_path / "c.jsonl"], tmp_path / "s", progress=False)
    cases = {
        tmp_path / "bad.txt": r"bad.txt is not UTF-8 text \(byte 0xff at offset 300\)",
        tmp_path / "c.jsonl": r"c.jsonl holds records, not plain text.*titanc data prepare",
        tmp_path / "s" / "train.bin": r"train.bin is a token shard .* pass the directory",
    }
    for path, message in cases.items():
        with pytest.raises(TitancError, match=message):
            TextData(path, seq_len=16)
    rc = main(["train", str(TINY), "--data", str(tmp_path / "s" / "train.bin"), "--steps", "1",
               "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--data " + str(tmp_path / "s") in err[0], err
    assert len(TextData(tmp_path / "ok.txt", seq_len=16)) == len(text)


def test_utf8_check_does_not_split_characters(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The check reads blocks: a character across a block boundary is not an error, and the
    offset of a bad byte is the file's, whatever block it is in."""
    monkeypatch.setattr(datasets, "_UTF8_BLOCK", 7)
    text = ("ab東京🚀é" * 30).encode()
    (tmp_path / "ok.txt").write_bytes(text)
    assert len(TextData(tmp_path / "ok.txt", seq_len=16)) == len(text)
    (tmp_path / "bad.txt").write_bytes(text[:101] + b"\xc3" + text[101:])
    bad = 101 if text[101] & 0xC0 != 0x80 else None
    with pytest.raises(TitancError, match=r"is not UTF-8 text \(byte 0x.. at offset \d+\)") as e:
        TextData(tmp_path / "bad.txt", seq_len=16)
    if bad is not None:
        assert f"at offset {bad})" in str(e.value)


# --- titanc eval of a documents run ---------------------------------------------------------------


class _Recorder:
    """A stand-in program: loss = the mean of the kept target ids / 100 (as the compiled loss,
    the mean over the targets the mask keeps); records every batch it is given."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.calls: list[tuple[torch.Tensor, dict | None]] = []

    def loss(self, rows: torch.Tensor, docs: dict | None = None) -> float:
        self.calls.append((rows, docs))
        t = rows[:, 1:].double()
        m = torch.ones_like(t) if docs is None else docs["loss_mask"]
        return float((t * m).sum() / m.sum().clamp(min=1)) / 100


def _doc_shards(tmp_path: Path) -> ShardData:
    _jsonl(tmp_path / "c.jsonl", _docs(120))
    prepare([tmp_path / "c.jsonl"], tmp_path / "s", progress=False, val_fraction=0.3)
    return ShardData(tmp_path / "s", T, 256)


def test_eval_of_a_pack_false_run_scores_one_document_per_row(tmp_path: Path) -> None:
    """A run trained with data.pack=false (one document per row, padding masked) was scored on
    packed windows across documents with no reset (its program drops doc_start), and the
    padding's bytes and tokens were counted."""
    data = _doc_shards(tmp_path)
    prog = _Recorder(_spec(**{"data.documents": True, "data.pack": False}))
    r = evaluate(prog, data, ByteTokenizer(), batches=3)
    docs, val = data.doc_starts("val"), data.split_array("val")
    ends = list(docs[1:]) + [len(val)]
    kept_all, target_sum = 0, 0
    for rows, d in prog.calls:
        assert d is not None
        for row, mask in zip(rows.numpy(), d["loss_mask"].numpy()):
            k = [i for i, s in enumerate(docs) if np.array_equal(
                val[s:min(ends[i], s + T + 1)], row[:min(ends[i] - s, T + 1)])]
            assert k, "a row is not a document from its first token"
            n = ends[k[0]] - docs[k[0]]
            assert mask.sum() == min(n - 1, T) and (row[n:] == 0).all()
            kept_all += int(mask.sum())
            target_sum += int(row[1:][mask > 0].sum())
    assert r["tokens"] == kept_all < 3 * B * T
    assert r["bytes"] == kept_all                      # one byte per kept target
    assert r["loss"] == pytest.approx(target_sum / kept_all / 100)


def test_eval_with_documents_weights_each_kept_target_once(tmp_path: Path) -> None:
    """Packed rows with documents: the loss is the mean over every kept target of the
    evaluation (it was the mean of per-batch means times B*T, whatever each batch kept), and
    bits per byte divides by the bytes of the kept targets only."""
    data = _doc_shards(tmp_path)
    prog = _Recorder(_spec(**{"data.documents": True}))
    r = evaluate(prog, data, ByteTokenizer(), batches=4)
    masks = [d["loss_mask"].numpy() > 0 for _, d in prog.calls]
    kept = sum(int(m.sum()) for m in masks)
    total = sum(int(rows[:, 1:].numpy()[m].sum()) for (rows, _), m in zip(prog.calls, masks))
    assert len({int(m.sum()) for m in masks}) > 1        # the batches keep different counts
    assert r["tokens"] == r["bytes"] == kept < 4 * B * T
    assert r["loss"] == pytest.approx(total / kept / 100)
    assert r["bits_per_byte"] == pytest.approx(total / 100 / math.log(2) / kept)
    plain = _Recorder(_spec())                            # without documents: as before
    r = evaluate(plain, data, ByteTokenizer(), batches=2)
    assert r["tokens"] == 2 * B * T and all(d is None for _, d in plain.calls)


def test_eval_with_an_empty_val_split_of_documents_names_the_split(tmp_path: Path) -> None:
    """doc_starts of a split with no tokens said the shards predate document starts (and to
    prepare them again, which changes nothing); it names the empty split."""
    _jsonl(tmp_path / "c.jsonl", _docs(40))
    prepare([tmp_path / "c.jsonl"], tmp_path / "s", progress=False, val_fraction=0.0)
    data = ShardData(tmp_path / "s", T, 256)
    with pytest.raises(TitancError, match="lists no val tokens, so there is no val split"):
        data.batch_documents(2, "val", pack=False)


def test_jsonl_with_a_byte_order_mark(tmp_path: Path) -> None:
    """A .jsonl file that starts with a UTF-8 byte-order mark (Windows PowerShell's utf8, Excel
    exports) was refused as 'not valid JSON' at line 1; the mark is no part of the records."""
    (tmp_path / "b.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "second"}\n')
    prepare([tmp_path / "b.jsonl"], tmp_path / "s", progress=False, val_fraction=0.0)
    got = np.fromfile(tmp_path / "s" / "train.bin", dtype=np.uint16).astype(np.uint8).tobytes()
    assert got == b"firstsecond"
    (tmp_path / "m.jsonl").write_bytes(b'{"text": "first"}\n\xef\xbb\xbf{"text": "x"}\n')
    with pytest.raises(TitancError, match=r"m.jsonl:2: not valid JSON"):   # only at the start
        prepare([tmp_path / "m.jsonl"], tmp_path / "t", progress=False)


def test_synthetic_recall_with_documents_draws_one_document_per_row() -> None:
    """data.documents=true with data.source synthetic:recall was an AttributeError traceback
    (SyntheticRecall has no batch_documents) at the first step, after the compile: each
    recall sequence is one document, which is what a batch without document inputs means."""
    from titanc.runtime.data.datasets import SyntheticRecall, draw, make_data

    for pack in (True, False):
        spec = _spec(**{"data.documents": True, "data.pack": pack})
        data = make_data(spec)
        assert isinstance(data, SyntheticRecall)
        tokens, docs = draw(data, spec, 4, "train", torch.Generator().manual_seed(1))
        assert docs is None and torch.equal(
            tokens, data.batch(4, "train", torch.Generator().manual_seed(1)))


def test_the_trainers_held_out_loss_weights_each_kept_target_once(tmp_path: Path) -> None:
    """`Trainer.evaluate` averaged its batches' means: with `data.documents` the batches keep
    different numbers of targets, so a target of a short batch weighed more. It is now the
    mean over every kept target, as `titanc eval` (and the plain mean without documents)."""
    from types import SimpleNamespace

    from titanc.runtime.train.trainer import Trainer

    data = _doc_shards(tmp_path)
    spec = _spec(**{"data.documents": True, "train.eval_batches": 4})
    prog = _Recorder(spec)
    out = Trainer.evaluate(SimpleNamespace(data=data, spec=spec, prog=prog))
    masks = [d["loss_mask"].numpy() > 0 for _, d in prog.calls]
    kept = sum(int(m.sum()) for m in masks)
    total = sum(int(rows[:, 1:].numpy()[m].sum()) for (rows, _), m in zip(prog.calls, masks))
    assert len({int(m.sum()) for m in masks}) > 1        # the batches keep different counts
    assert out["eval_loss"] == pytest.approx(total / kept / 100)
    plain = _Recorder(_spec(**{"train.eval_batches": 2}))
    out = Trainer.evaluate(SimpleNamespace(data=data, spec=plain.spec, prog=plain))
    means = [float(rows[:, 1:].double().mean()) / 100 for rows, _ in plain.calls]
    assert out["eval_loss"] == pytest.approx(sum(means) / 2)


# ---------------------------------------------------------------- data prepare

def _corpus(d: Path, name: str = "corpus.txt") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text("the cat sat on the mat\n" * 400)
    return p


def _shard_bytes(d: Path) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in ("header.json", "train.bin", "val.bin")}


def test_overwrite_keeps_the_old_shards_until_the_new_ones_are_complete(tmp_path: Path) -> None:
    good = _corpus(tmp_path / "in")
    out = tmp_path / "dp" / "ow"
    prepare([good], out, progress=False)
    before = _shard_bytes(out)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine text\n" * 100 + b"\xff\xfe not utf-8\n")   # fails mid-way
    with pytest.raises(TitancError, match="not UTF-8"):
        prepare([good, bad], out, progress=False, overwrite=True)
    assert _shard_bytes(out) == before and read_header(out)["splits"]["train"]["tokens"] > 0
    with pytest.raises(TitancError, match="does not exist"):
        prepare([tmp_path / "nope.txt"], out, progress=False, overwrite=True)
    assert _shard_bytes(out) == before
    (out / "NOTES.md").write_text("mine")                    # not a shard: kept
    prepare([good, good], out, progress=False, overwrite=True)
    assert read_header(out)["text_bytes"] == 2 * good.stat().st_size
    assert (out / "NOTES.md").read_text() == "mine"
    assert sorted(p.name for p in out.parent.iterdir()) == ["ow"]   # no staging left


def test_a_killed_prepare_leaves_the_old_shards(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    good = _corpus(tmp_path / "in")
    out = tmp_path / "ow"
    prepare([good], out, progress=False)
    before = _shard_bytes(out)

    def die(*_: object) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare_module, "_move_tail", die)
    with pytest.raises(KeyboardInterrupt):
        prepare([good, good], out, progress=False, overwrite=True)
    assert _shard_bytes(out) == before


def test_inputs_holding_a_shard_set_or_the_output_are_skipped(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    corp = tmp_path / "corp"
    text = _corpus(corp, "a.txt")
    assert main(["data", "prepare", str(corp), "-o", str(corp / "shards"), "--no-progress"]) == 0
    assert main(["data", "prepare", str(corp), "-o", str(tmp_path / "x"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"titanc: note: skipping {corp / 'shards'}: it is a token-shard set" in err
    header = read_header(tmp_path / "x")
    assert [s["path"] for s in header["sources"]] == [str(text)]
    # the output inside the input tree, overwritten: skipped as the output
    assert main(["data", "prepare", str(corp), "-o", str(corp / "shards"), "--overwrite",
                 "--no-progress"]) == 0
    assert [s["path"] for s in read_header(corp / "shards")["sources"]] == [str(text)]
    # a shard file named explicitly is skipped too
    code, _, err = cli(["data", "prepare", text, corp / "shards" / "train.bin", "-o",
                        tmp_path / "y", "--no-progress"], capsys)
    assert code == 0 and "it is in a token-shard set" in err


def test_a_device_is_not_called_an_empty_directory(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    code, _, err = cli(["data", "prepare", "/dev/zero", "-o", tmp_path / "z"], capsys)
    assert code == 2 and "input /dev/zero is not a regular file or a directory" in err
    code, _, err = cli(["tokenizer", "train", "/dev/null", "--vocab-size", "300",
                        "-o", tmp_path / "t.json"], capsys)
    assert code == 2 and "/dev/null is not a regular file or a directory" in err


def test_a_failed_write_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = _corpus(tmp_path / "in")

    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(prepare_module, "_move_tail", full)
    with pytest.raises(TitancError) as e:
        prepare([good], tmp_path / "out", progress=False)
    assert "val.bin: No space left on device" in str(e.value) and "could not write" in str(e.value)
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["in"]


# ---------------------------------------------------------------- tokenizer

def test_vocabulary_size_is_bounded(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text = _corpus(tmp_path)
    code, _, err = cli(["tokenizer", "train", text, "--vocab-size", "1000000000",
                        "-o", tmp_path / "t.json"], capsys)
    assert code == 2 and "[257, 2097152]" in one_error_line(err)
    with pytest.raises(TitancError, match="--vocab-size"):
        train_bpe(["text"], 10**9, tmp_path / "t.json")
    code, _, err = cli(["tokenizer", "train", text, "--vocab-size", "300", "--min-frequency",
                        "99999999999999999999", "-o", tmp_path / "t.json"], capsys)
    assert code == 2 and "--min-frequency" in err


def test_tokenizer_write_failure_is_one_line_and_leaves_no_temp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tokenizer_module.os, "replace", full)
    with pytest.raises(TitancError) as e:
        train_bpe(["the cat sat on the mat"] * 50, 300, tmp_path / "t.json")
    assert str(e.value).startswith(f"could not write tokenizer {tmp_path / 't.json'}: No space")
    assert os.listdir(tmp_path) == []
    with pytest.raises(TitancError, match="not a regular file"):
        train_bpe(["the cat"], 300, "/dev/full")


def test_an_empty_corpus_is_refused_like_data_prepare(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty.txt").write_text("")
    code, _, err = cli(["tokenizer", "train", tmp_path / "empty.txt", "--vocab-size", "300",
                        "-o", tmp_path / "t.json"], capsys)
    assert code == 2 and "holds no text" in err and not (tmp_path / "t.json").exists()
