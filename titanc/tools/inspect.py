"""`titanc inspect DIR`: read what `titanc compile` wrote, without running anything.

    titanc inspect build/tiny                    kernel table + totals per category
    titanc inspect build/tiny --kernel NAME      one kernel's source (DIR/kernels/NAME.py)
    titanc inspect build/tiny --graph [--pass P] the IR after pass P as DOT (+ PNG with Graphviz)
    titanc inspect build/tiny --memory           the buffer plan summary

The table reads report.json `kernels` ({name, category, flops, bytes, nodes}, plus
`launches` and `depth` when the compiler wrote them). A scan kernel's FLOPs are its body's
times its length (ir/schedule.py), and its body's kernels are listed too, so totals
never add a scan's FLOPs to its body's: per-category totals count every other kernel once
per launch (`launches`, the product of the enclosing scan lengths; 1 when unknown) and a
scan contributes only its own traffic (carries, stacked results). When report.json has no
launch counts, `resolved_rows` recomputes them by re-lowering the recorded spec.

`--graph` re-lowers the spec recorded in manifest.json (`compile_graphs`) and exports the
graph of one entry of `Compiled.log.dumps` (the same graphs as DIR/ir/NN_<pass>_<graph>.txt)
with `titanc.ir.to_dot`. Every bad input is a `TitancError` naming the choices; the artifact
directory and its report are opened and checked by `titanc.tools.build_dir.open_artifact`.
"""
from __future__ import annotations

import difflib
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Sequence

from titanc.errors import TitancError, printable, size_overflow
from titanc.ir.kernel_family import categories, prefix
from titanc.runtime.diagnostics.timing import format_bytes, format_count
from titanc.tools.build_dir import BuildDir

__all__ = ["kernel_rows", "resolved_rows", "category_totals", "is_scan", "kernel_table",
           "kernel_source", "pass_dumps", "pick_dump", "write_graph", "memory_summary",
           "step_table", "format_count", "format_bytes"]

_NAME = re.compile(r"[A-Za-z0-9_]+")


# -- formatting -------------------------------------------------------------------------------

def _intensity(flops: float, nbytes: float) -> str:
    return f"{flops / nbytes:.2f}" if nbytes else "-"


# -- the kernel table -------------------------------------------------------------------------

def kernel_rows(compiled: Any) -> list[dict[str, Any]]:
    """report.json `kernels` rows with `depth` and `launches` (`titanc.tools.cost_model.kernel_rows`)."""
    from titanc.tools.cost_model import kernel_rows as rows
    return rows(compiled)


def resolved_rows(art: BuildDir) -> tuple[list[dict[str, Any]], str]:
    """The kernel rows with `depth` and `launches`: from report.json when it has them, else
    by re-lowering manifest.json's spec (a compile, seconds) when that reproduces the
    report's kernel names. Returns (rows, note); the note says why counts are missing: among
    others, a spec that is not the one report.json records, or one this machine cannot
    re-lower (`_relowerable`)."""
    rows = art.kernels
    if all("launches" in r for r in rows):
        return rows, ""
    if not art.file("manifest.json").exists():
        return rows, "no launch counts in report.json and no manifest.json to recompute them"
    try:
        fresh = kernel_rows(_relower(art))
    except TitancError as exc:
        return rows, f"no launch counts: the recorded spec does not compile here ({exc})"
    if sorted(r["name"] for r in fresh) != sorted(r["name"] for r in rows):
        return rows, ("no launch counts: re-lowering the recorded spec gives other kernels "
                      "(the artifact comes from another titanc version); recompile it")
    return fresh, ""


def _relower(art: BuildDir) -> Any:
    """`compile_graphs` of manifest.json's spec, checked first: it must be the spec report.json
    records (`spec_hash`) and small enough to lower here (`_relowerable`); an overflow in
    the planner of sizes past what torch indexes is a TitancError too."""
    from titanc.compiler import compile_graphs

    spec = _manifest_spec(art)
    _relowerable(art, spec)
    try:
        return compile_graphs(spec, verify_each=False)
    except (OverflowError, MemoryError, RuntimeError, TypeError) as exc:
        if not size_overflow(exc):
            raise
        raise TitancError(f"{art.file('manifest.json')}: its spec's sizes overflow when "
                          f"re-lowered ({type(exc).__name__}); recompile with 'titanc compile "
                          f"SPEC -o {art.path}'") from None


