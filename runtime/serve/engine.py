"""Engine: continuous batching over a fixed pool of constant-size decoding slots.

A Titans sequence carries a constant-size state (sliding-window KV plus memory weights), so a
server can hold one `DecodeState` of N sequences, the *slots*, for its whole life and never run
out of cache. One thread, the engine loop, owns the compiled decode program. Each iteration:

1. frees the slots of finished or cancelled requests (a cancellation takes effect before the
   next decode step, so a cancelled request holds its slot for at most one step);
2. admits queued requests into free slots;
3. prefills admitted requests by whole memory chunks in parallel (batch 1, the graph
   `Generator.prefill` uses), at most `prefill_budget` prompt tokens per iteration, so a long
   prompt does not stall the others; the prompt's last partial chunk is then copied into
   its slot (`DecodeState.put`) and fed through the batched decode steps, one token a step.
   A request that continues a conversation (`Request.start`, runtime/serve/sessions.py)
   prefills from a copy of its state, one token at a time up to the next chunk boundary;
4. runs one batched decode step over all N slots (free slots decode a dummy token and are reset
   when reused) and samples the next token of every request whose prompt is in.

Scheduling is first come, first served with a fair share: before admitting, while requests
wait and every slot is busy, each request that has held its slot for `quantum` (64) decode
steps is swapped out to the back of the queue; a Titans sequence's state is constant-size, so
this is a copy of one batch row, and its sampler goes with it, so its tokens are the same. One
large request (n=16, max_tokens=4096) therefore delays a small one by at most about
`quantum x ceil(waiting / slots)` decode steps, never by its whole length.

Each request samples with its own `torch.Generator` seeded by its seed, and a row of the batched
step does not depend on the other rows (same batch shape every step), so a request's tokens do
not depend on what else is in the batch. Text (stop sequences, UTF-8 completion) is handled here
through a `Codec` because stopping must free the slot at once.
"""
from __future__ import annotations

import random
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from titanc.errors import TitancError

from titanc.runtime.serve.codec import IncrementalText
from titanc.runtime.serve.generate import DecodeState, Generator, Sampling, sample
from titanc.runtime.serve.penalties import penalize

Tensor = torch.Tensor
REPLACEMENT = "\ufffd"
QUANTUM = 64                    # decode steps a request keeps its slot while others wait


class Codec(Protocol):
    """The tokenizer as the server sees it: text <-> token ids, and one token as a string."""
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, tokens: Sequence[int]) -> str: ...
    def token_str(self, token: int) -> str: ...


class QueueFull(Exception):
    """The waiting queue is at its limit; retry later."""


class Draining(Exception):
    """The engine is shutting down and admits nothing new."""


@dataclass
class TokenLogprob:
    token: int
    logprob: float | None                     # None for the first prompt token (echo)
    top: dict[int, float] | None


@dataclass
class Update:
    """What a request gained in one engine iteration (sent to its `on_update`)."""
    text: str                                 # newly final text (held back: stop, UTF-8)
    tokens: list[int]
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob] | None = None   # once, with echo and logprobs
    finish_reason: str | None = None          # "stop" | "length" | "abort" at the end
    error: str | None = None                  # with "abort": why the engine ended it (one line)


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    on_update: Callable[[Update], None]       # called on the engine thread
    logprobs: int | None = None               # top-k logprobs per token, None: none
    echo: bool = False                        # with logprobs: also score the prompt
    start: DecodeState | None = None          # a conversation (batch 1) to continue; unchanged
    end: DecodeState | None = None            # with `start`: the conversation after this turn,
                                              # set when it finishes ("stop" or "length")
    # -- engine-owned -----------------------------------------------------------------------------
    tokens: list[int] = field(default_factory=list)
    feed: list[int] = field(default_factory=list)       # prompt tokens still to decode
    prompt_lp: list[TokenLogprob] = field(default_factory=list)
    carried: int = 0                          # unfed tokens of `start` fed before the prompt
    text: str = ""                            # decoded output, cut at a stop sequence
    decoded: IncrementalText | None = None    # decodes `tokens` as they grow
    sent: str = ""                            # the prefix of `text` already sent
    finish_reason: str | None = None
    cancelled: bool = False
    slot: int | None = None
    ran: int = 0                              # decode steps since last admitted to a slot
    saved: DecodeState | None = None          # its sequence while swapped out (batch 1)
    sampler: torch.Generator | None = None    # its generator while swapped out
    t_submit: float = 0.0
    t_last: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Prefill:
    req: Request
    state: DecodeState                        # batch 1
    cursor: int = 0
    logits: Tensor | None = None              # (1, V) of the last prompt position


