"""Hooks from the IR to the template families: Triton source for every kernel of a schedule.

`render_kernel(g, kernel)` maps one fused kernel onto its family (`ir.kernel_family.family_of`;
the family's record names its hook, below; docs/conventions.md §7: hooks read the IR,
templates hold plain Triton) and returns a `KernelCode`: the module source and how to launch
it (which values, viewed how, and the trailing size arguments of its `launch`).

    pointwise            pointwise.py.jinja over the flat element index (rank 1): values read
                         at the flat index come in as template inputs, every other read (a
                         view, broadcast, pad, concat, gather) is an indexed load through the
                         tensor's own strides; outputs are stored flat.
    reduction (SUM/AMAX) reduction.py.jinja: the reduced axes become the columns and the kept
                         axes the rows of a [rows, cols] index space; the input-domain nodes
                         are the prologue (stored prologue values are row stores), the
                         output-domain nodes the last stage's epilogue, stored per row
                         (`rows.py`).
    reduction (CUMSUM)   scan_cumsum.py.jinja: the scanned axis is the columns (`rows.py`).
    matmul               matmul.py.jinja in indexed mode: the einsum's letters grouped into
                         batch / M / N / K, operand tiles read through their views by index
                         statements (a concat or a mask operand is never materialized), a
                         prologue (pointwise work only the einsums read) evaluated as each
                         operand tile is loaded, the epilogue on the output tile, every output
                         stored at its own offsets.
    template             its op's rule in the template-kernel table (`lowerings.TRITON_KERNEL`):
                         segment_sum.py.jinja (a sorted segment sum) / scatter_along.py.jinja
                         for INDEX_ADD and SCATTER_ALONG (below); a pattern op's template
                         (`patterns.py`: ATTENTION -> attention_fwd, ATTENTION_BWD ->
                         attention_bwd, ...); a SCAN is no Triton kernel (the program loops
                         over its body's kernels), so `render_kernel` refuses it.

Every file starts with a header naming the kernel's IR nodes and the spec path, through
`render.sanitize_comment`. A kernel that no family can express raises `NotImplementedError`
naming the kernel and the node; there is no fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import Collection, Iterator

from titanc.ir import Graph, Node, Op, format_node
from titanc.ir.lowering import register_lowering
from titanc.ir.shapes import parse_einsum
from titanc.ir.buffer_plan import BufferPlan
from titanc.ir.kernel_family import family_of, resolve
from titanc.ir.schedule import Kernel, is_immediate, prologue_kernel

from titanc.codegen.families.fused import MatmulContraction, render_matmul, render_pointwise
from titanc.codegen.families.scatter import render_scatter_along, render_segment_sum
from titanc.codegen.meta import (compute_dtype, cuda_flat_block, kernel_split_k, matmul_tiles,
                                 needs_int64, pow2, value_dtype)
from titanc.codegen.meta import mma16 as mma16_dtype
from titanc.codegen.scan.kernel import ScanFallback, ScanKernel, scan_kernel_for
from titanc.codegen.lower.code import KernelCode, TensorArg, code_of, graph_dtype, index_tile, indexed_args, store
from titanc.codegen.lower.indexing import (Ix, Names, Section, broadcast_coords, delinearize,
                                           reshape_coords)
from titanc.codegen.lower.lowerings import TRITON_KERNEL
from titanc.codegen.lower import patterns  # noqa: F401  (registers the pattern ops' rules)
from titanc.codegen.lower.nodes import KernelLowering, Val
from titanc.passes.fusion_rules import matmul_prologue

__all__ = ["KernelCode", "TensorArg", "graph_dtype", "plan_kernels", "render_kernel"]


def plan_kernels(plan: BufferPlan, dtype: str | None = None, spec_path: str = "",
                 allow_tf32: bool = False, scan_kernels: bool = False
                 ) -> Iterator[tuple[BufferPlan, Kernel, KernelCode | ScanKernel]]:
    """The one dispatch from schedule kernels to families: (plan, kernel, code) for every
    kernel of a plan's schedule and its scan bodies (pre-order). No-op kernels (all outputs
    alias storage that already holds them) are skipped, aliased outputs are not stored. A
    scan is one `ScanKernel` (`codegen.scan`) when `scan_kernels` is set and it renders as
    one, as the triton target runs it; otherwise the kernel of its prologue gathers
    (`ir.schedule.prologue_kernel`, if any) and its body's kernels (a host loop)."""
    g = plan.schedule.graph
    dt = dtype or graph_dtype(g)
    for k, kern in enumerate(plan.schedule.kernels):
        scan = [n for n in kern.nodes if n in plan.bodies]
        if scan and scan_kernels:
            try:
                yield plan, kern, scan_kernel_for(plan, kern, scan[0], dt, allow_tf32)
                continue
            except ScanFallback:
                pass
        pro = prologue_kernel(g, kern)
        if scan and pro is not None:          # a host loop gathers its carries' rows first
            yield plan, pro, render_kernel(g, pro, dtype=dt, spec_path=spec_path,
                                           skip=set(plan.aliases), allow_tf32=allow_tf32,
                                           strided=plan.strided)
        if scan:
            yield from plan_kernels(plan.bodies[scan[0]], dt, spec_path, allow_tf32, scan_kernels)
        elif not plan.is_noop(k):
            yield plan, kern, render_kernel(g, kern, dtype=dt, spec_path=spec_path,
                                            skip=set(plan.aliases), allow_tf32=allow_tf32,
                                            strided=plan.strided)


