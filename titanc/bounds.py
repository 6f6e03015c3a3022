"""Every numeric input's range, in one table: CLI flags and HTTP request fields check here.

    parser.add_argument("--port", type=PORT.arg)            # argparse: exit 2, one line
    seed = SEED.check(body["seed"], "seed")                  # TitancError naming the field

A `Bound` is a closed integer range [lo, hi] with a name for messages. The upper ends are what
the code downstream accepts (a torch generator's 64-bit seed, a TCP port, the `tokenizers`
trainer's u32 frequencies) or a cap that keeps one input from asking for unbounded memory or
time (a vocabulary of 2**21 tokens, 2**20 tokens generated per sequence); memory beyond the
range is the fit check's job (titanc/fit.py). Text is parsed with at most `MAX_DIGITS` digits,
so a flag of a million digits costs nothing.

Every numeric field of the spec has its range here too (the spec section at the end):
titanc/model/spec.py declares `most=BOUND.hi` next to each field, and `SPEC_FLOAT_MAX` caps
the floats that become graph scalars (float32 when the masters are), so no spec value reaches
torch as a size or a scalar it cannot hold; tests/test_input_trust.py checks that no numeric
field of the schema is left without one.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from titanc.errors import TitancError

__all__ = ["Bound", "SEED", "TRAIN_SEED", "PORT", "VOCAB_SIZE", "MIN_FREQUENCY", "SLOTS", "QUEUE",
           "TOKENS", "PROMPT_TOKENS", "BODY_BYTES", "WORKERS", "THREADS", "STEPS", "BATCHES",
           "NPROC", "TOP_K", "DISTANCE", "LIMIT", "finite_float", "WIDTH", "FFN_WIDTH", "LAYERS",
           "HEADS", "PERSISTENT", "MEMORY_DEPTH", "EXPANSION", "CONV_TAPS", "BATCH_SIZE",
           "GRAD_ACCUM", "LOSS_CHUNK", "EVERY", "SPEC_FLOAT_MAX", "MEGABYTES", "SECONDS"]

MAX_DIGITS = 24


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Bound:
    lo: int
    hi: int
    what: str                      # "a seed", shown in messages

    def describe(self) -> str:
        return f"{self.what}: an integer in [{self.lo}, {self.hi}]"

    def check(self, value: Any, field: str) -> int:
        """`value` when it is an integer in range, else TitancError naming `field`."""
        if not _is_int(value):
            raise TitancError(f"{field}: expected {self.describe()}, got {_show(value)}")
        if not self.lo <= value <= self.hi:
            raise TitancError(f"{field}: expected {self.describe()}, got {_show(value)}")
        return value

    def parse(self, text: str, field: str) -> int:
        """An integer from text (a flag value), checked."""
        digits = text.strip().lstrip("+-")
        if not digits.isdigit() or len(digits) > MAX_DIGITS or not digits.isascii():
            raise TitancError(f"{field}: expected {self.describe()}, got {_show(text)}")
        return self.check(int(text), field)

    def arg(self, text: str) -> int:
        """An argparse `type`: the error becomes argparse's one-line usage error."""
        try:
            return self.parse(text, "value")
        except TitancError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None


def _show(value: Any) -> str:
    text = repr(value)
    if not text.isascii() or not text.isprintable():
        text = ascii(value)
    return text if len(text) <= 40 else text[:37] + "..."


def finite_float(lo: float, hi: float, what: str):  # noqa: ANN201 - an argparse type
    """An argparse type: a finite float in [lo, hi] (nan, inf refused)."""
    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= 64 else math.nan
        except ValueError:
            value = math.nan
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {what} in [{lo:g}, {hi:g}], "
                                             f"got {_show(text)}")
        return value
    return parse


SEED = Bound(0, 2**64 - 1, "a seed")                          # torch.Generator.manual_seed
TRAIN_SEED = Bound(0, 2**63 - 1, "a seed")                # train.seed: loaders seed seed + split
PORT = Bound(0, 65535, "a TCP port (0 picks a free one)")
VOCAB_SIZE = Bound(257, 1 << 21, "a vocabulary size")         # 256 bytes + end-of-text, ...
MIN_FREQUENCY = Bound(1, 2**32 - 1, "a pair count")          # tokenizers' trainer: u32..u64
SLOTS = Bound(1, 4096, "a number of slots")                   # then fit.check_fits
QUEUE = Bound(1, 1 << 16, "a queue length")
TOKENS = Bound(1, 1 << 20, "a number of tokens")              # generated per sequence
PROMPT_TOKENS = Bound(1, 1 << 20, "a number of prompt tokens")
BODY_BYTES = Bound(1, 1 << 30, "a number of bytes")
WORKERS = Bound(1, 256, "a number of worker processes")
THREADS = Bound(1, 1024, "a number of threads")
STEPS = Bound(1, 10**12, "a number of steps")
BATCHES = Bound(1, 1 << 20, "a number of batches")
NPROC = Bound(1, 1024, "a number of ranks")
TOP_K = Bound(1, 1 << 30, "a number of tokens")
DISTANCE = Bound(1, 1 << 20, "a distance in tokens")
LIMIT = Bound(1, 1 << 30, "a count")

# -- the spec's fields (titanc/model/spec.py: `most=BOUND.hi`) ------------------------------------
# caps on what one field may ask for; a spec within them whose product of sizes does not fit
# the machine is the fit check's to refuse (titanc/fit.py), before or after compiling
WIDTH = Bound(1, 1 << 16, "a width")                          # model.d_model
FFN_WIDTH = Bound(1, 1 << 18, "a width")                      # model.ffn_hidden: 4 x WIDTH
LAYERS = Bound(1, 1024, "a number of layers")                 # the compile is linear in them
HEADS = Bound(1, 1 << 16, "a number of heads")                # they divide model.d_model
PERSISTENT = Bound(0, 1 << 16, "a number of persistent tokens")
MEMORY_DEPTH = Bound(1, 64, "a number of memory layers")
EXPANSION = Bound(1, 64, "a width multiplier")
CONV_TAPS = Bound(1, 1024, "a number of convolution taps")
BATCH_SIZE = Bound(1, 1 << 16, "a number of sequences")       # x seq_len <= 2**36 tokens
GRAD_ACCUM = Bound(1, 1 << 12, "a number of micro-batches")
LOSS_CHUNK = Bound(0, 1 << 36, "a number of tokens")          # BATCH_SIZE x TOKENS
EVERY = Bound(0, STEPS.hi, "a number of steps")               # cadences; 0: never
SPEC_FLOAT_MAX = 3.4028234663852886e38   # train.lr, weight_decay, grad_clip, memory.lr_max:
#                                          graph scalars, float32 when the masters are
MEGABYTES = float(1 << 30)               # train.remat_budget_mb, bucket_mb (a petabyte)
SECONDS = 1e7                            # train.dist_timeout_s (116 days; torch's timedelta
#                                          and c10d's millisecond count overflow far past it)
