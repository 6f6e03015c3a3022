"""flash-linear-attention (fla) as an external oracle (issue 52): the memories of the presets
examples/deltanet.yaml, gated_deltanet.yaml and titans_fla.yaml, compiled by titanc's frontend
(`neural_memory.memory_scan` through the IR interpreter), equal fla's own plain-PyTorch
references in float64, outputs and final states, to 1e-12; and titanc's heavy-ball write read
after the write equals fla's momentum delta rule.

fla's reference files are loaded as files (importlib.util.spec_from_file_location), never by
importing `fla.ops`, which would import every Triton kernel. They compute in float32 by
casting their inputs (`.float()`, `.to(torch.float32)`, `dtype=torch.float`); to compare in
float64 the loaded text has those dtypes replaced by float64 (and the titans reference runs
with torch's default dtype float64: one of its tensors is made without a dtype). Two more edits,
to titans/naive.py alone, are `load_fla_titans`'s: its import of `fla.ops` is replaced by the
same function loaded as a file, and its layer-norm backward gets the parentheses its own comment
has (as shipped, its write is not the gradient of its loss). The only other thing this file
does is map inputs between the two conventions, one line each: fla's state S (d_k, d_v) is
titanc's Wᵀ; fla's β is θ·2/d_v (titanc's inner loss is a mean over the d_v channels); fla's
log decay g is titanc's log(1 − α); fla scales q by d_k^-1/2 inside (titanc's q is passed
pre-scaled where fla gives no `scale` argument)."""
from __future__ import annotations

import importlib.util
import re
from contextlib import contextmanager
from typing import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from titanc.ir import Builder, interpret
from titanc.model.neural_memory import MemStreams, memory_scan
from titanc.model.objective import objective_of
from titanc.model.spec import MemorySpec, load_spec

pytest.importorskip("einops")
_FLA = importlib.util.find_spec("fla")          # finds the package without importing it
if _FLA is None or not _FLA.submodule_search_locations:
    pytest.skip("fla-core is not installed (the dev extra pins it)", allow_module_level=True)
FLA = Path(_FLA.submodule_search_locations[0])
ROOT = Path(__file__).resolve().parent.parent
B, H, T, DK = 2, 2, 8, 4


