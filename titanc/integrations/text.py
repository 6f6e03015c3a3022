"""Text in, text out: a run's model and its own tokenizer, loaded together.

    from titanc.integrations.text import TextGenerator
    tg = TextGenerator("runs/notes")                       # titanc.load + the run's tokenizer
    tg.generate("Once upon", 64, temperature=0)            # -> the continuation, a str
    tg.generate(["a", "b"], 16)                            # -> one continuation per prompt
    for piece in tg.stream("Once upon", 64): print(piece, end="")
    tg.score("The sky is", " blue")                        # -> log p(" blue" | "The sky is")

A thin layer over `Generator` (runtime/serve/generate.py), which takes token ids: prompts are
encoded with the run's tokenizer (the one `titanc generate` uses, checked against what the
checkpoint recorded), outputs decoded with it, and streamed text never splits a character
(`StreamDecoder`). Sampling is `Sampling`'s fields as keywords (temperature, top_k, top_p,
seed, stop) or a `Sampling`.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from titanc.errors import TitancError

__all__ = ["TextGenerator"]


class TextGenerator:
    """`source`: a run directory or checkpoint file (its weights and tokenizer), or a Program
    with `tokenizer` (a Tokenizer, a tokenizer.json path or "byte"; default: what the
    program's spec names in data.tokenizer)."""

    def __init__(self, source: Any, tokenizer: Any = None):
        import titanc
        from titanc.runtime.data.tokenizer import check_vocab, load_tokenizer
        from titanc.runtime.program import Program
        from titanc.runtime.serve.generate import Generator
        from titanc.runtime.train.rundir import run_tokenizer

        if isinstance(source, Program):
            prog = source
            tok = load_tokenizer(tokenizer if tokenizer is not None else prog.spec)
        elif isinstance(source, (str, os.PathLike)):
            if tokenizer is not None:
                raise TitancError("TextGenerator: a run carries its own tokenizer; pass "
                                  "tokenizer= only with a Program")
            prog, tok = titanc.load(source), run_tokenizer(source)
        else:
            raise TypeError(f"TextGenerator: source must be a run directory, a checkpoint file "
                            f"or a Program, got {type(source).__name__}")
        check_vocab(prog.spec, tok)
        self.tokenizer = tok
        self.generator = Generator(prog, tok)

    @property
    def program(self) -> Any:
        return self.generator.prog

    def encode(self, text: str, what: str = "prompt") -> list[int]:
        if not isinstance(text, str):
            raise TitancError(f"{what}: expected text (a str), got {type(text).__name__}; "
                              f"Generator takes token ids")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise TitancError(f"{what}: {ascii(text)[:40]} is not valid Unicode (a lone "
                              f"surrogate)") from None
        ids = list(self.tokenizer.encode(text))
        if not ids:
            raise TitancError(f"{what}: {text!r} encodes to no tokens; give some text")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 64,
                 sampling: Any = None, **fields: Any) -> str | list[str]:
        """The continuation of one prompt (a str), or of each of a list of prompts."""
        one = isinstance(prompts, str)
        texts = [prompts] if one else _texts(prompts)
        ids = [self.encode(t) for t in texts]
        outs = self.generator.generate(ids, max_new_tokens, self._sampling(sampling, fields))
        decoded = [self.decode(o) for o in outs]
        return decoded[0] if one else decoded

    def stream(self, prompt: str, max_new_tokens: int = 64, sampling: Any = None,
               **fields: Any) -> Iterator[str]:
        """Pieces of one prompt's continuation as tokens are sampled (whole characters)."""
        from titanc.runtime.data.tokenizer import StreamDecoder

        ids = self.encode(prompt)
        out = StreamDecoder(self.tokenizer)
        for _, tok in self.generator.stream([ids], max_new_tokens,
                                            self._sampling(sampling, fields)):
            piece = out.push(tok)
            if piece:
                yield piece
        rest = out.flush()
        if rest:
            yield rest

    def score(self, context: str, continuation: str) -> float:
        """log p(continuation | context): the sum over the continuation's tokens (the text is
        encoded whole, then split where the context's tokens end)."""
        ctx = self.encode(context, "context")
        whole = self.encode(context + continuation, "continuation")
        if whole[:len(ctx)] != ctx or len(whole) == len(ctx):
            raise TitancError("score: the context's tokens are not a prefix of the whole "
                              "text's (a token spans the boundary), or the continuation is "
                              "empty; move the boundary, e.g. start the continuation with a space")
        _, logits = self.generator.prefill(whole[:-1])
        lp = torch.log_softmax(logits[0, len(ctx) - 1:].double(), -1)
        return float(lp.gather(1, torch.tensor(whole[len(ctx):])[:, None]).sum())

    @staticmethod
    def _sampling(sampling: Any, fields: dict[str, Any]) -> Any:
        from titanc.runtime.serve.generate import Sampling

        if sampling is not None and fields:
            raise TitancError("pass a Sampling or its fields as keywords, not both")
        if sampling is not None:
            return sampling
        unknown = sorted(set(fields) - {"temperature", "top_k", "top_p", "seed", "stop"})
        if unknown:
            raise TitancError(f"unknown sampling field {unknown[0]!r}; the fields are "
                              f"temperature, top_k, top_p, seed and stop")
        return Sampling(**fields)


def _texts(prompts: Any) -> list[str]:
    if isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Sequence) or not prompts:
        raise TitancError(f"prompts: expected a str or a non-empty list of str, got "
                          f"{type(prompts).__name__}")
    return list(prompts)
