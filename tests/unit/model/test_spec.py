"""Spec schema: the examples load, overrides and hashing work, every bad spec gets its exact
one-line message (docs/conventions.md §10 tier d), and a hostile `name` is plain data."""

from __future__ import annotations

import copy
import dataclasses
import json
import keyword
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import titanc.model.spec as spec_module
import titanc.model.spec_engine as spec_engine
from titanc.errors import SpecError, TitancError
from titanc.model.spec import (
    ModelSpec, Spec, load_spec, parse_set_args, spec_hash, spec_to_dict,
)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
TINY = ROOT / "examples" / "tiny.yaml"

# The smallest valid spec: everything else takes its default (a mac model, seq 128, segment 32,
# chunk 16, 4 attention heads and 2 memory heads over d_model 64).
BASE: dict[str, Any] = {
    "name": "t", "model": {"d_model": 64, "n_layers": 2, "block": "mac", "seq_len": 128},
}
DELETE = object()


def edited(**changes: Any) -> dict[str, Any]:
    """BASE with dotted paths set (`model__memory__chunk_size=48`) or removed (`=DELETE`)."""
    raw = copy.deepcopy(BASE)
    for key, value in changes.items():
        *sections, leaf = key.split("__")
        node = raw
        for name in sections:
            node = node.setdefault(name, {})
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return raw


def error_of(source: Any, overrides: dict[str, Any] | None = None) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(source, overrides)
    message = str(info.value)
    assert "\n" not in message and message == message.strip()
    return message


# ------------------------------------------------------------------------------ good specs


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load_and_round_trip(path: Path) -> None:
    spec = load_spec(path)
    assert spec.path == str(path)
    assert load_spec(spec_to_dict(spec)) == spec
    assert load_spec(yaml.safe_load(yaml.safe_dump(spec_to_dict(spec)))) == spec
    json.dumps(spec_to_dict(spec))  # plain data


def test_tiny_examples_share_sizes_and_differ_in_block() -> None:
    blocks = {}
    for kind in ("mac", "lmm", "mag", "mal", "attn"):
        path = TINY if kind == "mac" else ROOT / "examples" / f"tiny_{kind}.yaml"
        model = load_spec(path).model
        assert (model.vocab_size, model.d_model, model.n_layers, model.seq_len) == (256, 64, 2, 128)
        blocks[kind] = model.block
    assert blocks == {k: k for k in blocks}


def test_tiny_has_the_issue_values(tiny_spec: Spec) -> None:
    m, t = tiny_spec.model, tiny_spec.train
    assert (m.attention.heads, m.attention.window, m.attention.segment,
            m.attention.persistent_tokens) == (4, 64, 32, 4)
    assert dataclasses.astuple(m.memory) == (2, 2, 2, 16, True, 0.01, 0.9, 0.01, 1.0, True, 4,
                                             "silu", "heavy_ball", "attention", "context",
                                             "memory", (), "before_write", "after_grad",
                                             "sigmoid", None, "l2", None, None, "mlp",
                                             False)
    assert (t.batch_size, t.steps, t.lr, t.warmup, t.weight_decay, t.betas) == (
        8, 200, 3e-3, 20, 0.1, (0.9, 0.95))
    assert (t.grad_clip, t.seed, t.dtype, t.remat, t.remat_budget_mb, t.loss_chunk,
            t.grad_accum) == (1.0, 0, "float32", "per_layer", None, 1024, 1)
    assert tiny_spec.data.source == "synthetic:recall" and tiny_spec.compile.target == "auto"


def _param_count(m: ModelSpec) -> int:
    """Parameter count from the table in docs/semantics.md."""
    d, f, p = m.d_model, m.ffn, m.attention.persistent_tokens
    nm, dh = m.memory.heads, m.mem_head_dim
    h = m.memory.expansion * dh
    layer = d + 3 * d * f  # ffn_norm, ffn_w1/w3/w2
    if m.has_attention:
        layer += 4 * d * d + p * d  # attn_wq/wk/wv/wo, attn_persistent
    if m.block in ("attn", "mal"):
        layer += d  # attn_norm
    if m.has_memory:
        layer += d + 4 * d * d + 3 * d * m.memory.conv_kernel
        layer += d * d if m.memory.output_gate and m.block != "mac" else 0
        layer += 3 * d * nm + 3 * nm if m.memory.adaptive else 0
        shapes = [(dh, dh)] if m.memory.depth == 1 else (
            [(h, dh)] + [(h, h)] * (m.memory.depth - 2) + [(dh, h)])
        layer += sum(nm * a * b for a, b in shapes)
    if m.block == "mag":
        layer += 2 * d + d * d
    head = 0 if m.tie_embeddings else d * m.vocab_size
    return m.vocab_size * d + d + head + m.n_layers * layer


