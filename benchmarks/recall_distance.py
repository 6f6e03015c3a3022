"""Long-range recall against distance: lmm, mac, mag, mal and the attn baseline.

The task is `SyntheticRecall` (runtime/data/datasets.py) with the pair -> query distance controlled:
P key-value pairs, then filler, then Q queries at the end of the sequence; `distance` is the
number of positions from the last pair's value to the first query key (every pair -> query
distance is in [distance, distance + 2(P+Q) - 4]). The attention window is 8, so at distance
>= 8 no query sees a pair through attention: the attn baseline must sit at chance, and a
memory block can only answer through its neural memory.

Each model (one block kind, one seed) trains for a fixed number of steps under a per-model
budget of process CPU seconds (one thread; compile time included, evaluation excluded) and is
then scored on held-out sequences at every distance of the sweep, each distance in its own
program at the shortest length that holds it (seq_len a multiple of 16; the < 16 tokens of
slack are filler before the pairs).
Training follows a curriculum over sequence length (`--curriculum`, stages of
`seq_len:steps`): each stage compiles the same spec at its seq_len and continues from the
previous stage's parameters and optimizer state; in every batch the distance is drawn uniformly
from [window, the stage's longest], so short distances stay in the mix. The blocks have
(nearly) equal parameter counts: each block's FFN width is chosen so that its total matches
the largest block's (mag) at `model.ffn_hidden`.

    .venv/bin/python benchmarks/recall_distance.py --blocks lmm,attn --seeds 0 --quick
    .venv/bin/python benchmarks/recall_distance.py --blocks lmm,attn   # the README's figure
    .venv/bin/python benchmarks/recall_distance.py                     # all five blocks, 3 seeds
    .venv/bin/python benchmarks/recall_distance.py --set model.memory.lr_max=1
    .venv/bin/python benchmarks/recall_distance.py --blocks deltanet,gated_deltanet,titans_fla

The defaults are the recipe: the training loss counts the queries' targets alone
(`--filler-loss 0`, the spec's `data.loss: queries`: the filler's targets are noise or, in
prose, a language-modelling signal that drowns the recall one), train.lr 3e-3 (at 1e-2
AdamW collapses the adaptive gates θ, η before a binding forms), memory.qk_activation none
(zero-mean keys),
memory.chunk_size 4 (at chunk 8 the initial θ = 1 with η 0.9 is past the chunked momentum
write's stability bound for mag and mal, and bindings learned at 32 tokens were lost at
128-272), the curriculum 32 -> 128 -> 272 tokens with a long first stage (5,000 steps at 32:
a binding's onset comes at a seed- and task-dependent step, and the seeds and tasks whose
onset came late bind there), and each block's own options in BLOCK_SET and
BLOCK_CURRICULUM: lmm and mac at memory chunk 8 (they bind on every seed there, not at 4),
lmm with `memory.momentum_form: ema`, one memory head of width 64, lr_max 8 and
`memory.decay_max` 0.0005 (the write stays contractive and the learned decay small: a write
keeps at least exp(-0.0005 L) of itself after L tokens, so recall holds past the training
length) and twice the steps (the EMA write's first step on a pair is
(1 - η) θ: it binds slower), mag and mal with the same EMA write, decay cap and lr_max 8
(32 / 4), mag and mac with `memory.gate: attention` (the attention output gates the memory's
read, not the other way round), mac also with `mac_write: input` and `mac_read: residual` (not the
paper's MAC: written from the segment's input, its read also on the residual stream) and a
shorter curriculum (it steps slowest; the same CPU budget).
`--set BLOCK:key=value` sets an option for one block (`--set mac:model.memory.gate=memory`);
`--task-set n_pairs=6 --task-set n_values=12 --set model.vocab_size=48` varies the task.
`--task niah` (one needle in prose) and `--task passkey` (one needle in a repeated sentence)
are the paper's S-NIAH shapes; `--train-needles N` trains them on N needles and N queries a
sequence (`NeedleRecall`), and `--filler-loss 0` counts only the queries' targets in the loss
(`data.loss: queries`; P in (0, 1) keeps that share of the other targets): together the
recipe that teaches retrieval from prose.
The runs behind each choice: benchmarks/results/recall_distance_experiments.md.

Writes runs/recall_distance.json (config, one row per model, summary; `--out` elsewhere) and
recall_distance.png next to it (accuracy vs distance, one line per block: the mean over seeds
with the min-max band, chance dashed), prints the JSON and a table (mean and min over seeds).
The committed figure and JSON the README shows are benchmarks/results/recall_distance.*:
`--out benchmarks/results/recall_distance.json` replaces them on purpose.
Runs made in separate processes (one per block and seed, `--out` each) become one sweep with
`--merge A.json B.json ... --out runs/recall_distance.json`.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import torch
import yaml

import titanc
from titanc.errors import TitancError
from titanc.model.params import param_count
from titanc.runtime.data.datasets import RecallLayout, SyntheticRecall
from titanc.runtime.diagnostics.neural_memory import memory_stats
from titanc.model.spec import load_spec

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = "runs/recall_distance.json"     # the committed results are replaced only by name
SPEC: dict[str, Any] = {
    "name": "recall_distance",
    "model": {
        "vocab_size": 32, "d_model": 64, "n_layers": 1, "block": "lmm", "seq_len": 64,
        "tie_embeddings": False, "ffn_hidden": 128,
        "attention": {"heads": 2, "window": 8, "segment": 16, "persistent_tokens": 2},
        "memory": {"heads": 2, "depth": 1, "expansion": 2, "chunk_size": 4, "adaptive": True,
                   "lr_max": 2.0, "momentum": 0.9, "decay": 0.01, "output_gate": True,
                   "conv_kernel": 4, "qk_activation": "none"},
    },
    "train": {"batch_size": 32, "steps": 2500, "lr": 3.0e-3, "warmup": 30,
              "weight_decay": 0.0, "betas": [0.9, 0.95], "grad_clip": 1.0, "seed": 0,
              "dtype": "float32"},
    "data": {"source": "synthetic:recall"},
}
# each block's own options (`--set BLOCK:key=value` overrides them); docs/semantics.md
BLOCK_SET: dict[str, Any] = {
    "mag:model.memory.gate": "attention",        # the attention gates the memory's read
    "mac:model.memory.gate": "attention",
    "mac:model.memory.mac_write": "input",       # not the paper's MAC: written with u_s
    "mac:model.memory.mac_read": "residual",     # not the paper's MAC: h also on the output
    "lmm:model.memory.chunk_size": 8,            # lmm binds on every seed at chunk 8
    "lmm:model.memory.momentum_form": "ema",     # a write that contracts at any gate value
    "lmm:model.memory.heads": 1,                 # one memory head of width 64 (2 x 32 forget
    "lmm:model.memory.lr_max": 8,                # or interfere); lr_max = d / chunk (64 / 8)
    "lmm:model.memory.decay_max": 0.0005,        # the decay learned at <= 272 tokens, capped
    "lmm:model.memory.decay": 0.00025,
    "mac:model.memory.chunk_size": 8,            # so does the MAC option (seed 0 not at 4)
    # mag and mal: the same contractive write and capped decay (recall past the training
    # length), lr_max = d_head / chunk (32 / 4)
    **{f"{b}:model.memory.{k}": v for b in ("mag", "mal") for k, v in (
        ("momentum_form", "ema"), ("lr_max", 8), ("decay_max", 0.0005), ("decay", 0.00025))},
}
TASK = {"n_pairs": 4, "n_queries": 4, "n_keys": 8, "n_values": 8, "filler_tokens": 4}
NIAH_TASK = {"kind": "niah", "n_pairs": 1, "n_queries": 1, "n_keys": 8, "n_values": 8,
             "train_needles": 1, "needle_layout": "packed", "filler": "prose"}
CURRICULUM = "32:5000,128:500,272:300"
# the memory family (docs/semantics.md "Memory family"): `--blocks deltanet,...` trains the lmm
# block with examples/NAME.yaml's memory section (its gates, form and chunk) at the benchmark's
# sizes (d_model 64, 2 memory heads: the presets' own head width, so their lr_max carries over)
FAMILY = ("deltanet", "gated_deltanet", "titans_fla")
# a block's own curriculum (`--curriculum` sets every block's): MAC steps slowest, and its
# later stages are shorter to fit the same CPU budget; the lmm block (a layer of memory alone)
# binds slower and steps fastest: twice the steps in the same budget, for lmm and the family
# presets that train it (FAMILY)
LMM_CURRICULUM = "32:10000,128:1000,272:600"
BLOCK_CURRICULUM = {"mac": "32:2500,128:450,272:250", "lmm": LMM_CURRICULUM,
                    **dict.fromkeys(FAMILY, LMM_CURRICULUM)}
DISTANCES = "8,16,32,64,128,256,512,1024"
BLOCKS = "lmm,mac,mag,mal,attn"
EVAL_ROWS = 256                # held-out sequences per distance (4 queries each)
EVAL_SEED = 12345
METRICS_EVERY = 100           # steps between memory diagnostics with --metrics
ALIGN = 16                     # seq_len multiple: the mac segment and the memory chunk divide it


def parse_value(text: str) -> Any:
    return yaml.safe_load(text)


def _apply(s: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    s = json.loads(json.dumps(s))
    for key, value in overrides.items():
        node = s
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return s


def kind_of(block: str) -> str:
    """The block kind a `--blocks` name trains: a FAMILY preset trains the lmm block."""
    return "lmm" if block in FAMILY else block


def preset_memory(name: str) -> dict[str, Any]:
    """The `model.memory` section of examples/NAME.yaml, as `model.memory.KEY` overrides."""
    spec = yaml.safe_load((ROOT.parent / "examples" / f"{name}.yaml").read_text())
    return {f"model.memory.{k}": v for k, v in spec["model"]["memory"].items()}


def spec_with(block: str, seed: int, seq_len: int, steps: int,
              overrides: dict[str, Any]) -> dict[str, Any]:
    """The benchmark spec for one model: SPEC, a FAMILY preset's memory section
    (examples/NAME.yaml), the plain `--set` overrides, then those of the `BLOCK:key` form for
    this block, and the FFN width that matches mag's parameter count."""
    plain = {k: v for k, v in overrides.items() if ":" not in k}
    common = _apply(SPEC, plain)
    own = _apply(_apply(SPEC, preset_memory(block)), plain) if block in FAMILY else common
    own = _apply(own, {k.partition(":")[2]: v for k, v in overrides.items()
                       if k.partition(":")[0] == block and ":" in k})
    own["model"].update(block=kind_of(block), seq_len=seq_len)
    own["train"].update(seed=seed, steps=steps)
    own["model"]["ffn_hidden"] = matched_ffn(own, block, common)
    return own


