"""Token shards (the nanoGPT convention): `train.bin` / `val.bin` plus `header.json`.

    DIR/header.json   {"format": "titanc-shards", "version": 1, "dtype": "uint16",
                       "tokenizer": {name, kind, vocab_size, eot, hash},
                       "splits": {"train": {"file": "train.bin", "tokens": N}, "val": {...}},
                       "sources": [{path, bytes}], "text_bytes": ..., "val_fraction": ...}
    DIR/train.bin     the token ids, raw little-endian uint16 (uint32 when the vocabulary
    DIR/val.bin       does not fit in 16 bits), documents separated by the tokenizer's eot id
    DIR/train.docs    each split's document starts, little-endian int64 token offsets, the
    DIR/val.docs      first 0 (header "docs": {split: {file, count, sha256}}; `data.documents`)

`titanc data prepare` writes them (runtime/data/prepare.py); `ShardData` reads them by
`numpy.memmap`, so a corpus of any size costs only the pages the sampled windows touch.
A batch is `n` random windows of seq_len + 1 tokens drawn from the `torch.Generator` it is
handed (the trainer's, saved in checkpoints), so batches are a function of the seed and the
step and a resumed run continues the exact stream. `batch_documents` also returns each
token's document start and the loss mask (docs/data.md "Documents").

Opening checks, each a one-line `TitancError` naming the file and the fix: the header exists
and parses; each shard exists, is non-empty and has exactly `tokens x itemsize` bytes (a
truncated or padded file is refused); the tokenizer's hash matches the one the shards were
prepared with; the vocabulary fits the model; each split holds at least one window; a split's
document starts (`data.documents`) match the sha256 the header records for them. The first
million tokens of each shard are range-checked when opened, and every batch is checked
before it is returned, so a corrupt shard never trains silently on out-of-range ids.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from titanc.errors import TitancError

from titanc.runtime.data.tokenizer import Tokenizer

__all__ = ["HEADER", "FORMAT", "SPLITS", "ShardData", "read_header", "dtype_for"]

HEADER = "header.json"
FORMAT = "titanc-shards"
VERSION = 1
SPLITS = ("train", "val")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
CHECK_ON_OPEN = 1 << 20        # tokens range-checked per shard when opened
_PREPARE = "prepare them with 'titanc data prepare INPUT... -o {d}'"


def dtype_for(vocab_size: int) -> str:
    """uint16 when every id fits in 16 bits, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_header(directory: str | os.PathLike) -> dict[str, Any]:
    """The validated header.json of a shard directory."""
    d = Path(directory)
    path = d / HEADER
    if not d.is_dir():
        raise TitancError(f"shard directory {d} does not exist; {_PREPARE.format(d=d)}")
    if not path.exists():
        raise TitancError(f"{d} holds no {HEADER}, so it is not a token-shard directory; "
                          f"{_PREPARE.format(d=d)}")
    try:
        header = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, OSError):
        raise TitancError(f"{path} is not a JSON shard header (corrupt or not written by "
                          f"titanc); {_PREPARE.format(d=d)}") from None
    ok = (isinstance(header, dict) and header.get("format") == FORMAT
          and header.get("dtype") in DTYPES and isinstance(header.get("splits"), dict)
          and isinstance(header.get("tokenizer"), dict))
    if not ok:
        raise TitancError(f"{path} is not a titanc shard header (format, dtype, splits, "
                          f"tokenizer); {_PREPARE.format(d=d)}")
    if header.get("version") != VERSION:
        raise TitancError(f"{path} has shard format version {header.get('version')}, this "
                          f"titanc reads version {VERSION}; {_PREPARE.format(d=d)}")
    _check_fields(header, path, d)
    return header


