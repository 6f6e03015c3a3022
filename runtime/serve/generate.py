"""Generator: parallel prefill and token-by-token decoding over the compiled step graphs.

The host keeps, per sequence, its position, the ring buffers the step graph reads, and the
pending items of the memory chunk in progress; when a chunk completes it runs the write
graph (and, for mac, starts the next segment). Nothing here grows with context length.
`Sampling` and `sample` live in runtime/serve/sampling.py, conversation files
(`save_session`, `load_session`) in runtime/serve/session_file.py; both are importable from
here too.
"""
from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Iterator, Sequence

import torch

from titanc.errors import TitancError
from titanc.ir.tables import rope_inv_freq
from titanc.runtime.serve.sampling import Sampling, as_integer, sample, short_repr  # noqa: F401
from titanc.runtime.serve.penalties import penalize

Tensor = torch.Tensor
NEG_INF = -math.inf


@dataclass
class DecodeState:
    """Everything a batch of sequences carries between steps (leading L on layer tensors).

    A conversation (a session) is a batch-1 state: `unfed` holds the tokens of its transcript
    that have not run through the model yet (the last token a turn sampled), which the next
    turn feeds before its prompt."""
    tensors: dict[str, Tensor]                # the decode step graph's state.<name> inputs
    pending: dict[str, Tensor]                # items of the memory chunk in progress
    pos: list[int]                            # next position of each sequence
    slot_pos: Tensor                          # (B, W) position held by each ring slot, -1 empty
    unfed: list[list[int]] = field(default_factory=list)   # per sequence, fed next

    def __post_init__(self) -> None:
        if not self.unfed:
            self.unfed = [[] for _ in self.pos]

    @property
    def batch(self) -> int:
        return len(self.pos)

    @property
    def tokens(self) -> list[int]:
        """Tokens of each sequence's transcript: those run through the model and the unfed."""
        return [p + len(u) for p, u in zip(self.pos, self.unfed)]

    @property
    def nbytes(self) -> int:
        """Bytes the state holds: its tensors, and 8 a position and an unfed token (a count of
        the transcript's tokens is no storage: a conversation's state does not grow)."""
        ts = [*self.tensors.values(), *self.pending.values(), self.slot_pos]
        return (sum(t.numel() * t.element_size() for t in ts)
                + 8 * (len(self.pos) + sum(len(u) for u in self.unfed)))

    @staticmethod
    def cat(states: Sequence["DecodeState"]) -> "DecodeState":
        def join(key: str, get: Callable[[DecodeState], dict[str, Tensor]]) -> Tensor:
            return torch.cat([get(s)[key] for s in states], 1)
        first = states[0]
        return DecodeState({k: join(k, lambda s: s.tensors) for k in first.tensors},
                           {k: join(k, lambda s: s.pending) for k in first.pending},
                           [p for s in states for p in s.pos],
                           torch.cat([s.slot_pos for s in states]),
                           [list(u) for s in states for u in s.unfed])

    def take(self, b: int) -> "DecodeState":
        """A batch-1 copy of sequence b."""
        return DecodeState({k: t[:, b:b + 1].clone() for k, t in self.tensors.items()},
                           {k: t[:, b:b + 1].clone() for k, t in self.pending.items()},
                           [self.pos[b]], self.slot_pos[b:b + 1].clone(), [list(self.unfed[b])])

    def put(self, b: int, src: "DecodeState", j: int = 0) -> None:
        """Copy sequence j of `src` into sequence b of this state, in place: a serving engine
        keeps a fixed batch of slots and moves a prefilled sequence into a free one."""
        for mine, theirs in ((self.tensors, src.tensors), (self.pending, src.pending)):
            for k, t in mine.items():
                t[:, b].copy_(theirs[k][:, j])
        self.pos[b] = src.pos[j]
        self.slot_pos[b].copy_(src.slot_pos[j])
        self.unfed[b] = list(src.unfed[j])