def render_kernel(g: Graph, kernel: Kernel, *, dtype: str = "float32", spec_path: str = "",
                  skip: Collection[int] = (), allow_tf32: bool = False,
                  strided: Collection[int] = ()) -> KernelCode:
    """Triton source of one kernel; `skip` are outputs not to store (aliases of storage that
    already holds them); `allow_tf32`: float32 dots in tf32 on tensor cores (GPU only);
    `strided`: inputs the plan may bind as strided views (`BufferPlan.strided`), always
    loaded through their strides."""
    low = KernelLowering(g, kernel, compute_dtype(dtype), strided)
    outs = [v for v in kernel.outputs if v not in skip]
    header = [f"{kernel.name}: {kernel.category} kernel of graph {g.name}",
              f"spec: {spec_path or '(none)'}", "IR nodes:"]
    header += ["  " + format_node(g.node(n)) for n in kernel.nodes]
    fam = family_of(g, kernel)
    if not fam.renderer:
        raise NotImplementedError(low.where(f"a {fam.name} kernel has no Triton kernel of its "
                                            f"own (a SCAN runs as a scan kernel, `codegen.scan`, "
                                            f"or as a loop over its body's kernels)"))
    code = resolve(fam.renderer)(low, outs, header, dtype, allow_tf32)
    return code if code.family == fam.name else replace(code, family=fam.name)


# -- pointwise -------------------------------------------------------------------------------------

def lower_pointwise(low: KernelLowering, outs: list[int], header: list[str], dtype: str,
                    allow_tf32: bool = False) -> KernelCode:
    """The pointwise family's hook (`ir.kernel_family`): one flat index over the kernel."""
    g, kernel = low.g, low.kernel
    computed = [n for n in kernel.nodes if low.computed(n)]
    numel = g.node((computed or outs)[0]).type.numel
    flat = Ix("idx_0", frozenset({"i"}))
    sec = Section(Names(), "mask", "[BLOCK]", frozenset({"i"}), flat=flat, numel=numel)
    for nid in computed:
        n = g.node(nid)
        sec.values[nid] = low.compute(sec, n, delinearize(sec, flat, n.type.shape))
    outputs = []
    for k, v in enumerate(outs):
        val = sec.values.get(v) or low.read(sec, v, delinearize(sec, flat, low.shape(v)))
        outputs.append((f"out{k}", low.block(sec, val).expr))
    direct = list(low.direct.items())
    source = render_pointwise(
        kernel.name, inputs=[name for _, name in direct], outputs=outputs, body=sec.stmts,
        rank=1, indexed=low.indexed(), dtype=dtype, header_lines=header,
        block=min(1024, pow2(numel, 16)),
        cuda_block=max(16, cuda_flat_block(numel, min(1024, pow2(numel, 16)), 4)))
    args = ([TensorArg(v, (numel,)) for v, _ in direct] + [TensorArg(v, (numel,)) for v in outs]
            + indexed_args(low))
    return code_of(low, "pointwise", source, args, ((numel,),))


