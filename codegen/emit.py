"""The program emitter: a build directory's `kernels/*.py` and its `program.py`.

`emit_artifact(compiled, out_dir)` renders every kernel of the compiled graphs (`forward`,
`training`, `optimizer`; scan kernels, or the bodies of scans that stay host loops) through
`codegen.lower` and `codegen.scan` and writes

    kernels/<kernel>.py   one module per distinct source: kernels whose sources differ only in
                          their header and name share the file of the first one (its header
                          lists the others); a name two graphs use for different sources gets
                          `_<graph>` appended to the second file;
    kernels/index.json    graph -> kernel name -> module file (the deduplication mapping; a
                          kernel of a scan body that runs as one scan kernel maps to that
                          scan kernel's module);
    program.py            a printout of each graph's lowered program (`codegen.lowered`, the
                          list of steps the cpu and triton targets walk too): one
                          straight-line function per graph that creates the planned views of
                          its arena and persistent region and runs the steps in order. A
                          `LaunchGroup` is one launch of its group kernel (`codegen.group`,
                          written to kernels/ like the others), a
                          `ScanLaunch` one launch of its scan kernel (`codegen.scan`,
                          written to kernels/ like the others); a `ScanLoop` a launch of its
                          prologue gathers (if any) and a `for` loop over a function running
                          one step of its body in the scan's workspace, copying nothing:
                          where each iteration reads and writes is
                          `ir.buffer_plan.ScanHomes`, the same object the executors
                          bind, so the loop is stated once.

Nothing from the spec reaches the output unsanitised: comments go through `sanitize_comment`,
identifiers are built from node ids and sanitised kernel and graph names, and persistent
names are Python string literals (`repr`). Importing program.py imports no kernel (they load
on first call) and runs nothing; it imports two titanc functions (`ScanHomes`, `host_table`),
so the scan loop and the interpreter's mask and RoPE tables have one definition. The output
depends only on the compiled graphs, so compiling twice gives byte-identical files.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from pprint import pformat
from typing import Any, Iterator

from titanc.ir import Graph, Op
from titanc.ir.types import TensorType
from titanc.ir.buffer_plan import OUTPUT_PREFIX, BufferPlan, ScanHomes
from titanc.ir.schedule import is_immediate
from titanc.config import current
from titanc.files import write_text_atomic

from titanc.codegen.lower.dispatch import KernelCode, graph_dtype, plan_kernels
from titanc.codegen.group import groupable, render_group
from titanc.codegen.lowered import (Launch, LaunchGroup, Lowered, ScanLaunch, ScanLoop, lower,
                                    scan_operands)
from titanc.codegen.lower.expr import format_number
from titanc.codegen.render import sanitize_comment, sanitize_identifier
from titanc.codegen.scan.kernel import ScanKernel

__all__ = ["Artifact", "emit_artifact", "GRAPHS"]

GRAPHS = ("training", "optimizer", "forward")
_TORCH = {"f32": "torch.float32", "f64": "torch.float64", "bf16": "torch.bfloat16",
          "i64": "torch.int64"}


@dataclass
class Artifact:
    """What `emit_artifact` wrote: kernel name -> module file stem, per graph."""

    out_dir: Path
    modules: dict[str, dict[str, str]] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)


class _Lines:
    """An indented text buffer (docs/conventions.md §7: glue code is not built with `+=`)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, text: str = "") -> None:
        self.lines.append("    " * self.depth + text if text else "")

    def comment(self, text: str) -> None:
        self(f"# {sanitize_comment(text)}")

    @contextmanager
    def block(self, head: str) -> Iterator[None]:
        self(head)
        self.depth += 1
        yield
        self.depth -= 1

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def emit_artifact(compiled: Any, out_dir: str | os.PathLike) -> Artifact:
    """Write `out_dir/kernels/*.py`, `kernels/index.json` and `out_dir/program.py`."""
    out = Path(out_dir)
    kdir = out / "kernels"
    kdir.mkdir(parents=True, exist_ok=True)
    spec = compiled.spec
    spec_path = str(getattr(spec, "path", None) or "")
    art = Artifact(out)
    tf32 = spec.compile.allow_tf32
    codes: dict[str, list[tuple[str, Any]]] = {}                 # key -> (graph, code)
    per_graph: dict[str, list[Any]] = {}
    rendered: dict[tuple[int, str], Any] = {}                   # (id(plan), kernel) -> code

    inside: dict[str, dict[str, str]] = {}          # graph -> body kernel -> its scan kernel
    for name in GRAPHS:
        per_graph[name] = []
        inside[name] = {}
        for plan, kern, code in plan_kernels(compiled.plans[name], spec_path=spec_path,
                                             allow_tf32=tf32, scan_kernels=True):
            rendered[(id(plan), kern.name)] = code
            per_graph[name].append(code)
            codes.setdefault(code.key, []).append((name, code))
            if isinstance(code, ScanKernel):
                sid = next(n for n in kern.nodes if n in plan.bodies)
                inside[name].update({k: kern.name for k in _body_kernels(plan.bodies[sid])})
        for low in lowered_program(compiled.plans[name], rendered).walk():
            for st in low.steps:                  # launch groups: a kernel of their own
                if isinstance(st, LaunchGroup):
                    code = render_group(st.kernel.name, low.graph.name,
                                        [rendered[(id(low.plan), m.kernel.name)]
                                         for m in st.members])
                    rendered[(id(low.plan), st.kernel.name)] = code
                    per_graph[name].append(code)
                    codes.setdefault(code.key, []).append((name, code))
    stems: dict[str, str] = {}                                   # key -> file stem
    taken: set[str] = set()
    for key, users in codes.items():
        graph, first = users[0]
        stem = first.name if first.name not in taken else f"{first.name}_{graph}"
        taken.add(stem)
        stems[key] = stem
        path = kdir / f"{stem}.py"
        write_text_atomic(path, _shared_source(first, users))
        art.files.append(path)
    for old in sorted(kdir.glob("*.py")):                        # no stale kernels
        if old.stem not in taken:
            old.unlink()
    art.modules = {name: {c.name: stems[c.key] for c in per_graph[name]} for name in GRAPHS}
    for name in GRAPHS:                 # a scan kernel's body kernels: the scan kernel's module
        mods = art.modules[name]
        mods.update({k: mods[scan] for k, scan in inside[name].items() if k not in mods})
    index = kdir / "index.json"
    write_text_atomic(index, json.dumps(art.modules, indent=2, sort_keys=True) + "\n")
    program = out / "program.py"
    write_text_atomic(program, program_source(compiled, art.modules, rendered, spec_path))
    art.files += [index, program]
    return art


