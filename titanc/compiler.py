"""The compile pipeline: the only way a graph reaches an executor (docs/conventions.md §6).

Every graph kind (`GRAPH_KINDS`) goes through the same steps, declared as a table (`LOWER`,
`PIPELINE`, `BACKEND`; `titanc inspect --pipeline` prints it, `pipeline_text`):

    lower (frontend / decode / optimizer) -> its row of graph passes -> hoist_scan_invariants
        -> split_casts -> constants_per_reader -> views_per_reader -> fusion -> waves
        -> verify_schedule -> buffer plan
        =>  `CompiledGraph(kind, graph, schedule, plan, passes)`

The graph passes are canonicalize and aggregate for every kind; the forward graph adds the
chunked loss and (unless `remat: none`) the chunk-carry checkpoints, and the training graph is
the autodiff of that forward. Under `train.dtype: bfloat16` every kind but the optimizer ends
its graph passes with the precision policy (passes/precision.py) and a cleanup; the training
graph inherits it from the forward. Each graph pass is verified after it runs (`verify_each`),
recorded in the `PassLog` (report.json `graphs.<kind>.passes`) and dumped by `titanc compile`
as `ir/NN_<pass>_<graph>.txt`. `TITANC_DEBUG=1` prints pass timings, `=2` the IR after each
pass and every fusion refusal.

`compile_graphs` builds the training kinds (forward, training, optimizer) at once; the others
(logits, logprobs, decode_step, decode_write) are built on first use by `Compiled.graph`, so
the runtime receives compiled graphs and never imports a frontend module.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from titanc import compile_cache
from titanc.fit import planned_bytes
from titanc.ir import Graph, dtype_name
from titanc.passes.aggregate import Aggregate
from titanc.passes.autodiff import Autodiff
from titanc.passes.canonicalize import Canonicalize
from titanc.passes.fusion import fuse, graph_flops
from titanc.passes.waves import in_waves
from titanc.passes.constants import ConstantsPerReader
from titanc.ir.buffer_plan import BufferPlan
from titanc.passes.buffer_plan import plan_buffers
from titanc.ir.schedule import Schedule, verify_schedule
from titanc.passes.checkpoint_chunks import CheckpointChunks
from titanc.passes.chunked_loss import ChunkedLoss
from titanc.passes.flash_attention import FlashAttention
from titanc.passes.fused_adamw import FusedAdamW
from titanc.passes.linear_cross_entropy import LinearCrossEntropy
from titanc.passes.hoist_casts import HOIST_TOKENS, HoistCasts
from titanc.passes.remat import Policy, choose_policy
from titanc.passes.manager import Pass, PassLog
from titanc.passes.optimizer import optimizer_graph
from titanc.passes.precision import MixedPrecision
from titanc.passes.hoist import SINK_MIN_STATE, HoistScanInvariants
from titanc.passes.split_casts import SplitCasts
from titanc.passes.views_per_reader import ViewsPerReader

from titanc.model.decode import lower_step, lower_write
from titanc.model.frontend import lower_forward
from titanc.model.params import ParamSpec, param_specs
from titanc.model.spec import Spec

# forward: the loss; training: loss and gradients; optimizer: clip + AdamW; logits / logprobs:
# the forward with another output; decode_step: n new tokens given each layer's state;
# decode_write: one completed memory chunk applied to the state
GRAPH_KINDS = ("forward", "training", "optimizer", "logits", "logprobs", "decode_step",
               "decode_write")


@dataclass
class CompiledGraph:
    """One graph after the whole pipeline: what an executor binds."""
    kind: str                      # one of GRAPH_KINDS
    graph: Graph                   # after the graph passes
    schedule: Schedule             # fused kernels, verified
    plan: BufferPlan               # arena offsets; persistent names are bound by the caller
    passes: list[dict[str, Any]]   # this graph's records of the pass log


@dataclass
class Compiled:
    spec: Spec
    batch: int
    params: list[ParamSpec]
    log: PassLog = field(default_factory=PassLog)
    policy: Policy = field(default_factory=Policy)
    graphs: dict[Any, CompiledGraph] = field(default_factory=dict)
    patterns: bool = True          # the pattern passes (flash attention, fused linear
                                   # cross-entropy, fused AdamW); off only
                                   # to measure what they save (`titanc.tools.cost_model`)

    # the training kinds, as the tests, inspection and codegen read them
    @property
    def forward(self) -> Graph:
        return self.graphs["forward"].graph

    @property
    def grad(self) -> Graph:
        return self.graphs["training"].graph

    @property
    def optimizer(self) -> Graph:
        return self.graphs["optimizer"].graph

    @property
    def schedules(self) -> dict[str, Schedule]:
        return {k: self.graphs[k].schedule for k in ("forward", "training", "optimizer")}

    @property
    def plans(self) -> dict[str, BufferPlan]:
        return {k: self.graphs[k].plan for k in ("forward", "training", "optimizer")}

    @property
    def passes(self) -> list[dict[str, Any]]:
        return self.log.records

    def planned_bytes(self) -> int:
        """What a Program of this compile allocates (`titanc.fit.planned_bytes`)."""
        return planned_bytes(self)

    def model_flops(self) -> int:
        """FLOPs of one optimizer step as the model defines them, for MFU: the forward and
        its backward with nothing recomputed (the training row differentiated with
        `Policy("save_all")`, counted per node before fusion), per micro-batch times
        `train.grad_accum`, plus the optimizer's. The kernels' own FLOPs (`Kernel.flops`)
        also count what `train.remat` recomputes: hardware FLOPs (HFU), more by as much as
        the recompute (tiny.yaml per_layer 2.77 GFLOP a step executed, 1.83 here)."""
        g = self.graph("forward").graph
        for step in PIPELINE["training"]:
            if step.name == "autodiff":
                g = Autodiff(tuple(p.name for p in self.params), Policy("save_all"))(g)
            elif step.test(self):
                g = step.make(self)(g)
        optimizer = sum(k.flops for k in self.graph("optimizer").schedule.kernels)
        return self.spec.train.grad_accum * graph_flops(g) + optimizer

    def graph(self, kind: str, n: int = 1) -> CompiledGraph:
        """The compiled graph of `kind` at this batch (`n`: new tokens of a decode step),
        built through the pipeline on first use."""
        key = kind if kind in ("forward", "training", "optimizer") else (kind, n)
        if key not in self.graphs:
            self.graphs[key] = self._compile(kind, n)
        return self.graphs[key]

    def _compile(self, kind: str, n: int) -> CompiledGraph:
        """Run `kind`'s row of `PIPELINE`: lower (the training graph starts from the compiled
        forward), the row's graph passes whose condition holds, then `_finish`."""
        if kind not in PIPELINE:
            raise ValueError(f"unknown graph kind {kind!r}; one of {GRAPH_KINDS}")
        log, start = self.log, len(self.log.records)
        if kind == "training":
            g = self.graph("forward").graph
            # what scans save for the backward: carries only, everything, or a budgeted min-cut
            self.policy = choose_policy(g, self.spec.train)
        else:
            g = log.run("frontend", lambda: LOWER[kind][1](self, n))
        for step in PIPELINE[kind]:
            if step.test(self):
                g = log.apply(step.make(self), g)
        persistent = self._persistent()
        return _finish(log, kind, g, persistent, start, self.spec.compile.hoist_groups,
                       self.spec.compile.hoist_gates, self.spec.compile.sink_reads,
                       self.spec.compile.stack_once, self.spec.compile.views_per_reader)

    def graph_key(self, cg: CompiledGraph) -> str | None:
        """What compiled graph `cg` (one of this compile's) was compiled from, as text: the
        compile cache's key, the compiler's sources and the graph's place. The same in every
        process, unlike a pickle of its plan (one read back from the compile cache pickles
        differently): the key of a plan's precompiled kernels and rendered sources on disk.
        None when `cg` is not one of this compile's graphs."""
        place = next((k for k, g in self.graphs.items() if g is cg), None)
        if place is None:
            return None
        return (f"{compile_cache.compile_key(self.spec, self.batch, self.patterns)}"
                f"|{compile_cache.source_fingerprint()}|{place}")

    def for_batch(self, batch: int) -> "Compiled":
        """The same spec at another batch size; its graphs compile on first use."""
        return Compiled(self.spec, batch, self.params, PassLog(verify_each=False),
                        patterns=self.patterns)

    def _persistent(self) -> set[str]:
        """Names bound to the caller's tensors rather than planned in the arena: parameters
        and their gradients, the optimizer's inputs and outputs, and the loss (a decoder's
        per-layer `state.*` inputs are added per graph, in `_finish`)."""
        names = {p.name for p in self.params} | {"loss", "lr", "step", "grad_scale", "grad_norm"}
        return names | {f"{k}.{p.name}" for p in self.params
                        for k in ("grad", "param", "opt.m", "opt.v")}