def _relowerable(art: BuildDir, spec: Any) -> None:
    """Raise TitancError unless `spec` is the one report.json was compiled from (its
    `spec_hash`: that compile ran, so re-lowering it is as feasible here, however large the
    model), or, for a report without a hash, unless its lower bound
    (`titanc.fit.lower_bound_bytes`, plus the batch's tokens and one hidden state) fits this
    machine's memory: a manifest edited to d_model 10**30 or n_layers 10**9 must not send
    the compiler into an int64 overflow or hours of lowering."""
    from titanc.fit import lower_bound_bytes
    from titanc.model.spec import spec_hash
    from titanc.runtime.capacity import machine_bytes

    manifest = art.file("manifest.json")
    recorded = art.report.get("spec_hash")
    if isinstance(recorded, str) and recorded:
        if spec_hash(spec) != recorded:
            raise TitancError(f"{manifest}: its spec is not the one report.json was compiled "
                              f"from (spec_hash {printable(recorded[:12])}; a file was edited "
                              f"or damaged); recompile with 'titanc compile SPEC -o "
                              f"{art.path}'")
        return
    m, t = spec.model, spec.train
    itemsize = 8 if t.dtype == "float64" else 4
    needed = (lower_bound_bytes(spec)
              + t.batch_size * (m.seq_len + 1) * (8 + m.d_model * itemsize))
    have = machine_bytes()
    if needed > have:
        raise TitancError(f"{manifest}: its spec needs at least {needed:,} bytes, more than "
                          f"this machine's {have:,}, and report.json has no spec_hash that "
                          f"says a compile of it ran; recompile with 'titanc compile SPEC -o "
                          f"{art.path}'")


def is_scan(row: dict[str, Any]) -> bool:
    """A scan kernel (its FLOPs are its body's times its length): `scan` when the report has
    it, else by name (titanc_tem_fused_scan_<body>_<n>)."""
    if "scan" in row:
        return bool(row["scan"])
    return row["category"] == "template" and row["name"].startswith(
        f"titanc_{prefix('template')}_fused_scan_")


