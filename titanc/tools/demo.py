"""`python -m titanc.tools.demo` (`make demo`): compile the tiny MAC model and watch it learn text.

1. compiles examples/tiny.yaml (DEMO_OVERRIDES only set the schedule and evaluation cadence)
   and prints the IR summary: nodes per graph and pass, the largest tensor, the parameter
   count;
2. writes a small deterministic English corpus (a seeded toy grammar, so the demo needs no
   download) and prints the held-out loss of the untrained model (about ln 256 = 5.55);
3. trains with the real Trainer (progress bar, metrics.jsonl, loss.png, checkpoint) and prints
   the loss falling and the held-out loss against the unigram baseline, the loss of a model that
   knows byte frequencies but no context;
4. generates a sample from the trained model (chunk-parallel prefill, then token-by-token
   decoding with the memory state) and prints the kernel and memory-plan summary.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from titanc.errors import TitancError
from titanc.ir import graph_stats
from titanc.model.params import param_count
from titanc.runtime.train.rundir import LOCK_NAME
from titanc.runtime.train.trainer import Trainer, read_metrics
from titanc.model.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "tiny.yaml"
DEMO_STEPS = 250
DEMO_OUT = "runs/demo"
# what a demo run leaves in its directory (the trainer's files and the corpus), removed by the next
DEMO_FILES = ("corpus.txt", "checkpoint.safetensors", "metrics.jsonl", "loss.png", "spec.yaml",
              "tokenizer.json")
DEMO_OVERRIDES: dict[str, Any] = {
    "train.lr": 5e-3,
    "train.warmup": 10,
    "train.eval_every": 50,
    "train.eval_batches": 4,
    "train.checkpoint_every": 0,
    "data.val_fraction": 0.1,
}

_NOUNS = ("cat", "dog", "bird", "house", "tree", "river", "child", "teacher", "garden", "window",
          "book", "city", "ship", "farmer", "king", "song")
_ADJECTIVES = ("old", "small", "green", "quiet", "happy", "dark", "bright", "cold", "little", "red")
_VERBS = ("sees", "finds", "likes", "follows", "watches", "builds", "helps", "remembers")
_PLACES = ("near the river", "in the garden", "by the window", "under the tree", "at night",
           "in the city", "on the ship")


def make_corpus(n_bytes: int = 60_000, seed: int = 0) -> str:
    """Sentences from a toy grammar: deterministic, English-looking, learnable in minutes."""
    rng = random.Random(seed)

    def phrase() -> str:
        adj = rng.choice(_ADJECTIVES) + " " if rng.random() < 0.6 else ""
        return f"the {adj}{rng.choice(_NOUNS)}"

    out: list[str] = []
    size = 0
    while size < n_bytes:
        s = f"{phrase()} {rng.choice(_VERBS)} {phrase()}"
        if rng.random() < 0.5:
            s += " " + rng.choice(_PLACES)
        s = s[0].upper() + s[1:] + "."
        out.append(s)
        size += len(s) + 1
    return "\n".join(out) + "\n"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def ir_summary(compiled: Any) -> list[str]:
    """A few lines: node counts per graph and per pass, and the largest tensor."""
    graphs = {"forward": compiled.forward, "backward": compiled.grad,
              "optimizer": compiled.optimizer}
    stats = {k: graph_stats(g) for k, g in graphs.items()}
    largest = max(s["largest_tensor_bytes"] for s in stats.values())
    lines = ["IR: " + ", ".join(f"{k} {s['nodes']:,} nodes" for k, s in stats.items())
             + f"; largest tensor {_mib(largest)}"]
    passes = " -> ".join(f"{p['name']}({p.get('graph', '')}) {p['nodes_after']:,}"
                         for p in getattr(compiled, "passes", []) if "nodes_after" in p)
    if passes:
        lines.append(f"passes: {passes}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titanc.tools.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=DEMO_STEPS, help="training steps")
    parser.add_argument("--out", default=DEMO_OUT,
                        help=f"run directory, replaced by each run of the demo (default: "
                             f"{DEMO_OUT})")
    args = parser.parse_args(argv)
    try:
        return _demo(args.steps, args.out)
    except TitancError as exc:
        print(f"titanc demo: error: {exc}", file=sys.stderr)
        return 2


def fresh_run_dir(out: str) -> Path:
    """`out` emptied of an earlier demo's run (the files the demo and the trainer write), so
    the demo can run again; a directory holding anything else is refused."""
    run = Path(out)
    if run.exists() and not run.is_dir():
        raise TitancError(f"--out {run} is a file; pass a directory for the demo's run")
    if run.is_dir():
        others = sorted(p.name for p in run.iterdir()
                        if p.name not in DEMO_FILES and p.name != LOCK_NAME)   # lock: the trainer's
        if others:
            raise TitancError(f"--out {run} holds {', '.join(others[:4])}, which the demo did "
                              f"not write; choose another --out or empty it")
        for name in DEMO_FILES:
            (run / name).unlink(missing_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    return run


def _demo(steps: int, out: str) -> int:
    # The demo's tensors are tiny: one intra-op thread is fastest, and it does not collapse
    # when other processes share the cores (2 threads spin-wait there, often 5x slower).
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    run = fresh_run_dir(out)
    corpus = run / "corpus.txt"
    corpus.write_text(make_corpus())
    spec = load_spec(SPEC, {**DEMO_OVERRIDES, "data.source": str(corpus), "train.steps": steps})
    m = spec.model
    print(f"titanc demo: {spec.name} ({SPEC.name} with {len(DEMO_OVERRIDES)} overrides): block "
          f"{m.block}, {m.n_layers} layer(s) of width {m.d_model}, seq_len {m.seq_len}, "
          f"{param_count(m):,} parameters")
    trainer = Trainer(spec, run)
    for line in ir_summary(trainer.prog.compiled):
        print("  " + line)
    print(f"  compiled in {time.perf_counter() - t0:.1f} s")
    baseline = trainer.data.unigram_entropy("val")
    initial = trainer.evaluate()["eval_loss"]
    print(f"data: {trainer.data.description}")
    print(f"initial held-out loss {initial:.3f} nats/byte (uniform guessing: ln 256 = "
          f"{math.log(256):.3f}); unigram baseline {baseline:.3f}")
    summary = trainer.run()
    losses = [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    marks = sorted({losses[int(i * (len(losses) - 1) / 5)][0] for i in range(6)})
    print("training loss: " + "  ".join(f"step {s}: {dict(losses)[s]:.3f}" for s in marks))
    final = summary["eval_loss"]
    verdict = "below" if final < baseline else "NOT below"
    print(f"held-out loss {final:.3f} vs unigram baseline {baseline:.3f}: {baseline - final:+.3f} "
          f"nats/byte, {verdict} the baseline ({100 * (baseline - final) / baseline:.0f}% lower)")
    sample = _sample(trainer.prog, "The old ")
    print(f"sample: {sample!r}")
    for line in kernel_memory_summary(trainer.prog.compiled, m.vocab_size):
        print("  " + line)
    plot = "loss.png, " if (run / "loss.png").exists() else ""
    print(f"run directory {run}: metrics.jsonl, {plot}checkpoint.safetensors "
          f"({time.perf_counter() - t0:.0f} s in all)")
    return 0


def _sample(prog: Any, prompt: str, n: int = 60) -> str:
    from titanc.runtime.data.datasets import decode, encode
    from titanc.runtime.serve.generate import Generator, Sampling

    out = Generator(prog).generate([encode(prompt)], n, Sampling(temperature=0.6, seed=0))[0]
    return prompt + decode(out)


def kernel_memory_summary(compiled: Any, vocab_size: int) -> list[str]:
    from titanc.passes.buffer_plan import buffer_report
    from titanc.tools.cost_model import compiled_cost

    prof = compiled_cost(compiled)
    mem = buffer_report(compiled.plans["training"], vocab_size)
    ratio = mem["arena_bytes"] / max(1, mem["lower_bound_bytes"])
    return [f"kernels per training step: {prof['kernels']} launched on triton (a scan kernel "
            f"once), {prof['kernels_all']} counting scan bodies — " + ", ".join(
                f"{f['kernels']} {name}" for name, f in prof["families"].items()),
            f"buffer plan: arena {_mib(mem['arena_bytes'])} (lower bound "
            f"{_mib(mem['lower_bound_bytes'])}, ratio {ratio:.3f}), persistent "
            f"{_mib(mem['persistent_bytes'])}, largest logits buffer {_mib(mem['logits_bytes'])}"]


if __name__ == "__main__":
    sys.exit(main())
