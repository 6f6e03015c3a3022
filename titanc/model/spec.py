"""The model spec: a YAML file read into typed, frozen, validated dataclasses.

    spec = load_spec("examples/tiny.yaml", {"model.d_model": 128})
    spec.model.head_dim, spec.safe_name, spec_hash(spec), spec_to_dict(spec)

This module is the schema: the sections of a spec (model, train, data, compile), each field's
type, default and bounds (`bounded(ge=..., most=...)`), and the rules across fields
(`ModelSpec._check_shapes`, `TrainSpec.__post_init__`). Reading YAML, checking each field,
`--set` overrides and the one-line messages are the engine's, `titanc/model/spec_engine.py`,
bound to this tree as `SCHEMA`.

Every failure is a `SpecError` whose one-line message names the dotted field and the fix:
`model.memory.chunk_size: 48 must divide model.seq_len=128`.

`name` is data: any string is valid and nothing downstream may evaluate it. Code that needs an
identifier or a file name uses `Spec.safe_name`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import keyword
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from titanc.bounds import (BATCHES, BATCH_SIZE, CONV_TAPS, EVERY, EXPANSION, FFN_WIDTH,
                           GRAD_ACCUM, HEADS, LAYERS, LOSS_CHUNK, MEGABYTES, MEMORY_DEPTH,
                           PERSISTENT, SECONDS, SPEC_FLOAT_MAX, STEPS, TOKENS, TRAIN_SEED,
                           VOCAB_SIZE, WIDTH)
from titanc.errors import SpecError
from titanc.model.spec_engine import (F32_MAX, Schema, bounded, not_in_file, plain, read_yaml,
                                      section)

__all__ = [
    "AttentionSpec", "MemorySpec", "ModelSpec", "TrainSpec", "DataSpec", "CompileSpec", "Spec",
    "BLOCK_KINDS", "BLOCKS", "BlockKind", "DTYPES", "GATES", "REMAT_POLICIES", "TARGETS", "SCHEMA",
    "load_spec", "spec_to_dict", "spec_hash", "parse_set_args", "leaf_paths",
]


@dataclass(frozen=True)
class BlockKind:
    """What a block kind is made of (docs/semantics.md "Blocks"): parameters, the frontend,
    decoding and serving consult this instead of comparing kind names. How a kind composes its
    parts is `titanc.model.blocks.block`."""
    memory: bool      # a neural long-term memory: mem_* parameters, (W, S) state, chunk writes
    window: bool      # sliding-window attention: attn_* parameters, a KV ring of `window` keys
    segment: bool     # memory as context: attention over [persistent ‖ memory read ‖ segment]

    @property
    def attention(self) -> bool:
        return self.window or self.segment


BLOCK_KINDS: dict[str, BlockKind] = {
    "lmm": BlockKind(memory=True, window=False, segment=False),
    "mac": BlockKind(memory=True, window=False, segment=True),
    "mag": BlockKind(memory=True, window=True, segment=False),
    "mal": BlockKind(memory=True, window=True, segment=False),
    "attn": BlockKind(memory=False, window=True, segment=False),
}
BLOCKS = tuple(BLOCK_KINDS)
DTYPES = ("float32", "float64", "bfloat16")      # bfloat16: mixed precision, float32 masters
GATES = ("theta", "eta", "alpha")                # the write's gates (memory.fixed)
REMAT_POLICIES = ("none", "per_layer", "per_segment", "budget")
TARGETS = ("auto", "cpu", "triton", "reference")


# ---------------------------------------------------------------------------------- schema


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionSpec:
    heads: int = bounded(4, ge=1, most=HEADS.hi)
    window: int = bounded(64, ge=1, most=TOKENS.hi)  # sliding window W (attn, mag, mal)
    segment: int = bounded(32, ge=1, most=TOKENS.hi)  # segment length S (mac)
    # P learned tokens every query attends to
    persistent_tokens: int = bounded(4, ge=0, most=PERSISTENT.hi)

    def __post_init__(self) -> None:
        SCHEMA.check(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySpec:
    heads: int = bounded(2, ge=1, most=HEADS.hi)
    depth: int = bounded(2, ge=1, most=MEMORY_DEPTH.hi)  # layers of the memory MLP
    # hidden width = expansion * head dim
    expansion: int = bounded(2, ge=1, most=EXPANSION.hi)
    # b; 1 = exact token-by-token memory
    chunk_size: int = bounded(16, ge=1, most=TOKENS.hi)
    adaptive: bool = True                        # data-dependent theta/eta/alpha, else constants
    # theta_max (or the constant theta)
    lr_max: float = bounded(0.01, gt=0, most=SPEC_FLOAT_MAX)
    momentum: float = bounded(0.9, gt=0, lt=1)    # constant eta when not adaptive
    decay: float = bounded(0.01, ge=0, lt=1)      # constant alpha when not adaptive, else
    #                                              alpha's starting value
    decay_max: float = bounded(1.0, gt=0, le=1)   # top of the adaptive alpha's range
    output_gate: bool = True
    conv_kernel: int = bounded(4, ge=1, most=CONV_TAPS.hi)
    # activation of the q/k streams before l2norm: silu (the paper) or none (zero-mean keys)
    qk_activation: str = bounded("silu", choices=("silu", "none"))
    # the momentum of the write: heavy_ball (the paper, S_t = η S_{t-1} - θ g_t) or ema
    # (S_t = η S_{t-1} - (1 - η) θ g_t: θ is the step at any η, and the chunked write
    # contracts for every gate value while lr_max <= d / chunk_size; docs/semantics.md)
    # or none: no momentum state, W_t = (1 - α_t) W_{t-1} - θ_t g_t (DeltaNet's write)
    momentum_form: str = bounded("heavy_ball", choices=("heavy_ball", "ema", "none"))
    # block mac only (docs/semantics.md, "mac"): what the memory is written with, the attention
    # output ỹ (the paper), ỹ normalised, rmsnorm(ỹ, mac_norm) (attention_norm), or the
    # segment's normalised input u_s (input); and where the segment-start read h goes, only
    # into the attention as context (the paper) or also onto the block's output (residual)
    mac_write: str = bounded("attention", choices=("attention", "attention_norm", "input"))
    mac_read: str = bounded("context", choices=("context", "residual"))
    # blocks mac and mag: which branch of the paper's y ⊗ M is the sigmoid gate, the memory's
    # read gating the attention output (memory) or the attention output gating the read
    gate: str = bounded("memory", choices=("memory", "attention"))
    # the memory family (docs/semantics.md, "Memory family"): each default is the paper's
    # with adaptive: the gates held at their constants (theta lr_max, eta momentum, alpha
    # decay) while the others are learned, e.g. [alpha] for DeltaNet's θ-only adaptivity
    fixed: tuple[str, ...] = bounded((), choices=GATES)
    # which state a token reads: the start of its chunk (before_write) or the state after
    # its own write (after_write, DeltaNet's read; chunk_size 1)
    read: str = bounded("before_write", choices=("before_write", "after_write"))
    # when the decay applies: after the gradient, which is taken at W_{t-1} (after_grad, the
    # paper), or before it, the gradient at (1 - α_t) W_{t-1} (before_grad: Gated DeltaNet;
    # chunk_size 1)
    decay_order: str = bounded("after_grad", choices=("after_grad", "before_grad"))
    # the adaptive α: sigmoid (α = decay_max σ(x)) or mamba2 (α = 1 - exp(-e^A softplus(x)),
    # A = mem_alpha_a a learned per-head parameter)
    decay_form: str = bounded("sigmoid", choices=("sigmoid", "mamba2"))
    # per-head width of v and of the read (null: the key width d = d_model / heads); not mac
    value_width: int | None = bounded(None, ge=1, most=WIDTH.hi)
    # the inner objective each write descends, mean over channels of ρ(M(k) - v)
    # (docs/semantics.md, "Inner objective"; titanc/model/objective.py): l2 (the paper, r²),
    # huber (r² within huber_delta, linear beyond) or lp ((r² + 1e-6)^(lp_p/2), MIRAS's ℓp);
    # the compiler derives its gradient
    objective: str = bounded("l2", choices=("l2", "huber", "lp"))
    huber_delta: float | None = bounded(None, gt=0, most=SPEC_FLOAT_MAX)   # huber; null: 1
    lp_p: float | None = bounded(None, ge=1, le=8)                         # lp; null: 3
    # the model each write fits: the MLP M(x) = W_L φ(… W_1 x) (mlp, the paper), or fla's
    # Titans x + w ⊙ LN(W x) + b with w, b learned per head (ln_residual: depth 1, values of
    # the key width, not mac); the read stays W q
    inner: str = bounded("mlp", choices=("mlp", "ln_residual"))
    # the read y becomes y + w ⊙ LN(y) + b, with the inner model's w, b (fla's Titans output
    # norm; inner ln_residual)
    post_norm: bool = False

    @property
    def linear(self) -> bool:
        """A depth-1 memory without momentum under the l2 objective, its inner model W x: its
        chunked write is exact (the WY form, `neural_memory.chunk_update_linear`), so
        chunk_size is a speed knob and the model is the token-by-token memory at every chunk
        size."""
        return (self.depth == 1 and self.momentum_form == "none" and self.objective == "l2"
                and self.inner == "mlp")

    @property
    def write_chunk(self) -> int:
        """Tokens per decoding write: chunk_size, or 1 for a linear memory (a token reads the
        writes of its own chunk's earlier tokens)."""
        return 1 if self.linear else self.chunk_size

    def __post_init__(self) -> None:
        SCHEMA.check(self)
        for key, owner in (("huber_delta", "huber"), ("lp_p", "lp")):
            if getattr(self, key) is not None and self.objective != owner:
                raise SpecError(f"model.memory.{key}: {getattr(self, key)} applies to "
                                f"model.memory.objective: {owner} only (it is "
                                f"{self.objective}); remove it or set objective: {owner}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    vocab_size: int = bounded(256, ge=1, most=VOCAB_SIZE.hi)
    d_model: int = bounded(ge=1, most=WIDTH.hi)
    n_layers: int = bounded(ge=1, most=LAYERS.hi)
    block: str = bounded(choices=BLOCKS)
    # at most 2**20 tokens (bounds.TOKENS: a sequence's tokens everywhere); past it the
    # compile's per-chunk work runs for hours before the memory check could refuse it
    seq_len: int = bounded(ge=1, most=TOKENS.hi)
    tie_embeddings: bool = True
    # None: the multiple of 8 nearest 8/3 * d_model
    ffn_hidden: int | None = bounded(None, ge=1, most=FFN_WIDTH.hi)
    attention: AttentionSpec = section(AttentionSpec)
    memory: MemorySpec = section(MemorySpec)

    def __post_init__(self) -> None:
        SCHEMA.check(self)
        self._check_shapes()

    @property
    def ffn(self) -> int:
        """SwiGLU hidden width F."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return max(8, 8 * round(self.d_model / 3))  # nearest multiple of 8 to 8/3 * d_model

    @property
    def kind(self) -> BlockKind:
        """What this block kind is made of."""
        return BLOCK_KINDS[self.block]

    @property
    def has_memory(self) -> bool:
        return self.kind.memory

    @property
    def has_attention(self) -> bool:
        return self.kind.attention

    @property
    def head_dim(self) -> int:
        """Attention head width d_model / attention.heads."""
        return self.d_model // self.attention.heads

    @property
    def mem_head_dim(self) -> int:
        """Memory head width d = d_model / memory.heads."""
        return self.d_model // self.memory.heads

    def _check_shapes(self) -> None:
        d, t, att, mem = self.d_model, self.seq_len, self.attention, self.memory
        if self.has_attention:
            if d % att.heads:
                raise SpecError(f"model.attention.heads: {att.heads} must divide model.d_model={d}")
            if (d // att.heads) % 2:
                raise SpecError(
                    f"model.attention.heads: {att.heads} gives head dim {d}/{att.heads}="
                    f"{d // att.heads}, which must be even for RoPE; choose heads so that "
                    f"d_model/heads is even")
        if self.has_memory and d % mem.heads:
            raise SpecError(f"model.memory.heads: {mem.heads} must divide model.d_model={d}")
        if self.block == "mac":
            if t % att.segment:
                raise SpecError(
                    f"model.attention.segment: {att.segment} must divide model.seq_len={t} "
                    f"(block mac)")
            if att.segment % mem.chunk_size:
                raise SpecError(
                    f"model.memory.chunk_size: {mem.chunk_size} must divide "
                    f"model.attention.segment={att.segment} (block mac)")
        elif self.has_memory and t % mem.chunk_size:
            raise SpecError(
                f"model.memory.chunk_size: {mem.chunk_size} must divide model.seq_len={t}")
        if mem.adaptive and max(mem.decay, 1e-4) >= mem.decay_max:
            raise SpecError(f"model.memory.decay: {mem.decay} must be below "
                            f"model.memory.decay_max={mem.decay_max} (the adaptive decay "
                            f"starts at memory.decay inside (0, decay_max))")
        self._check_memory_family()
        for key, default, owner in (("mac_write", "attention", "mac"),
                                    ("mac_read", "context", "mac"), ("gate", "memory", "mac mag")):
            if self.block not in owner.split() and getattr(mem, key) != default:
                raise SpecError(f"model.memory.{key}: {getattr(mem, key)} applies to block "
                                f"{owner.replace(' ', ' and ')} only (this model's block is "
                                f"{self.block}); remove it")

    def _check_memory_family(self) -> None:
        """The knobs that make DeltaNet, Gated DeltaNet and their kin special cases
        (docs/semantics.md, "Memory family")."""
        mem = self.memory
        if not self.has_memory:
            return
        if len(set(mem.fixed)) != len(mem.fixed):
            raise SpecError(f"model.memory.fixed: {list(mem.fixed)} names a gate twice")
        if mem.fixed and not mem.adaptive:
            raise SpecError("model.memory.fixed: every gate is fixed with memory.adaptive: "
                            "false; remove memory.fixed or set memory.adaptive: true")
        if mem.momentum_form == "none" and "eta" in mem.fixed:
            raise SpecError("model.memory.fixed: eta does not exist with memory.momentum_form: "
                            "none (no momentum); remove it")
        for key, value in (("read", "after_write"), ("decay_order", "before_grad")):
            if getattr(mem, key) == value and mem.chunk_size != 1 and not mem.linear:
                raise SpecError(f"model.memory.{key}: {value} needs model.memory.chunk_size: 1 "
                                f"(is {mem.chunk_size}) unless the memory is linear (depth 1, "
                                f"momentum_form none, objective l2: its chunks are exact)")
        if mem.decay_form == "mamba2" and (not mem.adaptive or "alpha" in mem.fixed):
            raise SpecError("model.memory.decay_form: mamba2 parameterises a learned α; it "
                            "needs memory.adaptive: true and alpha not in memory.fixed")
        if mem.decay_form == "mamba2" and mem.decay_max < 1.0:
            raise SpecError(f"model.memory.decay_max: {mem.decay_max} applies to decay_form "
                            f"sigmoid only; remove it or use decay_form: sigmoid")
        if mem.inner == "ln_residual" and (mem.depth != 1 or self.block == "mac"
                                           or self.mem_value_dim != self.mem_head_dim):
            raise SpecError(f"model.memory.inner: ln_residual (x + w ⊙ LN(W x) + b) needs "
                            f"memory.depth: 1, values of the key width and block lmm, mag or "
                            f"mal (is depth {mem.depth}, value width {self.mem_value_dim}, key "
                            f"width {self.mem_head_dim}, block {self.block})")
        if mem.post_norm and mem.inner != "ln_residual":
            raise SpecError("model.memory.post_norm: true uses the inner model's w, b; it "
                            "needs model.memory.inner: ln_residual")
        if mem.value_width is not None and self.block == "mac":
            raise SpecError(f"model.memory.value_width: {mem.value_width} applies to blocks "
                            f"lmm, mag and mal (mac gates the attention with the read, width "
                            f"d_model); remove it")

    @property
    def mem_value_dim(self) -> int:
        """Per-head width of the memory's values and read: memory.value_width or d."""
        return self.memory.value_width or self.mem_head_dim


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    batch_size: int = bounded(8, ge=1, most=BATCH_SIZE.hi)
    steps: int = bounded(200, ge=1, most=STEPS.hi)
    lr: float = bounded(3e-3, gt=0, most=SPEC_FLOAT_MAX)
    warmup: int = bounded(20, ge=0, most=STEPS.hi)
    weight_decay: float = bounded(0.1, ge=0, most=SPEC_FLOAT_MAX)
    betas: tuple[float, float] = bounded((0.9, 0.95), ge=0, lt=1)
    grad_clip: float = bounded(1.0, ge=0, most=SPEC_FLOAT_MAX)  # global-norm clip; 0 disables
    seed: int = bounded(0, ge=0, most=TRAIN_SEED.hi)  # the loaders add the split to it
    dtype: str = bounded("float32", choices=DTYPES)
    remat: str = bounded("per_layer", choices=REMAT_POLICIES)
    # required when remat is budget
    remat_budget_mb: float | None = bounded(None, gt=0, most=MEGABYTES)
    # per_segment, block mac: sequences per group of the MAC scans (0: the fewest whose
    # segment [rows, S, D] reaches 1 MiB in float32, blocks.ROW_GROUP_BYTES)
    remat_rows: int = bounded(0, ge=0, most=BATCH_SIZE.hi)
    # per_layer / per_segment: layers per checkpoint group; the residual stream is saved every
    # `remat_group` layers and the backward re-runs a group's layers (n_layers/k + k
    # checkpoints live instead of n_layers; 1: every layer)
    remat_group: int = bounded(1, ge=1, most=LAYERS.hi)
    # tokens per LM-head chunk; 0 = unchunked
    loss_chunk: int = bounded(1024, ge=0, most=LOSS_CHUNK.hi)
    # micro-batches per optimizer step
    grad_accum: int = bounded(1, ge=1, most=GRAD_ACCUM.hi)
    # steps between evaluations; 0 = never
    eval_every: int = bounded(50, ge=0, most=EVERY.hi)
    eval_batches: int = bounded(4, ge=1, most=BATCHES.hi)
    # steps between checkpoints; 0 = only at the end
    checkpoint_every: int = bounded(100, ge=0, most=EVERY.hi)
    # steps between metrics lines (loss, grad norm: the only reads from the device)
    log_every: int = bounded(1, ge=1, most=EVERY.hi)
    # gradient all-reduce bucket size (distributed)
    bucket_mb: float = bounded(25.0, gt=0, most=MEGABYTES)
    zero: int = bounded(0, ge=0)                  # 1 = ZeRO-1: shard AdamW state over ranks
    # a collective waiting longer fails the job
    dist_timeout_s: float = bounded(300.0, gt=0, most=SECONDS)
    # steps between memory diagnostics in metrics.jsonl (runtime/diagnostics/neural_memory.py); 0 = never
    memory_stats_every: int = bounded(0, ge=0, most=EVERY.hi)
    # also write the metrics as TensorBoard scalars under DIR/<run directory name>
    # (titanc/integrations/tensorboard.py); null = none
    tensorboard: str | None = None

    @property
    def master_dtype(self) -> str:
        """The dtype of parameters, gradients, optimizer state, graph inputs and outputs:
        `dtype`, except that bfloat16 (mixed precision) keeps float32 master copies and the
        compiler's precision pass (passes/precision.py) decides what runs in bfloat16."""
        return "float32" if self.dtype == "bfloat16" else self.dtype

    @property
    def mixed_precision(self) -> bool:
        return self.dtype == "bfloat16"

    def __post_init__(self) -> None:
        SCHEMA.check(self)
        if self.master_dtype == "float32":  # these become float32 scalars of the training graph
            for name in ("lr", "weight_decay", "grad_clip"):
                if getattr(self, name) > F32_MAX:
                    raise SpecError(f"train.{name}: {getattr(self, name):g} overflows float32 "
                                    f"(largest {F32_MAX:.4g}); use a smaller value")
        if self.tensorboard is not None and not self.tensorboard.strip():
            raise SpecError("train.tensorboard: must not be empty; name a directory (e.g. "
                            "--set train.tensorboard=tb) or use null for none")
        if self.zero not in (0, 1):
            raise SpecError(f"train.zero: {self.zero} must be 0 (all-reduce) or 1 (ZeRO-1 "
                            f"optimizer sharding); e.g. --set train.zero=1")
        if self.remat == "budget" and self.remat_budget_mb is None:
            raise SpecError(
                "train.remat_budget_mb: required when train.remat is 'budget'; "
                "set it, e.g. --set train.remat_budget_mb=512")
        if self.remat_group > 1 and self.remat not in ("per_layer", "per_segment"):
            raise SpecError(
                f"train.remat_group: {self.remat_group} needs train.remat per_layer or "
                f"per_segment (is {self.remat}); set train.remat_group=1 or change train.remat")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    source: str = "synthetic:recall"             # a UTF-8 text file or a token-shard directory
    val_fraction: float = bounded(0.1, ge=0, lt=1)
    tokenizer: str = "byte"                      # or a tokenizer.json ('titanc tokenizer train')
    # honour document boundaries (docs/data.md "Documents"): the loader yields each token's
    # document start and the compiled program resets memory, conv history and attention there
    documents: bool = False
    # with documents: true, rows are windows of the packed stream (a row spans documents);
    # false: one document per row from its start, padded, the padding masked out of the loss
    pack: bool = True
    # which targets the training loss counts: every next token (all), or the synthetic recall
    # task's queried values alone (queries: the loader's loss mask; docs/data.md)
    loss: str = bounded("all", choices=("all", "queries"))

    def __post_init__(self) -> None:
        SCHEMA.check(self)
        if self.loss == "queries" and (self.source != "synthetic:recall" or self.documents):
            raise SpecError("data.loss: queries counts the synthetic recall task's queried "
                            "values; use it with data.source synthetic:recall and "
                            "data.documents false, or set data.loss=all")
        if not self.pack and not self.documents:
            raise SpecError("data.pack: false puts one document per row and needs document "
                            "boundaries; set data.documents=true or data.pack=true")
        if not self.source.strip():
            raise SpecError(
                "data.source: must not be empty; use synthetic:recall or a path to a text file")
        if not self.tokenizer.strip():
            raise SpecError("data.tokenizer: must not be empty; use byte or a path to a "
                            "tokenizer.json")


@dataclass(frozen=True, kw_only=True, slots=True)
class CompileSpec:
    target: str = bounded("auto", choices=TARGETS)
    # capture each graph's run into a CUDA graph and replay it (every address is fixed by
    # the buffer plan); None: on whenever the triton target runs on a CUDA device
    cuda_graphs: bool | None = None
    # float32 matmuls on tensor cores in tf32 (10-bit mantissa, ~1e-3 relative error per
    # product) on a GPU; off by default so float32 stays exact against the cpu target
    allow_tf32: bool = False
    # the LM head + cross-entropy as one fused pattern op whose kernels compute the logits a
    # tile at a time (passes/linear_cross_entropy.py); false: the chunked-loss scan of
    # generic kernels (a [loss_chunk, vocab] logits buffer)
    fused_loss: bool = True
    # the memory's chunk groups (train.remat): their backward's forward recompute hoisted out
    # of the group loop and run for every group at once (one scan kernel over groups x batch
    # x memory heads), for the activations of every group at once (passes/hoist.py;
    # large_125m's training arena 3.61 -> 4.13 GiB, tiny_lmm's 15.5 -> 24.7 MB)
    hoist_groups: bool = False
    # every memory chunk's state saved for the backward, which recomputes no chunk; true: the
    # chunk scans of >= 8 chunks checkpointed in groups of about sqrt(n) chunks, each group's
    # chunks recomputed in its backward (passes/checkpoint_chunks.py), for less memory where a
    # scan holds many chunks (large_125m bf16 with groups: training arena 2,085 -> 1,954 MiB
    # for +1.9 TFLOP and +6,624 triton launches a step; tiny_lmm bf16 12.3 -> 8.6 MiB, 80 ->
    # 68 launches: a group's scan kernel holds its chunks' recompute)
    chunk_groups: bool = False
    # a memory scan's carry-independent work hoisted before it even where it holds no einsum
    # (passes/hoist.py): the forward chunk scans' gates (their cumulative decay and the
    # weights of each token's gradient), computed for every chunk at once
    hoist_gates: bool = False
    # a forward chunk scan's reads (each chunk's queries through the memory at the chunk's
    # start state) computed after the scan for every chunk at once, from the stacked start
    # states, as batched matmuls over chunks x batch x memory heads, not in its serial loop
    # (passes/hoist.py): auto where a (batch, memory head) slice's state outgrows one
    # program's registers (more than 64K values: the scan runs as a host loop), always, never
    sink_reads: str = bounded("auto", choices=("auto", "always", "never"))
    # a value a scan outside the chunk recurrence stacks for two users stacked once
    # (passes/hoist.py `_stack_once`: a MAC segment's memory state at each segment start, for
    # its backward and its chunks' sunk reads; large_125m bf16: 685 MiB less training arena);
    # false: once per user, the programs the stored GPU calls ran (benchmarks/cost_fit.py)
    stack_once: bool = True
    # a view of a stored value that one kernel would write for another copied into each of
    # its readers (passes/views_per_reader.py: large_125m bf16 131.2 -> 107.3 GB of
    # elementwise traffic a step); false: fusion alone, the programs the stored GPU calls ran
    views_per_reader: bool = True

    def __post_init__(self) -> None:
        SCHEMA.check(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class Spec:
    name: str
    model: ModelSpec
    train: TrainSpec = section(TrainSpec)
    data: DataSpec = section(DataSpec)
    compile: CompileSpec = section(CompileSpec)
    path: str | None = not_in_file()  # the file it was read from

    def __post_init__(self) -> None:
        SCHEMA.check(self)
        mem = self.model.memory
        token_rules = [f"{key}: {value}" for key, value in (
            ("momentum_form", "none"), ("read", "after_write"), ("decay_order", "before_grad"),
            ("inner", "ln_residual"))
            if getattr(mem, key) == value]
        if self.data.documents and self.model.has_memory and token_rules:
            raise SpecError(f"data.documents: true is not implemented with model.memory."
                            f"{token_rules[0]} (the memory's document resets follow the "
                            f"default write); set data.documents: false")
        k, n = self.train.remat_group, self.model.n_layers
        if k > 1 and n % k:
            raise SpecError(f"train.remat_group: {k} must divide model.n_layers={n}; "
                            f"use a divisor of {n} (1: a checkpoint per layer)")

    @property
    def safe_name(self) -> str:
        """`name` as an identifier: [A-Za-z0-9_], non-empty, no leading digit, not a keyword."""
        ident = re.sub(r"[^A-Za-z0-9]+", "_", self.name).strip("_")[:64].rstrip("_") or "spec"
        if ident[0].isdigit():
            ident = "spec_" + ident
        return ident + "_" if keyword.iskeyword(ident) else ident


SCHEMA = Schema(Spec)


# ------------------------------------------------------------------------------- public API


def load_spec(source: str | os.PathLike | Mapping[str, Any] | Spec,
              overrides: Mapping[str, Any] | None = None) -> Spec:
    """Read and validate a spec.

    `source` is a path to a YAML file, a mapping shaped like the YAML, or a `Spec` (re-validated
    with the overrides applied). `overrides` map dotted paths to values, e.g.
    `{"model.d_model": 128}`, and are applied before validation; values are taken as given (the
    CLI parses `--set` strings with `parse_set_args`). Raises `SpecError` on any problem.
    """
    path: str | None = None
    if isinstance(source, Spec):
        raw, path = spec_to_dict(source), source.path
    elif isinstance(source, Mapping):
        raw = plain(source)
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        raw = read_yaml(path)
    else:
        raise TypeError(
            f"load_spec: expected a path, a mapping or a Spec, got {type(source).__name__}")
    for key, value in (overrides or {}).items():
        SCHEMA.apply_override(raw, key, value)
    return dataclasses.replace(SCHEMA.build(Spec, raw), path=path)


def spec_to_dict(spec: Spec) -> dict[str, Any]:
    """The spec as plain YAML/JSON data (tuples as lists, no `path`); `load_spec` reads it back."""
    return SCHEMA.to_dict(spec)


def spec_hash(spec: Spec) -> str:
    """sha256 hex digest of the canonical JSON of `spec_to_dict(spec)` (the path is excluded)."""
    text = json.dumps(spec_to_dict(spec), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def parse_set_args(items: Iterable[str]) -> dict[str, Any]:
    """Parse CLI `--set KEY=VALUE` strings into an overrides mapping.

    A value is read as YAML (`128` -> int, `[0.9,0.99]` -> list, `null` -> None), except for
    string fields (`name`, `model.block`, `data.source`, ...), which take the text verbatim so
    that `--set name=2024` stays a string. Later items win over earlier ones.
    """
    return SCHEMA.parse_set_args(items)


def leaf_paths() -> dict[str, Any]:
    """Every settable dotted path of the spec (sections excluded) and its type, in order."""
    return SCHEMA.leaves
