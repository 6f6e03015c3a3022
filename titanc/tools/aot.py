"""`python -m titanc.tools.aot SPEC --arch 80 90 [--set K=V] [--jobs N] [--skip-scan]`: compile
every kernel the spec's programs launch for the given CUDA architectures, without a GPU
(`runtime/targets/aot.py`), and print one JSON line per (launch, arch) and a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str]) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")    # before Triton is first imported
    from titanc.codegen.emit import GRAPHS
    from titanc.compiler import compile_graphs
    from titanc.model.spec import load_spec, parse_set_args
    from titanc.runtime.targets.aot import SHARED_LIMIT, Launch, compile_all, record_launches

    ap = argparse.ArgumentParser(prog="python -m titanc.tools.aot")
    ap.add_argument("spec")
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--set", action="append", default=[], help="spec override key=value")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--skip-scan", action="store_true",
                    help="leave out scan kernels (the slowest to compile)")
    args = ap.parse_args(argv)
    spec = load_spec(args.spec, parse_set_args(args.set))
    compiled = compile_graphs(spec)
    launches: dict[str, Launch] = {}
    for g in GRAPHS:
        for l in record_launches(compiled.plans[g], allow_tf32=spec.compile.allow_tf32):
            if not (args.skip_scan and l.is_scan):
                launches.setdefault(l.key(), l)
    results = compile_all(launches.values(), args.arch, args.jobs)
    for r in results:
        print(json.dumps(r))
    for arch in args.arch:
        rs = [r for r in results if r["arch"] == arch]
        ok = [r for r in rs if r["ok"]]
        print(f"sm_{arch}: {len(ok)}/{len(rs)} compiled, max shared "
              f"{max((r['shared'] for r in ok), default=0)} B (limit {SHARED_LIMIT[arch]}), "
              f"max registers {max((r['registers'] or 0 for r in ok), default=0)}, "
              f"spilling {sum(r['spill_bytes'] > 0 for r in ok)}, "
              f"dot kernels with mma {sum(r['mma'] for r in ok if r['uses_dot'])}"
              f"/{sum(r['uses_dot'] for r in ok)}", file=sys.stderr)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
