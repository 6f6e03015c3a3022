"""Static buffer plan: every activation of a schedule gets a fixed offset in one arena.

`plan_buffers(schedule, persistent)` turns the kernel order's liveness into buffers and places
them with `place` (greedy by size: largest first, each into the smallest address gap that is
free for its whole live interval, else above everything it overlaps; a few other orders are
tried and the smallest arena kept). Invariants of the result:

1. two buffers whose live intervals (inclusive kernel indices) intersect never share a byte;
2. every offset and size is a multiple of `alignment`;
3. `lower_bound_bytes <= peak_activation_bytes <= arena_bytes`.

What gets a buffer, top level:
- persistent values (graph inputs and outputs named in `persistent`: parameters, gradients,
  optimizer state) sit in a separate persistent region, laid out in graph order; a value
  reachable under several persistent names lives in the first and is copied to the others;
  an output with an input's persistent name gets its own buffer, except the parameter and
  moment results of an ADAMW pattern op (elementwise), which share their input's slot; a
  persistent output that is a RESHAPE of a kernel output with no other home puts that value
  in its slot (the reshape is an alias: a layer group's stacked gradients cost no copy);
- other graph inputs (e.g. `tokens`) get activation buffers live from kernel 0;
- kernel outputs get activation buffers from their producer to their last reader (graph
  outputs: to the end), and so does the result of a scan's prologue (the gathered rows, cast
  if so: `schedule.prologue_results`), during its scan's kernel alone: a host-loop scan
  gathers the rows there and uses them as the
  carry's operand (lent, updated in place, an ITEM sharing it, as any operand), a scan kernel
  reads the initial value through the gather and leaves it unwritten; except aliases: a
  RESHAPE whose operand already has storage shares it (same offset, the source's interval
  stretched to cover the view's; arena buffers are dense row-major, so a reshape is free; a
  kernel all of whose outputs are aliases is a no-op, `BufferPlan.is_noop`);
- views (`BufferPlan.views`, also aliases): a value a kernel would only copy, i.e. a chain of
  views (RESHAPE, PERMUTE, EXPAND, SLICE) of a stored value or of a constant (a FULL, ROPE or
  MASK generator), gets no buffer: the executors bind it as a strided view of its root's
  storage (a constant is made once at bind time, a FULL as a 0-d tensor expanded, so a
  constant fill costs nothing), and its readers load it through its strides. Only where
  every reader reads through strides (pointwise, reduction and matmul kernels, scans,
  attention), never for a graph output, and only where torch can express the chain as a view
  (`view_of`); the root's interval is stretched to cover the view's. Inside a scan body, an
  input whose operand is such a view is `strided` too, so the body's kernels never load it
  as dense memory; A SCAN's results are its ITEMs' buffers (the scan writes them
  directly), so ITEMs never copy;
- a carry ITEM of a scan of even length takes its carry operand's buffer (also an alias) when
  that operand is a plain arena value read by nothing but the scan: only the first iteration
  reads it and only the odd ones write the ITEM (`_carry_in_place`), so the cotangent
  entering a layer stack's backward and the one leaving it cost one buffer;
- a carry operand that nothing reads after the scan (a plain arena value read by the scan
  alone, or a body input its enclosing scan lends) is the carry's slot B: iterations after
  the first write it (`BufferPlan.lent`, `ScanHomes.lent`); a scan's carry input is dead
  after each iteration (it is read from a slot, the ITEM or a lent operand), so a body lends
  it to its own scans (`_dead_carries`): the layer backward inside a group's backward writes
  the group's incoming cotangent instead of a slot of its own;
- each SCAN kernel holds a workspace for exactly its own kernel index: the carry state
  (two aligned slots per carry, A then B, that iterations write in turn; 0 bytes for a slot
  no iteration uses: a carry whose ITEM is read uses that buffer as one of its two, and a
  scan of one or two iterations needs fewer, `ScanHomes.slot_used`) followed by its
  body's arena. The body is planned recursively with its inputs external (the first
  iteration reads the carry operands, later ones the slot the previous iteration wrote;
  per-iteration slices are read in place from the xs operands, constants from their
  operands). Its outputs are external too, written where the scan wants them (`OUTPUT_PREFIX`
  + output name): a carry into the other slot (into its ITEM buffer on the last iteration),
  a ys value straight into its slice of the stacked ITEM buffer; an output that reshapes a
  kernel output has that value written there (viewed in its shape). So a scan copies
  nothing. The exceptions keep a body-arena buffer and are copied: an output that is a body
  input, a reshape of a body input or of another output, or a value returned under several
  names (all but the first). A body's buffers are reused every iteration.

Numbers: `lower_bound_bytes` is the peak over the kernels of live activation bytes (aligned,
a workspace counted as carry state + its body's lower bound): no placement of this schedule
fits in less. `peak_activation_bytes` is the same peak with workspaces at their planned size
(carry state + body arena). `arena_bytes` is what the placement uses.
`BufferPlan.location(value)` says where any value that leaves its kernel lives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

import torch

from titanc.ir import Graph, Op, OpGroup
from titanc.ir.buffer_plan import OUTPUT_PREFIX, Buffer, BufferPlan, ScanHomes, view_of
from titanc.passes.waves import wave_spans
from titanc.ir.schedule import Schedule, liveness, prologue_results, scan_prologue, value_bytes
from titanc.ir.structural import STRUCTURAL
from titanc.ir.types import TensorType

Interval = tuple[int, int, int]          # (size, first, last), last inclusive


# -- placement of a synthetic buffer list --------------------------------------------------------

def lower_bound(buffers: Sequence[Interval]) -> int:
    """Peak over time of the summed sizes of live buffers."""
    events: dict[int, int] = {}
    for size, first, last in buffers:
        events[first] = events.get(first, 0) + size
        events[last + 1] = events.get(last + 1, 0) - size
    peak = run = 0
    for t in sorted(events):
        run += events[t]
        peak = max(peak, run)
    return peak


def place_in_order(buffers: Sequence[Interval], order: Sequence[int]) -> tuple[list[int], int]:
    """Place buffers one by one in `order`, each at the start of the smallest gap that is free
    for its whole interval and fits it (ties: lowest address), else right above the highest
    buffer it overlaps in time. Returns (offsets, arena size)."""
    offsets = [0] * len(buffers)
    placed: list[tuple[int, int, int, int]] = []       # (first, last, start, end)
    for i in order:
        size, first, last = buffers[i]
        if size <= 0:
            continue
        busy = sorted((s, e) for f, l, s, e in placed if f <= last and first <= l)
        best: tuple[int, int] | None = None            # (gap size, start)
        cursor = 0
        for s, e in busy:
            if s - cursor >= size and (best is None or s - cursor < best[0]):
                best = (s - cursor, cursor)
            cursor = max(cursor, e)
        offsets[i] = best[1] if best is not None else cursor
        placed.append((first, last, offsets[i], offsets[i] + size))
    return offsets, max((e for _, _, _, e in placed), default=0)


def _by_size(b: Sequence[Interval], i: int) -> tuple:
    return (-b[i][0], b[i][1], b[i][2], i)


ORDERS: dict[str, Callable[[Sequence[Interval], int], tuple]] = {
    "size": _by_size,                                                     # greedy by size
    "area": lambda b, i: (-b[i][0] * (b[i][2] - b[i][1] + 1), *_by_size(b, i)),
    "duration": lambda b, i: (b[i][1] - b[i][2], *_by_size(b, i)),       # longest-lived first
    "start": lambda b, i: (b[i][1], *_by_size(b, i)),                     # by first use
}


def place(buffers: Sequence[Interval], strategy: str = "best") -> tuple[list[int], int]:
    """Offsets for (size, first, last) buffers and the arena size.

    `strategy`: one of `ORDERS` (`"size"` is classic greedy-by-size), or `"best"`: every order
    tried, the smallest arena kept (ties: the first in `ORDERS`)."""
    names = list(ORDERS) if strategy == "best" else [strategy]
    best: tuple[list[int], int] | None = None
    for name in names:
        key = ORDERS[name]
        got = place_in_order(buffers, sorted(range(len(buffers)), key=lambda i: key(buffers, i)))
        if best is None or got[1] < best[1]:
            best = got
    assert best is not None
    return best


def overlaps(buffers: Sequence[Interval], offsets: Sequence[int]) -> list[tuple[int, int]]:
    """Pairs (i, j) of buffers that are live together and share an address (should be none)."""
    bad = []
    for i, (si, fi, li) in enumerate(buffers):
        for j in range(i + 1, len(buffers)):
            sj, fj, lj = buffers[j]
            if (fi <= lj and fj <= li and si > 0 and sj > 0
                    and offsets[i] < offsets[j] + sj and offsets[j] < offsets[i] + si):
                bad.append((i, j))
    return bad


def _updates_in_place(g: Graph, vid: int, name: str) -> bool:
    """Is output `vid` an element of an op that updates one of its operands in place (its
    entry's `in_place`: ADAMW's new parameters and moments) and that operand the input named
    `name`? Then it shares that input's persistent slot: the optimizer updates parameters and
    moments where they are."""
    node = g.node(vid)
    if node.op is not Op.ITEM:
        return False
    op = g.node(node.inputs[0])
    rule = STRUCTURAL[op.op].in_place
    k = node.attr("index")
    if rule is None or k not in (where := rule(op.attr_dict)):
        return False
    src_node = g.node(op.inputs[where[k]])
    return src_node.op is Op.INPUT and src_node.attr("name") == name


def _reshaped_source(g: Graph, vid: int, live: dict, inputs: dict[int, str],
                     homed: dict[int, list[str]]) -> int | None:
    """The value a persistent output only reshapes, where that value can live in the
    output's slot instead of an arena buffer plus a copy (a layer group's stacked weight
    gradient [L/k, k, ...] reshaped to [L, ...]): a kernel output with no home of its own."""
    node = g.node(vid)
    if node.op is not Op.RESHAPE:
        return None
    src = node.inputs[0]
    if src not in live or src in inputs or src in homed or g.node(src).op in OpGroup.VIEW:
        return None
    return src


def _carry_in_place(schedule: Schedule, live: dict, aliases: dict[int, int],
                    elsewhere: set[int], names: dict[int, str],
                    strided_in: frozenset[int]) -> dict[int, int]:
    """Carry ITEMs that take their operand's buffer: ITEM j of a scan of even length (>= 2)
    whose carry j is read after the scan (and not saved for the backward) shares the storage
    of carry operand j when that operand is a plain arena value read by nothing but this
    scan, once. `ScanHomes.homes` writes that ITEM on the odd iterations only, and only
    iteration 0 reads the operand, so no iteration reads what it writes; the operand costs
    no extra buffer beside the result (the cotangent entering a layer stack and the one
    leaving it share one)."""
    g, out = schedule.graph, {}
    roots = set(aliases.values())
    for k, kern in enumerate(schedule.kernels):
        for sid in kern.nodes:
            node = g.node(sid)
            if node.op is not Op.SCAN or sid not in schedule.bodies:
                continue
            nc, length = node.attr("n_carry"), node.attr("length")
            if length < 2 or length % 2:
                continue
            items = {g.node(u).attr("index"): u for u in g.users(sid) if u in kern.outputs}
            layout = ScanHomes.of(g, sid, set(items))
            saved = {j for j, _ in layout.saved_in + layout.saved_out}
            for j in range(nc):
                op, item = node.inputs[j], items.get(j)
                if (item is None or j in saved or item in elsewhere or item in aliases
                        or item in roots or item in out.values()):
                    continue
                if (op in aliases or op in roots or op in elsewhere or op in names
                        or op in strided_in or op not in live or op in out.values()
                        or list(node.inputs).count(op) != 1 or set(g.users(op)) != {sid}
                        or live[op][1] != k
                        or value_bytes(g, op) != value_bytes(g, item)):
                    continue
                out[item] = op
    return out


def _dead_carries(g: Graph, sid: int, k: int, read: Collection[int], live: dict,
                  aliases: dict[int, int], elsewhere: set[int], names: dict[int, str],
                  strided: frozenset[int], clobber: frozenset[int]) -> list[int]:
    """The carries j of scan `sid` (kernel k) that the scan may overwrite: every iteration
    reads carry j from a home nothing reads afterwards. Iteration i > 0 reads a slot or the
    ITEM (never a saved ys slice: excluded); iteration 0 reads operand j, which must be dense,
    read by this scan alone and dead after it: a plain arena value (or the ITEM it lends its
    buffer to, `_carry_in_place`), or a body input the enclosing scan lends (`clobber`)."""
    node = g.node(sid)
    layout = ScanHomes.of(g, sid, read)
    saved = {j for j, _ in layout.saved_in + layout.saved_out}
    items = {g.node(u).attr("index"): u for u in g.users(sid)}
    free = []
    for j in range(node.attr("n_carry")):
        op = node.inputs[j]
        sharers = {v for v, r in aliases.items() if r == op}
        if (j in saved or op in aliases or op in strided or sharers - {items.get(j)}
                or list(node.inputs).count(op) != 1 or list(g.users(op)) != [sid]):
            continue
        if op in clobber or (op not in elsewhere and op not in names and op in live
                             and live[op][1] == k):
            free.append(j)
    return free


def _carry_in_place_each_iteration(body: BufferPlan, j: int) -> bool:
    """May an iteration of a scan with body plan `body` write carry j's next value over the
    storage it read carry j from? Yes when every kernel reading body input j (or a view of
    it) runs before the kernel that produces body output j, or that producer is a nested
    scan whose carry, started from input j alone, is itself updated in place into output j
    (a layer group's backward: its layer backward scan updates the cotangent in place)."""
    sched, bg = body.schedule, body.schedule.graph
    inp, out = bg.inputs[j], bg.outputs[j][1]
    same = {inp} | {v for v, (root, _) in body.views.items() if root == inp} | \
        {v for v, r in body.aliases.items() if r == inp}
    kernel_of = {n: k for k, kern in enumerate(sched.kernels) for n in kern.nodes}
    if out in same or out not in kernel_of:
        return False
    # the first kernel writing output j's storage (a value aliased to it is written in place)
    writers = {out, body.aliases.get(out, out)} | {v for v, r in body.aliases.items()
                                                   if r in (out, body.aliases.get(out, out))}
    produced = min(kernel_of[w] for w in writers if w in kernel_of)
    readers = {kernel_of[u] for v in same for u in bg.users(v) if u not in same}
    if all(k < produced for k in readers):
        return True
    item = bg.node(out)
    if item.op is not Op.ITEM or readers != {produced}:
        return False
    sid, jj = item.inputs[0], item.attr("index")
    scan = bg.node(sid)
    return (scan.op is Op.SCAN and jj < scan.attr("n_carry") and scan.inputs[jj] == inp
            and list(bg.users(inp)) == [sid] and list(scan.inputs).count(inp) == 1
            and jj in body.in_place.get(sid, frozenset()))


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan_buffers(schedule: Schedule, persistent: Collection[str] = (),
                alignment: int = 64) -> BufferPlan:
    """Plan `schedule`'s activations (and its scan bodies', recursively) into one arena."""
    return _plan(schedule, set(persistent), alignment, body=False)


def _reads_strided(g: Graph, kern: Any, v: int) -> bool:
    """Does `kern` read value `v` through its strides? Every kernel but a template whose op's
    entry says otherwise (`Structural.strided`: a scan, the attention and cross-entropy
    templates read every operand so; the segment sum (INDEX_ADD) its indices, sorted as they
    are read; AdamW none)."""
    if kern.category != "template":
        return True
    for nid in kern.nodes:
        n = g.node(nid)
        e = STRUCTURAL.get(n.op)
        if e is not None and (e.strided == "all" or any(
                i == v and e.reads_strided(k) for k, i in enumerate(n.inputs))):
            return True
    return False


def _views(schedule: Schedule, live: dict, outs: set[int], elsewhere: set[int],
           strided_in: frozenset[int]) -> dict[int, tuple[int, tuple[int, ...]]]:
    """The values bound as views (module docstring), in kernel order."""
    g, kernels = schedule.graph, schedule.kernels
    readers: dict[int, list[Any]] = {}
    for kern in kernels:
        for v in kern.inputs:
            readers.setdefault(v, []).append(kern)
    views: dict[int, tuple[int, tuple[int, ...]]] = {}
    for kern in kernels:
        inside = set(kern.nodes)
        for v in kern.outputs:
            if v in outs or v in elsewhere or not all(_reads_strided(g, r, v)
                                                      for r in readers.get(v, [])):
                continue
            chain, x, ok = [], v, True
            while True:
                n = g.node(x)
                if x != v and x in live:                        # a stored value
                    break
                if n.op in OpGroup.GENERATOR:                   # a constant (or immediate)
                    break
                if n.op not in OpGroup.VIEW or (x != v and x not in inside):
                    ok = False
                    break
                chain.append(x)
                x = n.inputs[0]
            generator = g.node(x).op in OpGroup.GENERATOR and (x == v or x not in live)
            if not ok or (not generator and all(g.node(c).op is Op.RESHAPE for c in chain)
                          and x not in views and x not in strided_in):
                continue                                         # not a view, or a dense reshape
            root, pre = views.get(x, (x, ()))
            full = pre + tuple(reversed(chain))
            if _expressible(g, root, full, root in strided_in):
                views[v] = (root, full)
    return views


def _expressible(g: Graph, root: int, chain: tuple[int, ...], strided: bool) -> bool:
    """Can torch express `chain` over root's storage as a view (checked on meta tensors; a
    strided root, a body input bound to a view, only when the chain has no reshape)?"""
    n = g.node(root)
    if strided and any(g.node(c).op is Op.RESHAPE for c in chain):
        return False
    shape = n.type.shape
    t = (torch.empty((), device="meta").expand(tuple(shape)) if n.op is Op.FULL
         else torch.empty(shape, device="meta"))
    try:
        for c in chain:
            t = view_of(t, g.node(c))
    except RuntimeError:
        return False
    return True


def _plan(schedule: Schedule, persistent: set[str], alignment: int, body: bool,
          strided_in: frozenset[int] = frozenset(),
          clobber: frozenset[int] = frozenset()) -> BufferPlan:
    g, kernels = schedule.graph, schedule.kernels
    live = liveness(schedule)
    if schedule.waves and kernels:      # a value is live across the waves it spans (waves.py)
        spans = wave_spans(schedule)
        live = {v: (spans[a][0], spans[b][1]) for v, (a, b) in live.items()}
    names = {i: g.node(i).attr("name") for i in g.inputs}
    kernel_of = {v: k for k, kern in enumerate(kernels)
                 for v in kern.outputs + prologue_results(g, kern)}

    # where values that are not activations live
    external = dict(names) if body else {}
    reshaped: dict[int, int] = {}        # an output -> the kernel output it reshapes, homed there
    pers_slots: dict[str, tuple[int, int]] = {}
    pers_vals: dict[int, list[str]] = {}
    if body:
        _body_output_homes(g, live, external, reshaped)
    else:
        pers_slots, pers_vals = _persistent_homes(g, persistent, alignment, live, names, reshaped)
    elsewhere = set(pers_vals) | set(external)

    views = _views(schedule, live, {v for _, v in g.outputs}, elsewhere, strided_in)
    aliases = _aliases(schedule, live, views, pers_vals, reshaped, elsewhere, names, strided_in)
    constants = frozenset(r for r, _ in views.values()
                          if g.node(r).op in OpGroup.GENERATOR and (r in views or r not in live))
    span = {v: list(iv) for v, iv in live.items() if v not in aliases and v not in elsewhere}
    for v, root in aliases.items():
        if root in span:
            span[root][0] = min(span[root][0], live[v][0])
            span[root][1] = max(span[root][1], live[v][1])

    # buffers: values, then one workspace per scan kernel
    entries: list[tuple[int, str, str]] = []                     # (value, producer, kind)
    intervals: list[tuple[int, int, int]] = []                   # (bytes, first, last)
    for v in sorted(span):
        is_input = v in names
        entries.append((v, f"input:{names[v]}" if is_input else kernels[kernel_of[v]].name,
                        "input" if is_input else "value"))
        intervals.append((_align(value_bytes(g, v), alignment), span[v][0], span[v][1]))
    ws = _scan_workspaces(schedule, alignment, live, views, aliases, elsewhere, names,
                          strided_in, clobber)
    ws_low: dict[int, int] = {}                                  # workspace at the lower bound
    for sid, kname, size, low_size, k in ws.rows:
        entries.append((sid, kname, "workspace"))
        intervals.append((size, k, k))
        ws_low[len(intervals) - 1] = low_size

    offsets, arena = place(intervals)
    low = [(ws_low.get(i, s), a, b) for i, (s, a, b) in enumerate(intervals)]
    buffers = sorted((Buffer(v, off, s, a, b, prod, kind)
                      for (v, prod, kind), off, (s, a, b) in zip(entries, offsets, intervals)),
                     key=lambda b: (b.first, b.offset, b.value))
    return BufferPlan(schedule, buffers, aliases, pers_slots, pers_vals, external, arena,
                      lower_bound(low), lower_bound(intervals),
                      sum(s for _, s in pers_slots.values()), alignment, ws.bodies, ws.carry,
                      views, frozenset(views) | strided_in, constants, ws.lent, ws.in_place)


def _persistent_homes(g: Graph, persistent: set[str], alignment: int,
                      live: dict[int, tuple[int, int]], names: dict[int, str],
                      reshaped: dict[int, int],
                      ) -> tuple[dict[str, tuple[int, int]], dict[int, list[str]]]:
    """Slots of the persistent region (parameters, gradients, optimizer state) in input then
    output order, and the values homed in them; a reshaped output is recorded in `reshaped`."""
    pers_slots: dict[str, tuple[int, int]] = {}
    pers_vals: dict[int, list[str]] = {}
    top = 0
    for vid, name in [(i, names[i]) for i in g.inputs] + [(v, n) for n, v in g.outputs]:
        if name in persistent and name not in pers_slots:
            size = _align(value_bytes(g, vid), alignment)
            pers_slots[name] = (top, size)
            top += size
            src = _reshaped_source(g, vid, live, names, pers_vals)
            if src is not None:
                reshaped[vid] = src
            pers_vals.setdefault(vid if src is None else src, []).append(name)
        elif name in persistent and _updates_in_place(g, vid, name):
            pers_vals.setdefault(vid, []).append(name)    # the input's slot, updated
    return pers_slots, pers_vals


def _body_output_homes(g: Graph, live: dict[int, tuple[int, int]], external: dict[int, str],
                       reshaped: dict[int, int]) -> None:
    """A scan body's outputs are written where the scan wants them (`external`); a reshaped
    kernel output is written there and viewed (`reshaped`)."""
    outs = {v for _, v in g.outputs}
    for name, v in g.outputs:
        node = g.node(v)
        if v in external:
            continue
        if not (node.op is Op.RESHAPE and node.inputs[0] in live):
            external[v] = OUTPUT_PREFIX + name
            continue
        src = node.inputs[0]
        if (src not in external and src not in outs and src not in g.inputs
                and g.node(src).op not in OpGroup.VIEW):
            external[src] = OUTPUT_PREFIX + name
            reshaped[v] = src


def _aliases(schedule: Schedule, live: dict[int, tuple[int, int]], views: dict,
             pers_vals: dict[int, list[str]], reshaped: dict[int, int], elsewhere: set[int],
             names: dict[int, str], strided_in: frozenset[int]) -> dict[int, int]:
    """Values stored in another value's buffer: views (strided, of a stored value or a
    constant), a RESHAPE written by a kernel whose operand already has dense storage, reshaped
    outputs and carries updated in place."""
    g = schedule.graph
    aliases: dict[int, int] = {v: root for v, (root, _) in views.items()}
    for kern in schedule.kernels:
        for v in kern.outputs:
            node = g.node(v)
            src = node.inputs[0] if node.op is Op.RESHAPE else None
            if (src is not None and src in live and v not in pers_vals and v not in views
                    and src not in views and src not in strided_in):
                aliases[v] = aliases.get(src, src)
    for v in views:                      # a view of a dense reshape: the storage's owner
        aliases[v] = aliases.get(aliases[v], aliases[v])
    aliases.update(reshaped)
    aliases.update(_carry_in_place(schedule, live, aliases, elsewhere, names, strided_in))
    return aliases


@dataclass
class _Workspaces:
    """One workspace per scan kernel: its body's plan, carry slots, lent and in-place carries,
    and a row (scan node, kernel name, bytes, bytes at the lower bound, kernel index)."""
    rows: list[tuple[int, str, int, int, int]] = field(default_factory=list)
    bodies: dict[int, BufferPlan] = field(default_factory=dict)
    carry: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    lent: dict[int, frozenset[int]] = field(default_factory=dict)
    in_place: dict[int, frozenset[int]] = field(default_factory=dict)


def _scan_workspaces(schedule: Schedule, alignment: int, live: dict[int, tuple[int, int]],
                     views: dict, aliases: dict[int, int], elsewhere: set[int],
                     names: dict[int, str], strided_in: frozenset[int],
                     clobber: frozenset[int]) -> _Workspaces:
    g, ws = schedule.graph, _Workspaces()
    for k, kern in enumerate(schedule.kernels):
        for sid in kern.nodes:
            if sid not in schedule.bodies:
                continue
            node = g.node(sid)
            bg = node.attr("body")
            strided = frozenset(bi for bi, op in zip(bg.inputs, node.inputs)
                                if op in views or op in strided_in)
            nc = node.attr("n_carry")
            read = {g.node(u).attr("index") for u in g.users(sid) if u in kern.outputs}
            free = _dead_carries(g, sid, k, read, live, aliases, elsewhere, names,
                                 strided_in | strided, clobber)
            ws.lent[sid] = frozenset(free)
            sub = _plan(schedule.bodies[sid], set(), alignment, body=True, strided_in=strided,
                        clobber=frozenset(bg.inputs[j] for j in free))
            ws.bodies[sid] = sub
            slots, off = [], 0
            ws.in_place[sid] = frozenset(j for j in free
                                         if _carry_in_place_each_iteration(sub, j))
            layout = ScanHomes.of(g, sid, read, ws.lent[sid], ws.in_place[sid])
            for q, t in enumerate(2 * node.type[:nc]):              # slots A, then slots B
                used = layout.slot_used(q // nc, q % nc)            # (an unused one: 0 bytes)
                slots.append((off, _align(t.nbytes, alignment) if used else 0))
                off += slots[-1][1]
            ws.carry[sid] = slots
            ws.rows.append((sid, kern.name, off + sub.arena_bytes,
                            off + sub.lower_bound_bytes, k))
    return ws


def holds_logits(g: Graph, vid: int, vocab_size: int) -> bool:
    """Is v (or a value it is a reshape of) of rank >= 2 with the vocabulary as last axis?"""
    node = g.node(vid)
    while True:
        t = node.type
        if isinstance(t, TensorType) and t.rank >= 2 and t.shape[-1] == vocab_size:
            return True
        if node.op is not Op.RESHAPE:
            return False
        node = g.node(node.inputs[0])


def buffer_report(plan: BufferPlan, vocab_size: int) -> dict[str, int]:
    """report.json `memory`: arena, lower bound, persistent and peak activation bytes, and
    `logits_bytes`: the largest activation buffer (scan bodies included) holding logits, i.e.
    a value of rank >= 2 whose last axis is the vocabulary, directly, through a reshape, or
    as an alias (0 if none)."""
    def logits(p: BufferPlan) -> int:
        g = p.schedule.graph
        sizes = {b.value: value_bytes(g, b.value) for b in p.buffers if b.kind != "workspace"}
        hits = [v for v in sizes if holds_logits(g, v, vocab_size)]
        hits += [p.aliases[v] for v in p.aliases
                 if p.aliases[v] in sizes and holds_logits(g, v, vocab_size)]
        return max([sizes[v] for v in hits] + [logits(b) for b in p.bodies.values()],
                   default=0)

    return {"arena_bytes": plan.arena_bytes, "lower_bound_bytes": plan.lower_bound_bytes,
            "persistent_bytes": plan.persistent_bytes,
            "peak_activation_bytes": plan.peak_activation_bytes,
            "logits_bytes": logits(plan)}
