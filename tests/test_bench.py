"""`titanc bench` and the profile summary; the remat benchmark's claims as assertions.

The remat numbers come from static plans (compile_graphs, nothing model-sized allocated):
per_layer remat cuts an 8-layer model's peak activation bytes by more than 2x, and the
chunked LM head keeps the largest logits buffer at loss_chunk x vocab x 4 bytes whatever
the batch and sequence length."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from tests.helpers import TINY
from titanc.runtime.diagnostics.timing import peak_flops, profile_summary, profile_table
from titanc.tools.cli import main
from titanc.ir.kernel_family import PROFILE_LABELS

ROOT = Path(__file__).resolve().parent.parent


def _load_benchmark(name: str) -> ModuleType:
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod              # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_bench_one_step_prints_every_category(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({**TINY, "model": {**TINY["model"], "block": "mac"}}))
    code = main(["bench", str(path), "--steps", "1", "--warmup", "1", "--threads", "1",
                 "--set", "train.dtype=float32"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("t: compiled in ") and "1 warm-up steps" in lines[0]
    assert lines[1].startswith("profile: 1 steps, 32 tokens in ")
    assert "(cpu, 1 thread, float32)" in lines[1]
    rows = {cat: next((l for l in lines if l.startswith(f"  {cat} ")), None)
            for cat in (*PROFILE_LABELS, "outside kernels", "total")}
    assert all(rows.values()), rows
    for cat in PROFILE_LABELS:                 # time, share, launches per step (all ran)
        assert float(rows[cat].split()[-1]) > 0, rows[cat]
    assert any(l.startswith("  tokens/s ") for l in lines)
    assert "  MFU              n/a (no known peak FLOP/s for cpu)" in lines
    assert any(l.startswith("  peak memory ") and "(process RSS); planned arena + persistent"
               in l for l in lines)


def test_profile_summary_json_and_mfu() -> None:
    prof = {c: 0.1 for c in PROFILE_LABELS}
    kw = dict(flops_per_step=5e14, model_flops_per_step=3e14, device="NVIDIA H100 80GB HBM3",
              dtype="bfloat16")
    s = profile_summary(prof, steps=2, tokens=4096, seconds=1.0, peak_bytes=2**30, **kw)
    json.dumps(s)
    assert s["tokens_per_s"] == 4096
    assert s["outside_kernels_seconds"] == pytest.approx(1.0 - 0.1 * len(PROFILE_LABELS))
    assert s["mfu"] == pytest.approx(6e14 / 989.5e12)      # the model's FLOPs
    assert s["hfu"] == pytest.approx(1e15 / 989.5e12)      # the executed ones
    text = profile_table(prof, 2, 4096, 1.0, 2**30, **kw)
    assert f"  MFU / HFU        {100 * 6e14 / 989.5e12:.2f}% MFU, {100e15 / 989.5e12:.2f}% HFU " \
           f"of NVIDIA H100 80GB HBM3 990TFLOP/s (bfloat16)" in text
    assert "peak memory      1.0 GiB (CUDA allocator)" in text


def test_peak_flops_by_device_name() -> None:
    assert peak_flops("cpu") is None
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.5e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops("NVIDIA H100 NVL", "float64") == 60e12
    assert peak_flops("NVIDIA H200", "float64") == 67e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16") is None


def test_remat_per_layer_cuts_peak_activation_of_8_layers() -> None:
    rm = _load_benchmark("remat_memory")
    r = rm.remat(8, base={**TINY, "model": {**TINY["model"], "block": "mac"}})
    none, per_layer = r["none"]["peak_activation_bytes"], r["per_layer"]["peak_activation_bytes"]
    assert per_layer < none
    assert r["factor"] == none / per_layer > 2


def test_logits_buffer_is_one_loss_chunk_whatever_batch_and_seq_len() -> None:
    rm = _load_benchmark("remat_memory")
    V = rm.VOCAB
    rows = [rm.big_vocab(seq, batch, base=TINY) for seq, batch in ((2048, 4), (4096, 1))]
    for r in rows:
        assert r["logits_bytes"] == 1024 * V * 4 == r["one_chunk_bytes"]
        assert r["fused_logits_bytes"] == 0
        assert r["fused_peak_activation_bytes"] < r["peak_activation_bytes"]
        assert r["full_logits_bytes"] == r["batch_size"] * r["seq_len"] * V * 4


def test_gpu_check_times_once_no_other_job_compiles(tmp_path: Path, monkeypatch) -> None:
    """benchmarks/gpu_check.py: a timed loop waits while another running job has reported
    no first step (its compiles load the host: titans-pytorch's eager steps timed meanwhile
    on the H100 came out 2-3x slow); a job done compiling, or no longer running, does not
    hold it; at the deadline's margin it times anyway and says so."""
    import time

    gc = _load_benchmark("gpu_check")
    monkeypatch.setattr(gc, "OUT", tmp_path)
    monkeypatch.setattr(gc, "RESULTS", tmp_path / "results.jsonl")
    monkeypatch.setenv("GPU_CHECK_JOB", "tiny_bf16")
    (tmp_path / "running.json").write_text(json.dumps(["tiny_bf16", "chk_mac_f32",
                                                       "peer_tiny"]))
    gc.emit("peer_tiny_default_f32", "first_step", first_step_s=1.0)
    gc.emit("tiny_bf16", "first_step", first_step_s=1.0)
    assert gc.compiling_jobs("tiny_bf16") == ["chk_mac_f32"]
    # the deadline is within the margin: no wait, and the record says who was compiling
    monkeypatch.setenv("GPU_CHECK_DEADLINE", str(time.time() + gc.QUIET_MARGIN_S - 5))
    r = gc.quiet_host()
    assert r["host_quiet"] is False and r["compiling"] == ["chk_mac_f32"]
    assert r["quiet_wait_s"] < 1
    # the check ends while we wait: the loop times as soon as it sees that
    monkeypatch.setenv("GPU_CHECK_DEADLINE", str(time.time() + gc.QUIET_MARGIN_S + 60))
    import threading
    threading.Timer(1.5, lambda: gc.emit("chk_mac_f32", "result", ok=True)).start()
    r = gc.quiet_host()
    assert r["host_quiet"] is True and 1.0 <= r["quiet_wait_s"] < 10
    times, waits = gc.timed(lambda: None, 2, 3)
    assert len(times) == 2 and waits["host_quiet"] is True and "lock_wait_s" in waits


