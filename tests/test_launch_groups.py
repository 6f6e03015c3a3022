"""Launch groups (codegen/horizontal.py, codegen/group.py): independent launches of a lowered
program as one kernel on the triton target.

- structure: a grouped program runs the same kernels as the schedule, every pair of kernels
  that touch the same planned bytes (one writing) keeps its order and never shares a group,
  a group holds 2..MAX_MEMBERS pointwise / reduction / matmul kernels, and the launch count
  drops (tiny.yaml: the figure benchmarks/launches.py prints);
- the member rewrite: program ids become arguments, `launch` becomes `launch_args`;
- parity: the triton target with groups == the cpu target (float64), forward and training;
- the waves (passes/waves.py): the schedule comes wave by wave and the memory plan adds no
  hazard inside a wave.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import ast  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from titanc import config  # noqa: E402
from titanc.codegen.group import groupable, member_source  # noqa: E402
from titanc.ir.kernel_family import family_of  # noqa: E402
from titanc.codegen.horizontal import MAX_MEMBERS, extents, waves  # noqa: E402
from titanc.codegen.lower.dispatch import render_kernel  # noqa: E402
from titanc.codegen.lowered import Launch, LaunchGroup, Lowered, lower  # noqa: E402
from titanc.codegen.scan.kernel import (ScanFallback, count_launches,  # noqa: E402
                                        scan_kernel_for)
from titanc.compiler import compile_graphs  # noqa: E402
from titanc.ir.schedule import verify_schedule  # noqa: E402
from titanc.model.spec import load_spec  # noqa: E402
from titanc.passes.waves import in_waves, wave_spans  # noqa: E402
from titanc.runtime.targets.executor import ArenaExecutor  # noqa: E402
from titanc.runtime.targets.triton_executor import TritonExecutor  # noqa: E402

from .test_lowered import _inputs, compiled  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _flat(low: Lowered) -> list[Launch]:
    """The launches of one program level, in run order (a group's members in place)."""
    out: list[Launch] = []
    for s in low.steps:
        if isinstance(s, LaunchGroup):
            out += list(s.members)
        elif isinstance(s, Launch):
            out.append(s)
    return out


def _kernels(plan):
    """(plan, kernel) for every kernel that is not a no-op, scan bodies included."""
    for k, kern in enumerate(plan.schedule.kernels):
        if not plan.is_noop(k) and not any(n in plan.bodies for n in kern.nodes):
            yield plan, kern
        for n in kern.nodes:
            if n in plan.bodies:
                yield from _kernels(plan.bodies[n])


def _touches(plan, kern) -> tuple[list, list]:
    return ([x for v in kern.inputs for x in extents(plan, v)],
            [x for v in kern.outputs for x in extents(plan, v)])


def _overlap(xs, ys) -> bool:
    return any(r == s and a < d and c < b for r, a, b in xs for s, c, d in ys)


@pytest.mark.parametrize("example", ["tiny", "tiny_lmm", "tiny_mag"])
def test_groups_keep_every_hazard(example: str) -> None:
    """Every level of the triton target's training program: same kernels as the ungrouped
    program; a pair with a storage hazard keeps its schedule order and is never grouped."""
    plan = compile_graphs(load_spec(ROOT / "examples" / f"{example}.yaml")).plans["training"]

    def scan_kernel(p, kern, sid):          # as the triton target lowers: a kernel or a loop
        try:
            return scan_kernel_for(p, kern, sid, "float32")
        except ScanFallback:
            return None

    grouped, plain = lower(plan, scan_kernel, groupable), lower(plan, scan_kernel)
    n_groups = 0
    for low, ref in zip(grouped.walk(), plain.walk()):
        assert sorted(s.index for s in _flat(low)) == sorted(s.index for s in _flat(ref))
        scans = [s.index for s in low.steps if not isinstance(s, (Launch, LaunchGroup))]
        assert scans == [s.index for s in ref.steps if not isinstance(s, Launch)]
        pos, group_of = {}, {}
        for i, s in enumerate(low.steps):
            for m in (s.members if isinstance(s, LaunchGroup) else (s,)):
                pos[m.index], group_of[m.index] = i, id(s)
            if isinstance(s, LaunchGroup):
                n_groups += 1
                assert 2 <= len(s.members) <= MAX_MEMBERS
                assert all(family_of(low.graph, m.kernel).groupable for m in s.members)
        run = _flat(ref)
        for i, a in enumerate(run):
            ra, wa = _touches(low.plan, a.kernel)
            for b in run[i + 1:]:
                rb, wb = _touches(low.plan, b.kernel)
                if _overlap(wa, rb) or _overlap(wa, wb) or _overlap(ra, wb):
                    assert pos[a.index] < pos[b.index], (a.kernel.name, b.kernel.name)
    assert n_groups > 0


def test_groups_cut_tiny_yaml_launches() -> None:
    """The launches per training step on the triton target (benchmarks/launches.py): fewer with
    groups, and what the executor counts when it binds."""
    c = compile_graphs(load_spec(ROOT / "examples" / "tiny.yaml"))
    plans = [c.plans[g] for g in ("training", "optimizer")]
    with_groups = sum(count_launches(p) for p in plans)
    without = sum(count_launches(p, groups=False) for p in plans)
    assert with_groups < 0.85 * without, (with_groups, without)


def test_member_source_takes_program_ids_as_arguments() -> None:
    """The rewrite: the kernel is `member`, no `tl.program_id` left in it, three program-id
    arguments first, `launch` renamed `launch_args`, which returns the launch instead of
    making it."""
    seen = set()
    for plan, kern in _kernels(compiled("tiny_mal").plans["training"]):
        if not family_of(plan.schedule.graph, kern).groupable:
            continue
        code = render_kernel(plan.schedule.graph, kern, dtype="float64",
                             skip=set(plan.aliases), strided=plan.strided)
        m = member_source(code)
        tree = ast.parse(m.source)
        fn = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "member")
        assert kern.name not in m.source           # equal kernels give equal groups
        assert [a.arg for a in fn.args.args[:3]] == ["group_pid_0", "group_pid_1", "group_pid_2"]
        assert "program_id" not in ast.unparse(fn)
        names = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}
        assert "launch_args" in names and "launch" not in names
        assert [p for p, _ in m.params] == [a.arg for a in fn.args.args[3:]]
        seen.add(code.family)
    assert {"pointwise", "reduction", "matmul"} <= seen


