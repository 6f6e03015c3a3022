"""Why MAC does not learn recall: short diagnostic runs at one sequence length.

Trains one model of `benchmarks/recall_distance.py`'s spec (same task, same `--set`
overrides) at a single seq_len (default 32: pairs and queries 8..18 tokens apart, segment 16)
and every `--every` steps prints one JSON line:

  acc{d}, qloss{d}  held-out accuracy and cross-entropy at the query positions (128 rows at
                    each distance d of `--dist`; chance 0.125, ln 8 = 2.079);
                    acc{d}_by_query: the accuracy of the 1st, 2nd, ... query
  grad              gradient norm per parameter group (summed over the group's tensors)
  mem               memory diagnostics (runtime/diagnostics/neural_memory.py): inner loss before/after
                    the writes, |W|, θ, η
  attn_mass_q       mac only: the attention mass of the query positions on the persistent
                    tokens (P), the memory reads h, the segment tokens u, and on h_i, the
                    read at the query's own position -- the only h that carries its answer.
                    Taken from tests/reference/mac.py run on the trained parameters, so it is
                    only meaningful for the MAC of docs/semantics.md.
  attn_pairs        mac only, the same way: the attention of the pairs' tokens in the first
                    layer; a value token's mass on its own u (val_self), on its key's u
                    (val_key), on h and on P; a key token's on its own u, on h and on P. The
                    written ỹ of a token carries that token only as far as its self mass goes.

    .venv/bin/python benchmarks/recall_mac_diag.py --steps 1500 --every 250
    .venv/bin/python benchmarks/recall_mac_diag.py --block lmm --set train.lr=0.001
    .venv/bin/python benchmarks/recall_mac_diag.py --block mal --seed 1 --dist 8,top \
        --curriculum 32:1500,128:600,272:400 --every 300
    .venv/bin/python benchmarks/recall_mac_diag.py --load DIR/mac_seed0.pt --steps 0 \
        --seq-len 80 --dist 64 --filler-loss 0 --set ...   # a `recall_distance.py --save` model

The runs behind benchmarks/results/recall_distance_experiments.md ("MAC") are the records
"recall_mac_diag" of benchmarks/results/recall_distance_experiments.jsonl; the variants there
that are not spec options were one-line edits of the MAC body, switched by environment
variables and not part of titanc (`git show c01c1ec:benchmarks/results/recall_mac_variants.patch`).
"cpu" includes the probes.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import recall_distance as rd                              # noqa: E402
import titanc                                             # noqa: E402
from titanc.runtime.diagnostics.neural_memory import memory_stats      # noqa: E402
import tests.reference.mac as refmac                      # noqa: E402
from tests.reference.model import forward_logits          # noqa: E402


def groups(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Gradient norm per group: the parameter name's first two words (attn_wq, mem_theta...)."""
    out: dict[str, float] = {}
    for name, g in grads.items():
        words = name.removeprefix("layers.").split("_")
        key = "_".join(words[:2])
        out[key] = out.get(key, 0.0) + float(g.double().pow(2).sum())
    return {k: round(v ** 0.5, 4) for k, v in sorted(out.items())}


def attention_probs(prog, rows: torch.Tensor) -> list[torch.Tensor]:
    """The attention probabilities (B, H, S, P + 2S) of every segment of every layer, in that
    order, from tests/reference/mac.py run on the trained parameters."""
    m = prog.spec.model
    probs: list[torch.Tensor] = []

    def attend(q, k, v, visible):
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, -math.inf)
        a = s.softmax(-1)
        probs.append(a)                                    # (B, H, S, P + 2S)
        return a @ v

    params = {n: t.detach().float() for n, t in prog.parameters().items()}
    orig, refmac.attend = refmac.attend, attend
    try:
        with torch.no_grad():
            forward_logits(params, rows[:, :-1], m)
    finally:
        refmac.attend = orig
    return probs


