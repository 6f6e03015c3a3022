"""A typed model config for the reference's own tests.

The real spec objects (titanc's) expose the same attribute names; the reference reads
nothing else, so either kind can be passed to `forward_loss` / `forward_logits`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RefAttention:
    heads: int = 2
    window: int = 4  # sliding window W (attn, mag, mal); mac has no window
    segment: int = 8  # MAC segment length S
    persistent_tokens: int = 2  # P


@dataclass(frozen=True)
class RefMemory:
    heads: int = 2  # Nm
    depth: int = 2  # Ld
    expansion: int = 2  # E: hidden width h = E * d
    chunk_size: int = 4  # b
    adaptive: bool = True  # data-dependent theta/eta/alpha, else the constants below
    lr_max: float = 0.5
    momentum: float = 0.9
    decay: float = 0.05
    decay_max: float = 1.0  # adaptive alpha = decay_max * sigmoid(.)
    output_gate: bool = True
    conv_kernel: int = 4  # K
    qk_activation: str = "silu"  # 'silu' | 'none': activation of q, k before l2norm
    momentum_form: str = "heavy_ball"  # 'heavy_ball' S = ηS - θg | 'ema' S = ηS - (1-η)θg
    mac_write: str = "attention"  # mac: 'attention' writes ỹ | 'attention_norm' rmsnorm(ỹ) | 'input' u_s
    mac_read: str = "context"  # mac: 'context' | 'residual' also adds h to the output
    gate: str = "memory"  # mac, mag: 'memory' read gates the attention output | 'attention' output gates the read
    fixed: tuple[str, ...] = ()  # adaptive: gates held at their constants (theta, eta, alpha)
    read: str = "before_write"  # 'before_write' chunk-start state | 'after_write' after the token's write
    decay_order: str = "after_grad"  # 'after_grad' | 'before_grad': the gradient at (1 - alpha) W
    decay_form: str = "sigmoid"  # 'sigmoid' | 'mamba2': alpha = 1 - exp(-exp(A) softplus(x))
    value_width: int | None = None  # per-head width of v and of the read; None: d
    objective: str = "l2"  # 'l2' | 'huber' | 'lp': the inner objective's rho(M(k) - v)
    huber_delta: float | None = None  # huber: the threshold (None: 1)
    lp_p: float | None = None  # lp: the power (None: 3)
    inner: str = "mlp"  # 'mlp' | 'ln_residual': the write fits k + w layer_norm(W k) + b (depth 1)
    post_norm: bool = False  # ln_residual: the read y becomes y + w layer_norm(y) + b


@dataclass(frozen=True)
class RefModelConfig:
    vocab_size: int = 32
    d_model: int = 16
    n_layers: int = 2
    block: str = "lmm"  # 'attn' | 'lmm' | 'mag' | 'mal' | 'mac'
    seq_len: int = 16
    tie_embeddings: bool = False
    ffn_hidden: int | None = 32  # None: nearest multiple of 8 to 8/3 * d_model
    attention: RefAttention = field(default_factory=RefAttention)
    memory: RefMemory = field(default_factory=RefMemory)
