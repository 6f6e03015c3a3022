"""Statements inside fused kernels: an expression DAG lowered to Triton, a checker, naming.

Fused kernels carry their arithmetic as one-line statements such as `t3 = tl.sigmoid(t1) * t2`.
Hooks build them with `pointwise_statements` from an expression DAG:

    nodes = [("t0", "neg", ("x",)), ("t1", "exp", ("t0",)), ("t2", "const", (1.0,)),
             ("t3", "add", ("t1", "t2")), ("y", "recip", ("t3",))]      # y = sigmoid(x)

Each node is `(var, op, args)`; args name earlier vars or kernel inputs, except for `const`,
whose single arg is a number. Every statement that reaches a template passes
`check_statement`, which parses it and accepts only assignments of arithmetic on names,
numbers and `tl.*` calls, so no string handed to a template can smuggle in other code.
`Scope` names a kernel's user-derived identifiers (arguments and statement targets) so they
never shadow the template's own, rewriting the statements to match; `slice_statements` keeps
the statements a value depends on (a reduction's column loop recomputes only those).
"""

from __future__ import annotations

import ast
import functools
import math
from collections.abc import Iterable, Sequence

from titanc.codegen.render import Namer, sanitize_identifier

__all__ = [
    "POINTWISE_OPS",
    "Scope",
    "check_statement",
    "format_number",
    "pointwise_statements",
    "slice_statements",
]

# op -> (arity, format). `{0}`, `{1}` are argument names.
POINTWISE_OPS: dict[str, tuple[int, str]] = {
    "neg": (1, "-{0}"),
    "abs": (1, "tl.abs({0})"),
    "exp": (1, "tl.exp({0})"),
    "log": (1, "tl.log({0})"),
    "sigmoid": (1, "tl.sigmoid({0})"),
    "silu": (1, "{0} * tl.sigmoid({0})"),
    "rsqrt": (1, "tl.rsqrt({0})"),
    "sqrt": (1, "tl.sqrt({0})"),
    "recip": (1, "1.0 / {0}"),
    "square": (1, "{0} * {0}"),
    "add": (2, "{0} + {1}"),
    "sub": (2, "{0} - {1}"),
    "mul": (2, "{0} * {1}"),
    "div": (2, "{0} / {1}"),
    "max": (2, "tl.maximum({0}, {1})"),
    "min": (2, "tl.minimum({0}, {1})"),
    "gt": (2, "tl.where({0} > {1}, 1.0, 0.0)"),
    "lt": (2, "tl.where({0} < {1}, 1.0, 0.0)"),
    "where": (3, "tl.where({0} != 0, {1}, {2})"),
}


def format_number(value: float | int) -> str:
    """A number as Triton source: `0.5`, `-3.0`, `float("inf")`."""
    x = float(value)
    if math.isnan(x):
        return 'float("nan")'
    if math.isinf(x):
        return 'float("inf")' if x > 0 else 'float("-inf")'
    return repr(x)


def pointwise_statements(
    nodes: Sequence[tuple[str, str, Sequence[object]]],
    inputs: Iterable[str] = (),
) -> list[str]:
    """Lower an expression DAG to Triton statements, one per non-constant node.

    `inputs` are the names already bound in the kernel (loaded values); every non-const arg
    must name one of them or an earlier node. Names are sanitised; constants are inlined.
    """
    known = {sanitize_identifier(n) for n in inputs}
    consts: dict[str, str] = {}
    out: list[str] = []
    for var, op, args in nodes:
        target = sanitize_identifier(var)
        if op == "const":
            if len(args) != 1 or not isinstance(args[0], (int, float)):
                raise ValueError(f"const node {var!r} needs one numeric arg, got {args!r}")
            consts[target] = format_number(args[0])
            continue
        if op not in POINTWISE_OPS:
            raise ValueError(f"unknown pointwise op {op!r} in node {var!r}; "
                             f"known: {', '.join(sorted(POINTWISE_OPS))}")
        arity, fmt = POINTWISE_OPS[op]
        if len(args) != arity:
            raise ValueError(f"op {op!r} in node {var!r} takes {arity} args, got {len(args)}")
        names: list[str] = []
        for arg in args:
            if isinstance(arg, (int, float)):
                names.append(format_number(arg))
                continue
            a = sanitize_identifier(str(arg))
            if a in consts:
                names.append(consts[a])
            elif a in known:
                names.append(a)
            else:
                raise ValueError(f"node {var!r} uses {arg!r} before it is defined")
        # args are names or number literals (each node is its own statement), so only a
        # negative literal needs parentheses
        names = [f"({n})" if n.startswith("-") else n for n in names]
        out.append(check_statement(f"{target} = {fmt.format(*names)}"))
        known.add(target)
    return out


