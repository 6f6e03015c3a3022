"""One Triton kernel per scan: a SCAN node's body, loops and all, as a single generated program.

`render_scan(g, scan_id, dtype)` reads a scan's body graph and emits one `@triton.jit` kernel
(template `scan.py.jinja`) that runs every iteration inside the kernel. Nothing in it is
specific to Titans: a changed memory rule is a changed body graph, and it compiles the same way.

Independent axes. The grid is the product of the scan's *independent leading axes* (e.g.
[B, Nm] of a memory-chunk body): the longest prefix `P` of the carries' shape such that no body
op mixes those axes. Every body value gets a `pax` (where the axes of `P` sit in its shape, or
None when it does not vary along them); the rules, per op, are the `pax` of each op's
TRITON_SCAN rule (`rules.py`, driven by `independence.py`): einsum letters of P appear in
the output, reductions, cumsums, slices, pads and concats leave them alone, reshapes keep
them as whole axes, permutes move them. A value with a `pax` is computed per program on its
local slice (the P axes dropped); a value without one ("shared": scalars,
the causal mask table, shared weights) is computed whole in every program and read at full
coordinates. Each program runs the whole loop for its slice.

Storage. Each program owns a region of a global workspace (`ws`, `WS` elements per program):
every computed body value is a buffer there (contiguous over its local shape), carries
ping-pong between two slots (`it % 2`), xs are read straight from the stacked inputs at
iteration `t`, ys are written straight into their slice of the stacked outputs. Buffers get
symbolic offsets while the kernel is emitted; `scan_pack` then liveness-packs them (buffers
whose stage lifetimes, widened over loops, do not meet share addresses).

Carries on chip. A loop's carry is held in registers instead, as a loop-carried tile of its
local shape (each axis padded to a power of two >= 16, zero outside), when its local shape
has rank <= 2, the loop nests no scan (an inner loop's carries and stages get the registers),
and the carries held so far (enclosing loops included) stay within the register budget per
program (`codegen.meta.CARRY_REGISTER_BYTES`; `render_scan(carry_budget=)`). Its initial
value is loaded once, each iteration's next value is computed into a new tile and assigned
after every read of the old one (no slots, no copy), the final value is stored once after
the loop. A stage reads the tile only where its own tile has exactly the carry's axes (an
einsum operand whose letters get whole blocks, plain or `tl.trans`posed; a pointwise or
SUM / AMAX stage re-emitted as one tile of the local shape); any other read (a reshape, a
broadcast, a looped block) raises `RegMiss`, and the loop is emitted again with that carry
in the workspace. `ScanKernel.carries` (report.json `scan_carries`) says, per loop and carry,
which are on chip and why the others are not. Views (reshape,
permute, expand, slice, pad, concat) cost nothing: they are index arithmetic on the loads of
their consumers, and single-use elementwise nodes are inlined into their consumer's
expression. Consecutive stored elementwise nodes of one local shape share one stage: a
member reads an earlier member's result from the register tile that holds it (no store,
barrier and load between them), and the stage ends before a member that reads one at other
coordinates or reads a carry held on chip. A buffer nothing loads afterwards (a value only
its own stage read) is never stored. Consecutive reductions alike (one input shape, the same
axes) and consecutive one-block bf16 einsums share a stage too when none reads another's
result: every member's loads first, one barrier (a stage's serial rounds, `serial_rounds`,
are what a chunk's time follows). `tl.debug_barrier()` separates stages that talk through
the workspace; the copies of a loop's carries and ys touch disjoint storage and share one
barrier.

GPU fit. Index tiles are int32 unless a tensor reaches 2**31 elements (the workspace never
does: `MAX_WORKSPACE_TOTAL`); tiles hold at most `MAX_TILE` elements and dots `DOT_BLOCK`^3
(registers; `NUM_WARPS` = 8 spreads the on-chip carries over 256 threads); no software
pipelining (`NUM_STAGES = 1`: pipelined loads multiplied shared memory past A100's limit).
`runtime/targets/aot.py` compiles them for sm_80 and sm_90.

Stages. Elementwise nodes (and copies) are tile expressions over the flat local index;
einsums are `tl.dot` on [M, K] x [K, N] tiles (padded to powers of two >= 16, masked, letters
grouped into batch / M / N / K); SUM / AMAX are `tl.sum` / `tl.max` over a [rows, cols]
tile; CUMSUM is `tl.cumsum` along the columns; a nested SCAN becomes a nested loop (its
carries are slots of the same workspace). MASK and ROPE tables are computed once on the host
(`tables`) and passed in.

Split kernels. `render_scan(split=P)` (`config.scan_split`, `TITANC_SCAN_SPLIT=P`) shares
each slice of the independent axes (one workspace region) among P programs, at most
`MAX_SPLIT_GRID` programs in all (the grid's programs spin on each other: every one must be
resident, so the launcher asserts the device has that many SMs; fewer where the slices leave
no room, none below 2). Every stage runs inside `for sub in range(sub_lo, sub_hi):`, and its
first loop over independent output blocks (a flat tile loop, a reduction's rows, a dot's
M x N blocks in one loop, a batch loop) gives sub-program `sub` every P-th block from block
`sub`; a SUM or AMAX whose rows are one block hands out its column blocks instead, each
sub-program storing a partial result and sub-program 0 combining them in order after a
barrier; a stage with no such loop (one block, a cumsum's one row block) runs on sub-program
0 alone (`if sub_lo == 0:`). Each barrier between stages becomes a group barrier of the
slice (`_group_barrier` in the template: a CTA barrier, one thread's gpu-scope acq_rel
`tl.atomic_add` on the slice's counter in a small int32 tensor the launcher zeroes, a spin
until the count reaches the barrier's generation x P, a CTA barrier). Carries stay in the
workspace (none on chip: a register tile belongs to one program). On a GPU program `prog`
is sub-program `prog % P` of slice `prog // P`. The interpreter runs programs one after
another, where a spin would never end: there the constexpr SPLIT_SERIAL (set off CUDA) makes
one program per slice run its P sub-programs' shares of each stage in turn, the same stage
code between plain barriers, so the split's math (which blocks each sub-program computes, the
workspace they exchange) is what the interpreter tests for P > 1; the barrier primitive and
the pid -> sub mapping are what only a GPU runs. `serial_rounds` counts sub-program 0's
blocks (it has the most), `group_barriers` the barriers an iteration; `scan_kernel_for` keeps
the split kernel where its rounds plus `codegen.meta.BARRIER_ROUNDS` per group barrier cost
less than the unsplit kernel's, then weighs it against the host loop as any kernel. No split
kernel has run on a GPU: `scan_split` is 1 (off) by default.

Which scans are one kernel is `scan_form`'s rule (a chunk recurrence with independent axes),
then the cost rule of `scan_kernel_for` (the kernel's serial rounds against its host loop's
launches, `serial_cost`); every other scan runs as its host loop. No kernel holds more than
`MAX_STAGES` stages. A gather in the kernel's prologue (the embedding rows a carry starts
from) is read through: the carry's initial value is the table's row at the index. Anything
else (an op whose TRITON_SCAN rule keeps it out, such as a TAKE in a body or INDEX_ADD, an op
with no rule, integer casts, no independent axes, tiles or a workspace beyond the caps) raises
`ScanFallback` with the reason; the executor then keeps the host loop (whose body's scans
are kernels of their own) and reports the reason.

Modules: `rules` (the TRITON_SCAN table: each op's stage, independence and value rules),
`index` (references, coordinates), `independence` (which axes each program owns), `emitter`
(the lines, names and workspace being emitted), `values` (a value at coordinates),
`carries` (carries on chip), `stages` (pointwise stages), `einsum`, `reduce` (their stages),
`loops` (a body's nodes in order and the scan loops), `tidy` (dead stores dropped), `pack`
(workspace liveness), `rounds` (serial rounds and barriers counted from the emitted lines),
this one (the kernel and its launch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from math import prod
from typing import Callable, Collection

import torch

from titanc.ir import Graph, Node
from titanc.ir.tables import mask_table, rope_table
from titanc.ir.graph import freeze_attrs
from titanc.passes.flash_attention import expand_attention
from titanc.ir.buffer_plan import BufferPlan
from titanc.ir.schedule import Kernel, is_immediate, prologue_kernel, scan_prologue

from titanc.codegen.group import groupable
from titanc.config import current
from titanc.codegen.lowered import LaunchGroup, Lowered, ScanLaunch, ScanLoop, lower
from titanc.codegen.lower.code import graph_dtype
from titanc.codegen.meta import (BARRIER_ROUNDS, LOOP_GAIN, ROUNDS_PER_LAUNCH,
                                 carry_register_bytes,
                                 compute_dtype, dot_precision, kernel_split_k, needs_int64)
from titanc.codegen.render import render, sanitize_identifier
from titanc.codegen.scan.emitter import ScanEmitter
from titanc.codegen.scan.independence import prefixes
from titanc.codegen.scan.index import (MAX_TILE, MAX_WORKSPACE, BodyRefs, PaxError, Ref,
                                       ScanFallback)
from titanc.codegen.scan.loops import scan_loop
from titanc.codegen.scan.pack import BARRIER
from titanc.codegen.scan.rounds import rounds_and_barriers, split_stages
from titanc.codegen.scan.rules import expands, stage_of
from titanc.codegen.scan.tidy import drop_dead_stores, prune

__all__ = ["KERNEL_ROLES", "MAX_SPLIT_GRID", "MAX_STAGES", "MAX_TILE", "MAX_WORKSPACE",
           "ScanFallback", "ScanKernel", "render_scan", "scan_form", "serial_cost"]

MAX_WORKSPACE_TOTAL = 1 << 28   # workspace elements of all programs (one workspace per executor)
MAX_SPLIT_GRID = 132            # programs of a split kernel, every one resident at once (an
                                # H100's or H200's SMs; the launcher checks the device's)
# a split kernel's barrier between stages: its slice's programs (`scan.py.jinja`)
GROUP_BARRIER = "_group_barrier(bar_ptr + pid, SPLIT, SPLIT_SERIAL)"
MAX_STAGES = 128                # stages of one scan kernel (compile time and registers grow);
                                # a memory-chunk group's backward has 95
# scan roles (`ir.SCAN_ROLES`) whose body is one chunk of a recurrence (`scan_form`)
KERNEL_ROLES = frozenset({"memory", "memory_group"})
NUM_WARPS = 8
# No software pipelining: every loop of a scan kernel is short or reads the workspace its
# previous stage wrote, and pipelined loads multiply shared memory (tiny.yaml's layer scan:
# 174 KiB at 3 stages, above A100's 163 KiB; 32 KiB at 1).
NUM_STAGES = 1


@dataclass(frozen=True)
class ScanKernel:
    """A rendered scan kernel and how to launch it.

    `launch(ws, *inputs, *extra, *outputs, *tables)`: `inputs` are the scan node's operands
    (in order, immediates excluded: they are inlined, and so are the prologue gathers, read
    through), `extra` the values those gathers read (value ids), `outputs` the scan's result
    items listed in `outputs` (item index -> written), `tables` the MASK / ROPE tables (node
    attrs, host-made).
    """

    name: str
    source: str
    grid: int
    prefix: tuple[int, ...]
    ws_per_program: int
    inputs: tuple[int, ...]                  # positions in the scan's operands passed
    outputs: tuple[int, ...]                 # item indices written
    tables: tuple[tuple[str, dict], ...]     # (op name, attrs) of each host-made table
    stages: int                              # stages emitted (for reports)
    extra: tuple[int, ...] = ()              # value ids the prologue gathers read, passed
                                             # after the inputs
    # each loop's carries: {"scan": "%id", "carry": k, "shape": local tile, "on_chip": bool,
    # "why": why it stays in the workspace ("" on chip)}
    carries: tuple[dict, ...] = field(default=(), compare=False)
    rounds: int = field(default=0, compare=False)    # `serial_rounds` of its body
    # a split kernel: programs a slice of the independent axes (`grid` = slices x split on
    # a GPU; `ws_per_program` is then a slice's workspace / split, rounded up), and the group
    # barriers an iteration passes (`group_barriers`; 0 unsplit)
    split: int = 1
    barriers: int = field(default=0, compare=False)

    @cached_property
    def key(self) -> str:
        """Equal for scan kernels whose sources differ only in header and name (one module)."""
        return "scan:" + self.source.split("# Generated by titanc", 1)[-1].replace(self.name,
                                                                                   "KERNEL")



# -- the kernel -------------------------------------------------------------------------------------

def render_scan(g: Graph, scan_id: int, *, dtype: str = "float32", used: set[int] | None = None,
                name: str | None = None, spec_path: str = "",
                immediate: Callable[[int], float | None] = lambda v: None,
                allow_tf32: bool = False, carry_budget: int | None = None,
                prologue: Collection[int] = (), serial: bool = False,
                split: int = 1) -> ScanKernel:
    """One Triton kernel running scan `scan_id` of `g` (raises `ScanFallback` with the reason
    when it cannot). `used`: the item indices the program reads afterwards (default all);
    `prologue`: nodes the kernel computes before the scan (`ir.schedule.scan_prologue`:
    a gather and float casts of it, ending in carry operands): a carry's initial value is
    loaded through them (a row of the table at the index) instead of from a tensor of its own;
    `immediate(vid)`: the literal of an operand inlined as a constant, else None;
    `allow_tf32`: float32 dots on tensor cores in tf32 (`codegen.meta.dot_precision`);
    `carry_budget`: bytes of registers per program for carries held on chip (default
    `codegen.meta.carry_register_bytes()`; 0 keeps every carry in the workspace);
    `serial`: a scan without independent axes renders as one program instead of raising
    (the generator's tests on hand-built loops; `scan_form` never asks for it);
    `split`: programs per slice of the independent axes (the module's docstring, "Split
    kernels"), at most `MAX_SPLIT_GRID` programs in all (fewer where the slices leave no
    room: 1 is the unsplit kernel)."""
    budget = carry_register_bytes() if carry_budget is None else carry_budget
    n = g.node(scan_id)
    if stage_of(n) != "scan":
        raise ValueError(f"%{scan_id} is not a scan")
    if expands(n.attr("body")):                      # the kernel computes the chain itself
        n = n.replace(attrs=freeze_attrs({**n.attr_dict,
                                          "body": expand_attention(n.attr("body"))}))
    used = set(range(len(n.attr("body").outputs))) if used is None else set(used)
    job = _Job(g, n, compute_dtype(dtype), used,
               sanitize_identifier(name or f"titanc_scan_{scan_id}"), spec_path, immediate,
               allow_tf32, budget, tuple(prologue), max(1, split))
    why = "no carry with a leading axis"
    for prefix in prefixes(g, n):
        for shared in (0, 1, 2):     # operands other than carries taken by shape, or not
            try:
                return _render(job, prefix, shared)
            except PaxError as e:
                why = str(e)
    if serial:                       # one program (the generator's own tests)
        return _render(job, (), 2)
    raise ScanFallback(f"no independent leading axes ({why}): one program would run the "
                       "whole scan on one SM")


@dataclass(frozen=True)
class _Job:
    """What `render_scan` was asked for (the scan node with its body expanded)."""

    g: Graph
    n: Node
    cd: str
    used: set[int]
    name: str
    spec_path: str
    immediate: Callable[[int], float | None]
    allow_tf32: bool
    carry_budget: int
    prologue: tuple[int, ...]
    split: int = 1


def _render(job: _Job, prefix: tuple[int, ...], shared: int) -> ScanKernel:
    """Render with independent axes `prefix`: the carries whose shape starts with it vary
    per program, and so do the xs (`shared` < 2) and the other operands (`shared` < 1) whose
    shape does (`_bind_inputs`); prologue nodes are read through."""
    g, n = job.g, job.n
    em = ScanEmitter(g, n, job.cd, prefix)
    em.precision = dot_precision(job.allow_tf32)
    em.reg_budget = job.carry_budget
    em.split = split = min(job.split, MAX_SPLIT_GRID // max(1, prod(prefix))) \
        if prefix and job.split > 1 else 1
    if split < 2:
        em.split = split = 1
    sc = BodyRefs(g)
    inputs, extra = _bind_inputs(job, em, sc, prefix, shared)
    top = _outputs(job)
    outputs = list(top)
    if prefix and not any(sc.pax.get(v) is not None for v in n.inputs[:n.attr("n_carry")]):
        raise PaxError(f"no carry has the leading axes {list(prefix)}")
    # the workspace stays under MAX_WORKSPACE_TOTAL < 2**31: only the tensors decide
    em.index = "tl.int64" if needs_int64(*(prod(g.node(n.inputs[i]).type.shape)
                                           for i in inputs),
                                         *(prod(g.node(u).type.shape) for u in extra),
                                         *(prod(top[k].shape) for k in outputs)) else "tl.int32"
    scan_loop(em, sc, n, top)
    _check_and_tidy(em, prefix)
    if split > 1:
        em.lines = split_stages(em.lines)
    rounds, barriers = rounds_and_barriers(em.lines)
    if em.ws * prod(prefix) > MAX_WORKSPACE_TOTAL:
        raise PaxError(f"a workspace of {em.ws} x {prod(prefix)} elements is more than "
                       f"{MAX_WORKSPACE_TOTAL}")
    ranks = ([g.node(n.inputs[i]).type.rank for i in inputs]
             + [g.node(u).type.rank for u in extra]
             + [len(top[k].shape) for k in outputs])
    source = _source(job, em, prefix, (len(inputs) + len(extra), len(outputs)), ranks, rounds)
    return ScanKernel(job.name, source, prod(prefix) * split, prefix,
                      -(-max(em.ws, 16) // split), tuple(inputs), tuple(outputs),
                      tuple(em.tables), em.stages, carries=tuple(em.carry_notes),
                      extra=tuple(extra), rounds=rounds, split=split,
                      barriers=barriers if split > 1 else 0)


def _bind_inputs(job: _Job, em: ScanEmitter, sc: BodyRefs, prefix: tuple[int, ...],
                 shared: int) -> tuple[list[int], list[int]]:
    """Refs of the scan's operands (kernel tensors `a<k>`, literals, prologue nodes read
    through) and their pax; the positions passed and the values the prologue reads."""
    g, n, p = job.g, job.n, len(prefix)
    nc, nx = n.attr("n_carry"), n.attr("n_xs")
    for v in job.prologue:                            # a carry's initial value, gathered
        shape = g.node(v).type.shape
        q = tuple(range(p)) if shape[:p] == prefix else None
        sc.refs[v], sc.pax[v] = Ref("node", shape, q, node=g.node(v), scope=sc), q
    inputs: list[int] = []
    for i, v in enumerate(n.inputs):
        shape = g.node(v).type.shape
        if v in sc.refs:                              # the same value passed twice
            continue
        lit = job.immediate(v)
        if lit is not None:
            sc.refs[v], sc.pax[v] = Ref("lit", shape, None, value=lit), None
            continue
        if nc <= i < nx + nc:
            q = tuple(range(1, p + 1)) if shape[1:p + 1] == prefix and shared < 2 else None
        elif i < nc or shared < 1:
            q = tuple(range(p)) if shape[:p] == prefix else None
        else:
            q = None
        sc.refs[v] = Ref("arg", shape, q, name=f"a{len(inputs)}")
        sc.pax[v] = q
        if g.node(v).type.dtype == "bf16":
            em.low_args.add(f"a{len(inputs)}")
        inputs.append(i)
    extra = list(dict.fromkeys(u for v in job.prologue for u in g.node(v).inputs
                               if u not in sc.refs))
    for k, u in enumerate(extra):                     # what the prologue gathers read
        arg = f"a{len(inputs) + k}"
        sc.refs[u], sc.pax[u] = Ref("arg", g.node(u).type.shape, None, name=arg), None
        if g.node(u).type.dtype == "bf16":
            em.low_args.add(arg)
    return inputs, extra


def _outputs(job: _Job) -> dict[int, Ref]:
    """The kernel tensors `o<k>` of the used items: a carry's final value, a stacked y."""
    n = job.n
    body: Graph = n.attr("body")
    top: dict[int, Ref] = {}
    for k, (_, v) in enumerate(body.outputs):
        if k in job.used:
            shape = body.node(v).type.shape if k < n.attr("n_carry") else \
                (n.attr("length"),) + body.node(v).type.shape
            top[k] = Ref("arg", shape, None, name=f"o{len(top)}")
    return top