def _body_kernels(plan: BufferPlan) -> list[str]:
    """Every kernel name of a scan body's schedule, nested bodies included."""
    names = []
    for kern in plan.schedule.kernels:
        names.append(kern.name)
        names += [k for n in kern.nodes if n in plan.bodies for k in _body_kernels(plan.bodies[n])]
    return names


def _shared_source(first: Any, users: list[tuple[str, Any]]) -> str:
    """The first kernel's source; its header also names the kernels that share it."""
    others = [f"{c.name} ({graph}/{getattr(c, 'graph', 'scan')})" for graph, c in users[1:]]
    if not others:
        return first.source
    head, rest = first.source.split("\n", 1)
    lines = [f"# {sanitize_comment(f'also the source of {len(others)} identical kernels:')}"]
    lines += [f"#   {sanitize_comment(o)}" for o in others]
    return "\n".join([head, *lines, rest])


# -- program.py ------------------------------------------------------------------------------------

_PRELUDE = '''\
"""Launch the kernels of kernels/ in schedule order over a static buffer plan.

Each graph function takes `arena` and `persistent`, uint8 tensors of at least ARENA_BYTES[graph]
and PERSISTENT_BYTES[graph] bytes (`allocate(graph)` makes them), copies `inputs` (by graph
input name) into their planned buffers, uses the tensors of `bound` (persistent name -> tensor)
in place of their persistent slots, runs, and returns the outputs as views of the storage
(valid until the next call). A scan is one launch of its scan kernel where the triton target
runs it so, else a host loop over its body (`ScanHomes` says where each iteration reads and
writes). Scan workspaces and tables are made on first use and kept. On CPU, run with
TRITON_INTERPRET=1.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from titanc.codegen.scan.kernel import host_table
from titanc.ir.buffer_plan import ScanHomes

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
_LOADED = {}
_KEPT = {}


def load_kernel(module):
    """Import kernels/<module>.py once (Triton reads a kernel's source from its file)."""
    if module not in _LOADED:
        spec = importlib.util.spec_from_file_location(f"titanc_artifact_{module}",
                                                      KERNEL_DIR / f"{module}.py")
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        _LOADED[module] = loaded
    return _LOADED[module]


def view(storage, offset, shape, dtype):
    """`shape` elements of `dtype` at byte `offset` of a uint8 storage tensor."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return storage[offset:offset + size].view(dtype).view(shape)


def slot(bound, name, persistent, offset, shape, dtype):
    """A persistent value: the caller's tensor when bound, else its slot of `persistent`."""
    if name in bound:
        return bound[name].view(shape)
    return view(persistent, offset, shape, dtype)


def kept(key, make):
    """A tensor made once per key (scan workspaces, tables, unread scan outputs)."""
    if key not in _KEPT:
        _KEPT[key] = make()
    return _KEPT[key]


def workspace(name, numel, dtype, device):
    return kept(("ws", name, device), lambda: torch.empty(numel, dtype=dtype, device=device))


def table(op, attrs, dtype, device):
    return kept(("table", op, repr(attrs), dtype, device),
                lambda: host_table(op, attrs, dtype).to(device))


def allocate(graph, device="cpu"):
    """Fresh (arena, persistent) storage for `graph`."""
    return (torch.zeros(ARENA_BYTES[graph], dtype=torch.uint8, device=device),
            torch.zeros(PERSISTENT_BYTES[graph], dtype=torch.uint8, device=device))
'''


