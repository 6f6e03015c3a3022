"""User-facing errors.

Every problem a user can cause (a bad spec, a missing file, a bad flag value) raises a
`TitancError` whose message is one line that names the offending value and says how to fix it,
e.g. `model.memory.chunk_size: 48 must divide model.seq_len=128`. The CLI prints it as
`titanc: error: <message>` and exits with status 2, without a traceback. Internal invariants
use `assert`; they are bugs, not user errors.
"""

from __future__ import annotations

__all__ = ["TitancError", "SpecError", "DistributedError", "printable", "size_overflow"]


def printable(text: str, limit: int = 200) -> str:
    """`text` as it may reach a terminal: itself when printable, else its repr (ESC, CR and
    NUL shown as escapes, never sent raw); at most `limit` characters."""
    text = text if text.isprintable() else repr(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def size_overflow(exc: BaseException) -> bool:
    """Whether `exc` is a size past what torch or Python can index or allocate (a spec's
    dimension of 10**30 reaching `torch.empty`: "Overflow when unpacking long long", "Storage
    size calculation overflowed"), not a bug to show as a traceback."""
    if isinstance(exc, (OverflowError, MemoryError)):
        return True
    return isinstance(exc, (RuntimeError, TypeError)) and "overflow" in str(exc).lower()


class TitancError(Exception):
    """Base class of every error a user of titanc can trigger with bad input.

    The message is kept to one line: any line breaks in it are folded into spaces, so a value
    quoted inside a message can never break the `titanc: error: ...` format.
    `exit_status` is the CLI's: 2 for bad input; a failure of the run itself (a rank that
    died) sets 1.
    """

    exit_status = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).splitlines()).strip())

    @property
    def message(self) -> str:
        return str(self.args[0])


class SpecError(TitancError):
    """A model spec (file, mapping or override) is invalid."""


class DistributedError(TitancError):
    """A rank of a distributed run died, or a collective timed out: the job stops. Not bad
    input, so the CLI exits 1."""

    exit_status = 1