def _check_and_tidy(em: ScanEmitter, prefix: tuple[int, ...]) -> None:
    """Refuse a kernel whose programs mostly repeat shared work or that holds too many
    stages; then drop dead stores and unread names and pack the workspace."""
    if em.shared * 2 > sum(em.sizes) and prod(prefix) > 1:
        raise PaxError(f"with independent axes {list(prefix)} most of the work "
                       f"({em.shared} of {sum(em.sizes)} workspace elements) would be "
                       "repeated by every program")
    if em.stages > MAX_STAGES:
        raise ScanFallback(f"{em.stages} > {MAX_STAGES} stages in one kernel (compile time "
                           "and registers grow with them)")
    lines = drop_dead_stores(em.lines)
    if lines is not em.lines:                         # `stages` counts what is left
        em.lines = lines
        em.stages = sum(line.strip() == BARRIER for line in lines)
    em.lines = prune(em.lines)
    em.pack()


def _source(job: _Job, em: ScanEmitter, prefix: tuple[int, ...], counts: tuple[int, int],
            ranks: list[int], rounds: int) -> str:
    """The kernel's module text (template `scan.py.jinja`): header, arguments, body;
    `counts`: the input and output tensors, `ranks` their ranks."""
    g, n, p = job.g, job.n, len(prefix)
    tensors = ([f"a{k}" for k in range(counts[0])] + [f"o{k}" for k in range(counts[1])]
               + [f"g{k}" for k in range(len(em.tables))])
    ranks = ranks + [len(_table_shape(op, a)) for op, a in em.tables]
    strides = [[f"s_{t}_{d}" for d in range(r)] for t, r in zip(tensors, ranks)]
    pcs = []
    for i in range(p):
        inner = prod(prefix[i + 1:])
        pcs.append(f"pc{i} = (pid // {inner}) % {prefix[i]}" if inner > 1
                   else f"pc{i} = pid % {prefix[i]}")
    nc, nx = n.attr("n_carry"), n.attr("n_xs")
    split = (f" x {em.split} programs a slice (a split kernel: each stage's blocks handed out "
             "over them, a group barrier between stages)") if em.split > 1 else ""
    header = [f"{job.name}: scan kernel of graph {g.name}", f"spec: {job.spec_path or '(none)'}",
              f"scan %{n.id}: length {n.attr('length')}, {nc} carries, {nx} xs; grid over the "
              f"independent axes {list(prefix)}{split}; {em.stages} stages, {rounds} serial "
              "tile rounds an iteration",
              f"workspace: {em.ws} elements per program, liveness-packed from "
              f"{sum(em.sizes)}"]
    if job.prologue:
        header.append("prologue (carries' initial values read through): " + ", ".join(
            f"%{v} = {g.node(v).op.name.lower()}" for v in job.prologue))
    on_chip = [f"{c['scan']}.{c['carry']} {c['shape']}" for c in em.carry_notes if c["on_chip"]]
    if on_chip:                      # (a kernel holding none keeps its source, and AOT cache)
        header.append(f"carries on chip (budget {job.carry_budget} B of registers per "
                      "program): " + ", ".join(on_chip))
    body = em.lines if em.split == 1 else [
        line.replace(BARRIER, GROUP_BARRIER) if line.strip() == BARRIER else line
        for line in em.lines]
    return render("scan.py.jinja", name=job.name, header_lines=header, tensors=tensors,
                  strides=strides, pcs=pcs, body=body, ws=max(em.ws, 16),
                  grid=prod(prefix), split=em.split, index=em.index, num_warps=NUM_WARPS,
                  dot16=em.dot16,
                  num_stages=NUM_STAGES)


