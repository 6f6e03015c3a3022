"""Independent eager PyTorch reference of docs/semantics.md: the numerical oracle for titanc.

Shares nothing with the compiler but the parameter names; imports nothing from titanc.
"""

from .config import RefAttention, RefMemory, RefModelConfig
from .memory import chunk_token_loop, inner_grads, mem_apply, memory_scan
from .model import forward_logits, forward_loss
from .params import init_params, param_specs

__all__ = [
    "RefAttention",
    "RefMemory",
    "RefModelConfig",
    "chunk_token_loop",
    "forward_logits",
    "forward_loss",
    "init_params",
    "inner_grads",
    "mem_apply",
    "memory_scan",
    "param_specs",
]
