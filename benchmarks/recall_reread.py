"""Re-score models saved by `recall_distance.py --save DIR` with the spec changed at evaluation
only: which part of the trained memory fails past the training length.

Each variant (`;`-separated; empty = as trained) is a list of `KEY=VALUE` spec overrides (e.g.
`model.memory.chunk_size=2`: the same weights read with a finer, more exact write) and
`alpha_shift=X` / `eta_shift=X` (added to the decay gate's bias `mem_alpha_b` or the momentum
gate's `mem_eta_b`: X = -2 divides a small α by ~7), and is scored on 128 held-out rows at
each distance, the benchmark's task and seed.

    .venv/bin/python benchmarks/recall_reread.py DIR mal 0 512,1024 \\
        ";model.memory.chunk_size=2;alpha_shift=-2"

The runs are in benchmarks/results/recall_distance_experiments.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recall_distance as rd                              # noqa: E402
import titanc                                             # noqa: E402

ROWS = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("block")
    ap.add_argument("seed", type=int)
    ap.add_argument("distances")
    ap.add_argument("variants", help="';'-separated lists of KEY=VALUE / alpha_shift=X")
    args = ap.parse_args()
    torch.set_num_threads(1)
    state = torch.load(Path(args.dir) / f"{args.block}_seed{args.seed}.pt")
    base = rd.configure([], [])
    for variant in args.variants.split(";"):
        over, shifts = dict(base), {}
        for item in filter(None, variant.split(",")):
            key, _, value = item.partition("=")
            if key in ("alpha_shift", "eta_shift"):
                shifts[f"param.layers.mem_{key.partition('_')[0]}_b"] = float(value)
            else:
                over[key] = rd.parse_value(value)
        acc = {}
        for d in (int(x) for x in args.distances.split(",")):
            T = rd.eval_seq_len(d)
            prog = titanc.compile(rd.spec_with(args.block, args.seed, T, rd.SPEC["train"]["steps"],
                                                 over))
            st = dict(state)
            for name, shift in shifts.items():
                st[name] = st[name] + shift
            prog.load_state_dict(st)
            task = rd.task_for(T, args.seed)
            rows = task.batch(ROWS, "val", torch.Generator().manual_seed(rd.EVAL_SEED + args.seed),
                              distance=d)
            acc[d] = round(task.accuracy(prog, rows), 3)
        print(f"{args.block} seed {args.seed} {variant or 'as trained'}: {acc}", flush=True)


if __name__ == "__main__":
    main()