def host_table(op: str, a: dict, dtype: torch.dtype) -> torch.Tensor:
    """The host-made table of a scan kernel (`ScanKernel.tables` entry): the MASK or ROPE
    node's values, from the interpreter's own definitions (one semantics for every target)."""
    if op == "MASK":
        return mask_table(a["n_q"], a["q_start"], a["groups"], dtype)
    # a bf16 rotary table (mixed precision) holds bf16 values, kept in the compute dtype
    made = torch.bfloat16 if a.get("dtype") == "bf16" else dtype
    return rope_table(a["kind"], a["start"], a["count"], a["half"], a["base"], made).to(dtype)


def _table_shape(op: str, a: dict) -> tuple[int, ...]:
    if op == "MASK":
        return (a["n_q"], sum(length for _, length, _ in a["groups"]))
    return (a["count"], a["half"])



def scan_form(g: Graph, scan_id: int) -> str:
    """Why scan `scan_id` of `g` runs as its host loop, or "" where it may be one kernel.

    The rule (DESIGN.md §7, the third wave), from the body and the shapes:

    (a) One kernel, with a grid over the independent axes: a *chunk recurrence*, a scan whose
        role is in `KERNEL_ROLES` (`memory`: the neural memory's chunk loop, forward, backward
        and decode write; `memory_group`: the chunk-carry checkpoint groups around it). Its
        carries (W, S, momentum) are the state, each iteration one chunk's token-parallel
        work (projections, the inner gradient, the aggregated update) on tiles, and its
        batch x memory heads axes are independent: the shape of flash-linear-attention's
        chunk_h kernels. `render_scan` then finds the independent axes, or raises
        `ScanFallback` (none: one program would hold the chip's work on one SM; more than
        `MAX_STAGES` stages; a workspace beyond the caps), and the scan takes form (b).
    (b) A sequence of ordinary parallel kernels per iteration (the host loop over the body's
        schedule, each body kernel an ordinary grid kernel over tokens x features): every
        other role. A layer, a MAC segment and their backward (and a loss chunk, a loop of
        row groups) are big parallel work whose only independent axis is the batch, or none
        (the backward sums weight gradients over it): as one kernel they ran on 8 programs, or
        one, of a 132-SM chip, with 50 to 230 stages that took minutes to compile and spilled.
        Inside the step's CUDA graph a launch costs a few microseconds.

    `scan_kernel_for` then weighs (a) against (b) by their serial cost (`serial_cost`): a
    chunk recurrence whose state is too big for one program's chip (large_125m's memory: a
    head's MLP and momentum, ~1.2 MB) runs hundreds of tile rounds an iteration on its few
    programs, and its host loop, a few launches each over the whole chip, is faster.
    """
    n = g.node(scan_id)
    role = n.attr("role")
    if role in KERNEL_ROLES:
        return ""
    return (f"a {role} scan is big parallel work, not a chunk recurrence: each iteration "
            "runs its body's kernels, each with a grid of its own")


