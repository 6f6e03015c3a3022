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


def __getattr__(name: str) -> Any:
    if name == "Program":
        from titanc.runtime.program import Program
        return Program
    raise AttributeError(name)


__all__ = ["compile", "load_spec", "Spec", "SpecError", "TitancError", "__version__"]
