"""Data: the byte tokenizer, text files with a held-out split, the synthetic recall task, and the
exact one-line errors for bad data files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from titanc.errors import TitancError
from titanc.runtime.data import datasets as data_module
from titanc.runtime.data.datasets import (UNIGRAM_PSEUDOCOUNT, SyntheticRecall, TextData, decode, encode,
                                 make_data, recall_accuracy)
from titanc.model.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- tokenizer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello, world", "Grüße, 東京 🚀\n\ttabs"])
def test_tokenizer_round_trip(text: str) -> None:
    tokens = encode(text)
    assert all(0 <= t < 256 for t in tokens)
    assert len(tokens) == len(text.encode("utf-8"))
    assert decode(tokens) == text
    assert decode(torch.tensor(tokens, dtype=torch.int64)) == text


def test_decode_replaces_invalid_utf8() -> None:
    assert decode([0x68, 0xFF, 0x69]) == "h\ufffdi"
    assert decode(encode("é")[:1]) == "\ufffd"  # a cut multi-byte character


# --- text files -------------------------------------------------------------------------------


def write(tmp_path: Path, text: str | bytes, name: str = "corpus.txt") -> Path:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return p


def test_text_split_and_batches(tmp_path: Path) -> None:
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(100))
    data = TextData(write(tmp_path, text), seq_len=16, val_fraction=0.25, seed=0)
    raw = text.encode()
    n_val = int(len(raw) * 0.25)
    assert bytes(data.split_tokens("train").tolist()) == raw[:-n_val]
    assert bytes(data.split_tokens("val").tolist()) == raw[-n_val:]
    for split in ("train", "val"):
        b = data.batch(5, split, gen(1))
        assert b.shape == (5, 17) and b.dtype == torch.int64
        source = raw[:-n_val] if split == "train" else raw[-n_val:]
        for row in b:  # every row is a window of consecutive bytes of its split
            assert bytes(row.tolist()) in source
    assert torch.equal(data.batch(3, "train", gen(7)), data.batch(3, "train", gen(7)))
    assert not torch.equal(data.batch(3, "train", gen(7)), data.batch(3, "train", gen(8)))


def test_unigram_entropy(tmp_path: Path) -> None:
    # two symbols, equally frequent in train and val: the baseline is log 2 nats, up to the
    # pseudo-count every byte gets
    data = TextData(write(tmp_path, "ab" * 5000), seq_len=8, val_fraction=0.2)
    k = UNIGRAM_PSEUDOCOUNT
    assert data.unigram_entropy("val") == pytest.approx(-math.log((4000 + k) / (8000 + 256 * k)))
    assert data.unigram_entropy("val") == pytest.approx(math.log(2), abs=0.02)
    # a held-out byte never seen in training costs far more than the seen ones
    data = TextData(write(tmp_path, "ab" * 400 + "z" * 200), seq_len=8, val_fraction=0.2)
    assert data.unigram_entropy("val") > math.log(256)


def test_make_data_picks_source(tmp_path: Path) -> None:
    p = write(tmp_path, "x" * 500)
    spec = load_spec(ROOT / "examples/tiny.yaml", {"data.source": str(p), "model.seq_len": 32,
                                                    "model.attention.segment": 16})
    data = make_data(spec)
    assert isinstance(data, TextData) and data.seq_len == 32
    assert isinstance(make_data(load_spec(ROOT / "examples/tiny.yaml")), SyntheticRecall)
    assert isinstance(make_data("synthetic:recall", seq_len=16, vocab_size=64), SyntheticRecall)
    with pytest.raises(TitancError) as e:
        make_data("synthetic:copy", seq_len=16)
    assert str(e.value) == "unknown synthetic task 'synthetic:copy'; the known task is synthetic:recall"
    with pytest.raises(TitancError) as e:
        make_data(str(p), seq_len=16, vocab_size=64)
    assert str(e.value) == ("text data is byte-level and needs model.vocab_size >= 256, got 64; "
                            "set model.vocab_size=256")


# --- errors: exact one-line messages ------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.txt"
    with pytest.raises(TitancError) as e:
        TextData(p, seq_len=16)
    assert str(e.value) == (f"data file {p} does not exist; pass a text file or "
                            f"synthetic:recall as --data or data.source")


def test_empty_file(tmp_path: Path) -> None:
    p = write(tmp_path, "")
    with pytest.raises(TitancError) as e:
        TextData(p, seq_len=16)
    assert str(e.value) == (f"data file {p} is empty; pass a text file with at least one "
                            f"training window of text")


def test_file_too_short(tmp_path: Path) -> None:
    p = write(tmp_path, "0123456789")
    with pytest.raises(TitancError) as e:
        TextData(p, seq_len=16, val_fraction=0.0)
    assert str(e.value) == (f"data file {p} has 10 training bytes, fewer than one window of "
                            f"model.seq_len+1 = 17; use a longer file or a smaller model.seq_len")
    p = write(tmp_path, "x" * 100)
    with pytest.raises(TitancError) as e:
        TextData(p, seq_len=16, val_fraction=0.1)
    assert str(e.value) == (f"data file {p}: its held-out tail (data.val_fraction=0.1) has 10 "
                            f"bytes, fewer than one window of model.seq_len+1 = 17; use a longer "
                            f"file or a larger data.val_fraction")


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, "x" * 100)

    def denied(*args: object, **kwargs: object) -> None:  # chmod 0 does not stop root
        raise PermissionError(13, "Permission denied", str(p))

    monkeypatch.setattr(data_module, "open", denied, raising=False)
    with pytest.raises(TitancError) as e:
        TextData(p, seq_len=16)
    assert str(e.value) == f"data file {p} cannot be read: Permission denied"


def test_directory_is_not_a_data_file(tmp_path: Path) -> None:
    with pytest.raises(TitancError) as e:
        TextData(tmp_path, seq_len=16)
    assert str(e.value) == f"data file {tmp_path} is a directory; pass a text file"


# --- synthetic recall -----------------------------------------------------------------------------


def test_recall_structure() -> None:
    task = SyntheticRecall(seq_len=63, vocab_size=256, seed=0, n_pairs=6, n_queries=4)
    lay = task.layout
    b = task.batch(32, "train", gen(3))
    assert b.shape == (32, 64) and b.dtype == torch.int64
    (k_lo, k_hi), (v_lo, v_hi), (f_lo, f_hi) = lay.key_range, lay.value_range, lay.filler_range
    assert k_hi <= v_lo and v_hi <= f_lo  # disjoint token ranges
    for row in b.tolist():
        keys, values = row[0:12:2], row[1:12:2]
        assert all(k_lo <= k < k_hi for k in keys) and len(set(keys)) == 6
        assert all(v_lo <= v < v_hi for v in values)
        pairs = dict(zip(keys, values))
        filler = row[12:lay.query_start]
        assert all(f_lo <= f < f_hi for f in filler)
        queries = row[lay.query_start:]
        assert len(queries) == 8 and len(set(queries[0::2])) == 4
        for k, v in zip(queries[0::2], queries[1::2]):  # each query's answer is its pair's value
            assert pairs[k] == v
    assert lay.query_positions.tolist() == [56, 58, 60, 62]


def test_recall_default_sizes_fit() -> None:
    for seq_len in (16, 32, 128, 4096):
        task = SyntheticRecall(seq_len, 256)
        assert task.batch(2, "val", gen()).shape == (2, seq_len + 1)
    with pytest.raises(TitancError) as e:
        SyntheticRecall(seq_len=7, vocab_size=256, n_pairs=3)
    assert str(e.value) == ("synthetic:recall: 3 pairs and 3 queries need 12 tokens, more than "
                            "model.seq_len+1 = 8; raise model.seq_len")


def test_recall_accuracy() -> None:
    task = SyntheticRecall(seq_len=31, vocab_size=64, seed=0, n_pairs=3)
    tokens = task.batch(4, "val", gen(5))
    perfect = torch.nn.functional.one_hot(tokens[:, 1:], 64).double()  # predicts every next token
    assert task.accuracy(perfect, tokens) == 1.0
    wrong = perfect.clone()
    pos = task.layout.query_positions
    wrong[0, pos[0]] = 0  # one of 4*3 answers now predicts token 0, a key, not the value
    assert task.accuracy(wrong, tokens) == pytest.approx(11 / 12)

    class FakeProgram:  # a program exposing logits(tokens) -> [B, T, V]
        spec = load_spec(ROOT / "examples/tiny.yaml", {"model.vocab_size": 64, "model.seq_len": 32,
                                                        "model.attention.segment": 16})

        def logits(self, t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.one_hot(t[:, 1:], 64).double()

    assert task.accuracy(FakeProgram(), tokens) == 1.0
    assert recall_accuracy(FakeProgram(), tokens) == 1.0
    with pytest.raises(TitancError) as e:
        task.accuracy(object(), tokens)
    assert str(e.value) == ("recall accuracy needs the program's logits, and this object has no "
                            "logits(tokens) method")
