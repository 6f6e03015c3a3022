"""The model spec: a YAML file read into typed, frozen, validated dataclasses.

    spec = load_spec("examples/tiny.yaml", {"model.d_model": 128})
    spec.model.head_dim, spec.safe_name, spec_hash(spec), spec_to_dict(spec)

The schema is a tree in which every dataclass appears exactly once, so each one knows its own
dotted prefix (`_PREFIX`) and validates itself in `__post_init__`: a spec built in Python, by
`dataclasses.replace`, or from YAML passes the same checks. Validation, in order:

1. structure (`_build`): unknown keys (with the closest known key as a suggestion), missing
   required fields, sections that are not mappings;
2. each field (`_check_fields`): its type (a bool is not an int; an int is accepted for a float),
   then the bounds declared next to it (`_field(ge=..., gt=..., lt=..., choices=...)`);
3. rules across fields (`ModelSpec._check_shapes`, `TrainSpec.__post_init__`).

Every failure is a `SpecError` whose one-line message names the dotted field and the fix:
`model.memory.chunk_size: 48 must divide model.seq_len=128`.

`name` is data: any string is valid and nothing downstream may evaluate it. Code that needs an
identifier or a file name uses `Spec.safe_name`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import keyword
import math
import os
import re
import reprlib
import stat
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import yaml

from titanc.bounds import (BATCHES, BATCH_SIZE, CONV_TAPS, EVERY, EXPANSION, FFN_WIDTH,
                           GRAD_ACCUM, HEADS, LAYERS, LOSS_CHUNK, MEGABYTES, MEMORY_DEPTH,
                           PERSISTENT, SECONDS, SPEC_FLOAT_MAX, STEPS, TOKENS, TRAIN_SEED,
                           VOCAB_SIZE, WIDTH)
from titanc.errors import SpecError

__all__ = [
    "AttentionSpec", "MemorySpec", "ModelSpec", "TrainSpec", "DataSpec", "CompileSpec", "Spec",
    "BLOCK_KINDS", "BLOCKS", "BlockKind", "DTYPES", "REMAT_POLICIES", "TARGETS",
    "load_spec", "spec_to_dict", "spec_hash", "parse_set_args",
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
REMAT_POLICIES = ("none", "per_layer", "per_segment", "budget")
TARGETS = ("auto", "cpu", "triton", "reference")
_F32_MAX = 3.4028234663852886e38


def _field(default: Any = MISSING, **bounds: Any) -> Any:
    """A dataclass field with validation bounds: ge, gt, lt, le (numbers), most (a cap on
    what the code downstream takes, stated on its own: `must be at most N`) or choices
    (strings)."""
    return field(default=default, metadata=bounds)


def _section(cls: type) -> Any:
    return field(default_factory=cls)


# ---------------------------------------------------------------------------------- schema


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionSpec:
    heads: int = _field(4, ge=1, most=HEADS.hi)
    window: int = _field(64, ge=1, most=TOKENS.hi)  # sliding window W (attn, mag, mal)
    segment: int = _field(32, ge=1, most=TOKENS.hi)  # segment length S (mac)
    # P learned tokens every query attends to
    persistent_tokens: int = _field(4, ge=0, most=PERSISTENT.hi)

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySpec:
    heads: int = _field(2, ge=1, most=HEADS.hi)
    depth: int = _field(2, ge=1, most=MEMORY_DEPTH.hi)  # layers of the memory MLP
    # hidden width = expansion * head dim
    expansion: int = _field(2, ge=1, most=EXPANSION.hi)
    # b; 1 = exact token-by-token memory
    chunk_size: int = _field(16, ge=1, most=TOKENS.hi)
    adaptive: bool = True                        # data-dependent theta/eta/alpha, else constants
    # theta_max (or the constant theta)
    lr_max: float = _field(0.01, gt=0, most=SPEC_FLOAT_MAX)
    momentum: float = _field(0.9, gt=0, lt=1)    # constant eta when not adaptive
    decay: float = _field(0.01, ge=0, lt=1)      # constant alpha when not adaptive, else
    #                                              alpha's starting value
    decay_max: float = _field(1.0, gt=0, le=1)   # top of the adaptive alpha's range
    output_gate: bool = True
    conv_kernel: int = _field(4, ge=1, most=CONV_TAPS.hi)
    # activation of the q/k streams before l2norm: silu (the paper) or none (zero-mean keys)
    qk_activation: str = _field("silu", choices=("silu", "none"))
    # the momentum of the write: heavy_ball (the paper, S_t = η S_{t-1} - θ g_t) or ema
    # (S_t = η S_{t-1} - (1 - η) θ g_t: θ is the step at any η, and the chunked write
    # contracts for every gate value while lr_max <= d / chunk_size; docs/semantics.md)
    momentum_form: str = _field("heavy_ball", choices=("heavy_ball", "ema"))
    # block mac only (docs/semantics.md, "mac"): what the memory is written with, the attention
    # output ŷ = rmsnorm(ỹ) (the paper) or the segment's normalised input u_s; and where the
    # segment-start read h goes, only into the attention as context (the paper) or also onto
    # the block's output (residual)
    mac_write: str = _field("attention", choices=("attention", "input"))
    mac_read: str = _field("context", choices=("context", "residual"))
    # blocks mac and mag: which branch of the paper's y ⊗ M is the sigmoid gate, the memory's
    # read gating the attention output (memory) or the attention output gating the read
    gate: str = _field("memory", choices=("memory", "attention"))

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    vocab_size: int = _field(256, ge=1, most=VOCAB_SIZE.hi)
    d_model: int = _field(ge=1, most=WIDTH.hi)
    n_layers: int = _field(ge=1, most=LAYERS.hi)
    block: str = _field(choices=BLOCKS)
    # at most 2**20 tokens (bounds.TOKENS: a sequence's tokens everywhere); past it the
    # compile's per-chunk work runs for hours before the memory check could refuse it
    seq_len: int = _field(ge=1, most=TOKENS.hi)
    tie_embeddings: bool = True
    # None: the multiple of 8 nearest 8/3 * d_model
    ffn_hidden: int | None = _field(None, ge=1, most=FFN_WIDTH.hi)
    attention: AttentionSpec = _section(AttentionSpec)
    memory: MemorySpec = _section(MemorySpec)

    def __post_init__(self) -> None:
        _check_fields(self)
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
        for key, default, owner in (("mac_write", "attention", "mac"),
                                    ("mac_read", "context", "mac"), ("gate", "memory", "mac mag")):
            if self.block not in owner.split() and getattr(mem, key) != default:
                raise SpecError(f"model.memory.{key}: {getattr(mem, key)} applies to block "
                                f"{owner.replace(' ', ' and ')} only (this model's block is "
                                f"{self.block}); remove it")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    batch_size: int = _field(8, ge=1, most=BATCH_SIZE.hi)
    steps: int = _field(200, ge=1, most=STEPS.hi)
    lr: float = _field(3e-3, gt=0, most=SPEC_FLOAT_MAX)
    warmup: int = _field(20, ge=0, most=STEPS.hi)
    weight_decay: float = _field(0.1, ge=0, most=SPEC_FLOAT_MAX)
    betas: tuple[float, float] = _field((0.9, 0.95), ge=0, lt=1)
    grad_clip: float = _field(1.0, ge=0, most=SPEC_FLOAT_MAX)  # global-norm clip; 0 disables
    seed: int = _field(0, ge=0, most=TRAIN_SEED.hi)  # the loaders add the split to it
    dtype: str = _field("float32", choices=DTYPES)
    remat: str = _field("per_layer", choices=REMAT_POLICIES)
    # required when remat is budget
    remat_budget_mb: float | None = _field(None, gt=0, most=MEGABYTES)
    # per_segment, block mac: sequences per group of the MAC scans (0: the fewest whose
    # segment [rows, S, D] reaches 1 MiB in float32, blocks.ROW_GROUP_BYTES)
    remat_rows: int = _field(0, ge=0, most=BATCH_SIZE.hi)
    # per_layer / per_segment: layers per checkpoint group; the residual stream is saved every
    # `remat_group` layers and the backward re-runs a group's layers (n_layers/k + k
    # checkpoints live instead of n_layers; 1: every layer)
    remat_group: int = _field(1, ge=1, most=LAYERS.hi)
    # tokens per LM-head chunk; 0 = unchunked
    loss_chunk: int = _field(1024, ge=0, most=LOSS_CHUNK.hi)
    # micro-batches per optimizer step
    grad_accum: int = _field(1, ge=1, most=GRAD_ACCUM.hi)
    # steps between evaluations; 0 = never
    eval_every: int = _field(50, ge=0, most=EVERY.hi)
    eval_batches: int = _field(4, ge=1, most=BATCHES.hi)
    # steps between checkpoints; 0 = only at the end
    checkpoint_every: int = _field(100, ge=0, most=EVERY.hi)
    # steps between metrics lines (loss, grad norm: the only reads from the device)
    log_every: int = _field(1, ge=1, most=EVERY.hi)
    # gradient all-reduce bucket size (distributed)
    bucket_mb: float = _field(25.0, gt=0, most=MEGABYTES)
    zero: int = _field(0, ge=0)                  # 1 = ZeRO-1: shard AdamW state over ranks
    # a collective waiting longer fails the job
    dist_timeout_s: float = _field(300.0, gt=0, most=SECONDS)
    # steps between memory diagnostics in metrics.jsonl (runtime/diagnostics/neural_memory.py); 0 = never
    memory_stats_every: int = _field(0, ge=0, most=EVERY.hi)
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
        _check_fields(self)
        if self.master_dtype == "float32":  # these become float32 scalars of the training graph
            for name in ("lr", "weight_decay", "grad_clip"):
                if getattr(self, name) > _F32_MAX:
                    raise SpecError(f"train.{name}: {getattr(self, name):g} overflows float32 "
                                    f"(largest {_F32_MAX:.4g}); use a smaller value")
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
    val_fraction: float = _field(0.1, ge=0, lt=1)
    tokenizer: str = "byte"                      # or a tokenizer.json ('titanc tokenizer train')
    # honour document boundaries (docs/data.md "Documents"): the loader yields each token's
    # document start and the compiled program resets memory, conv history and attention there
    documents: bool = False
    # with documents: true, rows are windows of the packed stream (a row spans documents);
    # false: one document per row from its start, padded, the padding masked out of the loss
    pack: bool = True

    def __post_init__(self) -> None:
        _check_fields(self)
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
    target: str = _field("auto", choices=TARGETS)
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
    # the memory's chunk scans of >= 8 chunks checkpointed in groups of about sqrt(n) chunks
    # (train.remat; passes/checkpoint_chunks.py); false: every chunk's state saved, and the
    # backward recomputes no chunk (large_125m bf16: training arena 2,042 -> 2,468 MiB,
    # 35,265 -> 27,681 triton launches a step, its memory scans host loops; tiny_lmm: 15.0
    # -> 21.3 MiB, and 65 -> 79 launches: a group's scan kernel held its chunks' recompute)
    chunk_groups: bool = True
    # a memory scan's carry-independent work hoisted before it even where it holds no einsum
    # (passes/hoist.py): the forward chunk scans' gates (their cumulative decay and the
    # weights of each token's gradient), computed for every chunk at once
    hoist_gates: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class Spec:
    name: str
    model: ModelSpec
    train: TrainSpec = _section(TrainSpec)
    data: DataSpec = _section(DataSpec)
    compile: CompileSpec = _section(CompileSpec)
    path: str | None = field(default=None, compare=False)  # the file it was read from

    def __post_init__(self) -> None:
        _check_fields(self)
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


_PREFIX: dict[type, str] = {
    Spec: "", ModelSpec: "model", AttentionSpec: "model.attention",
    MemorySpec: "model.memory", TrainSpec: "train", DataSpec: "data", CompileSpec: "compile",
}
_NOT_IN_FILE = frozenset({"path"})  # Spec fields that are not part of the spec's content


# ---------------------------------------------------------------------------------- checks


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# repr() bounded in depth and width before it is built: a YAML alias bomb expands to a value
# whose full repr would take hours, and a message only ever shows its first 60 characters
def _int_repr(value: int) -> str:
    if value.bit_length() <= 256:
        return repr(value)
    return f"{'minus ' if value < 0 else ''}an integer of {value.bit_length()} bits"  # repr()
    #                                                       refuses ints past 4300 digits


class _BoundedRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        return _int_repr(x)


_REPR = _BoundedRepr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 60


def _brepr(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return _short(_REPR.repr(value))
    # linear in the input: keep the plain prefix
    return _short(_int_repr(value) if isinstance(value, int) else repr(value))


def _show(value: Any) -> str:
    """A value as it would be written in YAML, on one line and short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        value = list(value)
    return _brepr(value)


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    kinds = [(bool, "a boolean"), (int, "the integer"), (float, "the number"),
             (str, "the string"), ((list, tuple), "the list")]
    for kind, words in kinds:
        if isinstance(value, kind):
            return f"{words} {_show(value)}"
    if isinstance(value, Mapping):
        return "a mapping"
    return f"a {type(value).__name__} {_brepr(value)}"