def test_gpu_profile_prices_a_scan_round(monkeypatch) -> None:
    """benchmarks/gpu_profile.py: each scan kernel the profiler saw gets its serial tile
    rounds an iteration and its µs per round (µs / (launches x iterations x rounds));
    gpu_check's table prints them. The profiler's record is made up here (no CUDA)."""
    import titanc

    gp = _load_benchmark("gpu_profile")
    gc = _load_benchmark("gpu_check")
    prog = titanc.compile(TINY, **{"compile.target": "cpu"})
    forms: list[dict] = []
    from titanc.runtime.targets.triton_executor import count_launches
    count_launches(prog.compiled.plans["training"], forms=forms)
    kern = next(f for f in forms if f["form"] == "kernel")
    steps = 2
    per = {kern["scan"]: [4 * steps, 800.0 * steps], "titanc_poi_other": [2, 10.0]}
    (row,) = [s for s in gp.scan_rounds(prog, per, steps) if s["kernel"] == kern["scan"]]
    assert row["rounds"] == kern["rounds"] > 0 and row["iterations"] == kern["length"]
    assert row["per_step"] == 4 and row["us_per_step"] == 800.0
    assert row["us_per_round"] == round(800.0 / (4 * kern["length"] * kern["rounds"]), 3)
    report = {"device": "test", "date": "today", "seconds": 1.0, "deadline_s": 2,
              "jobs": {"profile_tiny_bf16": {"phase": "profile", "kernels_per_step": 3,
                                             "kernel_us_per_step": 810.0,
                                             "eager_wall_us_per_step": 900.0,
                                             "top": [], "scans": [row]}}}
    text = gc.table(report)
    assert "us/round" in text and str(row["us_per_round"]) in text


