"""`titanc data prepare`: tokenize a corpus into train.bin / val.bin + header.json in parallel.

    header = prepare(["wiki/", "dump.jsonl"], "data/wiki", tokenizer="tokenizer.json")

The corpus is cut into pieces (runtime/data/corpus.py); worker processes (`workers`; by default
the CPU count, fewer for a small corpus) each load the tokenizer once and tokenize pieces; the
parent writes their token arrays in input order, so the output does not depend on the number
of workers. The tokenizer's end-of-text id (BPE) follows every document, and each split's
document starts go to `train.docs` / `val.docs` (int64 offsets, docs/data.md). Memory stays
bounded: at most `2 x workers` pieces are in flight; the workers die with the parent, whatever
kills it.

Nothing is destroyed before its replacement exists: the new shard set is built in a directory
beside DIR (`.DIR.partial-PID`): tokens go to its `train.bin` as they arrive, the last
`val_fraction` of the stream moves to `val.bin`, the document offsets follow, `header.json` is
written last; only then is it renamed into place (`--overwrite`: the old DIR renamed aside
first, deleted after). A failed or killed run leaves DIR as it was. Input directories that hold
a shard set, and DIR itself, are skipped with a notice (corpus.find_files), so shards are never
read back as text.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from titanc.config import set_worker_environment
from titanc.errors import TitancError
from titanc.files import holds_cwd, recover_swap, staging_dir, swap_in

from titanc.runtime.children import die_with_parent
from titanc.runtime.data.corpus import PIECE_BYTES, Piece, plan, read_piece
from titanc.runtime.data.shards import FORMAT, HEADER, VERSION, dtype_for
from titanc.runtime.data.tokenizer import BYTE, ByteTokenizer, Tokenizer, load_tokenizer, tokenizer_info

__all__ = ["prepare"]

_COPY_TOKENS = 1 << 22          # tokens per block when moving the held-out tail to val.bin

# -- worker side -------------------------------------------------------------------------------
_worker_tok: Tokenizer | None = None


def _init_worker(tokenizer: str, parent: int) -> None:
    global _worker_tok
    die_with_parent(parent)                  # a killed `data prepare` takes its workers along
    # one process per core already: keep the tokenizers library from adding its own threads
    set_worker_environment(TOKENIZERS_PARALLELISM="false")
    _worker_tok = load_tokenizer(tokenizer)


def _tokenize(piece: Piece, text_field: str, dtype: str,
              tok: Tokenizer | None = None) -> tuple[np.ndarray, int, np.ndarray]:
    """Token ids of one piece (eot after each document end), its UTF-8 byte count and the
    offsets in the ids just past each document end (eot included)."""
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
    sizes = np.cumsum([len(ids) + (len(eot) if end else 0) for ids, end in zip(encoded, ends)],
                      dtype=np.int64)
    doc_ends = sizes[np.asarray(ends, dtype=bool)] if len(ends) else np.zeros(0, np.int64)
    return out, sum(len(r) for r in raw), doc_ends


# -- parent side -------------------------------------------------------------------------------
def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise TitancError(f"-o {out} is a file; pass a directory for the shards")
    if out.is_dir() and next(os.scandir(out), None) is not None and holds_cwd(out):
        raise TitancError(f"-o {out} is the current directory or holds it, and the new shard "
                          f"set replaces a directory that holds files by a rename; choose a "
                          f"subdirectory (-o shards) or run from outside it")
    existing = [n for n in (HEADER, "train.bin", "val.bin") if (out / n).exists()]
    if existing and not overwrite:
        raise TitancError(f"-o {out} already holds shards ({', '.join(existing)}); choose "
                          f"another directory or pass --overwrite")


def _is_shard_file(name: str) -> bool:
    return name == HEADER or name.startswith(("train.", "val."))


def _move_others(old: Path, out: Path) -> None:
    """Move the entries of `old` that are not shards (and not in `out`) into `out`."""
    for entry in old.iterdir():
        if not _is_shard_file(entry.name) and not (out / entry.name).exists():
            os.replace(entry, out / entry.name)


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
                             initargs=(tok_name, os.getpid())) as pool:
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


def _write_docs(out: Path, starts: np.ndarray, n_train: int, n_val: int) -> dict[str, dict]:
    """`train.docs` / `val.docs`: each split's document starts (int64 token offsets, the
    first 0: a split's first token starts a document); the header's `docs` entries, each
    with the file's sha256 (a damaged offset would train on wrong document boundaries)."""
    entries = {}
    for split, lo, hi in (("train", 0, n_train), ("val", n_train, n_train + n_val)):
        if hi == lo:
            continue
        mine = starts[(starts > lo) & (starts < hi)] - lo
        raw = np.concatenate([np.zeros(1, np.int64), mine]).astype("<i8").tobytes()
        tmp = out / f"{split}.docs.tmp"
        tmp.write_bytes(raw)
        os.replace(tmp, out / f"{split}.docs")
        entries[split] = {"file": f"{split}.docs", "count": len(raw) // 8,
                          "sha256": hashlib.sha256(raw).hexdigest()}   # checked on open
    return entries


