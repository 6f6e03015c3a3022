"""The tokenizer behind the server: one object with encode / decode / token_str.

`codec_for` is the one place the server chooses: the tokenizer the run or artifact directory
names (`runtime.data.tokenizer.load_tokenizer`: its tokenizer.json, else the spec's
`data.tokenizer`, byte-level by default), wrapped with the per-token text that logprobs need.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from titanc.runtime.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer


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
