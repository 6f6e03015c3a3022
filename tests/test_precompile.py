"""Every kernel compiled in parallel before the first step (`runtime/targets/precompile.py`).

- the stand-in arguments a compile worker passes to `JITFunction.warmup` on the GPU specialise
  exactly as the recorded launch's real arguments did (Triton's own `native_specialize_impl`:
  pointer dtype and 16-byte alignment, integer width and divisibility, constexprs), so the
  warmup computes the cache key the launch will;
- `precompile` records a plan's launches in a subprocess, compiles them in worker processes
  (ahead of time here: sm_90, no GPU) with their grids, and a second call compiles nothing;
- `titanc compile --arch` refuses an architecture it has no tables for.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import pytest

from titanc.runtime.targets import aot
from titanc.runtime.targets.precompile import precompile
from titanc.runtime.targets.precompile_worker import standins
from titanc.codegen.render import load_module
from titanc.compiler import compile_graphs
from titanc.model.spec import load_spec

from .conftest import EXAMPLES

SMALL = {"model.d_model": 8, "model.n_layers": 1, "model.seq_len": 8, "model.vocab_size": 16,
         "model.ffn_hidden": 8, "train.batch_size": 1, "model.memory.heads": 2,
         "model.memory.chunk_size": 2}


def test_standins_specialise_as_the_recorded_arguments() -> None:
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    c = compile_graphs(load_spec(EXAMPLES / "tiny_lmm.yaml", SMALL))
    launches = aot.record_launches(c.plans["training"])
    assert any(l.is_scan for l in launches) and any(l.is_matmul for l in launches)
    for launch in launches:
        module = load_module(launch.source, launch.name)
        args, _, _ = standins(launch, module, 90)
        for (name, ty), arg in zip(launch.signature, args):
            if ty == "constexpr":
                continue
            got_ty, attr = native_specialize_impl(BaseBackend, arg, False, True, True)
            assert got_ty == ty, (launch.name, name, got_ty, ty)
            assert (attr == "D") == (name in launch.divisible), (launch.name, name, attr)


def test_precompile_compiles_every_kernel_once(tmp_path, monkeypatch) -> None:
    """Several plans in one pool (what a Program precompiles before its first step): one
    recording, a launch the plans share compiled once, every plan's marker written, so each
    plan alone and both together are cached after."""
    from titanc import config

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))    # Triton reads it
    plan = compile_graphs(load_spec(EXAMPLES / "tiny_lmm.yaml", SMALL)).plans["optimizer"]
    other = compile_graphs(load_spec(EXAMPLES / "tiny_attn.yaml", SMALL)).plans["optimizer"]
    with config.override(cache_dir=tmp_path / "titanc"):
        first = precompile([plan, other], 90, jit=False, jobs=2, progress=False)
        again = precompile(plan, 90, jit=False, jobs=2, progress=False)
        alone = precompile(other, 90, jit=False, jobs=2, progress=False)
        both = precompile([other, plan], 90, jit=False, jobs=2, progress=False)
    if any("ptxas" in r.get("error", "") for r in first["results"]):
        pytest.skip("this triton build has no ptxas")
    assert first["kernels"] == first["compiled"] >= 1 and not first["failed"]
    assert not first["cached"] and all(r["ok"] and r["registers"] for r in first["results"])
    assert first["kernels"] == len({json.dumps(r, sort_keys=True) for r in first["results"]})
    assert set(first["grids"]) == {r["name"] for r in first["results"]}
    assert all(p >= 1 for p in first["grids"].values())
    assert set(first["aliases"].values()) <= set(first["grids"])
    assert again["cached"] and alone["cached"] and both["cached"]
    assert again["kernels"] == alone["kernels"] == both["kernels"] == first["kernels"]


def test_a_second_process_finds_the_markers(tmp_path, monkeypatch) -> None:
    """A second run of a spec compiles nothing: its plans come back from the compile cache
    (their pickles differ from the fresh ones'), so the markers are keyed by what the plans
    were compiled from (`Executors.plans`), the same in both."""
    import titanc
    from titanc import compile_cache, config
    from titanc.runtime.program import Program
    from titanc.runtime.targets import precompile as pc

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    over = {**SMALL, "compile.target": "triton"}
    with config.override(cache_dir=tmp_path / "titanc"):
        fresh = titanc.compile(EXAMPLES / "tiny_lmm.yaml", **over)
        plans, keys = fresh.executors.plans()
        # what a second process compiles: the compile cache's copy (this test process
        # memoizes compiles, tests/helpers.py, so it is stored and read back here)
        key = compile_cache.compile_key(fresh.spec, None, True)
        compile_cache.store(key, fresh.compiled, True)
        again = Program(compile_cache.load(key, False))
        plans2, keys2 = again.executors.plans()
        assert keys == keys2 and plans2[0] is not plans[0]
        # the markers are what this test is about: the pool compiles nothing (its compiles
        # are test_precompile_compiles_every_kernel_once's)
        monkeypatch.setattr(pc, "_pool", lambda launches, *a: [
            {"name": l["name"], "ok": True} for l in launches])
        first = precompile(plans[1:2], 90, jit=False, progress=False, keys=keys[1:2])
        second = precompile(plans2[1:2], 90, jit=False, progress=False, keys=keys2[1:2])
        marker = pc._marker(plans2[1], keys2[1], 90, False, False)
        assert marker.exists() and pc._marker(plans2[1], "other", 90, False, False) != marker
        # a switch that changes which kernels launch keys its own marker
        for switch in ({"scan_kernels": False}, {"scan_cost": False}, {"split_k": True},
                       {"gpu_blocks": False}, {"group_launches": False}):
            with config.override(**switch):
                assert pc._marker(plans2[1], keys2[1], 90, False, False) != marker, switch
    assert not first["cached"] and second["cached"]
    assert second["kernels"] == first["kernels"] >= 1
    # each executor's own precompile (a graph bound later: evaluation at another batch) is
    # keyed the same way, by both programs
    bound: list[str] = []

    def executor(plan, tensors, **options):
        bound.append(options["plan_key"])
        return object()

    for prog in (fresh, again):
        prog.executors.cls = executor
        for cg in (prog.graph("training", prog.batch_size), prog.graph("forward", 3)):
            prog.executors.bind(cg)
    assert bound[0] == bound[2] == keys[0] and bound[1] == bound[3] != keys[2]


def test_a_second_program_binds_without_rendering(tmp_path, monkeypatch) -> None:
    """The triton target keeps the kernels it rendered for a plan in the compile cache's
    folder, under the plan's key (`Compiled.graph_key`), the dtype and tf32: a second
    program (a second process) binds the same plan with nothing rendered, to the same
    kernels and scan kernels."""
    import titanc
    from titanc import config
    from titanc.runtime.targets import triton_executor as te

    over = {**SMALL, "compile.target": "triton", "model.n_layers": 1}

    def bind(prog):
        return prog.executors.of(prog.graph("training", prog.batch_size))

    with config.override(cache_dir=tmp_path / "titanc", compile_cache=True, debug=0):
        first = bind(titanc.compile(EXAMPLES / "tiny_lmm.yaml", **over))
        assert len(list((tmp_path / "titanc" / "rendered").glob("*.pickle"))) == 1

        def refuse(*a, **k):
            raise AssertionError("rendered again")
        monkeypatch.setattr(te, "render_kernel", refuse)
        monkeypatch.setattr(te, "scan_kernel_for", refuse)
        second = bind(titanc.compile(EXAMPLES / "tiny_lmm.yaml", **over))
        assert [k.source for k in second.kernels()] == [k.source for k in first.kernels()]
        scans = [v for v in second._scans.values() if isinstance(v, te.ScanKernel)]
        assert scans and scans == [v for v in first._scans.values()
                                   if isinstance(v, te.ScanKernel)]
        assert second.fallbacks == first.fallbacks
        # another dtype renders its own
        with pytest.raises(AssertionError, match="rendered again"):
            bind(titanc.compile(EXAMPLES / "tiny_lmm.yaml", **over,
                                **{"train.dtype": "float64"}))


def test_subprocesses_import_the_package_from_a_folder_with_its_own_titanc(tmp_path) -> None:
    """The precompile's recorder and workers, and the distributed launcher's ranks, run with
    `config.module_command`: from a folder holding a titanc/ of its own (a checkout's root,
    where the GPU check runs) `python -m` would import that folder instead of the package."""
    import subprocess
    import sys

    from titanc.config import child_environment, module_command

    (tmp_path / "titanc").mkdir()
    (tmp_path / "titanc" / "__init__.py").write_text("raise SystemExit(7)\n")
    env = child_environment()
    shadowed = subprocess.run([sys.executable, "-m", "titanc.config"], cwd=tmp_path, env=env)
    ours = subprocess.run(module_command("titanc.config"), cwd=tmp_path, env=env)
    assert shadowed.returncode == 7 and ours.returncode == 0


def test_compile_arch_is_validated(tmp_path, capsys) -> None:
    from titanc.tools.cli import main

    assert main(["compile", str(EXAMPLES / "tiny.yaml"), "-o", str(tmp_path / "b"),
                 "--arch", "75"]) == 2
    assert "--arch 75: one of 80, 86, 89, 90" in capsys.readouterr().err


def test_occupancy_rows_name_why_a_big_kernel_has_few_programs(monkeypatch) -> None:
    """report.json `occupancy` (`cost_model.occupancy`): every launched kernel of a training
    step with its recorded grid and FLOPs share (the shares of the launched kernels, scan
    kernels holding their bodies', sum to 1), and `why_under` exactly where a kernel holds
    more than 1% of the FLOPs on fewer than 132 programs (compiles faked: only the grids)."""
    import titanc.runtime.targets.precompile as pre
    from titanc.tools.cost_model import SMS, occupancy

    def recorded(plan, arch, **kw):
        grids, aliases = {}, {}
        aot.record_launches(plan, grids=grids, aliases=aliases)
        return {"grids": grids, "aliases": aliases, "results": []}

    monkeypatch.setattr(pre, "precompile", recorded)
    c = compile_graphs(load_spec(EXAMPLES / "tiny_lmm.yaml", SMALL))
    occ = occupancy(c, 90)
    rows = occ["kernels"]
    assert rows and all(r["programs"] >= 1 for r in rows)
    assert abs(sum(r["flops_share"] for r in rows) - 1) < 0.01
    assert any("scan_memory_chunk" in r["name"] for r in rows)
    for r in rows:
        assert ("why_under" in r) == (r["flops_share"] > 0.01 and r["programs"] < SMS), r
    scan = next(r for r in rows if "scan_memory_chunk" in r["name"] and "why_under" in r)
    assert scan["programs"] == 1 * 2 and "chunk recurrence" in scan["why_under"]
    assert occ["under"] == sum("why_under" in r for r in rows)


# a compile worker that takes 0.15 s a kernel and logs how many workers are alive with it
_FAKE_WORKER = """
import json, os, sys, time
live = sys.argv[1]
me = os.path.join(live, str(os.getpid()))
open(me, "w").close()
for line in sys.stdin:
    time.sleep(0.15)
    with open(os.path.join(live, "..", "log"), "a") as f:
        f.write(f"{len(os.listdir(live))}\\n")
    sys.stdout.write(json.dumps({"name": json.loads(line)["name"], "ok": True}) + "\\n")
    sys.stdout.flush()
os.remove(me)
"""


def test_the_compile_pools_of_every_process_share_the_machines_slots(tmp_path, monkeypatch
                                                                      ) -> None:
    """Two pools at once (two programs precompiling; on the H100, 19), each asking for 4
    workers, with TITANC_COMPILE_JOBS=2: never more than 2 workers alive, and every kernel
    compiled by one of them."""
    import sys
    import threading
    from functools import partial

    from titanc import config
    from titanc.runtime.targets import precompile as pc

    live = tmp_path / "live"
    live.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(_FAKE_WORKER)
    monkeypatch.setattr(pc, "module_command",
                        lambda *a: [sys.executable, str(script), str(live)])
    monkeypatch.setattr(pc, "CompileSlots", partial(pc.CompileSlots, root=tmp_path / "slots"))
    results: dict[int, list] = {}

    def pool(i: int) -> None:
        launches = [{"name": f"k{i}_{j}", "source": "x" * j} for j in range(6)]
        results[i] = pc._pool(launches, 90, False, 4, False)

    with config.override(compile_jobs=2):
        threads = [threading.Thread(target=pool, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    alive = [int(n) for n in (tmp_path / "log").read_text().split()]
    assert len(alive) == 12 and max(alive) <= 2
    assert sorted(r["name"] for i in (0, 1) for r in results[i]) == sorted(
        f"k{i}_{j}" for i in (0, 1) for j in range(6))
    assert all(r["ok"] for i in (0, 1) for r in results[i])


def test_compile_slots_wait_for_a_free_one_or_give_up(tmp_path) -> None:
    from titanc.runtime.targets.precompile import CompileSlots

    slots = CompileSlots(2, root=tmp_path)
    a, b = slots.try_acquire(), slots.try_acquire()
    assert a is not None and b is not None and slots.try_acquire() is None
    assert slots.acquire(give_up=lambda: True) is None
    slots.release(a)
    c = slots.acquire(give_up=lambda: True)
    assert c is not None
    slots.release(b)
    slots.release(c)


def test_a_bad_compile_jobs_variable_is_named() -> None:
    from titanc.config import Config
    from titanc.errors import TitancError

    assert Config.from_env({"TITANC_COMPILE_JOBS": "3"}).compile_slots() == 3
    assert Config.from_env({}).compile_slots() >= 1
    with pytest.raises(TitancError, match="TITANC_COMPILE_JOBS='lots'"):
        Config.from_env({"TITANC_COMPILE_JOBS": "lots"}).compile_slots()


def test_processes_precompiling_the_same_plan_compile_it_once(tmp_path, monkeypatch) -> None:
    """Two precompiles of one plan at once (the ranks of `titanc train --nproc`): one
    records and compiles, the other waits on the plan's lock and finds its marker."""
    import threading
    import time

    from titanc import config
    from titanc.runtime.targets import precompile as pc

    pools: list[int] = []

    def pool(launches, *a):
        pools.append(len(launches))
        time.sleep(0.5)
        return [{"name": l["name"], "ok": True} for l in launches]

    monkeypatch.setattr(pc, "recorded_launches", lambda plans, *a: (
        [{"name": "k0", "source": ""}, {"name": "k1", "source": ""}],
        {"grids": {}, "aliases": {}}))
    monkeypatch.setattr(pc, "_pool", pool)
    out: dict[int, dict] = {}

    def run(i: int) -> None:
        with config.override(cache_dir=tmp_path):
            out[i] = pc.precompile(["plan"], 90, jit=False, progress=False, keys=["key"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert pools == [2]
    assert sorted(r["cached"] for r in out.values()) == [False, True]
    assert all(r["kernels"] == 2 for r in out.values())


def test_a_pool_whose_workers_cannot_start_names_every_kernel_failed(tmp_path, monkeypatch
                                                                      ) -> None:
    """A worker that dies at once (here: a command that exits) leaves its kernels failed, so
    `precompile` writes no marker claiming them; and an unusable slot folder does not stop
    the pool."""
    import sys
    from functools import partial

    from titanc.runtime.targets import precompile as pc

    monkeypatch.setattr(pc, "module_command", lambda *a: [sys.executable, "-c", "pass"])
    blocked = tmp_path / "file"
    blocked.write_text("")                       # a file where the slot folder should be
    monkeypatch.setattr(pc, "CompileSlots", partial(pc.CompileSlots, root=blocked / "slots"))
    launches = [{"name": f"k{j}", "source": ""} for j in range(3)]
    results = pc._pool(launches, 90, False, 2, False)
    assert sorted(r["name"] for r in results) == ["k0", "k1", "k2"]
    assert not any(r["ok"] for r in results)
