"""What rematerialisation and the chunked LM head save, from the static buffer plan alone.

    .venv/bin/python benchmarks/remat_memory.py            # 8 layers; vocab 151,936 at 8k tokens
    .venv/bin/python benchmarks/remat_memory.py --quick    # 4 layers; vocab 151,936 at 2k tokens

1. An 8-layer tiny MAC model (examples/tiny.yaml sizes, batch 8, seq 128): the training
   plan's `peak_activation_bytes` with `train.remat: none` (the scans save every residual)
   and `per_layer` (layer inputs saved, the rest recomputed in the backward), and the factor.
2. A Qwen-sized vocabulary (151,936) at seq_len 8192 with loss_chunk 1024, batch 1 and 4:
   `logits_bytes` (the largest buffer holding logits) with the chunked loss
   (`compile.fused_loss: false`) against 1024 x vocab x 4 bytes, the size of one float32
   chunk of logits (the full [B*T, V] tensor would be B*8192*V*4), `fused_logits_bytes` with
   the fused linear cross-entropy (0: its tiles never leave the kernel), and
   the compile time (`compile_graphs`: static types only, nothing model-sized allocated).

Numbers come from `passes.buffer_plan.buffer_report` on `compile_graphs(spec).plans['training']`.
Prints JSON, then a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from titanc.compiler import compile_graphs  # noqa: E402
from titanc.passes.buffer_plan import buffer_report  # noqa: E402
from titanc.model.spec import load_spec  # noqa: E402

TINY = ROOT / "examples" / "tiny.yaml"
VOCAB = 151_936
LOSS_CHUNK = 1024


Base = Any     # a spec path or dict the overrides apply to


def plan(overrides: dict[str, Any], base: Base = TINY) -> tuple[dict[str, int], float]:
    """The training plan's memory report and the compile time of `base` + `overrides`."""
    spec = load_spec(base, overrides)
    t0 = time.perf_counter()
    c = compile_graphs(spec)
    seconds = time.perf_counter() - t0
    return buffer_report(c.plans["training"], spec.model.vocab_size), seconds


def remat(layers: int, base: Base = TINY) -> dict[str, Any]:
    rows = {}
    for policy in ("none", "per_layer"):
        mem, seconds = plan({"model.n_layers": layers, "train.remat": policy}, base)
        rows[policy] = {**mem, "compile_seconds": seconds}
    return {"n_layers": layers, "none": rows["none"], "per_layer": rows["per_layer"],
            "factor": rows["none"]["peak_activation_bytes"]
            / rows["per_layer"]["peak_activation_bytes"]}


def big_vocab(seq_len: int, batch: int, base: Base = TINY) -> dict[str, Any]:
    over = {"model.vocab_size": VOCAB, "model.seq_len": seq_len, "train.batch_size": batch,
            "train.loss_chunk": LOSS_CHUNK, "train.dtype": "float32"}
    mem, seconds = plan({**over, "compile.fused_loss": False}, base)
    fused, _ = plan(over, base)
    return {"vocab_size": VOCAB, "seq_len": seq_len, "batch_size": batch,
            "loss_chunk": LOSS_CHUNK, "logits_bytes": mem["logits_bytes"],
            "fused_logits_bytes": fused["logits_bytes"],
            "fused_peak_activation_bytes": fused["peak_activation_bytes"],
            "one_chunk_bytes": LOSS_CHUNK * VOCAB * 4,
            "full_logits_bytes": batch * seq_len * VOCAB * 4,
            "peak_activation_bytes": mem["peak_activation_bytes"],
            "arena_bytes": mem["arena_bytes"], "persistent_bytes": mem["persistent_bytes"],
            "compile_seconds": seconds}


def measure(quick: bool) -> dict[str, Any]:
    seq = 2048 if quick else 8192
    return {"benchmark": "remat_memory", "remat": remat(4 if quick else 8),
            "vocab": [big_vocab(seq, b) for b in (1, 4)]}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def table(res: dict[str, Any]) -> str:
    r = res["remat"]
    lines = [f"remat, {r['n_layers']} layers (tiny MAC, batch 8, seq 128): peak activation",
             f"  none       {_mib(r['none']['peak_activation_bytes']):>14}  "
             f"(compile {r['none']['compile_seconds']:.1f} s)",
             f"  per_layer  {_mib(r['per_layer']['peak_activation_bytes']):>14}  "
             f"(compile {r['per_layer']['compile_seconds']:.1f} s)",
             f"  factor     {r['factor']:>10.1f}x", "",
             f"vocab {VOCAB:,}, loss_chunk {LOSS_CHUNK}:",
             f"{'batch':>5} {'seq':>6} {'logits buffer':>14} {'1024*V*4':>12} "
             f"{'full [B*T,V]':>14} {'peak act.':>12} {'compile':>8}"]
    for v in res["vocab"]:
        lines.append(f"{v['batch_size']:>5} {v['seq_len']:>6} {_mib(v['logits_bytes']):>14} "
                     f"{_mib(v['one_chunk_bytes']):>12} {_mib(v['full_logits_bytes']):>14} "
                     f"{_mib(v['peak_activation_bytes']):>12} {v['compile_seconds']:>6.1f} s")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 layers and seq_len 2048")
    args = ap.parse_args()
    res = measure(args.quick)
    print(json.dumps(res, indent=2))
    print()
    print(table(res))


if __name__ == "__main__":
    main()
