"""The tokenizer behind the server: one object with encode / decode / token_str.

`codec_for` is the one place the server chooses: the tokenizer the run or artifact directory
names (`runtime.data.tokenizer.load_tokenizer`: its tokenizer.json, else the spec's
`data.tokenizer`, byte-level by default), wrapped with the per-token text that logprobs need.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from titanc.runtime.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer


REPLACEMENT = "\ufffd"
SETTLE_AFTER = 16            # tokens a tail may reach before a boundary inside it is looked for
PENDING = 4                  # the last tokens of such a tail stay pending: a UTF-8 character
                             # begun before them is decided within its next 3 bytes


class IncrementalText:
    """`text(tokens)` equals `codec.decode(tokens)` for a sequence that only grows, decoding
    only the tokens since the last settled boundary, each decoded after the token before it
    (a decoder that treats a sequence's first token apart, SentencePiece's leading space,
    still sees it inside). A boundary settles where the text ends in a whole character; a
    tail of SETTLE_AFTER tokens that never does (invalid bytes) settles at its last point k,
    PENDING tokens or more from its end, where decoding the two sides apart gives the same
    text as decoding them together."""

    def __init__(self, codec: Any):
        self.codec = codec
        self.settled = ""                 # decode(tokens[:n])
        self.n = 0
        self._ctx: list[int] = []         # tokens[n - 1:n]

    def text(self, tokens: Sequence[int]) -> str:
        tail = list(tokens[self.n:])
        if not tail:
            return self.settled
        new = self._after(self._ctx, tail)
        if not new.endswith(REPLACEMENT):
            return self._settle(tokens, tail, new)
        if len(tail) >= SETTLE_AFTER:
            for k in range(len(tail) - PENDING, 0, -1):
                head = self._after(self._ctx, tail[:k])
                if head + self._after(tail[k - 1:k], tail[k:]) == new:
                    self._settle(tokens[:self.n + k], tail[:k], head)
                    return self.settled + self._after(self._ctx, tail[k:])
        return self.settled + new

    def _after(self, ctx: list[int], toks: list[int]) -> str:
        """The text `toks` add after `ctx` (at most one token)."""
        if not ctx:
            return self.codec.decode(toks)
        return self.codec.decode(ctx + toks)[len(self.codec.decode(ctx)):]

    def _settle(self, tokens: Sequence[int], tail: list[int], new: str) -> str:
        self.settled += new
        self.n = len(tokens)
        self._ctx = tail[-1:]
        return self.settled


class TokenizerCodec:
    """A tokenizer as the server uses it; `vocab_size` is the model's (ids a prompt may use)."""

    def __init__(self, tok: Tokenizer, vocab_size: int):
        self.tok, self.vocab_size = tok, vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(list(tokens))

    def token_str(self, token: int) -> str:
        """One token as text: its characters, or `bytes:\\xNN` for a byte-level token that is
        not UTF-8 on its own (the form OpenAI uses for partial characters)."""
        if isinstance(self.tok, ByteTokenizer):
            if not 0 <= token < 256:
                return "\ufffd"
            b = bytes([token])
            try:
                return b.decode("utf-8")
            except UnicodeDecodeError:
                return f"bytes:\\x{b[0]:02x}"
        return self.tok.decode([token])


def codec_for(prog: Any, source: str | Path | None = None) -> TokenizerCodec:
    """The tokenizer of a loaded program: the one its run / artifact directory carries or
    names, else the one its spec names."""
    tok = load_tokenizer(source if source is not None else prog.spec)
    return TokenizerCodec(tok, prog.spec.model.vocab_size)
