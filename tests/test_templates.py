"""Kernel template families: parity under TRITON_INTERPRET=1, safety and determinism of rendering.

Every family renders a module (one `@triton.jit` kernel, or one per phase, and a `launch`),
which is loaded from the kernel cache and compared with plain torch on small shapes whose
sizes are not multiples of the block sizes, so every masked edge is exercised. Tolerances:
float32 rtol = atol = 2e-5, float64 rtol = atol = 1e-12. All families support float64 under
the interpreter.
"""

from __future__ import annotations

import ast
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import pytest
from pathlib import Path
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from jinja2 import UndefinedError

from titanc.codegen.lower.expr import check_statement, pointwise_statements
from titanc.codegen.families import (
    TEMPLATE_LOCALS,
    KeyGroup,
    ReductionStage,
    render_attention_bwd,
    render_attention_fwd,
    render_cross_entropy,
    render_matmul,
    render_pointwise,
    render_reduction,
)
from titanc.codegen.render import (
    Namer,
    kernel_name,
    load_module,
    render,
    sanitize_comment,
    sanitize_identifier,
)
from titanc import config

# Masked-off lanes load 0 and may compute rsqrt(0) or log(0): numpy warns, but those lanes are
# never stored.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), **TOL[dtype])


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- rendering: sanitising, strictness, determinism ---------------------------------------------