class Observer(Protocol):
    """Metrics hooks (called on the engine thread)."""
    def first_token(self, seconds: float) -> None: ...
    def next_token(self, seconds: float) -> None: ...
    def finished(self, reason: str, n_tokens: int) -> None: ...


class Engine:
    def __init__(self, gen: Generator, codec: Codec, slots: int, max_queue: int = 64,
                 prefill_budget: int | None = None, observer: Observer | None = None,
                 quantum: int = QUANTUM):
        if slots < 1:
            raise TitancError(f"--slots: {slots} must be at least 1")
        self.gen, self.codec, self.n_slots, self.max_queue = gen, codec, slots, max_queue
        self.prefill_budget = prefill_budget or 4 * gen.chunk
        self.quantum = quantum                              # decode steps of a fair share
        self.preempted = 0                                  # swaps out, for /metrics, tests
        self.observer = observer
        self.state = gen.new_state(slots)
        self._fresh = gen.new_state(1)
        self._tokens = torch.zeros(slots, 1, dtype=torch.int64)
        self.slots: list[Request | None] = [None] * slots
        self._prefills: dict[int, _Prefill] = {}            # slot -> prefill in progress
        self._samplers: dict[int, torch.Generator] = {}     # slot -> its request's generator
        self.waiting: deque[Request] = deque()
        self.steps = 0                                      # batched decode steps run
        self.draining = False
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None             # what stopped the loop, if any
        self.failures = 0                                   # iterations that raised, recovered
        self._outbox: list[tuple[Request, Update]] = []
        # called on the engine thread with each iteration's (request, update) pairs; it must
        # not block and must arrange for each request's on_update to be called
        self.deliver: Callable[[list[tuple[Request, Update]]], None] | None = None

    # -- public, any thread ----------------------------------------------------------------------
    def submit(self, reqs: Sequence[Request]) -> None:
        """Queue requests, all or none: raises QueueFull or Draining."""
        with self._cv:
            if self.draining or self._stop:
                raise Draining("the server is shutting down")
            if len(self.waiting) + len(reqs) > self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (limit "
                                f"{self.max_queue})")
            now = time.perf_counter()
            for r in reqs:
                r.t_submit = now
                self.waiting.append(r)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        """Stop a request; its slot is free before the next decode step."""
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    def cancel_all(self) -> None:
        with self._cv:
            for r in list(self.waiting) + [r for r in self.slots if r is not None]:
                r.cancelled = True
            self._cv.notify()

    def drain(self) -> None:
        """Admit nothing new from now on; requests already queued or running continue."""
        with self._cv:
            self.draining = True

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    @property
    def idle(self) -> bool:
        with self._cv:
            return not self.waiting and self.active == 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="titanc-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.cancel_all()
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and not self.waiting and self.active == 0:
                        self._cv.wait()
                    if self._stop:
                        break
                try:
                    self.iterate()
                except Exception as exc:                    # noqa: BLE001 - keep serving
                    self._recover(exc)
        except BaseException as exc:                        # never leave clients hanging
            self.error = exc
            with self._cv:
                self.draining = True
                for r in list(self.waiting) + [r for r in self.slots if r is not None]:
                    r.cancelled = True
            self._reap()
            self._flush()
            raise

    def _recover(self, exc: Exception) -> None:
        """An iteration raised outside any one request (a batched step): end every request in
        a slot with the error, start the slots afresh and go on serving the queue."""
        msg = _one_line(exc, "the engine failed on a batched step")
        print(f"titanc engine: {msg}; ending the requests in its slots", file=sys.stderr)
        self.failures += 1
        with self._cv:
            for s, r in enumerate(self.slots):
                if r is not None:
                    self._fail(r, msg)
                    self.slots[s] = None
            self._prefills.clear()
            self._samplers.clear()
            self.state = self.gen.new_state(self.n_slots)
        self._flush()

    def _fail(self, r: Request, msg: str) -> None:
        """End one request with an error ("abort": a conversation keeps its state)."""
        r.cancelled = True
        self._finish(r, "abort", error=msg)

    def iterate(self) -> None:
        """One engine iteration (public so tests can drive the engine without its thread)."""
        try:
            self._reap()
            self._admit()
            self._prefill()
            if any(r is not None and s not in self._prefills for s, r in enumerate(self.slots)):
                self._decode()
            self._reap()
        finally:
            self._flush()

    def _reap(self) -> None:
        with self._cv:
            for r in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(r)
                self._finish(r, "abort")
            for s, r in enumerate(self.slots):
                if r is not None and (r.cancelled or r.done):
                    if not r.done:
                        self._finish(r, "abort")
                    elif r.start is not None and r.finish_reason != "abort":
                        r.end = self.state.take(s)           # all but the last sampled token
                        r.end.unfed = [r.tokens[-1:]]
                    self.slots[s] = None
                    self._prefills.pop(s, None)
                    self._samplers.pop(s, None)
                    self.state.put(s, self._fresh)

    def _admit(self) -> None:
        with self._cv:
            self._preempt()
            for s in range(self.n_slots):
                if self.slots[s] is None and self.waiting:
                    r = self.waiting.popleft()
                    r.slot, r.ran = s, 0
                    self.slots[s] = r
                    if r.saved is not None:                 # swapped out earlier: back in
                        self.state.put(s, r.saved)
                        self._samplers[s], r.saved, r.sampler = r.sampler, None, None
                        continue
                    self._prefills[s] = _Prefill(r, self._start_state(r))
                    if r.echo and r.logprobs is not None:
                        r.prompt_lp = [TokenLogprob(r.prompt[0], None, None)]
                    seed = r.sampling.seed
                    self._samplers[s] = torch.Generator().manual_seed(seed)

    def _preempt(self) -> None:
        """Fair share: while requests wait and no slot is free, a request that has had its
        slot for `quantum` decode steps is swapped out to the back of the queue (its
        sequence copied aside: the state is constant-size, its sampler kept, so its tokens
        do not change), longest-running first, one per waiting request."""
        free = sum(r is None for r in self.slots)
        due = sorted((s for s, r in enumerate(self.slots)
                      if r is not None and s not in self._prefills and not r.done
                      and not r.cancelled and r.ran >= self.quantum),
                     key=lambda s: -self.slots[s].ran)           # type: ignore[union-attr]
        for s in due[:max(0, len(self.waiting) - free)]:
            r = self.slots[s]
            assert r is not None
            r.saved = self.gen.new_state(1)
            r.saved.put(0, self.state, s)
            r.sampler = self._samplers.pop(s)
            r.slot, self.slots[s] = None, None
            self.state.put(s, self._fresh)
            self.waiting.append(r)
            self.preempted += 1

    def _start_state(self, r: Request) -> DecodeState:
        """Where a request's prefill starts: a fresh sequence, or a copy of its conversation,
        whose unfed tokens become the head of the prompt."""
        if r.start is None:
            return self.gen.new_state(1)
        st = r.start.take(0)
        r.carried = len(st.unfed[0])
        r.prompt = st.unfed[0] + r.prompt
        st.unfed = [[]]
        return st

    # -- prefill ---------------------------------------------------------------------------------
    def _prefill_size(self, p: "_Prefill") -> int:
        """Tokens of the next batch-1 prefill step: a whole chunk, or, for a conversation not
        at a chunk boundary, one token towards it; 0 once less than a chunk would follow."""
        chunk = self.gen.chunk
        head = -p.state.pos[0] % chunk
        if p.cursor + head + chunk > len(p.req.prompt):
            return 0
        return 1 if head else chunk

    def _prefill(self) -> None:
        """Whole memory chunks of admitted prompts, in parallel (batch 1), oldest first, up
        to the token budget; the rest of a prompt (less than a chunk) is fed through the
        batched decode steps, one token per step, at no extra cost."""
        budget = self.prefill_budget
        for s in sorted(self._prefills, key=lambda s: self._prefills[s].req.t_submit):
            p = self._prefills[s]
            r = p.req
            try:
                while budget > 0 and (n := self._prefill_size(p)):
                    self._prefill_chunk(p, n)
                    budget -= n
            except Exception as exc:                        # noqa: BLE001 - this request only
                del self._prefills[s]
                self._fail(r, _one_line(exc, "the engine failed on this prompt"))
                continue
            if not self._prefill_size(p):
                del self._prefills[s]
                self.state.put(s, p.state)
                r.feed = r.prompt[p.cursor:]
                if not r.feed:                              # the prompt ended on a chunk
                    self._start(s, p.logits)
            if budget <= 0:
                break

    def _prefill_chunk(self, p: _Prefill, n: int) -> None:
        r, c = p.req, p.cursor
        toks = torch.tensor([r.prompt[c:c + n]], dtype=torch.int64)
        logits = self.gen.step(p.state, toks)                # (1, n, V)
        if r.echo and r.logprobs is not None:
            for t in range(n):
                if c + t + 1 < len(r.prompt):
                    r.prompt_lp.append(self._logprob(logits[0, t], r.prompt[c + t + 1],
                                                     r.logprobs))
        p.logits = logits[:, -1].clone()
        p.cursor += n

    def _start(self, s: int, logits: Tensor) -> None:
        """The prompt is in: score it (echo), then sample the first token."""
        r = self.slots[s]
        assert r is not None
        if r.echo and r.logprobs is not None:
            self._notify(r, Update("", [], [], prompt_logprobs=r.prompt_lp[r.carried:]))
        if r.max_tokens == 0:
            self._finish(r, "length")
        else:
            self._emit(s, logits)

    # -- decode ----------------------------------------------------------------------------------
    def _decode(self) -> None:
        """One batched step over every slot: the next prompt token of a slot still feeding
        its prompt, the last sampled token of a decoding slot, a dummy token elsewhere."""
        for s, r in enumerate(self.slots):
            live = r is not None and s not in self._prefills
            self._tokens[s, 0] = ((r.feed[0] if r.feed else r.tokens[-1]) if live
                                  else 0)                    # type: ignore[union-attr]
        logits = self.gen.step(self.state, self._tokens)[:, -1]     # (N, V)
        self.steps += 1
        for s, r in enumerate(self.slots):
            if r is None or s in self._prefills or r.cancelled:
                continue
            r.ran += 1
            if not r.feed:
                self._emit(s, logits[s:s + 1])
                continue
            r.feed.pop(0)
            if not r.feed:
                self._start(s, logits[s:s + 1])
            elif r.echo and r.logprobs is not None:
                r.prompt_lp.append(self._logprob(logits[s], r.feed[0], r.logprobs))

    def _emit(self, s: int, logits: Tensor) -> None:
        """Sample the next token of slot s from its logits (1, V) and tell the request."""
        r = self.slots[s]
        assert r is not None
        if not bool(torch.isfinite(logits).all()):
            self._fail(r, "the model's output for this sequence is not finite (a NaN or an "
                          "inf): its state is damaged")
            return
        tok = int(sample(penalize(logits, [r.tokens], r.sampling), r.sampling,
                         self._samplers[s])[0])
        lp = [self._logprob(logits[0], tok, r.logprobs)] if r.logprobs is not None else []
        now = time.perf_counter()
        if self.observer is not None:
            if r.tokens:
                self.observer.next_token(now - r.t_last)
            else:
                self.observer.first_token(now - r.t_submit)
        r.t_last = now
        r.tokens.append(tok)
        reason = self._advance_text(r)
        if reason is None and len(r.tokens) >= r.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(r, reason, lp, [tok])
            return
        self._notify(r, Update(self._take_text(r, final=False), [tok], lp))

    def _notify(self, r: Request, update: Update) -> None:
        self._outbox.append((r, update))

    def _flush(self) -> None:
        """Deliver this iteration's updates: all at once through `deliver` when set (one
        wake-up of the server's event loop per step instead of one per token), else each to
        its request's callback here; a failing callback cancels that request only."""
        out, self._outbox = self._outbox, []
        if not out:
            return
        if self.deliver is not None:
            self.deliver(out)
            return
        for r, update in out:
            try:
                r.on_update(update)
            except Exception as exc:                        # noqa: BLE001 - keep serving
                print(f"titanc engine: dropping a request whose callback failed: {exc!r}",
                      file=sys.stderr)
                r.cancelled = True

    def _logprob(self, logits: Tensor, tok: int, k: int | None) -> TokenLogprob:
        lsm = torch.log_softmax(logits.to(torch.float64), -1)
        top = None
        if k:
            v, i = torch.topk(lsm, min(k, lsm.shape[-1]))
            top = dict(zip(i.tolist(), v.tolist()))
        return TokenLogprob(tok, float(lsm[tok]), top)

    # -- text ------------------------------------------------------------------------------------
    def _advance_text(self, r: Request) -> str | None:
        """Decode the output; cut it at the first stop sequence (which is not returned)."""
        before = len(r.text)
        if r.decoded is None:
            r.decoded = IncrementalText(self.codec)
        r.text = r.decoded.text(r.tokens)
        stops = [x for x in r.sampling.stop if x]
        if not stops:
            return None
        longest = max(map(len, stops))
        start = max(0, min(before, len(r.text)) - longest)
        hits = [i for i in (r.text.find(x, start) for x in stops) if i >= 0]
        if hits:
            r.text = r.text[:min(hits)]
            return "stop"
        return None

    def _take_text(self, r: Request, final: bool) -> str:
        """The text not yet sent that can no longer change: without a trailing incomplete
        UTF-8 character, and short of a stop sequence's length minus one."""
        ready = r.text
        if not final:
            ready = ready.rstrip(REPLACEMENT)
            hold = max((len(x) for x in r.sampling.stop if x), default=1) - 1
            ready = ready[:max(0, len(ready) - hold)]
        if len(ready) <= len(r.sent) or not ready.startswith(r.sent):
            return ""
        out = ready[len(r.sent):]
        r.sent = ready
        return out

    def _finish(self, r: Request, reason: str, lp: list[TokenLogprob] | None = None,
                tokens: list[int] | None = None, error: str | None = None) -> None:
        if r.done:
            return
        r.finish_reason = reason
        if self.observer is not None:
            self.observer.finished(reason, len(r.tokens))
        self._notify(r, Update(self._take_text(r, final=True), tokens or [], lp or [],
                           finish_reason=reason, error=error))


def _one_line(exc: BaseException, what: str) -> str:
    """`what` and the exception's first line, for a client and the log (no traceback)."""
    first = (str(exc).splitlines() or [""])[0][:160]
    return f"{what} ({type(exc).__name__}{': ' + first if first else ''})"


def random_seed() -> int:
    """A seed for a request that did not name one."""
    return random.SystemRandom().randrange(2**63)
