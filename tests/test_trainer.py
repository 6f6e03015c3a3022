"""The Trainer: bit-for-bit resume, a non-finite loss stopping the run, the run directory
(metrics.jsonl, loss.png, spec.yaml), gradient accumulation, and `titanc train` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import titanc
from titanc.tools.cli import main
from titanc.errors import TitancError
from titanc.runtime.train.checkpoint import load_checkpoint
from titanc.runtime.lr_schedule import lr_at
from titanc.runtime.train.trainer import Trainer, read_metrics, run_training
from titanc.model.spec import Spec, load_spec, spec_to_dict

from tests.helpers import one_thread  # noqa: F401 (autouse)

ROOT = Path(__file__).resolve().parent.parent
TINY = {"model.d_model": 16, "model.n_layers": 1, "model.seq_len": 16, "model.vocab_size": 256,
        "model.attention.segment": 8, "model.memory.chunk_size": 4, "train.batch_size": 2,
        "train.eval_every": 0, "train.eval_batches": 1, "train.checkpoint_every": 0}
FILES = {"attn": "tiny_attn.yaml", "lmm": "tiny_lmm.yaml", "mac": "tiny.yaml"}


def tiny(block: str = "attn", **overrides: Any) -> Spec:
    """A tiny spec of `block`; overrides name dotted fields with "__" for "."."""
    return load_spec(ROOT / "examples" / FILES[block],
                     {**TINY, **{k.replace("__", "."): v for k, v in overrides.items()}})


def train(spec: Spec, out: Path, **kw: Any) -> dict[str, Any]:
    return run_training(spec, out, progress=False, log=lambda _: None, **kw)


def corpus(tmp_path: Path, n: int = 4000) -> Path:
    words = "the cat sat on a mat and the dog ran to the red door".split()
    p = tmp_path / "corpus.txt"
    p.write_text(" ".join(words[(i * 7) % len(words)] for i in range(n // 4)))
    return p


# --- resume ----------------------------------------------------------------------------------


def test_resume_is_bit_for_bit(tmp_path: Path) -> None:
    spec = tiny("lmm", train__warmup=2, train__checkpoint_every=1)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(spec, straight, steps=4)
    train(spec, split, steps=4, until=2)  # a run stopped after 2 of its 4 steps
    assert load_checkpoint(split / "checkpoint.safetensors")[1]["step"] == 2
    summary = train(spec, split, steps=4, resume=split)
    assert summary["steps"] == 4 and summary["steps_run"] == 2
    a, _ = load_checkpoint(straight / "checkpoint.safetensors")
    b, _ = load_checkpoint(split / "checkpoint.safetensors")
    assert a.keys() == b.keys()
    for k in a:  # parameters, AdamW moments, step and the sampler state
        assert torch.equal(a[k], b[k]), k
    losses = [[(m["step"], m["loss"]) for m in read_metrics(d / "metrics.jsonl") if "loss" in m]
              for d in (straight, split)]
    assert losses[0] == losses[1] and [s for s, _ in losses[1]] == [1, 2, 3, 4]


def test_resume_drops_metrics_past_the_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(), run, steps=2)
    with open(run / "metrics.jsonl", "a") as f:  # a crashed run logged a step it never saved
        f.write(json.dumps({"step": 3, "loss": 9.0}) + "\n" + '{"step": 4, "lo')
    train(tiny(), run, steps=3, resume=run)
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl") if "loss" in m] == [1, 2, 3]
    assert read_metrics(run / "metrics.jsonl")[-2]["loss"] != 9.0


def test_resume_into_a_new_directory_copies_the_history(tmp_path: Path) -> None:
    train(tiny(), tmp_path / "a", steps=2)
    train(tiny(), tmp_path / "b", steps=3, resume=tmp_path / "a")
    assert [m["step"] for m in read_metrics(tmp_path / "b" / "metrics.jsonl") if "loss" in m] == [1, 2, 3]
    assert [m["step"] for m in read_metrics(tmp_path / "a" / "metrics.jsonl") if "loss" in m] == [1, 2]


def test_run_directory_is_not_overwritten(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(), run, steps=2)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    with pytest.raises(TitancError) as e:
        train(tiny(), run, steps=2)
    assert str(e.value) == (f"--out {run} already holds a run ({run / 'checkpoint.safetensors'}); "
                            f"continue it with --resume {run} or choose another --out")
    with pytest.raises(TitancError) as e:
        train(tiny(), run, steps=2, resume=run)
    assert str(e.value) == ("the checkpoint is at step 2 and train.steps is 2: nothing to train; "
                            "pass --steps N with a total N > 2")
    with pytest.raises(TitancError) as e:
        train(tiny(), run, resume=tmp_path / "nothing")
    assert str(e.value) == f"--resume {tmp_path / 'nothing'}: no such run directory or checkpoint file"
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


# --- failures ----------------------------------------------------------------------------------


def test_nonfinite_loss_stops_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    """Step 3 goes non-finite, so the state after step 2 (from which step 3 runs) is not good:
    trying step 3 on it before saving finds that, and step 1's checkpoint is kept."""
    run = tmp_path / "run"
    spec = tiny(train__lr=1e6, train__warmup=0, train__checkpoint_every=1, train__steps=20)
    with pytest.raises(TitancError) as e:
        train(spec, run)
    ckpt = run / "checkpoint.safetensors"
    msg = str(e.value)
    assert (msg.startswith("step 2: its gradient norm after the update is nan; ")
            or msg.startswith("step 2: the next batch's loss after the update is nan; ")), msg
    assert msg.endswith(f"; the last good checkpoint (step 1) is kept in {ckpt}; lower train.lr "
                        f"(the lr was {lr_at(1, spec.train):.3g}) or raise train.warmup, then continue with "
                        f"--resume {run}")
    tensors, meta = load_checkpoint(ckpt)
    assert meta["step"] == 1 and all(torch.isfinite(t).all() for t in tensors.values()
                                     if t.is_floating_point())
    assert (run / "loss.png").stat().st_size > 0
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2]