def category_totals(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{category: {kernels, flops, bytes}} per step; a scan's FLOPs are left to its body's
    kernels (see the module docstring)."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        t = out.setdefault(r["category"], {"kernels": 0, "flops": 0, "bytes": 0})
        n = int(r.get("launches", 1))
        t["kernels"] += 1
        t["bytes"] += n * int(r["bytes"])
        if not is_scan(r):
            t["flops"] += n * int(r["flops"])
    return dict(sorted(out.items(), key=lambda kv: _category_key(kv[0])))


def _category_key(c: str) -> tuple[int, str]:
    order = categories()                       # the kernel families' categories, in order
    return (order.index(c) if c in order else len(order), c)


def kernel_table(art: BuildDir, limit: int | None = None,
                 rows: Sequence[dict[str, Any]] | None = None, note: str = "") -> str:
    """The kernel table (name, category, launches per step, FLOPs and bytes per launch,
    FLOPs/byte, IR nodes) and per-category totals. `rows` default to report.json's (see
    `resolved_rows`); `limit` keeps the first rows of the table (totals always cover all)."""
    rows = list(art.kernels if rows is None else rows)
    r = art.report
    has_launches = all("launches" in k for k in rows)
    width = max([len("kernel")] + [len(k["name"]) + 2 * int(k.get("depth", 0)) for k in rows])
    width = min(width, 72)
    head = (f"{'kernel':<{width}}  {'category':<9} {'launches':>8} {'FLOPs':>9} {'bytes':>10} "
            f"{'FLOP/B':>7} {'nodes':>5}")
    counts = r.get("kernel_counts", {})
    lines = [f"{printable(r.get('name', '?'))}: {len(rows)} kernels "
             f"({', '.join(f'{printable(k, 40)} {v}' for k, v in counts.items())}); "
             f"spec {printable(str(r.get('spec_hash', '?'))[:12])}, "
             f"{format_count(r.get('parameters'))} parameters", "", head, "-" * len(head)]
    shown = rows if limit is None else rows[:limit]
    for k in shown:
        name = "  " * int(k.get("depth", 0)) + printable(k["name"], 10 ** 4)
        if len(name) > width:
            name = name[:width - 1] + "…"
        flops = format_count(k["flops"]) + ("*" if is_scan(k) else "")
        launches = str(k["launches"]) if "launches" in k else "?"
        lines.append(f"{name:<{width}}  {printable(k['category'], 40):<9} {launches:>8} {flops:>9} "
                     f"{format_bytes(k['bytes']):>10} {_intensity(k['flops'], k['bytes']):>7} "
                     f"{k['nodes']:>5}")
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more kernels (drop --limit to list all)")
    totals = category_totals(rows)
    per = "per training step" if has_launches else "each kernel counted once"
    thead = (f"{'category':<10} {'kernels':>7} {'FLOPs':>10} {'bytes':>10} {'FLOP/B':>7} "
             f"{'share':>6}")
    all_flops = sum(t["flops"] for t in totals.values())
    lines += ["", f"totals ({per}):", thead, "-" * len(thead)]
    for cat, t in totals.items():
        flops = format_count(t["flops"]) + ("*" if cat == "template" else "")
        share = f"{100 * t['flops'] / max(all_flops, 1):5.1f}%"
        ai = _intensity(t["flops"], t["bytes"])
        lines.append(f"{printable(cat, 40):<10} {t['kernels']:>7} {flops:>10} "
                     f"{format_bytes(t['bytes']):>10} "
                     f"{ai:>7} {share:>6}")
    all_bytes = sum(t["bytes"] for t in totals.values())
    lines.append(f"{'all':<10} {len(rows):>7} {format_count(all_flops):>10} "
                 f"{format_bytes(all_bytes):>10} {_intensity(all_flops, all_bytes):>7}")
    lines.append("* a scan kernel's FLOPs are its body's times its length; its body's kernels "
                 "are listed under it and the totals count them, not the scan (template totals: "
                 "the scans' own traffic and the other templates)")
    if not has_launches:
        lines.append(f"  ({note or 'no launch counts in report.json'}: body kernels count once, "
                     f"not once per iteration)")
    return "\n".join(lines)


# -- one kernel's source ----------------------------------------------------------------------

GRAPH_ORDER = ("training", "optimizer", "forward")   # report.json lists training + optimizer


def kernel_source(art: BuildDir, name: str) -> str:
    """One kernel's source, header included. `name` is a kernel name, optionally qualified by
    its graph (`forward/NAME`: names repeat across the training, optimizer and forward
    schedules; unqualified, training wins). kernels/index.json (graph -> kernel -> module)
    resolves deduplicated kernels to the module holding their source, and a scan body's
    kernels to their scan kernel's module where the scan runs as one kernel; a scan that runs
    as a host loop has no module and prints its body's loop function from program.py. Without an index, the file
    DIR/kernels/NAME.py or a module whose header names NAME."""
    kdir = art.file("kernels")
    if not kdir.is_dir():
        raise TitancError(f"{art.path} has no kernels/ directory (compiled before kernels were "
                          f"emitted); recompile with 'titanc compile SPEC -o {art.path}'")
    graph, _, kname = name.rpartition("/")
    files = sorted(f.stem for f in kdir.glob("*.py"))
    index = _kernel_index(kdir)
    # with an index, the kernels are the ones it lists: another file in kernels/ is not one
    known = sorted({n for m in index.values() for n in m} if index else set(files))
    if not _NAME.fullmatch(kname) or (graph and not _NAME.fullmatch(graph)):
        raise TitancError(f"unknown kernel {printable(repr(name))}; "
                          f"{_choices(kname, known, 'kernels/')}")
    if graph and index and graph not in index:
        raise TitancError(f"unknown graph {printable(repr(graph))} in --kernel "
                          f"{printable(name)}; choose one of "
                          f"{', '.join(sorted(index))}")
    order = [graph] if graph else [*GRAPH_ORDER, *sorted(set(index) - set(GRAPH_ORDER))]
    for g in order:
        module = index.get(g, {}).get(kname)
        if module is None or not _NAME.fullmatch(module) or module not in files:
            continue
        text = _read(kdir / f"{module}.py", art)
        head = text.split("# Generated by titanc", 1)[0]
        scan = "scan.py.jinja" in text and not re.search(rf"\b{re.escape(kname)}\b", head)
        notes = [] if module == kname else [
            f"# {g}/{kname}: a kernel of a scan body; the scan runs as one scan kernel, "
            f"kernels/{module}.py, which computes it inside its loop" if scan else
            f"# {g}/{kname}: identical source deduplicated into kernels/{module}.py"]
        notes += [f"# note: {o}/{kname} is another kernel (kernels/{m}.py); select it with "
                  f"--kernel {o}/{kname}" for o in order if o != g
                  for m in [index.get(o, {}).get(kname)] if m is not None and m != module]
        return "\n".join(notes) + ("\n" if notes else "") + text
    body = _scan_body(art, order, kname)
    if body is not None:
        return body
    if not index and not graph:
        if kname in files:
            return _read(kdir / f"{kname}.py", art)
        for stem in files:                           # deduplicated: another file's header
            text = _read(kdir / f"{stem}.py", art)
            if re.search(rf"\b{re.escape(kname)}\b", text.split("\n\n", 1)[0]):
                return f"# {kname}: identical source deduplicated into kernels/{stem}.py\n" + text
    if not graph and kname in {k["name"] for k in art.kernels}:
        raise TitancError(f"kernel {kname} is in report.json but {kdir} has no source for it "
                          f"(an older or partial emission); recompile with "
                          f"'titanc compile SPEC -o {art.path}'")
    if kname in files and not graph:
        raise TitancError(f"kernels/{kname}.py is not a kernel of this artifact "
                          f"(kernels/index.json does not list it: a file 'titanc compile' did "
                          f"not write); {_choices(kname, known, 'kernels/index.json')}")
    raise TitancError(f"unknown kernel {printable(repr(name))}; "
                      f"{_choices(kname, known, 'kernels/')}")


def _read(path: Path, art: BuildDir) -> str:
    """A text file of the artifact; one that is not UTF-8 is damaged (TitancError)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TitancError(f"{path}: not UTF-8 text (byte {exc.start}: the file is damaged); "
                          f"recompile with 'titanc compile SPEC -o {art.path}'") from None


def _kernel_index(kdir: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads((kdir / "index.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {g: {k: v for k, v in m.items() if isinstance(v, str)}
            for g, m in data.items() if isinstance(m, dict)}


def _scan_body(art: BuildDir, graphs: Sequence[str], name: str) -> str | None:
    """The loop-body function `def <graph>_<name>_body(...)` of program.py, if any."""
    program = art.file("program.py")
    if not program.exists():
        return None
    lines = _read(program, art).splitlines()
    for g in graphs:
        head = f"def {g}_{name}_body("
        for i, line in enumerate(lines):
            if line.startswith(head):
                end = next((j for j in range(i + 1, len(lines))
                            if lines[j].startswith(("def ", "class "))), len(lines))
                while end > i + 1 and not lines[end - 1].strip():
                    end -= 1
                return "\n".join([f"# {g}/{name}: a scan; program.py runs this body once per "
                                  f"iteration (program.py line {i + 1})", *lines[i:end]]) + "\n"
    return None


def _choices(name: str, names: Sequence[str], where: str) -> str:
    if not names:
        return f"{where} is empty"
    close = difflib.get_close_matches(name[:200], names, n=3, cutoff=0.5)
    if close:
        return f"did you mean {', '.join(close)}? ({len(names)} in {where})"
    if len(names) <= 8:
        return f"choose one of {', '.join(names)}"
    return (f"{len(names)} in {where}, e.g. {', '.join(names[:3])} "
            f"('titanc inspect DIR' lists them all)")


# -- the IR as DOT ----------------------------------------------------------------------------

def _manifest_spec(art: BuildDir) -> Any:
    from titanc.model.spec import load_spec

    manifest = art.file("manifest.json")
    try:
        spec = json.loads(manifest.read_text())["spec"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        spec = None
    if not isinstance(spec, dict):
        raise TitancError(f"{manifest}: missing or not a titanc manifest; recompile with "
                          f"'titanc compile SPEC -o {art.path}'")
    return load_spec({**spec, "name": spec.get("name") or art.report.get("name", "spec")})


def pass_dumps(art: BuildDir) -> list[tuple[str, Any]]:
    """(NN_<pass>_<graph>, Graph) for every dump of the pipeline, re-lowered from the spec."""
    c = _relower(art)
    return [(f"{k:02d}_{stage}", g) for k, (stage, g) in enumerate(c.log.dumps)]


def pick_dump(dumps: Sequence[tuple[str, Any]], name: str | None) -> tuple[str, Any]:
    """By full name (03_chunked_loss_forward), stage (chunked_loss_forward) or pass name
    (chunked_loss: that pass's dump of the training graph if it ran there, else its last
    dump). Default: the last dump of the training graph (forward + backward after every
    pass)."""
    if name is None:
        grads = [d for d in dumps if d[1].name == "grad"]
        return (grads or list(dumps))[-1]
    for how in (lambda s: s, lambda s: s.split("_", 1)[1]):
        hits = [d for d in dumps if how(d[0]) == name]
        if hits:
            return hits[-1]
    hits = [d for d in dumps if d[0].split("_", 1)[1].rsplit("_", 1)[0] == name]
    if hits:
        return ([d for d in hits if d[1].name == "grad"] or hits)[-1]
    stages = [d[0] for d in dumps]
    passes = list(dict.fromkeys(s.split("_", 1)[1].rsplit("_", 1)[0] for s in stages))
    raise TitancError(f"unknown pass {name!r}; choose one of {', '.join(passes)} "
                      f"or a dump {', '.join(stages)}")


def write_graph(art: BuildDir, pass_name: str | None = None) -> tuple[str, list[Path], str]:
    """Write DIR/graph_<pass>_<graph>.dot (and .png when Graphviz's `dot` is on PATH).
    Returns (dump name, files written, a note: '' or why there is no PNG / a mismatch)."""
    from titanc.ir import format_graph, to_dot

    stage, g = pick_dump(pass_dumps(art), pass_name)
    notes = []
    dumped = art.file("ir") / f"{stage}.txt"
    if dumped.exists() and dumped.read_text() != format_graph(g):
        notes.append(f"note: {dumped} differs from the re-lowered graph (the artifact comes from "
                     f"another titanc version); the DOT shows the re-lowered one")
    base = stage.split("_", 1)[1]
    dot_path = art.file(f"graph_{base}.dot")
    dot_path.write_text(to_dot(g))
    written = [dot_path]
    dot = shutil.which("dot")
    if dot is None:
        notes.append("no PNG: Graphviz 'dot' is not installed (render with "
                     f"'dot -Tpng {dot_path} -o graph.png')")
    else:
        png = dot_path.with_suffix(".png")
        try:
            subprocess.run([dot, "-Tpng", str(dot_path), "-o", str(png)], check=True,
                           capture_output=True, timeout=300)
            written.append(png)
        except (subprocess.SubprocessError, OSError) as exc:
            notes.append(f"no PNG: dot failed ({type(exc).__name__}); the .dot file is complete")
    return stage, written, "\n".join(notes)


# -- the step before and after the pattern passes --------------------------------------------

def step_table(art: BuildDir) -> str:
    """report.json `step` (titanc/tools/cost_model.py) as a table: per kernel family, kernels,
    launches, bytes and FLOPs per training step before -> after the pattern passes; '' when
    the report has no `step` section."""
    step = art.report.get("step")
    if not isinstance(step, dict) or not all(isinstance(step.get(k), dict)
                                             for k in ("before", "after")):
        return ""
    b, a = step["before"], step["after"]
    fams = list(dict.fromkeys([*a.get("families", {}), *b.get("families", {})]))
    w = max([14, *(len(printable(f, 40)) for f in fams)])      # linear_cross_entropy_bwd
    head = (f"{'family':<{w}} {'kernels':>15} {'launches':>15} {'bytes':>23} {'FLOPs':>19}")
    lines = ["per training step, before -> after the pattern passes "
             "(report.json step; titanc/tools/cost_model.py):", head, "-" * len(head)]
    zero = {"kernels": 0, "launches": 0, "bytes": 0, "flops": 0}

    def pair(x: Any, y: Any, fmt: Any = str) -> str:
        return f"{fmt(x)} -> {fmt(y)}"

    for f in fams:
        x, y = b.get("families", {}).get(f, zero), a.get("families", {}).get(f, zero)
        lines.append(f"{printable(f, 40):<{w}} {pair(x['kernels'], y['kernels']):>15} "
                     f"{pair(x['launches'], y['launches']):>15} "
                     f"{pair(x['bytes'], y['bytes'], format_bytes):>23} "
                     f"{pair(x['flops'], y['flops'], format_count):>19}")
    lines.append(f"{'all':<{w}} {pair(b.get('kernels_all'), a.get('kernels_all')):>15} "
                 f"{'':>15} {pair(b.get('bytes', 0), a.get('bytes', 0), format_bytes):>23} "
                 f"{pair(b.get('flops', 0), a.get('flops', 0), format_count):>19}")
    lines.append(f"kernels launched per step on the triton target (a scan kernel once): "
                 f"{b.get('kernels')} -> {a.get('kernels')}")
    return "\n".join(lines)


# -- the buffer plan --------------------------------------------------------------------------

def memory_summary(art: BuildDir, head: int = 40) -> str:
    """report.json `memory` (and `memory_forward`) plus the first `head` lines of
    memory_plan.txt."""
    lines = []
    for key, title in (("memory", "training step"), ("memory_forward", "forward (eval)")):
        m = art.report.get(key)
        if not isinstance(m, dict):
            continue
        arena, lb = m.get("arena_bytes"), m.get("lower_bound_bytes")
        ratio = f" (arena / lower bound {arena / lb:.3f})" if arena and lb else ""
        lines.append(f"{title}:")
        lines.append(f"  {'activation arena':<38} {format_bytes(arena):>10}{ratio}")
        for k, label in (("lower_bound_bytes", "lower bound (peak live)"),
                         ("peak_activation_bytes", "peak activation"),
                         ("persistent_bytes", "persistent (params, grads, optimizer)"),
                         ("logits_bytes", "largest logits buffer")):
            if k in m:
                lines.append(f"  {label:<38} {format_bytes(m[k]):>10}")
        if arena is not None and "persistent_bytes" in m:
            lines.append(f"  {'total planned (arena + persistent)':<38} "
                         f"{format_bytes(arena + m['persistent_bytes']):>10}")
    if not lines:
        lines.append(f"{art.path}/report.json has no memory section; recompile with "
                     f"'titanc compile'")
    plan = art.file("memory_plan.txt")
    if plan.exists():
        text = _read(plan, art).splitlines()
        lines += ["", f"{plan} (first {min(head, len(text))} of {len(text)} lines):"]
        lines += text[:head]
        if len(text) > head:
            lines.append(f"... {len(text) - head} more lines")
    else:
        lines.append(f"(no {plan.name}: recompile for the buffer-by-buffer map)")
    return "\n".join(lines)