def test_large_example_is_about_125m_parameters() -> None:
    spec = load_spec(ROOT / "examples" / "large_125m.yaml")
    assert 110e6 <= _param_count(spec.model) <= 140e6


def test_defaults_and_derived_sizes() -> None:
    spec = load_spec(BASE)
    m = spec.model
    assert m.vocab_size == 256 and m.ffn_hidden is None and m.ffn == 168  # 8/3*64 = 170.7
    assert load_spec(edited(model__d_model=768, model__attention={"heads": 12})).model.ffn == 2048
    assert load_spec(edited(model__ffn_hidden=100)).model.ffn == 100
    assert (m.head_dim, m.mem_head_dim) == (16, 32)
    assert spec.train == spec_module.TrainSpec() and spec.compile.target == "auto"
    assert spec.data.source == "synthetic:recall" and spec.path is None


@pytest.mark.parametrize("block, memory, attention", [
    ("lmm", True, False), ("mac", True, True), ("mag", True, True), ("mal", True, True),
    ("attn", False, True)])
def test_block_kinds(block: str, memory: bool, attention: bool) -> None:
    m = load_spec(edited(model__block=block)).model
    assert (m.has_memory, m.has_attention) == (memory, attention)


def test_int_is_accepted_for_float_and_yaml_exponents_are_floats(tmp_path: Path) -> None:
    assert load_spec(edited(train={"lr": 1})).train.lr == 1.0
    assert isinstance(load_spec(edited(train={"lr": 1})).train.lr, float)
    path = tmp_path / "s.yaml"
    path.write_text("name: e\nmodel: {d_model: 64, n_layers: 1, block: attn, seq_len: 8}\n"
                    "train: {lr: 3e-3, weight_decay: 1E-2}\n")
    assert (load_spec(path).train.lr, load_spec(path).train.weight_decay) == (3e-3, 1e-2)


def test_unused_sections_are_not_cross_checked() -> None:
    # attention heads that do not divide d_model only matter for blocks with attention
    assert load_spec(edited(model__block="lmm", model__attention={"heads": 5})).model.block == "lmm"
    assert load_spec(edited(model__block="attn", model__memory={"heads": 3})).model.block == "attn"


