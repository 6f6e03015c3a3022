"""Hooks of the fused families, whose kernels carry hook-made statements: pointwise (`poi`),
row reduction with prologue/epilogues (`red`), and batched matmul with an epilogue (`mm`).

Each `render_<family>` returns the source of one module: a `@triton.jit` kernel named as
passed in (`titanc_{poi|red|mm}_fused_<ops>_<n>`), headed by `header_lines`, and a plain
`launch(...)` over torch tensors. Every user-derived name and statement goes through one
`expr.Scope` per kernel, so nothing a spec says can shadow a template's own names or inject
code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from titanc.codegen.lower.expr import Scope, slice_statements
from titanc.codegen.meta import LAUNCH_LOCALS, Tile, check_block, compute_dtype, dot_precision, pow2
from titanc.codegen.render import render

__all__ = [
    "MATMUL_KERNEL_LOCALS",
    "MatmulContraction",
    "POINTWISE_KERNEL_LOCALS",
    "REDUCTION_KERNEL_LOCALS",
    "ReductionStage",
    "render_matmul",
    "render_pointwise",
    "render_reduction",
]

# --- pointwise --------------------------------------------------------------------------------

POINTWISE_KERNEL_LOCALS = frozenset("""
    BLOCK RANK pid offs mask rest numel idx_0 idx_1 idx_2 idx_3 size_0 size_1 size_2 size_3
""".split())


def render_pointwise(
    name: str,
    *,
    inputs: Sequence[str],
    outputs: Sequence[tuple[str, str]],
    body: Sequence[str],
    rank: int,
    scalars: Sequence[str] = (),
    indexed: Sequence[tuple[str, int]] = (),
    dtype: str = "float32",
    header_lines: Sequence[str] = (),
    block: int = 1024,
    num_warps: int = 4,
    cuda_block: int | None = None,
) -> str:
    """Fused elementwise kernel over the flat index space of a common rank-`rank` shape.

    inputs: tensor names; each is loaded (with its own strides, 0 on broadcast axes) into a
        value of the same (sanitised) name that `body` reads.
    outputs: `(tensor name, body variable)` pairs; the variable is stored into the tensor.
    body: one-line statements (see `expr.pointwise_statements`).
    scalars: runtime scalar kernel arguments `body` may read (e.g. a learning rate).
    indexed: `(tensor name, rank)` of tensors the body loads itself (gathers, views that are no
        strided broadcast of the common shape): the kernel gets `<name>_ptr` and the tensor's
        own strides `stride_<name>_0 ..`, and the body reads them with `tl.load`. Such a name
        must come back unchanged from the scope (hooks use fresh names like `in3`).
    block: elements a program off CUDA; cuda_block: on CUDA (`meta.cuda_flat_block`; default
        `block`), also the module's `cuda_constexprs` for an ahead-of-time compile.
    Launcher: `launch(*inputs, *outputs, *indexed, *scalars, shape)`.
    """
    if not 1 <= rank <= 4:
        raise ValueError(f"pointwise rank {rank} must be between 1 and 4")
    check_block("block", block, 16)
    cuda_block = check_block("cuda_block", block if cuda_block is None else cuda_block, 16)
    scope = Scope(POINTWISE_KERNEL_LOCALS | LAUNCH_LOCALS)
    strides = [f"stride_{{}}_{d}" for d in range(rank)]
    in_names = [scope.declare(n, ["{}_ptr", *strides]) for n in inputs]
    out_names = [scope.declare(n, ["{}_ptr", *strides]) for n, _ in outputs]
    idx_tensors = indexed_tensors(scope, indexed)
    scalar_names = [scope.declare(n) for n in scalars]
    stmts = scope.statements(body)
    out_vars = [scope.ref(var) for _, var in outputs]

    def tensor(arg: str, var: str) -> dict[str, object]:
        strides = [f"stride_{arg}_{d}" for d in range(rank)]
        offset = " + ".join(f"idx_{d} * {s}" for d, s in enumerate(strides))
        return {"arg": arg, "ptr": f"{arg}_ptr", "var": var, "strides": strides,
                "offset": offset}

    ins = [tensor(a, a) for a in in_names]
    outs = [tensor(a, v) for a, v in zip(out_names, out_vars)]
    return render(
        "pointwise.py.jinja",
        name=name,
        header_lines=header_lines,
        rank=rank,
        block=block,
        cuda_block=cuda_block,
        num_warps=num_warps,
        compute_dtype=compute_dtype(dtype),
        inputs=ins,
        outputs=outs,
        tensors=ins + outs,
        sizes=[f"size_{d}" for d in range(rank)],
        index_lines=_index_lines(rank),
        scalars=scalar_names,
        body=stmts,
        indexed=idx_tensors,
        launch_params=in_names + out_names + [t["arg"] for t in idx_tensors] + scalar_names,
        tensor_args=in_names + out_names,
    )


def indexed_tensors(scope: Scope, indexed: Sequence[tuple[str, int]]) -> list[dict[str, object]]:
    """Declare body-indexed tensors: a pointer and one stride per own axis, names unchanged."""
    out: list[dict[str, object]] = []
    for name, rank in indexed:
        strides = [f"stride_{{}}_{d}" for d in range(rank)]
        arg = scope.declare(name, ["{}_ptr", *strides])
        if arg != name:
            raise ValueError(f"indexed tensor {name!r} clashes with a template name (got {arg!r})")
        out.append({"arg": arg, "ptr": f"{arg}_ptr",
                    "strides": [s.format(arg) for s in strides]})
    return out


def _index_lines(rank: int) -> list[str]:
    """Row-major decomposition of the flat `offs` into `idx_0 .. idx_{rank-1}`."""
    if rank == 1:
        return ["idx_0 = offs"]
    lines = [f"idx_{rank - 1} = offs % size_{rank - 1}", f"rest = offs // size_{rank - 1}"]
    for d in range(rank - 2, 0, -1):
        lines += [f"idx_{d} = rest % size_{d}", f"rest = rest // size_{d}"]
    lines.append("idx_0 = rest")
    return lines


# --- reduction --------------------------------------------------------------------------------

REDUCTION_KERNEL_LOCALS = frozenset("""
    BLOCK_R BLOCK_C pid rows row_mask cols mask col_start n_rows n_cols
