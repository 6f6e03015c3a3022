"""Real corpora: tokenizers (byte, BPE through `tokenizers`), corpus reading, `titanc data
prepare` into token shards, the memmap loader, `titanc eval`'s arithmetic, and the exact
one-line error (exit status 2) of every bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from titanc.tools.cli import main
from titanc.errors import TitancError
from titanc.runtime.data.corpus import plan, read_piece
from titanc.runtime.train.evaluate import evaluate
from titanc.runtime.data.prepare import prepare
from titanc.runtime.data.shards import HEADER, ShardData, dtype_for
from titanc.runtime.data.tokenizer import (BPETokenizer, ByteTokenizer, StreamDecoder, check_vocab,
                                      load_tokenizer, save_tokenizer, train_bpe)
from titanc.model.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.yaml"
TEXT = ("The old lighthouse keeper counted the ships. Grüße aus 東京 🚀 — naïve café.\n"
        "Each night the lamp turned, and each night the sea answered.\n") * 40
FILLER = " ".join(f"{w}{i % 7}" for i, w in enumerate(
    "a compiler lowers the model into kernels that train and serve it while memory learns "
    "at test time over long sequences of tokens".split() * 30))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> BPETokenizer:
    """A 320-token byte-level BPE trained on the fly, on fixed text only (not on a repo file
    whose edits would change the merges)."""
    d = tmp_path_factory.mktemp("tok")
    return train_bpe([TEXT, FILLER], 320, d / "tok.json")


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path


def err_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# --- tokenizers -------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_large_ids() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eot is None
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.decode([104, 300, 105]) == "h\ufffdi"          # ids >= 256 never crash
    assert tok.decode(torch.tensor([104, 105])) == "hi"


def test_bpe_round_trip_hash_and_token_bytes(bpe: BPETokenizer, tmp_path: Path) -> None:
    assert bpe.vocab_size == 320 and bpe.eot == 0
    ids = bpe.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) / 1.5                 # merges do compress
    assert bpe.decode(ids) == TEXT
    nbytes = bpe.token_bytes()
    assert int(nbytes[ids].sum()) == len(TEXT.encode())        # exact bytes per token
    assert nbytes[bpe.eot] == 0
    # the hash is of the content: reformatting the JSON keeps it, another vocabulary does not
    pretty = write(tmp_path / "pretty.json", json.dumps(json.loads(bpe.text), indent=4))
    assert BPETokenizer(pretty).hash == bpe.hash
    other = train_bpe([TEXT], 300, tmp_path / "other.json")
    assert other.hash != bpe.hash and other.hash != ByteTokenizer.hash


def test_stream_decoder_never_splits_a_character(bpe: BPETokenizer) -> None:
    for tok in (ByteTokenizer(), bpe):
        dec = StreamDecoder(tok)
        pieces = [dec.push(t) for t in tok.encode(TEXT)] + [dec.flush()]
        assert "".join(pieces) == TEXT and not any("\ufffd" in p for p in pieces)
    dec = StreamDecoder(ByteTokenizer())
    assert [dec.push(t) for t in "東".encode()] == ["", "", "東"]
    assert dec.push(0xE6) == "" and dec.flush() == "\ufffd"    # a cut character at the end


def test_load_tokenizer_resolves_runs_artifacts_and_specs(bpe: BPETokenizer,
                                                          tmp_path: Path) -> None:
    spec = load_spec(TINY, {"data.tokenizer": str(bpe.path), "model.vocab_size": 320})
    assert load_tokenizer(spec).hash == bpe.hash
    run = tmp_path / "run"
    run.mkdir()
    assert save_tokenizer(bpe, run) == run / "tokenizer.json"
    assert load_tokenizer(run).hash == bpe.hash                   # the run's own copy
    assert load_tokenizer(run / "checkpoint.safetensors").hash == bpe.hash
    save_tokenizer(ByteTokenizer(), run)                           # byte: no stale copy left
    assert not (run / "tokenizer.json").exists()
    write(run / "spec.yaml", "name: x\ndata: {tokenizer: byte}\n")
    assert isinstance(load_tokenizer(run), ByteTokenizer)
    art = tmp_path / "art"
    write(art / "manifest.json", json.dumps({"spec": {"data": {"tokenizer": str(bpe.path)}}}))
    assert load_tokenizer(art).hash == bpe.hash
    check_vocab(spec, bpe)
    with pytest.raises(TitancError, match=r"model.vocab_size: 256 does not match the tokenizer "
                                          r".*tok.json \(320 tokens\); set model.vocab_size=320"):
        check_vocab(load_spec(TINY, {"data.tokenizer": str(bpe.path)}), bpe)


def test_compiled_artifact_carries_the_tokenizer(bpe: BPETokenizer, tmp_path: Path) -> None:
    small = ["--set", "model.d_model=16", "--set", "model.n_layers=1", "--set",
             "model.seq_len=16", "--set", "model.memory.chunk_size=4", "--set",
             "model.vocab_size=320", "--set", f"data.tokenizer={bpe.path}"]
    out = tmp_path / "build"
    assert main(["compile", str(ROOT / "examples" / "tiny_lmm.yaml"), *small, "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"] == {"name": str(bpe.path), "kind": "bpe", "vocab_size": 320,
                                     "eot": 0, "hash": bpe.hash}
    assert (out / "tokenizer.json").read_bytes() == bpe.path.read_bytes()
    assert load_tokenizer(out).hash == bpe.hash


# --- corpus reading ---------------------------------------------------------------------------


def test_pieces_cut_at_lines_and_characters(tmp_path: Path) -> None:
    lines = write(tmp_path / "a.txt", TEXT)
    one_line = write(tmp_path / "b.txt", "東京🚀" * 200)          # no newline: cut by character
    for path in (lines, one_line):
        pieces = plan([path], piece_bytes=61)
        assert len(pieces) > 5 and pieces[-1].last and not pieces[0].last
        text = "".join(t for p in pieces for t, _ in read_piece(p))
        assert text == path.read_text(encoding="utf-8")


def test_directories_jsonl_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    write(tmp_path / "d" / "b.md", "bee")
    write(tmp_path / "d" / "a.txt", "ay")
    write(tmp_path / "d" / "sub" / "c.md", "sea")
    write(tmp_path / "d" / ".hidden", "no")
    write(tmp_path / "d" / "__pycache__" / "x.md", "no")
    write(tmp_path / "r.jsonl", '{"text": "one"}\n\n{"body": "x", "text": "two"}\n')
    pq.write_table(pa.table({"text": ["p1", None, "p2", "p3"]}), tmp_path / "t.parquet",
                   row_group_size=2)
    texts = [t for p in plan([tmp_path / "d", tmp_path / "r.jsonl", tmp_path / "t.parquet"])
             for t, _ in read_piece(p)]
    assert texts == ["ay", "bee", "sea", "one", "two", "p1", "p2", "p3"]
    only_md = [t for p in plan([tmp_path / "d"], ext=["md"]) for t, _ in read_piece(p)]
    assert only_md == ["bee", "sea"]


# --- prepare and the memmap loader ------------------------------------------------------------


def test_prepare_byte_shards_hold_the_corpus_exactly(tmp_path: Path) -> None:
    a = write(tmp_path / "in" / "a.txt", TEXT)
    b = write(tmp_path / "in" / "b.txt", "second file ✓\n" * 30)
    h = prepare([tmp_path / "in"], tmp_path / "out", val_fraction=0.25, progress=False)
    raw = a.read_bytes() + b.read_bytes()
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16)
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == raw
    assert len(val) == int(len(raw) * 0.25)                       # the tail is held out
    on_disk = json.loads((tmp_path / "out" / HEADER).read_text())
    assert on_disk == {k: v for k, v in h.items() if k not in ("seconds", "workers")}
    assert h["dtype"] == "uint16" and h["text_bytes"] == len(raw)
    assert h["tokenizer"]["hash"] == ByteTokenizer.hash
    assert h["splits"]["train"]["tokens"] == len(train)
    assert [s["path"] for s in h["sources"]] == [str(a), str(b)]
    assert dtype_for(65536) == "uint16" and dtype_for(65537) == "uint32"


def test_prepare_bpe_in_parallel_matches_one_worker(bpe: BPETokenizer, tmp_path: Path) -> None:
    docs = [write(tmp_path / "in" / f"{k}.txt", TEXT[k * 50:] + f"doc {k}\n") for k in range(4)]
    h1 = prepare(docs, tmp_path / "one", tokenizer=str(bpe.path), workers=1, progress=False)
    h2 = prepare(docs, tmp_path / "two", tokenizer=str(bpe.path), workers=2, progress=False)
    for split in ("train", "val"):
        assert ((tmp_path / "one" / f"{split}.bin").read_bytes()
                == (tmp_path / "two" / f"{split}.bin").read_bytes())
    assert h2["workers"] == 2 and h1["tokenizer"]["hash"] == bpe.hash
    ids = np.concatenate([np.fromfile(tmp_path / "one" / f"{s}.bin", dtype=np.uint16)
                          for s in ("train", "val")]).tolist()
    assert ids.count(bpe.eot) == 4                                 # one eot after each document
    assert bpe.decode(ids) == "".join(d.read_text() for d in docs)


def test_shard_batches_are_windows_deterministic_per_seed(tmp_path: Path) -> None:
    write(tmp_path / "a.txt", TEXT)
    prepare([tmp_path / "a.txt"], tmp_path / "s", progress=False)
    data = ShardData(tmp_path / "s", 32, 256, tokenizer=ByteTokenizer())
    stream = np.fromfile(tmp_path / "s" / "train.bin", dtype=np.uint16).astype(np.int64)
    b1 = data.batch(6, "train", torch.Generator().manual_seed(3))
    b2 = data.batch(6, "train", torch.Generator().manual_seed(3))
    assert b1.dtype == torch.int64 and b1.shape == (6, 33) and torch.equal(b1, b2)
    for row in b1.numpy():   # every row is a window of the stream
        starts = [s for s in range(len(stream) - 32) if stream[s] == row[0]]
        assert any(np.array_equal(stream[s:s + 33], row) for s in starts)
    assert not torch.equal(b1, data.batch(6, "train", torch.Generator().manual_seed(4)))
    assert data.has_split("val") and data.batch(2, "val").shape == (2, 33)


def test_eval_arithmetic_loss_perplexity_bits_per_byte(bpe: BPETokenizer, tmp_path: Path) -> None:
    """A stand-in program with a constant loss: every number follows from it exactly."""
    write(tmp_path / "a.txt", TEXT)
    prepare([tmp_path / "a.txt"], tmp_path / "s", tokenizer=str(bpe.path), progress=False,
            val_fraction=0.5)
    spec = load_spec(TINY, {"model.seq_len": 32, "train.batch_size": 2, "model.vocab_size": 320})
    prog = SimpleNamespace(spec=spec, loss=lambda tokens: 2.0)
    data = ShardData(tmp_path / "s", 32, 320, tokenizer=bpe)
    r = evaluate(prog, data, bpe, batches=3)
    val = np.fromfile(tmp_path / "s" / "val.bin", dtype=np.uint16)
    starts = np.linspace(0, len(val) - 33, 6).round().astype(int)
    n_bytes = sum(int(bpe.token_bytes()[val[s + 1:s + 33]].sum()) for s in starts)
    assert r["tokens"] == 3 * 2 * 32 and r["bytes"] == n_bytes
    assert r["loss"] == 2.0 and r["perplexity"] == pytest.approx(math.exp(2.0))
    assert r["bits_per_byte"] == pytest.approx(2.0 * 192 / math.log(2) / n_bytes)


# --- bad input: one line, exit 2 --------------------------------------------------------------


def _shards(tmp_path: Path, name: str = "s", text: str = TEXT, tok: str = "byte") -> Path:
    write(tmp_path / f"{name}.txt", text)
    prepare([tmp_path / f"{name}.txt"], tmp_path / name, tokenizer=tok, progress=False)
    return tmp_path / name


def _train(data: Path | str, tmp_path: Path, *sets: str) -> list[str]:
    return ["train", str(TINY), "--data", str(data), "--out", str(tmp_path / "run"),
            *[x for s in sets for x in ("--set", s)]]


def _bad_cases(tmp_path: Path, bpe: BPETokenizer) -> dict[str, tuple[list[str], str]]:
    t = tmp_path
    write(t / "latin1.txt", "caf\xe9 ok".encode("latin-1"))
    write(t / "bad.jsonl", '{"text": "fine"}\n{"text": oops}\n')
    write(t / "nofield.jsonl", '{"body": "x"}\n')
    write(t / "fake.parquet", "not parquet at all")
    write(t / "empty.txt", "")
    existing = _shards(t, "existing")
    missing = _shards(t, "missing")
    (missing / "train.bin").unlink()
    empty = _shards(t, "emptyshard")
    (empty / "train.bin").write_bytes(b"")
    truncated = _shards(t, "truncated")
    with open(truncated / "train.bin", "r+b") as f:
        f.truncate(1001)
    binary = _shards(t, "binary")
    size = (binary / "train.bin").stat().st_size
    (binary / "train.bin").write_bytes(np.full(size // 2, 0xBEEF, np.uint16).tobytes())
    garbled = _shards(t, "garbled")
    (garbled / HEADER).write_bytes(b"\x00\xff\x13binary")
    short = _shards(t, "short", text="tiny corpus\n" * 5)
    n_short = json.loads((short / HEADER).read_text())["splits"]["train"]["tokens"]
    n_trunc = json.loads((truncated / HEADER).read_text())["splits"]["train"]["tokens"]
    tokf, fix = str(bpe.path), "prepare them with 'titanc data prepare INPUT... -o {}'"
    return {
        "prepare: missing input": (
            ["data", "prepare", str(t / "nope.txt"), "-o", str(t / "o1")],
            f"input {t / 'nope.txt'} does not exist; pass text files, directories, .jsonl or "
            f".parquet files"),
        "prepare: non-UTF-8 text": (
            ["data", "prepare", str(t / "latin1.txt"), "-o", str(t / "o2")],
            f"input {t / 'latin1.txt'} is not UTF-8 text (byte 0xe9 at offset 3); convert it to "
            f"UTF-8 or leave it out (--ext filters the files of a directory)"),
        "prepare: bad jsonl line": (
            ["data", "prepare", str(t / "bad.jsonl"), "-o", str(t / "o3")],
            f"input {t / 'bad.jsonl'}:2: not valid JSON (Expecting value); each line of a "
            f".jsonl file is one JSON object"),
        "prepare: jsonl without the field": (
            ["data", "prepare", str(t / "nofield.jsonl"), "-o", str(t / "o4")],
            f"input {t / 'nofield.jsonl'}:1: no 'text' field; name the text field with "
            f"--text-field"),
        "prepare: not parquet": (
            ["data", "prepare", str(t / "fake.parquet"), "-o", str(t / "o5")],
            None),
        "prepare: no text": (
            ["data", "prepare", str(t / "empty.txt"), "-o", str(t / "o6")],
            f"the inputs ({t / 'empty.txt'}) hold no text; pass files with text in them"),
        "prepare: output holds shards": (
            ["data", "prepare", str(t / "existing.txt"), "-o", str(existing)],
            f"-o {existing} already holds shards (header.json, train.bin, val.bin); choose "
            f"another directory or pass --overwrite"),
        "prepare: missing tokenizer": (
            ["data", "prepare", str(t / "existing.txt"), "-o", str(t / "o7"), "--tokenizer",
             str(t / "no.json")],
            f"tokenizer file {t / 'no.json'} does not exist; train one with 'titanc tokenizer "
            f"train CORPUS --vocab-size N -o {t / 'no.json'}' or use data.tokenizer: byte"),
        # --vocab-size out of [257, 2**21] is a usage error (titanc/bounds.py):
        # tests/test_data_input.py test_vocabulary_size_is_bounded
        "train: missing shard": (
            _train(missing, t),
            f"shard {missing / 'train.bin'} does not exist (the header lists "
            f"{json.loads((missing / HEADER).read_text())['splits']['train']['tokens']:,} "
            f"tokens); {fix.format(missing)}"),
        "train: empty shard": (
            _train(empty, t), None),
        "train: truncated shard": (
            _train(truncated, t),
            f"shard {truncated / 'train.bin'} has 1,001 bytes, but the header lists "
            f"{n_trunc:,} uint16 tokens = {2 * n_trunc:,} bytes; the shard is truncated or "
            f"corrupt; {fix.format(truncated)}"),
        "train: binary shard": (
            _train(binary, t),
            f"shard {binary / 'train.bin'} holds token id 48879 at token 0, outside the "
            f"tokenizer's 256 ids: the file is corrupt or binary garbage; {fix.format(binary)}"),
        "train: binary header": (
            _train(garbled, t),
            f"{garbled / HEADER} is not a JSON shard header (corrupt or not written by titanc); "
            f"{fix.format(garbled)}"),
        "train: not a shard directory": (
            _train(t / "o1_missing_dir_is_made_below", t), None),
        "train: tokenizer/shard mismatch": (
            _train(existing, t, f"data.tokenizer={tokf}", "model.vocab_size=320"),
            f"{existing / HEADER}: the shards were prepared with tokenizer byte (hash "
            f"{ByteTokenizer.hash[:12]}), not with {tokf} (hash {bpe.hash[:12]}); set "
            f"data.tokenizer to the tokenizer they were prepared with or prepare them again "
            f"with --tokenizer {tokf}"),
        "train: corpus shorter than one sequence": (
            _train(short, t),
            f"{short / 'train.bin'} has {n_short} tokens, fewer than one window of "
            f"model.seq_len+1 = 129; prepare a longer corpus or use a smaller model.seq_len"),
        "train: vocab does not match the tokenizer": (
            _train(existing, t, f"data.tokenizer={tokf}"),
            f"model.vocab_size: 256 does not match the tokenizer {tokf} (320 tokens); set "
            f"model.vocab_size=320"),
        "train: text file with a BPE tokenizer": (
            _train(t / "existing.txt", t, f"data.tokenizer={tokf}", "model.vocab_size=320"),
            f"data.source {t / 'existing.txt'} is a text file, read as bytes, but "
            f"data.tokenizer is {tokf}; prepare shards with 'titanc data prepare "
            f"{t / 'existing.txt'} -o DIR --tokenizer {tokf}' and set data.source to DIR"),
    }


def test_every_bad_input_is_one_line_with_exit_2(bpe: BPETokenizer, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cases = _bad_cases(tmp_path, bpe)
    (tmp_path / "o1_missing_dir_is_made_below").mkdir()
    for case, (argv, want) in cases.items():
        assert main(argv) == 2, case
        line = err_line(capsys)
        assert line.startswith("titanc: error: "), (case, line)
        if want is not None:
            assert line == f"titanc: error: {want}", case
        assert not (tmp_path / "run" / "checkpoint.safetensors").exists(), case
    # the cases checked by their distinctive part
    assert main(cases["prepare: not parquet"][0]) == 2
    assert err_line(capsys).startswith(f"titanc: error: input {tmp_path / 'fake.parquet'} is "
                                       f"not a parquet file (")
    assert main(cases["train: empty shard"][0]) == 2
    assert err_line(capsys).startswith(f"titanc: error: shard "
                                       f"{tmp_path / 'emptyshard' / 'train.bin'} is empty (")
    d = tmp_path / "o1_missing_dir_is_made_below"
    assert main(cases["train: not a shard directory"][0]) == 2
    assert err_line(capsys) == (f"titanc: error: data.source {d} is a directory without "
                                f"header.json, so not token shards; prepare it with 'titanc "
                                f"data prepare {d} -o data/{d.name}' and pass --data "
                                f"data/{d.name}")   # shards beside the text, never into it


def test_eval_bad_inputs(bpe: BPETokenizer, tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    save_tokenizer(bpe, run)
    write(tmp_path / "a.txt", TEXT)
    assert main(["eval", str(run), "--data", str(tmp_path / "a.txt")]) == 2
    assert err_line(capsys) == (
        f"titanc: error: --data {tmp_path / 'a.txt'} is a text file, but the run uses the "
        f"tokenizer {run / 'tokenizer.json'}; prepare shards with 'titanc data prepare "
        f"{tmp_path / 'a.txt'} -o DIR --tokenizer {run / 'tokenizer.json'}' and pass --data DIR")
    assert main(["eval", str(tmp_path / "nothing"), "--data", str(tmp_path)]) == 2
    assert err_line(capsys).startswith("titanc: error: ")


def test_eval_recall_accuracy_and_a_split_too_short(tmp_path: Path) -> None:
    """--recall scores the argmax at the query positions: an oracle scores 1, a constant 0."""
    from titanc.runtime.data.datasets import SyntheticRecall

    spec = load_spec(TINY, {"model.seq_len": 32, "train.batch_size": 2})
    oracle = SimpleNamespace(spec=spec, loss=lambda t: 0.0, logits=lambda t: torch.nn.functional
                             .one_hot(t[:, 1:], 256).double())
    blind = SimpleNamespace(spec=spec, loss=lambda t: 5.5, logits=lambda t: torch.zeros(
        t.shape[0], t.shape[1] - 1, 256).index_fill_(2, torch.tensor([255]), 1.0))
    task = SyntheticRecall(32, 256)
    r = evaluate(oracle, task, ByteTokenizer(), batches=2)
    assert r["recall_accuracy"] == 1.0 and r["loss"] == 0.0 and "bits_per_byte" not in r
    write(tmp_path / "a.txt", TEXT)
    prepare([tmp_path / "a.txt"], tmp_path / "s", progress=False, val_fraction=0.01)
    data = ShardData(tmp_path / "s", 32, 256)
    r = evaluate(blind, data, ByteTokenizer(), batches=2, recall=True)
    assert r["recall_accuracy"] == 0.0 and r["recall_chance"] == 1 / 64
    assert r["bits_per_byte"] == pytest.approx(5.5 / math.log(2))   # one byte per token
    short = ShardData(tmp_path / "s", 256, 256)                       # val: ~50 tokens < 257
    with pytest.raises(TitancError, match=r"the val split of .* has \d+ tokens, fewer than "
                                          r"one window of model.seq_len\+1 = 257"):
        evaluate(SimpleNamespace(spec=load_spec(TINY, {"model.seq_len": 256}), loss=None),
                 short, ByteTokenizer())