# the graph passes every kind goes through after lowering: fold and simplify, weighted
# outer-product sums -> contractions, attention chains -> the flash-attention pattern op (before
# autodiff, so the backward is the op's VJP and no [B, H, Tq, Tk] tensor exists either way)
SHARED: tuple[Pass, ...] = (Canonicalize(), Aggregate(), FlashAttention())


@dataclass(frozen=True)
class Step:
    """One graph pass of a row of `PIPELINE`: `make` builds it from the `Compiled` (its
    options come from the spec), run where `test` holds (`when` says so in words)."""
    name: str                                   # the pass's `name` (its pass-log record)
    make: Callable[["Compiled"], Pass]
    when: str = ""
    test: Callable[["Compiled"], bool] = lambda c: True


def _mixed(c: "Compiled") -> bool:
    return c.spec.train.mixed_precision


# fold and simplify, weighted outer-product sums -> contractions, attention chains -> the
# flash-attention pattern op (before autodiff: the backward is the op's VJP)
_SHARED = (Step("canonicalize", lambda c: Canonicalize()),
           Step("aggregate", lambda c: Aggregate()),
           Step("flash_attention", lambda c: FlashAttention(), "patterns", lambda c: c.patterns))
# train.dtype bfloat16: the precision policy last (after the passes that match float32
# patterns), then a cleanup; not the optimizer; the training graph inherits the forward's casts
_MIXED = (Step("mixed_precision", lambda c: MixedPrecision(), "train.dtype bfloat16", _mixed),
          Step("canonicalize", lambda c: Canonicalize(), "train.dtype bfloat16", _mixed))