def test_specs_are_frozen_and_validate_when_built_in_python() -> None:
    spec = load_spec(BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(SpecError, match=r"^model\.memory\.chunk_size: 16 must divide "
                                        r"model\.seq_len=100$"):
        ModelSpec(d_model=64, n_layers=1, block="lmm", seq_len=100)
    with pytest.raises(SpecError, match=r"^model\.d_model: 0 must be >= 1$"):
        dataclasses.replace(spec.model, d_model=0)
    assert issubclass(SpecError, TitancError)


# ------------------------------------------------------------------------------- bad specs

BAD_SPECS = [
    # unknown keys, with the closest known key
    (edited(model__d_modle=64), "unknown key 'model.d_modle'; did you mean 'model.d_model'?"),
    (edited(trian={}), "unknown key 'trian'; did you mean 'train'?"),
    (edited(model__chunk_size=16),
     "unknown key 'model.chunk_size'; did you mean 'model.memory.chunk_size'?"),
    (edited(model__memory={"zzz": 1}),
     "unknown key 'model.memory.zzz'; known keys in model.memory: heads, depth, expansion, "
     "chunk_size, adaptive, lr_max, momentum, decay, decay_max, output_gate, conv_kernel, "
     "qk_activation, momentum_form, mac_write, mac_read, gate, fixed, read, decay_order, "
     "decay_form, value_width, objective, huber_delta, lp_p, inner, post_norm"),
    (edited(memory={}), "unknown key 'memory'; did you mean 'model.memory'?"),
    (edited(train={"heads": 2}),
     "unknown key 'train.heads'; did you mean 'model.attention.heads'?"),
    (edited(path="x.yaml"), "unknown key 'path'; known keys: name, model, train, data, compile"),
    # wrong types
    (edited(model__d_model="64"), "model.d_model: expected an integer, got the string '64'"),
    (edited(model__n_layers=True), "model.n_layers: expected an integer, got a boolean true"),
    (edited(model__d_model=64.0), "model.d_model: expected an integer, got the number 64.0"),
    (edited(model__seq_len=None), "model.seq_len: expected an integer, got null"),
    (edited(model__memory={"adaptive": "yes"}),
     "model.memory.adaptive: expected true or false, got the string 'yes'"),
    (edited(train={"lr": "fast"}), "train.lr: expected a number, got the string 'fast'"),
    (edited(train={"lr": float("nan")}), "train.lr: nan must be a finite number"),
    (edited(name=2024), "name: expected a string, got the integer 2024; put it in quotes"),
    (edited(model__attention=4), "model.attention: expected a mapping, got the integer 4"),
    (edited(model=[1, 2]), "model: expected a mapping, got the list [1, 2]"),
    (edited(train={"betas": [0.9]}),
     "train.betas: expected a list of 2 numbers, got the list [0.9]"),
    (edited(train={"betas": [0.9, "x"]}), "train.betas[1]: expected a number, got the string 'x'"),
    # missing required fields
    (edited(name=DELETE), "name: required field is missing"),
    (edited(model=DELETE), "model: required field is missing"),
    (edited(model__d_model=DELETE), "model.d_model: required field is missing"),
    (edited(model__n_layers=DELETE), "model.n_layers: required field is missing"),
    (edited(model__block=DELETE), "model.block: required field is missing"),
    (edited(model__seq_len=DELETE), "model.seq_len: required field is missing"),
    # non-positive sizes
    (edited(model__d_model=0), "model.d_model: 0 must be >= 1"),
    (edited(model__n_layers=-2), "model.n_layers: -2 must be >= 1"),
    (edited(model__seq_len=0), "model.seq_len: 0 must be >= 1"),
    (edited(model__vocab_size=0), "model.vocab_size: 0 must be >= 1"),
    (edited(model__ffn_hidden=0), "model.ffn_hidden: 0 must be >= 1"),
    (edited(model__attention={"heads": 0}), "model.attention.heads: 0 must be >= 1"),
    (edited(model__attention={"persistent_tokens": -1}),
     "model.attention.persistent_tokens: -1 must be >= 0"),
    (edited(model__memory={"heads": 0}), "model.memory.heads: 0 must be >= 1"),
    (edited(model__memory={"chunk_size": 0}), "model.memory.chunk_size: 0 must be >= 1"),
    (edited(train={"batch_size": 0}), "train.batch_size: 0 must be >= 1"),
    (edited(train={"grad_accum": 0}), "train.grad_accum: 0 must be >= 1"),
    (edited(train={"loss_chunk": -1}), "train.loss_chunk: -1 must be >= 0"),
    # unknown choices
    (edited(model__block="macc"), "model.block: 'macc' must be one of lmm, mac, mag, mal, attn"),
    (edited(train={"dtype": "float16"}),
     "train.dtype: 'float16' must be one of float32, float64, bfloat16"),
    (edited(train={"remat": "all"}), "train.remat: 'all' must be one of none, per_layer, per_segment, budget"),
    (edited(compile={"target": "cuda"}),
     "compile.target: 'cuda' must be one of auto, cpu, triton, reference"),
    # shapes
    (edited(model__block="lmm", model__memory={"chunk_size": 48}),
     "model.memory.chunk_size: 48 must divide model.seq_len=128"),
    (edited(model__block="mag", model__memory={"chunk_size": 48}),
     "model.memory.chunk_size: 48 must divide model.seq_len=128"),
    (edited(model__attention={"segment": 48}),
     "model.attention.segment: 48 must divide model.seq_len=128 (block mac)"),
    (edited(model__memory={"chunk_size": 24}),
     "model.memory.chunk_size: 24 must divide model.attention.segment=32 (block mac)"),
    (edited(model__attention={"heads": 5}),
     "model.attention.heads: 5 must divide model.d_model=64"),
    (edited(model__block="attn", model__attention={"heads": 32}, model__d_model=96),
     "model.attention.heads: 32 gives head dim 96/32=3, which must be even for RoPE; "
     "choose heads so that d_model/heads is even"),
    (edited(model__memory={"heads": 3}), "model.memory.heads: 3 must divide model.d_model=64"),
    # ranges
    (edited(model__attention={"window": 0}), "model.attention.window: 0 must be >= 1"),
    (edited(model__memory={"momentum": 1.0}), "model.memory.momentum: 1.0 must be in (0, 1)"),
    (edited(model__memory={"momentum": 0}), "model.memory.momentum: 0.0 must be in (0, 1)"),
    (edited(model__memory={"decay": 1}), "model.memory.decay: 1.0 must be in [0, 1)"),
    (edited(model__memory={"decay": -0.1}), "model.memory.decay: -0.1 must be in [0, 1)"),
    (edited(model__memory={"lr_max": 0}), "model.memory.lr_max: 0.0 must be > 0"),
    (edited(model__memory={"decay_max": 0}), "model.memory.decay_max: 0.0 must be in (0, 1]"),
    (edited(model__memory={"decay_max": 1.5}), "model.memory.decay_max: 1.5 must be in (0, 1]"),
    (edited(model__memory={"decay_max": 0.005}),
     "model.memory.decay: 0.01 must be below model.memory.decay_max=0.005 (the adaptive decay "
     "starts at memory.decay inside (0, decay_max))"),
    (edited(model__memory={"momentum_form": "nesterov"}),
     "model.memory.momentum_form: 'nesterov' must be one of heavy_ball, ema, none"),
    (edited(model__memory={"depth": 0}), "model.memory.depth: 0 must be >= 1"),
    (edited(model__memory={"expansion": 0}), "model.memory.expansion: 0 must be >= 1"),
    (edited(model__memory={"conv_kernel": 0}), "model.memory.conv_kernel: 0 must be >= 1"),
    (edited(model__block="lmm", model__memory={"mac_read": "residual"}),
     "model.memory.mac_read: residual applies to block mac only (this model's block is lmm); "
     "remove it"),
    (edited(model__block="mal", model__memory={"gate": "attention"}),
     "model.memory.gate: attention applies to block mac and mag only (this model's block is "
     "mal); remove it"),
    (edited(train={"betas": [0.9, 1.0]}), "train.betas[1]: 1.0 must be in [0, 1)"),
    (edited(train={"betas": [-0.1, 0.9]}), "train.betas[0]: -0.1 must be in [0, 1)"),
    (edited(train={"lr": 0}), "train.lr: 0.0 must be > 0"),
    (edited(train={"remat": "budget"}),
     "train.remat_budget_mb: required when train.remat is 'budget'; "
     "set it, e.g. --set train.remat_budget_mb=512"),
    (edited(train={"remat": "budget", "remat_budget_mb": 0}),
     "train.remat_budget_mb: 0.0 must be > 0"),
    (edited(data={"source": " "}),
     "data.source: must not be empty; use synthetic:recall or a path to a text file"),
    (edited(data={"val_fraction": 1}), "data.val_fraction: 1.0 must be in [0, 1)"),
]


@pytest.mark.parametrize("raw, message", BAD_SPECS, ids=[m[:48] for _, m in BAD_SPECS])
def test_bad_spec_message(raw: dict[str, Any], message: str) -> None:
    assert error_of(raw) == message


def test_an_attention_head_count_that_divides_is_accepted() -> None:
    spec = load_spec(edited(model__block="attn", model__attention={"heads": 3}, model__d_model=96))
    assert spec.model.head_dim == 32


# --------------------------------------------------------------------------- file problems


def _write(tmp_path: Path, text: str | bytes, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert error_of(path) == f"{path}: no such spec file"
    assert error_of(str(path)) == f"{path}: no such spec file"


def test_directory(tmp_path: Path) -> None:
    assert error_of(tmp_path) == f"{tmp_path}: is a directory, not a spec file"


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, "name: x\n")

    def denied(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(spec_engine, "open", denied, raising=False)  # tests run as root too
    assert error_of(path) == f"{path}: permission denied; cannot read the spec file"


@pytest.mark.parametrize("text", ["", "   \n\n", "# just a comment\n", "---\n"])
def test_empty_file(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text)
    assert error_of(path) == (f"{path}: file is empty; a spec is a YAML mapping with at least "
                              f"name and model (see examples/tiny.yaml)")


@pytest.mark.parametrize("text, where, problem", [
    ("name: x\nmodel: {d_model: 64\n", ":3:1", "expected ',' or '}', but got '<stream end>'"),
    ("name: x\n  model: 3\n", ":2:8", "mapping values are not allowed here"),
    ("a: [1, 2\n", ":2:1", "expected ',' or ']', but got '<stream end>'"),
    ("name: x\nname: y\n", ":2:1", "duplicate key 'name'"),
    ("name: !!python/object:os.system x\n", ":1:7",
     "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object:os.system'"),
])
def test_invalid_yaml(tmp_path: Path, text: str, where: str, problem: str) -> None:
    path = _write(tmp_path, text)
    assert error_of(path) == f"{path}{where}: not valid YAML: {problem}"


def test_binary_file(tmp_path: Path) -> None:
    path = _write(tmp_path, b"\x89PNG\r\n\x1a\n\x00\xff")
    assert error_of(path) == f"{path}: not a text file (invalid UTF-8 at byte 0)"


@pytest.mark.parametrize("text, got", [
    ("- name\n- model\n", "the list ['name', 'model']"),
    ("just a string\n", "the string 'just a string'"),
    ("42\n", "the integer 42"),
])
def test_top_level_not_a_mapping(tmp_path: Path, text: str, got: str) -> None:
    path = _write(tmp_path, text)
    assert error_of(path) == (
        f"{path}: the top level must be a mapping (name: ..., model: ...), got {got}")


def test_empty_section_means_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, "name: x\nmodel: {d_model: 64, n_layers: 1, block: lmm, seq_len: 16}\n"
                            "train:\ndata:\n")
    assert load_spec(path).train == spec_module.TrainSpec()


def test_loading_something_else_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        load_spec(42)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- overrides


def test_dict_overrides() -> None:
    spec = load_spec(TINY, {"model.d_model": 128, "train.batch_size": 2, "name": "big"})
    assert (spec.model.d_model, spec.train.batch_size, spec.name) == (128, 2, "big")
    assert spec.path == str(TINY)


def test_overrides_apply_before_validation() -> None:
    raw = edited(model__memory={"chunk_size": 48})  # invalid on its own
    assert load_spec(raw, {"model.memory.chunk_size": 8}).model.memory.chunk_size == 8
    assert error_of(BASE, {"model.memory.chunk_size": 48}) == (
        "model.memory.chunk_size: 48 must divide model.attention.segment=32 (block mac)")


def test_overrides_create_missing_sections() -> None:
    assert load_spec(BASE, {"model.memory.depth": 3}).model.memory.depth == 3
    assert load_spec(BASE, {"compile.target": "cpu"}).compile.target == "cpu"


def test_overrides_on_a_spec_keep_its_path(tiny_spec: Spec) -> None:
    spec = load_spec(tiny_spec, {"model.n_layers": 4})
    assert spec.model.n_layers == 4 and spec.path == tiny_spec.path
    assert dataclasses.replace(spec, path=None) == spec  # path is not part of equality


def test_parse_set_args() -> None:
    parsed = parse_set_args([
        "model.d_model=128", "train.betas=[0.9,0.99]", "train.lr=3e-4",
        "train.remat_budget_mb=null", "model.memory.adaptive=false", "name=2024",
        "data.source=data/notes.txt", "model.block=mal", "train.steps=5", "train.steps=7"])
    assert parsed == {
        "model.d_model": 128, "train.betas": [0.9, 0.99], "train.lr": 3e-4,
        "train.remat_budget_mb": None, "model.memory.adaptive": False, "name": "2024",
        "data.source": "data/notes.txt", "model.block": "mal", "train.steps": 7}
    spec = load_spec(TINY, parsed)
    assert spec.train.betas == (0.9, 0.99) and spec.name == "2024" and spec.model.d_model == 128
    assert spec.model.memory.adaptive is False and spec.train.steps == 7


@pytest.mark.parametrize("overrides, message", [
    ({"model.d_modle": 1}, "unknown key 'model.d_modle'; did you mean 'model.d_model'?"),
    ({"modl.d_model": 1}, "unknown key 'modl.d_model'; did you mean 'model.d_model'?"),
    ({"chunk_size": 8}, "unknown key 'chunk_size'; did you mean 'model.memory.chunk_size'?"),
    ({"model.chunk_size": 8},
     "unknown key 'model.chunk_size'; did you mean 'model.memory.chunk_size'?"),
    ({"modl.memory.dpth": 3}, "unknown key 'modl.memory.dpth'; did you mean 'model.memory.depth'?"),
    ({"model.memory.zzz": 1},
     "unknown key 'model.memory.zzz'; overrides name a field by its dotted path, "
     "e.g. model.d_model"),
    ({"path": "x"},
     "unknown key 'path'; overrides name a field by its dotted path, e.g. model.d_model"),
    ({"zzz.qqq": 1},
     "unknown key 'zzz.qqq'; overrides name a field by its dotted path, e.g. model.d_model"),
    ({"model.attention": {"heads": 2}},
     "model.attention: is a section; override one of its fields, e.g. model.attention.heads"),
    ({"model.d_model": "128"}, "model.d_model: expected an integer, got the string '128'"),
])
def test_bad_overrides(overrides: dict[str, Any], message: str) -> None:
    assert error_of(TINY, overrides) == message


def test_override_through_a_non_mapping() -> None:
    assert error_of(edited(model__memory=5), {"model.memory.depth": 1}) == (
        "model.memory: expected a mapping, got the integer 5")


@pytest.mark.parametrize("items, message", [
    (["model.d_model"], "--set 'model.d_model': expected KEY=VALUE, e.g. --set model.d_model=128"),
    (["=3"], "--set '=3': expected KEY=VALUE, e.g. --set model.d_model=128"),
    (["train.betas=[0.9,"],
     "--set train.betas: value '[0.9,' is not valid YAML: expected the node content, but found "
     "'<stream end>'"),
])
def test_bad_set_args(items: list[str], message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_set_args(items)
    assert str(info.value) == message


# ---------------------------------------------------------------------------------- hashing


def test_spec_hash_is_stable_and_content_based(tmp_path: Path, tiny_spec: Spec) -> None:
    digest = spec_hash(tiny_spec)
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert spec_hash(load_spec(TINY)) == digest
    assert spec_hash(load_spec(spec_to_dict(tiny_spec))) == digest  # path excluded
    copy_path = _write(tmp_path, TINY.read_text(), "copy.yaml")
    assert spec_hash(load_spec(copy_path)) == digest
    assert spec_hash(load_spec(tiny_spec, {"train.lr": 3e-3})) == digest
    assert spec_hash(load_spec(tiny_spec, {"train.seed": 1})) != digest
    assert spec_hash(load_spec(tiny_spec, {"model.memory.adaptive": False})) != digest
    assert spec_hash(load_spec(edited(train={"lr": 1}))) == spec_hash(
        load_spec(edited(train={"lr": 1.0})))


# ------------------------------------------------------------------------------ hostile name

HOSTILE_NAMES = [
    "x'\"\n\"\"\"; __import__('os').system('x') #\r\n{{ name }} {% raw %} ${HOME} `id`",
    "__import__('os').system('touch /tmp/pwned')",
    "", "   ", "123", "class", "../../etc/passwd", "ünïcödé naïve", "a" * 500, "\x00\x1b[31m",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=range(len(HOSTILE_NAMES)))
def test_hostile_name_is_data(tmp_path: Path, name: str) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(edited(name=name)), encoding="utf-8")
    spec = load_spec(path)
    assert spec.name == name
    safe = spec.safe_name
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", safe) and len(safe) <= 69
    assert safe.isidentifier() and not keyword.iskeyword(safe)
    assert load_spec(spec_to_dict(spec)) == spec


def test_safe_name_examples() -> None:
    def safe(name: str) -> str:
        return load_spec(edited(name=name)).safe_name

    assert safe("tiny-mac") == "tiny_mac"
    assert safe("123") == "spec_123"
    assert safe("class") == "class_"
    assert safe("../..") == "spec"
    assert safe("__import__('os').system('x')") == "import_os_system_x"


@pytest.mark.parametrize("limit", [1000, 100_000])
def test_deep_nesting_fails_fast_whatever_the_recursion_limit(tmp_path: Path, limit: int) -> None:
    """`[[[...` 3,000 levels deep, in a --set value and in a spec file, is one error naming the
    nesting (spec.MAX_YAML_DEPTH), under Python's default recursion limit and under a raised
    one (hypothesis raises it while a test runs; the composer then recursed 3,000 levels,
    seconds per parse, and the spec fuzzer's shrinking ran for minutes)."""
    import sys

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        deep = "[" * 3000 + "]" * 3000
        with pytest.raises(SpecError, match="nesting deeper than 64 levels"):
            parse_set_args([f"model.d_model={deep}"])
        path = tmp_path / "deep.yaml"
        path.write_text(f"name: t\nmodel: {deep}\n")
        with pytest.raises(SpecError, match="nesting deeper than 64 levels"):
            load_spec(path)
    finally:
        sys.setrecursionlimit(old)