class _HostInputs:
    """Preallocated host-side inputs of an n-token step for B sequences, filled in place
    (so a decode step allocates nothing)."""

    def __init__(self, gen: "Generator", B: int, n: int):
        m, dt = gen.m, gen.dtype
        half = m.d_model // m.attention.heads // 2
        self.cos = torch.zeros(B, n, half, dtype=dt)
        self.sin = torch.zeros(B, n, half, dtype=dt)
        self.inv = rope_inv_freq(half)                  # the ROPE nodes' frequencies
        self.t = torch.arange(n, dtype=torch.float64)
        self.pos = torch.zeros(n, dtype=torch.float64)
        self.ang = torch.zeros(n, half, dtype=torch.float64)
        self.trig = torch.zeros(n, half, dtype=torch.float64)
        bias = gen.prog.graph("decode_step", B, n).graph.input_types().get("attn_bias")
        self.bias = torch.zeros(B, n, bias.shape[-1] if bias else 0, dtype=dt)
        self.mask = torch.zeros(B, dtype=dt)
        W = m.attention.window
        t = torch.arange(n)
        causal = t[None, :] <= t[:, None]
        if not m.kind.segment:
            causal = causal & (t[:, None] - t[None, :] < W)
        self.new_keys = torch.zeros(n, n, dtype=dt).masked_fill(~causal, NEG_INF)
        self.ti = torch.arange(n)[:, None]                 # (n, 1) int64
        self.q = torch.zeros(n, 1, dtype=torch.int64)
        self.diff = torch.zeros(n, W, dtype=torch.int64)
        self.seen = torch.zeros(W, dtype=torch.bool)
        self.hide = torch.zeros(n, W, dtype=torch.bool)
        self.at = torch.zeros(B, dtype=torch.int64)        # per sequence: position, then slot
        self.slot = torch.zeros(B, dtype=torch.int64)


def _flushing_denormals() -> bool:
    """Does the CPU flush subnormal floats to zero now (torch has no getter)?"""
    return float(torch.tensor(5e-324, dtype=torch.float64) * 2.0) == 0.0