# a scan's bf16 casts of its weights run before it, where its matmuls take many rows: of
# its xs slices before autodiff; of its consts too where no autodiff follows (a MAC segment
# scan's weights)
def _hoist_casts(consts: bool) -> Step:
    return Step("hoist_casts", lambda c: HoistCasts(consts),
                f"train.dtype bfloat16, >= {HOIST_TOKENS} tokens a micro-batch"
                + (", consts too" if consts else ""),
                lambda c: _mixed(c) and c.batch * c.spec.model.seq_len >= HOIST_TOKENS)


_HOIST_CASTS, _HOIST_ALL_CASTS = _hoist_casts(False), _hoist_casts(True)

# how each kind's graph is made: the frontend's lowering (or the optimizer's graph)
LOWER: dict[str, tuple[str, Callable[["Compiled", int], Graph]]] = {
    "forward": ("model.frontend.lower_forward", lambda c, n: lower_forward(c.spec, c.batch)),
    "training": ("autodiff of the compiled forward", lambda c, n: c.graph("forward").graph),
    "optimizer": ("passes.optimizer.optimizer_graph", lambda c, n: optimizer_graph(
        c.params, c.spec.train, dtype_name(c.spec.train.master_dtype))),
    "logits": ("model.frontend.lower_forward(output=logits)",
               lambda c, n: lower_forward(c.spec, c.batch, output="logits")),
    "logprobs": ("model.frontend.lower_forward(output=logprobs)",
                 lambda c, n: lower_forward(c.spec, c.batch, output="logprobs")),
    "decode_step": ("model.decode.lower_step", lambda c, n: lower_step(c.spec, c.batch, n)),
    "decode_write": ("model.decode.lower_write", lambda c, n: lower_write(c.spec, c.batch)),
}