def program_source(compiled: Any, modules: dict[str, dict[str, str]],
                   rendered: dict[tuple[int, str], Any], spec_path: str = "") -> str:
    """The text of program.py for `compiled`: kernel modules named by `modules`, launches as
    `rendered` ((id(plan), kernel name) -> code) says."""
    spec = compiled.spec
    buf = _Lines()
    buf.comment("program.py: straight-line launches of the titanc kernels of one compiled spec")
    buf.comment(f"spec name: {getattr(spec, 'name', '')}")
    buf.comment(f"spec: {spec_path or '(none)'}")
    buf.comment("Generated by titanc from codegen/emit.py; do not edit.")
    buf.lines += _PRELUDE.splitlines()
    buf()
    plans = {name: compiled.plans[name] for name in GRAPHS}
    tables = {
        "ARENA_BYTES": {n: p.arena_bytes for n, p in plans.items()},
        "PERSISTENT_BYTES": {n: p.persistent_bytes for n, p in plans.items()},
        "INPUTS": {n: p.schedule.graph.input_names() for n, p in plans.items()},
        "OUTPUTS": {n: [o for o, _ in p.schedule.graph.outputs] for n, p in plans.items()},
    }
    for label, table in tables.items():
        buf()
        buf.lines += f"{label} = {pformat(table, width=96, sort_dicts=False)}".splitlines()
    for name, plan in plans.items():
        _Emitter(buf, name, modules[name], rendered).graph(lowered_program(plan, rendered))
    return buf.text()


def lowered_program(plan: BufferPlan, rendered: dict[tuple[int, str], Any]) -> Lowered:
    """The lowered program program.py prints: a scan is one launch where `rendered` holds its
    scan kernel (as the triton target lowers it), else a loop."""
    def scan_kernel(p: BufferPlan, kern: Any, sid: int) -> ScanKernel | None:
        code = rendered.get((id(p), kern.name))
        return code if isinstance(code, ScanKernel) else None
    return lower(plan, scan_kernel, groupable if current().group_launches else None)


def _constant(n: Any) -> str:
    """A generator made once at bind time (a FULL as a 0-d tensor expanded)."""
    a, dt = n.attr_dict, _TORCH[n.type.dtype]
    if n.op is Op.FULL:
        return (f"torch.full((), {float(a['value'])!r}, dtype={dt}, device=arena.device)"
                f".expand({tuple(n.type.shape)!r})")
    return f"table({n.op.name!r}, {a!r}, {dt}, arena.device)"


