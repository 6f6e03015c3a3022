"""One Triton kernel per scan: a SCAN node's body graph, loops and all, as a single program.

    kernel.py        `render_scan` / `scan_kernel_for` (the entry), launches per step, host
                     tables
    rules.py         the TRITON_SCAN lowering table: per op, whether a scan kernel holds it
                     (else why not) and how (its stage, independence and value rules)
    independence.py  which axes each program owns (the grid), a value's `pax` by its rule
    emitter.py       the kernel being emitted: lines, names, workspace buffers, tile helpers
    values.py        a body value at coordinates (loads, carries on chip, views composed)
    carries.py       carries held on chip as loop-carried register tiles
    stages.py        pointwise stages (flat tiles; runs of stored elementwise nodes)
    einsum.py        einsum stages (`tl.dot` on blocked tiles)
    reduce.py        reduction stages (sums, maxima, cumulative sums)
    loops.py         a body's nodes in order, and each scan as a loop
    index.py         index arithmetic and value references; `ScanFallback` (why a scan stays
                     a loop)
    tidy.py          dead stores and unread names dropped after emission
    pack.py          liveness packing of the per-program workspace
"""