# The graph passes of each kind, in order (`titanc inspect --pipeline` prints this table, and
# docs/architecture.md's diagram is that print). After them every kind goes through `BACKEND`.
PIPELINE: dict[str, tuple[Step, ...]] = {
    # the direct program (per-token outer products, layers and memory chunks as scans), the
    # shared passes, then LM head + cross-entropy as one fused pattern op (the [B·T, V] logits
    # never exist; the chunked-loss scan where the pattern refuses) and the memory state saved
    # every k ≈ sqrt(n) chunks (the residual stream every train.remat_group layers)
    "forward": (*_SHARED,
                Step("linear_cross_entropy", lambda c: LinearCrossEntropy(c.spec.train.loss_chunk),
                     "compile.fused_loss and patterns",
                     lambda c: c.spec.compile.fused_loss and c.patterns),
                Step("chunked_loss", lambda c: ChunkedLoss(c.spec.train.loss_chunk)),
                Step("checkpoint_chunks", lambda c: CheckpointChunks(
                    c.spec.train.remat_group, c.spec.compile.chunk_groups),
                     "train.remat != none", lambda c: c.spec.train.remat != "none"),
                *_MIXED, _HOIST_CASTS),
    # forward + backward (scans recompute what the policy does not save), then the shared
    # passes again: aggregate catches any weighted outer-product sum the backward exposes
    "training": (Step("autodiff", lambda c: Autodiff(tuple(p.name for p in c.params), c.policy)),
                 *_SHARED, _HOIST_ALL_CASTS),
    # clipping + AdamW over the flat parameter set, recognised as one multi-tensor ADAMW op
    "optimizer": (*_SHARED,
                  Step("fused_adamw", lambda c: FusedAdamW(
                      tuple(p.decay for p in c.params), tuple(c.spec.train.betas),
                      c.spec.train.weight_decay, c.spec.train.grad_clip, SHARED),
                       "patterns", lambda c: c.patterns)),
    "logits": (*_SHARED, *_MIXED, _HOIST_ALL_CASTS),
    "logprobs": (*_SHARED, *_MIXED, _HOIST_ALL_CASTS),
    "decode_step": (*_SHARED, *_MIXED),
    "decode_write": (*_SHARED, *_MIXED),
}
# what every kind's graph goes through after its row: a chunk recurrence's carry-independent
# work hoisted before its scan, a cast of an input read by several
# kernels copied per reader, composed constants (RoPE's [cos ‖ cos]) copied per reader, a
# view one kernel would write for another copied into its readers, then fusion into kernels, the kernels in waves of independent ones (passes/waves.py: launch
# groups), the schedule's verifier and the buffer plan
BACKEND = ("hoist_scan_invariants", "split_casts", "constants_per_reader", "views_per_reader",
           "fusion", "waves", "verify_schedule", "buffer plan")


def pipeline_text() -> str:
    """The pipeline as text: per kind, its lowering and its passes ([condition])."""
    lines = []
    for kind, steps in PIPELINE.items():
        lines.append(f"{kind}: {LOWER[kind][0]}")
        row = "   "
        for s in steps:
            piece = f" → {s.name}" + (f" [{s.when}]" if s.when else "")
            if len(row) + len(piece) > 92:
                lines.append(row)
                row = "   "
            row += piece
        lines.append(row)
    lines.append("every kind, after its row:")
    row = "   "
    for step in BACKEND:
        if len(row) + len(step) + 3 > 92:
            lines.append(row)
            row = "   "
        row += f" → {step}"
    lines.append(row)
    return "\n".join(lines) + "\n"


