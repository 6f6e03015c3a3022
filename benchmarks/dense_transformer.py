"""What a user would train instead of a Titans model: a plain decoder-only transformer at a
titanc spec's width, depth, heads, FFN width, vocabulary and sequence, in PyTorch with
`F.scaled_dot_product_attention` (causal, over the whole sequence) and `torch.compile`.

    .venv/bin/python benchmarks/dense_transformer.py --size tiny --steps 5      # CPU, eager
    python3 benchmarks/dense_transformer.py --size large --compile --bf16       # on a GPU

The model: token embedding (tied to the LM head), per layer RMSNorm -> multi-head attention
with rotary positions -> residual, RMSNorm -> SwiGLU FFN (width `model.ffn_hidden`) ->
residual, a final RMSNorm; no biases; GPT-2's initialisation. Trained with AdamW (the spec's lr, betas, weight decay,
gradient clip) under bfloat16 autocast with `--bf16`.

`model_flops` is the MFU numerator, counted as titanc counts its own (`Compiled.model_flops`:
forward and backward, nothing recomputed): 6 x the matmul parameters (the LM head included)
x tokens, plus the attention's two T x T products at 6 x 2 x B x T^2 x d a layer, halved
for the causal mask (what a flash kernel computes). The matmul part is checked against
`torch.utils.flop_counter` (tests/test_bench.py; it counts no SDPA on CPU). benchmarks/gpu_check.py
runs it as the `dense` jobs: large_125m's dimensions, the comparison of issue #50.
Prints JSON, then a one-line table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"tiny": "tiny.yaml", "large": "large_125m.yaml"}


@dataclass(frozen=True)
class Dims:
    vocab: int
    d: int
    layers: int
    heads: int
    ffn: int
    seq: int

    @classmethod
    def of(cls, spec: Any) -> "Dims":
        m = spec.model
        return cls(m.vocab_size, m.d_model, m.n_layers, m.attention.heads, m.ffn_hidden,
                   m.seq_len)


def rotary(T: int, dh: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, dh, 2, device=device).float() / dh))
    ang = torch.arange(T, device=device).float()[:, None] * inv[None, :]
    return ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Layer(nn.Module):
    def __init__(self, n: Dims):
        super().__init__()
        self.heads = n.heads
        self.norm1, self.norm2 = nn.RMSNorm(n.d), nn.RMSNorm(n.d)
        self.qkv = nn.Linear(n.d, 3 * n.d, bias=False)
        self.out = nn.Linear(n.d, n.d, bias=False)
        self.gate_up = nn.Linear(n.d, 2 * n.ffn, bias=False)
        self.down = nn.Linear(n.ffn, n.d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                           is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, D))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class DenseTransformer(nn.Module):
    def __init__(self, n: Dims):
        super().__init__()
        self.n = n
        self.embed = nn.Embedding(n.vocab, n.d)
        self.layers = nn.ModuleList(Layer(n) for _ in range(n.layers))
        self.norm = nn.RMSNorm(n.d)
        for name, p in self.named_parameters():       # GPT-2's: N(0, 0.02), the residual
            if p.dim() == 2:                           # projections scaled by depth
                std = 0.02 / ((2 * n.layers) ** 0.5 if name.endswith(("out.weight",
                                                                      "down.weight")) else 1)
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of tokens [B, T + 1]."""
        x = self.embed(tokens[:, :-1])
        cos, sin = rotary(x.shape[1], self.n.d // self.n.heads, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.norm(x) @ self.embed.weight.t()
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def matmul_params(n: Dims) -> int:
    """Parameters that multiply every token: the layers' projections and the LM head."""
    return n.layers * (4 * n.d * n.d + 3 * n.d * n.ffn) + n.vocab * n.d


def model_flops(n: Dims, batch: int, causal: bool = True) -> float:
    """Forward + backward FLOPs of one step of `batch` sequences (the module docstring)."""
    tokens = batch * n.seq
    attention = 6 * 2 * batch * n.seq * n.seq * n.d * n.layers
    return 6.0 * matmul_params(n) * tokens + (attention / 2 if causal else attention)


def make_step(spec: Any, device: str, compile: bool, bf16: bool, batch: int | None = None
              ) -> tuple[Any, DenseTransformer, int]:
    """(one AdamW step on a fixed random batch, the model, rows a step)."""
    torch.manual_seed(spec.train.seed)
    n, B = Dims.of(spec), batch or spec.train.batch_size
    model = DenseTransformer(n).to(device)
    loss_fn = torch.compile(model) if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, betas=tuple(spec.train.betas),
                            weight_decay=spec.train.weight_decay)
    toks = torch.randint(0, n.vocab, (B, n.seq + 1), device=device)

    def step() -> torch.Tensor:
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(toks)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, model, B


def train(spec: Any, device: str, compile: bool, bf16: bool, steps: int,
          batch: int | None = None) -> dict[str, Any]:
    """Build, (compile,) warm up and time `steps` AdamW steps on random tokens."""
    step, model, B = make_step(spec, device, compile, bf16, batch)
    n = model.n
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    first = float(step())
    first_s = time.perf_counter() - t0
    step()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    flops = model_flops(n, B)
    return {"size": n.__dict__, "batch": B, "tokens_per_step": B * n.seq, "device": device,
            "compile": compile, "bf16": bf16, "first_step_s": round(first_s, 2),
            "ms_median": round(1e3 * med, 3), "tokens_per_s": round(B * n.seq / med),
            "model_gflop": round(flops / 1e9, 3), "achieved_tflops": round(flops / med / 1e12, 3),
            "parameters": sum(p.numel() for p in model.parameters()),
            "loss_first": first, "loss_last": float(loss)}


def main() -> None:
    from titanc.model.spec import load_spec

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--batch", type=int, default=None, help="rows a step (default the spec's)")
    args = ap.parse_args()
    spec = load_spec(ROOT / "examples" / SIZES[args.size])
    r = train(spec, args.device, args.compile, args.bf16, args.steps, args.batch)
    print(json.dumps(r, indent=1))
    print(f"{'size':6} {'tokens/step':>11} {'ms/step':>9} {'tokens/s':>10} {'TFLOP/s':>8}")
    print(f"{args.size:6} {r['tokens_per_step']:>11} {r['ms_median']:9.3f} "
          f"{r['tokens_per_s']:>10,} {r['achieved_tflops']:8.3f}")


if __name__ == "__main__":
    main()