_ALLOWED_NODES = (
    ast.Module, ast.Assign, ast.AugAssign, ast.Expr, ast.Name, ast.Load, ast.Store,
    ast.Constant, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.Call, ast.keyword,
    ast.Attribute, ast.Subscript, ast.Slice, ast.Tuple, ast.List, ast.IfExp,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
    ast.USub, ast.UAdd, ast.Not, ast.Invert, ast.BitAnd, ast.BitOr,
    ast.Gt, ast.GtE, ast.Lt, ast.LtE, ast.Eq, ast.NotEq, ast.And, ast.Or,
)


@functools.lru_cache(maxsize=1 << 16)     # statements recur across kernels; a refusal raises
def check_statement(stmt: str) -> str:
    """Return `stmt` if it is one safe assignment, else raise ValueError.

    Safe: printable ASCII, no `#`, one `name = expr` (or `name += expr`) whose expression uses
    only names, numbers, arithmetic/comparison operators, indexing with `None`/`:` for
    broadcasting, `x.to(tl.<dtype>)`, calls to `tl.*` functions and to the module's helpers
    (`HELPERS`, one argument), and `float("inf")`-style constants. No strings, no other calls or attributes, no dunder names.
    """
    if not stmt.isascii() or not stmt.isprintable() or "#" in stmt or ";" in stmt:
        raise ValueError(f"unsafe statement {stmt!r}: must be one printable ASCII line")
    try:
        tree = ast.parse(stmt, mode="exec")
    except SyntaxError as err:
        raise ValueError(f"statement {stmt!r} does not parse: {err.msg}") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.Assign, ast.AugAssign)):
        raise ValueError(f"statement {stmt!r} must be a single assignment")
    first = tree.body[0]
    targets = first.targets if isinstance(first, ast.Assign) else [first.target]
    if len(targets) != 1 or not isinstance(targets[0], ast.Name):
        raise ValueError(f"statement {stmt!r} must assign to a single name")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ValueError(f"statement {stmt!r} uses {type(node).__name__}, which is not allowed")
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            raise ValueError(f"statement {stmt!r} uses dunder name {node.id!r}")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, bool,
                                                                             type(None))):
            if not _is_float_special(node, tree):
                raise ValueError(f"statement {stmt!r} contains a non-numeric constant")
        if isinstance(node, ast.Attribute) and not _is_tl_attribute(node):
            raise ValueError(f"statement {stmt!r} uses attribute {node.attr!r}")
        if isinstance(node, ast.Call) and not _is_allowed_call(node):
            raise ValueError(f"statement {stmt!r} calls something other than tl.*")
        if isinstance(node, ast.Subscript) and not _is_broadcast_index(node.slice):
            raise ValueError(f"statement {stmt!r} indexes with something other than None/:")
    return stmt


def _is_tl_attribute(node: ast.Attribute) -> bool:
    """`tl.x`, `tl.math.x`, or the method name in `value.to(...)`."""
    if node.attr.startswith("_"):
        return False
    if node.attr == "to":
        return True
    base = node.value
    if isinstance(base, ast.Attribute) and base.attr == "math":
        base = base.value
    return isinstance(base, ast.Name) and base.id == "tl"


# the helpers a generated module defines beside its kernels (codegen/render.py with_helpers)
HELPERS = frozenset({"_bf16"})


def _is_allowed_call(node: ast.Call) -> bool:
    if isinstance(node.func, ast.Name) and node.func.id in HELPERS:
        return len(node.args) == 1 and not node.keywords
    if isinstance(node.func, ast.Attribute):
        if node.func.attr == "to":
            return (len(node.args) == 1 and isinstance(node.args[0], ast.Attribute)
                    and _is_tl_attribute(node.args[0]) and node.args[0].attr != "to")
        return _is_tl_attribute(node.func)
    if isinstance(node.func, ast.Name) and node.func.id == "float":
        return (len(node.args) == 1 and not node.keywords
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in ("inf", "-inf", "nan"))
    return False