# -- matmul ----------------------------------------------------------------------------------------

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def lower_matmul(low: KernelLowering, outs: list[int], header: list[str], dtype: str,
                 allow_tf32: bool = False) -> KernelCode:
    """The matmul family's hook (`ir.kernel_family`): one output tile grid; each einsum of
    the kernel (fusion gave them equal tiles, `passes.fusion.matmul_tile`) its own K loop and
    accumulator, then the epilogue."""
    g, kernel = low.g, low.kernel
    einsums = [g.node(n) for n in kernel.nodes if g.node(n).op is Op.EINSUM]
    # 16-bit MMA when the executor stores in 16 bits or every operand holds bf16 values (the
    # mixed-precision pass casts every einsum operand to bf16): `meta.mma16`, as scan kernels
    op16 = mma16_dtype(dtype, [value_dtype(g, v) for e in einsums for v in e.inputs])
    mma16 = op16 is not None
    names = Names()
    products = [_product(low, e, names, mma16, op16) for e in einsums]
    first = products[0]
    for p in products[1:]:
        if (p.out_roles, p.sz["batch"], p.sz["M"], p.sz["N"]) != (
                first.out_roles, first.sz["batch"], first.sz["M"], first.sz["N"]):
            raise NotImplementedError(low.where(f"%{p.node.id} and %{first.node.id} have "
                                                f"different output tiles"))
    e, size, (batch, m, n) = first.node, first.size, first.groups
    tc = first.tc

    def group(sec: Section, chars: list[str], index: Ix) -> dict[str, Ix]:
        return dict(zip(chars, delinearize(sec, index, [size[ch] for ch in chars])))

    epi = Section(names, "mask", "[BLOCK_M, BLOCK_N]", frozenset({"m", "n"}))
    letters = (group(epi, batch, Ix("batch")) | group(epi, m, index_tile(epi, "rows", "m"))
               | group(epi, n, index_tile(epi, "cols", "n")))
    oc = [letters[ch] for ch in tc]
    oshape = e.type.shape

    def coords(shape: tuple[int, ...]) -> list[Ix]:
        return reshape_coords(epi, oc, oshape, shape)

    acc_of, held = _shared_accumulators(g, kernel, products)
    pro = matmul_prologue(g, list(kernel.nodes), {n for n in kernel.nodes if low.computed(n)})
    for k, p in enumerate(products):
        epi.values[p.node.id] = Val(acc_of[k], epi.dims)
        if p.node.type.dtype == "bf16":   # the epilogue and the store see the product rounded
            epi.values[p.node.id] = low.round_bf16(epi, epi.values[p.node.id])
    ids = {p.node.id for p in products}
    for nid in kernel.nodes:
        node = g.node(nid)
        if nid in held:                      # a sum a shared accumulator holds
            if held[nid] is not None:
                epi.values[nid] = Val(held[nid], epi.dims)
        elif low.computed(nid) and nid not in ids and nid not in pro:
            epi.values[nid] = low.compute(epi, node, coords(node.type.shape))
    stores: list[tuple[str, str, str]] = []
    for v in outs:
        store(low, epi, v, coords(low.shape(v)), stores)
    more = [MatmulContraction(tuple(p.loads), p.tiles[0], p.tiles[1], acc_of[k], p.sz["K"],
                              init=acc_of[k] == f"acc{k}")
            for k, p in enumerate(products) if k > 0]
    k_max = max(p.sz["K"] for p in products)
    source = render_matmul(kernel.name, indexed=low.indexed(), operand_loads=first.loads,
                           operands=(first.tiles[0], first.tiles[1]), contractions=more,
                           epilogue=epi.stmts, stores=stores,
                           dtype=dtype, header_lines=header, allow_tf32=allow_tf32,
                           tiles=matmul_tiles(2 if mma16 else _ITEMSIZE[dtype], first.sz["M"],
                                              first.sz["N"], k_max,
                                              exact_f32=not (mma16 or allow_tf32),
                                              accumulators=len(set(acc_of))),
                           mma16=mma16, split_k=kernel_split_k(g, kernel))
    return code_of(low, "matmul", source, indexed_args(low),
                   (first.sz["batch"], first.sz["M"], first.sz["N"], first.sz["K"]))


