"""Frontend: lower a spec into the forward graph (tokens -> loss).

Graph inputs: `tokens` i64 [B, T+1], then every parameter of `params.param_specs` by name.
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


def lm_loss(b: Builder, x: Value, params: dict[str, Value], targets: Value, tied: bool) -> Value:
    """Mean next-token cross-entropy of rmsnorm(x) @ head; x (B, T, D), targets (B, T)."""
    logits = lm_logits(b, x, params, tied)                        # (B, T, V)
    m = logits.amax((-1,), keepdim=True)
    lse = (logits - m).exp().sum((-1,)).log() + m.reshape(*m.shape[:-1])   # (B, T)
    return (lse - b.take_along(logits, targets)).mean((0, 1))


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
                segmented: bool = False, rows: int = 0) -> Value:
    """The layers as one scan over stacked weights; `segmented` (`train.remat: per_segment`):
    each layer's per-token work runs a segment at a time, MAC `rows` sequences at a time
    (`blocks.Parallel`)."""
    names = sorted(k for k in params if k.startswith("layers."))
    short = [k.removeprefix("layers.") for k in names]

    def body(bb: Builder, carry: list[Value], xs: list[Value], _: list[Value]):
        p = dict(zip(short, xs))
        return [block(Parallel(bb, p, m, segmented, rows), carry[0], p, m)], []

    (x,), _ = b.scan(body, [x], [params[k] for k in names], length=m.n_layers,
                     name="layer", names=["x"] + short, role="layer")
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
    x = b.take(params["embed"], tokens.slice(1, 0, T))            # (B, T, D)
    # remat per_segment shapes the program the training graph differentiates (the loss);
    # logits / logprobs keep the whole-sequence layers (memory_stats reads their chunk scans)
    segmented = spec.train.remat == "per_segment" and output == "loss"
    x = layer_stack(b, x, params, m, segmented, spec.train.remat_rows)
    if output == "logits":
        out = lm_logits(b, x, params, m.tie_embeddings)
    elif output == "logprobs":
        out = lm_logprobs(b, x, params, tokens.slice(1, 1, T + 1), m.tie_embeddings,
                          spec.train.loss_chunk)
    else:
        out = lm_loss(b, x, params, tokens.slice(1, 1, T + 1), m.tie_embeddings)
    b.graph.set_outputs([(output, out.id)])
    return b.graph
