"""chunked loss: the LM head and cross-entropy over chunks of tokens, so the [B·T, V]
logits never exist.

Matches the frontend's loss, `mean(logsumexp(h @ head) − take_along(h @ head, targets))`,
and replaces it by a scan over chunks of `chunk` tokens whose carry is the running loss sum:

    h (B, T, D) -> (n, c, D);  targets -> (n, c)
    scan: logits = h_c @ head (c, V); lse = m + log Σ exp(logits − m); acc += Σ (lse − tgt)
    loss = acc / (B·T)

Autodiff turns it into a reverse scan that recomputes one chunk's logits at a time: the head
gradient accumulates in a carry and the hidden-state gradient comes out chunk by chunk, with
no host synchronisation. Precondition: `g` verifies and came from the frontend (or passes that
keep the loss subgraph). Postcondition: same loss; no value of the result has more than
`chunk·V` elements on the head path. If the pattern is not found the graph is returned as is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanc.ir import Builder, Graph, Node, Op, Value


def match_loss(g: Graph) -> dict[str, int] | None:
    """Walk back from the `loss` output through the frontend's cross-entropy ops."""
    def one(nid: int, op: Op) -> Node | None:
        n = g.node(nid)
        return n if n.op is op else None

    try:
        loss = g.node(g.output("loss"))
    except KeyError:
        return None
    if loss.op is not Op.MUL:
        return None
    total = one(loss.inputs[0], Op.SUM)
    diff = total and one(total.inputs[0], Op.SUB)
    lse = diff and one(diff.inputs[0], Op.ADD)
    tgt = diff and one(diff.inputs[1], Op.TAKE_ALONG)
    log = lse and one(lse.inputs[0], Op.LOG)
    if not (log and tgt):
        return None
    logits = g.node(tgt.inputs[0])
    if logits.op is not Op.EINSUM or logits.attr("spec") not in ("btd,vd->btv", "btd,dv->btv"):
        return None
    return {"logits": logits.id, "h": logits.inputs[0], "head": logits.inputs[1],
            "targets": tgt.inputs[1], "loss": loss.id}


def loss_chunk_size(n_tokens: int, want: int) -> int:
    """The largest divisor of n_tokens that is at most `want`."""
    for c in range(min(want, n_tokens), 0, -1):
        if n_tokens % c == 0:
            return c
    return 1


@dataclass(frozen=True)
class ChunkedLoss:
    """The LM head and cross-entropy as a scan over chunks of at most `chunk` tokens (the
    module docstring has the pre/postconditions); `chunk <= 0` leaves the graph as it is."""
    chunk: int
    name: ClassVar[str] = "chunked_loss"

    def __call__(self, g: Graph) -> Graph:
        return _chunk_loss(g, self.chunk) if self.chunk > 0 else g


def _chunk_loss(g: Graph, chunk: int) -> Graph:
    m = match_loss(g)
    if m is None:
        return g
    spec = g.node(m["logits"]).attr("spec")
    B, T, D = g.node(m["h"]).type.shape
    c = loss_chunk_size(B * T, chunk)
    n = B * T // c
    head_spec = "cd,vd->cv" if spec.startswith("btd,vd") else "cd,dv->cv"
    b = Builder(g.name)
    env: dict[int, Value] = {}
    for node in g:                 # every node is rebuilt (outputs after the loss included);
        if node.id == m["loss"]:   # the loss is the chunked scan, the old head path dies
            env[node.id] = _chunked(b, env[m["h"]].reshape(n, c, D),
                                    env[m["targets"]].reshape(n, c), env[m["head"]],
                                    head_spec, B * T)
            continue
        env[node.id] = b.like(node, *[env[i] for i in node.inputs])
    b.graph.set_outputs([(name, env[i].id) for name, i in g.outputs])
    from titanc.passes.canonicalize import canonicalize
    return canonicalize(b.graph)


def _chunked(b: Builder, h: Value, targets: Value, head: Value, head_spec: str,
             tokens: int) -> Value:
    """The mean cross-entropy as a scan over chunks h (n, c, D), targets (n, c)."""
    n, c, _ = h.shape

    def body(bb: Builder, carry: list[Value], xs: list[Value], consts: list[Value]):
        hc, tc = xs
        logits = bb.einsum(head_spec, hc, consts[0])             # (c, V): one chunk only
        mx = logits.amax((-1,), keepdim=True)
        lse = (logits - mx).exp().sum((-1,)).log() + mx.reshape(c)
        return [carry[0] + (lse - bb.take_along(logits, tc)).sum((0,))], []

    (acc,), _ = b.scan(body, [b.full(0.0, (), head.dtype)], [h, targets], [head], length=n,
                       name="loss_chunk", names=["acc", "h", "targets", "head"],
                       role="loss")
    return acc * (1.0 / tokens)
