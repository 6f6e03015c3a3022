"""Recall against distance: the distance-controlled recall layout, the memory diagnostics
(runtime/diagnostics/neural_memory.py) checked against the float64 reference, `train.memory_stats_every`
in metrics.jsonl, and `titanc eval RUN --task recall`. The long-range sweep itself is
benchmarks/recall_distance.py (minutes); these stay fast."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
import torch

import tests.reference as R
import titanc
from tests.helpers import tiny_spec, tokens
from tests.reference.memory import gates, initial_state, projections
from tests.reference.ops import layer_params, rmsnorm
from titanc.tools.cli import main
from titanc.errors import TitancError
from titanc.runtime.data.datasets import SyntheticRecall
from titanc.runtime.train.evaluate import recall_seq_len
from titanc.runtime.diagnostics.neural_memory import memory_stats
from titanc.runtime.train.trainer import read_metrics

LAYOUT = {"n_pairs": 3, "n_queries": 2, "n_keys": 4, "n_values": 6, "filler_tokens": 3}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_distance_places_the_pairs_exactly() -> None:
    task = SyntheticRecall(40, 32, seed=0, **LAYOUT)
    lay = task.layout
    assert task.max_distance == lay.query_start - 2 * lay.n_pairs + 1 == 32
    rows = {}
    for d in (1, 8, 20, task.max_distance):
        b = task.batch(16, "val", torch.Generator().manual_seed(3), distance=d)
        rows[d] = b
        p0 = lay.query_start - d - 2 * lay.n_pairs + 1       # first pair token
        assert p0 >= 0
        keys, values = b[:, p0:p0 + 2 * lay.n_pairs:2], b[:, p0 + 1:p0 + 2 * lay.n_pairs:2]
        assert ((keys >= 0) & (keys < 4)).all() and ((values >= 4) & (values < 10)).all()
        filler = torch.cat([b[:, :p0], b[:, p0 + 2 * lay.n_pairs:lay.query_start]], 1)
        assert ((filler >= 10) & (filler < 13)).all()        # nothing else outside the pairs
        # the last pair's value sits exactly d positions before the first query key
        assert lay.query_start - (p0 + 2 * lay.n_pairs - 1) == d
        for row in b.tolist():                                # queries answer their pairs
            pairs = dict(zip(row[p0:p0 + 2 * lay.n_pairs:2], row[p0 + 1:p0 + 2 * lay.n_pairs:2]))
            q = lay.query_start
            assert all(pairs[row[i]] == row[i + 1] for i in range(q, lay.length, 2))
    # only the layout moves: the same keys, values and queries at every distance
    q = lay.query_start
    assert all(torch.equal(rows[8][:, q:], rows[d][:, q:]) for d in rows)
    default = task.batch(4, "val", torch.Generator().manual_seed(1))
    assert torch.equal(default[:, :2 * lay.n_pairs],
                       task.batch(4, "val", torch.Generator().manual_seed(1),
                                  distance=task.max_distance)[:, :2 * lay.n_pairs])
    with pytest.raises(TitancError, match=r"distance=33 must be in \[1, 32\]"):
        task.batch(2, distance=33)


def test_recall_seq_len_is_valid_and_shortest() -> None:
    for block, align in (("lmm", 4), ("mac", 8), ("attn", 1), ("mag", 4)):
        spec = tiny_spec(**{"model.block": block})
        for d in (1, 8, 13, 50):
            T = recall_seq_len(spec, d, 3, 2)
            assert T % align == 0 and T >= d + 8 and T - align < d + 8
            assert SyntheticRecall(T, 32, **LAYOUT).max_distance >= d


def _reference_chunks(spec, params: dict[str, torch.Tensor], tok: torch.Tensor, layer: int = 0):
    """Per-chunk (loss before, loss after, |W|, |S|, rms of v) of the first layer's memory, computed by
    the float64 reference (a 1-layer lmm: the memory input is rmsnorm(embed[tok]))."""
    cfg = spec.model
    p = layer_params({k: v.double() for k, v in params.items()}, layer)
    x = params["embed"].double()[tok[:, :-1]]
    u = rmsnorm(x, p["mem_norm"])
    _, k, v = projections(p, u, cfg)
    theta, eta, alpha = gates(p, u, cfg)
    W, S = initial_state(p, u.shape[0], cfg)
    b, out = cfg.memory.chunk_size, []
    for c0 in range(0, cfg.seq_len, b):
        sl = slice(c0, c0 + b)
        before = (R.mem_apply(W, k[:, :, sl]) - v[:, :, sl]).pow(2).mean()
        g = R.inner_grads(W, k[:, :, sl], v[:, :, sl])
        W, S = R.chunk_token_loop(W, S, g, theta[:, :, sl], eta[:, :, sl], alpha[:, :, sl])
        after = (R.mem_apply(W, k[:, :, sl]) - v[:, :, sl]).pow(2).mean()
        norm = lambda ts: float(sum(t.pow(2).sum((-2, -1)) for t in ts).sqrt().mean())  # noqa
        out.append((float(before), float(after), norm(W), norm(S),
                    float(v[:, :, sl].pow(2).mean().sqrt())))
    return out, (float(theta.mean()), float(eta.mean()), float(alpha.mean()))


@pytest.mark.parametrize("depth", [1, 2])
def test_memory_stats_match_the_reference(depth: int) -> None:
    spec = tiny_spec(**{"model.n_layers": 1, "model.memory.depth": depth,
                        "train.dtype": "float32", "model.memory.lr_max": 2.0})
    prog = titanc.compile(spec)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():                      # non-trivial gates: data-dependent θ, η, α
        for n, t in prog.parameters().items():
            if "_theta_w" in n or "_eta_w" in n or "_alpha_w" in n:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
    tok = tokens(spec)
    stats = memory_stats(prog, tok)
    (layer,) = stats["layers"]
    want, (th, et, al) = _reference_chunks(spec, prog.parameters(), tok)
    assert len(layer["chunk_loss_before"]) == spec.model.seq_len // spec.model.memory.chunk_size
    for i, (before, after, *_) in enumerate(want):
        assert layer["chunk_loss_before"][i] == pytest.approx(before, rel=1e-3, abs=1e-5)
        assert layer["chunk_loss_after"][i] == pytest.approx(after, rel=1e-3, abs=1e-5)
    n = len(want)
    assert layer["w_norm"] == pytest.approx(sum(w[2] for w in want) / n, rel=1e-3)
    assert layer["s_norm"] == pytest.approx(sum(w[3] for w in want) / n, rel=1e-3)
    assert layer["v_rms"] == pytest.approx(sum(w[4] for w in want) / n, rel=1e-3)
    assert (layer["theta"], layer["eta"], layer["alpha"]) == pytest.approx((th, et, al), rel=1e-3)
    assert any(a < b for a, b in zip(layer["chunk_loss_after"], layer["chunk_loss_before"]))


def test_memory_stats_per_layer_and_block() -> None:
    for block in ("mac", "mal"):
        spec = tiny_spec(**{"model.block": block, "train.dtype": "float32"})
        stats = memory_stats(titanc.compile(spec), tokens(spec))
        assert len(stats["layers"]) == spec.model.n_layers
        m = spec.model.memory
        for layer in stats["layers"]:         # fresh gates: σ(bias) exactly
            assert layer["theta"] == pytest.approx(m.lr_max / 2, rel=1e-5)
            assert layer["eta"] == pytest.approx(m.momentum, rel=1e-5)
            assert layer["alpha"] == pytest.approx(m.decay, rel=1e-4)
            assert len(layer["chunk_loss_before"]) == spec.model.seq_len // m.chunk_size
    spec = tiny_spec(**{"model.block": "attn", "train.dtype": "float32"})
    assert memory_stats(titanc.compile(spec), tokens(spec)) == {"layers": []}


@pytest.mark.parametrize("write", ["attention_norm", "attention"])
def test_mac_memory_input_normalised_only_with_attention_norm(write: str) -> None:
    """`memory.mac_write: attention_norm` writes ŷ = rmsnorm(ỹ) (docs/semantics.md, mac step
    3): the memory's projections and gates do not see the scale of the attention output, so
    scaling attn_wo leaves every write (inner losses, |W|, |S|, θ, η, α) as it was. The
    default, the paper's write of ỹ itself: v(ỹ) and the gates scale with it."""
    spec = tiny_spec(**{"model.block": "mac", "train.dtype": "float64",
                        "model.memory.mac_write": write})
    prog = titanc.compile(spec)
    params = prog.parameters()
    assert ("layers.mac_norm" in params) == (write == "attention_norm")
    gen = torch.Generator().manual_seed(3)
    for gate in ("theta", "eta", "alpha"):     # non-zero gate weights: the gates see the write
        w = params[f"layers.mem_{gate}_w"]
        w.copy_(0.5 * torch.randn(w.shape, generator=gen, dtype=w.dtype))
    tok = tokens(spec)
    params["layers.attn_wo"].mul_(1000.0)        # ỹ² well above the norm's eps (1e-6)
    a = memory_stats(prog, tok)["layers"][0]   # layer 0: later layers see the block output,
    params["layers.attn_wo"].mul_(10.0)          # which does scale with ỹ
    b = memory_stats(prog, tok)["layers"][0]
    assert a["inner_loss_before"] > 1e-3          # the writes are not trivially empty
    if write == "attention":                     # v(ỹ) and the gates see the scale
        assert b["inner_loss_before"] > 2 * a["inner_loss_before"]
        assert b["v_rms"] > 2 * a["v_rms"]
        assert abs(b["eta"] - a["eta"]) > 0.1 and abs(b["alpha"] - a["alpha"]) > 0.1
        return
    for key in ("inner_loss_before", "inner_loss_after", "w_norm", "s_norm", "v_rms",
                "theta", "eta", "alpha"):     # the stats are rounded to 5 decimals
        assert b[key] == pytest.approx(a[key], rel=1e-3, abs=2e-5), key
    assert b["chunk_loss_before"] == pytest.approx(a["chunk_loss_before"], rel=1e-3, abs=2e-5)


