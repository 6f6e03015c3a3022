"""titanc: a compiler for Titans-style language models with neural long-term memory."""
from __future__ import annotations

from typing import Any

from .errors import SpecError, TitancError
from .spec import Spec, load_spec

__version__ = "0.1.0"


def compile(spec: Any, **overrides: Any) -> "Program":
    """Compile a spec (path, dict or Spec; overrides by dotted path) into a runnable Program."""
    from titanc.compiler import compile_graphs
    from titanc.runtime.program import Program

    return Program(compile_graphs(load_spec(spec, overrides or None)))


def load(path: Any, **overrides: Any) -> "Program":
    """Reopen a run directory / checkpoint (weights included) or a compiled artifact
    directory (fresh weights from its spec)."""
    import json
    from pathlib import Path

    from titanc.runtime.checkpoint import checkpoint_path, load_checkpoint, restore

    p = Path(path)
    manifest = p / "manifest.json"
    if p.is_dir() and manifest.exists() and not (p / "checkpoint.safetensors").exists():
        try:
            spec_dict = json.loads(manifest.read_text())["spec"]
        except (OSError, ValueError, KeyError):
            raise TitancError(f"{manifest} is not a titanc manifest; recompile with "
                              f"'titanc compile'") from None
        return compile({**spec_dict, "name": spec_dict.get("name", "spec")}, **overrides)
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