@contextmanager
def _flush_denormals(restore: bool) -> Iterator[None]:
    """Subnormal floats flushed to zero inside, `restore` (the caller's setting) after. The
    memory weights decay geometrically; on CPU, once they turn subnormal every op on them
    slows down ~2x (measured after ~8k decoded tokens)."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(restore)


class Generator:
    def __init__(self, prog: Any, tokenizer: Any = None):
        """`tokenizer` (runtime/data/tokenizer.py; default bytes) decodes output for stop sequences."""
        from titanc.runtime.program import Program

        if not isinstance(prog, Program):
            raise TypeError(f"Generator: prog must be a titanc Program (from titanc.compile or "
                            f"titanc.load), got {type(prog).__name__}")
        self.prog = prog
        self.tokenizer = tokenizer
        self.spec = prog.spec
        self.m = prog.spec.model
        self.dtype = prog.dtype
        self.kind = self.m.kind                           # what the block kind is made of
        self.has_memory = self.kind.memory
        self._flush_after = _flushing_denormals()        # the caller's setting, restored
        self.chunk = self.m.memory.write_chunk if self.has_memory else 16
        self._graphs: dict[tuple, Any] = {}
        self._weights: tuple[tuple[int, int, int], str] | None = None   # identity's cache
        self._one_state_bytes = 0                        # bytes of one sequence's state

    # -- graphs -------------------------------------------------------------------------------
    def new_state(self, batch: int) -> DecodeState:
        """The state of `batch` sequences at position 0."""
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
            raise TitancError(f"new_state: batch {short_repr(batch)} must be an integer >= 1")
        batch = int(batch)
        if batch > 1:
            self._check_state_fits(batch)
        L = self.m.n_layers
        tensors = self._zeros("decode_step", batch, "state.")
        pending: dict[str, Tensor] = {}
        if self.has_memory:
            pending = self._zeros("decode_write", batch, "pending.")
            params = self.prog.parameters()
            for i in range(1, self.m.memory.depth + 1):
                w0 = params[f"layers.mem_w{i}"].to(self.dtype)          # (L, Nm, o, i)
                tensors[f"W{i}"] = w0[:, None].expand(L, batch, *w0.shape[1:]).clone()
                if self.kind.segment:
                    tensors[f"Wseg{i}"] = tensors[f"W{i}"].clone()
        window = self.m.attention.window if self.kind.window else 1
        return DecodeState(tensors, pending, [0] * batch,
                           torch.full((batch, window), -1, dtype=torch.int64))

    def state_bytes(self, batch: int = 1) -> int:
        """Bytes a decoding state of `batch` sequences holds (one sequence's, measured, times
        `batch`: every tensor of a state has the batch as a dimension)."""
        if not self._one_state_bytes:
            st = self.new_state(1)
            self._one_state_bytes = sum(t.numel() * t.element_size() for t in
                                        [*st.tensors.values(), *st.pending.values(),
                                         st.slot_pos])
        return self._one_state_bytes * batch

    def _check_state_fits(self, batch: int) -> None:
        """TitancError naming the batch when its state cannot fit this machine's memory."""
        from titanc.runtime.capacity import check_fits

        check_fits(self.state_bytes(batch), self.spec, str(self.prog.device), lower=True,
                   reduce=f"the new_state batch ({batch})")

    def _zeros(self, kind: str, batch: int, prefix: str) -> dict[str, Tensor]:
        """Zeros shaped like the `prefix`-named inputs of a compiled graph, by short name."""
        types = self.prog.graph(kind, batch).graph.input_types()
        return {k.removeprefix(prefix): torch.zeros(*t.shape, dtype=self.dtype)
                for k, t in types.items() if k.startswith(prefix)}

    # -- host inputs --------------------------------------------------------------------------
    def _host(self, B: int, n: int) -> _HostInputs:
        key = ("host", B, n)
        if key not in self._graphs:
            self._graphs[key] = _HostInputs(self, B, n)
        return self._graphs[key]

    def _fill_rope(self, h: _HostInputs, b: int, start: int) -> None:
        torch.add(h.t, float(start), out=h.pos)
        torch.outer(h.pos, h.inv, out=h.ang)
        h.cos[b].copy_(torch.cos(h.ang, out=h.trig))
        h.sin[b].copy_(torch.sin(h.ang, out=h.trig))

    def _fill_bias(self, h: _HostInputs, st: DecodeState, b: int, n: int) -> None:
        m = self.m
        P = m.attention.persistent_tokens
        row = h.bias[b]                                             # (n, keys)
        row[:, :P].zero_()
        if m.kind.segment:
            S = m.attention.segment
            i0 = st.pos[b] % S                                       # cache slots j < i0 filled
            for start in (P, P + S + n):
                row[:, start:start + i0].zero_()
                row[:, start + i0:start + S].fill_(NEG_INF)
                row[:, start + S:start + S + n].copy_(h.new_keys)
            return
        W = m.attention.window
        held = st.slot_pos[b]                                        # (W,)
        torch.add(h.ti, st.pos[b], out=h.q)                          # query positions
        torch.sub(h.q, held, out=h.diff)
        torch.ge(held, 0, out=h.seen)
        torch.lt(h.diff, W, out=h.hide)
        torch.logical_and(h.hide, h.seen, out=h.hide)
        torch.logical_not(h.hide, out=h.hide)
        ring = row[:, P:P + W]
        ring.zero_()
        ring.masked_fill_(h.hide, NEG_INF)
        row[:, P + W:].copy_(h.new_keys)

    # -- one step ------------------------------------------------------------------------------
    def step(self, st: DecodeState, tokens: Tensor) -> Tensor:
        """Run n new tokens (B, n) through every layer; returns logits (B, n, V), a view that
        the next step overwrites (clone to keep it). Allocates nothing after warm-up.

        The n tokens must lie in one memory chunk (n = 1, or a whole aligned chunk)."""
        with self.prog.lock:             # the program's executors, and this one's host inputs
            return self._step(st, tokens)

    def _step(self, st: DecodeState, tokens: Tensor) -> Tensor:
        B, n = tokens.shape
        if n > self.chunk or (n > 1 and any(p % self.chunk for p in st.pos)):
            raise TitancError(f"a {n}-token step must start a memory chunk of {self.chunk}")
        inputs: dict[str, Tensor] = {"tokens": tokens}
        inputs.update({f"state.{k}": v for k, v in st.tensors.items()})
        if self.kind.attention:
            h = self._host(B, n)
            S = self.m.attention.segment
            for b in range(B):
                self._fill_rope(h, b, st.pos[b] % S if self.kind.segment else st.pos[b])
                self._fill_bias(h, st, b, n)
            inputs.update(rope_cos=h.cos, rope_sin=h.sin, attn_bias=h.bias)
        with _flush_denormals(self._flush_after):
            out = self.prog.run_graph(self.prog.graph("decode_step", B, n), inputs)
        self._absorb(st, out, n)
        return out["logits"]

    def _absorb(self, st: DecodeState, out: dict[str, Tensor], n: int) -> None:
        m, B = self.m, st.batch
        for k in st.tensors:
            if k.startswith("conv_"):
                st.tensors[k].copy_(out[f"new.{k}"])
        ring = ("k", "v") if m.kind.window else ()
        seg = ("hk", "hv", "uk", "uv") if m.kind.segment else ()
        items = tuple(k for k in ("mk", "mv", "theta", "log_eta", "log_keep")
                      if k in st.pending)    # no log_eta without momentum
        if n == 1 and B > 1:
            self._absorb_one(st, out, ring, seg, items)
        else:
            self._absorb_loop(st, out, n, ring, seg, items)
        st.pos = [p + n for p in st.pos]
        if self.has_memory:
            done = [p % self.chunk == 0 for p in st.pos]
            if any(done):
                self._write(st, done)

    def _absorb_one(self, st: DecodeState, out: dict[str, Tensor], ring: tuple[str, ...],
                    seg: tuple[str, ...], items: tuple[str, ...]) -> None:
        """One new token per sequence: each output lands at its sequence's own time slot
        (dim 3), one scatter per tensor for the whole batch instead of one copy per row."""
        h = self._host(st.batch, 1)
        for b, p in enumerate(st.pos):
            h.at[b].fill_(p)
        for names, period, dst, fmt in ((ring, self.m.attention.window, st.tensors,
                                         "{}_cache"),
                                        (seg, self.m.attention.segment, st.tensors, "{}"),
                                        (items, self.chunk, st.pending, "{}")):
            if not names:
                continue
            torch.remainder(h.at, period, out=h.slot)
            for name in names:
                src = out[f"new.{name}_new"] if dst is st.tensors else out[f"new.{name}"]
                view = [1] * src.dim()
                view[1] = st.batch
                dst[fmt.format(name)].scatter_(3, h.slot.view(view).expand(src.shape), src)
            if names is ring:
                st.slot_pos.scatter_(1, h.slot[:, None], h.at[:, None])

    def _absorb_loop(self, st: DecodeState, out: dict[str, Tensor], n: int,
                     ring: tuple[str, ...], seg: tuple[str, ...], items: tuple[str, ...]) -> None:
        m, B = self.m, st.batch
        for b in range(B):
            for t in range(n):
                p = st.pos[b] + t
                for name in ring:
                    slot = p % m.attention.window
                    st.tensors[f"{name}_cache"][:, b, :, slot].copy_(out[f"new.{name}_new"][:, b, :, t])
                    st.slot_pos[b, slot].fill_(p)
                for name in seg:
                    st.tensors[name][:, b, :, p % m.attention.segment].copy_(
                        out[f"new.{name}_new"][:, b, :, t])
                for k in items:
                    st.pending[k][:, b, :, p % self.chunk].copy_(out[f"new.{k}"][:, b, :, t])

    def _write(self, st: DecodeState, done: list[bool]) -> None:
        """Write the completed chunks into memory. The write graph costs in proportion to its
        batch, so when only some sequences completed a chunk (sequences out of phase, as in a
        serving engine's slots) each of them is written alone through the batch-1 graph."""
        depth, B = self.m.memory.depth, st.batch
        keys = [f"{k}{i}" for k in ("W", "S") for i in range(1, depth + 1)
                if f"{k}{i}" in st.tensors]                  # no S without momentum
        if all(done) or B == 1:
            self._write_rows(st.tensors, st.pending, keys, done)
        else:
            # views into the batch on the cpu target (its executor takes strided inputs and
            # the step stays allocation-free); contiguous copies for generated kernels
            own = (lambda t: t) if self.prog.target == "cpu" else (lambda t: t.contiguous())
            for b in (b for b, d in enumerate(done) if d):
                row = {k: own(st.tensors[k][:, b:b + 1]) for k in keys}
                self._write_rows(row, {k: own(v[:, b:b + 1]) for k, v in st.pending.items()},
                                 keys, [True])
                for k in keys:
                    if row[k].data_ptr() != st.tensors[k][:, b:b + 1].data_ptr():
                        st.tensors[k][:, b:b + 1].copy_(row[k])
        if self.kind.segment:
            S = self.m.attention.segment
            for b in range(B):
                if done[b] and st.pos[b] % S == 0:                  # a segment ended
                    for i in range(1, depth + 1):
                        st.tensors[f"Wseg{i}"][:, b].copy_(st.tensors[f"W{i}"][:, b])
                    for c in ("q", "k", "v"):                       # ỹ convs are segment-local
                        if f"conv_{c}" in st.tensors:
                            st.tensors[f"conv_{c}"][:, b].zero_()

    def _write_rows(self, tensors: dict[str, Tensor], pending: dict[str, Tensor],
                    keys: list[str], done: list[bool]) -> None:
        B = len(done)
        mask = self._host(B, 1).mask
        for b, d in enumerate(done):
            mask[b].fill_(1.0 if d else 0.0)
        inputs = {f"state.{k}": tensors[k] for k in keys}
        inputs.update({f"pending.{k}": v for k, v in pending.items()})
        inputs["mask"] = mask
        with _flush_denormals(self._flush_after):
            out = self.prog.run_graph(self.prog.graph("decode_write", B), inputs)
        for k, v in out.items():
            tensors[k.removeprefix("state.")].copy_(v)

    # -- prefill and generation ----------------------------------------------------------------
    def prefill(self, prompt: Sequence[int],
                state: DecodeState | None = None) -> tuple[DecodeState, Tensor]:
        """Whole chunks in parallel, single tokens where no whole chunk is left or a chunk has
        not been reached yet. Without `state` from position 0; with a batch-1 `state` (a
        conversation, left unchanged) its unfed tokens, then the prompt, continue it. Returns
        the new state and the logits of every prompt position (1, T, V)."""
        toks = _prompt_tensor(prompt, self.m.vocab_size)
        if state is None:
            st, carry = self.new_state(1), 0
        else:
            _check_state(state)
            if state.batch != 1:
                raise TitancError(f"a conversation state holds one sequence, this one holds "
                                  f"{state.batch}")
            st = state.take(0)
            carry = len(st.unfed[0])
            toks = torch.cat([torch.tensor([st.unfed[0]], dtype=torch.int64), toks], 1)
            st.unfed = [[]]
        logits, T, s = [], toks.shape[1], 0
        while s < T:
            aligned = st.pos[0] % self.chunk == 0 and s + self.chunk <= T
            n = self.chunk if aligned else 1
            with self.prog.lock:                # the view, copied before another step
                logits.append(self.step(st, toks[:, s:s + n]).clone())
            s += n
        return st, torch.cat(logits, 1)[:, carry:]

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               sampling: Sampling | None = None,
               state: DecodeState | None = None) -> Iterator[tuple[int, int]]:
        """Yield (sequence index, token) as tokens are sampled; stops per sequence.

        With `state` (a conversation: batch 1, from `new_state(1)` or `load_state_dict`) the
        one prompt continues it, and once the stream is exhausted `state` holds the
        conversation after this turn (its last sampled token unfed); a stream closed early
        leaves it unchanged."""
        s = Sampling() if sampling is None else sampling
        if not isinstance(s, Sampling):
            raise TypeError(f"sampling must be a Sampling (titanc.runtime.serve.generate."
                            f"Sampling(temperature=..., top_k=...)), got {type(s).__name__}")
        n = as_integer(max_new_tokens)
        if n is None or n < 0:
            raise TitancError(f"max_new_tokens: {short_repr(max_new_tokens)} must be an integer "
                              f">= 0")
        max_new_tokens = n
        prompts = _prompt_list(prompts)
        if state is not None:
            _check_state(state)
        if state is not None and len(prompts) != 1:
            raise TitancError(f"a conversation state continues one prompt, got {len(prompts)}")
        gen = torch.Generator().manual_seed(s.seed)
        states, last = [], []
        for p in prompts:
            st, lg = self.prefill(p, state)
            states.append(st)
            last.append(lg[:, -1])
        st = DecodeState.cat(states) if len(states) > 1 else states[0]
        logits = torch.cat(last)
        outs: list[list[int]] = [[] for _ in prompts]
        decode = self.tokenizer.decode if self.tokenizer is not None else _decode_bytes
        tail = max((len(x.encode("utf-8")) for x in s.stop), default=0) + 4
        alive = [True] * len(prompts)
        for k in range(max_new_tokens):
            nxt = sample(penalize(logits, outs, s), s, gen)
            for i, tok in enumerate(nxt.tolist()):
                if not alive[i]:
                    continue
                yield i, tok
                outs[i].append(tok)
                if not any(s.stop):
                    continue
                text = decode(outs[i][-tail:])   # a stop of n bytes spans <= n tokens
                if any(text.endswith(x) for x in s.stop if x):
                    alive[i] = False
            if not any(alive) or k == max_new_tokens - 1:
                break
            with self.prog.lock:                # the view, copied before another step
                logits = self.step(st, nxt[:, None])[:, -1].clone()
        if state is not None:                    # every token but the last sampled is in
            state.put(0, st)
            state.unfed[0] = outs[0][-1:]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: Sampling | None = None,
                 state: DecodeState | None = None) -> list[list[int]]:
        """The tokens `stream` yields, per prompt (with `state`: the turn of a conversation)."""
        prompts = _prompt_list(prompts)
        out: list[list[int]] = [[] for _ in prompts]
        for i, tok in self.stream(prompts, max_new_tokens, sampling, state):
            out[i].append(tok)
        return out


    # -- a conversation's state as tensors -----------------------------------------------------
    def state_dict(self, state: DecodeState) -> dict[str, Tensor]:
        """The tensors of a conversation (a batch-1 state), as copies: `state.<name>` and
        `pending.<name>` (the step and write graphs' inputs), `pos`, `slot_pos` and `unfed`."""
        _check_state(state)
        if state.batch != 1:
            raise TitancError(f"state_dict: a conversation state holds one sequence, this one "
                              f"holds {state.batch}; take one with state.take(b)")
        out = {f"state.{k}": t for k, t in state.tensors.items()}
        out.update({f"pending.{k}": t for k, t in state.pending.items()})
        out["slot_pos"] = state.slot_pos
        out = {k: t.detach().clone().contiguous() for k, t in out.items()}
        out["pos"] = torch.tensor(state.pos, dtype=torch.int64)
        out["unfed"] = torch.tensor(state.unfed[0], dtype=torch.int64)
        return out

    def load_state_dict(self, sd: dict[str, Tensor], what: str = "state_dict") -> DecodeState:
        """A conversation state from `state_dict`'s tensors, checked name by name against
        this model's (a state of another model is one TitancError naming `what`)."""
        from titanc.runtime.api_checks import check_state_tensor
        from titanc.runtime.serve.session_file import check_loaded_state

        if not isinstance(sd, Mapping):
            raise TypeError(f"load_state_dict: sd must be a mapping of names to tensors (from "
                            f"Generator.state_dict), got {type(sd).__name__}")
        want = self.state_dict(self.new_state(1))
        missing = sorted(set(want) - set(sd))
        extra = sorted(set(sd) - set(want))
        if missing or extra:
            name, how = (missing[0], "lacks") if missing else (extra[0], "has an unknown")
            raise TitancError(f"{what} {how} tensor {name!r}: it is not a conversation state "
                              f"of this model")
        for k, w in want.items():
            t = sd[k]
            check_state_tensor(t, f"{what}: tensor {k!r}")
            if t.dtype != w.dtype or (k != "unfed" and t.shape != w.shape) or t.dim() != w.dim():
                raise TitancError(f"{what}: tensor {k!r} is {t.dtype}{list(t.shape)}, this model's "
                                  f"is {w.dtype}{list(w.shape)}; it is a state of another model")
        check_loaded_state(dict(sd), self.m.vocab_size, what)
        pos, unfed = int(sd["pos"][0]), sd["unfed"].tolist()
        st = self.new_state(1)
        for d, prefix in ((st.tensors, "state."), (st.pending, "pending.")):
            for k, t in d.items():
                t.copy_(sd[prefix + k])
        st.slot_pos.copy_(sd["slot_pos"])
        st.pos, st.unfed = [pos], [unfed]
        return st

    def identity(self) -> dict[str, str]:
        """What a saved state is only valid with: the spec (its sha256), the tokenizer and the
        weights (their sha256, hashed again only when the parameters changed: a training
        step or an in-place write since the last call)."""
        from titanc.model.spec import spec_hash
        from titanc.runtime.data.tokenizer import ByteTokenizer
        from titanc.runtime.serve.session_file import weights_hash

        tok = self.tokenizer if self.tokenizer is not None else ByteTokenizer()
        flat = self.prog.flat["param"]
        key = (self.prog.step, flat._version, flat.data_ptr())
        if self._weights is None or self._weights[0] != key:
            self._weights = (key, weights_hash(self.prog))
        return {"spec_hash": spec_hash(self.spec), "model": self.spec.name,
                "tokenizer": tok.hash, "weights": self._weights[1]}

