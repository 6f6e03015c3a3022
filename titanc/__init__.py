"""titanc: a compiler for Titans-style language models with neural long-term memory."""
from __future__ import annotations

from typing import Any

from titanc.errors import SpecError, TitancError, size_overflow
from titanc.model.spec import Spec, load_spec
from titanc.version import __version__


def compile(spec: Any, **overrides: Any) -> "Program":
    """Compile a model spec into a runnable Program.

    Args:
        spec: a path to a YAML spec file, a mapping shaped like that YAML, or a `Spec`
            (from `titanc.load_spec`).
        **overrides: spec fields by dotted path, applied before validation; Python keywords
            cannot hold dots, so pass them as a dict: `titanc.compile("examples/tiny.yaml",
            **{"model.d_model": 128, "train.batch_size": 2})`.

    Returns:
        A `Program` holding freshly initialised parameters: `train_step(tokens)`,
        `loss(tokens)`, `logits(tokens)`, `grads(tokens)`, `parameters()`, `state_dict()`;
        tokens are int64 ids in [0, model.vocab_size) shaped [batch, seq_len + 1]. Generate
        text with `titanc.runtime.serve.generate.Generator(program)`.

    Raises:
        SpecError: the spec is invalid (the message names the field and the fix).
        TitancError: the buffer plan needs more memory than this machine has.

    Example:
        >>> prog = titanc.compile("examples/tiny.yaml", **{"train.batch_size": 2})
        >>> loss = prog.train_step(tokens)        # tokens: [2, 129] int64
    """
    from titanc.compiler import compile_graphs
    from titanc.fit import lower_bound_bytes
    from titanc.runtime.capacity import check_fits
    from titanc.runtime.program import Program

    spec = load_spec(spec, overrides or None)
    check_fits(lower_bound_bytes(spec), spec, lower=True)   # before any time is spent
    try:
        compiled = compile_graphs(spec, dumps=False)
    except (OverflowError, MemoryError, RuntimeError, TypeError) as exc:
        if not size_overflow(exc):        # each field is bounded (titanc/bounds.py); their
            raise                         # product may still pass what torch indexes
        raise TitancError(f"the spec's sizes are past what torch can index or this process "
                          f"can hold ({type(exc).__name__} while compiling); reduce "
                          f"train.batch_size, model.seq_len, model.d_model or "
                          f"model.vocab_size") from None
    return Program(compiled)


def load(path: Any, **overrides: Any) -> "Program":
    """Reopen a run directory / checkpoint (weights included) or a compiled artifact
    directory (fresh weights from its spec)."""
    import json
    import os
    from pathlib import Path

    from titanc.runtime.train.checkpoint import checkpoint_path, load_checkpoint, restore

    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise TypeError(f"titanc.load: path must be a str or os.PathLike naming a run "
                        f"directory, a checkpoint file or a compiled artifact directory, got "
                        f"{type(path).__name__}")
    if os.fspath(path) == "":
        raise TitancError("titanc.load: path is empty; pass a run directory, a checkpoint "
                          "file or a compiled artifact directory ('.' for this one)")
    p = Path(path)
    if p.suffix in (".yaml", ".yml", ".json") and p.is_file():
        raise TitancError(f"titanc.load: {p} is a spec or metadata file, not a run, checkpoint "
                          f"or artifact; compile a spec with titanc.compile({str(p)!r}), or "
                          f"load the directory that holds it")
    manifest = p / "manifest.json"
    if p.is_dir() and manifest.exists() and not (p / "checkpoint.safetensors").exists():
        try:
            spec_dict = json.loads(manifest.read_text())["spec"]
        except (OSError, ValueError, KeyError, TypeError):
            spec_dict = None
        if not isinstance(spec_dict, dict):
            raise TitancError(f"{manifest} is not a titanc manifest (no spec mapping); "
                              f"recompile with 'titanc compile'")
        spec_dict = {**spec_dict, "name": spec_dict.get("name", "spec")}
        try:
            load_spec(spec_dict)             # the artifact's own spec, before the overrides
        except SpecError as exc:
            raise SpecError(f"{manifest}: its spec is invalid ({exc}); recompile with "
                            f"'titanc compile'") from None
        return compile(spec_dict, **overrides)
    ckpt = checkpoint_path(p, flag="load")
    tensors, meta = load_checkpoint(ckpt)
    prog = compile(meta["spec"], **overrides)
    restore(prog, tensors, meta, path=ckpt)
    return prog


def __getattr__(name: str) -> Any:
    if name == "Program":
        from titanc.runtime.program import Program
        return Program
    raise AttributeError(name)


__all__ = ["compile", "load", "load_spec", "Spec", "SpecError", "TitancError", "__version__"]