def _is_float_special(const: ast.Constant, tree: ast.AST) -> bool:
    """A string constant is allowed only as the argument of `float("inf")` and friends."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and node.args[0] is const:
            return _is_allowed_call(node)
    return False


def _is_broadcast_index(index: ast.AST) -> bool:
    parts = index.elts if isinstance(index, ast.Tuple) else [index]
    for part in parts:
        if isinstance(part, ast.Slice):
            if part.lower or part.upper or part.step:
                return False
        elif not (isinstance(part, ast.Constant) and part.value is None):
            return False
    return True


class Scope:
    """The names of one kernel: declared tensors and scalars, and statement variables.

    Every user-derived name goes through one `Namer`, so none can shadow a name the template
    binds (`mask`, `offs`, a pointer argument) or another user name; `statements` rewrites
    the statements to the chosen names. Names a statement reads but neither declares nor
    assigns are left alone: they refer to the template's own values (`n_cols`, `acc`).
    """

    def __init__(self, reserved: Iterable[str]) -> None:
        self._namer = Namer(reserved)
        self._map: dict[str, str] = {}

    def declare(self, user: str, derived: Sequence[str] = ()) -> str:
        """Name a tensor or scalar argument; `derived` patterns such as "{}_ptr" are reserved."""
        key = sanitize_identifier(user)
        if key in self._map:
            raise ValueError(f"two kernel arguments are named {user!r} after sanitising ({key})")
        self._map[key] = self._namer.fresh(user, derived)
        return self._map[key]

    def assign(self, var: str) -> str:
        """Name a value the kernel computes (a statement target, a reduction result)."""
        key = sanitize_identifier(var)
        if key not in self._map:
            self._map[key] = self._namer.fresh(var)
        return self._map[key]

    def ref(self, var: str) -> str:
        """The chosen name of a declared or assigned `var`."""
        key = sanitize_identifier(var)
        if key not in self._map:
            raise ValueError(f"{var!r} is neither a kernel argument nor assigned by a statement")
        return self._map[key]

    def statements(self, stmts: Sequence[str]) -> list[str]:
        """Check `stmts`, name their targets, and rewrite them to the chosen names."""
        checked = [check_statement(s) for s in stmts]
        for stmt in checked:
            self.assign(_names(stmt)[0])
        out = []
        for stmt in checked:
            keys = {sanitize_identifier(n) for n in _names(stmt)[1]}
            out.append(_renamed(stmt, tuple(sorted((k, self._map[k]) for k in keys
                                                   if k in self._map))))
        return out


# Statements recur across kernels (the same index arithmetic, the same loads): their parse
# and their renaming are memoised, by the statement and the names it uses.
@functools.lru_cache(maxsize=1 << 16)
def _names(stmt: str) -> tuple[str, tuple[str, ...]]:
    """(assigned name, every name) of a checked statement."""
    tree = ast.parse(stmt).body[0]
    target = tree.targets[0] if isinstance(tree, ast.Assign) else tree.target
    return target.id, tuple(sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}))


@functools.lru_cache(maxsize=1 << 16)
def _renamed(stmt: str, mapping: tuple[tuple[str, str], ...]) -> str:
    """`stmt` with its names replaced through `mapping` (sanitised name -> chosen name)."""
    tree = _Renamer(dict(mapping)).visit(ast.parse(stmt).body[0])
    return check_statement(ast.unparse(tree))


class _Renamer(ast.NodeTransformer):
    def __init__(self, mapping: dict[str, str]) -> None:
        self._mapping = mapping

    def visit_Name(self, node: ast.Name) -> ast.Name:
        new = self._mapping.get(sanitize_identifier(node.id), node.id)
        return ast.copy_location(ast.Name(id=new, ctx=node.ctx), node)


def slice_statements(stmts: Sequence[str], wanted: set[str]) -> tuple[list[str], set[str]]:
    """The statements (in order) that `wanted` depends on, and the free names they read."""
    need, keep = set(wanted), []
    for stmt in reversed(stmts):
        target, reads = _reads(stmt)
        if target in need:
            keep.append(stmt)
            need.discard(target)
            need |= reads
    return keep[::-1], need


def _reads(stmt: str) -> tuple[str, set[str]]:
    """(assigned name, names read) of a checked statement."""
    tree = ast.parse(stmt).body[0]
    target = tree.targets[0].id if isinstance(tree, ast.Assign) else tree.target.id
    value = tree.value
    reads = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
    if isinstance(tree, ast.AugAssign):
        reads.add(target)
    return target, reads
