"""How much the aggregate pass shrinks the largest intermediate of a memory-only model.

Prints JSON (and a table): for d_model 768, seq_len 512, chunk sizes 64 and 512 (one chunk
spanning the sequence), the largest value in the whole forward graph and inside the memory
chunk body, before and after `aggregate`. Static types only: nothing model-sized is allocated.

    .venv/bin/python benchmarks/aggregate_shrink.py
"""
from __future__ import annotations

import json

from titanc.model.frontend import lower_forward
from titanc.ir import Graph, Op
from titanc.ir.types import type_bytes
from titanc.passes.aggregate import aggregate
from titanc.passes.canonicalize import canonicalize
from titanc.model.spec import load_spec


def largest(g: Graph, body_prefix: str | None = None) -> int:
    best = 0
    for n in g:
        if n.op is Op.SCAN:
            best = max(best, largest(n.attr("body"), body_prefix))
        if n.op is not Op.INPUT and (body_prefix is None or g.name.startswith(body_prefix)):
            best = max(best, type_bytes(n.type))
    return best


def measure(chunk: int) -> dict:
    spec = load_spec({"name": "memory-only", "model": {
        "vocab_size": 256, "d_model": 768, "n_layers": 1, "block": "lmm", "seq_len": 512,
        "memory": {"heads": 4, "depth": 2, "expansion": 2, "chunk_size": chunk}},
        "train": {"batch_size": 1}})
    before = canonicalize(lower_forward(spec))
    after = aggregate(before)
    row = {"chunk_size": chunk, "d_model": 768, "seq_len": 512,
           "graph_largest_before": largest(before), "graph_largest_after": largest(after),
           "memory_body_largest_before": largest(before, "memory_chunk"),
           "memory_body_largest_after": largest(after, "memory_chunk")}
    row["graph_factor"] = row["graph_largest_before"] / row["graph_largest_after"]
    row["memory_body_factor"] = row["memory_body_largest_before"] / row["memory_body_largest_after"]
    return row


def main() -> None:
    rows = [measure(64), measure(512)]
    print(json.dumps(rows, indent=2))
    print(f"{'chunk':>6} {'graph before':>14} {'after':>10} {'factor':>7}   "
          f"{'memory body before':>19} {'after':>10} {'factor':>7}")
    for r in rows:
        print(f"{r['chunk_size']:>6} {r['graph_largest_before'] / 2**20:>11.1f} MiB "
              f"{r['graph_largest_after'] / 2**20:>6.1f} MiB {r['graph_factor']:>7.1f}   "
              f"{r['memory_body_largest_before'] / 2**20:>16.1f} MiB "
              f"{r['memory_body_largest_after'] / 2**20:>6.1f} MiB {r['memory_body_factor']:>7.1f}")


if __name__ == "__main__":
    main()
