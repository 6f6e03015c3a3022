"""Documents in packed rows (docs/semantics.md "Documents"): at a document start the memory
(W back to W⁽⁰⁾, S and momentum to 0), the conv history and attention visibility reset, so a
packed row A|B gives B's tokens exactly the loss and gradients of B alone.

Float64 throughout: the eager reference (tests/reference) against itself (packed vs alone),
the frontend on the reference interpreter against the reference, and compiled programs on the
cpu and (interpreted) triton targets against themselves (packed vs alone) and the reference.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import pytest  # noqa: E402
import torch  # noqa: E402

import tests.reference as R  # noqa: E402
from tests.helpers import BLOCKS, one_thread, tiny_spec, tokens  # noqa: F401 (fixture)
from titanc.errors import TitancError  # noqa: E402
from titanc.ir import interpret  # noqa: E402
from titanc.model.frontend import lower_forward  # noqa: E402
from titanc.model.spec import SpecError  # noqa: E402
from titanc.passes.autodiff import grad_graph  # noqa: E402

T = 16          # tiny_spec: seq_len 16, memory chunks of 4, MAC segments of 8


def _spec(block: str, **over):
    return tiny_spec(**{"model.block": block, "data.documents": True, **over})


def _doc(starts: list[list[int]]) -> torch.Tensor:
    """doc_start [B, T] from each row's document starts (after position 0)."""
    doc = torch.zeros(len(starts), T, dtype=torch.long)
    for r, row in enumerate(starts):
        for s in row:
            doc[r, s:] = s
    return doc