def scan_kernel_for(plan: BufferPlan, kern: Kernel, sid: int, dtype: str,
                    allow_tf32: bool = False) -> ScanKernel:
    """The scan kernel of schedule kernel `kern` (scan node `sid`), or `ScanFallback` where
    `scan_form` or the generator gives it a host loop."""
    g = plan.schedule.graph
    why = scan_form(g, sid)
    if why:
        raise ScanFallback(why)
    outs = set(kern.outputs)
    used = {g.node(u).attr("index") for u in g.users(sid) if u in outs}

    def rendered(split: int) -> ScanKernel:
        return render_scan(g, sid, dtype=dtype, used=used, name=kern.name,
                           immediate=lambda v: (float(g.node(v).attr("value"))
                                                if is_immediate(g, v) else None),
                           allow_tf32=allow_tf32, prologue=scan_prologue(g, kern), split=split)

    length = g.node(sid).attr("length")
    cost = lambda k: ROUNDS_PER_LAUNCH + (k.rounds + BARRIER_ROUNDS * k.barriers) * length
    sk = rendered(1)
    if current().scan_split > 1:        # the split kernel where it costs less (or no rule)
        sp = rendered(current().scan_split)
        if sp.split > 1 and (not current().scan_cost or cost(sp) < cost(sk)):
            sk = sp
    if current().scan_cost:
        one = cost(sk)
        loop = serial_cost(lower(plan.bodies[sid], _kernel_or_none(dtype, allow_tf32),
                                 groupable if current().group_launches else None)) * length
        loop += ROUNDS_PER_LAUNCH * (prologue_kernel(g, kern) is not None)
        if LOOP_GAIN * loop <= one:
            split = (f" ({sk.split} a slice, {sk.barriers} group barriers an iteration at "
                     f"{BARRIER_ROUNDS} rounds each)") if sk.split > 1 else ""
            raise ScanFallback(
                f"its one kernel would run {sk.rounds} serial tile rounds an iteration on "
                f"{sk.grid} programs{split} ({one:,} rounds in all), its host loop costs "
                f"{loop:,} (a launch counted as {ROUNDS_PER_LAUNCH} rounds, `serial_cost`; at "
                f"most 1/{LOOP_GAIN} of the kernel's): a loop of kernels over the whole chip "
                "is faster")
    return sk