def prepare(inputs: Sequence[str | os.PathLike], out: str | os.PathLike, *,
            tokenizer: str = BYTE, val_fraction: float = 0.1, text_field: str = "text",
            ext: Sequence[str] | None = None, workers: int | None = None,
            progress: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """Tokenize `inputs` into shards in `out`; returns the header written (plus "seconds")."""
    if not 0 <= val_fraction < 1:
        raise TitancError(f"--val-fraction: {val_fraction} must be in [0, 1)")
    if not os.fspath(out):
        raise TitancError("-o: an empty path; pass the directory for the shards, e.g. -o "
                          "data/corpus")
    out = Path(out)
    with _writing(out):
        recover_swap(out, _move_others)
    _check_out(out, overwrite)
    tok = load_tokenizer(tokenizer)
    dtype = dtype_for(tok.vocab_size)
    pieces = plan(inputs, ext, exclude=[out])
    if workers is None:  # a worker costs ~0.3 s to start: give each at least two pieces
        total = sum(p.size for p in pieces)
        workers = min(os.cpu_count() or 1, max(1, total // (2 * PIECE_BYTES)))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = staging_dir(out)            # the old shards stay valid until the swap
        stage.mkdir()
    except OSError as exc:
        raise TitancError(f"cannot create -o {out}: {exc.filename or out}: "
                          f"{exc.strerror or exc}; choose a writable directory") from None
    train_tmp, val_tmp = stage / "train.bin", stage / "val.bin"
    from tqdm import tqdm

    t0 = time.perf_counter()
    total_bytes, n_tokens = 0, 0
    sources: dict[str, int] = {}
    doc_ends: list[np.ndarray] = []            # token offsets just past each document
    bar = tqdm(total=sum(p.size for p in pieces), unit="B", unit_scale=True, desc="prepare",
               disable=not progress or None, dynamic_ncols=True, mininterval=0.5)
    try:
        with _writing(train_tmp), open(train_tmp, "wb") as f:
            for piece, ids, n_bytes, ends in _results(pieces, tok, tokenizer, text_field,
                                                      dtype, workers):
                f.write(ids.tobytes())
                doc_ends.append(ends + n_tokens)
                n_tokens += len(ids)
                total_bytes += n_bytes
                sources[piece.path] = sources.get(piece.path, 0) + n_bytes
                bar.update(piece.size)
        if n_tokens == 0:
            raise TitancError(f"the inputs ({', '.join(map(str, inputs))}) hold no text; pass "
                              f"files with text in them")
        n_val = int(n_tokens * val_fraction)
        with _writing(val_tmp):
            _move_tail(train_tmp, val_tmp, n_tokens - n_val, n_val, np.dtype(dtype))
        ends = np.concatenate(doc_ends) if doc_ends else np.zeros(0, np.int64)
        with _writing(stage / "train.docs"):
            docs = _write_docs(stage, ends, n_tokens - n_val, n_val)
        header = {
            "format": FORMAT, "version": VERSION, "dtype": dtype,
            "tokenizer": tokenizer_info(tok),
            "splits": {"train": {"file": "train.bin", "tokens": n_tokens - n_val},
                       "val": {"file": "val.bin", "tokens": n_val}},
            # document starts per split (data.documents; runtime/data/shards.py)
            "docs": docs,
            "val_fraction": val_fraction, "text_bytes": total_bytes,
            "sources": [{"path": p, "bytes": b} for p, b in sources.items()],
        }
        with _writing(stage / HEADER):
            (stage / HEADER).write_text(json.dumps(header, indent=2) + "\n")
        with _writing(out):
            swap_in(stage, out, _move_others, last=HEADER)
    finally:
        bar.close()
        shutil.rmtree(stage, ignore_errors=True)
    seconds = time.perf_counter() - t0
    return {**header, "seconds": seconds, "workers": workers}


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """An OSError while writing `path` (a full disk) as a one-line error naming it."""
    try:
        yield
    except OSError as exc:
        raise TitancError(f"could not write {exc.filename or path}: {exc.strerror or exc}; "
                          f"shards already in -o are unchanged") from None