def _count(s: dict[str, Any], block: str, ffn: int) -> int:
    t = json.loads(json.dumps(s))
    t["model"].update(block=kind_of(block), ffn_hidden=ffn)
    t["model"]["seq_len"] = ALIGN
    return param_count(load_spec(t).model)


def matched_ffn(s: dict[str, Any], block: str, common: dict[str, Any]) -> int:
    """FFN width (a multiple of 8) that brings `block` (spec `s`) closest to the parameter
    count of mag (spec `common`, without any block's own overrides)."""
    base = s["model"]["ffn_hidden"]
    target = _count(common, "mag", base)
    per = _count(s, block, base + 8) - _count(s, block, base)      # params per 8 FFN units
    return max(8, base + 8 * round((target - _count(s, block, base)) / per))


def eval_seq_len(distance: int) -> int:
    """Shortest aligned seq_len whose recall sequences reach `distance`."""
    need = distance + 2 * (TASK["n_pairs"] + TASK["n_queries"]) - 2
    return ALIGN * math.ceil(need / ALIGN)


# the needle-in-a-haystack filler: the repository's own prose (code spans and blocks dropped,
# lower-cased, letters only), each character mapped to one of the filler tokens (space and the
# 14 commonest letters get their own token, the other letters share the last)
HAYSTACK_FILES = ("README.md", "docs/architecture.md", "docs/semantics.md")
HAYSTACK_CHARS = " etasnroilcdhpm"
# the passkey task's filler (the paper's S-NIAH-PK: a number in repeated text), in those letters
PASSKEY_FILLER = ("the grass is green the sky is blue the sun is yellow here we go there and "
                  "back again ")