""".split())


@dataclass(frozen=True)
class ReductionStage:
    """`result = op(operand)` over each row, after `prologue` computed `operand` from the row.

    `op` is "sum" or "max"; masked columns never contribute. `result` has shape (BLOCK_R, 1),
    so later statements broadcast it against rows without indexing. `epilogue` statements run
    on reduced values only (e.g. `inv = tl.rsqrt(ss / n_cols + 1e-6)`).
    """

    op: str
    operand: str
    result: str
    prologue: tuple[str, ...] = ()
    epilogue: tuple[str, ...] = ()


def render_reduction(
    name: str,
    *,
    inputs: Sequence[str],
    stages: Sequence[ReductionStage],
    n_cols: int,
    row_epilogue: Sequence[str] = (),
    row_outputs: Sequence[tuple[str, str]] = (),
    reduced_outputs: Sequence[tuple[str, str]] = (),
    indexed: Sequence[tuple[str, int]] = (),
    row_stores: Sequence[tuple[str, str, str]] = (),
    dtype: str = "float32",
    header_lines: Sequence[str] = (),
    block_r: int = 1,
    block_c: int | None = None,
    max_single_block: int = 4096,
    num_warps: int = 4,
    wide: bool = False,
    cuda_block_r: int | None = None,
    cuda_block_c: int | None = None,
) -> str:
    """Row reduction(s) over the last axis of [rows, cols] views with prologue and epilogues.

    inputs: row tensors, loaded into values of the same (sanitised) name; a [cols] weight
        broadcasts over rows, a [rows, 1] tensor over columns.
    stages: reductions in order; a later stage may read earlier results (softmax: max, then
        sum of exp(x - max)).
    row_epilogue / row_outputs: statements on the row and `(tensor, var)` pairs stored per
        element. reduced_outputs: `(tensor, var)` pairs stored per row ([rows] tensors).
    n_cols: the static row length. When it fits one block (`block_c` unset, or >= n_cols) the
        row is loaded once; otherwise each stage loops over column blocks of `block_c`.
    indexed: `(tensor name, rank)` of tensors the statements load (and `row_stores` write)
        with their own index arithmetic, as in `render_pointwise`.
    row_stores: `(indexed tensor, offset var, value var)`: per-element stores at an offset the
        row epilogue computes (an element of a reduction over non-trailing axes is no
        `[rows, cols]` strided view).
    wide: row and column indices in int64 (a tensor of >= 2**31 elements, `meta.needs_int64`).
    block_r: rows a program off CUDA; cuda_block_r: on CUDA (`meta.cuda_row_block`; default
        `block_r`), also the module's `cuda_constexprs` for an ahead-of-time compile.
        cuda_block_c: the column block on CUDA (`meta.cuda_column_blocks`; default `block_c`):
        the kernel loops over column blocks if either device's block is shorter than a row.
    Launcher: `launch(*inputs, *row_outputs, *reduced_outputs, *indexed, n_rows, n_cols)`.
    """
    if not stages:
        raise ValueError("a reduction needs at least one stage")
    cuda_block_r, block_c, cuda_block_c = _reduction_blocks(
        n_cols, block_r, block_c, cuda_block_r, cuda_block_c, max_single_block)
    single_pass = min(block_c, cuda_block_c) >= n_cols
    cd = compute_dtype(dtype)
    scope = Scope(REDUCTION_KERNEL_LOCALS | LAUNCH_LOCALS)
    derived = ["{}_ptr", "stride_{}_row", "stride_{}_col"]
    in_names = [scope.declare(n, derived) for n in inputs]
    row_out_names = [scope.declare(n, derived) for n, _ in row_outputs]
    red_out_names = [scope.declare(n, derived) for n, _ in reduced_outputs]
    all_names = in_names + row_out_names + red_out_names
    idx_tensors = indexed_tensors(scope, indexed)
    stage_ctx, prologues = _reduction_stages(scope, stages, cd, single_pass)
    row_stmts = scope.statements(row_epilogue)
    ins = [_row_tensor(a, a) for a in in_names]
    row_outs = [_row_tensor(a, scope.ref(v)) for a, (_, v) in zip(row_out_names, row_outputs)]
    row_values = [{"arg": a, "ptr": f"{a}_ptr", "var": scope.ref(v),
                   "strides": [f"stride_{a}_row"], "offset": f"rows * stride_{a}_row"}
                  for a, (_, v) in zip(red_out_names, reduced_outputs)]
    for stage in stage_ctx:
        stage["loads"] = [t for t in ins if t["arg"] in stage["loads"]]
    stores = _indexed_stores(scope, row_stores, idx_tensors, "row store")
    wanted = {t["var"] for t in row_outs} | {t["var"] for t in stores} | {
        t["offset"] for t in stores}
    final_stmts, final_free = slice_statements(prologues + row_stmts, wanted)
    launch = all_names + [t["arg"] for t in idx_tensors]
    return render(
        "reduction.py.jinja", name=name, header_lines=header_lines, block_r=block_r,
        cuda_block_r=cuda_block_r, block_c=block_c, cuda_block_c=cuda_block_c,
        num_warps=num_warps, compute_dtype=cd, single_pass=single_pass, inputs=ins,
        stages=stage_ctx, row_epilogue=row_stmts, row_outputs=row_outs, row_values=row_values,
        row_stores=stores, final_stmts=final_stmts,
        final_loads=[t for t in ins if t["var"] in final_free], tensors=ins + row_outs + row_values,
        row_tensors=ins + row_outs, indexed=idx_tensors, launch_params=launch,
        tensor_args=all_names, device_arg=launch[0], wide=wide)


def _reduction_blocks(n_cols: int, block_r: int, block_c: int | None, cuda_block_r: int | None,
                      cuda_block_c: int | None, max_single_block: int) -> tuple[int, int, int]:
    """(cuda_block_r, block_c, cuda_block_c) of `render_reduction`, each checked."""
    check_block("block_r", block_r)
    cuda_block_r = check_block("cuda_block_r", block_r if cuda_block_r is None else cuda_block_r)
    if block_c is None:
        block_c = pow2(n_cols, 16) if n_cols <= max_single_block else 1024
    check_block("block_c", block_c, 16)
    cuda_block_c = check_block("cuda_block_c", block_c if cuda_block_c is None else cuda_block_c,
                               16)
    return cuda_block_r, block_c, cuda_block_c


def _row_tensor(arg: str, var: str) -> dict[str, object]:
    strides = [f"stride_{arg}_row", f"stride_{arg}_col"]
    return {"arg": arg, "ptr": f"{arg}_ptr", "var": var, "strides": strides,
            "offset": f"rows * {strides[0]} + cols * {strides[1]}"}


def _reduction_stages(scope: Scope, stages: Sequence[ReductionStage], cd: str,
                      single_pass: bool) -> tuple[list[dict[str, object]], list[str]]:
    """Each stage's template context (its `loads`: the input names its prologue reads, made
    tensors by the caller) and every stage's prologue statements, in order."""
    stage_ctx: list[dict[str, object]] = []
    prologues: list[str] = []
    for st in stages:
        if st.op not in ("sum", "max"):
            raise ValueError(f"reduction op {st.op!r} must be 'sum' or 'max'")
        pro = scope.statements(st.prologue)
        operand, result = scope.ref(st.operand), scope.assign(st.result)
        epi = scope.statements(st.epilogue)
        prologues += pro
        where = "0.0" if st.op == "sum" else 'float("-inf")'
        reduced = f"tl.{st.op}(tl.where(mask, {operand}, {where}), axis=1, keep_dims=True)"
        needed, free = slice_statements(prologues, {operand})
        stage_ctx.append({
            "op": st.op, "operand": operand, "result": result, "epilogue": epi,
            "prologue": pro if single_pass else needed,
            "reduce": reduced,
            "init": (f"tl.full([BLOCK_R, 1], 0, dtype={cd})" if st.op == "sum"
                     else f'tl.full([BLOCK_R, 1], float("-inf"), dtype={cd})'),
            "combine": (f"{result} + {reduced}" if st.op == "sum"
                        else f"tl.maximum({result}, {reduced})"),
            "loads": sorted(free),
        })
    return stage_ctx, prologues