def _kernel_or_none(dtype: str, allow_tf32: bool
                    ) -> Callable[[BufferPlan, Kernel, int], "ScanKernel | None"]:
    def one(plan: BufferPlan, kern: Kernel, sid: int) -> "ScanKernel | None":
        try:
            return scan_kernel_for(plan, kern, sid, dtype, allow_tf32)
        except ScanFallback:
            return None
    return one


def serial_cost(lowered: Lowered) -> int:
    """One run of `lowered` in serial tile rounds, the unit of `codegen.meta.
    ROUNDS_PER_LAUNCH`: a launch (a launch group, a loop's prologue; a split-K matmul two)
    is ROUNDS_PER_LAUNCH rounds, a scan kernel that plus its serial rounds an iteration
    (and a split kernel's group barriers, `BARRIER_ROUNDS` each) times its iterations, a
    host loop its body's cost times its iterations. What decides
    between a chunk recurrence's one kernel and its host loop (`scan_kernel_for`)."""
    g = lowered.graph
    cost = 0
    for s in lowered.steps:
        if isinstance(s, ScanLoop):
            cost += (ROUNDS_PER_LAUNCH * (s.prologue is not None)
                     + serial_cost(s.body) * g.node(s.scan).attr("length"))
        elif isinstance(s, ScanLaunch):
            cost += ROUNDS_PER_LAUNCH + (s.code.rounds + BARRIER_ROUNDS * s.code.barriers) \
                * g.node(s.scan).attr("length")
        else:
            single = isinstance(s, LaunchGroup) or kernel_split_k(g, s.kernel) < 2
            cost += ROUNDS_PER_LAUNCH * (1 if single else 2)
    return cost


