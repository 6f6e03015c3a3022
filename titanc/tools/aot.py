"""`python -m titanc.tools.aot SPEC --arch 80 90 [--set K=V] [--jobs N]`: compile
every kernel the spec's programs launch for the given CUDA architectures, without a GPU
(`runtime/targets/aot.py`), and print one JSON line per (launch, arch) and a summary
(stderr): per architecture how many compiled, and each kernel that failed with the first
line of its error. Exit 0 when every kernel compiled, 1 when one failed, 2 for bad input
(a bad spec, an architecture without tables, a bad --jobs: one line, as `titanc` says it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from titanc import bounds as B
from titanc.errors import TitancError, printable


def _arch(text: str) -> int:
    """An argparse type: a compute capability titanc has tables for (`aot.SHARED_LIMIT`)."""
    from titanc.runtime.targets.aot import SHARED_LIMIT

    arch = B.Bound(0, 1000, "a CUDA compute capability").arg(text)
    if arch not in SHARED_LIMIT:
        raise argparse.ArgumentTypeError(
            f"{arch}: one of {', '.join(map(str, SHARED_LIMIT))} (the CUDA compute "
            f"capabilities titanc has tables for)")
    return arch


def main(argv: list[str]) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")    # before Triton is first imported
    ap = argparse.ArgumentParser(prog="python -m titanc.tools.aot")
    ap.add_argument("spec")
    ap.add_argument("--arch", type=_arch, nargs="+", default=[80, 90])
    ap.add_argument("--set", action="append", default=[], help="spec override key=value")
    ap.add_argument("--jobs", type=B.WORKERS.arg, default=1)
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:                 # --help: 0; a usage error: 2, one line
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return _run(args)
    except TitancError as exc:
        print(f"titanc: error: {exc}", file=sys.stderr)
        return exc.exit_status


def _run(args: argparse.Namespace) -> int:
    from titanc.codegen.emit import GRAPHS
    from titanc.compiler import compile_graphs
    from titanc.model.spec import load_spec, parse_set_args
    from titanc.runtime.targets.aot import SHARED_LIMIT, Launch, compile_all, record_launches

    archs = list(dict.fromkeys(args.arch))            # --arch 90 90 compiles once
    spec = load_spec(args.spec, parse_set_args(args.set))
    compiled = compile_graphs(spec)
    launches: dict[str, Launch] = {}
    for g in GRAPHS:
        for l in record_launches(compiled.plans[g], allow_tf32=spec.compile.allow_tf32):
            launches.setdefault(l.key(), l)
    results = compile_all(launches.values(), archs, args.jobs)
    for r in results:
        print(json.dumps(r))
    for arch in archs:
        rs = [r for r in results if r["arch"] == arch]
        ok = [r for r in rs if r["ok"]]
        print(f"sm_{arch}: {len(ok)}/{len(rs)} compiled, max shared "
              f"{max((r['shared'] for r in ok), default=0)} B (limit {SHARED_LIMIT[arch]}), "
              f"max registers {max((r['registers'] or 0 for r in ok), default=0)}, "
              f"spilling {sum(r['spill_bytes'] > 0 for r in ok)}, "
              f"dot kernels with mma {sum(r['mma'] for r in ok if r['uses_dot'])}"
              f"/{sum(r['uses_dot'] for r in ok)}", file=sys.stderr)
        loops = sorted((r["mainloop"]["instructions"] / r["mainloop"]["mma"], r["name"],
                        r["mainloop"]["shared_stores"]) for r in ok if r.get("matmul")
                       and r.get("mainloop"))
        if loops:
            print(f"  matmul main loops: {len(loops)} kernels, SASS instructions per tensor-core "
                  f"instruction median {loops[len(loops) // 2][0]:.1f}, max {loops[-1][0]:.1f} "
                  f"({printable(loops[-1][1])}); {sum(s > 0 for _, _, s in loops)} store an "
                  f"operand to shared memory every iteration", file=sys.stderr)
        for r in rs:
            if not r["ok"]:
                error = str(r.get("error") or "no error recorded").strip().splitlines()
                print(f"  failed: {printable(r['name'])}: {printable(error[0] if error else '')}",
                      file=sys.stderr)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