def _poison_the_loss(monkeypatch: pytest.MonkeyPatch, spec: Spec, value: float) -> None:
    """Every step of `spec`'s Program reports `value` as its loss."""
    Program = type(titanc.compile(spec))
    real = Program.advance

    def poisoned(self: Any, tokens: torch.Tensor, docs: Any = None) -> None:
        real(self, tokens, docs)
        self._last["loss"] = torch.tensor(value)

    monkeypatch.setattr(Program, "advance", poisoned)


def test_nonfinite_before_any_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _poison_the_loss(monkeypatch, tiny(), math.inf)
    with pytest.raises(TitancError) as e:
        train(tiny(), tmp_path / "run", steps=5)
    assert str(e.value) == ("step 1: loss is inf; no good checkpoint was written before it "
                            "(train.checkpoint_every=0); lower train.lr (the lr was 0.00015) or "
                            "raise train.warmup, then train again")
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()


def test_nonfinite_with_a_memory_names_the_inner_step_too(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with a memory can blow up through its inner step (`model.memory.lr_max`), not
    only train.lr: the message names both."""
    spec = tiny("lmm")
    _poison_the_loss(monkeypatch, spec, math.nan)
    with pytest.raises(TitancError) as e:
        train(spec, tmp_path / "run", steps=5)
    assert (f"or raise train.warmup, or lower model.memory.lr_max "
            f"({spec.model.memory.lr_max:.3g}: the memory's inner step), then train again"
            in str(e.value)), str(e.value)


def test_an_evaluation_with_every_target_masked_says_so(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Held-out batches whose loss mask keeps no target leave no held-out loss: the trainer
    says so once instead of dropping it from the summary without a word."""
    from titanc.runtime.train import trainer as T
    real = T.draw

    def masked(data: Any, spec: Any, batch: int, split: str, gen: Any, **kw: Any) -> Any:
        tokens, docs = real(data, spec, batch, split, gen, **kw)
        return (tokens, {"loss_mask": torch.zeros(1)}) if split == "val" else (tokens, docs)

    monkeypatch.setattr(T, "draw", masked)
    lines: list[str] = []
    out = run_training(tiny(train__eval_every=1), tmp_path / "run", steps=3, progress=False,
                       log=lines.append)
    said = [l for l in lines if l.startswith("no held-out loss: every target of the ")]
    assert len(said) == 1 and out["eval_loss"] is None, lines


# --- the run directory ------------------------------------------------------------------------


def test_run_directory_contents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    spec = tiny("attn", train__eval_every=2, train__checkpoint_every=2, train__eval_batches=2)
    summary = run_training(spec, run, steps=4, progress=False, profile=True)
    assert sorted(p.name for p in run.iterdir()) == [
        ".lock", "checkpoint.safetensors", "loss.png", "metrics.jsonl", "spec.yaml"]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_spec(yaml.safe_load((run / "spec.yaml").read_text())) == load_spec(spec, {"train.steps": 4})
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    assert all(set(r) == {"step", "loss", "lr", "grad_norm", "tokens_per_s"} for r in steps)
    assert all(set(r) == {"step", "eval_loss", "eval_accuracy"} for r in evals)
    assert summary["steps"] == 4 and summary["loss"] == steps[-1]["loss"]
    assert summary["eval_loss"] == evals[-1]["eval_loss"] and 0 <= summary["eval_accuracy"] <= 1
    assert summary["tokens_per_s"] > 0 and summary["seconds"] > 0
    out = capsys.readouterr().out
    assert "profile" in out and "train_step" in out and "peak memory" in out
    assert out.strip().splitlines()[-1].startswith("done: step 4, loss ")


def test_text_data_reports_the_unigram_baseline(tmp_path: Path) -> None:
    summary = train(tiny(train__eval_every=1), tmp_path / "run", steps=2, data=str(corpus(tmp_path)))
    assert summary["unigram_loss"] > 0 and summary["eval_loss"] > 0
    assert summary["eval_accuracy"] is None
    spec = yaml.safe_load((tmp_path / "run" / "spec.yaml").read_text())
    assert spec["data"]["source"] == str(tmp_path / "corpus.txt")


def test_missing_data_file_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(TitancError) as e:
        train(tiny(), tmp_path / "run", data=str(tmp_path / "missing.txt"))
    assert str(e.value).startswith(f"data file {tmp_path / 'missing.txt'} does not exist")
    assert not (tmp_path / "run").exists()


# --- gradient accumulation --------------------------------------------------------------------


def test_grad_accum_equals_one_big_batch() -> None:
    rows = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(3))
    common = {"train.dtype": "float64", "train.warmup": 0}
    accum = titanc.compile(tiny("lmm", **common), **{"train.grad_accum": 4, "train.batch_size": 1})
    big = titanc.compile(tiny("lmm", **common), **{"train.grad_accum": 1, "train.batch_size": 4})
    la, lb = accum.train_step(rows), big.train_step(rows)
    assert la == pytest.approx(lb, rel=1e-12)
    assert accum.last["grad_norm"] == pytest.approx(big.last["grad_norm"], rel=1e-10)
    pa, pb = accum.parameters(), big.parameters()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=1e-12)