def _shared_accumulators(g: Graph, kernel: Kernel, products: list["_Product"]
                         ) -> tuple[list[str], dict[int, str | None]]:
    """Each product's accumulator, and the ADD nodes a shared accumulator stands for (the
    root of a sum: its name; an ADD inside the sum: None, nothing reads it). Products that
    the epilogue only adds together (an ADD of two products or sums of them, each read by
    that ADD alone, of its type, not bf16-rounded) accumulate into one tile, the first
    one's (`acc` for product 0, `acc<k>` for product k). tiny.yaml's segment backward sums
    four products: with four [BLOCK_M, BLOCK_N] accumulators on a 128 x 64 tile it needed
    255 registers and spilled 980 B per thread on sm_90."""
    sums: dict[int, set[int]] = {p.node.id: {k} for k, p in enumerate(products)
                                 if p.node.type.dtype in ("f32", "f64")}
    outs = set(kernel.outputs)
    held: dict[int, str | None] = {}
    for nid in kernel.nodes:                      # in order: a sum's parts come first
        n = g.node(nid)
        if n.op is Op.ADD and len(set(n.inputs)) == 2 and all(
                i in sums and i not in outs and g.users(i) == [nid]
                and g.node(i).type == n.type for i in n.inputs):
            sums[nid] = sums.pop(n.inputs[0]) | sums.pop(n.inputs[1])
            held.update({i: None for i in n.inputs if g.node(i).op is Op.ADD})
            held[nid] = None
    acc_of = ["acc" if k == 0 else f"acc{k}" for k in range(len(products))]
    for root, ks in sums.items():
        name = acc_of[min(ks)]
        for k in ks:
            acc_of[k] = name
        if root in held:
            held[root] = name
    return acc_of, held


@dataclass
class _Product:
    """One einsum of a matmul kernel: its letters grouped into batch / M / N / K, and the
    statements loading its [BLOCK_M, BLOCK_K] and [BLOCK_K, BLOCK_N] tiles per K step."""
    node: Node
    tc: str
    size: dict[str, int]
    groups: tuple[list[str], list[str], list[str]]
    sz: dict[str, int]
    out_roles: tuple[str, ...]
    loads: list[str]
    tiles: list[str]


def _product(low: KernelLowering, e: Node, names: Names, mma16: bool, op16: str) -> _Product:
    if len(e.inputs) != 2:
        raise NotImplementedError(low.where(f"%{e.id} contracts {len(e.inputs)} operands, "
                                            f"the matmul family takes two"))
    (ta, tb), tc = parse_einsum(e.attr("spec"), 2)
    if len(set(ta)) != len(ta) or len(set(tb)) != len(tb):
        raise NotImplementedError(low.where(f"%{e.id} takes a diagonal ({e.attr('spec')})"))
    size = dict(zip(ta, low.shape(e.inputs[0]))) | dict(zip(tb, low.shape(e.inputs[1])))
    batch = [ch for ch in tc if ch in ta and ch in tb]
    m = [ch for ch in tc if ch in ta and ch not in tb]
    n = [ch for ch in tc if ch in tb and ch not in ta]
    k = list(dict.fromkeys(ch for ch in ta + tb if ch not in tc))
    sz = {name: prod(size[ch] for ch in group)
          for name, group in (("batch", batch), ("M", m), ("N", n), ("K", k))}
    roles = tuple("b" if ch in batch else "m" if ch in m else "n" for ch in tc)
    loads: list[str] = []

    def group(sec: Section, chars: list[str], index: Ix) -> dict[str, Ix]:
        return dict(zip(chars, delinearize(sec, index, [size[ch] for ch in chars])))

    tiles = []
    for term, vid, (outer_chars, inner_chars), mask, block, dims, idx in (
            (ta, e.inputs[0], (m, k), "m_mask[:, None] & k_mask[None, :]", "[BLOCK_M, BLOCK_K]",
             ("m", "k"), ("offs_m[:, None]", "(k_start + offs_k)[None, :]")),
            (tb, e.inputs[1], (k, n), "k_mask[:, None] & n_mask[None, :]", "[BLOCK_K, BLOCK_N]",
             ("k", "n"), ("(k_start + offs_k)[:, None]", "offs_n[None, :]"))):
        sec = Section(names, mask, block, frozenset(dims), stmts=loads)
        outer = group(sec, outer_chars, index_tile(sec, idx[0], dims[0]))
        inner = group(sec, inner_chars, index_tile(sec, idx[1], dims[1]))
        coord = group(sec, batch, Ix("batch")) | outer | inner
        if mma16 and _stored_as(low, vid, op16):
            # a kernel input stored as the MMA takes it: its masked load (0 outside the
            # tile) is the operand, straight from memory to the tensor cores
            tiles.append(low.load(sec, vid, [coord[ch] for ch in term], (), stored=True).expr)
            continue
        val = _operand_tile(low, sec, vid, [coord[ch] for ch in term])
        if mma16:                                 # 16-bit MMA, float32 accumulation
            cast = f".to(tl.{op16})"
        else:
            cast = f".to({low.cd})" if val.literal is not None or low.cd != "tl.float32" else ""
        tiles.append(sec.let(f"tl.where({mask}, {val.expr}, 0.0){cast}", "t"))
    return _Product(e, tc, size, (batch, m, n), sz, roles, loads, tiles)