def test_member_source_refuses_a_template_kernel() -> None:
    plan, kern = next((p, k) for p, k in _kernels(compiled("tiny_mal").plans["training"])
                      if k.category == "template" and "attention" in k.name)
    code = render_kernel(plan.schedule.graph, kern, dtype="float64", skip=set(plan.aliases),
                         strided=plan.strided)
    with pytest.raises(ValueError, match="cannot join a launch group"):
        member_source(code)


@pytest.mark.parametrize("example", [pytest.param("tiny_mag", marks=pytest.mark.slow), "tiny_lmm"])
def test_grouped_triton_equals_cpu(example: str) -> None:
    """The triton target with launch groups (interpreted) == the cpu target, float64."""
    c = compiled(example)
    inputs = _inputs(c)
    for graph in ("forward", "training"):
        plan = c.plans[graph]
        ex = TritonExecutor(plan)
        groups = [s for low in ex.program.walk() for s in low.steps
                  if isinstance(s, LaunchGroup)]
        if graph == "training":
            assert groups
        got, want = ex.run(inputs), ArenaExecutor(plan).run(inputs)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-11,
                                       msg=lambda m: f"{example} {graph} {k}: {m}")


def test_group_launches_off() -> None:
    """TITANC_GROUP_LAUNCHES=0 (`config.group_launches`): every kernel launches alone."""
    plan = compiled("tiny_mal").plans["training"]
    with config.override(group_launches=False):
        ex = TritonExecutor(plan)
    assert not [s for low in ex.program.walk() for s in low.steps
                if isinstance(s, LaunchGroup)]
    assert config.Config.from_env({"TITANC_GROUP_LAUNCHES": "0"}).group_launches is False


def test_in_waves_orders_each_run_by_wave() -> None:
    """passes/waves.py: the compiled schedule (tiny.yaml training, every body) is a valid
    schedule whose runs between barriers come wave by wave, each wave one contiguous span,
    scan kernels where fusion put them; `in_waves` of it changes nothing."""
    sched = compile_graphs(load_spec(ROOT / "examples" / "tiny.yaml")).plans["training"].schedule
    for _, s in sched.walk():
        verify_schedule(s)
        spans = wave_spans(s)
        assert all(a <= k <= b for k, (a, b) in enumerate(spans))
        for k in range(1, len(spans)):       # spans are contiguous and never interleave
            assert spans[k] == spans[k - 1] or spans[k][0] == k
    again = in_waves(sched)
    assert [k.name for _, s in again.walk() for k in s.kernels] == \
        [k.name for _, s in sched.walk() for k in s.kernels]


@pytest.mark.parametrize("example", ["tiny", "tiny_mag"])
def test_the_plan_keeps_waves_free_of_storage_hazards(example: str) -> None:
    """The planner widens liveness to whole waves (`wave_spans`), so the storage hazards the
    lowering reads add no wave to a run of launches, but for a carry updated in place (read
    and rewritten in one wave of a scan body: one more)."""
    c = compile_graphs(load_spec(ROOT / "examples" / f"{example}.yaml"))
    for graph in ("forward", "training"):
        for low in lower(c.plans[graph]).walk():
            spans = wave_spans(low.plan.schedule)
            runs: list[list[Launch]] = [[]]
            for s in low.steps:
                if isinstance(s, Launch):
                    runs[-1].append(s)
                else:
                    runs.append([])
            for run in (r for r in runs if r):
                by_hazard = max(waves(low.plan, [s.kernel for s in run])) + 1
                by_value = len({spans[s.index] for s in run})
                assert by_hazard <= by_value + 1, (graph, low.graph.name, by_hazard, by_value)
                if low.graph.name.startswith("mac_segment"):
                    assert by_hazard == by_value, (low.graph.name, by_hazard, by_value)