class NeedleRecall:
    """S-NIAH: one key-value needle (a key token, then a value token) somewhere in a stream of
    filler, the key again as the last input token: the model must predict the value. Same
    vocabulary split as the pairs task (keys, values, then filler tokens for the text);
    `distance` puts the needle's value `distance` positions before the query key. The filler
    is natural text (`filler="prose"`, `--task niah`: training windows from the first 90 % of
    the text, held-out ones from the rest) or one sentence repeated (`filler="repeat"`,
    `--task passkey`: the paper's S-NIAH-PK, a number hidden in repeated filler, each window
    starting at a random offset of the repetition).

    `train_needles` > 1 (`--train-needles N`) is the training signal that teaches retrieval:
    a training sequence holds N needles with distinct keys and ends with the N queries (each
    key, then its value), so every sequence carries N recall targets instead of one;
    held-out sequences keep the one-needle shape. `needle_layout` "packed" (the default):
    the needles side by side, the first `distance` + 2N positions before the first query,
    and the queries in the needles' order; "scattered": the needles at random
    non-overlapping places, the queries in random order."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int = 0, n_keys: int = 8,
                 n_values: int = 8, train_needles: int = 1, filler: str = "prose",
                 needle_layout: str = "packed", **_: Any):
        length = seq_len + 1
        f_lo = n_keys + n_values
        if vocab_size - f_lo < len(HAYSTACK_CHARS) + 1:
            raise SystemExit(f"--task niah needs model.vocab_size >= "
                             f"{f_lo + len(HAYSTACK_CHARS) + 1}")
        if not 1 <= train_needles <= n_keys:
            raise SystemExit(f"--train-needles {train_needles}: between 1 and the task's "
                             f"n_keys ({n_keys})")
        self.seq_len = seq_len
        self.train_needles = train_needles
        self.needle_layout = needle_layout
        self.layout = RecallLayout(length, 1, 1, (0, n_keys), (n_keys, f_lo),
                                   (f_lo, f_lo + len(HAYSTACK_CHARS) + 1))
        table = {c: f_lo + i for i, c in enumerate(HAYSTACK_CHARS)}
        other = f_lo + len(HAYSTACK_CHARS)
        if filler == "repeat":
            sentence = PASSKEY_FILLER * (2 + 2 * length // len(PASSKEY_FILLER))
            ids = torch.tensor([table.get(c, other) for c in sentence])
            self.text = {"train": ids, "val": ids}
            self.starts = len(PASSKEY_FILLER)   # any offset of the repetition
            return
        text = "\n".join((ROOT.parent / f).read_text() for f in HAYSTACK_FILES).lower()
        text = re.sub(r"```.*?```|`[^`]*`", " ", text, flags=re.S)     # prose, not code
        words = re.sub(r"[^a-z]+", " ", text).split()
        ids = torch.tensor([table.get(c, other) for c in " ".join(words)])
        cut = int(0.9 * len(ids))
        self.text = {"train": ids[:cut], "val": ids[cut:]}
        if len(self.text["val"]) <= length:
            raise SystemExit(f"--task niah: the held-out text ({len(self.text['val'])} "
                             f"characters) is shorter than a sequence ({length})")
        self.starts = 0                         # any window of the text

    @property
    def chance(self) -> float:
        lo, hi = self.layout.value_range
        return 1.0 / (hi - lo)

    @property
    def max_distance(self) -> int:
        return self.layout.length - 3          # needle at positions 0, 1; query key last

    def _filler(self, n: int, split: str, generator: torch.Generator | None) -> torch.Tensor:
        L = self.layout.length
        text = self.text["val" if split == "val" else "train"]
        start = torch.randint(0, self.starts or len(text) - L, (n,), generator=generator)
        return text[start[:, None] + torch.arange(L)]

    def batch(self, n: int, split: str = "train", generator: torch.Generator | None = None,
              distance: int | None = None) -> torch.Tensor:
        if split == "train" and self.train_needles > 1:
            return self._needles(n, generator, distance)
        L, lay = self.layout.length, self.layout
        out = self._filler(n, split, generator)
        d = self.max_distance if distance is None else distance
        keys = torch.randint(*lay.key_range, (n,), generator=generator)
        values = torch.randint(*lay.value_range, (n,), generator=generator)
        p0 = L - 2 - d - 1                      # needle key; its value sits d before the query
        out[:, p0], out[:, p0 + 1] = keys, values
        out[:, L - 2], out[:, L - 1] = keys, values
        return out

    def _needles(self, n: int, generator: torch.Generator | None,
                 distance: int | None) -> torch.Tensor:
        """A training batch of `train_needles` needles a sequence (the class docstring)."""
        L, lay, N = self.layout.length, self.layout, self.train_needles
        if L < 4 * N:
            raise SystemExit(f"--train-needles {N}: {N} needles and their queries need "
                             f"{4 * N} tokens, a training sequence has {L}")
        out = self._filler(n, "train", generator)
        rows = torch.arange(n)[:, None]
        n_keys = lay.key_range[1] - lay.key_range[0]
        keys = torch.rand(n, n_keys, generator=generator).argsort(-1)[:, :N] + lay.key_range[0]
        values = torch.randint(*lay.value_range, (n, N), generator=generator)
        q = L - 2 * N + 2 * torch.arange(N)
        if self.needle_layout == "packed":
            d = min(self.max_distance if distance is None else distance, L - 4 * N)
            place = (L - 2 * N - d - 2 * N + 2 * torch.arange(N)).expand(n, N)
            order = torch.arange(N).expand(n, N)
        else:
            slots = (L - 2 * N) // 2            # token pairs before the queries
            place = 2 * torch.rand(n, slots, generator=generator).argsort(-1)[:, :N]
            order = torch.rand(n, N, generator=generator).argsort(-1)
        out[rows, place], out[rows, place + 1] = keys, values
        out[:, q], out[:, q + 1] = keys.gather(1, order), values.gather(1, order)
        return out

    @property
    def train_query_positions(self) -> torch.Tensor:
        """Token indices of a training sequence's queried keys (its N queries)."""
        N = self.train_needles
        return self.layout.length - 2 * N + 2 * torch.arange(N)

    def accuracy(self, prog: Any, tokens: torch.Tensor) -> float:
        pos = self.layout.query_positions
        pred = prog.logits(tokens)[:, pos].argmax(dim=-1).cpu()
        return float((pred == tokens[:, pos + 1]).double().mean())


