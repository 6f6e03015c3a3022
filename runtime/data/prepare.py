"""`titanc data prepare`: tokenize a corpus into train.bin / val.bin + header.json in parallel.

    header = prepare(["wiki/", "dump.jsonl"], "data/wiki", tokenizer="tokenizer.json")

The corpus is cut into pieces (runtime/data/corpus.py); worker processes (`workers`; by default
the CPU count, fewer for a small corpus) each load the tokenizer once and tokenize pieces; the
parent writes their token arrays in input order, so the output does not depend on the number
of workers. The tokenizer's end-of-text id (BPE) follows every document. Tokens go to
`train.bin` as they arrive; at the end the last `val_fraction` of the stream moves to `val.bin`
and `header.json` is written last, atomically, so a directory with a header is complete.
Memory stays bounded: at most `2 x workers` pieces are in flight.
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from titanc.config import set_worker_environment
from titanc.errors import TitancError

from titanc.runtime.data.corpus import PIECE_BYTES, Piece, plan, read_piece
from titanc.runtime.data.shards import FORMAT, HEADER, VERSION, dtype_for
from titanc.runtime.data.tokenizer import BYTE, ByteTokenizer, Tokenizer, load_tokenizer, tokenizer_info

__all__ = ["prepare"]

_COPY_TOKENS = 1 << 22          # tokens per block when moving the held-out tail to val.bin

# -- worker side -------------------------------------------------------------------------------
_worker_tok: Tokenizer | None = None


def _init_worker(tokenizer: str) -> None:
    global _worker_tok
    # one process per core already: keep the tokenizers library from adding its own threads
    set_worker_environment(TOKENIZERS_PARALLELISM="false")
    _worker_tok = load_tokenizer(tokenizer)


def _tokenize(piece: Piece, text_field: str, dtype: str,
              tok: Tokenizer | None = None) -> tuple[np.ndarray, int]:
    """Token ids of one piece (eot after each document end) and its UTF-8 byte count."""
    tok = tok or _worker_tok
    assert tok is not None, "worker not initialised"
    texts, ends = [], []
    for text, end in read_piece(piece, text_field):
        texts.append(text)
        ends.append(end)
    raw = [t.encode("utf-8") for t in texts]
    if isinstance(tok, ByteTokenizer):                     # the ids are the bytes
        encoded = [np.frombuffer(r, dtype=np.uint8) for r in raw]
    elif hasattr(tok, "encode_batch"):
        encoded = [np.asarray(ids, dtype=dtype) for ids in tok.encode_batch(texts)]
    else:
        encoded = [np.asarray(tok.encode(t), dtype=dtype) for t in texts]
    eot = np.asarray([] if tok.eot is None else [tok.eot], dtype=dtype)
    parts = [p for ids, end in zip(encoded, ends) for p in ((ids, eot) if end else (ids,))]
    out = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    return out, sum(len(r) for r in raw)


# -- parent side -------------------------------------------------------------------------------
def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise TitancError(f"-o {out} is a file; pass a directory for the shards")
    existing = [n for n in (HEADER, "train.bin", "val.bin") if (out / n).exists()]
    if existing and not overwrite:
        raise TitancError(f"-o {out} already holds shards ({', '.join(existing)}); choose "
                          f"another directory or pass --overwrite")


def _results(pieces: list[Piece], tok: Tokenizer, tok_name: str, text_field: str, dtype: str,
             workers: int):
    """(piece, tokens, bytes) in input order; at most 2·workers pieces in flight."""
    if workers <= 1 or len(pieces) <= 1:
        for p in pieces:
            yield (p, *_tokenize(p, text_field, dtype, tok))
        return
    import multiprocessing as mp

    ctx = mp.get_context("spawn")          # no forked copy of torch / tokenizers threads
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(tok_name,)) as pool:
        pending: deque[tuple[Piece, Future]] = deque()
        it = iter(pieces)
        for p in it:
            pending.append((p, pool.submit(_tokenize, p, text_field, dtype)))
            if len(pending) >= 2 * workers:
                break
        while pending:
            p, fut = pending.popleft()
            try:
                yield (p, *fut.result())
            except BaseException:
                for _, f in pending:
                    f.cancel()
                raise
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(_tokenize, nxt, text_field, dtype)))


def _move_tail(train: Path, val: Path, n_train: int, n_val: int, dtype: np.dtype) -> None:
    """Copy tokens [n_train, n_train + n_val) of `train` into `val`, then truncate `train`."""
    src = np.memmap(train, dtype=dtype, mode="r", shape=(n_train + n_val,))
    with open(val, "wb") as f:
        for s in range(n_train, n_train + n_val, _COPY_TOKENS):
            f.write(np.asarray(src[s:min(s + _COPY_TOKENS, n_train + n_val)]).tobytes())
    del src
    os.truncate(train, n_train * dtype.itemsize)


def prepare(inputs: Sequence[str | os.PathLike], out: str | os.PathLike, *,
            tokenizer: str = BYTE, val_fraction: float = 0.1, text_field: str = "text",
            ext: Sequence[str] | None = None, workers: int | None = None,
            progress: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """Tokenize `inputs` into shards in `out`; returns the header written (plus "seconds")."""
    if not 0 <= val_fraction < 1:
        raise TitancError(f"--val-fraction: {val_fraction} must be in [0, 1)")
    out = Path(out)
    _check_out(out, overwrite)
    tok = load_tokenizer(tokenizer)
    dtype = dtype_for(tok.vocab_size)
    pieces = plan(inputs, ext)
    if workers is None:  # a worker costs ~0.3 s to start: give each at least two pieces
        total = sum(p.size for p in pieces)
        workers = min(os.cpu_count() or 1, max(1, total // (2 * PIECE_BYTES)))
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        (out / HEADER).unlink(missing_ok=True)        # the old shards are invalid from now on
    train_tmp, val_tmp = out / "train.bin.tmp", out / "val.bin.tmp"
    from tqdm import tqdm

    t0 = time.perf_counter()
    total_bytes, n_tokens = 0, 0
    sources: dict[str, int] = {}
    bar = tqdm(total=sum(p.size for p in pieces), unit="B", unit_scale=True, desc="prepare",
               disable=not progress or None, dynamic_ncols=True, mininterval=0.5)
    try:
        with open(train_tmp, "wb") as f:
            for piece, ids, n_bytes in _results(pieces, tok, tokenizer, text_field, dtype,
                                                workers):
                f.write(ids.tobytes())
                n_tokens += len(ids)
                total_bytes += n_bytes
                sources[piece.path] = sources.get(piece.path, 0) + n_bytes
                bar.update(piece.size)
        if n_tokens == 0:
            raise TitancError(f"the inputs ({', '.join(map(str, inputs))}) hold no text; pass "
                              f"files with text in them")
        n_val = int(n_tokens * val_fraction)
        _move_tail(train_tmp, val_tmp, n_tokens - n_val, n_val, np.dtype(dtype))
        os.replace(train_tmp, out / "train.bin")
        os.replace(val_tmp, out / "val.bin")
    finally:
        bar.close()
        for tmp in (train_tmp, val_tmp):
            tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    header = {
        "format": FORMAT, "version": VERSION, "dtype": dtype,
        "tokenizer": tokenizer_info(tok),
        "splits": {"train": {"file": "train.bin", "tokens": n_tokens - n_val},
                   "val": {"file": "val.bin", "tokens": n_val}},
        "val_fraction": val_fraction, "text_bytes": total_bytes,
        "sources": [{"path": p, "bytes": b} for p, b in sources.items()],
    }
    tmp = out / (HEADER + ".tmp")
    tmp.write_text(json.dumps(header, indent=2) + "\n")
    os.replace(tmp, out / HEADER)
    return {**header, "seconds": seconds, "workers": workers}