def attention_mass(prog, rows: torch.Tensor, positions: torch.Tensor) -> dict[str, float]:
    """Mean attention mass of the query positions on P / h / u / h_i (reference MAC)."""
    m = prog.spec.model
    S, P = m.attention.segment, m.attention.persistent_tokens
    probs = attention_probs(prog, rows)
    mass = {"P": 0.0, "h": 0.0, "u": 0.0, "h_self": 0.0}
    n = 0
    for qp in positions.tolist():
        a = probs[qp // S][:, :, qp % S]                   # (B, H, P + 2S)
        i = qp % S
        mass["P"] += float(a[..., :P].sum(-1).mean())
        mass["h"] += float(a[..., P:P + S].sum(-1).mean())
        mass["u"] += float(a[..., P + S:].sum(-1).mean())
        mass["h_self"] += float(a[..., P + i].mean())
        n += 1
    return {k: round(v / n, 3) for k, v in mass.items()}


def pair_attention(prog, task, rows: torch.Tensor) -> dict[str, float]:
    """The first layer's attention of the pairs' tokens (reference MAC), averaged over heads:
    a value token's mass on its own u, its key's u, h and P; a key token's on its own u, h and
    P (pairs whose key and value fall in different segments are left out)."""
    m = prog.spec.model
    S, P = m.attention.segment, m.attention.persistent_tokens
    probs = attention_probs(prog, rows)
    lo, hi = task.layout.value_range
    acc: dict[str, list[float]] = {k: [] for k in ("val_self", "val_key", "val_h", "val_P",
                                                   "key_self", "key_h", "key_P")}
    for b in range(rows.shape[0]):
        for t in range(1, task.layout.query_start):
            if not lo <= int(rows[b, t]) < hi or t % S == 0:
                continue
            for kind, tt in (("val", t), ("key", t - 1)):
                a = probs[tt // S][b, :, tt % S].mean(0)   # (P + 2S,)
                i = tt % S
                acc[f"{kind}_self"].append(float(a[P + S + i]))
                acc[f"{kind}_h"].append(float(a[P:P + S].sum()))
                acc[f"{kind}_P"].append(float(a[:P].sum()))
                if kind == "val":
                    acc["val_key"].append(float(a[P + S + i - 1]))
    return {k: round(sum(v) / max(len(v), 1), 3) for k, v in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block", default="mac")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dist", default="8,16",
                    help="held-out distances to probe; 'top': the stage's longest")
    ap.add_argument("--curriculum", default=None,
                    help="stages seq_len:steps,... as recall_distance.py's (overrides "
                         "--seq-len/--steps; each stage continues from the last)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--filler-loss", type=float, default=1.0, metavar="P",
                    help="as recall_distance.py's: every query's target and a share P of the "
                         "others in the loss (default 1)")
    ap.add_argument("--task-set", action="append", default=[], metavar="KEY=VALUE",
                    help="task override, as recall_distance.py's")
    ap.add_argument("--load", default=None, metavar="PT",
                    help="start from a state saved by recall_distance.py --save (with the "
                         "same --set); --steps 0 probes it once without training")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.filler_loss < 1:
        args.set = ["data.loss=queries", *args.set]
    overrides = rd.configure(args.set, args.task_set)

    mask_gen = torch.Generator().manual_seed(args.seed + 1)

    def masked(task, rows: torch.Tensor):
        return (rd.loss_mask(task, rows.shape[0], args.filler_loss, mask_gen)
                if args.filler_loss < 1 else None)
    stages = (rd.parse_curriculum(args.curriculum) if args.curriculum
              else [(args.seq_len, args.steps)])
    total = max(1, sum(n for _, n in stages))      # --steps 0: probe a --load state
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.process_time()
    step, state = 0, None
    for seq_len, n in stages:
        prog = titanc.compile(rd.spec_with(args.block, args.seed, seq_len, total, overrides))
        if state is None and args.load:
            state = torch.load(args.load)
        if state is not None:
            prog.load_state_dict(state)
        task = rd.task_for(seq_len, args.seed)
        window = prog.spec.model.attention.window
        top, pos = task.max_distance, task.layout.query_positions
        dists = [top if d == "top" else int(d) for d in args.dist.split(",")]

        def probe(loss: float) -> None:
            ev = torch.Generator().manual_seed(999)
            res: dict = {"step": step, "seq_len": seq_len, "loss": round(loss, 4),
                         "cpu": round(time.process_time() - t0, 1)}
            for d in dists:
                rows = task.batch(128, "val", ev, distance=d)
                lg = prog.logits(rows)
                hit = (lg[:, pos].argmax(-1) == rows[:, pos + 1]).double()   # (rows, queries)
                res[f"acc{d}"] = round(float(hit.mean()), 3)
                res[f"acc{d}_by_query"] = [round(float(x), 3) for x in hit.mean(0)]
                res[f"qloss{d}"] = round(float(torch.nn.functional.cross_entropy(
                    lg[:, pos].reshape(-1, lg.shape[-1]), rows[:, pos + 1].reshape(-1))), 3)
            rows = task.batch(32, "val", ev, distance=dists[0])
            res["grad"] = groups(prog.grads(rows, masked(task, rows))[1])
            if prog.spec.model.kind.memory:
                ms = memory_stats(prog, rows[:16])["layers"][0]
                res["mem"] = {k: ms[k] for k in ("inner_loss_before", "inner_loss_after",
                                                 "w_norm", "s_norm", "theta", "eta", "alpha")}
            if args.block == "mac" and prog.spec.model.memory.mac_read == "context" \
                    and prog.spec.model.memory.mac_write in ("attention", "attention_norm"):
                res["attn_mass_q"] = attention_mass(prog, rows, pos)
                res["attn_pairs"] = pair_attention(prog, task, rows)
            print(json.dumps(res), flush=True)

        if n == 0:
            probe(float("nan"))

        for i in range(1, n + 1):
            d = int(torch.randint(min(window, top), top + 1, (), generator=gen))
            tokens = task.batch(prog.batch_size, "train", gen, distance=d)
            loss = prog.train_step(tokens, masked(task, tokens))
            step += 1
            if step == 1 or step % args.every == 0 or i == n:
                probe(loss)
        state = prog.state_dict()


if __name__ == "__main__":
    main()