# --- the command line --------------------------------------------------------------------------


def test_cli_train_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = [a for k, v in TINY.items() for a in ("--set", f"{k}={v}")]
    run = str(tmp_path / "run")
    spec = str(ROOT / "examples" / "tiny_attn.yaml")
    assert main(["train", spec, *sets, "--steps", "1", "--out", run]) == 0
    assert main(["train", spec, *sets, "--steps", "2", "--resume", run, "--out", run,
                 "--strict"]) == 0
    assert load_checkpoint(Path(run) / "checkpoint.safetensors")[1]["step"] == 2
    assert main(["train", spec, *sets, "--data", str(tmp_path / "no.txt"), "--out", run]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"titanc: error: data file {tmp_path / 'no.txt'} does not exist; pass a "
                       f"text file or synthetic:recall as --data or data.source")


def test_trainer_class_exposes_the_run(tmp_path: Path) -> None:
    t = Trainer(tiny(), tmp_path / "run", steps=3, progress=False, log=lambda _: None)
    assert t.prog.step == 0 and t.until == 3 and not (tmp_path / "run").exists()
    assert t.evaluate().keys() == {"eval_loss", "eval_accuracy"}
    assert spec_to_dict(t.spec)["train"]["steps"] == 3
    assert t.run()["steps"] == 3


def test_demo_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from titanc.tools import demo

    assert demo.make_corpus(2000) == demo.make_corpus(2000)
    assert demo.main(["--steps", "2", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "IR: forward " in out and "initial held-out loss" in out
    assert "training loss: step 1: " in out and "vs unigram baseline" in out
    assert "launched on triton (a scan kernel once)" in out and " attention_fwd" in out
    assert (tmp_path / "demo" / "loss.png").exists()


def test_interrupt_keeps_the_last_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Program = type(titanc.compile(tiny()))
    real = Program.advance

    def interrupted(self: Any, tokens: torch.Tensor, docs: Any = None) -> None:
        if self.step == 2:
            raise KeyboardInterrupt
        real(self, tokens, docs)

    monkeypatch.setattr(Program, "advance", interrupted)
    run, logs = tmp_path / "run", []
    with pytest.raises(KeyboardInterrupt):
        run_training(tiny(train__checkpoint_every=1), run, steps=4, progress=False, log=logs.append)
    assert logs[-1] == (f"interrupted after step 2; the last checkpoint (step 2) is in "
                        f"{run / 'checkpoint.safetensors'}; continue with --resume {run}")
    monkeypatch.setattr(Program, "advance", real)
    assert train(tiny(), run, steps=4, resume=run)["steps"] == 4
