"""Frontend: lower a spec into the forward graph (tokens -> loss).

Graph inputs: `tokens` i64 [B, T+1], then every parameter of `params.param_specs` by name;
with `data.documents`, `doc_start` [B, T] (each token's document start, documents.py) and,
for the loss, `loss_mask` [B, T] (which targets count).
Layers are one scan over stacked weights (`layers.*`, leading axis L), so the IR and the
compiled body do not grow with depth.
"""
from __future__ import annotations

from titanc.ir import Builder, Graph, Value, dtype_name

from titanc.model.blocks import Parallel, block
from titanc.model.nn import rmsnorm
from titanc.model.params import param_specs
from titanc.model.spec import ModelSpec, Spec


def lm_logits(b: Builder, x: Value, params: dict[str, Value], tied: bool) -> Value:
    """rmsnorm(x) @ head: (B, T, D) -> (B, T, V)."""
    h = rmsnorm(x, params["norm_f"])
    if tied:
        return b.einsum("btd,vd->btv", h, params["embed"])
    return b.einsum("btd,dv->btv", h, params["lm_head"])


def lm_loss(b: Builder, x: Value, params: dict[str, Value], targets: Value, tied: bool,
            mask: Value | None = None) -> Value:
    """Mean next-token cross-entropy of rmsnorm(x) @ head; x (B, T, D), targets (B, T). With
    `mask` (B, T) of 0/1: the mean over the positions it keeps (sum(ce·mask) / max(Σmask, 1))."""
    logits = lm_logits(b, x, params, tied)                        # (B, T, V)
    m = logits.amax((-1,), keepdim=True)
    lse = (logits - m).exp().sum((-1,)).log() + m.reshape(*m.shape[:-1])   # (B, T)
    ce = lse - b.take_along(logits, targets)
    if mask is None:
        return ce.mean((0, 1))
    return (ce * mask).sum((0, 1)) * b.maximum(mask.sum((0, 1)), 1.0).recip()


def lm_logprobs(b: Builder, x: Value, params: dict[str, Value], targets: Value, tied: bool,
                chunk: int) -> Value:
    """log p(target) per position (B, T), the head applied `chunk` tokens at a time so the
    [B·T, V] logits never exist."""
    from titanc.passes.chunked_loss import loss_chunk_size

    B, T, D = x.shape
    c = loss_chunk_size(B * T, chunk if chunk > 0 else B * T)
    n = B * T // c
    h = rmsnorm(x, params["norm_f"]).reshape(n, c, D)
    head = params["embed"] if tied else params["lm_head"]
    spec = "cd,vd->cv" if tied else "cd,dv->cv"

    def body(bb: Builder, carry: list[Value], xs: list[Value], consts: list[Value]):
        logits = bb.einsum(spec, xs[0], consts[0])                # (c, V)
        mx = logits.amax((-1,), keepdim=True)
        lse = (logits - mx).exp().sum((-1,)).log() + mx.reshape(c)
        return [], [bb.take_along(logits, xs[1]) - lse]

    _, (lp,) = b.scan(body, [], [h, targets.reshape(n, c)], [head], length=n,
                      name="logprob_chunk", names=["h", "targets", "head"], role="loss")
    return lp.reshape(B, T)


def layer_stack(b: Builder, x: Value, params: dict[str, Value], m: ModelSpec,
                segmented: bool = False, rows: int = 0, doc: Value | None = None) -> Value:
    """The layers as one scan over stacked weights; `segmented` (`train.remat: per_segment`):
    each layer's per-token work runs a segment at a time, MAC `rows` sequences at a time
    (`blocks.Parallel`). `doc` (B, T): each token's document start, a constant of the scan."""
    names = sorted(k for k in params if k.startswith("layers."))
    short = [k.removeprefix("layers.") for k in names]
    consts = [] if doc is None else [doc]

    def body(bb: Builder, carry: list[Value], xs: list[Value], k: list[Value]):
        p = dict(zip(short, xs))
        mixers = Parallel(bb, p, m, segmented, rows, k[0] if k else None)
        return [block(mixers, carry[0], p, m)], []

    (x,), _ = b.scan(body, [x], [params[k] for k in names], consts, length=m.n_layers,
                     name="layer", names=["x"] + short + ["doc_start"] * len(consts),
                     role="layer")
    return x


def lower_forward(spec: Spec, batch: int | None = None, dtype: str | None = None,
                  output: str = "loss") -> Graph:
    """The forward graph; `output` is 'loss' (scalar), 'logits' ([B, T, V]) or 'logprobs'
    ([B, T], through the chunked head)."""
    m = spec.model
    B = batch or spec.train.batch_size
    T = m.seq_len
    dt = dtype_name(dtype or spec.train.master_dtype)
    b = Builder("forward")
    tokens = b.input("tokens", (B, T + 1), "i64")
    params = {ps.name: b.input(ps.name, ps.shape, dt) for ps in param_specs(m)}
    # data.documents: each token's document start in its row (titanc/model/documents.py)
    # (data.pack: false rows are one document from position 0: nothing to reset)
    doc = b.input("doc_start", (B, T), dt) if spec.data.documents and spec.data.pack else None
    # ... and which positions' targets count in the loss (0: padding, or a target across a
    # document boundary)
    masked = spec.data.documents or spec.data.loss == "queries"
    mask = b.input("loss_mask", (B, T), dt) if masked and output == "loss" \
        else None
    x = b.take(params["embed"], tokens.slice(1, 0, T))            # (B, T, D)
    # remat per_segment shapes the program the training graph differentiates (the loss);
    # logits / logprobs keep the whole-sequence layers (memory_stats reads their chunk scans)
    segmented = spec.train.remat == "per_segment" and output == "loss"
    x = layer_stack(b, x, params, m, segmented, spec.train.remat_rows, doc)
    if output == "logits":
        out = lm_logits(b, x, params, m.tie_embeddings)
    elif output == "logprobs":
        out = lm_logprobs(b, x, params, tokens.slice(1, 1, T + 1), m.tie_embeddings,
                          spec.train.loss_chunk)
    else:
        out = lm_loss(b, x, params, tokens.slice(1, 1, T + 1), m.tie_embeddings, mask)
    b.graph.set_outputs([(output, out.id)])
    return b.graph