def test_gpu_run_default_jobs_are_gpu_check_jobs() -> None:
    """Every job (or group) benchmarks/gpu_run.sh asks benchmarks/gpu_check.py for by default
    exists there, with its environment where it has one: a misspelt name would cost a device
    call its row."""
    import re

    gc = _load_benchmark("gpu_check")
    text = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    only = re.search(r"^ONLY=\$\{ONLY:-([^}]*)\}", text, re.M).group(1).split(",")
    known = set(gc.GROUPS) | {n for v in gc.GROUPS.values() for n in v}
    assert set(only) <= known, set(only) - known
    assert set(gc.JOB_ENV) <= known
    assert gc.JOB_ENV["tiny_bf16_interp_blocks"] == {"TITANC_GPU_BLOCKS": "0"}


def test_mfu_counts_the_models_flops_not_the_recompute() -> None:
    """`Compiled.model_flops()` (MFU) is the step with nothing recomputed: under `remat:
    per_layer` the kernels execute more (`step_flops`, HFU: the layers' forwards again), and
    the model's FLOPs are those a `remat: none` compile executes (its casts aside: 1%)."""
    from titanc.compiler import compile_graphs
    from titanc.model.spec import load_spec
    from titanc.tools.bench import step_flops

    small = {"model.d_model": 16, "model.n_layers": 2, "model.seq_len": 32,
             "model.vocab_size": 32, "train.batch_size": 2, "train.grad_accum": 2}
    c = {remat: compile_graphs(load_spec(TINY, {**small, "train.remat": remat}),
                               verify_each=False) for remat in ("per_layer", "none")}
    none = step_flops(c["none"])
    assert c["none"].model_flops() == pytest.approx(none, rel=0.01)
    assert c["per_layer"].model_flops() == pytest.approx(none, rel=0.01)
    assert step_flops(c["per_layer"]) > 1.2 * c["per_layer"].model_flops()


def test_dense_baseline_counts_its_matmul_flops_and_learns() -> None:
    """benchmarks/dense_transformer.py (gpu_check's `dense` jobs): its `model_flops` less the
    attention term is what torch's FLOP counter counts in one forward and backward (every
    projection and the tied LM head; no SDPA on CPU), the causal attention is half the full,
    and AdamW steps on one batch bring the loss down from ln(vocab)."""
    import math

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from titanc.model.spec import load_spec

    dt = _load_benchmark("dense_transformer")
    n = dt.Dims(vocab=32, d=16, layers=2, heads=2, ffn=24, seq=16)
    torch.manual_seed(0)
    model = dt.DenseTransformer(n)
    toks = torch.randint(0, n.vocab, (2, n.seq + 1))
    with FlopCounterMode(display=False) as fc:
        model(toks).backward()
    full, causal = dt.model_flops(n, 2, causal=False), dt.model_flops(n, 2)
    attention = full - causal
    assert fc.get_total_flops() == full - 2 * attention == 6 * dt.matmul_params(n) * 2 * n.seq
    spec = load_spec(TINY, {"model.d_model": 16, "model.n_layers": 1, "model.seq_len": 16,
                            "model.vocab_size": 32, "model.ffn_hidden": 24,
                            "model.attention.heads": 2, "train.batch_size": 2})
    step, _, B = dt.make_step(spec, "cpu", False, False)
    losses = [float(step()) for _ in range(30)]
    assert B == 2 and abs(losses[0] - math.log(32)) < 0.3 and losses[-1] < losses[0] - 1.0


def test_elementwise_traffic_names_what_keeps_each_kernel_out() -> None:
    """benchmarks/elementwise_traffic.py: the outside bytes split by the rule that keeps a
    kernel out of the one writing its largest input, adding up to the outside total; a
    rule's reason with its node ids as %n, so kernels refused alike add up."""
    bench = _load_benchmark("elementwise_traffic")
    r = bench.traffic(str(ROOT / "examples" / "tiny.yaml"), {"train.batch_size": 2}, top=50)
    reasons = r["outside_by_reason"]
    assert sum(reasons.values()) == r["outside_bytes"] > 0
    assert all(why and "%" not in why.replace("%n", "") for why in reasons), reasons
    assert any("views a computed value" in why for why in reasons), reasons
    assert all(t["blocked"] in reasons for t in r["top"])
    assert list(reasons.values()) == sorted(reasons.values(), reverse=True)