def _stored_as(low: KernelLowering, vid: int, op16: str) -> bool:
    """Operand `vid` is a kernel input whose storage holds `op16` values (a bf16 tensor of a
    mixed-precision graph, or any float tensor where the compute dtype is `op16`)."""
    if vid in low.inside or is_immediate(low.g, vid):
        return False
    t = low.node(vid).type
    return t.is_float and ((t.dtype == "bf16" and op16 == "bfloat16") or low.cd == f"tl.{op16}")


def _operand_tile(low: KernelLowering, sec: Section, vid: int, coords: list[Ix]) -> Val:
    """Operand `vid` of an einsum at `coords` (its own shape) in an operand tile's section: a
    kernel input (or a view of one) is loaded; a prologue value (`passes.fusion_rules.
    matmul_prologue`: computed before any contraction, read only on the way to the einsums)
    is evaluated here from its own operands, at coordinates of the same element (a reshape
    keeps the linear index, an elementwise op broadcasts), once per section."""
    if not low.computed(vid):
        return low.read(sec, vid, coords)
    if vid in sec.values:
        return sec.values[vid]
    n = low.node(vid)
    if n.op is Op.RESHAPE:
        src = n.inputs[0]
        val = _operand_tile(low, sec, src, reshape_coords(sec, coords, n.type.shape,
                                                          low.shape(src)))
    else:
        for i in dict.fromkeys(n.inputs):
            if low.computed(i):
                _operand_tile(low, sec, i, broadcast_coords(coords, n.type.shape, low.shape(i)))
        val = low.compute(sec, n, coords)
    sec.values[vid] = val
    return val


# -- scatter-adds ----------------------------------------------------------------------------------

@register_lowering(Op.INDEX_ADD, TRITON_KERNEL)
@register_lowering(Op.SCATTER_ALONG, TRITON_KERNEL)
def _scatter(g: Graph, node: Node, kernel: Kernel, header: list[str], dtype: str,
             allow_tf32: bool) -> KernelCode:
    low = KernelLowering(g, kernel, compute_dtype(dtype))
    grad, idx = node.inputs
    n_idx = g.node(idx).type.numel
    if node.op is Op.INDEX_ADD:
        # a sorted segment sum (`segment_sum.py`): O((indices + rows) · cols), deterministic
        cols = g.node(grad).type.numel // max(n_idx, 1)
        source = render_segment_sum(kernel.name, dtype=dtype, header_lines=header,
                                    block_c=max(16, min(128, pow2(cols))))
        args = [TensorArg(grad, (n_idx, cols)), TensorArg(idx),    # idx: any strides
                TensorArg(node.id, (node.attr("rows"), cols))]
        return code_of(low, "segment_sum", source, args, ())
    source = render_scatter_along(kernel.name, dtype=dtype, header_lines=header,
                                  wide=needs_int64(n_idx * node.attr("size")),
                                  block_r=min(16, pow2(n_idx)),
                                  block_c=max(16, min(64, pow2(node.attr("size")))))
    args = [TensorArg(grad, (n_idx,)), TensorArg(idx, (n_idx,)),
            TensorArg(node.id, (n_idx, node.attr("size")))]
    return code_of(low, "scatter_along", source, args, ())
