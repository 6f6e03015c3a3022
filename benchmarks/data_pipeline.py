"""Data pipeline throughput: `titanc data prepare` MB/s and the memmap loader's cost per batch.

    python benchmarks/data_pipeline.py            # ~8 MB corpus, 3 repeats
    python benchmarks/data_pipeline.py --quick    # ~4 MB, 1 repeat

The corpus is the repository's own text (docs, sources, examples) repeated to --mb megabytes
over 8 files. Prepare is timed end to end (reading, tokenizing in worker processes, writing,
the val split) for the byte tokenizer and a 4,096-token byte-level BPE trained on the same
text, with 1 and 2 workers; MB/s is UTF-8 text bytes per wall second, median of the repeats, and
MB/cpu-s the same per CPU second of this process and its workers (what one uncontended core
does; on a shared, loaded machine the wall rate cannot show the second worker's gain).
The loader is timed per `batch()` call (random windows, int64 tensor out) on the prepared BPE
shards and on a 1 GiB shard (sparse apart from its first MiB), median over the calls.
Prints a table, then the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from titanc.runtime.data.corpus import iter_texts
from titanc.runtime.data.prepare import prepare
from titanc.runtime.data.shards import ShardData
from titanc.runtime.data.tokenizer import ByteTokenizer, tokenizer_info, train_bpe

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / d for d in ("docs", "titanc", "ir", "passes", "codegen", "runtime", "examples")]


def make_corpus(d: Path, mb: float) -> Path:
    text = "".join(iter_texts(SOURCES + [ROOT / "README.md"], ext=["md", "py", "yaml"]))
    per_file = int(mb * 1e6 / 8)
    reps = max(1, round(per_file / len(text.encode())))
    corpus = d / "corpus"
    corpus.mkdir()
    for k in range(8):
        (corpus / f"part{k}.txt").write_text(text * reps)
    return corpus


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the prepare workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def time_prepare(corpus: Path, tok: str, workers: int, repeats: int, d: Path) -> dict:
    rates, seconds, cpu_rates = [], [], []
    for r in range(repeats):
        out = d / f"shards_{Path(tok).stem}_{workers}_{r}"
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        h = prepare([corpus], out, tokenizer=tok, workers=workers, progress=False)
        dt = time.perf_counter() - t0
        seconds.append(dt)
        rates.append(h["text_bytes"] / 1e6 / dt)
        cpu_rates.append(h["text_bytes"] / 1e6 / (_cpu_seconds() - c0))
        if r < repeats - 1:
            shutil.rmtree(out)
    tokens = sum(s["tokens"] for s in h["splits"].values())
    return {"tokenizer": "byte" if tok == "byte" else "bpe4096", "workers": workers,
            "text_mb": h["text_bytes"] / 1e6, "tokens": tokens,
            "mb_per_s": statistics.median(rates), "seconds": statistics.median(seconds),
            "mb_per_cpu_s": statistics.median(cpu_rates),
            "shards": str(out)}


def time_loader(data: ShardData, batch: int, calls: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        data.batch(batch, "train", gen)                        # warm the touched pages
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        data.batch(batch, "train", gen)
        times.append(time.perf_counter() - t0)
    return {"batch": batch, "seq_len": data.seq_len, "calls": calls,
            "us_per_batch": 1e6 * statistics.median(times),
            "train_tokens": len(data.split_array("train"))}


def big_shard(d: Path) -> Path:
    path = d / "big"
    path.mkdir()
    with open(path / "train.bin", "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, 1 << 19, dtype=np.uint16).tobytes())
        f.truncate(1 << 30)
    header = {"format": "titanc-shards", "version": 1, "dtype": "uint16",
              "tokenizer": tokenizer_info(ByteTokenizer()),
              "splits": {"train": {"file": "train.bin", "tokens": 1 << 29}},
              "val_fraction": 0.0, "text_bytes": 1 << 29, "sources": []}
    (path / "header.json").write_text(json.dumps(header))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=8.0, help="corpus size in MB (default 8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=500, help="loader calls timed per case")
    ap.add_argument("--quick", action="store_true", help="--mb 4 --repeats 1 --calls 100")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.repeats, args.calls = 4.0, 1, 100
    import torch   # not at the top: prepare's worker processes re-import this script

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        corpus = make_corpus(d, args.mb)
        t0 = time.perf_counter()
        bpe = train_bpe(iter_texts(SOURCES + [ROOT / "README.md"], ext=["md", "py", "yaml"]),
                        4096, d / "tok.json")
        train_s = time.perf_counter() - t0
        prep = [time_prepare(corpus, tok, w, args.repeats, d)
                for tok in ("byte", str(bpe.path)) for w in (1, 2)]
        bpe_shards = ShardData(prep[-1]["shards"], 128, 4096, tokenizer=bpe)
        big = ShardData(big_shard(d), 128, 256)
        loader = [dict(time_loader(data, b, args.calls), shard=name)
                  for name, data in (("bpe shards", bpe_shards), ("1 GiB shard", big))
                  for b in (8, 64)]
    result = {"cpus": os.cpu_count(), "load_average": os.getloadavg(),
              "bpe_train_seconds": train_s, "prepare": prep, "loader": loader,
              "python": sys.version.split()[0]}
    print(f"{'tokenizer':<10} {'workers':>7} {'MB':>7} {'tokens':>11} {'MB/s':>7} {'s':>7} "
          f"{'MB/cpu-s':>9}")
    for p in prep:
        print(f"{p['tokenizer']:<10} {p['workers']:>7} {p['text_mb']:>7.1f} {p['tokens']:>11,} "
              f"{p['mb_per_s']:>7.2f} {p['seconds']:>7.2f} {p['mb_per_cpu_s']:>9.2f}")
    print(f"\n{'shard':<12} {'train tokens':>13} {'batch':>6} {'seq':>5} {'us/batch':>9}")
    for l in loader:
        print(f"{l['shard']:<12} {l['train_tokens']:>13,} {l['batch']:>6} {l['seq_len']:>5} "
              f"{l['us_per_batch']:>9.1f}")
    for p in prep:
        p.pop("shards")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