def _finish(log: PassLog, kind: str, g: Graph, persistent: set[str], start: int,
            hoist_groups: bool = False, hoist_gates: bool = False,
            sink_reads: str = "auto", stack_once: bool = True,
            views_per_reader: bool = True) -> CompiledGraph:
    # a chunk recurrence's carry-independent work (its backward's forward recompute) runs
    # once over every chunk before the scan, not in its serial loop (with
    # compile.hoist_groups, a chunk group's recompute scan too, over every group; with
    # compile.hoist_gates, a forward chunk scan's gates too), and its reads at each chunk's
    # start state once over every chunk after it (compile.sink_reads); a value any scan
    # stacks for two users is stacked once (compile.stack_once)
    sink = {"auto": SINK_MIN_STATE, "always": 0, "never": None}[sink_reads]
    g = log.apply(HoistScanInvariants(nested=hoist_groups, gates=hoist_gates, sink=sink,
                                      once=stack_once), g)
    # a cast of an input read by several kernels: one copy per reader, which fusion loads cast
    # (mixed precision's parameter casts launch nothing of their own)
    g = log.apply(SplitCasts(), g)
    # composed constants (RoPE's [cos ‖ cos]) copied per reader: computed in each reader's
    # kernel rather than stored by a kernel of their own; last, as it undoes their CSE
    g = log.apply(ConstantsPerReader(), g)
    # a view of a stored value copied per reader: each reader's kernel loads the value through
    # its own copy, and no kernel writes the view for another (compile.views_per_reader)
    if views_per_reader:
        g = log.apply(ViewsPerReader(), g)
    schedule = _timed(log, f"fusion_{kind}", lambda: verify_schedule(in_waves(fuse(g))))
    persistent = persistent | {n for n in g.input_names() if n.startswith("state.")}
    plan = _timed(log, f"memory_plan_{kind}", lambda: plan_buffers(schedule, persistent))
    return CompiledGraph(kind, g, schedule, plan, log.records[start:])


def compile_graphs(spec: Spec, batch: int | None = None, verify_each: bool = True,
                   patterns: bool = True, dumps: bool = True) -> Compiled:
    """Lower `spec` and compile its training graphs (forward, training, optimizer); the other
    kinds compile on first use. Allocates no model-sized tensors. `patterns=False` leaves the
    pattern passes out (flash attention, fused AdamW): the 'before' of `titanc.tools.cost_model`.
    `dumps=False` keeps no graph per pass (`log.dumps` empty: a program that only runs); such a
    compile is read from the on-disk cache when an earlier process made it
    (titanc/compile_cache.py), and every compile is written there."""
    key = compile_cache.compile_key(spec, batch, patterns)
    if compile_cache.enabled(dumps):
        hit = compile_cache.load(key, verify_each)
        if hit is not None:
            log = dataclasses.replace(hit.log, verify_each=verify_each, keep_dumps=False)
            return dataclasses.replace(hit, spec=spec, log=log)
    c = Compiled(spec, batch or spec.train.batch_size, param_specs(spec.model),
                 PassLog(verify_each=verify_each, keep_dumps=dumps), patterns=patterns)
    for kind in ("forward", "training", "optimizer"):
        c.graph(kind)
    if compile_cache.enabled(False):
        compile_cache.store(key, c, verify_each)
    return c


def _timed(log: PassLog, name: str, fn: Any) -> Any:
    """Run a non-graph step (fusion, planning) and record its time with the passes."""
    t0 = time.perf_counter()
    out = fn()
    log.records.append({"name": name, "seconds": time.perf_counter() - t0})
    return out


def launches_per_step(c: Compiled, target: str = "cpu",
                      fallbacks: list[dict[str, str]] | None = None,
                      carries: list[dict] | None = None) -> dict[str, int]:
    """Kernel launches on `target` ("cpu" or "triton") of a training step (grad_accum
    backward passes + one optimizer update), a decode step (one token, batch 1) and the
    memory write a decode makes once per completed chunk. On the cpu target every scan is a
    host loop over its body's kernels; on triton a scan that renders to one scan kernel is
    one launch and so is a launch group (`codegen.scan.kernel.count_launches`); the scans it cannot render, and why,
    are appended to `fallbacks`, and where each scan kernel keeps its carries to `carries`
    (`codegen.scan.kernel.ScanKernel.carries`)."""
    if target == "triton":
        from titanc.codegen.scan.kernel import count_launches

        def count(plan: BufferPlan) -> int:
            return count_launches(plan, fallbacks=fallbacks, carries=carries)
    else:
        count = BufferPlan.launches  # type: ignore[assignment]
    spec = c.spec
    counts = {"training": spec.train.grad_accum * count(c.plans["training"])
              + count(c.plans["optimizer"])}
    one = c if c.batch == 1 else c.for_batch(1)
    counts["decode"] = count(one.graph("decode_step").plan)
    if spec.model.has_memory:
        counts["decode_write_per_chunk"] = count(one.graph("decode_write").plan)
    return counts