def _indexed_stores(scope: Scope, stores: Sequence[tuple[str, str, str]],
                    idx_tensors: list[dict[str, object]], what: str,
                    keep: str | None = None) -> list[dict[str, str]]:
    """`(indexed tensor, offset var, value var)` stores as template context (a value named
    `keep`, a matmul's accumulator, stays itself); a store into a tensor not indexed is an
    error."""
    out = []
    for tensor, offset, var in stores:
        arg = scope.ref(tensor)
        if not any(t["arg"] == arg for t in idx_tensors):
            raise ValueError(f"{what} into {tensor!r}, which is not an indexed tensor")
        out.append({"ptr": f"{arg}_ptr", "offset": scope.ref(offset),
                    "var": var if var == keep else scope.ref(var)})
    return out


# --- matmul -----------------------------------------------------------------------------------

MATMUL_KERNEL_LOCALS = frozenset("""
    stride_ab stride_am stride_ak stride_bb stride_bk stride_bn stride_cb stride_cm stride_cn
    stride_sb stride_sk c_ptrs scale_ptrs BLOCK_M BLOCK_N BLOCK_K GROUP_M a b c a_ptr b_ptr c_ptr
    scale
    scale_ptr M N K batch pid num_pid_m num_pid_n num_pid_in_group group_id first_pid_m
    group_size_m pid_m pid_n offs_m offs_n offs_k m_mask n_mask k_mask a_ptrs b_ptrs acc
    k_start rows cols mask split k_per k_lo k_hi ws_ptr ws_tile num_tiles torch
    _workspace _WORKSPACES SPLIT_K
""".split())