def task_for(seq_len: int, seed: int) -> SyntheticRecall | NeedleRecall:
    kind = NeedleRecall if TASK.get("kind") in ("niah", "passkey") else SyntheticRecall
    return kind(seq_len, SPEC["model"]["vocab_size"], seed=seed,
                **{k: v for k, v in TASK.items() if k != "kind"})


def configure(sets: list[str], task_sets: list[str]) -> dict[str, Any]:
    """BLOCK_SET and the `--set` overrides as a dict (a plain `--set key` replaces BLOCK_SET's
    `BLOCK:key` defaults: what the user sets wins over the benchmark's per-block choices);
    applies `--task-set` to TASK and a `model.vocab_size` override to SPEC (the task generator
    reads both)."""
    overrides = dict(BLOCK_SET)
    for item in sets:
        key, _, value = item.partition("=")
        if ":" not in key:
            for k in [k for k in BLOCK_SET if k.partition(":")[2] == key]:
                overrides.pop(k, None)
        overrides[key] = parse_value(value)
    for item in task_sets:
        key, _, value = item.partition("=")
        fixed = {"kind", "filler", "train_needles", "needle_layout"}   # set by their flags
        if key not in TASK or key in fixed:
            raise SystemExit(f"--task-set {item}: the task has {sorted(set(TASK) - fixed)}")
        TASK[key] = int(value)
    SPEC["model"]["vocab_size"] = overrides.pop("model.vocab_size", SPEC["model"]["vocab_size"])
    return overrides


