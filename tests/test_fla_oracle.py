"""flash-linear-attention (fla) as an external oracle (issue 52): the memories of the presets
examples/deltanet.yaml and examples/gated_deltanet.yaml, compiled by titanc's frontend
(`neural_memory.memory_scan` through the IR interpreter), equal fla's own plain-PyTorch
references in float64, outputs and final states, to 1e-12; and titanc's heavy-ball write read
after the write equals fla's momentum delta rule.

fla's reference files are loaded as files (importlib.util.spec_from_file_location), never by
importing `fla.ops`, which would import every Triton kernel. They compute in float32 by
casting their inputs (`.float()`, `.to(torch.float32)`, `dtype=torch.float`); to compare in
float64 the loaded text has those dtypes replaced by float64, and nothing else is changed.
The only other thing this file does is map inputs between the two conventions, one line each:
fla's state S (d_k, d_v) is titanc's Wᵀ; fla's β is θ·2/d_v (titanc's inner loss is a mean
over the d_v channels); fla's log decay g is titanc's log(1 − α); fla scales q by d_k^-1/2
inside (titanc's q is passed pre-scaled where fla gives no `scale` argument)."""
from __future__ import annotations

import importlib.util
import re
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


def titanc_memory(mem: MemorySpec, q, k, v, theta, log_keep, w0, log_eta=None
                  ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The memory of spec `mem` through the IR interpreter: reads (B, H, T, dv), final W
    (B, H, dv, dk) and final S. Inputs (B, H, T, ·) and gates (B, H, T)."""
    b = Builder("fla_oracle")
    def inp(name: str, x: torch.Tensor):
        return b.input(name, tuple(x.shape), "f64")
    xs = {"q": q, "k": k, "v": v, "theta": theta, "log_keep": log_keep, "w0": w0}
    if log_eta is not None:
        xs["log_eta"] = log_eta
    vals = {n: inp(n, x) for n, x in xs.items()}
    st = MemStreams(vals["q"], vals["k"], vals["v"], vals["theta"], vals.get("log_eta"),
                    vals["log_keep"])
    ss = [] if log_eta is None else [b.full(0.0, tuple(w0.shape), "f64")]
    ws, ss, y = memory_scan(b, [vals["w0"]], ss, st, mem.chunk_size, st.q,
                            obj=objective_of(mem), mem=mem)
    b.graph.set_outputs([("y", y.id), ("w", ws[0].id)] + [("s", s.id) for s in ss])
    out = interpret(b.graph, xs)
    return out["y"], out["w"], [out["s"]] if "s" in out else []


def _inputs(dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    q, k = [torch.nn.functional.normalize(rnd(B, H, T, DK), dim=-1) for _ in range(2)]
    v = rnd(B, H, T, dv)
    beta = torch.sigmoid(rnd(B, H, T))
    s0 = rnd(B, H, DK, dv) * 0.3                        # fla's initial state (d_k, d_v)
    return q, k, v, beta, s0, g


def _preset(name: str, dv: int, chunk: int) -> MemorySpec:
    """The preset's memory with value width dv and chunks of `chunk` tokens."""
    mem = load_spec(ROOT / "examples" / f"{name}.yaml").model.memory
    assert mem.linear                                   # exact at every chunk size
    return MemorySpec(**{**{f: getattr(mem, f) for f in mem.__slots__}, "value_width": dv,
                         "chunk_size": chunk})


CHUNKS = [1, 4, 8]   # token by token; the exact chunked (WY) form, in two chunks and in one


@pytest.mark.parametrize("chunk", CHUNKS)
def test_deltanet_equals_fla_delta_rule(chunk: int) -> None:
    """examples/deltanet.yaml's memory (chunks of `chunk` tokens) against fla's delta_rule_recurrence (from an
    initial state) and delta_rule_chunkwise (chunks of 4, from zero), outputs and final
    states, float64, 1e-12."""
    fla = load_fla("ops/delta_rule/naive.py")
    mem = _preset("deltanet", DK, chunk)
    q, k, v, beta, s0, _ = _inputs(DK, seed=0)
    theta = beta * DK / 2                               # β = θ·2/d_v
    no_decay = torch.zeros_like(beta)
    o, s = fla.delta_rule_recurrence(q, k, v, beta, initial_state=s0.clone())
    y, w, _ = titanc_memory(mem, q * DK ** -0.5, k, v, theta, no_decay, s0.transpose(-1, -2))
    assert (y - o).abs().max() <= 1e-12
    assert (w.transpose(-1, -2) - s).abs().max() <= 1e-12
    o, s = fla.delta_rule_chunkwise(q, k, v, beta, chunk_size=4)
    y, w, _ = titanc_memory(mem, q * DK ** -0.5, k, v, theta, no_decay,
                            torch.zeros(B, H, DK, DK, dtype=torch.float64))
    assert (y - o).abs().max() <= 1e-12
    assert (w.transpose(-1, -2) - s).abs().max() <= 1e-12


@pytest.mark.parametrize("chunk", CHUNKS)
def test_gated_deltanet_equals_fla_gated_delta_rule(chunk: int) -> None:
    """examples/gated_deltanet.yaml's memory (values twice the key width; chunks of `chunk`
    tokens) against fla's
    naive_recurrent_gated_delta_rule and naive_chunk_gated_delta_rule (chunks of 4), both
    from an initial state, outputs and final states, float64, 1e-12."""
    fla = load_fla("ops/gated_delta_rule/naive.py")
    dv = 2 * DK
    mem = _preset("gated_deltanet", dv, chunk)
    q, k, v, beta, s0, g = _inputs(dv, seed=1)
    log_decay = -torch.nn.functional.softplus(torch.randn(B, H, T, generator=g,
                                                          dtype=torch.float64))
    theta = beta * dv / 2
    y, w, _ = titanc_memory(mem, q, k, v, theta, log_decay, s0.transpose(-1, -2))
    def bthd(x):                                        # fla's (B, T, H, ·) layout
        return x.transpose(1, 2).contiguous()
    for o, s in (fla.naive_recurrent_gated_delta_rule(
                     bthd(q), bthd(k), bthd(v), bthd(beta), bthd(log_decay), scale=1.0,
                     initial_state=s0.clone(), output_final_state=True),
                 fla.naive_chunk_gated_delta_rule(
                     bthd(q), bthd(k), bthd(v), bthd(log_decay), bthd(beta), chunk_size=4,
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
