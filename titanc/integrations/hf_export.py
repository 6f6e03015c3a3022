"""`titanc export RUN --hf DIR`: a trained run as a Hugging Face model directory.

    DIR/config.json              model_type "titanc", auto_map, the run's spec (`titanc_spec`)
    DIR/model.safetensors        the parameters only (no optimizer state), one tensor per layer:
                                 model.embed, model.norm_f, model.layers.<i>.<name>, ...
    DIR/tokenizer.json           the run's tokenizer (a byte-level run gets one whose ids are the
                                 UTF-8 bytes), with tokenizer_config.json for AutoTokenizer
    DIR/configuration_titanc.py  constant code: imports titanc's config class
    DIR/modeling_titanc.py       constant code: imports titanc's model class

`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` then compiles the spec in
config.json with titanc and runs the exported weights through the compiled program
(titanc/integrations/hf_modeling.py). The two .py files are the same bytes for every export:
everything that differs between models is data in config.json. Exporting needs no
`transformers`; loading the directory needs titanc and `transformers` installed.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:                  # the CLI registers `export` without importing torch
    import torch

from titanc.errors import TitancError, printable

__all__ = ["export_hf", "hf_name", "titanc_name", "add_command", "MODEL_TYPE"]

MODEL_TYPE = "titanc"
WEIGHTS = "model.safetensors"
LAYER_PREFIX = "layers."

CONFIGURATION_PY = '''\
"""titanc's configuration class for `transformers` (written by `titanc export --hf`; the same
code for every model: the model itself is the data in config.json)."""
from titanc.integrations.hf_modeling import TitancConfig

__all__ = ["TitancConfig"]
'''

MODELING_PY = '''\
"""titanc's causal LM for `transformers` (written by `titanc export --hf`; the same code for
every model). It compiles the spec in config.json with titanc and runs model.safetensors
through the compiled program: titanc must be installed where this directory is loaded."""
from titanc.integrations.hf_modeling import TitancConfig, TitancForCausalLM

__all__ = ["TitancConfig", "TitancForCausalLM"]
'''


# -- parameter names ---------------------------------------------------------------------------

def hf_name(name: str, layer: int | None = None) -> str:
    """The exported name of titanc parameter `name` (of one layer when stacked)."""
    if name.startswith(LAYER_PREFIX):
        return f"model.layers.{layer}.{name[len(LAYER_PREFIX):]}"
    return f"model.{name}"


def titanc_name(hf: str) -> tuple[str, int | None]:
    """(titanc parameter name, layer or None) of an exported name."""
    rest = hf.removeprefix("model.")
    if rest.startswith(LAYER_PREFIX):
        layer, _, name = rest[len(LAYER_PREFIX):].partition(".")
        return LAYER_PREFIX + name, int(layer)
    return rest, None


def unstack(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """titanc's parameters (layer tensors stacked on dim 0) as exported tensors, one per layer."""
    out: dict[str, "torch.Tensor"] = {}
    for name, t in params.items():
        if name.startswith(LAYER_PREFIX):
            for i in range(t.shape[0]):
                out[hf_name(name, i)] = t[i].detach().clone().contiguous()
        else:
            out[hf_name(name)] = t.detach().clone().contiguous()
    return out


# -- the export --------------------------------------------------------------------------------