def load_fla(rel: str) -> ModuleType:
    """fla/<rel> as a module of its own, its float32 casts made float64 (see above)."""
    path = FLA / rel
    spec = importlib.util.spec_from_file_location(f"fla_oracle_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    text = path.read_text()
    text = text.replace(".float()", ".double()")
    text = re.sub(r"torch\.float32\b|torch\.float\b", "torch.float64", text)
    exec(compile(text, str(path), "exec"), module.__dict__)
    return module


def titanc_memory(mem: MemorySpec, q, k, v, theta, log_keep, w0, log_eta=None, ln=None
                  ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The memory of spec `mem` through the IR interpreter: reads (B, H, T, dv), final W
    (B, H, dv, dk) and final S. Inputs (B, H, T, ·), gates (B, H, T), `ln` the inner model's
    (w, b), each (H, d), with `memory.inner: ln_residual`."""
    b = Builder("fla_oracle")
    def inp(name: str, x: torch.Tensor):
        return b.input(name, tuple(x.shape), "f64")
    xs = {"q": q, "k": k, "v": v, "theta": theta, "log_keep": log_keep, "w0": w0}
    if log_eta is not None:
        xs["log_eta"] = log_eta
    if ln is not None:
        xs["ln_w"], xs["ln_b"] = ln
    vals = {n: inp(n, x) for n, x in xs.items()}
    st = MemStreams(vals["q"], vals["k"], vals["v"], vals["theta"], vals.get("log_eta"),
                    vals["log_keep"])
    ss = [] if log_eta is None else [b.full(0.0, tuple(w0.shape), "f64")]
    lnv = None if ln is None else (vals["ln_w"], vals["ln_b"])
    ws, ss, y = memory_scan(b, [vals["w0"]], ss, st, mem.chunk_size, st.q,
                            obj=objective_of(mem), mem=mem, ln=lnv)
    b.graph.set_outputs([("y", y.id), ("w", ws[0].id)] + [("s", s.id) for s in ss])
    out = interpret(b.graph, xs)
    return out["y"], out["w"], [out["s"]] if "s" in out else []


def _inputs(dv: int, seed: int, t: int = T):
    g = torch.Generator().manual_seed(seed)
    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    q, k = [torch.nn.functional.normalize(rnd(B, H, t, DK), dim=-1) for _ in range(2)]
    v = rnd(B, H, t, dv)
    beta = torch.sigmoid(rnd(B, H, t))
    s0 = rnd(B, H, DK, dv) * 0.3                        # fla's initial state (d_k, d_v)
    return q, k, v, beta, s0, g


def _preset(name: str, dv: int, chunk: int, linear: bool = True) -> MemorySpec:
    """The preset's memory with value width dv and chunks of `chunk` tokens."""
    mem = load_spec(ROOT / "examples" / f"{name}.yaml").model.memory
    assert mem.linear == linear                         # exact at every chunk size
    return MemorySpec(**{**{f: getattr(mem, f) for f in mem.__slots__}, "value_width": dv,
                         "chunk_size": chunk})


# (chunk, tokens): token by token; the exact chunked (WY) form in two chunks and in one; the
# presets' own chunk of 16, in two chunks of 32 tokens
CHUNKS = [(1, T), (4, T), (8, T), (16, 32)]


def _fla_chunk(t: int) -> int:
    """The chunk fla's chunked references run at: 16 (the presets') where 32 tokens, else 4."""
    return 16 if t == 32 else 4


@pytest.mark.parametrize("chunk,t", CHUNKS)
def test_deltanet_equals_fla_delta_rule(chunk: int, t: int) -> None:
    """examples/deltanet.yaml's memory (chunks of `chunk` tokens) against fla's
    delta_rule_recurrence (from an initial state) and delta_rule_chunkwise (chunks of
    `_fla_chunk`, from zero), outputs and final states, float64, 1e-12."""
    fla = load_fla("ops/delta_rule/naive.py")
    mem = _preset("deltanet", DK, chunk)
    q, k, v, beta, s0, _ = _inputs(DK, seed=0, t=t)
    theta = beta * DK / 2                               # β = θ·2/d_v
    no_decay = torch.zeros_like(beta)
    o, s = fla.delta_rule_recurrence(q, k, v, beta, initial_state=s0.clone())
    y, w, _ = titanc_memory(mem, q * DK ** -0.5, k, v, theta, no_decay, s0.transpose(-1, -2))
    assert (y - o).abs().max() <= 1e-12
    assert (w.transpose(-1, -2) - s).abs().max() <= 1e-12
    o, s = fla.delta_rule_chunkwise(q, k, v, beta, chunk_size=_fla_chunk(t))
    y, w, _ = titanc_memory(mem, q * DK ** -0.5, k, v, theta, no_decay,
                            torch.zeros(B, H, DK, DK, dtype=torch.float64))
    assert (y - o).abs().max() <= 1e-12
    assert (w.transpose(-1, -2) - s).abs().max() <= 1e-12


@pytest.mark.parametrize("chunk,t", CHUNKS)
def test_gated_deltanet_equals_fla_gated_delta_rule(chunk: int, t: int) -> None:
    """examples/gated_deltanet.yaml's memory (values twice the key width; chunks of `chunk`
    tokens) against fla's naive_recurrent_gated_delta_rule and naive_chunk_gated_delta_rule
    (chunks of `_fla_chunk`), both from an initial state, outputs and final states, float64,
    1e-12."""
    fla = load_fla("ops/gated_delta_rule/naive.py")
    dv = 2 * DK
    mem = _preset("gated_deltanet", dv, chunk)
    q, k, v, beta, s0, g = _inputs(dv, seed=1, t=t)
    log_decay = -torch.nn.functional.softplus(torch.randn(B, H, t, generator=g,
                                                          dtype=torch.float64))
    theta = beta * dv / 2
    y, w, _ = titanc_memory(mem, q, k, v, theta, log_decay, s0.transpose(-1, -2))
    def bthd(x):                                        # fla's (B, T, H, ·) layout
        return x.transpose(1, 2).contiguous()
    for o, s in (fla.naive_recurrent_gated_delta_rule(
                     bthd(q), bthd(k), bthd(v), bthd(beta), bthd(log_decay), scale=1.0,
                     initial_state=s0.clone(), output_final_state=True),
                 fla.naive_chunk_gated_delta_rule(
                     bthd(q), bthd(k), bthd(v), bthd(log_decay), bthd(beta),
                     chunk_size=_fla_chunk(t),
                     scale=1.0, initial_state=s0.clone(), output_final_state=True)):
        assert (y - bthd(o)).abs().max() <= 1e-12
        assert (w.transpose(-1, -2) - s).abs().max() <= 1e-12


def test_heavy_ball_read_after_write_equals_fla_momentum_delta_rule() -> None:
    """titanc's heavy-ball write (S_t = η_t S_{t-1} - θ_t g_t, W_t = (1 - α_t) W_{t-1} + S_t),
    read after the write, at chunk 1, against fla's recurrent_momentum_delta_rule_ref (its
    prediction key p = k). fla's momentum M is titanc's −S/β, so titanc's η_t is
    μ_t β_t/β_{t-1} and θ_t = β_t η^fla_t d_v/2: the coupling the issue names."""
    fla = load_fla("ops/momentum_delta_rule/naive.py")
    mem = MemorySpec(heads=H, depth=1, chunk_size=1, read="after_write")
    q, k, v, beta, s0, g = _inputs(DK, seed=2)
    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    log_mu = torch.nn.functional.logsigmoid(rnd(B, H, T) + 2)
    log_alpha = torch.nn.functional.logsigmoid(rnd(B, H, T) + 4)
    eta_f = torch.sigmoid(rnd(B, H, T))                 # fla's η, the gradient's step
    prev = torch.cat([beta[..., :1], beta[..., :-1]], -1)
    log_eta = log_mu + beta.log() - prev.log()
    theta = beta * eta_f * DK / 2
    y, w, (s,) = titanc_memory(mem, q * DK ** -0.5, k, v, theta, log_alpha,
                               s0.transpose(-1, -2), log_eta)
    def bth(x):
        return x.transpose(1, 2).contiguous()
    o, final = fla.recurrent_momentum_delta_rule_ref(
        bth(q), bth(k), bth(v), bth(log_alpha), bth(log_mu), bth(k), beta=bth(beta),
        eta=bth(eta_f), initial_S=s0.clone(), output_final_state=True)
    assert (y - bth(o)).abs().max() <= 1e-12
    assert (w.transpose(-1, -2) - final[0]).abs().max() <= 1e-12
    m = -s / beta[..., -1, None, None]                   # fla's M = −S/β at the last token
    assert (m.transpose(-1, -2) - final[1]).abs().max() <= 1e-12


def load_fla_titans() -> ModuleType:
    """fla's titans/naive.py (`load_fla`'s float64 text) with two edits to its text, each
    checked to apply: (1) its `from fla.ops.titans.log_impl import combine_params_log`, which
    would import `fla.ops`, becomes the same function from log_impl.py loaded as a file; (2)
    the precedence slip in its layer-norm backward, `D * grad - grad.sum(-1, keepdim=True) /
    (rstd * D)`, gets the parentheses its own commented-out line has,
    `(D * grad - grad.sum(-1, keepdim=True)) / (rstd * D)`. As shipped, its write is not the
    gradient of its own loss ‖k + w·LN(kM) + b − v‖² (issue 52 measured 13.1 apart, 1.1e-14
    with the parentheses); the tests below equal titanc, whose reference takes that gradient
    by autograd. Nothing else is changed."""
    log_impl = load_fla("ops/titans/log_impl.py")
    path = FLA / "ops/titans/naive.py"
    text = path.read_text()
    text = re.sub(r"torch\.float32\b|torch\.float\b", "torch.float64", text)
    for old, new, count in (
            ("from fla.ops.titans.log_impl import combine_params_log", "", 1),
            ("v_new = D * grad - grad.sum(-1, keepdim=True) / (rstd * D)",
             "v_new = (D * grad - grad.sum(-1, keepdim=True)) / (rstd * D)", 2)):
        assert text.count(old) == count, f"fla's titans/naive.py changed: {old!r}"
        text = text.replace(old, new)
    module = ModuleType("fla_oracle_titans")
    module.combine_params_log = log_impl.combine_params_log
    exec(compile(text, str(path), "exec"), module.__dict__)
    return module


@contextmanager
def float64_default() -> Iterator[None]:
    """torch's default dtype float64 inside: fla's tensors made without a dtype are float64
    too, as `load_fla` makes its explicit casts."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _titans_inputs(seed: int):
    """fla's titans inputs (B, H, T, ·): q, k, v, θ, α, η (B, H, T, 1), w, b (H, d) and an
    initial state M (B, H, d, d)."""
    q, k, v, _, s0, g = _inputs(DK, seed)
    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    theta = torch.sigmoid(rnd(B, H, T, 1)) * 0.2
    alpha = torch.sigmoid(rnd(B, H, T, 1) - 3)
    eta = torch.sigmoid(rnd(B, H, T, 1) + 1)
    w, bias = 1 + 0.3 * rnd(H, DK), 0.3 * rnd(H, DK)
    return q, k, v, theta, alpha, eta, w, bias, s0


def _titans_titanc(mem: MemorySpec, q, k, v, theta, alpha, eta, w, bias, s0):
    """titanc's memory on fla's titans inputs: W = Mᵀ; θ = θ_fla·d (titanc's ℓ is fla's
    over d, fla's write carries the 2 of its squared norm: 2θ_fla = θ·2/d); log η, log(1 − α)."""
    gate = lambda x: x[..., 0]                          # noqa: E731  (B, H, T, 1) -> (B, H, T)
    return titanc_memory(mem, q, k, v, gate(theta) * DK, gate(alpha).neg().log1p(),
                         s0.transpose(-1, -2), gate(eta).log(), ln=(w, bias))


def test_titans_fla_equals_fla_titans() -> None:
    """examples/titans_fla.yaml's memory (chunk 1: read after the token's write, the inner
    model k + w·LN(W k) + b, the post-norm) against fla's titans_linear (token by token) and
    chunk_titans_linear (its closed form) at chunk 1, from an initial state, outputs and final
    states, float64, 1e-12."""
    fla = load_fla_titans()
    mem = _preset("titans_fla", DK, 1, linear=False)
    q, k, v, theta, alpha, eta, w, bias, s0 = _titans_inputs(seed=3)
    y, wt, _ = _titans_titanc(mem, q, k, v, theta, alpha, eta, w, bias, s0)
    for run in (fla.titans_linear, fla.chunk_titans_linear):
        with float64_default():                         # log_impl's torch.full(-inf): no dtype
            o, m = run(q, k, v, w, bias, theta, alpha, eta, 1e-6, 1, s0.clone(), True)
        assert (y - o).abs().max() <= 1e-12
        assert (wt.transpose(-1, -2) - m).abs().max() <= 1e-12


@pytest.mark.parametrize("chunk", [2, 4])
def test_titans_fla_chunk_end_states_equal_fla_titans(chunk: int) -> None:
    """In chunks of `chunk` tokens, titanc's write (every gradient at the chunk-start state,
    the momentum and decay token by token in closed form) ends each chunk at fla's state:
    final states against titans_linear and chunk_titans_linear at the same chunk, 1e-12.
    Their reads differ: fla reads each token at the state after its own write inside the
    chunk, which titanc's `read` cannot say for this memory at chunks > 1."""
    fla = load_fla_titans()
    mem = _preset("titans_fla", DK, chunk, linear=False)
    mem = MemorySpec(**{**{f: getattr(mem, f) for f in mem.__slots__}, "read": "before_write"})
    q, k, v, theta, alpha, eta, w, bias, s0 = _titans_inputs(seed=4)
    _, wt, _ = _titans_titanc(mem, q, k, v, theta, alpha, eta, w, bias, s0)
    for run in (fla.titans_linear, fla.chunk_titans_linear):
        with float64_default():                         # log_impl's torch.full(-inf): no dtype
            _, m = run(q, k, v, w, bias, theta, alpha, eta, 1e-6, chunk, s0.clone(), True)
        assert (wt.transpose(-1, -2) - m).abs().max() <= 1e-12