def _type_error(path: str, want: str, value: Any) -> SpecError:
    hint = ""
    if want == "a string" and isinstance(value, (bool, int, float)):
        hint = "; put it in quotes"
    return SpecError(f"{path}: expected {want}, got {_describe(value)}{hint}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_type(value: Any, tp: Any, path: str) -> Any:
    """Return `value` as type `tp` (int -> float, list -> tuple, mapping -> section) or raise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):  # only `X | None` occurs in the schema
        (inner,) = [a for a in args if a is not type(None)]
        return None if value is None else _check_type(value, inner, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _type_error(path, f"a list of {len(args)} numbers", value)
        return tuple(_check_type(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if value is None or isinstance(value, Mapping):
            return _build(tp, value)
        raise _type_error(path, "a mapping", value)
    if tp is bool:
        if not isinstance(value, bool):
            raise _type_error(path, "true or false", value)
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(path, "an integer", value)
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(path, "a number", value)
        value = float(value)
        if not math.isfinite(value):
            raise SpecError(f"{path}: {_show(value)} must be a finite number")
    elif tp is str:
        if not isinstance(value, str):
            raise _type_error(path, "a string", value)
    else:  # pragma: no cover - the schema uses no other types
        raise AssertionError(f"unsupported schema type {tp!r} at {path}")
    return value


def _bounds_text(bounds: Mapping[str, Any]) -> str:
    if "lt" in bounds or "le" in bounds:
        lo, bracket = (bounds["ge"], "[") if "ge" in bounds else (bounds["gt"], "(")
        hi, close = (bounds["lt"], ")") if "lt" in bounds else (bounds["le"], "]")
        return f"in {bracket}{lo}, {hi}{close}"
    return f">= {bounds['ge']}" if "ge" in bounds else f"> {bounds['gt']}"


def _check_bounds(value: Any, bounds: Mapping[str, Any], path: str) -> None:
    if value is None or not bounds:
        return
    if isinstance(value, tuple):
        for i, item in enumerate(value):
            _check_bounds(item, bounds, f"{path}[{i}]")
        return
    if "choices" in bounds:
        if value not in bounds["choices"]:
            raise SpecError(f"{path}: {_show(value)} must be one of {', '.join(bounds['choices'])}")
        return
    ok = (("ge" not in bounds or value >= bounds["ge"])
          and ("gt" not in bounds or value > bounds["gt"])
          and ("lt" not in bounds or value < bounds["lt"])
          and ("le" not in bounds or value <= bounds["le"]))
    if not ok:
        raise SpecError(f"{path}: {_show(value)} must be {_bounds_text(bounds)}")
    if "most" in bounds and value > bounds["most"]:
        if bounds["most"] == SPEC_FLOAT_MAX:    # a graph scalar: float32 when the masters are
            raise SpecError(f"{path}: {value:g} overflows float32 (largest {_F32_MAX:.4g}); "
                            f"use a smaller value")
        raise SpecError(f"{path}: {_show(value)} must be at most {_show(bounds['most'])}")


def _check_fields(obj: Any) -> None:
    """Type-check, normalise and bound-check every field of a spec dataclass, in order."""
    cls = type(obj)
    hints = _hints(cls)
    for f in fields(cls):
        if f.name in _NOT_IN_FILE:
            continue
        path = _join(_PREFIX[cls], f.name)
        value = _check_type(getattr(obj, f.name), hints[f.name], path)
        _check_bounds(value, f.metadata, path)
        object.__setattr__(obj, f.name, value)


# ------------------------------------------------------------------------------- structure


def _keys(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if f.name not in _NOT_IN_FILE]


@functools.cache
def _leaf_paths(cls: type = Spec, prefix: str = "") -> dict[str, Any]:
    """Every settable dotted path of the schema (sections excluded) and its type, in order."""
    out: dict[str, Any] = {}
    hints = _hints(cls)
    for name in _keys(cls):
        path, tp = _join(prefix, name), hints[name]
        if dataclasses.is_dataclass(tp):
            out.update(_leaf_paths(tp, path))
        else:
            out[path] = tp
    return out


def _suggest(path: str) -> str | None:
    """The known dotted path that an unknown `path` most likely meant, or None.

    A known name in the wrong place wins (`model.chunk_size` -> `model.memory.chunk_size`);
    otherwise each unknown part is replaced by its closest sibling (`modl.d_modle`).
    """
    name = path.rsplit(".", 1)[-1]
    for known in [*filter(None, _PREFIX.values()), *_leaf_paths()]:
        if known.rsplit(".", 1)[-1] == name:
            return known
    cls: Any = Spec
    fixed = []
    for part in path.split("."):
        keys = _keys(cls) if cls is not None else []
        close = [part] if part in keys else difflib.get_close_matches(part, keys, n=1, cutoff=0.6)
        if not close:
            return None
        fixed.append(close[0])
        tp = _hints(cls)[close[0]]
        cls = tp if dataclasses.is_dataclass(tp) else None
    return ".".join(fixed)


def _unknown_key(path: str, fallback_hint: str) -> SpecError:
    guess = _suggest(path)
    hint = f"did you mean {guess!r}?" if guess else fallback_hint
    return SpecError(f"unknown key {_short(repr(path))}; {hint}")


def _build(cls: type, raw: Mapping[str, Any] | None) -> Any:
    """Construct `cls` from a mapping: structure checks here, field checks in __post_init__."""
    prefix = _PREFIX[cls]
    raw = {} if raw is None else raw  # an empty section (`train:` alone) means all defaults
    known = _keys(cls)
    for key in raw:
        if key not in known:
            where = f" in {prefix}" if prefix else ""
            raise _unknown_key(_join(prefix, str(key)), f"known keys{where}: {', '.join(known)}")
    for f in fields(cls):
        required = f.default is MISSING and f.default_factory is MISSING
        if required and f.name not in raw:
            raise SpecError(f"{_join(prefix, f.name)}: required field is missing")
    hints = _hints(cls)
    kwargs = {k: _check_type(v, hints[k], _join(prefix, k))  # sections first; leaves in cls()
              if dataclasses.is_dataclass(hints[k]) else v for k, v in raw.items()}
    return cls(**kwargs)


# ------------------------------------------------------------------------------------ YAML


MAX_YAML_DEPTH = 64   # a spec nests 4 levels; deeper input is refused before it is parsed further


class _Loader(yaml.SafeLoader):
    """safe_load, plus YAML 1.2 floats without a dot (`3e-3`), an error on duplicate keys, and
    one on nesting past MAX_YAML_DEPTH. The depth cap makes deep input (`[[[[...`) fail fast
    and alike whatever Python's recursion limit is: the pure-Python composer recurses per
    level, and under a raised limit (hypothesis raises it while a test runs) 3,000 levels
    took seconds per parse instead of failing."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        depth = getattr(self, "_depth", 0)
        if depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nesting deeper than {MAX_YAML_DEPTH} levels",
                self.peek_event().start_mark)
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {_brepr(key)}", key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_problem(exc: yaml.YAMLError) -> tuple[str, str]:
    """(' line:col', problem) of a YAML error, for a one-line message."""
    mark = getattr(exc, "problem_mark", None)
    where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc)
    return where, " ".join(str(problem).split())