def _ce(logits: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy [B, T]."""
    return logits.logsumexp(-1) - logits.gather(-1, toks[:, 1:, None])[..., 0]


def _ref_part(params, toks, doc, cfg, rows: slice, cols: slice):
    """Sum of the reference cross-entropy over toks[rows, cols]'s targets, and its gradients."""
    leaf = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    total = _ce(R.forward_logits(leaf, toks[:, :-1], cfg, doc), toks)[rows, cols].sum()
    total.backward()
    return float(total.detach()), {k: v.grad if v.grad is not None else torch.zeros_like(v)
                          for k, v in leaf.items()}


def _packed_and_alone(spec, a: int, seed: int = 0):
    """Row 0: A (a tokens) | B; row 1: B | C, the same B tokens from position 0."""
    gen = torch.Generator().manual_seed(seed)
    V = spec.model.vocab_size
    b_len = T + 1 - a
    B_ = torch.randint(0, V, (b_len,), generator=gen)
    packed = torch.cat([torch.randint(0, V, (a,), generator=gen), B_])
    alone = torch.cat([B_, torch.randint(0, V, (a,), generator=gen)])
    return torch.stack([packed, alone])


# -------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("block", BLOCKS)
def test_reference_packed_equals_alone(block: str) -> None:
    """A document starting on a chunk (and MAC segment) boundary: B's losses and their
    gradients equal B alone, in a row without documents, to 1e-10."""
    spec = _spec(block)
    params = R.init_params(spec.model, seed=1)
    a = 8
    toks = _packed_and_alone(spec, a)
    doc = _doc([[a], []])
    n = T - a                                            # B's targets: the last is C's or none
    got, g_got = _ref_part(params, toks[:1], doc[:1], spec.model, slice(None), slice(a, T))
    want, g_want = _ref_part(params, toks[1:], None, spec.model, slice(None), slice(0, n))
    assert abs(got - want) < 1e-10
    for k in params:
        torch.testing.assert_close(g_got[k], g_want[k], rtol=1e-10, atol=1e-10,
                                   msg=lambda m: f"grad of {k}: {m}")
    # without the document start, A leaks into B: the test can fail
    leaked, _ = _ref_part(params, toks[:1], None, spec.model, slice(None), slice(a, T))
    assert abs(leaked - want) > 1e-6


@pytest.mark.parametrize("block", BLOCKS)
def test_reference_mid_chunk_start_does_not_leak(block: str) -> None:
    """A start inside a chunk and a segment: B's logits do not depend on A at all."""
    spec = _spec(block)
    params = R.init_params(spec.model, seed=2)
    a = 5
    toks = tokens(spec, batch=2, seed=3)
    toks[1, a:] = toks[0, a:]                            # same B after different A's
    out = R.forward_logits(params, toks[:, :-1], spec.model, _doc([[a], [a]]))
    torch.testing.assert_close(out[0, a:], out[1, a:], rtol=1e-12, atol=1e-12)
    plain = R.forward_logits(params, toks[:, :-1], spec.model)
    assert (plain[0, a:] - plain[1, a:]).abs().max() > 1e-6


# ------------------------------------------------------------ the frontend (interpreted IR)


@pytest.mark.parametrize("block", BLOCKS)
def test_frontend_matches_reference(block: str) -> None:
    """The lowered graph with doc_start and loss_mask: masked loss and every gradient match
    the reference to 1e-10 (starts at, before and inside chunks and segments)."""
    spec = _spec(block)
    params = R.init_params(spec.model, seed=4)
    toks = tokens(spec, batch=2, seed=5)
    doc = _doc([[3, 8, 13], [5, 6]])
    mask = torch.ones(2, T, dtype=torch.float64)
    mask[0, 7] = mask[1, 4] = 0.0                        # targets across a boundary
    leaf = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ce = _ce(R.forward_logits(leaf, toks[:, :-1], spec.model, doc), toks)
    ref = (ce * mask).sum() / mask.sum()
    ref.backward()
    out = interpret(grad_graph(lower_forward(spec), list(params)),
                    {"tokens": toks, "doc_start": doc.double(), "loss_mask": mask, **params})
    assert abs(float(out["loss"]) - float(ref)) < 1e-10
    for k, p in leaf.items():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(out[f"grad.{k}"], want, rtol=1e-8, atol=1e-12,
                                   msg=lambda m: f"grad of {k}: {m}")


def test_without_documents_the_graph_is_unchanged() -> None:
    """data.documents false (the default): no document inputs, the same graph as before."""
    plain = lower_forward(tiny_spec(**{"model.block": "mag"}))
    assert "doc_start" not in plain.input_names() and "loss_mask" not in plain.input_names()
    docs = lower_forward(_spec("mag"))
    assert {"doc_start", "loss_mask"} <= set(docs.input_names())
    assert len(list(docs)) > len(list(plain))


# ------------------------------------------------------------------- compiled, both targets


def _program(block: str, target: str, layers: int | None = None):
    """The block compiled for `target`; one layer on the interpreted triton target (every
    reset is per layer; two layers are checked on the reference and the cpu target)."""
    import titanc

    layers = layers or (1 if target == "triton" else 2)
    return titanc.compile(_spec(block, **{"compile.target": target, "model.n_layers": layers}))


# MAC on the cpu target (memory and attention read in parallel; every block is packed against
# alone on the reference above); the other blocks and the interpreted triton target in the
# slow tier (the default tier's triton case is the mid-chunk
# test below: MAC, starts inside chunks, gradients against the cpu target)
PACKED_CASES = [pytest.param(b, t, marks=[] if t == "cpu" and b == "mac"
                             else [pytest.mark.slow])
                for t in ("cpu", "triton") for b in BLOCKS]


@pytest.mark.parametrize("block,target", PACKED_CASES)
def test_compiled_packed_equals_alone(block: str, target: str) -> None:
    """A packed row A|B with the loss mask on B gives exactly the loss and the gradients of B
    alone (the B|C row, one document, the same mask on B), 1e-10 in float64; and the packed
    row's full masked loss matches the reference. On triton, B alone runs on a cpu-target
    twin (the same parameters; the targets agree in float64): one interpreted step."""
    prog = _program(block, target)
    twin = _program(block, "cpu", layers=prog.spec.model.n_layers) if target == "triton" else prog
    a = 8
    toks = _packed_and_alone(prog.spec, a, seed=6)
    mask = torch.zeros(2, T, dtype=torch.float64)
    mask[0, a:T] = 1.0
    mask[1, 0:T - a] = 1.0
    doc = _doc([[a], []]).double()
    got, g_got = prog.grads(toks[:1], {"doc_start": doc[:1], "loss_mask": mask[:1]})
    want, g_want = twin.grads(toks[1:], {"doc_start": doc[1:], "loss_mask": mask[1:]})
    assert abs(got - want) < 1e-10
    for k in g_want:
        torch.testing.assert_close(g_got[k], g_want[k], rtol=1e-10, atol=1e-10,
                                   msg=lambda m: f"grad of {k}: {m}")
    params = prog.parameters()
    assert all(torch.equal(params[k], v) for k, v in twin.parameters().items())
    ref, _ = _ref_part(params, toks[:1], _doc([[a]]), prog.spec.model, slice(None),
                       slice(a, T))
    assert abs(got - ref / (T - a)) < 1e-10


@pytest.mark.parametrize("target", ["cpu", "triton"])
def test_compiled_mid_chunk_starts_match_reference(target: str) -> None:
    """Starts inside chunks on a compiled MAC (attention, both conv kinds, memory reads and
    writes): the training loss matches the reference; on triton the loss and every gradient
    match the cpu target's (1e-10, float64)."""
    prog = _program("mac", target)
    toks = tokens(prog.spec, batch=1, seed=8)
    doc = _doc([[3, 6, 13]])
    mask = torch.ones(1, T, dtype=torch.float64)
    extra = {"doc_start": doc.double(), "loss_mask": mask}
    loss, grads = prog.grads(toks, extra)
    ce = _ce(R.forward_logits(prog.parameters(), toks[:, :-1], prog.spec.model, doc), toks)
    assert abs(loss - float(ce.mean())) < 1e-10
    if target == "triton":
        twin = _program("mac", "cpu", layers=prog.spec.model.n_layers)
        assert all(torch.equal(prog.parameters()[k], v) for k, v in twin.parameters().items())
        want, g_want = twin.grads(toks, extra)
        assert abs(loss - want) < 1e-10
        for k in g_want:
            torch.testing.assert_close(grads[k], g_want[k], rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"grad of {k}: {m}")


# ------------------------------------------------------------------------- spec and inputs


def test_pack_false_needs_documents() -> None:
    with pytest.raises(SpecError, match="data.documents"):
        tiny_spec(**{"data.pack": False})


def test_document_inputs_without_documents_is_an_error() -> None:
    import titanc

    prog = titanc.compile(tiny_spec(**{"compile.target": "cpu"}))
    toks = tokens(prog.spec)
    with pytest.raises(TitancError, match="data.documents=true"):
        prog.loss(toks, {"doc_start": torch.zeros(toks.shape[0], T)})


def test_bad_document_input_shape() -> None:
    prog = _program("lmm", "cpu")
    toks = tokens(prog.spec)
    with pytest.raises(TitancError, match="doc_start must be"):
        prog.loss(toks, {"doc_start": torch.zeros(toks.shape[0], T + 1)})


# ------------------------------------------------------------------------------------ data


@pytest.fixture
def shards(tmp_path):
    """Three byte-level documents of 20, 7 and 30 tokens (files are documents)."""
    from titanc.runtime.data.prepare import prepare

    (tmp_path / "in").mkdir()
    texts = {"a.txt": "a" * 20, "b.txt": "b" * 7, "c.txt": "c" * 30}
    for name, text in texts.items():
        (tmp_path / "in" / name).write_text(text)
    prepare([tmp_path / "in"], tmp_path / "s", val_fraction=0.0, progress=False, workers=1)
    return tmp_path / "s"


def test_prepare_records_document_starts(shards) -> None:
    from titanc.runtime.data.shards import ShardData

    data = ShardData(shards, T, 256)
    assert data.doc_starts("train").tolist() == [0, 20, 27]
    assert (shards / "train.docs").stat().st_size == 3 * 8


def test_packed_batches_carry_document_starts(shards) -> None:
    """Every row: doc_start is each token's document start in the row (0 when it began
    earlier), and a target that begins a document is masked."""
    from titanc.runtime.data.shards import ShardData

    data = ShardData(shards, T, 256)
    toks, docs = data.batch_documents(64, "train", torch.Generator().manual_seed(0))
    assert toks.shape == (64, T + 1) and docs["doc_start"].shape == (64, T)
    seen_start = False
    for row, ds, m in zip(toks, docs["doc_start"], docs["loss_mask"]):
        for t in range(T):
            d = int(ds[t])
            assert set(row[d:t + 1].tolist()) == {int(row[t])}      # one document a..t
            assert d == 0 or row[d - 1] != row[d]                    # and it starts at d
            assert m[t] == float(row[t + 1] == row[t])               # target in the document
            seen_start |= d > 0
    assert seen_start
    # the same generator state draws the same windows as `batch`
    plain = data.batch(64, "train", torch.Generator().manual_seed(0))
    assert torch.equal(plain, toks)


def test_unpacked_rows_are_one_document_padded(shards) -> None:
    from titanc.runtime.data.shards import ShardData

    data = ShardData(shards, T, 256)
    toks, docs = data.batch_documents(32, "train", torch.Generator().manual_seed(1), pack=False)
    lengths = {ord("a"): 20, ord("b"): 7, ord("c"): 30}
    for row, m in zip(toks, docs["loss_mask"]):
        n = min(lengths[int(row[0])], T + 1)                  # the document's tokens in the row
        assert set(row[:n].tolist()) == {int(row[0])} and not row[n:].any()
        assert m.tolist() == [1.0] * (n - 1) + [0.0] * (T - n + 1)
    assert not docs["doc_start"].any()


def test_documents_need_shards_with_starts(shards, tmp_path) -> None:
    from titanc.runtime.data.datasets import make_data

    text = tmp_path / "t.txt"
    text.write_text("x" * 100)
    with pytest.raises(TitancError, match="data.documents"):
        make_data(tiny_spec(**{"data.documents": True, "data.source": str(text),
                               "model.vocab_size": 256}))
    (shards / "train.docs").write_bytes(b"\0" * 5)
    with pytest.raises(TitancError, match="train.docs"):
        make_data(tiny_spec(**{"data.documents": True, "data.source": str(shards),
                               "model.vocab_size": 256}))


@pytest.mark.parametrize("pack", [True, False])
def test_training_on_documents(shards, tmp_path, pack: bool) -> None:
    """The trainer draws document batches and passes them: two steps, an evaluation and
    the memory diagnostics run on the cpu target, the loss finite and falling."""
    from titanc.runtime.train.trainer import read_metrics, run_training

    spec = tiny_spec(**{"data.documents": True, "data.pack": pack, "data.source": str(shards),
                        "model.vocab_size": 256, "data.val_fraction": 0.0,
                        "compile.target": "cpu", "train.eval_every": 0,
                        "train.memory_stats_every": 2, "train.lr": 1e-2})
    summary = run_training(spec, tmp_path / "run", steps=4, progress=False, log=lambda _: None)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert any("memory" in r for r in rows) and summary["steps_run"] == 4