def _view_text(n: Any) -> str:
    """The torch view method call of view node `n` (as `buffer_plan.view_of` applies it)."""
    a = n.attr_dict
    if n.op is Op.RESHAPE:
        return f".view({tuple(a['shape'])!r})"
    if n.op is Op.PERMUTE:
        return f".permute{tuple(a['perm'])!r}"
    if n.op is Op.EXPAND:
        return f".expand({tuple(a['shape'])!r})"
    return f".narrow({int(a['axis'])}, {int(a['start'])}, {int(a['stop']) - int(a['start'])})"


class _Emitter:
    """Writes one graph's function and, before it, its scan bodies' functions."""

    def __init__(self, buf: _Lines, graph: str, modules: dict[str, str],
                 rendered: dict[tuple[int, str], Any]):
        self.buf, self.name, self.modules = buf, sanitize_identifier(graph), modules
        self.rendered = rendered

    def graph(self, low: Lowered) -> None:
        plan = low.plan
        g = plan.schedule.graph
        self._bodies(low)
        b = self.buf
        b()
        b()
        with b.block(f"def {self.name}(arena, persistent, inputs=None, bound=None):"):
            b(f'"""Graph {self.name}: {len(plan.schedule.kernels)} kernels in schedule order."""')
            b("bound = bound or {}")
            self._kernel_imports(low)
            self._views(low, set(g.inputs))
            b("graph_inputs = {" + ", ".join(f"{n!r}: v{i}" for n, i in
                                             zip(g.input_names(), g.inputs)) + "}")
            with b.block("for name, tensor in (inputs or {}).items():"):
                with b.block("if graph_inputs[name].data_ptr() != tensor.data_ptr():"):
                    b("graph_inputs[name].copy_(tensor)")
            self._launches(low)
            b("return {" + ", ".join(f"{n!r}: v{v}" for n, v in g.outputs) + "}")

    def _bodies(self, low: Lowered) -> None:
        """Functions running one step of each loop's body (nested bodies first)."""
        for st in low.steps:
            if not isinstance(st, ScanLoop):
                continue
            body = st.body.plan
            self._bodies(st.body)
            bg = body.schedule.graph
            b = self.buf
            b()
            b()
            direct = [v for k, (_, v) in enumerate(bg.outputs) if body.direct_output(k)]
            params = ", ".join(f"v{i}" for i in [*bg.inputs, *direct])
            with b.block(f"def {self._body_name(st.kernel.name)}(arena, {params}):"):
                b(f'"""One step of scan %{st.scan} of {self.name} (body '
                  f'{sanitize_identifier(bg.name)}) in its workspace arena; the outputs '
                  f'it writes in place are parameters too."""')
                self._kernel_imports(st.body)
                self._views(st.body, set(bg.inputs) | set(direct), external=True)
                self._launches(st.body)
                b("return [" + ", ".join(f"v{v}" for _, v in bg.outputs) + "]")

    def _body_name(self, kernel: str) -> str:
        return sanitize_identifier(f"{self.name}_{kernel}_body")

    def _kernel_imports(self, low: Lowered) -> None:
        seen: list[str] = []
        for st in low.steps:
            pro = st.prologue if isinstance(st, ScanLoop) else None
            for name in [st.kernel.name] + ([pro.name] if pro is not None else []):
                if name in self.modules and name not in seen:
                    seen.append(name)
        if seen:
            self.buf.comment("kernels (modules shared by identical kernels)")
        for name in seen:
            self.buf(f"{sanitize_identifier(name)} = load_kernel({self.modules[name]!r})")

    # -- values ------------------------------------------------------------------------------------
    def _views(self, low: Lowered, inputs: set[int], external: bool = False) -> None:
        """Bind `v<id>` for every value a launch, a scan or the return statement uses."""
        plan = low.plan
        g = plan.schedule.graph
        used: list[int] = [] if external else list(g.inputs)
        for st in low.steps:
            if isinstance(st, (Launch, LaunchGroup)):
                used += [a.value for a in self._code(plan, st.kernel).args if a.value >= 0]
                continue
            if isinstance(st, ScanLoop) and st.prologue is not None:
                used += [a.value for a in self._code(plan, st.prologue).args if a.value >= 0]
            used += scan_operands(low, st)
        used += [v for _, v in g.outputs]
        b = self.buf
        b.comment("planned views: every value that crosses a kernel boundary")
        bound: set[int] = set(inputs) if external else set()
        for vid in dict.fromkeys(used):
            if vid in bound:
                continue
            bound.add(vid)
            b(f"v{vid} = {self._storage(plan, vid)}")

    def _storage(self, plan: BufferPlan, vid: int) -> str:
        g = plan.schedule.graph
        t = g.node(vid).type
        assert isinstance(t, TensorType)
        shape, dt = tuple(t.shape), _TORCH[t.dtype]
        note = f"  # %{vid}"
        if vid in plan.views:                       # a strided view of a root: no copy
            root, chain = plan.views[vid]
            expr = (_constant(g.node(root)) if plan.is_constant_root(root)
                    else self._storage(plan, root).split("  # ")[0])
            return expr + "".join(_view_text(g.node(c)) for c in chain) + note
        where, at = plan.location(vid)
        if where == "persistent":
            name = plan.persistent_values[plan.aliases.get(vid, vid)][0]
            return f"slot(bound, {name!r}, persistent, {at}, {shape!r}, {dt}){note}"
        if where == "external":
            src = (g.output(at[len(OUTPUT_PREFIX):]) if at.startswith(OUTPUT_PREFIX)
                   else g.input_by_name(at))
            return f"v{src}.view({shape!r}){note}"
        return f"view(arena, {at}, {shape!r}, {dt}){note}"

    def _code(self, plan: BufferPlan, kern: Any) -> KernelCode:
        return self.rendered[(id(plan), kern.name)]

    # -- launches ----------------------------------------------------------------------------------
    def _launches(self, low: Lowered) -> None:
        """The lowered program's steps, in its order (the schedule's no-ops as comments first;
        a launch group's members as comments above its launch)."""
        plan = low.plan
        g = plan.schedule.graph
        b = self.buf

        def head(k: int, kern: Any) -> None:
            b.comment(f"[{k}] {kern.name}: {kern.category} "
                      + " ".join(f"%{n}" for n in kern.nodes))

        for k, kern in enumerate(plan.schedule.kernels):
            if plan.is_noop(k):
                head(k, kern)
                b.comment("no-op: its outputs alias storage that already holds them")
        for st in low.steps:
            if isinstance(st, LaunchGroup):
                for m in st.members:
                    head(m.index, m.kernel)
                b.comment(f"the {len(st.members)} kernels above, independent, as one launch")
                self._launch(plan, st.kernel)
                continue
            head(st.index, st.kernel)
            if isinstance(st, ScanLaunch):
                self._scan_launch(plan, st.kernel, g.node(st.scan), st.code)
            elif isinstance(st, ScanLoop):
                if st.prologue is not None:          # the carries' rows, gathered first
                    self._launch(plan, st.prologue)
                self._scan(plan, st.kernel, g.node(st.scan))
            else:
                self._launch(plan, st.kernel)

    def _launch(self, plan: BufferPlan, kern: Any) -> None:
        """One launch of a rendered (non-scan) kernel."""
        code = self._code(plan, kern)
        args = ["None" if a.value < 0 else f"v{a.value}" if a.view is None
                else f"v{a.value}.view({a.view!r})"       # < 0: the launcher's temporary
                for a in code.args] + [repr(s) for s in code.sizes]
        self.buf(f"{sanitize_identifier(kern.name)}.launch({', '.join(args)})")

    def _items(self, g: Graph, kern: Any, node: Any) -> dict[int, int]:
        """Output index -> ITEM value, for the scan's results the program reads."""
        return {g.node(u).attr("index"): u for u in g.users(node.id) if u in kern.outputs}

    def _scan_launch(self, plan: BufferPlan, kern: Any, node: Any, sk: ScanKernel) -> None:
        """One launch of the scan kernel (as the triton target runs it)."""
        g = plan.schedule.graph
        dt = "torch.float64" if graph_dtype(g) == "float64" else "torch.float32"
        items = self._items(g, kern, node)
        args = [self._operand(g, node.inputs[i]) for i in sk.inputs]
        args += [f"v{v}" for v in sk.extra]
        args += [f"v{items[k]}" for k in sk.outputs]
        args += [f"table({op!r}, {a!r}, {dt}, arena.device)" for op, a in sk.tables]
        ident = sanitize_identifier(kern.name)
        self.buf(f"ws = workspace({self.name + '.' + ident!r}, {sk.grid * sk.ws_per_program}, "
                 f"{dt}, arena.device)")
        self.buf(f"{ident}.launch(ws, {', '.join(args)})")

    def _scan(self, plan: BufferPlan, kern: Any, node: Any) -> None:
        """The host loop of a scan, copying nothing: `ScanHomes` (the executors' own statement
        of the loop) says where iteration i reads its carries and writes its outputs; the
        body function writes its direct outputs in place, the rest are copied."""
        g = plan.schedule.graph
        a = node.attr_dict
        body: BufferPlan = plan.bodies[node.id]
        bg: Graph = a["body"]
        nc, nx = a["n_carry"], a["n_xs"]
        b = self.buf
        ws = next(x for x in plan.buffers if x.kind == "workspace" and x.value == node.id)
        args = [self._operand(g, i) for i in node.inputs]
        items = self._items(g, kern, node)
        b(f"ws = arena[{ws.offset}:{ws.offset + ws.size}]  # carry slots A and B, then the body's arena")
        state = plan.carry_state[node.id]
        sets = [[f"view(ws, {off}, {tuple(t.shape)!r}, {_TORCH[t.dtype]})" if size else "None"
                 for (off, size), t in zip(state[s * nc:(s + 1) * nc], node.type[:nc])]
                for s in (0, 1)]                          # None: a slot no iteration uses
        b("slots = ([" + ", ".join(sets[0]) + "], [" + ", ".join(sets[1]) + "])")
        b("operands = [" + ", ".join(args) + "]")
        b("items = {" + ", ".join(f"{k}: v{v}" for k, v in sorted(items.items())) + "}")
        unread = {k: bg.node(v).type for k, (_, v) in enumerate(bg.outputs)
                  if k >= nc and k not in items}
        b("unread = {" + ", ".join(
            f"{k}: ({tuple(t.shape)!r}, {_TORCH[t.dtype]})" for k, t in unread.items()) + "}")
        key = f"{self.name}.{sanitize_identifier(kern.name)}"
        b(f"scratch = lambda k: kept(({key!r}, k), lambda: torch.empty(unread[k][0], "
          f"dtype=unread[k][1], device=arena.device))")
        layout = plan.scan_homes(node.id, items)
        b(f"layout = {layout!r}")
        direct = [k for k in range(len(bg.outputs)) if body.direct_output(k)]
        copied = [k for k in range(len(bg.outputs)) if k not in direct]
        with b.block("for i, t in enumerate(layout.order()):"):
            b("homes = [ScanHomes.resolve(h, operands, slots, items, scratch) "
              "for h in layout.homes(i)]")
            b("carry = [ScanHomes.resolve(h, operands, slots, items, scratch) "
              "for h in layout.carry_in(i)]")
            step = (["*carry", f"*[x[t] for x in operands[{nc}:{nc + nx}]]",
                     f"*operands[{nc + nx}:]"] + [f"homes[{k}]" for k in direct])
            b(f"out = {self._body_name(kern.name)}(ws[{plan.workspace_body_offset(node.id)}:], "
              f"{', '.join(step)})")
            if copied:
                with b.block(f"for k in {copied!r}:"):
                    b("homes[k].copy_(out[k])")

    def _operand(self, g: Graph, vid: int) -> str:
        if is_immediate(g, vid):
            n = g.node(vid)
            return (f"torch.full((), {format_number(n.attr('value'))}, "
                    f"dtype={_TORCH[n.type.dtype]}, device=arena.device)")
        return f"v{vid}"
