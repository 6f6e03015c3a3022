"""The tokenizer behind the server: one object with encode / decode / token_str.

Today every run uses byte-level tokens (`runtime/data.py`); `codec_for` is the one place that
chooses, so a run directory that names another tokenizer plugs in here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from . import data


class ByteCodec:
    """UTF-8 bytes, one token per byte; invalid UTF-8 decodes to U+FFFD."""

    def __init__(self, vocab_size: int = 256):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return data.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return data.decode([t % 256 for t in tokens])

    def token_str(self, token: int) -> str:
        """One token as text: the character, or `bytes:\\xNN` for a byte that is not UTF-8
        on its own (the form OpenAI uses for partial characters)."""
        b = bytes([token % 256])
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return f"bytes:\\x{b[0]:02x}"


def codec_for(prog: Any, source: str | Path | None = None) -> ByteCodec:
    """The tokenizer of a loaded program (byte-level today)."""
    return ByteCodec(prog.spec.model.vocab_size)
