"""`titanc compile` output: IR dumps, report.json and manifest.json in a build directory.

Layout: `ir/NN_<stage>.txt` after every pipeline stage, `report.json`
(names are an interface: keep them stable), `manifest.json` (spec hash, versions).
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from titanc.errors import TitancError, size_overflow
from titanc.ir import format_graph, graph_stats

from titanc.config import debug_level
from titanc.passes.buffer_plan import buffer_report

from titanc.files import (holds_cwd, recover_swap, staging_dir, swap_in, write_text_atomic,
                          writing_into)

from titanc.compiler import GRAPH_KINDS, Compiled, compile_graphs, launches_per_step
from titanc.fit import lower_bound_bytes, planned_bytes
from titanc.runtime.capacity import check_fits
from titanc.model.params import param_count
from titanc.model.spec import spec_hash, spec_to_dict
from titanc.tools.alignment import note_lines, unaligned_rows
from titanc.tools.cost_model import kernel_rows, launched_kernels, occupancy, step_cost


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("titanc", "torch", "triton", "networkx", "jinja2"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def build_report(spec: Any, c: Compiled, seconds: float) -> dict[str, Any]:
    fallbacks: list[dict[str, str]] = []
    carries: list[dict] = []
    launches = {"cpu": launches_per_step(c, "cpu"),
                "triton": launches_per_step(c, "triton", fallbacks, carries)}
    return {
        "name": spec.name,
        "spec_hash": spec_hash(spec),
        "block": spec.model.block,
        "parameters": param_count(spec.model),
        "compile_seconds": seconds,
        # every graph kind the runtime runs, each through the same pipeline (its pass log)
        "graphs": {kind: _graph_row(c, kind) for kind in GRAPH_KINDS
                   if kind != "decode_write" or spec.model.has_memory},
        "remat_policy": c.policy.mode + ("" if c.policy.mode != "mincut" or c.policy.ban_matmul
                                         else "_with_matmuls"),
        "passes": [r for r in c.passes if "nodes_before" in r],
        "steps": [r for r in c.passes if "nodes_before" not in r],
        # the kernels a step runs (no-ops left out: views and constants bound without a
        # kernel), each with its scan nesting and runs a step (`titanc inspect` reads them
        # rather than lowering the spec again)
        "kernels": [{k: r[k] for k in ("name", "category", "flops", "bytes", "nodes", "depth",
                                       "launches", "scan")} for r in kernel_rows(c)],
        # kernels per graph that run something, scan bodies included, no-ops (views and
        # constants bound without a kernel) left out: step.after.kernels_all, per graph
        "kernel_counts": {name: launched_kernels(p) for name, p in c.plans.items()},
        "launches_per_step": launches,
        "scan_fallbacks": {"triton": fallbacks},   # scans that stay host loops, and why
        # per scan of every graph the step and decoding run: one kernel (a chunk recurrence,
        # its grid) or a host loop of ordinary kernels, and why (`codegen.scan.kernel.scan_form`)
        "scan_forms": {"triton": scan_forms(c)},
        # each scan kernel's loops: which carries are held on chip, which stay in the
        # workspace and why (one row per distinct kernel and carry)
        "scan_carries": {"triton": _unique(carries)},
        # sizes whose rows a GPU cannot load 16 bytes at a time (titanc/tools/alignment.py)
        "gpu_alignment": unaligned_rows(c),
        "memory": buffer_report(c.plans["training"], spec.model.vocab_size),
        "memory_forward": buffer_report(c.plans["forward"], spec.model.vocab_size),
        # per training step: kernels by family, modeled bytes and FLOPs, with and without the
        # pattern passes (titanc/tools/cost_model.py)
        "step": step_cost(spec, c),
    }


def scan_forms(c: Compiled) -> list[dict]:
    """report.json `scan_forms`: each scan's form on the triton target, and why."""
    from titanc.codegen.scan.kernel import count_launches

    forms: list[dict] = []
    one = c if c.batch == 1 else c.for_batch(1)
    plans = [c.plans[k] for k in ("training", "optimizer", "forward")]
    plans += [one.graph(k).plan for k in ("decode_step", "decode_write")
              if k != "decode_write" or c.spec.model.has_memory]
    for plan in plans:
        count_launches(plan, forms=forms)
    return _unique(forms)