def count_launches(plan: BufferPlan, dtype: str | None = None, scan_kernels: bool = True,
                   fallbacks: list[dict[str, str]] | None = None,
                   carries: list[dict] | None = None, forms: list[dict] | None = None,
                   groups: bool | None = None) -> int:
    """Kernel launches of one run of `plan` on the triton target, from the plan alone (its
    lowered program's, `Lowered.launches`): a scan that renders to a scan kernel is one
    launch, one that runs as a host loop launches its body's kernels once per iteration (its
    reason appended to `fallbacks`); with `groups` (default: `config.group_launches`, as the
    triton target lowers), a launch group is one launch (`codegen.horizontal`). `carries`
    gets, per scan kernel, where each loop's carries live (`ScanKernel.carries`, with the
    graph and kernel names); `forms` gets, per scan, the
    form `scan_form` and the generator gave it (report.json `scan_forms`: graph, scan, role,
    form "kernel" with its grid and serial tile rounds an iteration or "host_loop", its
    iterations (`length`), and why)."""
    dt = dtype or graph_dtype(plan.schedule.graph)

    def one_kernel(p: BufferPlan, kern: Kernel, sid: int) -> bool | None:
        row = {"graph": p.schedule.graph.name, "scan": kern.name,
               "role": p.schedule.graph.node(sid).attr("role"),
               "length": p.schedule.graph.node(sid).attr("length")}
        try:
            if not scan_kernels:
                raise ScanFallback("scan kernels are off")
            sk = scan_kernel_for(p, kern, sid, dt)
            if carries is not None:
                carries.extend({"graph": p.schedule.graph.name, "kernel": kern.name, **c}
                               for c in sk.carries)
            if forms is not None:
                split = (f", split over {sk.split} programs each ({sk.barriers} group "
                         "barriers an iteration)") if sk.split > 1 else ""
                forms.append(row | {"form": "kernel", "grid": sk.grid, "rounds": sk.rounds,
                                    "split": sk.split,
                                    "why": f"a chunk recurrence: one program per independent "
                                           f"index {list(sk.prefix)}{split}, its state on "
                                           f"chip across iterations"})
            return True
        except ScanFallback as e:
            if fallbacks is not None:
                fallbacks.append({"graph": p.schedule.graph.name, "scan": kern.name,
                                  "reason": str(e)})
            if forms is not None:
                forms.append(row | {"form": "host_loop", "why": str(e)})
            return None

    if groups is None:
        groups = current().group_launches
    return lower(plan, one_kernel, groupable if groups else None).launches()