@dataclass(frozen=True)
class MatmulContraction:
    """A further product of an indexed matmul kernel: `loads` leave the tiles named `a` and
    `b` per K step (as `operand_loads` do), summed over `k` into `acc` (a fresh accumulator,
    or, with `init` false, one an earlier product started: products the epilogue only adds
    share one, so a sum of four products holds one tile of registers, not four)."""

    loads: tuple[str, ...]
    a: str
    b: str
    acc: str
    k: int
    init: bool = True


def render_matmul(
    name: str,
    *,
    k_scale: bool = False,
    epilogue: Sequence[str] = (),
    epilogue_inputs: Sequence[str] = (),
    result: str = "acc",
    scalars: Sequence[str] = (),
    indexed: Sequence[tuple[str, int]] = (),
    operand_loads: Sequence[str] = (),
    operands: tuple[str, str] = ("a", "b"),
    contractions: Sequence[MatmulContraction] = (),
    stores: Sequence[tuple[str, str, str]] = (),
    dtype: str = "float32",
    allow_tf32: bool = False,
    header_lines: Sequence[str] = (),
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 32,
    group_m: int = 8,
    num_warps: int = 4,
    tiles: Mapping[int, Tile] | None = None,
    mma16: bool = False,
    split_k: int = 1,
) -> str:
    """Batched matmul `c[b] = a[b] @ b[b]` over arbitrary strides, fp32 (fp64) accumulation.

    k_scale: multiply A's columns (the contracted axis) by a per-(batch, k) weight first:
        `sum_u w_u delta_u (x) a_u = (delta * w)^T a`, the aggregated memory update with its
        token weights folded into one operand (a = delta^T as a strided view, b = a_u rows).
    epilogue: statements on `acc` (the [BLOCK_M, BLOCK_N] tile) and on `epilogue_inputs`,
        tensors broadcast to [batch, M, N] (a bias [N], a residual [batch, M, N], a per-batch
        scalar [batch, 1, 1]); `result` names the value stored into c.
    allow_tf32: fp32 dots on tensor cores in tf32 (GPU only; the interpreter is exact).
    mma16: the operand tiles are bf16/fp16: the 16-bit MMA on a GPU; under the interpreter
        (constexpr DOT_F32, set by the launcher off CUDA) an exact fp32 dot of the same values.
    tiles: the launch configuration per compute capability (`meta.matmul_tiles`), picked by
        the launcher from the device; default: block_m/n/k and num_warps everywhere.
    Launcher: `launch(a, b, c[, scale], *epilogue_inputs, *scalars)`.

    Indexed mode (`indexed` given: `(tensor name, rank)` pairs, read and written through their
    own strides): `operand_loads` run once per K step and leave the [BLOCK_M, BLOCK_K] and
    [BLOCK_K, BLOCK_N] tiles in the variables named by `operands` (they may read `offs_m`,
    `offs_n`, `offs_k`, `k_start`, `m_mask`, `n_mask`, `k_mask`, `batch`); the epilogue reads
    `acc`, `rows`, `cols`, `batch`, and `stores` are `(indexed tensor, offset var, value var)`
    written under `mask`. Launcher: `launch(*indexed, *scalars, batch, M, N, K)`.
    `contractions` (indexed mode only): more products over the same output tile, each its
    own K loop (static length) into its own accumulator, which the epilogue reads.
    `split_k` (indexed mode only, `meta.split_k`): every K loop cut into that many slices,
    each a program of grid axis 2 storing its partial tiles into a workspace the launcher
    keeps; `<name>_finish` adds them in slice order, then runs the epilogue and the stores.
    """
    tiles = _matmul_tiles(tiles or {0: Tile(block_m, block_n, block_k, num_warps, 3)})
    scope = Scope(MATMUL_KERNEL_LOCALS | LAUNCH_LOCALS)
    epi_names = [scope.declare(n, ["{}_ptr", "stride_{}_b", "stride_{}_m", "stride_{}_n"])
                 for n in epilogue_inputs]
    idx_tensors = indexed_tensors(scope, indexed)
    scalar_names = [scope.declare(n) for n in scalars]
    loads = scope.statements(operand_loads)
    a_operand, b_operand = (scope.ref(v) for v in operands) if indexed else operands
    extra = _contractions(scope, contractions, bool(indexed))
    stmts = scope.statements(epilogue)
    res = "acc" if result == "acc" else scope.ref(result)
    store_ctx = _indexed_stores(scope, stores, idx_tensors, "matmul store", keep="acc")
    if split_k > 1 and not indexed:
        raise ValueError("split-K needs the indexed mode")
    if indexed and (k_scale or epilogue_inputs):
        raise ValueError("indexed matmuls read scales and epilogue inputs by statements")
    tensors = ([t["arg"] for t in idx_tensors] if indexed
               else ["a", "b", "c"] + (["scale"] if k_scale else []) + epi_names)
    return render(
        "matmul.py.jinja", name=name, header_lines=header_lines,
        tiles={arch: tuple(t) for arch, t in sorted(tiles.items())}, group_m=group_m,
        acc_dtype=compute_dtype(dtype), precision=dot_precision(allow_tf32), k_scale=k_scale,
        epilogue=stmts, epilogue_inputs=[_epilogue_tensor(n) for n in epi_names],
        scalars=scalar_names, result=res, indexed=idx_tensors, operand_loads=loads,
        a_operand=a_operand, b_operand=b_operand, contractions=extra, stores=store_ctx,
        launch_params=tensors + scalar_names, tensor_args=tensors, mma16=mma16, split_k=split_k,
        split_accs=["acc"] + [c["acc"] for c in extra if c["init"]])