def _train_tiny(tmp_path: Path, extra: list[str]) -> Path:
    run = tmp_path / "run"
    assert main(["train", "examples/tiny_lmm.yaml", "--out", str(run), "--steps", "4",
                 "--data", "synthetic:recall",
                 "--set", "model.seq_len=32", "--set", "model.vocab_size=32",
                 "--set", "train.eval_every=0", *extra]) == 0
    return run


def test_memory_stats_in_metrics_and_eval_task_recall(tmp_path: Path, monkeypatch,
                                                       capsys) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    run = _train_tiny(tmp_path, ["--set", "train.memory_stats_every=2"])
    mem = [r for r in read_metrics(run / "metrics.jsonl") if "memory" in r]
    assert [r["step"] for r in mem] == [2, 4]
    assert {"inner_loss_before", "inner_loss_after", "w_norm", "s_norm", "theta", "eta",
            "alpha"} <= set(mem[0]["memory"]["layers"][0])
    capsys.readouterr()
    assert main(["eval", str(run), "--task", "recall", "--distances", "8,40", "--batches", "1",
                 "--recall-layout", "n_pairs=2,n_queries=2,n_keys=4,n_values=4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["task"] == "recall" and out["chance"] == pytest.approx(0.25)
    assert set(out["accuracy_by_distance"]) == {"8", "40"}
    assert all(0 <= a <= 1 for a in out["accuracy_by_distance"].values())
    # bad input: one line, exit 2
    assert main(["eval", str(run), "--task", "recall", "--distances", "8,x"]) == 2
    assert "--distances" in capsys.readouterr().err
    assert main(["eval", str(run), "--task", "recall", "--recall-layout", "pairs=2"]) == 2
    assert "--recall-layout" in capsys.readouterr().err
    assert main(["eval", str(run)]) == 2
    assert "--data is required" in capsys.readouterr().err


def test_needle_task_places_one_needle_in_prose() -> None:
    """benchmarks/recall_distance.py --task niah: one key-value needle `distance` tokens
    before the final query key, which repeats the needle's key; the rest is text filler."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import recall_distance as rd

    task = rd.NeedleRecall(64, 32, seed=0, n_keys=8, n_values=8)
    assert task.max_distance == 62 and task.chance == 1 / 8
    for d in (8, 30, task.max_distance):
        b = task.batch(16, "val", torch.Generator().manual_seed(1), distance=d)
        L = b.shape[1]
        p0 = L - 3 - d
        assert ((b[:, p0] < 8) & (b[:, p0] == b[:, L - 2])).all()          # the needle's key
        assert ((b[:, p0 + 1] >= 8) & (b[:, p0 + 1] < 16)).all()           # its value
        assert torch.equal(b[:, p0 + 1], b[:, L - 1])
        rest = torch.cat([b[:, :p0], b[:, p0 + 2:L - 2]], 1)
        assert ((rest >= 16) & (rest < 32)).all()                           # text only
    assert (L - 2 - (p0 + 1)) == task.max_distance                          # value to query
    train = task.batch(4, "train", torch.Generator().manual_seed(1))
    val = task.batch(4, "val", torch.Generator().manual_seed(1))
    assert not torch.equal(train[:, 2:-2], val[:, 2:-2])                    # disjoint text


@pytest.mark.parametrize("layout", ["packed", "scattered"])
def test_needle_task_trains_on_several_needles_and_a_repeated_filler(layout: str) -> None:
    """--train-needles N: a training sequence holds N needles with distinct keys at
    non-overlapping places (packed: side by side, `distance` + 2N before the first query,
    asked in their order) and ends with their N queries (key, then its value); held-out
    sequences keep one needle. --task passkey: the filler is one sentence repeated."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import recall_distance as rd

    task = rd.NeedleRecall(64, 32, seed=0, n_keys=8, n_values=8, train_needles=4,
                           needle_layout=layout)
    b = task.batch(32, "train", torch.Generator().manual_seed(3), distance=20)
    L, N = b.shape[1], 4
    if layout == "packed":
        first = L - 2 * N - 20 - 2 * N
        assert ((b[:, first:first + 2 * N:2] < 8).all()
                and torch.equal(b[:, first:first + 2 * N], b[:, L - 2 * N:]))
    for row in b:
        body, queries = row[:L - 2 * N], row[L - 2 * N:]
        where = (body < 8).nonzero().flatten()                    # the needles' keys
        assert len(where) == N and len(set(body[where].tolist())) == N
        assert ((body[where + 1] >= 8) & (body[where + 1] < 16)).all()
        needles = dict(zip(body[where].tolist(), body[where + 1].tolist()))
        asked = dict(zip(queries[0::2].tolist(), queries[1::2].tolist()))
        assert asked == needles                                   # every needle asked once
        rest = torch.ones_like(body, dtype=torch.bool)
        rest[where], rest[where + 1] = False, False
        assert (body[rest] >= 16).all()
    one = task.batch(8, "val", torch.Generator().manual_seed(3), distance=20)
    assert ((one < 8).sum(1) == 2).all()                          # one needle, its query
    pk = rd.NeedleRecall(64, 32, seed=0, filler="repeat")
    a = pk.batch(4, "val", torch.Generator().manual_seed(1), distance=30)
    period = len(rd.PASSKEY_FILLER)
    text = pk.text["val"]
    assert torch.equal(text[:period], text[period:2 * period])   # one sentence repeated
    for row in a:                                                 # a window of it, then
        assert any(torch.equal(row[:20], text[o:o + 20]) for o in range(period))   # the needle
    with pytest.raises(SystemExit, match="train-needles"):
        rd.NeedleRecall(64, 32, n_keys=8, train_needles=9)


def test_benchmark_block_options_apply_to_their_block_only() -> None:
    """recall_distance.py's BLOCK_SET and `--set BLOCK:key=value` reach only that block's spec
    (mac's and mag's options are errors on any other block), a plain `--set` reaches all
    (replacing BLOCK_SET's per-block value of its key),
    and every block's FFN width still matches mag's parameter count."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import recall_distance as rd
    from titanc.model.params import param_count
    from titanc.model.spec import load_spec

    over = rd.configure(["model.memory.momentum=0.8", "model.memory.lr_max=3",
                         "mag:model.memory.gate=memory"], [])
    specs = {b: load_spec(rd.spec_with(b, 0, 32, 10, over)).model
             for b in ("lmm", "mac", "mag", "mal", "attn")}
    assert specs["mag"].memory.gate == "memory"                 # --set wins over BLOCK_SET
    mac = specs["mac"].memory
    assert (mac.gate, mac.mac_write, mac.mac_read) == ("attention", "input", "residual")
    for b in ("lmm", "mal", "attn"):
        m = specs[b].memory
        assert (m.gate, m.mac_write, m.mac_read) == ("memory", "attention", "context")
    assert all(s.memory.momentum == 0.8 for s in specs.values())
    # a plain --set replaces BLOCK_SET's per-block default (lmm's lr_max 4) for every block
    assert all(s.memory.lr_max == 3 for s in specs.values())
    lmm = specs["lmm"].memory
    assert (lmm.momentum_form, lmm.decay_max, lmm.heads) == ("ema", 0.0005, 1)
    assert specs["mac"].memory.momentum_form == "heavy_ball"       # the paper's write
    assert all((specs[b].memory.momentum_form, specs[b].memory.decay_max) == ("ema", 0.0005)
               for b in ("mag", "mal"))
    assert specs["lmm"].memory.chunk_size == specs["mac"].memory.chunk_size == 8
    assert specs["mal"].memory.chunk_size == specs["mag"].memory.chunk_size == 4
    counts = {b: param_count(s) for b, s in specs.items()}
    per8 = 3 * 8 * specs["mag"].d_model                          # params per 8 FFN units
    assert all(abs(c - counts["mag"]) <= per8 / 2 for c in counts.values()), counts


def test_benchmark_family_presets_train_the_lmm_block_with_their_memory() -> None:
    """`recall_distance.py --blocks deltanet,gated_deltanet,titans_fla`: each name trains the
    lmm block with examples/NAME.yaml's memory section at the benchmark's sizes, a plain
    `--set` still reaches it, and its FFN width matches mag's parameter count."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import recall_distance as rd
    from titanc.model.params import param_count
    from titanc.model.spec import load_spec

    over = rd.configure(["model.memory.conv_kernel=2", "deltanet:model.memory.lr_max=8"], [])
    specs = {b: load_spec(rd.spec_with(b, 0, 32, 10, over)).model
             for b in ("mag",) + rd.FAMILY}
    for name in rd.FAMILY:
        preset = load_spec(str(Path(__file__).resolve().parents[1] / "examples"
                               / f"{name}.yaml")).model.memory
        m = specs[name].memory
        assert specs[name].block == "lmm" and m.conv_kernel == 2
        for field in ("momentum_form", "read", "decay_form", "decay_order", "inner",
                      "post_norm", "value_width", "chunk_size", "fixed"):
            assert getattr(m, field) == getattr(preset, field), (name, field)
        assert m.lr_max == (8 if name == "deltanet" else preset.lr_max)
    counts = {b: param_count(s) for b, s in specs.items()}
    per8 = 3 * 8 * specs["mag"].d_model
    assert all(abs(c - counts["mag"]) <= per8 / 2 for c in counts.values()), counts


def test_benchmark_merges_runs_of_one_configuration(tmp_path: Path) -> None:
    """`recall_distance.py --merge A.json B.json --out M.json`: one sweep from runs made in
    separate processes (rows concatenated, summary over all of them, the plot beside it);
    runs of another configuration are refused with one line."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import recall_distance as rd

    config = {"spec": rd.SPEC, "overrides": {}, "task": dict(rd.TASK), "curriculum": "32:10",
              "distances": [8, 64], "budget_cpu_s": 600.0, "chance": 0.125}

    def run(name: str, block: str, accs: list[float], cfg: dict) -> str:
        rows = [{"block": block, "seed": i, "params": 1,
                 "accuracy": {"8": a, "64": a / 2}} for i, a in enumerate(accs)]
        path = tmp_path / name
        path.write_text(json.dumps({"config": cfg, "results": rows}))
        return str(path)

    out = tmp_path / "merged.json"
    result = rd.merge([run("a.json", "lmm", [1.0, 0.5], config),
                       run("b.json", "lmm", [0.75], config),
                       run("c.json", "attn", [0.125], config)], out)
    assert json.loads(out.read_text()) == result and out.with_suffix(".png").exists()
    assert [r["block"] for r in result["results"]] == ["lmm", "lmm", "lmm", "attn"]
    assert result["summary"]["lmm"]["8"] == {"mean": 0.75, "min": 0.5, "max": 1.0}
    assert result["summary"]["lmm"]["64"]["min"] == 0.25
    # each block is compared with itself: mag trained on another curriculum merges, as mag's
    # own; lmm on two curricula (or another task) does not
    other = run("d.json", "mag", [1.0], {**config, "curriculum": "32:20"})
    result = rd.merge([run("a.json", "lmm", [1.0], config), run("b.json", "lmm", [0.5], config),
                       other], out)
    assert (result["config"]["curriculum"], result["config"]["block_curriculum"]) == (
        "32:10", {"mag": "32:20"})
    with pytest.raises(SystemExit, match="d.json was made with another configuration"):
        rd.merge([run("a.json", "lmm", [1.0], config),
                  run("d.json", "lmm", [1.0], {**config, "curriculum": "32:20"})], out)
    with pytest.raises(SystemExit, match="t.json was made with another configuration"):
        rd.merge([run("a.json", "lmm", [1.0], config),
                  run("t.json", "attn", [1.0], {**config, "task": {**rd.TASK, "n_pairs": 6}})],
                 out)
    # a run of blocks that each train on their own curriculum: its default does not matter
    own = {**config, "block_curriculum": {"mac": "32:5"}}
    result = rd.merge([run("e.json", "lmm", [1.0], own),
                       run("f.json", "mac", [0.5], {**own, "curriculum": "32:20"})], out)
    assert result["config"]["curriculum"] == "32:10"
    assert result["config"]["block_curriculum"] == {"mac": "32:5"}
    assert [r["block"] for r in result["results"]] == ["lmm", "mac"]
    with pytest.raises(SystemExit, match="f.json was made with another configuration"):
        rd.merge([run("e.json", "lmm", [1.0], own),
                  run("f.json", "lmm", [0.5], {**own, "curriculum": "32:20"})], out)
    # a block's own option counts only where that block trained: lmm re-run with a new lmm
    # option merges with the other blocks' earlier runs, not with lmm runs without it
    new = {**config, "overrides": {"lmm:model.memory.decay_max": 0.004, "mac:x": 1}}
    old = {**config, "overrides": {"mac:x": 1}}
    result = rd.merge([run("g.json", "mac", [0.5], old), run("h.json", "lmm", [1.0], new)], out)
    assert result["config"]["overrides"] == {"mac:x": 1, "lmm:model.memory.decay_max": 0.004}
    with pytest.raises(SystemExit, match="i.json was made with another configuration"):
        rd.merge([run("h.json", "lmm", [1.0], new), run("i.json", "lmm", [0.5], old)], out)
