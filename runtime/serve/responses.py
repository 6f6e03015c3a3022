"""A completion's response assembled from engine updates, in linear time, within a size limit.

`Choice` absorbs a choice's updates (text, tokens, logprobs). Each token's `text_offset` (the
character offset of its text in the choice's text) comes from `Offsets`, which decodes only
the tokens since the last whole character (`codec.IncrementalText`), so a choice of n tokens
costs O(n) decoding, not the O(n^2) of decoding every prefix. Log-probabilities that are not
finite are sent as null (JSON has no NaN; the engine also ends a request whose output is
not finite).

`response_bound` is the most bytes a request's response can take, from its parameters alone
(choices x (echoed prompt + max_tokens) x the bytes a token can cost with its logprobs): a
request whose bound passes `--max-response-bytes` is refused before it runs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from titanc.runtime.serve.codec import IncrementalText
from titanc.runtime.serve.completions import CompletionParams
from titanc.runtime.serve.engine import TokenLogprob, Update

__all__ = ["Choice", "Offsets", "response_bound", "render", "max_token_bytes"]

JSON_CHAR = 6                # the most JSON bytes one byte of text becomes (\\u00XX)
NUMBER = 26                  # a float as JSON with its separator ("-0.12345678901234567, ")
ENTRY = 8                    # quotes, colon, comma around one top_logprobs entry
NAME = 16                    # the JSON of a byte token's name, "bytes:\\xNN"


class Offsets:
    """Character offsets of tokens in the text they decode to (`IncrementalText`: O(1)
    decoding per token), plus `base` characters before them."""

    def __init__(self, codec: Any, base: int = 0):
        self.base, self.tokens, self.decoded = base, [], IncrementalText(codec)

    def next(self, token: int) -> int:
        """The offset at which `token` starts; then `token` is part of the text."""
        start = self.base + len(self.decoded.text(self.tokens))
        self.tokens.append(token)
        return start


@dataclass
class Choice:
    """One choice being assembled from engine updates."""
    index: int
    prompt: list[int]
    prompt_text: str
    echo: bool
    logprobs: bool
    codec: Any
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    lp_tokens: list[str] = field(default_factory=list)
    lp_values: list[float | None] = field(default_factory=list)
    lp_top: list[dict[str, float | None] | None] = field(default_factory=list)
    lp_offset: list[int] = field(default_factory=list)
    started: bool = False
    _offsets: Offsets | None = None

    def add(self, up: Update) -> tuple[str, dict | None]:
        """Absorb an update; returns the text delta and the logprobs of this delta."""
        delta = up.text
        if not self.started:
            self.started = True
            if self.echo:
                delta = self.prompt_text + delta
        self.text += delta
        self.tokens += up.tokens
        if self.finish_reason is None:
            self.finish_reason, self.error = up.finish_reason, up.error
        if not self.logprobs:
            return delta, None
        n0 = len(self.lp_tokens)
        if up.prompt_logprobs is not None:
            self._add_lp(up.prompt_logprobs, Offsets(self.codec))
        if self._offsets is None:
            self._offsets = Offsets(self.codec, len(self.prompt_text) if self.echo else 0)
        self._add_lp(up.logprobs, self._offsets)
        return delta, {"tokens": self.lp_tokens[n0:], "token_logprobs": self.lp_values[n0:],
                       "top_logprobs": self.lp_top[n0:], "text_offset": self.lp_offset[n0:]}

    def _add_lp(self, lps: list[TokenLogprob], offsets: Offsets) -> None:
        token_str = self.codec.token_str
        for lp in lps:
            self.lp_tokens.append(token_str(lp.token))
            self.lp_values.append(_finite(lp.logprob))
            self.lp_top.append(None if lp.top is None else
                               {token_str(t): _finite(v) for t, v in lp.top.items()})
            self.lp_offset.append(offsets.next(lp.token))

    def logprobs_body(self) -> dict | None:
        if not self.logprobs:
            return None
        return {"tokens": self.lp_tokens, "token_logprobs": self.lp_values,
                "top_logprobs": self.lp_top, "text_offset": self.lp_offset}


def _finite(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else None


def render(body: Any) -> bytes:
    """A response body as JSON bytes (UTF-8; never NaN: ValueError if one slipped through)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")


def max_token_bytes(codec: Any) -> int:
    """The most UTF-8 bytes one token stands for, from the tokenizer's vocabulary (computed
    once per codec; at least 4: U+FFFD, an id past the tokenizer, is 3)."""
    cached = getattr(codec, "_max_token_bytes", None)
    if cached is not None:
        return cached
    sizes = getattr(getattr(codec, "tok", None), "token_bytes", None)
    longest = 4
    if sizes is not None:
        try:
            longest = max(longest, int(max(sizes())))
        except (TypeError, ValueError):
            pass
    try:
        codec._max_token_bytes = longest
    except AttributeError:
        pass
    return longest


def response_bound(params: CompletionParams, codec: Any) -> int:
    """The most bytes a response to `params` can take (see the module docstring): a byte of
    text is at most JSON_CHAR bytes of JSON (a control character as \\u00XX)."""
    text = JSON_CHAR * max_token_bytes(codec)
    name = max(text, NAME)                            # a token's name: its text or bytes:\\xNN
    per_token = text
    if params.logprobs is not None:
        per_token += name + 2 * NUMBER + params.logprobs * (name + NUMBER + ENTRY)
    echoed = [len(p) if params.echo else 0 for p in params.prompts]
    tokens = sum((e + params.max_tokens) * params.n for e in echoed)
    return 1024 + tokens * per_token
