"""A titanc model as a `transformers` causal LM, run through titanc's compiled program.

    model = AutoModelForCausalLM.from_pretrained("hf/tiny", trust_remote_code=True)
    logits = model(input_ids).logits                 # (B, T, V)
    out = model.generate(input_ids, max_new_tokens=16, do_sample=False)

The directory is `titanc export RUN --hf DIR`'s (titanc/integrations/hf_export.py). The module
holds the exported weights as ordinary parameters (one tensor per layer, so `state_dict`,
`save_pretrained` and weight inspection work as for any model); the first forward compiles the
spec in config.json (`titanc.compile`) and copies the weights into the program, again whenever
a parameter changed since. Logits come from `Generator.prefill`, the compiled decode graphs
`titanc generate` and `titanc serve` run (whole memory chunks in parallel, then token by token),
so any length works and memory stays constant.

Generation keeps, per row, the decode state after the tokens it has seen: when the next call's
row extends them (as `generate` does, one token a step), only the new tokens run. Rows are read
where `attention_mask` is 1 (left or right padding). Inference only: the parameters receive no
gradients through the program.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

try:
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ModuleNotFoundError as exc:            # pragma: no cover - the extra is missing
    from titanc.errors import TitancError
    raise TitancError("loading a titanc export needs the transformers package; "
                      "pip install transformers") from exc

from titanc.integrations.hf_export import MODEL_TYPE, hf_name

__all__ = ["TitancConfig", "TitancForCausalLM"]


class TitancConfig(PretrainedConfig):
    """config.json of an export: transformers' fields and `titanc_spec`, the run's spec."""
    model_type = MODEL_TYPE

    def __init__(self, titanc_spec: dict[str, Any] | None = None, vocab_size: int = 256,
                 **kwargs: Any):
        self.titanc_spec = titanc_spec or {}
        self.vocab_size = vocab_size
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("use_cache", False)
        super().__init__(**kwargs)


@dataclass
class _Seen:
    """A row's tokens so far, the decode state after them and the last position's logits."""
    ids: list[int]
    state: Any
    last: torch.Tensor                         # (V,)


class TitancForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TitancConfig
    base_model_prefix = ""
    _no_split_modules: list[str] = []
    _keys_to_ignore_on_load_unexpected: list[str] = []

    def __init__(self, config: TitancConfig):
        super().__init__(config)
        from titanc.model.params import param_specs
        from titanc.model.spec import load_spec

        self.spec = load_spec(config.titanc_spec)
        L = self.spec.model.n_layers
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Module() for _ in range(L))
        for p in param_specs(self.spec.model):
            if p.name.startswith("layers."):
                for i in range(L):
                    self._owner(hf_name(p.name, i)).register_parameter(
                        p.name.removeprefix("layers."),
                        nn.Parameter(torch.zeros(tuple(p.shape[1:])), requires_grad=False))
            else:
                self.model.register_parameter(
                    p.name, nn.Parameter(torch.zeros(tuple(p.shape)), requires_grad=False))
        self._program: Any = None
        self._generator: Any = None
        self._synced: tuple[tuple[int, int], ...] | None = None
        self._seen: list[_Seen] = []
        self.post_init()

    def _owner(self, name: str) -> nn.Module:
        """The submodule that holds exported parameter `name`."""
        return self.get_submodule(name.rpartition(".")[0])

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing: every weight comes from model.safetensors."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False                             # the decode state is kept per row, here

    # -- the compiled program ----------------------------------------------------------------
    @property
    def titanc_program(self) -> Any:
        """The titanc Program (compiled on first use) holding this module's weights."""
        self._sync()
        return self._program

    @property
    def titanc_generator(self) -> Any:
        """A titanc Generator over `titanc_program`."""
        self._sync()
        return self._generator

    def _sync(self) -> None:
        """Compile once; copy the weights into the program whenever one changed."""
        import titanc
        from titanc.runtime.serve.generate import Generator

        if self._program is None:
            self._program = titanc.compile(self.config.titanc_spec)
            self._generator = Generator(self._program)
        versions = tuple((id(p), p._version) for p in self.parameters())
        if versions == self._synced:
            return
        params = self._program.parameters()
        sd = {}
        for name, mine in params.items():
            if name.startswith("layers."):
                rows = [self._owner(hf_name(name, i)).get_parameter(name.removeprefix("layers."))
                        for i in range(mine.shape[0])]
                sd[f"param.{name}"] = torch.stack([r.detach() for r in rows])
            else:
                sd[f"param.{name}"] = self.model.get_parameter(name).detach()
        self._program.load_state_dict(sd, strict=False)
        self._synced = versions
        self._seen = []

    # -- forward -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, logits_to_keep: int = 0,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits (B, T, V) of every position, or of the last `logits_to_keep`; with `labels`
        the mean next-token cross-entropy over labels != -100 (shifted, as in transformers)."""
        with torch.no_grad():
            self._sync()
            B, T = input_ids.shape
            keep = T if not logits_to_keep else min(int(logits_to_keep), T)
            V = self.spec.model.vocab_size
            logits = torch.zeros(B, keep, V, dtype=self._program.dtype,
                                 device=self._program.device)
            seen = []
            for b in range(B):
                where = (torch.arange(T) if attention_mask is None
                         else attention_mask[b].nonzero()[:, 0].cpu())
                ids = input_ids[b, where].tolist()
                if not ids:
                    continue
                row, entry = self._row(ids, keep)
                seen.append(entry)
                at = where - (T - keep)
                ok = at >= 0
                logits[b, at[ok]] = row[-int(ok.sum()):] if ok.any() else row[:0]
            self._seen = seen
            logits = logits.to(input_ids.device)
        loss = None
        if labels is not None:
            if keep != T:
                raise ValueError("labels need the logits of every position; leave "
                                 "logits_to_keep at 0")
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, V).float(), labels[:, 1:].reshape(-1),
                ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _row(self, ids: list[int], keep: int) -> tuple[torch.Tensor, _Seen]:
        """Logits of a row's last `keep` tokens (at least those), and what it leaves seen."""
        gen = self._generator
        best = max((s for s in self._seen if len(s.ids) <= len(ids)
                    and ids[:len(s.ids)] == s.ids), key=lambda s: len(s.ids), default=None)
        if keep == 1 and best is not None:
            if len(best.ids) == len(ids):
                return best.last[None], best
            state, lg = gen.prefill(ids[len(best.ids):], best.state)
        else:
            state, lg = gen.prefill(ids)
        lg = lg[0]
        return lg, _Seen(list(ids), state, lg[-1].clone())

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor,
                                      attention_mask: torch.Tensor | None = None,
                                      **kwargs: Any) -> dict[str, Any]:
        """The whole rows every step: `forward` runs only what a row adds to what it saw."""
        inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if kwargs.get("logits_to_keep") is not None:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs
