"""One Triton kernel per scan: a SCAN node's body graph, loops and all, as a single program.

    kernel.py   `render_scan` / `scan_kernel_for` (the entry), launches per step, host tables
    stages.py   the body's nodes as kernel stages (pointwise, reductions, einsums, cumsums)
    values.py   values of a stage: workspace refs, on-chip carries, bf16 rounding
    index.py    index arithmetic and value references; `ScanFallback` (why a scan stays a loop)
    pack.py     liveness packing of the per-program workspace
"""
