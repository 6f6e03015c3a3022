"""Generator: parallel prefill and token-by-token decoding over the compiled step graphs.

The host keeps, per sequence, its position, the ring buffers the step graph reads, and the
pending items of the memory chunk in progress; when a chunk completes it runs the write
graph (and, for mac, starts the next segment). Nothing here grows with context length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from titanc.decode import lower_step, lower_write, n_keys, state_shapes
from titanc.errors import TitancError

Tensor = torch.Tensor
NEG_INF = -math.inf


@dataclass
class DecodeState:
    """Everything a batch of sequences carries between steps (leading L on layer tensors)."""
    tensors: dict[str, Tensor]                # state.<name> of decode.state_shapes
    pending: dict[str, Tensor]                # items of the memory chunk in progress
    pos: Tensor                               # (B,) next position of each sequence
    slot_pos: Tensor                          # (B, W) position held by each ring slot, -1 empty

    @property
    def batch(self) -> int:
        return int(self.pos.shape[0])

    @staticmethod
    def cat(states: Sequence["DecodeState"]) -> "DecodeState":
        def join(key: str, dim: int, get: Callable[[DecodeState], dict[str, Tensor]]):
            return torch.cat([get(s)[key] for s in states], dim)
        first = states[0]
        return DecodeState({k: join(k, 1, lambda s: s.tensors) for k in first.tensors},
                           {k: join(k, 1, lambda s: s.pending) for k in first.pending},
                           torch.cat([s.pos for s in states]),
                           torch.cat([s.slot_pos for s in states]))


@dataclass
class Sampling:
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop: Sequence[str] = field(default_factory=tuple)


class Generator:
    def __init__(self, prog: Any):
        self.prog = prog
        self.spec = prog.spec
        self.m = prog.spec.model
        self.dtype = prog.dtype
        self.has_memory = self.m.block != "attn"
        self.chunk = self.m.memory.chunk_size if self.has_memory else 16
        self._graphs: dict[tuple, Any] = {}

    # -- graphs -------------------------------------------------------------------------------
    def _graph(self, kind: str, batch: int, n: int = 1):
        key = (kind, batch, n)
        if key not in self._graphs:
            self._graphs[key] = (lower_step(self.spec, batch, n) if kind == "step"
                                 else lower_write(self.spec, batch))
        return self._graphs[key]

    def new_state(self, batch: int) -> DecodeState:
        L = self.m.n_layers
        z = lambda *s: torch.zeros(*s, dtype=self.dtype)
        tensors = {k: z(L, *s) for k, s in state_shapes(self.m, batch).items()}
        pending: dict[str, Tensor] = {}
        if self.has_memory:
            nm, e = self.m.memory.heads, self.m.d_model // self.m.memory.heads
            pending = {k: z(L, batch, nm, self.chunk, e) for k in ("mk", "mv")}
            pending.update({k: z(L, batch, nm, self.chunk) for k in ("theta", "log_eta", "log_keep")})
            params = self.prog.parameters()
            for i in range(1, self.m.memory.depth + 1):
                w0 = params[f"layers.mem_w{i}"].to(self.dtype)          # (L, Nm, o, i)
                tensors[f"W{i}"] = w0[:, None].expand(L, batch, *w0.shape[1:]).clone()
                if self.m.block == "mac":
                    tensors[f"Wseg{i}"] = tensors[f"W{i}"].clone()
        window = self.m.attention.window if self.m.block in ("attn", "mag", "mal") else 1
        return DecodeState(tensors, pending, torch.zeros(batch, dtype=torch.int64),
                           torch.full((batch, window), -1, dtype=torch.int64))

    # -- host inputs --------------------------------------------------------------------------
    def _rope(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        half = self.m.d_model // self.m.attention.heads // 2
        inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2.0 / (2 * half))
        ang = pos.to(torch.float64)[..., None] * inv
        return torch.cos(ang).to(self.dtype), torch.sin(ang).to(self.dtype)

    def _bias(self, st: DecodeState, n: int) -> Tensor:
        m, B = self.m, st.batch
        P = m.attention.persistent_tokens
        vis = torch.zeros(B, n, n_keys(m, n), dtype=torch.bool)
        vis[:, :, :P] = True
        t = torch.arange(n)
        causal = t[None, :] <= t[:, None]                                  # (n, n) new keys
        if m.block == "mac":
            S = m.attention.segment
            filled = torch.arange(S)[None, :] < (st.pos % S)[:, None]      # (B, S)
            for start in (P, P + S + n):
                vis[:, :, start:start + S] = filled[:, None, :]
                vis[:, :, start + S:start + S + n] = causal
        else:
            W = m.attention.window
            qpos = st.pos[:, None] + t[None, :]                             # (B, n)
            held = st.slot_pos[:, None, :]                                  # (B, 1, W)
            vis[:, :, P:P + W] = (held >= 0) & (qpos[:, :, None] - held < W)
            vis[:, :, P + W:] = causal & (t[:, None] - t[None, :] < W)
        bias = torch.zeros(vis.shape, dtype=self.dtype)
        return bias.masked_fill(~vis, NEG_INF)

    # -- one step ------------------------------------------------------------------------------
    def step(self, st: DecodeState, tokens: Tensor) -> Tensor:
        """Run n new tokens (B, n) through every layer; returns logits (B, n, V), a view that
        the next step overwrites (clone to keep it).

        The n tokens must lie in one memory chunk (n = 1, or a whole aligned chunk)."""
        B, n = tokens.shape
        if n > 1 and bool(((st.pos % self.chunk) != 0).any()) or n > self.chunk:
            raise TitancError(f"a {n}-token step must start a memory chunk of {self.chunk}")
        inputs: dict[str, Tensor] = {"tokens": tokens.to(torch.int64), **self.prog.parameters()}
        inputs.update({f"state.{k}": v for k, v in st.tensors.items()})
        if self.m.block != "lmm":
            t = st.pos[:, None] + torch.arange(n)[None, :]
            if self.m.block == "mac":
                t = t % self.m.attention.segment
            inputs["rope_cos"], inputs["rope_sin"] = self._rope(t)
            inputs["attn_bias"] = self._bias(st, n)
        out = self.prog._run(self._graph("step", B, n), inputs)
        self._absorb(st, out, n)
        return out["logits"]

    def _absorb(self, st: DecodeState, out: dict[str, Tensor], n: int) -> None:
        m, B = self.m, st.batch
        for k in st.tensors:
            if k.startswith("conv_"):
                st.tensors[k].copy_(out[f"new.{k}"])
        rows = torch.arange(B)
        for t in range(n):
            pos = st.pos + t
            if m.block in ("attn", "mag", "mal"):
                slot = pos % m.attention.window
                for name in ("k", "v"):
                    _put(st.tensors[f"{name}_cache"], rows, slot, out[f"new.{name}_new"][:, :, :, t])
                st.slot_pos[rows, slot] = pos
            if m.block == "mac":
                slot = pos % m.attention.segment
                for name in ("hk", "hv", "uk", "uv"):
                    _put(st.tensors[name], rows, slot, out[f"new.{name}_new"][:, :, :, t])
            if self.has_memory:
                slot = pos % self.chunk
                for k in ("mk", "mv", "theta", "log_eta", "log_keep"):
                    _put(st.pending[k], rows, slot, out[f"new.{k}"][:, :, :, t])
        st.pos += n
        if self.has_memory:
            done = (st.pos % self.chunk) == 0
            if bool(done.any()):
                self._write(st, done)

    def _write(self, st: DecodeState, done: Tensor) -> None:
        depth, B = self.m.memory.depth, st.batch
        inputs = {f"state.{k}{i}": st.tensors[f"{k}{i}"] for k in ("W", "S")
                  for i in range(1, depth + 1)}
        inputs.update({f"pending.{k}": v for k, v in st.pending.items()})
        inputs["mask"] = done.to(self.dtype)
        out = self.prog._run(self._graph("write", B), inputs)
        for k, v in out.items():
            st.tensors[k.removeprefix("state.")].copy_(v)
        if self.m.block == "mac":
            seg_done = done & ((st.pos % self.m.attention.segment) == 0)
            for i in range(1, depth + 1):
                st.tensors[f"Wseg{i}"][:, seg_done] = st.tensors[f"W{i}"][:, seg_done]
            for c in ("q", "k", "v"):
                if f"conv_{c}" in st.tensors:
                    st.tensors[f"conv_{c}"][:, seg_done] = 0.0    # ỹ convs are segment-local

    # -- prefill and generation ----------------------------------------------------------------
    def prefill(self, prompt: Sequence[int]) -> tuple[DecodeState, Tensor]:
        """Whole chunks in parallel, then the rest token by token. Returns the state and the
        logits of every prompt position (1, T, V)."""
        if len(prompt) == 0:
            raise TitancError("an empty prompt has nothing to condition on; give at least one token")
        st = self.new_state(1)
        toks = torch.tensor([list(prompt)], dtype=torch.int64)
        logits = []
        full = (len(prompt) // self.chunk) * self.chunk
        for s in range(0, full, self.chunk):
            logits.append(self.step(st, toks[:, s:s + self.chunk]).clone())
        for s in range(full, len(prompt)):
            logits.append(self.step(st, toks[:, s:s + 1]).clone())
        return st, torch.cat(logits, 1)

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               sampling: Sampling | None = None) -> Iterator[tuple[int, int]]:
        """Yield (sequence index, token) as tokens are sampled; stops per sequence."""
        s = sampling or Sampling()
        gen = torch.Generator().manual_seed(s.seed)
        states, last = [], []
        for p in prompts:
            st, lg = self.prefill(p)
            states.append(st)
            last.append(lg[:, -1])
        st = DecodeState.cat(states)
        logits = torch.cat(last)
        texts = [b"" for _ in prompts]
        alive = [True] * len(prompts)
        for _ in range(max_new_tokens):
            nxt = sample(logits, s, gen)
            for i, tok in enumerate(nxt.tolist()):
                if not alive[i]:
                    continue
                yield i, tok
                texts[i] += bytes([tok % 256])
                text = texts[i].decode("utf-8", errors="replace")
                if any(text.endswith(x) for x in s.stop if x):
                    alive[i] = False
            if not any(alive):
                return
            logits = self.step(st, nxt[:, None])[:, -1]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: Sampling | None = None) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]
        for i, tok in self.stream(prompts, max_new_tokens, sampling):
            out[i].append(tok)
        return out


def _put(dst: Tensor, rows: Tensor, slot: Tensor, val: Tensor) -> None:
    """dst[:, b, :, slot[b]] = val[:, b] for every sequence b (val: (L, B, ...))."""
    dst[:, rows, :, slot] = val.transpose(0, 1)        # advanced indices move B to the front


def sample(logits: Tensor, s: Sampling, gen: torch.Generator) -> Tensor:
    """Next token per row of logits (B, V): greedy at temperature 0, else top-k / top-p."""
    logits = logits.to(torch.float64)
    if s.temperature <= 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if s.top_p is not None and s.top_p < 1.0:
        sorted_l, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_l, -1)
        drop = probs.cumsum(-1) - probs > s.top_p                  # keep the smallest prefix > p
        sorted_l = sorted_l.masked_fill(drop, NEG_INF)
        logits = torch.full_like(logits, NEG_INF).scatter(-1, idx, sorted_l)
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
