"""Document boundaries inside a row (`data.documents: true`, docs/semantics.md "Documents").

The graph input `doc_start` (B, T), float, holds for each token the position in its row at
which its document starts (0 for tokens of a document that began before the row). Every
reset is built from it with ordinary elementwise ops (GT against position vectors made by a
CUMSUM of ones), so every pass, both targets and remat see them as any other value:

    attention      key j hidden from query i unless j >= doc_start[i] (an additive −BIG);
                   RoPE at each token's position in its document (t − doc_start[t])
    causal conv    a tap reading a position before doc_start[t] reads 0
    memory         a token whose document starts inside its chunk reads, and takes its inner
                   gradient at, (W⁽⁰⁾, 0); the chunk's closed-form update keeps only the chunk's
                   last document (`neural_memory.chunk_update_docs`)

All comparisons are between integers held in floats (exact below 2²⁴), offset by 0.5.
"""
from __future__ import annotations

from titanc.ir import Op, Value

# additive bias of a key in another document: finite, so no −inf − (−inf) anywhere; exp of
# (a score − BIG) is exactly 0 in float32 and float64
BIG = 1e30


def positions(x: Value, n: int, start: int = 0) -> Value:
    """The positions start .. start+n-1 as a vector (n,) of x's dtype."""
    return x.b.full(1.0, (n,), x.dtype).cumsum(0) + float(start - 1)


def unit_starts(x: Value, T: int, unit: int) -> Value:
    """(T,): the position at which each token's unit (memory chunk, MAC segment) starts."""
    n = T // unit
    first = (x.b.full(1.0, (n, 1), x.dtype).cumsum(0) - 1.0) * float(unit)   # (n, 1)
    return first.expand(n, unit).reshape(T)


def local(doc: Value, unit: int) -> Value:
    """doc_start (B, T) relative to each token's unit start: < 0 where the document began
    before the unit, >= 0 where it began inside it."""
    return doc - unit_starts(doc, doc.shape[1], unit)


def gt(x: Value, y: Value | float) -> Value:
    """1.0 where x > y, else 0.0 (broadcasting)."""
    return x.b.op(Op.GT, x, x.b.lift(y, x.dtype))


def visible(doc: Value, n_keys: int) -> Value:
    """(B, T, n_keys): 1 where key j (at position j) is in query i's document or later
    (j >= doc[i]); the causal/window mask hides the later ones."""
    B, T = doc.shape
    return gt(positions(doc, n_keys).reshape(1, 1, n_keys) + 0.5, doc.reshape(B, T, 1))


def attention_bias(doc: Value, P: int, groups: int) -> Value:
    """Additive visibility (B, 1, T, P + groups·T) of [P persistent ‖ group₁ ‖ … ]: 0 for the
    persistent keys and for keys in the query's document, −BIG for earlier documents' keys."""
    B, T = doc.shape
    hide = (visible(doc, T) - 1.0) * BIG                           # (B, T, T)
    bias = hide if groups == 1 else doc.b.concat([hide] * groups, 2)
    if P:
        bias = bias.pad(2, P, 0)
    return bias.reshape(B, 1, T, P + groups * T)


def rope_tables(rel: Value, half: int) -> tuple[Value, Value]:
    """RoPE cos/sin tables (B, 1, T, half) at each token's position in its document `rel`
    (B, T): rows of the static ROPE tables picked by a one-hot contraction, so a document's
    tokens rotate by exactly the values the same tokens get at the start of a row."""
    b = rel.b
    B, T = rel.shape
    p = positions(rel, T).reshape(1, 1, T)
    r = rel.reshape(B, T, 1)
    onehot = gt(p + 0.5, r) - gt(p - 0.5, r)                      # (B, T, T): rel == p
    return tuple(b.einsum("btp,ph->bth", onehot, b.rope(kind, 0, T, half, rel.dtype))
                 .reshape(B, 1, T, half) for kind in ("cos", "sin"))  # type: ignore[return-value]


def conv_tap(doc: Value, back: int) -> Value:
    """(B, T, 1): 1 where the position `back` steps before each token is in its document."""
    B, T = doc.shape
    return gt(positions(doc, T).reshape(1, T) - float(back) + 0.5, doc).reshape(B, T, 1)