def loss_mask(task: SyntheticRecall | NeedleRecall, batch: int, keep: float,
              generator: torch.Generator) -> dict[str, torch.Tensor]:
    """`--filler-loss P`: the `loss_mask` of a training batch (the spec's `data.loss: queries`):
    every query's target counted, each other target with probability P (0: the queries'
    alone, as `titanc train` counts them under `data.loss: queries`)."""
    T = task.seq_len
    mask = (torch.rand(batch, T, generator=generator) < keep).float()
    pos = getattr(task, "train_query_positions", task.layout.query_positions)
    mask[:, pos] = 1.0
    return {"loss_mask": mask}


def parse_curriculum(text: str) -> list[tuple[int, int]]:
    stages = []
    for part in text.split(","):
        seq_len, steps = part.split(":")
        stages.append((int(seq_len), int(steps)))
    return stages


def train_one(block: str, seed: int, stages: list[tuple[int, int]], distances: list[int],
              overrides: dict[str, Any], budget_s: float, window: int,
              metrics: Path | None = None, fixed: bool = False,
              save: Path | None = None, filler_loss: float = 1.0) -> dict[str, Any]:
    """Train one model through the curriculum within `budget_s` CPU seconds; score it.
    `filler_loss` < 1: the loss counts every query's target and that share of the others."""
    total = sum(n for _, n in stages)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.process_time()
    prog, state, step, loss, truncated = None, None, 0, float("nan"), False
    for seq_len, n in stages:
        # a stage holds the task's pairs and queries at least `window` apart (a task with
        # more pairs than the first stage's 32 tokens hold trains its first stage longer)
        seq_len = max(seq_len, eval_seq_len(min(window, 8)))
        prog = titanc.compile(spec_with(block, seed, seq_len, total, overrides))
        if state is not None:
            prog.load_state_dict(state)
        task = task_for(seq_len, seed)
        top = task.max_distance
        for _ in range(n):
            if time.process_time() - t0 > budget_s:
                truncated = True
                break
            d = top if fixed else int(torch.randint(min(window, top), top + 1, (),
                                                     generator=gen))
            tokens = task.batch(prog.batch_size, "train", gen, distance=d)
            docs = loss_mask(task, prog.batch_size, filler_loss, gen) if filler_loss < 1 \
                else None
            loss = prog.train_step(tokens, docs)
            step += 1
            if metrics is not None and step % METRICS_EVERY == 0 and block != "attn":
                t_stats = time.process_time()    # diagnostics do not count against the budget
                probe = task.batch(16, "val", torch.Generator().manual_seed(EVAL_SEED),
                                   distance=top)
                with metrics.open("a") as f:
                    f.write(json.dumps({"block": block, "seed": seed, "step": step,
                                        "seq_len": seq_len, "loss": loss,
                                        "memory": memory_stats(prog, probe)}) + "\n")
                t0 += time.process_time() - t_stats
        state = prog.state_dict()
        if truncated:
            break
    cpu_s = time.process_time() - t0
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        torch.save(state, save / f"{block}_seed{seed}.pt")
    acc = {}
    for d in distances:       # one program per distance, at the shortest length that holds it
        T = eval_seq_len(d)
        ev = titanc.compile(spec_with(block, seed, T, total, overrides))
        ev.load_state_dict(state)
        task = task_for(T, seed)
        rows = task.batch(EVAL_ROWS, "val", torch.Generator().manual_seed(EVAL_SEED + seed),
                          distance=d)
        acc[str(d)] = round(task.accuracy(ev, rows), 4)
    return {"block": block, "seed": seed, "steps": step, "cpu_s": round(cpu_s, 1),
            "truncated": truncated, "final_loss": round(loss, 4),
            "params": param_count(ev.spec.model), "ffn_hidden": ev.spec.model.ffn_hidden,
            "accuracy": acc}