def _unique(rows: list[dict]) -> list[dict]:
    """`rows` without repeats (a kernel counted for several graph kinds), in order."""
    seen: dict[str, dict] = {}
    for r in rows:
        seen.setdefault(json.dumps(r, sort_keys=True), r)
    return list(seen.values())


def _graph_row(c: Compiled, kind: str) -> dict[str, Any]:
    """A graph kind at the compile's batch (decode kinds: one new token)."""
    cg = c.graph(kind)
    st = graph_stats(cg.graph)
    return {"nodes": st["nodes"], "largest_tensor_bytes": st["largest_tensor_bytes"],
            "kernels": launched_kernels(cg.plan),
            "arena_bytes": cg.plan.arena_bytes,
            "passes": [{k: r[k] for k in r if k != "graph"} for r in cg.passes]}


def write_artifact(spec: Any, out_dir: str | os.PathLike, force: bool = False,
                   arch: int | None = None) -> dict[str, Any]:
    """Compile `spec` and write the build directory; returns the report. With `arch`, also
    compile every kernel for sm_`arch` (`runtime.targets.precompile`: in parallel, into the caches a
    later run loads) and add report.json `occupancy` (`cost_model.occupancy`).

    Refuses (TitancError) a spec whose buffer plan exceeds the machine's memory unless
    `force`; every write failure is a one-line TitancError naming the file."""
    from titanc.runtime.data.tokenizer import check_vocab, load_tokenizer

    from titanc.runtime.targets.aot import SHARED_LIMIT

    if arch is not None and arch not in SHARED_LIMIT:
        raise TitancError(f"--arch {arch}: one of {', '.join(map(str, SHARED_LIMIT))} (the "
                          "CUDA compute capabilities titanc has tables for)")
    tok = load_tokenizer(spec)
    check_vocab(spec, tok)
    out = Path(out_dir)
    final = Path(os.path.realpath(out))          # a symlinked -o: the directory it names
    with writing_into(out, "the artifact directory"):
        recover_swap(final, _move_others)
    _check_out(out)
    if not force:
        check_fits(lower_bound_bytes(spec), spec, _device(spec), force_hint=True, lower=True)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        stage = staging_dir(final)
        (stage / "ir").mkdir(parents=True)
    except OSError as e:
        raise TitancError(f"cannot create output directory {out}: {e.strerror or e}; choose a "
                          f"writable directory with -o") from None
    try:
        from titanc.tools import artifact_cache
        with writing_into(out, "the artifact directory"):        # a copy into the stage
            report = artifact_cache.restore(spec, tok.hash, force, arch, stage)
            if report is not None:
                swap_in(stage, final, _move_others, last="manifest.json")
        if report is not None:
            return report
        t0 = time.perf_counter()
        try:
            c = compile_graphs(spec)
        except (OverflowError, MemoryError, RuntimeError, TypeError) as exc:
            if not size_overflow(exc):
                raise
            raise TitancError(f"the spec's sizes are past what torch can index or this "
                              f"process can hold ({type(exc).__name__} while compiling), "
                              f"even with --force; reduce model.d_model, model.n_layers or "
                              f"train.batch_size") from None
        seconds = time.perf_counter() - t0
        if not force:
            check_fits(planned_bytes(c), spec, _device(spec), force_hint=True)
        with writing_into(out, "the artifact directory"):
            report = _write_files(spec, c, stage, seconds, tok, arch)
            artifact_cache.save(spec, tok.hash, force, arch, stage)
            swap_in(stage, final, _move_others, last="manifest.json")
        return report
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# What `titanc compile` writes: the entries an artifact directory's next compile replaces
# (ir/*.txt and kernels/*.py, kernels/index.json inside the two folders). Everything else in
# the directory (graphs `inspect --graph` drew, notes) is carried into the new artifact.
_OURS = frozenset({"ir", "kernels", "report.json", "manifest.json", "program.py",
                   "memory_plan.txt", "tokenizer.json"})