MAX_SPEC_BYTES = 1 << 20  # a spec is a page of YAML; anything near this is not one


def _load_yaml(text: str) -> Any:
    """yaml.load with our loader; every failure (including ints past Python's digit limit and
    nesting past the recursion limit) is a yaml.YAMLError."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except (ValueError, RecursionError) as exc:
        raise yaml.YAMLError(" ".join(str(exc).split()) or type(exc).__name__) from None


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        st = os.stat(path)  # before open(): opening a FIFO for reading blocks
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"{path}: not a regular file (a device, FIFO or socket); "
                            f"pass a YAML spec file")
        if st.st_size > MAX_SPEC_BYTES:
            raise SpecError(f"{path}: {st.st_size} bytes is too large for a spec (at most "
                            f"{MAX_SPEC_BYTES}); pass a YAML spec file")
        with open(path, "rb") as fh:
            data = fh.read(MAX_SPEC_BYTES + 1)
        if len(data) > MAX_SPEC_BYTES:
            raise SpecError(f"{path}: too large for a spec (over {MAX_SPEC_BYTES} bytes)")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a directory, not a spec file") from None
    except PermissionError:
        raise SpecError(f"{path}: permission denied; cannot read the spec file") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise SpecError(f"{path}: cannot read the spec file: {reason}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not a text file (invalid UTF-8 at byte {exc.start})") from None
    empty = (f"{path}: file is empty; a spec is a YAML mapping with at least name and model "
             f"(see examples/tiny.yaml)")
    if not text.strip():
        raise SpecError(empty)
    try:
        doc = _load_yaml(text)
    except yaml.YAMLError as exc:
        where, problem = _yaml_problem(exc)
        raise SpecError(f"{path}{where}: not valid YAML: {problem}") from None
    if doc is None:
        raise SpecError(empty)
    if not isinstance(doc, dict):
        raise SpecError(
            f"{path}: the top level must be a mapping (name: ..., model: ...), "
            f"got {_describe(doc)}")
    return doc


# ------------------------------------------------------------------------------- public API


def _plain(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """A deep copy of nested mappings/lists as dicts/lists, safe to edit. Shared sub-values
    (YAML aliases) stay shared, so an alias bomb is copied in time linear in its text."""
    if not isinstance(value, (Mapping, list, tuple)):
        return value
    memo = {} if memo is None else memo
    if id(value) not in memo:
        # the copy is in the memo before its items are copied: a value that contains itself
        # (`--set 'model.d_model=&a [*a]'`) is copied as such, not recursed into forever
        if isinstance(value, Mapping):
            out: Any = memo.setdefault(id(value), {})
            out.update((k, _plain(v, memo)) for k, v in value.items())
        else:
            out = memo.setdefault(id(value), [])
            out.extend(_plain(v, memo) for v in value)
    return memo[id(value)]


def _apply_override(raw: dict[str, Any], key: Any, value: Any) -> None:
    leaves = _leaf_paths()
    if key in _PREFIX.values():
        example = next(p for p in leaves if p.startswith(f"{key}."))
        raise SpecError(f"{key}: is a section; override one of its fields, e.g. {example}")
    if not isinstance(key, str) or key not in leaves:
        raise _unknown_key(str(key),
                           "overrides name a field by its dotted path, e.g. model.d_model")
    *sections, leaf = key.split(".")
    node, path = raw, ""
    for name in sections:
        path = _join(path, name)
        if node.get(name) is None:
            node[name] = {}
        if not isinstance(node[name], dict):
            raise _type_error(path, "a mapping", node[name])
        node[name] = dict(node[name])  # the section may be a YAML alias shared with another
        node = node[name]
    node[leaf] = _plain(value)


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
        raw = _plain(source)
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        raw = _read_yaml(path)
    else:
        raise TypeError(
            f"load_spec: expected a path, a mapping or a Spec, got {type(source).__name__}")
    for key, value in (overrides or {}).items():
        _apply_override(raw, key, value)
    return dataclasses.replace(_build(Spec, raw), path=path)


def spec_to_dict(spec: Spec) -> dict[str, Any]:
    """The spec as plain YAML/JSON data (tuples as lists, no `path`); `load_spec` reads it back."""

    def convert(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return {name: convert(getattr(obj, name)) for name in _keys(type(obj))}
        if isinstance(obj, tuple):
            return [convert(v) for v in obj]
        return obj

    return convert(spec)


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
    leaves = _leaf_paths()
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError(
                f"--set {_short(repr(item))}: expected KEY=VALUE, e.g. --set model.d_model=128")
        if leaves.get(key) is str:
            out[key] = text
            continue
        try:
            out[key] = _load_yaml(text)
        except yaml.YAMLError as exc:
            raise SpecError(
                f"--set {key}: value {_short(repr(text))} is not valid YAML: "
                f"{_yaml_problem(exc)[1]}"
            ) from None
    return out