def summarize(rows: list[dict[str, Any]], distances: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for block in dict.fromkeys(r["block"] for r in rows):
        mine = [r for r in rows if r["block"] == block]
        out[block] = {str(d): {"mean": round(sum(r["accuracy"][str(d)] for r in mine)
                                             / len(mine), 4),
                               "min": min(r["accuracy"][str(d)] for r in mine),
                               "max": max(r["accuracy"][str(d)] for r in mine)}
                      for d in distances}
    return out


def plot(path: Path, summary: dict[str, Any], distances: list[int], chance: float,
         window: int, title: str, seeds: dict[str, int] | None = None) -> None:
    """Accuracy vs distance, one line per block (mean over its seeds, min-max band);
    `seeds`: how many seeds each block has, shown in the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for block, by_d in summary.items():
        mean = [by_d[str(d)]["mean"] for d in distances]
        lo = [by_d[str(d)]["min"] for d in distances]
        hi = [by_d[str(d)]["max"] for d in distances]
        n = (seeds or {}).get(block)
        label = block if n is None else f"{block} ({n} seed{'s' if n != 1 else ''})"
        line, = ax.plot(distances, mean, marker="o", label=label)
        ax.fill_between(distances, lo, hi, color=line.get_color(), alpha=0.15)
    ax.axhline(chance, color="gray", linestyle="--", label=f"chance ({chance:.3f})")
    ax.axvline(window, color="gray", linestyle=":", label=f"attention window ({window})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(distances)
    ax.set_xticklabels([str(d) for d in distances])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("pair → query distance (tokens)")
    ax.set_ylabel("held-out recall accuracy")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="center left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default=BLOCKS)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--curriculum", default=None,
                    help=f"stages seq_len:steps,... for every block (default {CURRICULUM}, "
                         f"and {BLOCK_CURRICULUM} for those blocks)")
    ap.add_argument("--distances", default=DISTANCES, help=f"evaluation distances ({DISTANCES})")
    ap.add_argument("--budget", type=float, default=600.0,
                    help="CPU seconds per model (training and compiles; default 600)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="spec override, e.g. model.memory.decay=0 (repeatable)")
    ap.add_argument("--train-distance", choices=("random", "max"), default="random",
                    help="training batches: distance drawn from [window, longest] (random) "
                         "or always the longest (pairs at the start)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke settings: curriculum 32:100, distances 8,16,64")
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help=f"the sweep's JSON, its plot beside it (default {DEFAULT_OUT}, outside "
                         f"the committed benchmarks/results/)")
    ap.add_argument("--append", action="store_true",
                    help="add to the rows already in --out (same configuration) instead of "
                         "starting over")
    ap.add_argument("--metrics", default=None,
                    help=f"append memory diagnostics (runtime/diagnostics/neural_memory.py) every "
                         f"{METRICS_EVERY} steps to this JSONL file")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--task", choices=("pairs", "niah", "passkey"), default="pairs",
                    help="pairs: 4 key-value pairs, random filler, 4 queries (default); niah: "
                         "one key-value needle in the repository's prose, the key again last; "
                         "passkey: the same needle in one sentence repeated")
    ap.add_argument("--train-needles", type=int, default=1, metavar="N",
                    help="niah / passkey: N needles and their N queries a training sequence "
                         "(held-out sequences keep one needle; default 1)")
    ap.add_argument("--needle-layout", choices=("packed", "scattered"), default="packed",
                    help="with --train-needles: the needles side by side at the batch's "
                         "distance, queries in their order (packed), or at random places, "
                         "queries in random order (scattered)")
    ap.add_argument("--filler-loss", type=float, default=0.0, metavar="P",
                    help="training loss: every query's target and each other target with "
                         "probability P (default 0: the queries' alone; 1: every target)")
    ap.add_argument("--task-set", action="append", default=[], metavar="KEY=VALUE",
                    help="task override, e.g. n_pairs=6 or n_values=12 (repeatable; with "
                         "--set model.vocab_size=... for a larger vocabulary)")
    ap.add_argument("--save", default=None,
                    help="directory to save each trained model's state (BLOCK_seedN.pt)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="train nothing: merge these runs' JSON (one configuration, e.g. one "
                         "process per block and seed) into --out and its plot")
    args = ap.parse_args()
    if args.merge:
        out = Path(args.out)
        report(out, merge(args.merge, out))
        return
    torch.set_num_threads(args.threads)
    if args.task in ("niah", "passkey"):
        TASK.clear()
        TASK.update(NIAH_TASK, kind=args.task, train_needles=args.train_needles,
                    needle_layout=args.needle_layout,
                    filler="repeat" if args.task == "passkey" else "prose")
    elif args.train_needles != 1:
        raise SystemExit("--train-needles: only with --task niah or --task passkey")
    if args.quick:
        args.curriculum, args.distances = "32:100", "8,16,64"
    if not 0.0 <= args.filler_loss <= 1.0:
        raise SystemExit(f"--filler-loss {args.filler_loss}: a probability in [0, 1]")
    if args.filler_loss < 1:                 # a loss mask: the program takes it as an input
        args.set = ["data.loss=queries", *args.set]
    overrides = configure(args.set, args.task_set)
    curricula = ({} if args.curriculum else BLOCK_CURRICULUM)
    args.curriculum = args.curriculum or CURRICULUM
    distances = [int(d) for d in args.distances.split(",")]
    window = overrides.get("model.attention.window", SPEC["model"]["attention"]["window"])
    metrics = Path(args.metrics) if args.metrics else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    chance = 1.0 / TASK["n_values"]
    config = {"spec": SPEC, "overrides": overrides, "task": TASK, "curriculum": args.curriculum,
              "block_curriculum": curricula,
              "train_distance": args.train_distance, "distances": distances,
              "budget_cpu_s": args.budget, "threads": args.threads, "eval_rows": EVAL_ROWS,
              "filler_loss": args.filler_loss,
              "chance": chance}
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: list[dict[str, Any]] = []
    if args.append and out.exists():         # continue a sweep: keep its rows, same config
        before = json.loads(out.read_text())
        if before["config"] != json.loads(json.dumps(config)):
            raise SystemExit(f"--append: {out} was made with another configuration; "
                             f"use another --out")
        rows = before["results"]
    for seed in seeds:
        for block in args.blocks.split(","):
            stages = parse_curriculum(curricula.get(block, args.curriculum))
            r = train_one(block, seed, stages, distances, overrides, args.budget, window,
                          metrics, args.train_distance == "max",
                          Path(args.save) if args.save else None, args.filler_loss)
            rows.append(r)
            print(f"# {block} seed {seed}: {r['steps']} steps, {r['cpu_s']} cpu s, "
                  f"acc {r['accuracy']}", flush=True)
            # written after every model, so an interrupted sweep keeps what it measured
            result = write_results(out, config, rows, args.task)
    report(out, result)


def write_results(out: Path, config: dict[str, Any], rows: list[dict[str, Any]],
                  task: str) -> dict[str, Any]:
    """`out` (JSON: config, rows, summary) and its plot beside it (.png)."""
    distances = config["distances"]
    summary = summarize(rows, distances)
    result = {"config": config, "results": rows, "summary": summary}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    own = sorted(b for b in config.get("block_curriculum", {}) if b in {r["block"] for r in rows})
    needles = config["task"].get("train_needles", 1)
    if needles > 1:
        task += f", {needles} {config['task']['needle_layout']} needles a training sequence"
    title = (f"recall vs distance ({task}): curriculum {config['curriculum']}"
             f"{' (' + ', '.join(own) + ': their own)' if own else ''},\n"
             f"≤{config['budget_cpu_s']:.0f} CPU s/model")
    seeds = {b: sum(r["block"] == b for r in rows) for b in summary}
    window = config["overrides"].get("model.attention.window",
                                     config["spec"]["model"]["attention"]["window"])
    plot(out.with_suffix(".png"), summary, distances, config["chance"], window, title, seeds)
    return result


def merge(paths: list[str], out: Path) -> dict[str, Any]:
    """One sweep from runs made in separate processes (`--out` each). What is compared is
    each run's configuration as it applied to its own models: a block's `BLOCK:key` options
    and the curriculum it trained on (its own, or the run's default) must be the same in
    every run that trained that block, everything else the same in every run. The merged
    configuration holds every block's options, the most common curriculum as the default and
    the others as blocks' own; the rows are concatenated in the order given."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    shared: dict[str, Any] = {}             # what every run must agree on
    per_block: dict[str, Any] = {}          # block -> (its options, its curriculum)
    for p, run in zip(paths, runs):
        c = run["config"]
        rest = {k: v for k, v in c.items()
                if k not in ("overrides", "block_curriculum", "curriculum")}
        plain = {k: v for k, v in c["overrides"].items() if ":" not in k}
        ok = shared.setdefault("rest", rest) == rest and shared.setdefault("plain", plain) == plain
        for block in {r["block"] for r in run["results"]}:
            mine = ({k: v for k, v in c["overrides"].items() if k.startswith(block + ":")},
                    c.get("block_curriculum", {}).get(block, c["curriculum"]))
            ok = ok and per_block.setdefault(block, mine) == mine
        if not ok:
            raise SystemExit(f"--merge: {p} was made with another configuration than the "
                             f"others")
    curricula = [cur for _, cur in per_block.values()]
    default = max(curricula, key=curricula.count)
    config = {**runs[0]["config"], **shared["rest"],
              "overrides": {**shared["plain"],
                            **{k: v for opts, _ in per_block.values() for k, v in opts.items()}},
              "curriculum": default,
              "block_curriculum": {b: cur for b, (_, cur) in per_block.items() if cur != default}}
    task = config["task"].get("kind", "pairs")
    return write_results(out, config, [r for run in runs for r in run["results"]], task)


def report(out: Path, result: dict[str, Any]) -> None:
    """The JSON, then a table of mean/min accuracy per block and distance."""
    rows, summary, distances = result["results"], result["summary"], result["config"]["distances"]
    chance = result["config"]["chance"]
    print(json.dumps(result, indent=2))
    head = f"{'block':>6} {'params':>7} " + " ".join(f"{'d=' + str(d):>11}" for d in distances)
    print(head)
    for block, by_d in summary.items():
        params = next(r["params"] for r in rows if r["block"] == block)
        cells = " ".join(f"{by_d[str(d)]['mean']:>5.3f}/{by_d[str(d)]['min']:.2f}"
                         for d in distances)
        print(f"{block:>6} {params:>7} {cells}")
    print(f"cells: mean/min accuracy over seeds; chance {chance:.3f}; wrote {out} and "
          f"{out.with_suffix('.png')}")


if __name__ == "__main__":
    try:
        main()
    except TitancError as exc:       # a bad --set: one line, as the CLI says it
        hint = ("; an option of one block goes in as --set BLOCK:key=value"
                if "block" in str(exc) else "")
        raise SystemExit(f"recall_distance: error: {exc}{hint}") from None
