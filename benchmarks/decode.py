"""Decode speed and state memory against context length: one sequence decoded token by token
(greedy) to 100k tokens on a cheap MAC config, timed per 1k tokens.

    .venv/bin/python benchmarks/decode.py              # to 100,000 tokens (a few minutes)
    .venv/bin/python benchmarks/decode.py --quick      # to 2,048 tokens
    .venv/bin/python benchmarks/decode.py --block lmm --threads 1

At each checkpoint (256, 1k, 4k, 16k, 100k tokens of context) it records the decode rate
over the last 1k tokens, the bytes of the decode state (KV ring buffers / segment caches,
memory weights and momentum, conv history, the pending chunk: `DecodeState`), the bytes of
every buffer the program and its executors own (`Program.storages()`), and the process RSS.
State and storage bytes must not change with context: the memory is a fixed-size MLP and
attention is windowed / segment-local. Wall time on a shared machine moves with other
processes' load; the process CPU time per 1k tokens (one thread) is recorded next to it.

Decoding slows down about 1.8x after ~8k tokens unless --flush-denormal: the untrained
model's memory barely writes, so its weights decay geometrically ((1 - alpha) per token)
into subnormal floats, which x86 CPUs process slowly. State size is unaffected.
Prints JSON, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHECKPOINTS = (256, 1024, 4096, 16384, 100_000)
QUICK_CHECKPOINTS = (256, 1024, 2048)


def config(block: str) -> dict[str, Any]:
    return {"name": f"decode-{block}", "model": {
        "vocab_size": 256, "d_model": 64, "n_layers": 2, "block": block, "seq_len": 128,
        "ffn_hidden": 172, "attention": {"heads": 4, "window": 64, "segment": 32,
                                         "persistent_tokens": 4},
        "memory": {"heads": 2, "depth": 2, "expansion": 2, "chunk_size": 16}},
        "train": {"batch_size": 1, "dtype": "float32"}, "compile": {"target": "cpu"}}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def state_bytes(st: Any) -> int:
    return (sum(t.nbytes for t in st.tensors.values())
            + sum(t.nbytes for t in st.pending.values()) + st.slot_pos.nbytes)


def storage_bytes(prog: Any) -> int:
    seen: dict[int, int] = {}
    for t in prog.storages():
        if t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def run(block: str, checkpoints: tuple[int, ...], threads: int,
        flush_denormal: bool = False) -> dict[str, Any]:
    import torch

    import titanc
    from titanc.runtime.serve.generate import Generator

    torch.set_num_threads(threads)
    flushed = torch.set_flush_denormal(flush_denormal) and flush_denormal
    spec = config(block)
    t0 = time.perf_counter()
    prog = titanc.compile(spec)
    gen = Generator(prog)
    st, logits = gen.prefill([0])
    setup = time.perf_counter() - t0
    tok = torch.zeros(1, 1, dtype=torch.int64)
    tok.copy_(logits[:, -1:].argmax(-1))
    pos, rows, per_1k, cpu_1k = 1, [], [], []
    t_block, c_block = time.perf_counter(), time.process_time()
    total_t0 = t_block
    targets = list(checkpoints)
    end = max(targets)
    while pos < end:
        logits = gen.step(st, tok)
        torch.argmax(logits[:, -1:], -1, out=tok)
        pos += 1
        if pos % 1000 == 0 or pos in targets:
            now = time.perf_counter()
            if pos % 1000 == 0:
                cpu = time.process_time()
                per_1k.append(now - t_block)
                cpu_1k.append(cpu - c_block)
                t_block, c_block = now, cpu
        if pos in targets:
            last = per_1k[-1] if per_1k else (now - total_t0) / (pos - 1) * 1000
            rows.append({"context": pos, "seconds_per_1k_tokens": last,
                         "tokens_per_s": 1000 / last,
                         "cpu_seconds_per_1k_tokens": cpu_1k[-1] if cpu_1k else None,
                         "state_bytes": state_bytes(st), "storage_bytes": storage_bytes(prog),
                         "rss_bytes": _rss(),
                         "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                         * 1024})
    total = time.perf_counter() - total_t0
    return {"benchmark": "decode", "config": spec, "threads": threads,
            "flush_denormal": flushed, "setup_seconds": setup,
            "tokens_decoded": pos - 1, "decode_seconds": total,
            "mean_tokens_per_s": (pos - 1) / total, "seconds_per_1k_tokens": per_1k,
            "cpu_seconds_per_1k_tokens": cpu_1k,
            "state_bytes_constant": len({r["state_bytes"] for r in rows}) == 1,
            "storage_bytes_constant": len({r["storage_bytes"] for r in rows}) == 1,
            "checkpoints": rows, "load_average": os.getloadavg(), "cpus": os.cpu_count()}


def table(res: dict[str, Any]) -> str:
    head = (f"{'context':>8} {'ms / 1k tok':>12} {'CPU ms':>8} {'tokens/s':>9} {'state':>10} "
            f"{'buffers':>10} {'RSS':>10}")
    lines = [f"{res['config']['name']}: decoded {res['tokens_decoded']:,} tokens in "
             f"{res['decode_seconds']:.1f} s ({res['mean_tokens_per_s']:,.0f} tokens/s, "
             f"{res['threads']} thread(s), flush denormals "
             f"{'on' if res['flush_denormal'] else 'off'})",
             head, "-" * len(head)]
    for r in res["checkpoints"]:
        cpu = r["cpu_seconds_per_1k_tokens"]
        cpu = f"{1e3 * cpu:>8.1f}" if cpu is not None else f"{'-':>8}"
        lines.append(f"{r['context']:>8,} {1e3 * r['seconds_per_1k_tokens']:>12.1f} {cpu} "
                     f"{r['tokens_per_s']:>9,.0f} {r['state_bytes'] / 1024:>6.1f} KiB "
                     f"{r['storage_bytes'] / 2**20:>6.2f} MiB {r['rss_bytes'] / 2**20:>6.1f} MiB")
    for what, key in (("wall", "seconds_per_1k_tokens"), ("CPU", "cpu_seconds_per_1k_tokens")):
        per = res[key]
        if per:
            lines.append(f"{what} per 1k tokens: min {1e3 * min(per):.0f} ms, max "
                         f"{1e3 * max(per):.0f} ms, first {1e3 * per[0]:.0f} ms, last "
                         f"{1e3 * per[-1]:.0f} ms")
    lines.append(f"state bytes constant: {res['state_bytes_constant']}; program buffers "
                 f"constant: {res['storage_bytes_constant']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"checkpoints {QUICK_CHECKPOINTS}")
    ap.add_argument("--block", default="mac", choices=["attn", "lmm", "mag", "mal", "mac"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--flush-denormal", action="store_true",
                    help="torch.set_flush_denormal(True): subnormal floats read as zero")
    args = ap.parse_args()
    res = run(args.block, QUICK_CHECKPOINTS if args.quick else CHECKPOINTS, args.threads,
              args.flush_denormal)
    print(json.dumps(res, indent=2))
    print()
    print(table(res))


if __name__ == "__main__":
    main()
