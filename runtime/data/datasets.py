"""Training data: a byte-level tokenizer, text files with a held-out split, and synthetic recall.

Every dataset answers `batch(n, split, generator) -> int64 [n, seq_len + 1]` (inputs are
columns 0..T-1, next-token targets 1..T, as `Program.loss` expects) and draws only from the
`torch.Generator` it is handed, so a sampler restored from a checkpoint continues the exact
stream of batches.

    data = make_data(spec)                   # from data.source: a file or synthetic:recall
    tokens = data.batch(8, "train", gen)     # (8, T+1) int64

`TextData` reads a UTF-8 text file as bytes (vocab 256; a file that is not UTF-8, a .jsonl or
.parquet file, or a shard of a shard set is refused naming the fix); the last `val_fraction` of the bytes is
the held-out split, and `unigram_entropy()` is the loss a model that knows only byte
frequencies would get on it, the baseline a trained model must beat.

`SyntheticRecall` is multi-query associative recall. Each sequence is

    k1 v1 k2 v2 … kP vP   f f f … f   kσ(1) vσ(1) … kσ(Q) vσ(Q)
    └── pairs (early) ──┘ └ filler ┘  └──── queries (the last 2Q tokens) ───┘

with keys, values and filler drawn from disjoint token ranges and the mapping fresh in every
sequence, so the only way to predict the value after a queried key is to remember the pair
seen ~seq_len tokens earlier. `accuracy` scores the argmax prediction at the query positions.
By default a quarter of the vocabulary are keys, a quarter values and the rest filler;
`n_keys`, `n_values` and `filler_tokens` narrow the alphabets (tokens past them go unused).
With `n_keys == n_pairs` every sequence uses the same keys in a fresh order, so *which* keys
appear carries no information and only the key–value binding is left to learn; a single
filler token makes the filler free to predict, so the loss is not dominated by noise.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from titanc.errors import TitancError

__all__ = [
    "VOCAB_SIZE", "encode", "decode", "Dataset", "TextData", "SyntheticRecall",
    "recall_accuracy", "make_data", "draw", "SYNTHETIC_RECALL",
]

Tensor = torch.Tensor
VOCAB_SIZE = 256
SYNTHETIC_RECALL = "synthetic:recall"
SPLITS = ("train", "val")
UNIGRAM_PSEUDOCOUNT = 0.5   # added to every byte's training count (Krichevsky–Trofimov)


# ---------------------------------------------------------------------------------- tokenizer


def encode(text: str) -> list[int]:
    """UTF-8 bytes of `text`, one token per byte (0..255)."""
    return list(text.encode("utf-8"))


def decode(tokens: Any) -> str:
    """Tokens (ints 0..255, a list or a tensor) back to text; invalid UTF-8 becomes U+FFFD."""
    if isinstance(tokens, Tensor):
        tokens = tokens.tolist()
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------- datasets


class Dataset(Protocol):
    seq_len: int
    description: str

    def batch(self, n: int, split: str = "train", generator: torch.Generator | None = None,
              rows: slice | None = None) -> Tensor:
        """`n` rows drawn with `generator`; `rows` keeps only those rows (a rank's part of a
        global batch), reading no others, while the generator advances as for all `n`."""


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class TextData:
    """A text file as byte tokens; the first (1 - val_fraction) of it trains, the tail is held out."""

    def __init__(self, path: str | os.PathLike, seq_len: int, val_fraction: float = 0.1,
                 seed: int = 0):
        self.path = os.fspath(path)
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        raw = _read_bytes(self.path)
        window = seq_len + 1
        n_val = int(len(raw) * val_fraction)
        n_train = len(raw) - n_val
        if n_train < window:
            raise TitancError(
                f"data file {self.path} has {n_train} training bytes, fewer than one window of "
                f"model.seq_len+1 = {window}; use a longer file or a smaller model.seq_len")
        if val_fraction > 0 and n_val < window:
            raise TitancError(
                f"data file {self.path}: its held-out tail (data.val_fraction={val_fraction}) "
                f"has {n_val} bytes, fewer than one window of model.seq_len+1 = {window}; "
                f"use a longer file or a larger data.val_fraction")
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self._splits = {"train": tokens[:n_train], "val": tokens[n_train:]}
        self._gens = {s: _generator(seed + i) for i, s in enumerate(SPLITS)}
        self.description = f"{self.path} ({len(raw):,} bytes, {n_val:,} held out)"

    def __len__(self) -> int:
        return sum(len(t) for t in self._splits.values())

    def split_tokens(self, split: str) -> Tensor:
        """The split's bytes as a uint8 tensor."""
        _check_split(split)
        return self._splits[split]

    def has_split(self, split: str) -> bool:
        return len(self.split_tokens(split)) > self.seq_len

    def batch(self, n: int, split: str = "train", generator: torch.Generator | None = None,
              rows: slice | None = None) -> Tensor:
        """`n` random windows of seq_len+1 consecutive bytes from `split`: int64 [n, seq_len+1]
        (only `rows` of them, when given)."""
        data = self.split_tokens(split)
        if not self.has_split(split):
            raise TitancError(f"data file {self.path} has no {split} split "
                              f"(data.val_fraction={self.val_fraction}); set data.val_fraction > 0")
        gen = generator if generator is not None else self._gens[split]
        window = self.seq_len + 1
        starts = torch.randint(0, len(data) - window + 1, (n,), generator=gen)
        if rows is not None:
            starts = starts[rows]
        return data[starts[:, None] + torch.arange(window)].long()

    def unigram_entropy(self, split: str = "val") -> float:
        """Cross-entropy in nats of `split` under the byte frequencies of the training split
        (each count + UNIGRAM_PSEUDOCOUNT): the loss of a model that ignores context."""
        counts = torch.bincount(self._splits["train"].long(), minlength=VOCAB_SIZE).double()
        counts += UNIGRAM_PSEUDOCOUNT
        logp = counts.log() - counts.sum().log()
        data = self.split_tokens(split)
        if len(data) == 0:
            data = self._splits["train"]
        freq = torch.bincount(data.long(), minlength=VOCAB_SIZE).double()
        return float(-(freq * logp).sum() / freq.sum())


def _read_bytes(path: str) -> bytes:
    if not os.path.exists(path):
        raise TitancError(f"data file {path} does not exist; pass a text file or "
                          f"{SYNTHETIC_RECALL} as --data or data.source")
    if os.path.isdir(path):
        raise TitancError(f"data file {path} is a directory; pass a text file")
    if not stat.S_ISREG(os.stat(path).st_mode):     # /dev/zero never ends; a FIFO blocks
        raise TitancError(f"data file {path} is not a regular file (a device, FIFO or "
                          f"socket); pass a text file")
    _check_not_prepared_input(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise TitancError(f"data file {path} cannot be read: {exc.strerror or exc}") from None
    if not raw:
        raise TitancError(f"data file {path} is empty; pass a text file with at least one "
                          f"training window of text")
    _check_utf8(raw, path)
    return raw


_RECORD_SUFFIXES = (".jsonl", ".parquet")
_UTF8_BLOCK = 1 << 24


def _check_not_prepared_input(path: str) -> None:
    """A file read as bytes must be text: a shard of a token-shard set, or a .jsonl /
    .parquet file (whose text is a field of each record), would train on its raw bytes."""
    parent = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    if name.endswith((".bin", ".docs")) and os.path.isfile(os.path.join(parent, "header.json")):
        raise TitancError(f"data file {path} is a token shard of the shard set in {parent}; "
                          f"pass the directory: --data {parent}")
    if name.lower().endswith(_RECORD_SUFFIXES):
        raise TitancError(f"data file {path} holds records, not plain text (only their text "
                          f"field is text); prepare shards with 'titanc data prepare {path} "
                          f"-o DIR' and pass --data DIR")


def _check_utf8(raw: bytes, path: str) -> None:
    """The bytes are UTF-8 text (a block at a time, cut at character starts)."""
    i, n = 0, len(raw)
    while i < n:
        j = min(n, i + _UTF8_BLOCK)
        while i < j < n and (raw[j] & 0xC0) == 0x80:      # do not split a character
            j -= 1
        if j == i:
            j = min(n, i + _UTF8_BLOCK)
        try:
            raw[i:j].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TitancError(
                f"data file {path} is not UTF-8 text (byte 0x{raw[i + exc.start]:02x} at offset "
                f"{i + exc.start}); convert it to UTF-8, or prepare shards of text files with "
                f"'titanc data prepare'") from None
        i = j


@dataclass(frozen=True, slots=True)
class RecallLayout:
    """Where things sit in a recall sequence of `length` = seq_len + 1 tokens."""
    length: int
    n_pairs: int
    n_queries: int
    key_range: tuple[int, int]      # [lo, hi) token ids
    value_range: tuple[int, int]
    filler_range: tuple[int, int]

    @property
    def query_start(self) -> int:
        return self.length - 2 * self.n_queries

    @property
    def query_positions(self) -> Tensor:
        """Token indices of the queried keys; the logits there must predict the value."""
        return torch.arange(self.n_queries) * 2 + self.query_start


class SyntheticRecall:
    """Multi-query associative recall (see the module docstring for the layout)."""

    def __init__(self, seq_len: int, vocab_size: int = VOCAB_SIZE, seed: int = 0,
                 n_pairs: int | None = None, n_queries: int | None = None, *,
                 n_keys: int | None = None, n_values: int | None = None,
                 filler_tokens: int | None = None):
        """`n_keys` / `n_values`: sizes of the key and value alphabets (tokens [0, n_keys) and
        [n_keys, n_keys + n_values)); each defaults to a quarter of `vocab_size`.
        `filler_tokens`: how many distinct filler tokens (from n_keys + n_values up) are drawn;
        default all the remaining vocabulary. Chance accuracy is 1 / n_values."""
        length = seq_len + 1
        if n_pairs is None:
            n_pairs = max(1, min(8, length // 8))
        if n_queries is None:
            n_queries = n_pairs
        if vocab_size < 8 and n_keys is None and n_values is None:
            raise TitancError(f"{SYNTHETIC_RECALL} needs model.vocab_size >= 8 (disjoint key, "
                              f"value and filler tokens), got {vocab_size}")
        if n_keys is None:
            n_keys = vocab_size // 4
            keys_from = f"a quarter of model.vocab_size={vocab_size}"
        else:
            keys_from = "n_keys"
        if n_values is None:
            n_values = vocab_size // 4
        if n_keys < 1 or n_values < 1 or n_keys + n_values >= vocab_size:
            raise TitancError(f"{SYNTHETIC_RECALL}: n_keys={n_keys} and n_values={n_values} "
                              f"must be >= 1 and leave at least one filler token in "
                              f"model.vocab_size={vocab_size}")
        f_lo = n_keys + n_values
        if filler_tokens is None:
            filler_tokens = vocab_size - f_lo
        if not 1 <= filler_tokens <= vocab_size - f_lo:
            raise TitancError(f"{SYNTHETIC_RECALL}: filler_tokens={filler_tokens} must be in "
                              f"[1, {vocab_size - f_lo}] (the vocabulary left after keys and "
                              f"values)")
        if not 1 <= n_pairs <= n_keys:
            raise TitancError(f"{SYNTHETIC_RECALL}: n_pairs={n_pairs} must be in [1, "
                              f"{n_keys}] ({keys_from})")
        if not 1 <= n_queries <= n_pairs:
            raise TitancError(f"{SYNTHETIC_RECALL}: n_queries={n_queries} must be in [1, "
                              f"n_pairs={n_pairs}]")
        if 2 * (n_pairs + n_queries) > length:
            raise TitancError(
                f"{SYNTHETIC_RECALL}: {n_pairs} pairs and {n_queries} queries need "
                f"{2 * (n_pairs + n_queries)} tokens, more than model.seq_len+1 = {length}; "
                f"raise model.seq_len")
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.layout = RecallLayout(length, n_pairs, n_queries, (0, n_keys), (n_keys, f_lo),
                                   (f_lo, f_lo + filler_tokens))
        self._gens = {s: _generator(seed + i) for i, s in enumerate(SPLITS)}
        self.description = (f"{SYNTHETIC_RECALL} ({n_pairs} pairs, {n_queries} queries, "
                            f"{length - 2 * (n_pairs + n_queries)} filler tokens)")

    @property
    def chance(self) -> float:
        """Accuracy of a model that knows which tokens are values but not the pairs."""
        lo, hi = self.layout.value_range
        return 1.0 / (hi - lo)

    @property
    def max_distance(self) -> int:
        """The pair -> query distance with the pairs at the start (the default layout)."""
        return self.layout.query_start - 2 * self.layout.n_pairs + 1

    def batch(self, n: int, split: str = "train", generator: torch.Generator | None = None,
              rows: slice | None = None, distance: int | None = None) -> Tensor:
        """`n` fresh recall sequences: int64 [n, seq_len+1] (only `rows` of them, when given:
        a rank's part of a global batch). Both splits draw from the same
        distribution (each sequence has its own mapping, so nothing can be memorised).

        `distance` moves the pair block right (filler before it) so that the first query key
        sits `distance` positions after the last pair's value; every pair -> query distance is
        then in [distance, distance + 2(P+Q) - 4]. Default: pairs at the start,
        `max_distance`. The draws are the same for every distance (only the layout moves)."""
        _check_split(split)
        gen = generator if generator is not None else self._gens[split]
        lay = self.layout
        top = self.max_distance
        if distance is None:
            distance = top
        if not 1 <= distance <= top:
            raise TitancError(f"{SYNTHETIC_RECALL}: distance={distance} must be in [1, {top}] "
                              f"for seq_len={self.seq_len} with {lay.n_pairs} pairs and "
                              f"{lay.n_queries} queries; raise seq_len")
        p0 = top - distance                      # first pair token
        (k_lo, k_hi), (v_lo, v_hi), (f_lo, f_hi) = lay.key_range, lay.value_range, lay.filler_range
        # P distinct keys per row: the first P of a random permutation of the key range
        keys = torch.rand(n, k_hi - k_lo, generator=gen).argsort(dim=1)[:, :lay.n_pairs] + k_lo
        values = torch.randint(v_lo, v_hi, (n, lay.n_pairs), generator=gen)
        order = torch.rand(n, lay.n_pairs, generator=gen).argsort(dim=1)[:, :lay.n_queries]
        out = torch.randint(f_lo, f_hi, (n, lay.length), generator=gen)
        out[:, p0:p0 + 2 * lay.n_pairs:2] = keys
        out[:, p0 + 1:p0 + 2 * lay.n_pairs:2] = values
        q = lay.query_start
        out[:, q::2] = keys.gather(1, order)
        out[:, q + 1::2] = values.gather(1, order)
        return out if rows is None else out[rows]

    def query_mask(self, n: int) -> Tensor:
        """float64 [n, seq_len]: 1 at the positions whose target is a queried value (the
        `loss_mask` of `data.loss: queries`), 0 elsewhere."""
        mask = torch.zeros(n, self.seq_len, dtype=torch.float64)
        mask[:, self.layout.query_positions] = 1.0
        return mask

    def accuracy(self, logits_or_prog: Any, tokens: Tensor) -> float:
        """Fraction of query positions whose argmax prediction is the paired value. Takes logits
        [B, T, V] for `tokens` [B, T+1], or a program with `logits(tokens)`."""
        logits = _logits(logits_or_prog, tokens)
        pos = self.layout.query_positions
        pred = logits[:, pos].argmax(dim=-1).cpu()     # a program on CUDA returns device logits
        return float((pred == tokens[:, pos + 1].cpu()).double().mean())


def _logits(logits_or_prog: Any, tokens: Tensor) -> Tensor:
    if isinstance(logits_or_prog, Tensor):
        logits = logits_or_prog
    else:
        fn = getattr(logits_or_prog, "logits", None)
        if fn is None:
            raise TitancError("recall accuracy needs the program's logits, and this "
                              f"{type(logits_or_prog).__name__} has no logits(tokens) method")
        logits = fn(tokens)
    want = (tokens.shape[0], tokens.shape[1] - 1)
    if logits.dim() != 3 or tuple(logits.shape[:2]) != want:
        raise ValueError(f"logits must be [B, T, V] with (B, T) = {want}, "
                         f"got {list(logits.shape)}")
    return logits


def recall_accuracy(prog: Any, tokens: Tensor, data: SyntheticRecall | None = None) -> float:
    """Recall accuracy of `prog` (a program with `logits`) on recall `tokens` [B, T+1]."""
    if data is None:
        data = SyntheticRecall(tokens.shape[1] - 1, getattr(prog, "vocab_size", None)
                               or prog.spec.model.vocab_size)
    return data.accuracy(prog, tokens)


# ---------------------------------------------------------------------------------- choosing


def draw(data: Any, spec: Any, n: int, split: str, generator: torch.Generator | None,
         rows: slice | None = None) -> tuple[Tensor, dict[str, Tensor] | None]:
    """A batch as the program takes it: tokens, and with `data.documents` the rows'
    doc_start / loss_mask (`ShardData.batch_documents`, packed or not per `data.pack`); with
    `data.loss: queries` a loss_mask of the recall task's query targets."""
    if spec.data.loss == "queries":             # the recall task's queried values alone
        tokens = data.batch(n, split, generator, rows=rows)
        return tokens, {"loss_mask": data.query_mask(tokens.shape[0])}
    if not spec.data.documents or not hasattr(data, "batch_documents"):
        # synthetic:recall: every sequence is one document, the program's default for a
        # batch without document inputs (every target counts)
        return data.batch(n, split, generator, rows=rows), None
    return data.batch_documents(n, split, generator, rows=rows, pack=spec.data.pack)


def make_data(spec_or_source: Any, seq_len: int | None = None, vocab_size: int | None = None,
              seed: int = 0, val_fraction: float = 0.1) -> Dataset:
    """The dataset a spec (or a source string with the sizes given) asks for:
    `synthetic:recall`, a path to a text file, or a token-shard directory (runtime/data/shards.py)."""
    if isinstance(spec_or_source, (str, os.PathLike)):
        source = os.fspath(spec_or_source)
        if seq_len is None:
            raise TypeError("make_data(source, ...) needs seq_len")
        vocab_size = VOCAB_SIZE if vocab_size is None else vocab_size
    else:
        spec = spec_or_source
        source = spec.data.source
        seq_len = spec.model.seq_len if seq_len is None else seq_len
        vocab_size = spec.model.vocab_size if vocab_size is None else vocab_size
        seed = spec.train.seed
        val_fraction = spec.data.val_fraction
    if source == SYNTHETIC_RECALL:
        return SyntheticRecall(seq_len, vocab_size, seed)
    if source.startswith("synthetic:"):
        raise TitancError(f"unknown synthetic task {source!r}; the known task is "
                          f"{SYNTHETIC_RECALL}")
    from titanc.runtime.data.tokenizer import BYTE, load_tokenizer
    tok = None if isinstance(spec_or_source, (str, os.PathLike)) else load_tokenizer(spec)
    if os.path.isdir(source):                    # token shards from 'titanc data prepare'
        from titanc.runtime.data.shards import ShardData
        shards = ShardData(source, seq_len, vocab_size, tokenizer=tok, seed=seed)
        if not isinstance(spec_or_source, (str, os.PathLike)) and spec.data.documents:
            shards.doc_starts("train")           # fail now, not at the first step
        return shards
    if not isinstance(spec_or_source, (str, os.PathLike)) and spec.data.documents:
        raise TitancError(f"data.documents: true needs document starts, which only token "
                          f"shards record; prepare {source} with 'titanc data prepare "
                          f"{source} -o DIR', set data.source to DIR, or set "
                          f"data.documents=false")
    if tok is not None and tok.name != BYTE:
        raise TitancError(f"data.source {source} is a text file, read as bytes, but "
                          f"data.tokenizer is {tok.name}; prepare shards with 'titanc data "
                          f"prepare {source} -o DIR --tokenizer {tok.name}' and set "
                          f"data.source to DIR")
    if vocab_size < VOCAB_SIZE:
        raise TitancError(f"text data is byte-level and needs model.vocab_size >= {VOCAB_SIZE}, "
                          f"got {vocab_size}; set model.vocab_size=256")
    return TextData(source, seq_len, val_fraction, seed)