def _count(value: Any) -> bool:
    """A token or offset count as titanc writes it: a non-negative JSON integer."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_fields(header: dict[str, Any], path: Path, d: Path) -> None:
    """The fields the loader reads have the types `titanc data prepare` writes: a damaged or
    hand-edited header is one line naming the field, never a traceback."""
    def bad(field: str, want: str, value: Any) -> TitancError:
        return TitancError(f"{path}: {field} is {json.dumps(value)[:40]}, not {want}; the "
                           f"header is damaged; {_PREPARE.format(d=d)}")

    vocab = header["tokenizer"].get("vocab_size", 0)
    if not _count(vocab):
        raise bad("tokenizer.vocab_size", "a non-negative integer", vocab)
    for split, entry in header["splits"].items():
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise bad(f"splits.{split}", "an object {file, tokens}", entry)
        if not _count(entry.get("tokens", 0)):
            raise bad(f"splits.{split}.tokens", "a non-negative integer", entry.get("tokens"))
        if not isinstance(entry.get("file", ""), str):
            raise bad(f"splits.{split}.file", "a file name", entry.get("file"))
    docs = header.get("docs")
    if docs is None:
        return
    if not isinstance(docs, dict):
        raise bad("docs", "an object {split: {file, count}}", docs)
    for split, entry in docs.items():
        if not isinstance(entry, dict):
            raise bad(f"docs.{split}", "an object {file, count}", entry)
        if not _count(entry.get("count", 0)):
            raise bad(f"docs.{split}.count", "a non-negative integer", entry.get("count"))
        if not isinstance(entry.get("file"), str):
            raise bad(f"docs.{split}.file", "a file name", entry.get("file"))


class ShardData:
    """A shard directory as a dataset: `batch(n, split, generator) -> int64 [n, seq_len+1]`."""

    def __init__(self, directory: str | os.PathLike, seq_len: int, vocab_size: int, *,
                 tokenizer: Tokenizer | None = None, seed: int = 0):
        self.directory = Path(directory)
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.header = header = read_header(self.directory)
        info = header["tokenizer"]
        if tokenizer is not None and info.get("hash") != tokenizer.hash:
            raise TitancError(
                f"{self.directory / HEADER}: the shards were prepared with tokenizer "
                f"{info.get('name')} (hash {str(info.get('hash'))[:12]}), not with "
                f"{tokenizer.name} (hash {tokenizer.hash[:12]}); set data.tokenizer to the "
                f"tokenizer they were prepared with or prepare them again with --tokenizer "
                f"{tokenizer.name}")
        if int(info.get("vocab_size", 0)) > vocab_size:
            raise TitancError(f"{self.directory / HEADER}: the shards' tokenizer has "
                              f"{info['vocab_size']} tokens, more than model.vocab_size="
                              f"{vocab_size}; set model.vocab_size={info['vocab_size']}")
        self.dtype = np.dtype(DTYPES[header["dtype"]])
        self._arrays: dict[str, np.memmap | None] = {s: self._open(s) for s in SPLITS}
        self._docs: dict[str, np.ndarray] = {}
        if self._arrays["train"] is None or len(self._arrays["train"]) < seq_len + 1:
            n = 0 if self._arrays["train"] is None else len(self._arrays["train"])
            raise TitancError(
                f"{self._path('train')} has {n} tokens, fewer than one window of "
                f"model.seq_len+1 = {seq_len + 1}; prepare a longer corpus or use a smaller "
                f"model.seq_len")
        import torch   # lazily: `titanc data prepare` workers import this module without torch

        self._gens = {s: torch.Generator().manual_seed(seed + i) for i, s in enumerate(SPLITS)}
        n_train = len(self._arrays["train"])
        n_val = 0 if self._arrays["val"] is None else len(self._arrays["val"])
        self.description = (f"{self.directory} ({n_train + n_val:,} {header['dtype']} tokens, "
                            f"{n_val:,} held out, tokenizer {info.get('name')})")

    def _path(self, split: str) -> Path:
        entry = self.header["splits"].get(split) or {}
        return self.directory / str(entry.get("file", f"{split}.bin"))

    def _open(self, split: str) -> np.memmap | None:
        entry = self.header["splits"].get(split)
        if entry is None or int(entry.get("tokens", 0)) == 0:
            if split == "train":
                raise TitancError(f"{self.directory / HEADER} lists no training tokens; "
                                  f"{_PREPARE.format(d=self.directory)}")
            return None
        path, tokens = self._path(split), int(entry["tokens"])
        fix = f"the shard is truncated or corrupt; {_PREPARE.format(d=self.directory)}"
        if not path.exists():
            raise TitancError(f"shard {path} does not exist (the header lists {tokens:,} "
                              f"tokens); {_PREPARE.format(d=self.directory)}")
        size = path.stat().st_size
        if size == 0:
            raise TitancError(f"shard {path} is empty (the header lists {tokens:,} tokens); "
                              f"{fix}")
        if size != tokens * self.dtype.itemsize:
            raise TitancError(f"shard {path} has {size:,} bytes, but the header lists "
                              f"{tokens:,} {self.dtype.name} tokens = "
                              f"{tokens * self.dtype.itemsize:,} bytes; {fix}")
        head = np.fromfile(path, dtype=self.dtype, count=min(tokens, CHECK_ON_OPEN))
        self._check_range(head, path, 0)
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(tokens,))

    def _check_range(self, tokens: np.ndarray, path: Path, where: int | None) -> None:
        limit = int(self.header["tokenizer"].get("vocab_size", self.vocab_size))
        if tokens.size and int(tokens.max()) >= limit:
            bad = int(np.argmax(tokens >= limit))
            at = f"at token {where + bad:,}" if where is not None else "in a sampled window"
            raise TitancError(f"shard {path} holds token id {int(tokens.max())} {at}, outside "
                              f"the tokenizer's {limit} ids: the file is corrupt or binary "
                              f"garbage; {_PREPARE.format(d=self.directory)}")

    def __len__(self) -> int:
        return sum(len(a) for a in self._arrays.values() if a is not None)

    def split_array(self, split: str) -> np.ndarray:
        """The split's tokens as a read-only memmap (empty when the split has none)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        arr = self._arrays[split]
        return np.zeros(0, dtype=self.dtype) if arr is None else arr

    def has_split(self, split: str) -> bool:
        return len(self.split_array(split)) > self.seq_len

    def windows(self, split: str, starts: np.ndarray) -> "torch.Tensor":
        """Windows of seq_len + 1 tokens at `starts`: int64 [len(starts), seq_len+1]."""
        arr = self.split_array(split)
        idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(self.seq_len + 1)
        rows = arr[idx]                                    # reads only the touched pages
        self._check_range(rows, self._path(split), None)
        import torch

        return torch.from_numpy(rows.astype(np.int64))

    def _window_starts(self, n: int, split: str, generator: "torch.Generator | None",
                       rows: slice | None) -> np.ndarray:
        if not self.has_split(split):
            raise TitancError(f"{self._path(split)} has fewer than model.seq_len+1 = "
                              f"{self.seq_len + 1} tokens, so there is no {split} split; "
                              f"prepare the shards with a larger --val-fraction")
        import torch

        gen = generator if generator is not None else self._gens[split]
        high = len(self.split_array(split)) - self.seq_len
        starts = torch.randint(0, high, (n,), generator=gen)
        if rows is not None:
            starts = starts[rows]
        return starts.numpy()

    def batch(self, n: int, split: str = "train", generator: "torch.Generator | None" = None,
              rows: slice | None = None) -> "torch.Tensor":
        """`n` random windows of seq_len+1 tokens from `split`: int64 [n, seq_len+1] (only
        `rows` of them, when given: a rank reads only its part of a global batch)."""
        return self.windows(split, self._window_starts(n, split, generator, rows))

    def doc_starts(self, split: str) -> np.ndarray:
        """The split's document starts (int64, sorted, the first 0), from `<split>.docs`."""
        if split not in self._docs:
            if split in SPLITS and not len(self.split_array(split)):
                raise TitancError(f"{self.directory / HEADER} lists no {split} tokens, so "
                                  f"there is no {split} split; prepare the shards with a "
                                  f"larger --val-fraction")
            entry = (self.header.get("docs") or {}).get(split)
            if not isinstance(entry, dict):
                raise TitancError(
                    f"{self.directory / HEADER} records no document starts for {split} "
                    f"(shards prepared before titanc wrote them); prepare them again with "
                    f"'titanc data prepare INPUT... -o {self.directory} --overwrite', or set "
                    f"data.documents=false")
            arr = self._read_docs(split, entry)
            if arr[0] != 0 or np.any(np.diff(arr) < 0) or arr[-1] >= len(self.split_array(split)):
                path = self.directory / str(entry.get("file"))
                raise TitancError(f"document starts {path} are not increasing offsets from 0 "
                                  f"inside the split; {_PREPARE.format(d=self.directory)}")
            # an empty document (a .jsonl record of "" under the byte tokenizer, in shards
            # prepared before those were skipped) repeats its successor's start: it holds no
            # token, so it is no document (pack=false would draw it as a row of padding)
            self._docs[split] = arr if np.all(np.diff(arr) > 0) else np.unique(arr)
        return self._docs[split]

    def _read_docs(self, split: str, entry: dict[str, Any]) -> np.ndarray:
        """The offsets of `<split>.docs`, their count and sha256 as the header records them."""
        path, count = self.directory / str(entry.get("file")), int(entry.get("count", 0))
        again = (f"prepare them again with 'titanc data prepare INPUT... -o {self.directory} "
                 f"--overwrite'")
        if not isinstance(entry.get("sha256"), str):
            raise TitancError(f"{self.directory / HEADER} records no checksum of {split}'s "
                              f"document starts (shards prepared before titanc checked them), "
                              f"so a damaged offset would go unseen; {again}, or set "
                              f"data.documents=false")
        try:
            whole = count > 0 and path.is_file() and path.stat().st_size == count * 8
            raw = path.read_bytes() if whole else b""
        except OSError:
            raw = b""
        if len(raw) != count * 8 or count == 0:
            raise TitancError(f"document starts {path} are missing or not {count} int64 "
                              f"offsets; {_PREPARE.format(d=self.directory)}")
        if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
            raise TitancError(f"document starts {path} do not match the checksum in "
                              f"{HEADER} (the file is damaged or was edited); {again}")
        return np.frombuffer(raw, dtype="<i8")

    def window_documents(self, split: str, starts: np.ndarray) -> dict[str, "torch.Tensor"]:
        """doc_start and loss_mask float64 [len(starts), seq_len] of the windows at `starts`
        (as `windows`): each input token's document start in its row (0 when the document
        began before the row), and 0 in the mask where the target begins a document."""
        import torch

        docs = self.doc_starts(split)
        starts = np.asarray(starts, dtype=np.int64)
        pos = starts[:, None] + np.arange(self.seq_len)        # each input token's offset
        first = docs[np.searchsorted(docs, pos, side="right") - 1]
        doc_start = np.maximum(first - starts[:, None], 0)
        nxt = np.searchsorted(docs, pos + 1, side="left")
        begins = docs[np.minimum(nxt, len(docs) - 1)] == pos + 1
        return {"doc_start": torch.from_numpy(doc_start.astype(np.float64)),
                "loss_mask": torch.from_numpy((~begins).astype(np.float64))}

    def batch_documents(self, n: int, split: str = "train",
                        generator: "torch.Generator | None" = None, rows: slice | None = None,
                        pack: bool = True) -> tuple["torch.Tensor", dict[str, "torch.Tensor"]]:
        """`n` rows with their documents: tokens int64 [n, seq_len+1] and {"doc_start",
        "loss_mask"} float64 [n, seq_len] (docs/data.md "Documents"). `pack`: random windows
        of the stream, doc_start each token's document start in its row, the targets that
        begin a document masked; else one document per row from its start, truncated to the
        row or padded with id 0, every target past its end masked (doc_start all 0)."""
        import torch

        if pack:
            starts = self._window_starts(n, split, generator, rows)
            return self.windows(split, starts), self.window_documents(split, starts)
        docs = self.doc_starts(split)
        gen = generator if generator is not None else self._gens[split]
        pick = torch.randint(0, len(docs), (n,), generator=gen)
        if rows is not None:
            pick = pick[rows]
        return self.document_rows(split, pick.numpy())

    def document_rows(self, split: str, k: np.ndarray
                      ) -> tuple["torch.Tensor", dict[str, "torch.Tensor"]]:
        """Rows of `data.pack: false` for the split's documents number `k` (as
        `batch_documents(pack=False)`): each from its document's first token, truncated to
        the row or padded with id 0, and the loss mask of the targets inside the document."""
        import torch

        docs = self.doc_starts(split)
        arr = self.split_array(split)
        T = self.seq_len
        k = np.asarray(k, dtype=np.int64)
        starts = docs[k]
        ends = np.where(k + 1 < len(docs), docs[np.minimum(k + 1, len(docs) - 1)], len(arr))
        idx = starts[:, None] + np.arange(T + 1)
        ids = np.where(idx < ends[:, None], arr[np.minimum(idx, len(arr) - 1)], 0)
        self._check_range(ids, self._path(split), None)
        tokens = torch.from_numpy(ids.astype(np.int64))
        pos = starts[:, None] + np.arange(T)                   # each input token's offset
        doc_start = np.zeros_like(pos)
        mask = pos + 1 < ends[:, None]
        return tokens, {"doc_start": torch.from_numpy(doc_start.astype(np.float64)),
                        "loss_mask": torch.from_numpy(mask.astype(np.float64))}