def export_hf(run: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """Write the Hugging Face directory of a run directory or checkpoint file `run` into
    `out` (a new or empty directory, or an earlier titanc export, which is replaced). Returns
    a summary {out, step, parameters, tokenizer, files}."""
    from titanc.model.spec import load_spec, spec_hash
    from titanc.runtime.train.checkpoint import checkpoint_path, expected_state, load_checkpoint
    from titanc.runtime.train.rundir import run_tokenizer

    out = Path(out)
    _check_out(out)
    ckpt = checkpoint_path(run, flag="RUN")
    tensors, meta = load_checkpoint(ckpt)
    spec = load_spec(meta["spec"])
    tok = run_tokenizer(run)
    shapes = {k.removeprefix("param."): s for k, s in expected_state(spec).items()
              if k.startswith("param.")}
    params = {k.removeprefix("param."): t for k, t in tensors.items() if k.startswith("param.")}
    missing = sorted(set(shapes) - set(params))
    if missing:
        raise TitancError(f"checkpoint {printable(str(ckpt))} lacks parameter {missing[0]!r} "
                          f"of its own spec; it is damaged, export another checkpoint")
    weights = unstack({k: params[k] for k in shapes})
    tmp = out.parent / f".{out.name}.export-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        _write_dir(tmp, spec, meta, weights, tok, spec_hash(spec))
        if out.exists():
            shutil.rmtree(out)                 # _check_out: empty, or an earlier titanc export
        os.replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TitancError(f"--hf {printable(str(out))}: could not write the export "
                          f"({exc.strerror or exc}); choose a writable directory") from None
    return {"out": str(out), "step": int(meta["step"]),
            "parameters": sum(t.numel() for t in weights.values()),
            "tokenizer": getattr(tok, "name", "byte"), "files": sorted(os.listdir(out))}


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise TitancError(f"--hf {printable(str(out))} is a file; name a new directory")
    if out.is_dir() and any(out.iterdir()) and not _is_export(out):
        raise TitancError(f"--hf {printable(str(out))} is not empty and holds no titanc "
                          f"export; name a new or empty directory")


def _is_export(d: Path) -> bool:
    try:
        return json.loads((d / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def _write_dir(d: Path, spec: Any, meta: dict[str, Any], weights: dict[str, torch.Tensor],
               tok: Any, digest: str) -> None:
    from safetensors.torch import save_file

    from titanc.runtime.data.tokenizer import BPETokenizer

    save_file(weights, str(d / WEIGHTS), metadata={"format": "pt"})
    eot = getattr(tok, "eot", None)
    text = tok.text if isinstance(tok, BPETokenizer) else json.dumps(byte_tokenizer_json())
    (d / "tokenizer.json").write_text(text, encoding="utf-8")
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                  "model_max_length": 1_000_000_000}
    if eot is not None:
        from titanc.runtime.data.tokenizer import EOT_TOKEN
        tok_config.update(eos_token=EOT_TOKEN, pad_token=EOT_TOKEN)
    (d / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (d / "config.json").write_text(json.dumps(config_dict(spec, meta, eot, digest), indent=2)
                                   + "\n")
    (d / "configuration_titanc.py").write_text(CONFIGURATION_PY)
    (d / "modeling_titanc.py").write_text(MODELING_PY)


def config_dict(spec: Any, meta: dict[str, Any], eot: int | None, digest: str) -> dict[str, Any]:
    """config.json: what transformers reads (model_type, auto_map, sizes, special ids) and
    what titanc compiles (`titanc_spec`, the run's spec as data)."""
    from titanc.model.spec import spec_to_dict
    from titanc.version import __version__

    m = spec.model
    return {
        "model_type": MODEL_TYPE, "architectures": ["TitancForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_titanc.TitancConfig",
                     "AutoModelForCausalLM": "modeling_titanc.TitancForCausalLM"},
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "num_hidden_layers": m.n_layers,
        "block": m.block, "training_seq_len": m.seq_len,
        "bos_token_id": None, "eos_token_id": eot, "pad_token_id": eot,
        "tie_word_embeddings": False, "use_cache": False,
        "dtype": spec.train.master_dtype,
        "titanc_spec": spec_to_dict(spec),
        "titanc_source": {"step": int(meta["step"]), "spec_hash": digest,
                          "titanc_version": __version__},
    }


def byte_tokenizer_json() -> dict[str, Any]:
    """A `tokenizers` JSON whose ids are UTF-8 bytes, as titanc's byte tokenizer's: byte-level
    pre-tokenization maps each byte to one printable character, and a BPE model without merges
    maps that character to the byte's value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return json.loads(tok.to_str())


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the ByteLevel alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# -- the command -------------------------------------------------------------------------------

def add_command(commands: Any) -> None:
    """Register `titanc export` on the CLI's subparsers."""
    import argparse

    export = commands.add_parser(
        "export", help="write a trained run as a Hugging Face model directory",
        description="Write RUN (a run directory or checkpoint file) as a Hugging Face model\n"
                    "directory: config.json, weights-only model.safetensors, tokenizer.json and\n"
                    "a modeling file that runs the model through titanc's compiled program.",
        epilog="example:\n  titanc export runs/tiny --hf hf/tiny\n"
               "  python -c \"from transformers import AutoModelForCausalLM as M; "
               "M.from_pretrained('hf/tiny', trust_remote_code=True)\"",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("source", metavar="RUN", help="run directory or checkpoint file")
    export.add_argument("--hf", metavar="DIR", required=True,
                        help="the directory to write (new, empty, or an earlier export)")
    export.set_defaults(run=_cmd_export)


def _cmd_export(args: Any) -> int:
    s = export_hf(args.source, args.hf)
    print(f"exported {printable(str(args.source))} (step {s['step']}, {s['parameters']:,} "
          f"parameters) -> {printable(s['out'])}: {', '.join(s['files'])}")
    print(f"  load: AutoModelForCausalLM.from_pretrained({s['out']!r}, trust_remote_code=True)")
    return 0
