"""The `titanc` model of lm-evaluation-harness (`lm_eval`).

    import titanc.integrations.lm_eval                   # registers the model "titanc"
    lm_eval.simple_evaluate(model="titanc", model_args="run=runs/notes", tasks=[...])
    python -m titanc.integrations.lm_eval run --model titanc --model_args run=runs/notes \\
        --tasks hellaswag                                 # lm-eval's own CLI, model registered

Every score comes from titanc's compiled decode program (`Generator.prefill`, the graphs
`titanc generate` runs): the log-probability of a continuation is the sum, over its tokens, of
log_softmax of the logits at the position before each. Contexts of any length are read whole
(the memory keeps what the attention window drops), so nothing is truncated or windowed.

- loglikelihood: the context runs once per distinct context; each continuation continues its
  decode state. `is_greedy`: every continuation token is its position's argmax.
- loglikelihood_rolling: the whole text after one prefix token (the tokenizer's end-of-text,
  or `prefix_token`; a byte-level run has none and uses "\\n", byte 10).
- generate_until: `Generator.generate`, greedy unless `do_sample` (then `temperature`,
  `top_k`, `top_p`), stopped at `max_gen_toks` or the first `until` string, which is cut off.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from titanc.errors import TitancError

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ModuleNotFoundError as exc:            # pragma: no cover - the extra is missing
    raise TitancError("the titanc lm-eval model needs lm-evaluation-harness; "
                      "pip install lm-eval") from exc

__all__ = ["TitancLM"]

BYTE_PREFIX = 10                 # "\n": the prefix token of a tokenizer without end-of-text
CONTEXTS_KEPT = 64               # decode states of recent contexts kept for their continuations


@register_model("titanc")
class TitancLM(TemplateLM):
    """A titanc run for lm-eval: `run` (a run directory or checkpoint file), or `program`
    (titanc.compile / titanc.load) with `tokenizer` (runtime/data/tokenizer.py; default the
    byte tokenizer). lm-eval's batch_size / device arguments are accepted and unused: requests
    run one at a time on the program's own device."""

    def __init__(self, run: str | os.PathLike | None = None, *, program: Any = None,
                 tokenizer: Any = None, prefix_token: int | str | None = None,
                 max_gen_toks: int | str = 256, **lm_eval_args: Any):
        super().__init__()
        import titanc
        from titanc.runtime.data.tokenizer import ByteTokenizer
        from titanc.runtime.serve.generate import Generator
        from titanc.runtime.train.rundir import run_tokenizer

        if (run is None) == (program is None):
            raise TitancError("the titanc lm-eval model needs run=RUN (a run directory or "
                              "checkpoint) or program=PROGRAM, not both")
        if run is not None:
            program, tokenizer = titanc.load(run), run_tokenizer(run)
        self.tok = tokenizer if tokenizer is not None else ByteTokenizer()
        self.gen = Generator(program, self.tok)
        self.vocab_size = program.spec.model.vocab_size
        eot = getattr(self.tok, "eot", None)
        prefix = (_integer(prefix_token, "prefix_token") if prefix_token is not None
                  else eot if eot is not None else BYTE_PREFIX)
        if not 0 <= prefix < self.vocab_size:
            raise TitancError(f"prefix_token: {prefix} is outside the vocabulary "
                              f"[0, {self.vocab_size}); pass prefix_token=ID")
        self._prefix = prefix
        self.max_gen_toks = _integer(max_gen_toks, "max_gen_toks")
        if self.max_gen_toks < 0:
            raise TitancError(f"max_gen_toks: {self.max_gen_toks} must be >= 0")
        self._contexts: OrderedDict[tuple[int, ...], tuple[Any, torch.Tensor]] = OrderedDict()

    # -- what TemplateLM needs ---------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._prefix

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tok, "name", "byte"))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        return list(self.tok.encode(string))

    def tok_decode(self, ids: list[int], **kwargs: Any) -> str:
        return self.tok.decode(ids)

    # -- scoring -------------------------------------------------------------------------------
    def _context(self, ids: list[int]) -> tuple[Any, torch.Tensor]:
        """(decode state after `ids`, log-probabilities of the next token (V,)), kept for the
        continuations that share the context."""
        key = tuple(ids)
        if key not in self._contexts:
            state, logits = self.gen.prefill(ids)
            self._contexts[key] = (state, torch.log_softmax(logits[0, -1].double(), -1))
            while len(self._contexts) > CONTEXTS_KEPT:
                self._contexts.popitem(last=False)
        self._contexts.move_to_end(key)
        return self._contexts[key]

    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """(sum of log p(continuation token | everything before it), all greedy)."""
        if not continuation:
            return 0.0, True
        state, first = self._context(context or [self._prefix])
        rows = [first]
        if len(continuation) > 1:
            _, logits = self.gen.prefill(continuation[:-1], state)
            rows.extend(torch.log_softmax(logits[0].double(), -1))
        lp = torch.stack(rows)                                         # (n, V)
        target = torch.tensor(continuation)
        total = float(lp.gather(1, target[:, None]).sum())
        return total, bool((lp.argmax(-1) == target).all())

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        out = []
        for key, context, continuation in requests:
            result = self.score(context, continuation)
            self.cache_hook.add_partial("loglikelihood", key, result)
            out.append(result)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            total, _ = self.score([self._prefix], self.tok_encode(text))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    # -- generation ----------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from titanc.runtime.serve.generate import Sampling

        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            sample = bool(kwargs.get("do_sample", False))
            sampling = Sampling(temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                                top_k=kwargs.get("top_k") if sample else None,
                                top_p=kwargs.get("top_p") if sample else None,
                                seed=int(kwargs.get("seed", 0) or 0), stop=tuple(until))
            n = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            prompt = self.tok_encode(context) or [self._prefix]
            (ids,) = self.gen.generate([prompt], n, sampling)
            text = self.tok_decode(ids)
            cut = min((text.find(s) for s in until if s and s in text), default=len(text))
            text = text[:cut]
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            out.append(text)
        return out


def _integer(value: Any, name: str) -> int:
    """A model argument as an int (lm-eval passes model_args strings through as text)."""
    try:
        if isinstance(value, bool) or isinstance(value, float):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise TitancError(f"{name}: {value!r} is not an integer; pass {name}=N") from None


def main() -> None:
    """lm-eval's command line with the titanc model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
