"""`data.loss: queries`: the training loss of the synthetic recall task counts the queried
values alone (docs/data.md "Which targets the loss counts"), and the recall benchmark's
`--filler-loss P` (every query and a share P of the other targets)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import titanc
from tests.helpers import tiny_spec
from tests.test_run_input import cli, one_error_line
from titanc.errors import SpecError
from titanc.model.frontend import lower_forward
from titanc.runtime.data.datasets import SyntheticRecall, draw, make_data
from titanc.runtime.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"model.block": "lmm", "model.d_model": 32, "model.n_layers": 1, "model.seq_len": 32,
         "model.vocab_size": 32, "model.ffn_hidden": 64, "model.memory.heads": 2,
         "model.memory.chunk_size": 8, "train.batch_size": 4, "train.dtype": "float64",
         "compile.target": "cpu"}


def test_the_loss_is_the_mean_over_the_queried_values() -> None:
    """The program's loss under `data.loss: queries` is the cross-entropy at the query
    positions alone, averaged over them, computed here from the same program's logits."""
    prog = titanc.compile(tiny_spec(**SMALL, **{"data.loss": "queries"}))
    data = make_data(prog.spec)
    tokens, docs = draw(data, prog.spec, 4, "train", torch.Generator().manual_seed(0))
    pos = data.layout.query_positions
    assert torch.equal(docs["loss_mask"].nonzero()[:, 1].unique(), pos)
    assert docs["loss_mask"].sum() == 4 * len(pos)
    logp = torch.log_softmax(prog.logits(tokens).double(), -1)
    want = -logp[:, pos].gather(-1, tokens[:, pos + 1, None]).mean()
    assert abs(prog.loss(tokens, docs) - float(want)) < 1e-9
    everything = -logp.gather(-1, tokens[:, 1:, None]).mean()
    assert abs(prog.loss(tokens) - float(everything)) < 1e-9      # no mask: every target


def test_a_rank_draws_the_mask_of_its_rows() -> None:
    spec = tiny_spec(**SMALL, **{"data.loss": "queries"})
    data = make_data(spec)
    tokens, docs = draw(data, spec, 6, "train", torch.Generator().manual_seed(1),
                        rows=slice(2, 5))
    assert tokens.shape[0] == 3 and docs["loss_mask"].shape == (3, 32)


def test_without_it_the_graph_takes_no_mask() -> None:
    plain = lower_forward(tiny_spec(**SMALL)).input_names()
    masked = lower_forward(tiny_spec(**SMALL, **{"data.loss": "queries"})).input_names()
    assert "loss_mask" not in plain and masked == [*plain, "loss_mask"]


@pytest.mark.parametrize("extra", [{"data.source": "README.md"},
                                   {"data.documents": True}])
def test_queries_need_the_synthetic_task(extra: dict) -> None:
    with pytest.raises(SpecError, match="data.loss: queries"):
        tiny_spec(**SMALL, **{"data.loss": "queries", **extra})


def test_the_cli_says_it_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, err = cli(["train", ROOT / "examples" / "tiny.yaml", "--data", ROOT / "README.md",
                        "--set", "data.loss=queries", "--steps", "1", "--out", tmp_path / "run"],
                       capsys)
    assert code == 2 and "data.loss: queries" in one_error_line(err)


def test_train_runs_under_the_query_loss(tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    """`titanc train` under data.loss: queries: the loader hands the mask to the training
    and the held-out steps."""
    run = tmp_path / "run"
    sets = [f"{k}={v}" for k, v in SMALL.items()] + ["data.loss=queries", "train.steps=4",
                                                     "train.eval_every=2"]
    code, _, _ = cli(["train", ROOT / "examples" / "tiny.yaml", "--out", run,
                      *[a for s in sets for a in ("--set", s)]], capsys)
    assert code == 0
    evals = [r["eval_loss"] for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]
    assert len(evals) == 2 and all(math.isfinite(e) for e in evals)


def test_the_benchmarks_filler_loss_keeps_every_query() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import recall_distance as rd

    gen = torch.Generator().manual_seed(0)
    needles = rd.NeedleRecall(64, 32, seed=0, n_keys=8, n_values=8, train_needles=4)
    mask = rd.loss_mask(needles, 16, 0.0, gen)["loss_mask"]
    b = needles.batch(16, "train", gen, distance=10)
    assert mask.shape == (16, 64) and (mask.sum(1) == 4).all()
    q = mask[0].nonzero().flatten()
    assert (b[:, q] < 8).all() and ((b[:, q + 1] >= 8) & (b[:, q + 1] < 16)).all()
    half = rd.loss_mask(SyntheticRecall(64, 32, seed=0), 64, 0.5, gen)["loss_mask"]
    assert half[:, SyntheticRecall(64, 32).layout.query_positions].all()
    assert 0.3 < float(half.mean()) < 0.7


def test_a_task_longer_than_the_first_stage_trains_it_longer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """12 pairs and 4 queries need 32 tokens before any filler: the benchmark's 32-token
    first stage is raised to 48 (pairs and queries at least 8 apart) instead of failing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import recall_distance as rd

    for key, value in {"n_pairs": 12, "n_keys": 16, "n_values": 16}.items():
        monkeypatch.setitem(rd.TASK, key, value)
    monkeypatch.setitem(rd.SPEC["model"], "vocab_size", 64)
    seen: list[int] = []
    compile_ = titanc.compile
    monkeypatch.setattr(rd.titanc, "compile",
                        lambda s: seen.append(s["model"]["seq_len"]) or compile_(s))
    overrides = {**rd.BLOCK_SET, "data.loss": "queries"}
    r = rd.train_one("lmm", 0, [(32, 1)], [8], overrides, 60.0, 8, filler_loss=0.0)
    assert seen == [48, 48] and r["steps"] == 1 and 0 <= r["accuracy"]["8"] <= 1
