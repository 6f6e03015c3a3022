"""NIAH with four needles per training sequence: train on NIAH sequences holding 4 needles and
4 queries (prose filler, the pairs layout, in training only), score on benchmarks/recall_distance.py's
one-needle held-out NIAH. Measures whether the single query's sparse signal, not the prose, is
what stops binding (the runs: benchmarks/results/recall_distance_experiments.md, "Four needles").
Every other flag is recall_distance.py's.

    .venv/bin/python benchmarks/recall_niah_four_needles.py --blocks lmm --seeds 0
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recall_distance as rd  # noqa: E402

orig = rd.NeedleRecall.batch

def batch(self, n, split="train", generator=None, distance=None):
    if split != "train":
        return orig(self, n, split, generator, distance)
    L, lay = self.layout.length, self.layout
    text = self.text["train"]
    d = min(self.max_distance if distance is None else distance, L - 16)
    start = torch.randint(0, len(text) - L, (n,), generator=generator)
    out = text[start[:, None] + torch.arange(L)]
    keys = torch.stack([torch.randperm(lay.key_range[1] - lay.key_range[0], generator=generator)[:4]
                        for _ in range(n)]) + lay.key_range[0]
    values = torch.randint(*lay.value_range, (n, 4), generator=generator)
    p0 = L - 8 - d - 8
    for i in range(4):
        out[:, p0 + 2 * i], out[:, p0 + 2 * i + 1] = keys[:, i], values[:, i]
        out[:, L - 8 + 2 * i], out[:, L - 7 + 2 * i] = keys[:, i], values[:, i]
    return out

rd.NeedleRecall.batch = batch
sys.argv = ["recall_distance.py", "--task", "niah"] + sys.argv[1:]
rd.main()