def _check_state(state: Any) -> None:
    if not isinstance(state, DecodeState):
        raise TypeError(f"state must be a DecodeState (Generator.new_state(1) or "
                        f"Generator.load_state_dict), got {type(state).__name__}")


def _prompt_list(prompts: Any) -> list[Any]:
    """`prompts` as a list of prompts (each a sequence of ids, a 1-D tensor or array); a
    flat list of ids (or a 1-D tensor) is refused, not taken as one prompt per id."""
    if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Iterable):
        raise TitancError(f"prompts: expected a non-empty list of prompts, each a list of "
                          f"token ids, got {type(prompts).__name__}")
    if isinstance(prompts, Tensor) and prompts.dim() != 2:
        raise TitancError(f"prompts: a tensor of prompts must be [batch, T], got "
                          f"{list(prompts.shape)}; wrap one prompt's ids as [ids]")
    out = list(prompts)
    if not out:
        raise TitancError("prompts: expected a non-empty list of prompts, each a list of "
                          "token ids")
    for p in out:
        if isinstance(p, numbers.Integral) or (isinstance(p, Tensor) and p.dim() == 0):
            raise TitancError("prompts: expected a list of prompts, got a flat list of token "
                              "ids; wrap one prompt as [ids]")
    return out


def _prompt_tensor(prompt: Sequence[int], vocab_size: int) -> Tensor:
    """A prompt as a (1, T) int64 tensor of ids checked against the vocabulary."""
    from titanc.runtime.api_checks import check_token_ids

    if isinstance(prompt, Tensor):
        if not (prompt.dim() == 1 or (prompt.dim() == 2 and prompt.shape[0] == 1)):
            raise TitancError(f"a prompt tensor must be 1-D [T] (or [1, T]), got "
                              f"{list(prompt.shape)}; pass several prompts as a list")
        toks = prompt.reshape(1, -1)
    else:
        if isinstance(prompt, (str, bytes, Mapping)) or not isinstance(prompt, Iterable):
            raise TitancError(f"a prompt must be a sequence of integer token ids, got "
                              f"{type(prompt).__name__}")
        prompt = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in prompt):
            raise TitancError("a prompt must be a sequence of integer token ids; encode text "
                              "with the run's tokenizer first")
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise TitancError(f"prompt: id {str(bad)[:24]} is outside the vocabulary "
                              f"[0, {vocab_size}) of model.vocab_size={vocab_size}")
        toks = torch.tensor([[int(t) for t in prompt]], dtype=torch.int64)
    if toks.numel() == 0:
        raise TitancError("an empty prompt has nothing to condition on; give at least one token")
    check_token_ids(toks, vocab_size, "prompt")
    return toks.to(torch.int64)


def _decode_bytes(tokens: Sequence[int]) -> str:
    return bytes(t % 256 for t in tokens).decode("utf-8", errors="replace")


# -- conversation files (runtime/serve/session_file.py; here for `from ...generate import`) ---

from titanc.runtime.serve.session_file import (SESSION_FORMAT, SESSION_VERSION,  # noqa: E402,F401
                                               load_session, save_session)