_OURS_INSIDE = {"ir": lambda n: n.endswith(".txt"),
                "kernels": lambda n: n.endswith(".py") or n in ("index.json", "__pycache__")}


def _is_artifact(d: Path) -> bool:
    return (d / "manifest.json").is_file() or (d / "report.json").is_file()


def _check_out(out: Path) -> None:
    """-o must be a new or empty directory, or an artifact an earlier compile wrote: files
    of anything else (a run directory, a source tree) are never replaced or deleted."""
    if out.exists() and not out.is_dir():
        raise TitancError(f"cannot create output directory {out}: it is a file; choose a "
                          f"directory with -o")
    if not out.is_dir():
        return
    try:
        empty = next(os.scandir(out), None) is None
    except OSError as e:
        raise TitancError(f"cannot read output directory {out}: {e.strerror or e}; choose a "
                          f"readable directory with -o") from None
    if not empty and not _is_artifact(out):
        raise TitancError(f"-o {out} holds files and is not a titanc artifact (no "
                          f"manifest.json): compile would replace report.json, program.py, "
                          f"ir/ and kernels/ in it; choose a new or empty directory")
    if not empty and holds_cwd(out):
        raise TitancError(f"-o {out} is the current directory or holds it, and compile "
                          f"replaces an artifact directory by a rename; choose a "
                          f"subdirectory (-o build) or run from outside it")


def _move_others(old: Path, final: Path) -> None:
    """Move what `old` holds that compile did not write into `final`."""
    for entry in old.iterdir():
        if entry.name not in _OURS:
            os.replace(entry, final / entry.name)
        elif entry.name in _OURS_INSIDE and entry.is_dir():
            for inner in entry.iterdir():
                if not _OURS_INSIDE[entry.name](inner.name) and not (
                        final / entry.name / inner.name).exists():
                    os.replace(inner, final / entry.name / inner.name)


def _on_device(arch: int) -> bool:
    """Is this process's CUDA device of compute capability `arch` (compile through its JIT)?"""
    import torch

    if not torch.cuda.is_available():
        return False
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor == arch


def _device(spec: Any) -> str:
    """Where the program of `spec` would hold its memory."""
    import torch

    from titanc.runtime.targets.executors import resolve_target
    return "cuda" if resolve_target(spec.compile.target) == "triton" and \
        torch.cuda.is_available() else "cpu"


def _write_files(spec: Any, c: Compiled, out: Path, seconds: float, tok: Any,
                 arch: int | None = None) -> dict[str, Any]:
    from titanc.runtime.data.tokenizer import save_tokenizer, tokenizer_info

    for old in (out / "ir").glob("*.txt"):
        old.unlink()                              # no stale dumps from an earlier compile
    for k, (stage, g) in enumerate(c.log.dumps):
        write_text_atomic(out / "ir" / f"{k:02d}_{stage}.txt", format_graph(g))
    report = build_report(spec, c, seconds)
    if arch is not None:
        report["occupancy"] = occupancy(c, arch, jit=_on_device(arch))
    write_text_atomic(out / "report.json", json.dumps(report, indent=2) + "\n")
    from titanc.codegen.emit import emit_artifact
    emit_artifact(c, out)
    if debug_level() >= 3:
        for f in sorted((out / "kernels").glob("*.py")):
            print(f"# ---- {f.name}\n{f.read_text()}", file=sys.stderr)
    write_text_atomic(out / "memory_plan.txt", "\n".join(
        f"== {name} ==\n{c.plans[name].to_text()}" for name in ("training", "forward", "optimizer")))
    save_tokenizer(tok, out)                      # the tokenizer travels with the artifact
    manifest = {"name": spec.name, "spec_hash": report["spec_hash"], "spec": spec_to_dict(spec),
                "spec_path": spec.path, "tokenizer": tokenizer_info(tok),
                "versions": _versions(), "argv": sys.argv[1:]}
    write_text_atomic(out / "manifest.json", json.dumps(manifest, indent=2, default=str) + "\n")
    return report