HOSTILE = [
    "__import__('os').system('echo pwned')",
    'x"); import os; os.system("id"); ("',
    "a\nimport os\n",
    "b\r\nos.system('x')",
    "for",
    "123abc",
    "",
    "naïve\u2028name",
    "{{ name }}{% for x in y %}",
    "# comment",
    "mask",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_sanitize_identifier_is_safe(text: str) -> None:
    name = sanitize_identifier(text)
    assert name.isidentifier() and name.isascii()
    assert not name.startswith("__")
    assert name not in ("for", "import", "os", "eval", "exec", "__import__")
    # it compiles as a plain assignment target and nothing else
    tree = ast.parse(f"{name} = 1")
    assert isinstance(tree.body[0], ast.Assign) and len(tree.body) == 1


def test_sanitize_identifier_keeps_good_names() -> None:
    assert sanitize_identifier("rms_w") == "rms_w"
    assert sanitize_identifier("layers.0.attn-wq") == "layers_0_attn_wq"
    assert sanitize_identifier("class") == "v_class"
    assert sanitize_identifier("tl") == "v_tl"


@pytest.mark.parametrize("text", HOSTILE + ['"""', "\x1b[31m", "a\x00b", "tab\there"])
def test_sanitize_comment_is_one_printable_line(text: str) -> None:
    line = sanitize_comment(text)
    assert line.isprintable() and line.isascii() and "\n" not in line and "\r" not in line
    tree = ast.parse(f"# {line}\nx = 1\n")
    assert len(tree.body) == 1


def test_namer_avoids_template_locals_and_duplicates() -> None:
    namer = Namer({"mask", "offs"})
    assert namer.fresh("mask") == "v_mask"
    assert namer.fresh("w") == "w"
    assert namer.fresh("w") == "w_1"
    assert namer.fresh("w!") == "w_"


def test_kernel_name() -> None:
    assert kernel_name("poi", ["sigmoid", "mul"], 3) == "titanc_poi_fused_sigmoid_mul_3"
    assert kernel_name("red", ["x'); import os #"], 0) == "titanc_red_fused_x_import_os_0"
    with pytest.raises(ValueError, match="category"):
        kernel_name("bad", ["x"], 0)


@pytest.mark.parametrize("stmt", [
    "y = x\nimport os",
    "y = x; import os",
    "y = __import__('os').system('ls')",
    "y = x.__class__",
    "y = eval('1')",
    "y = 'text'",
    "import os",
    "y = x  # trailing",
    "y = [x for x in z]",
    "y = lambda: 0",
    "y = x[0]",
    "y = open('f').read()",
    "y = tl.load.__globals__",
])
def test_check_statement_rejects_code(stmt: str) -> None:
    with pytest.raises(ValueError):
        check_statement(stmt)


@pytest.mark.parametrize("stmt", [
    "t3 = tl.sigmoid(t1) * t2",
    'm = tl.full([BLOCK_R, 1], float("-inf"), dtype=tl.float32)',
    "s = tl.sum(x * x, axis=1, keep_dims=True)",
    "y = x[:, None] * w[None, :]",
    "z = (x > 0.5).to(tl.float32)",
    "acc += x",
])
def test_check_statement_accepts_triton_arithmetic(stmt: str) -> None:
    assert check_statement(stmt) == stmt


def test_pointwise_statements_errors() -> None:
    with pytest.raises(ValueError, match="unknown pointwise op"):
        pointwise_statements([("y", "tanhh", ("x",))], inputs=["x"])
    with pytest.raises(ValueError, match="before it is defined"):
        pointwise_statements([("y", "exp", ("z",))], inputs=["x"])
    with pytest.raises(ValueError, match="takes 2 args"):
        pointwise_statements([("y", "add", ("x",))], inputs=["x"])


def test_strict_undefined() -> None:
    with pytest.raises(UndefinedError):
        render("pointwise.py.jinja", name="k", header_lines=[])


def _all_sources() -> list[str]:
    groups = [KeyGroup("persistent", False), KeyGroup("seq", True, window=4)]
    return [
        render_pointwise("titanc_poi_fused_exp_0", inputs=["x"], outputs=[("y", "t")],
                         body=["t = tl.exp(x)"], rank=2),
        render_reduction("titanc_red_fused_sum_0", inputs=["x"], n_cols=40,
                         stages=[ReductionStage("sum", "x", "s")],
                         reduced_outputs=[("out", "s")], block_c=16),
        render_matmul("titanc_mm_fused_mm_0", k_scale=True, epilogue=["y = acc * 2.0"],
                      result="y"),
        render_attention_fwd("titanc_tem_fused_attn_0", groups=groups, head_dim=8),
        render_attention_bwd("titanc_tem_fused_attn_bwd_0", groups=groups, head_dim=8),
        render_cross_entropy("titanc_tem_fused_ce_0", d_model=24),
        render_cross_entropy("titanc_tem_fused_ce_bwd_0", d_model=24, backward=True),
    ]


def test_rendering_is_deterministic_and_parses() -> None:
    first, second = _all_sources(), _all_sources()
    assert first == second
    for src in first:
        tree = ast.parse(src)
        kernels = [f for f in tree.body if isinstance(f, ast.FunctionDef)
                   and any(ast.unparse(d) == "triton.jit" for d in f.decorator_list)]
        public = [f.name for f in kernels if not f.name.startswith("_")]
        assert public and all(n.startswith("titanc_") for n in public)
        assert any(isinstance(f, ast.FunctionDef) and f.name == "launch" for f in tree.body)
        assert src.startswith("# titanc_") and src.endswith("\n") and "\t" not in src


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name a module binds: module constants, functions, arguments, assignment targets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
            names.update(a.arg for a in node.args.args + node.args.kwonlyargs)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_template_locals_are_declared() -> None:
    """Names a template binds itself are listed in TEMPLATE_LOCALS, so Scope avoids them.

    User names below all contain "zz"; every other bound name must be declared.
    """
    body = pointwise_statements([("zz_t", "exp", ("zz_x",))], inputs=["zz_x"])
    groups = [KeyGroup("zz_p", False), KeyGroup("zz_s", True, window=4)]
    sources = {
        "pointwise": [render_pointwise("titanc_poi_fused_zz_0", inputs=["zz_x"], rank=4,
                                       outputs=[("zz_y", "zz_t")], body=body, scalars=["zz_a"])],
        "reduction": [render_reduction(
            "titanc_red_fused_zz_0", inputs=["zz_x"], n_cols=40, block_c=block_c,
            stages=[ReductionStage("max", "zz_x", "zz_m"),
                    ReductionStage("sum", "zz_e", "zz_s",
                                   prologue=("zz_e = tl.exp(zz_x - zz_m)",))],
            row_epilogue=["zz_y = zz_e / zz_s"], row_outputs=[("zz_o", "zz_y")],
            reduced_outputs=[("zz_r", "zz_s")]) for block_c in (None, 16)],
        "matmul": [render_matmul("titanc_mm_fused_zz_0", k_scale=True, epilogue_inputs=["zz_b"],
                                 epilogue=["zz_y = acc + zz_b * zz_a"], scalars=["zz_a"],
                                 result="zz_y")],
        "attention_fwd": [render_attention_fwd("titanc_tem_fused_zz_0", groups=groups,
                                               head_dim=8)],
        "attention_bwd": [render_attention_bwd("titanc_tem_fused_zz_1", groups=groups,
                                               head_dim=8)],
    }
    for family, srcs in sources.items():
        for src in srcs:
            own = {n for n in _bound_names(ast.parse(src)) if "zz" not in n}
            assert own <= TEMPLATE_LOCALS[family], (family, sorted(own - TEMPLATE_LOCALS[family]))


def test_rendering_is_identical_across_processes() -> None:
    """Byte-identical sources in a fresh interpreter with another hash seed."""
    import hashlib
    import subprocess
    import sys

    script = ("import hashlib, tests.test_templates as t; "
              "print(hashlib.sha256('\\0'.join(t._all_sources()).encode()).hexdigest())")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    here = hashlib.sha256("\0".join(_all_sources()).encode()).hexdigest()
    assert out.stdout.strip() == here


def test_hostile_names_render_import_safe_source(tmp_path, monkeypatch) -> None:
    with config.override(cache_dir=Path(str(tmp_path))):
        evil = "__import__('os').system('touch PWNED')"
        evil_var = "t'\n__import__('os')"
        nodes = [(evil_var, "exp", (evil,)), ("out\"", "mul", (evil_var, "mask"))]
        body = pointwise_statements(nodes, inputs=[evil, "mask"])
        src = render_pointwise(evil, inputs=[evil, "mask"], outputs=[('y"""\nimport os', "out\"")],
                               body=body, rank=1, block=16,
                               header_lines=[evil, "line\nimport os", '"""', "\u2028x"])
        tree = ast.parse(src)
        imports = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   for a in n.names}
        assert imports <= {"math", "triton", "triton.language"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                assert not node.id.startswith("__") and node.id not in ("eval", "exec", "os"), node.id
            if isinstance(node, ast.Attribute):
                assert node.attr != "system"
        header = src.split("\nimport math", 1)[0].splitlines()
        assert all(line.startswith("#") for line in header)
        module = load_module(src, evil)
        x, m = torch.randn(20), torch.randn(20)
        y = torch.empty(20)
        module.launch(x, m, y, shape=(20,))
        close(y, torch.exp(x) * m, torch.float32)
        assert not (tmp_path / "PWNED").exists() and not os.path.exists("PWNED")


def test_user_names_equal_to_template_locals(tmp_path, monkeypatch) -> None:
    """Inputs named like the kernel's own variables are renamed, and results stay right."""
    with config.override(cache_dir=Path(str(tmp_path))):
        names = ["mask", "offs", "pid", "BLOCK"]
        body = pointwise_statements(
            [("s0", "add", ("mask", "offs")), ("s1", "mul", ("s0", "pid")),
             ("numel_", "sub", ("s1", "BLOCK"))], inputs=names)
        src = render_pointwise("titanc_poi_fused_clash_0", inputs=names,
                               outputs=[("idx_0", "numel_")], body=body, rank=2, block=16)
        module = load_module(src, "clash")
        a, b, c, d = (torch.randn(3, 5, generator=gen(i)) for i in range(4))
        out = torch.empty(3, 5)
        module.launch(a, b, c, d, out, shape=(3, 5))
        close(out, (a + b) * c - d, torch.float32)


def test_load_module_caches_by_content(tmp_path, monkeypatch) -> None:
    with config.override(cache_dir=Path(str(tmp_path))):
        src = render_cross_entropy("titanc_tem_fused_ce_0", d_model=8)
        assert load_module(src, "g") is load_module(src, "g")
        files = list(tmp_path.glob("*.py"))
        assert len(files) == 1 and files[0].read_text() == src


# --- 1. pointwise -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_chain_with_broadcast(dtype: torch.dtype) -> None:
    # y = silu(x) * sigmoid(-b) + 2 * rsqrt(c);  z = max(x, b) > 0.5 ; five ops and more
    nodes = [
        ("s", "silu", ("x",)), ("nb", "neg", ("b",)), ("g", "sigmoid", ("nb",)),
        ("p", "mul", ("s", "g")), ("two", "const", (2.0,)), ("r", "rsqrt", ("c",)),
        ("r2", "mul", ("r", "two")), ("y", "add", ("p", "r2")),
        ("mx", "max", ("x", "b")), ("z", "gt", ("mx", 0.5)), ("q", "div", ("z", "scale")),
    ]
    body = pointwise_statements(nodes, inputs=["x", "b", "c", "scale"])
    src = render_pointwise("titanc_poi_fused_silu_sigmoid_mul_rsqrt_add_0",
                           inputs=["x", "b", "c"], outputs=[("out_y", "y"), ("out_z", "q")],
                           scalars=["scale"], body=body, rank=3, dtype=dname(dtype), block=32)
    module = load_module(src, "pw")
    shape = (3, 5, 7)
    x = torch.randn(shape, dtype=dtype, generator=gen(1))
    b = torch.randn(5, 1, dtype=dtype, generator=gen(2))  # broadcast over axes 0 and 2
    c = torch.rand(7, dtype=dtype, generator=gen(3)) + 0.5  # broadcast over axes 0 and 1
    out_y = torch.empty(shape, dtype=dtype)
    out_z = torch.empty(shape, dtype=dtype).transpose(0, 2).contiguous().transpose(0, 2)
    module.launch(x, b, c, out_y, out_z, 4.0, shape=shape)
    close(out_y, F.silu(x) * torch.sigmoid(-b) + 2 * torch.rsqrt(c), dtype)
    close(out_z, (torch.maximum(x, b) > 0.5).to(dtype) / 4.0, dtype)


@pytest.mark.parametrize("rank", [1, 4])
def test_pointwise_ranks(rank: int) -> None:
    body = pointwise_statements([("e", "exp", ("x",)), ("y", "sub", ("e", "w")),
                                 ("l", "log", ("w",)), ("z", "recip", ("l",))],
                                inputs=["x", "w"])
    src = render_pointwise(f"titanc_poi_fused_exp_sub_{rank}", inputs=["x", "w"],
                           outputs=[("o", "y"), ("o2", "z")], body=body, rank=rank, block=16)
    module = load_module(src, f"pw{rank}")
    shape = (37,) if rank == 1 else (2, 3, 1, 5)
    x = torch.randn(shape, generator=gen(4))
    w = torch.rand(shape[-1], generator=gen(5)) + 1.5
    o, o2 = torch.empty(shape), torch.empty(shape)
    module.launch(x, w, o, o2, shape=shape)
    close(o, torch.exp(x) - w, torch.float32)
    close(o2, (1 / torch.log(w)).expand(shape), torch.float32)


# --- 2. reduction -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_c", [None, 16])  # one block per row / a loop over column blocks
def test_reduction_rmsnorm(dtype: torch.dtype, block_c: int | None) -> None:
    rows, cols = 5, 37
    src = render_reduction(
        "titanc_red_fused_rmsnorm_0", inputs=["x", "w"], n_cols=cols, block_c=block_c,
        block_r=2, dtype=dname(dtype),
        stages=[ReductionStage("sum", "sq", "ss", prologue=("sq = x * x",),
                               epilogue=("rstd = tl.rsqrt(ss / n_cols + 1e-6)",))],
        row_epilogue=["y = x * rstd * w"], row_outputs=[("out", "y")],
        reduced_outputs=[("rstd_out", "rstd")])
    module = load_module(src, "rms")
    x = torch.randn(rows, cols, dtype=dtype, generator=gen(6))
    w = torch.randn(cols, dtype=dtype, generator=gen(7))
    out, rstd = torch.empty_like(x), torch.empty(rows, dtype=dtype)
    module.launch(x, w, out, rstd, rows, cols)
    ref_rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
    close(out, x * ref_rstd[:, None] * w, dtype)
    close(rstd, ref_rstd, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_c", [None, 16])
def test_reduction_softmax(dtype: torch.dtype, block_c: int | None) -> None:
    rows, cols = 7, 45
    src = render_reduction(
        "titanc_red_fused_softmax_0", inputs=["x"], n_cols=cols, block_c=block_c, block_r=4,
        dtype=dname(dtype),
        stages=[ReductionStage("max", "x", "mx"),
                ReductionStage("sum", "e", "s", prologue=("e = tl.exp(x - mx)",))],
        row_epilogue=["y = e / s"], row_outputs=[("out", "y")])
    module = load_module(src, "softmax")
    x = torch.randn(rows, cols, dtype=dtype, generator=gen(8)) * 4
    out = torch.empty_like(x)
    module.launch(x, out, rows, cols)
    close(out, torch.softmax(x, -1), dtype)


def test_reduction_l2norm_on_strided_heads() -> None:
    # l2norm over the head axis of a [B, T, H, d] tensor viewed as [B*T*H, d] rows
    u = torch.randn(2, 3, 2, 12, generator=gen(9))
    x = u.reshape(-1, 12)
    src = render_reduction(
        "titanc_red_fused_l2norm_0", inputs=["x"], n_cols=12, block_r=4,
        stages=[ReductionStage("sum", "sq", "ss", prologue=("sq = x * x",),
                               epilogue=("inv = tl.rsqrt(ss + 1e-6)",))],
        row_epilogue=["y = x * inv"], row_outputs=[("out", "y")])
    module = load_module(src, "l2")
    out = torch.empty(x.shape[1], x.shape[0]).t()  # a strided (column-major) output
    module.launch(x, out, x.shape[0], 12)
    close(out, x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6), torch.float32)


# --- 3. matmul --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_strided_with_scale_and_epilogue(dtype: torch.dtype) -> None:
    src = render_matmul("titanc_mm_fused_mm_silu_add_0", k_scale=True, dtype=dname(dtype),
                        epilogue=["t = acc * tl.sigmoid(acc)", "y = t + bias * alpha + res"],
                        epilogue_inputs=["bias", "res"], scalars=["alpha"], result="y",
                        block_m=16, block_n=16, block_k=16)
    module = load_module(src, "mm")
    B, M, N, K = 2, 20, 17, 35
    a = torch.randn(B, K, M, dtype=dtype, generator=gen(10)).transpose(1, 2)  # [B, M, K] view
    b = torch.randn(N, K, dtype=dtype, generator=gen(11)).t()  # shared [K, N] view
    w = torch.randn(B, K, dtype=dtype, generator=gen(12))
    bias = torch.randn(N, dtype=dtype, generator=gen(13))
    res = torch.randn(B, M, N, dtype=dtype, generator=gen(14))
    c = torch.empty(B, M, N, dtype=dtype)
    module.launch(a, b, c, w, bias, res, 0.5)
    acc = (a * w[:, None, :]) @ b
    close(c, F.silu(acc) + 0.5 * bias + res, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_aggregated_memory_update(dtype: torch.dtype) -> None:
    """sum_u w_u delta_u (x) h_u as one contraction: W_new = decay * W - (delta * w)^T h."""
    Bz, b, d, hid = 3, 9, 6, 20
    delta = torch.randn(Bz, b, d, dtype=dtype, generator=gen(15))
    h = torch.randn(Bz, b, hid, dtype=dtype, generator=gen(16))
    w = torch.rand(Bz, b, dtype=dtype, generator=gen(17))
    W = torch.randn(Bz, d, hid, dtype=dtype, generator=gen(18))
    decay = torch.rand(Bz, 1, 1, dtype=dtype, generator=gen(19))
    src = render_matmul("titanc_mm_fused_memory_update_0", k_scale=True, dtype=dname(dtype),
                        epilogue=["y = decay * W - acc"], epilogue_inputs=["W", "decay"],
                        result="y", block_m=16, block_n=16, block_k=16)
    module = load_module(src, "memupd")
    out = torch.empty_like(W)
    module.launch(delta.transpose(1, 2), h, out, w, W, decay)
    direct = (w[..., None, None] * delta[..., :, None] * h[..., None, :]).sum(1)
    close(out, decay * W - direct, dtype)
    close(out, decay * W - torch.einsum("bu,buc,buh->bch", w, delta, h), dtype)


def test_matmul_plain_2d() -> None:
    src = render_matmul("titanc_mm_fused_mm_1", block_m=16, block_n=32, block_k=16)
    module = load_module(src, "mm2")
    a, b = torch.randn(33, 19, generator=gen(20)), torch.randn(19, 40, generator=gen(21))
    c = torch.empty(33, 40)
    module.launch(a, b, c)
    close(c, a @ b, torch.float32)


# --- 5. attention -----------------------------------------------------------------------------

def _attention_mask(T: int, lens: list[int], groups: list[KeyGroup]) -> torch.Tensor:
    i = torch.arange(T)[:, None]
    cols = []
    for n, g in zip(lens, groups):
        j = torch.arange(n)[None, :]
        m = torch.ones(T, n, dtype=torch.bool) if not g.causal else j <= i
        if g.window:
            m = m & (j > i - g.window)
        cols.append(m)
    return torch.cat(cols, 1)


ATTENTION_LAYOUTS = {
    "swa": ([KeyGroup("persistent", False), KeyGroup("seq", True, window=5)], lambda T: [3, T]),
    "mac": ([KeyGroup("persistent", False), KeyGroup("memory", True),
             KeyGroup("segment", True)], lambda T: [2, T, T]),
    "causal": ([KeyGroup("seq", True)], lambda T: [T]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", sorted(ATTENTION_LAYOUTS))
def test_attention_forward_backward(dtype: torch.dtype, layout: str) -> None:
    """One key and one value tensor per group, each with its own layout: the first group's
    keys a batch-expanded view (persistent tokens shared by the batch), the others a
    [B, T, H, D] projection permuted to [B, H, T, D]; nothing is concatenated."""
    groups, lens_of = ATTENTION_LAYOUTS[layout]
    Z, H, T, D = 2, 2, 37 if layout == "swa" else 19, 12
    lens = lens_of(T)
    kw = dict(groups=groups, head_dim=D, dtype=dname(dtype), block_m=16, block_n=16)
    fwd = load_module(render_attention_fwd(f"titanc_tem_fused_attn_{layout}_0", **kw), "af")
    bwd = load_module(render_attention_bwd(f"titanc_tem_fused_attn_bwd_{layout}_0", **kw), "ab")
    g = gen(26)
    # q as a [B, T, H, D] projection permuted to [B, H, T, D]: strided, no copy
    q = torch.randn(Z, T, H, D, dtype=dtype, generator=g).permute(0, 2, 1, 3).requires_grad_()

    def group(i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(leaf, the tensor the kernels read) of one group's keys or values."""
        if i == 0 and not groups[0].causal:
            leaf = torch.randn(1, H, n, D, dtype=dtype, generator=g).requires_grad_()
            return leaf, leaf.expand(Z, H, n, D)
        leaf = torch.randn(Z, n, H, D, dtype=dtype, generator=g).requires_grad_()
        return leaf, leaf.permute(0, 2, 1, 3)

    kl, ks = zip(*(group(i, n) for i, n in enumerate(lens)))
    vl, vs = zip(*(group(i, n) for i, n in enumerate(lens)))
    scale = D ** -0.5
    o = torch.empty(Z, H, T, D, dtype=dtype)
    lse = torch.empty(Z, H, T, dtype=dtype)
    fwd.launch(q.detach(), *(k.detach() for k in ks), *(v.detach() for v in vs), o, lse,
               *lens, scale)

    k, v = torch.cat(ks, 2), torch.cat(vs, 2)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~_attention_mask(T, lens, groups), float("-inf"))
    ref = torch.softmax(scores, -1) @ v
    close(o, ref.detach(), dtype)
    close(lse, torch.logsumexp(scores, -1).detach(), dtype)

    do = torch.randn(Z, H, T, D, dtype=dtype, generator=g)
    ref.backward(do)
    dq = torch.empty_like(q)
    dks = [torch.empty(Z, H, n, D, dtype=dtype) for n in lens]
    dvs = [torch.empty(Z, H, n, D, dtype=dtype) for n in lens]
    delta = torch.empty(Z, H, T, dtype=dtype)
    bwd.launch(q.detach(), *(k.detach() for k in ks), *(v.detach() for v in vs), o, lse, do,
               dq, *dks, *dvs, delta, *lens, scale)
    close(dq, q.grad, dtype)
    for leaf, d, in list(zip(kl, dks)) + list(zip(vl, dvs)):
        want = leaf.grad if leaf.shape[0] == 1 else leaf.grad.permute(0, 2, 1, 3)
        close(d.sum(0, keepdim=True) if leaf.shape[0] == 1 else d, want, dtype)


# --- 6. cross-entropy -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("int64", [False, True])
def test_cross_entropy_fused_head(dtype: torch.dtype, tied: bool, int64: bool) -> None:
    """`int64`: the wide-offset variant (rows x vocab >= 2**31) computes the same."""
    N, D, V = 21, 24, 75
    src = render_cross_entropy("titanc_tem_fused_ce_0", d_model=D, block_v=32, int64=int64,
                               dtype=dname(dtype))
    src_b = render_cross_entropy("titanc_tem_fused_ce_bwd_0", d_model=D, block_v=32,
                                 backward=True, accumulate_dw=True, int64=int64,
                                 dtype=dname(dtype))
    assert ("tl.int64" in src) == int64 and ("tl.int64" in src_b) == int64
    fwd, bwd = load_module(src, "ce"), load_module(src_b, "ceb")
    g = gen(27)
    h = torch.randn(N, D, dtype=dtype, generator=g).requires_grad_()
    W = torch.randn((V, D) if tied else (D, V), dtype=dtype, generator=g).requires_grad_()
    Wv = W if tied else W.t()  # [V, D] view either way
    target = torch.randint(0, V, (N,), generator=g)
    target[3] = -100  # ignored row
    loss, lse = torch.empty(N, dtype=dtype), torch.empty(N, dtype=dtype)
    fwd.launch(h.detach(), Wv.detach(), target, loss, lse)
    logits = h @ Wv.t()
    ref = F.cross_entropy(logits, target, reduction="none", ignore_index=-100)
    close(loss, ref.detach(), dtype)
    close(lse[target != -100], torch.logsumexp(logits, -1)[target != -100].detach(), dtype)

    ref.mean().backward()
    dh = torch.empty_like(h)
    dW0 = torch.randn(W.shape, dtype=dtype, generator=g)
    dW = dW0.clone()  # accumulate_dw adds into it
    upstream = torch.tensor(1.0 / N, dtype=dtype)
    bwd.launch(h.detach(), Wv.detach(), target, lse, upstream.expand(N), dh,
               dW if tied else dW.t())
    close(dh, h.grad, dtype)
    close(dW - dW0, W.grad, dtype)


@pytest.mark.parametrize("tied", [True, False])
def test_cross_entropy_over_slices_of_the_model_width(tied: bool) -> None:
    """A model wider than `max_block_d` (large_125m's 768 > CE_MAX_BLOCK_D) is summed in
    slices of it, the backward kernels taking a slice a program (40 = 16 + 16 + 8 here, the
    last one masked), together with the dW kernel's row slices: loss, lse, dh and the
    accumulated dW equal torch's in float64, and one slice is the unsliced kernel's source."""
    N, D, V = 140, 40, 75
    kw = dict(d_model=D, block_v=32, dtype="float64", max_block_d=16)
    fwd = load_module(render_cross_entropy("titanc_tem_fused_ce_0", **kw), "ce_width")
    bwd = load_module(render_cross_entropy("titanc_tem_fused_ce_bwd_0", backward=True,
                                           accumulate_dw=True, **kw), "ceb_width")
    assert fwd.BLOCK_D == bwd.BLOCK_D == 16
    assert render_cross_entropy("x", d_model=D) == render_cross_entropy("x", d_model=D,
                                                                        max_block_d=64)
    g = gen(8)
    h = torch.randn(N, D, dtype=torch.float64, generator=g).requires_grad_()
    W = torch.randn((V, D) if tied else (D, V), dtype=torch.float64, generator=g)
    W.requires_grad_()
    Wv = W if tied else W.t()
    target = torch.randint(0, V, (N,), generator=g)
    target[5] = -100
    loss, lse = torch.empty(N, dtype=torch.float64), torch.empty(N, dtype=torch.float64)
    fwd.launch(h.detach(), Wv.detach(), target, loss, lse)
    logits = h @ Wv.t()
    ref = F.cross_entropy(logits, target, reduction="none", ignore_index=-100)
    close(loss, ref.detach(), torch.float64)
    close(lse, torch.logsumexp(logits, -1).detach(), torch.float64)
    ref.mean().backward()
    dh, dW0 = torch.empty_like(h), torch.randn(W.shape, dtype=torch.float64, generator=g)
    dW = dW0.clone()
    bwd.launch(h.detach(), Wv.detach(), target, lse,
               torch.tensor(1.0 / N, dtype=torch.float64).expand(N), dh,
               dW if tied else dW.t())
    close(dh, h.grad, torch.float64)
    close(dW - dW0, W.grad, torch.float64)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("programs", [1, 256])
def test_cross_entropy_dw_over_row_slices(accumulate: bool, programs: int) -> None:
    """The dW kernel splits the rows into slices (about DW_PROGRAMS programs, each slice's
    partial sum added atomically; one slice stores): the same dW either way, a dW that is
    not accumulated is overwritten (zeroed before the atomic adds), and dh is unchanged."""
    N, D, V = 140, 24, 75                   # 9 row blocks (2 slices), 3 vocabulary blocks
    src = render_cross_entropy("titanc_tem_fused_ce_bwd_0", d_model=D, block_v=32,
                               backward=True, accumulate_dw=accumulate, dtype="float64")
    bwd = load_module(src, "ceb_slices")
    g = gen(5)
    h = torch.randn(N, D, dtype=torch.float64, generator=g).requires_grad_()
    W = torch.randn(V, D, dtype=torch.float64, generator=g).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    logits = h @ W.t()
    F.cross_entropy(logits, target).backward()
    lse = torch.logsumexp(logits, -1).detach()
    dh = torch.empty_like(h)
    dW0 = torch.randn(W.shape, dtype=torch.float64, generator=g)
    dW = dW0.clone()
    saved = bwd.DW_PROGRAMS
    try:
        bwd.DW_PROGRAMS = programs
        bwd.launch(h.detach(), W.detach(), target, lse,
                   torch.tensor(1.0 / N, dtype=torch.float64).expand(N), dh, dW)
    finally:
        bwd.DW_PROGRAMS = saved
    close(dh, h.grad, torch.float64)
    close(dW - dW0 if accumulate else dW, W.grad, torch.float64)
