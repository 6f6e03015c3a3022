"""A launch group's kernel: independent kernels as one launch (`codegen.horizontal` picks them).

`render_group(name, graph, members)` takes the members' rendered kernels (of groupable
families, `KernelFamily.groupable`: one `@triton.jit` kernel, one `launch` that calls it
once) and gives a `KernelCode` of family "group" whose module

- loads each member's *member module*: its source with two source-to-source rewrites
  (`member_source`, on the Python AST of code we generated):
      the kernel takes its program ids as its first arguments (`group_pid_0..2`) instead of
      reading `tl.program_id(axis=k)`, so another kernel can run it for a slice of its grid;
      `launch(...)` becomes `launch_args(...)`, which returns the launch it would make
      (grid, positional arguments, keywords) instead of making it;
- defines the group kernel (templates/launch_group.py.jinja): program `pid` runs member `i`
  where `end[i-1] <= pid < end[i]`, with that member's program ids unflattened from
  `pid - end[i-1]` over its own grid;
- and `launch(*tensors, *sizes)` with the members' launch arguments concatenated (every
  member's tensors, then every member's sizes: `KernelCode.args` and `.sizes` in that order),
  which asks each member for its launch and makes one.

The grid offsets and extents are runtime arguments the JIT does not specialise on, so a
group compiles once whatever tiles a device picks; the members' constexprs (tiles, blocks) are
the group's (prefixed `m<i>_`), and `cuda_constexprs(arch)` / `cuda_options(arch)` give
them for an architecture as the members' own `tiles_for` would (the precompile and
`runtime.targets.aot` read them). The group runs with the largest num_warps and num_stages
of its members: a Triton kernel computes the same for any of them.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from titanc.codegen.lower.code import KernelCode
from titanc.codegen.render import render
from titanc.codegen.meta import kernel_split_k
from titanc.ir import Graph
from titanc.ir.kernel_family import FAMILIES, family_of
from titanc.ir.schedule import Kernel

__all__ = ["MemberSource", "groupable", "member_source", "render_group"]

PIDS = ("group_pid_0", "group_pid_1", "group_pid_2")
MEMBER = "member"                 # a member module's kernel


@dataclass(frozen=True)
class MemberSource:
    source: str                              # the member module's text
    params: tuple[tuple[str, bool], ...]     # the kernel's (argument, is constexpr), in order
    options: tuple[int | None, int | None]   # its launch's literal num_warps, num_stages


def groupable(g: Graph, kernel: Kernel) -> bool:
    """May schedule kernel `kernel` of graph `g` join a launch group (`codegen.horizontal`)?
    Its family's record says so (`KernelFamily.groupable`: its module is one kernel and one
    pure `launch`, no allocation, no torch op); not a split-K matmul (`meta.kernel_split_k`):
    its launch is two kernels."""
    return family_of(g, kernel).groupable and kernel_split_k(g, kernel) == 1


class _ProgramIds(ast.NodeTransformer):
    """`tl.program_id(axis=k)` / `tl.program_id(k)` -> `group_pid_k`."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "program_id":
            axis = node.args[0] if node.args else next(k.value for k in node.keywords
                                                        if k.arg == "axis")
            assert isinstance(axis, ast.Constant), "a program id's axis is a literal"
            return ast.copy_location(ast.Name(PIDS[int(axis.value)], ast.Load()), node)
        return node


def _is_constexpr(a: ast.arg) -> bool:
    return a.annotation is not None and ast.unparse(a.annotation).endswith("constexpr")


def member_source(code: KernelCode) -> MemberSource:
    """`code`'s module rewritten as a group member (module docstring)."""
    fam = FAMILIES.get(code.family)
    if fam is None or not fam.groupable:
        raise ValueError(f"{code.name}: a {code.family} kernel cannot join a launch group")
    tree = ast.parse(code.source)
    kernel = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == code.name)
    launch = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "launch")
    params = tuple((a.arg, _is_constexpr(a)) for a in kernel.args.args)
    kernel.args.args[:0] = [ast.arg(p) for p in PIDS]
    _ProgramIds().visit(kernel)
    launch.name = "launch_args"
    calls, literal = 0, {}
    for node in ast.walk(launch):
        for i, stmt in enumerate(getattr(node, "body", [])):
            call = stmt.value if isinstance(stmt, ast.Expr) else None
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == code.name):
                kw = ast.Dict([ast.Constant(k.arg) for k in call.keywords],
                              [k.value for k in call.keywords])
                literal = {k.arg: k.value.value for k in call.keywords
                           if isinstance(k.value, ast.Constant)}
                node.body[i] = ast.copy_location(ast.Return(ast.Tuple(
                    [call.func.slice, ast.List(call.args, ast.Load()), kw], ast.Load())), stmt)
                calls += 1
    if calls != 1:
        raise ValueError(f"{code.name}: its launch makes {calls} kernel calls, not one")
    # named `member` (the name only tells kernels apart, so equal kernels give equal groups,
    # which share one module, as `KernelCode.key` lets equal kernels); no header (its spec
    # text stays out of the group's source)
    body = re.sub(rf"\b{re.escape(code.name)}\b", MEMBER, ast.unparse(
        ast.fix_missing_locations(tree)))
    return MemberSource("# a launch group's member (codegen/group.py): program ids are "
                        "arguments\n" + body + "\n", params,
                        (literal.get("num_warps"), literal.get("num_stages")))


def render_group(name: str, graph: str, members: list[KernelCode]) -> KernelCode:
    """The group kernel of `members` (module docstring), named `name`."""
    srcs = [member_source(m) for m in members]
    rows = []
    for i, (m, s) in enumerate(zip(members, srcs)):
        rows.append({
            "i": i, "name": m.name, "source": repr(s.source),
            "runtime": [f"m{i}_{p}" for p, c in s.params if not c],
            "constexpr": [f"m{i}_{p}" for p, c in s.params if c],
            "call": [f"{p}=m{i}_{p}" for p, _ in s.params]})
    source = render("launch_group.py.jinja", name=name, graph=graph, members=rows,
                    params=repr(tuple(s.params for s in srcs)),
                    options=repr(tuple(s.options for s in srcs)),
                    arity=repr(tuple((len(m.args), len(m.sizes)) for m in members)))
    return KernelCode(name, "group", "group", graph, source,
                      tuple(a for m in members for a in m.args),
                      tuple(s for m in members for s in m.sizes))