def _epilogue_tensor(n: str) -> dict[str, object]:
    """An epilogue input broadcast to [batch, M, N] through its strides."""
    return {"arg": n, "ptr": f"{n}_ptr", "var": n,
            "strides": [f"stride_{n}_b", f"stride_{n}_m", f"stride_{n}_n"],
            "offset": f"batch * stride_{n}_b + rows * stride_{n}_m + cols * stride_{n}_n"}


def _matmul_tiles(tiles: Mapping[int, Tile]) -> dict[int, Tile]:
    """The launch configurations, each tile side checked (`tl.dot` needs every side >= 16)."""
    tiles = dict(tiles)
    for arch, t in tiles.items():
        for label, blk in (("block_m", t.block_m), ("block_n", t.block_n),
                           ("block_k", t.block_k)):
            check_block(f"sm_{arch} {label}", blk, 16)
    return tiles


def _contractions(scope: Scope, contractions: Sequence[MatmulContraction],
                  indexed: bool) -> list[dict[str, object]]:
    """The template context of a matmul's further products (indexed mode only)."""
    extra = []
    for c in contractions:
        if not indexed:
            raise ValueError("more than one contraction needs the indexed mode")
        c_loads = scope.statements(c.loads)
        extra.append({"loads": c_loads, "a": scope.ref(c.a), "b": scope.ref(c.b),
                      "acc": "acc" if c.acc == "acc" else scope.assign(c.acc),
                      "k": int(c.k), "init": c.init})
    return extra
