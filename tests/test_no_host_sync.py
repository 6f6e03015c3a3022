"""A training step reads nothing back to the host (issue 28): gradient accumulation, lr and step
are device work, the loss and the gradient norm stay on the device until asked for.

`Program.advance` runs with every way of reading a device value (`.item()`, `float()`,
`int()`, `bool()`, `.tolist()` of a non-host tensor) and every device synchronisation patched
to raise, on the cpu target and on the (interpreted) triton target; the values it leaves equal
those of `train_step` (which reads them) on a twin program. The Trainer reads them only on its
logging steps."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import math  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import titanc  # noqa: E402
from tests.helpers import TINY, tokens  # noqa: E402

READS = ("item", "__float__", "__int__", "__bool__", "__index__")


class HostRead(AssertionError):
    pass


@contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Patch every read of a tensor's value and every device sync to raise (and record)."""
    seen: list[str] = []

    def refuse(what: str) -> Any:
        def f(*a: Any, **k: Any) -> Any:
            seen.append(what)
            raise HostRead(f"{what} during a training step")
        return f

    with monkeypatch.context() as m:
        for name in READS:
            m.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        m.setattr(torch.cuda, "synchronize", refuse("torch.cuda.synchronize"))
        m.setattr(torch.cuda.Stream, "synchronize", refuse("Stream.synchronize"))
        m.setattr(torch.cuda.Event, "synchronize", refuse("Event.synchronize"))
        yield seen


def _programs(target: str, accum: int, block: str = "mac") -> tuple[Any, Any]:
    """The program on `target` and its twin, which reads back every step (on the cpu target:
    under the interpreter a triton step is slow, and the targets agree in float64); on triton
    the attention block, one layer of 8 tokens: the host path of a step does not depend on
    the block (the layer scan with its carries, gradient accumulation, clipping and AdamW are
    all there), and an interpreted memory block costs 5x the time (23 s against 4 s)."""
    over = {"model.block": block, "train.grad_accum": accum, "train.batch_size": 1,
            "train.dtype": "float64", "train.warmup": 2, "train.steps": 4,
            "model.n_layers": 1 if target == "triton" else 2,
            "model.seq_len": 8 if target == "triton" else 16}
    return (titanc.compile(TINY, **over, **{"compile.target": target}),
            titanc.compile(TINY, **over, **{"compile.target": "cpu"}))


@pytest.mark.parametrize("target,accum", [pytest.param("cpu", 1, marks=pytest.mark.slow), ("cpu", 2),
                                          ("triton", 2)])
def test_steps_read_nothing_back(target: str, accum: int,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    prog, twin = _programs(target, accum, "mac" if target == "cpu" else "attn")
    toks = tokens(prog.spec, batch=accum)
    steps = 3 if target == "cpu" else 2          # past the warmup: the lr table's cosine part
    want = [(twin.train_step(toks), twin.last) for _ in range(steps)]
    prog.advance(toks)                            # binds the executors (not a steady step)
    with no_host_reads(monkeypatch) as seen:
        for _ in range(steps - 1):
            prog.advance(toks)
    assert seen == []
    got = prog.last                               # read now, once
    assert prog.step == twin.step == steps
    assert got["loss"] == pytest.approx(want[-1][0], rel=1e-12)
    assert got["grad_norm"] == pytest.approx(want[-1][1]["grad_norm"], rel=1e-10)
    assert got["lr"] == want[-1][1]["lr"]
    for n, p in twin.parameters().items():
        torch.testing.assert_close(prog.parameters()[n], p, rtol=1e-12, atol=1e-14)


def test_the_patch_catches_a_read(monkeypatch: pytest.MonkeyPatch) -> None:
    prog, _ = _programs("cpu", 1)
    toks = tokens(prog.spec)
    prog.advance(toks)
    with no_host_reads(monkeypatch) as seen, pytest.raises(HostRead):
        prog.train_step(toks)                     # train_step reads the loss
    assert seen == ["Tensor.__float__"]


def test_trainer_reads_on_logging_steps_only(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from titanc.model.spec import load_spec
    from titanc.runtime.train.trainer import read_metrics, run_training
    from tests.test_trainer import FILES, ROOT, TINY as SMALL

    spec = load_spec(ROOT / "examples" / FILES["attn"],
                     {**SMALL, "train.log_every": 3, "train.eval_every": 0,
                      "train.checkpoint_every": 0})
    reads: list[int] = []
    Program = type(titanc.compile(spec))
    real = Program.last

    def counted(self: Any) -> dict[str, float]:
        reads.append(self.step)
        return real.fget(self)

    monkeypatch.setattr(Program, "last", property(counted))
    run_training(spec, tmp_path / "run", steps=7, progress=False, log=lambda _: None)
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")
            if "loss" in m] == [3, 6, 7]
    # the logging steps, then the final checkpoint's guard (at step 7)
    assert reads[:3] == [3, 6, 7] and set(reads) == {3, 6, 7}
    assert all(math.isfinite(m["loss"]) for m in read_metrics(
        tmp_path / "run" / "metrics.jsonl") if "loss" in m)
