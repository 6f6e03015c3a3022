"""The `titanc inspect` and `titanc bench` commands (registered by titanc/tools/cli.py).

    titanc inspect DIR [--kernel NAME | --graph [--pass NAME] | --memory] | --pipeline
    titanc bench SPEC [--set KEY=VALUE ...] [--steps N] [--warmup N] [--threads N] [--json]

Their bodies import the inspector and the profiler lazily, so `titanc --help` stays fast.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from titanc import bounds as B
from titanc.errors import TitancError
from titanc.model.spec import load_spec, parse_set_args

__all__ = ["add_inspect_commands", "INSPECT_KERNEL_EXAMPLE"]

# a kernel every spec's artifact has (the optimizer's), so the help's example stays true
INSPECT_KERNEL_EXAMPLE = "titanc_tem_fused_adamw_0"

_SET_HELP = ("override a spec field by its dotted path; VALUE is read as YAML "
             "(--set model.d_model=128, --set train.betas=[0.9,0.99], "
             "--set train.remat_budget_mb=null); repeatable, later ones win")


def add_inspect_commands(commands: Any) -> None:
    """Register `inspect` and `bench` on the CLI's subparsers object."""
    _add_inspect_parser(commands)
    _add_bench_parser(commands)


def _add_inspect_parser(commands: Any) -> None:
    inspect = commands.add_parser(
        "inspect", help="show the kernels, IR graphs and buffer plan of a compiled artifact",
        description="Read the artifact 'titanc compile' wrote to DIR. Without options: a table of\n"
                    "kernels (category, FLOPs, bytes, arithmetic intensity, IR nodes), totals\n"
                    "per category, and the training step by kernel family before and after\n"
                    "the pattern passes.",
        epilog="examples:\n"
               "  titanc inspect build/tiny\n"
               f"  titanc inspect build/tiny --kernel {INSPECT_KERNEL_EXAMPLE}\n"
               "  titanc inspect build/tiny --graph --pass aggregate\n"
               "  titanc inspect build/tiny --memory\n"
               "  titanc inspect --pipeline",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    inspect.add_argument("dir", metavar="DIR", nargs="?", default=None,
                         help="artifact directory ('titanc compile -o DIR')")
    what = inspect.add_mutually_exclusive_group()
    what.add_argument("--pipeline", action="store_true",
                      help="print the compile pipeline: each graph kind's lowering and passes "
                           "(with their conditions), then what every kind goes through; no DIR")
    what.add_argument("--kernel", metavar="NAME",
                      help="print one kernel's source with its header (DIR/kernels/NAME.py)")
    what.add_argument("--graph", action="store_true",
                      help="write the IR after a pass as DIR/graph_<pass>.dot (and .png when "
                           "Graphviz is installed)")
    what.add_argument("--memory", action="store_true",
                      help="print the buffer plan summary (arena, lower bound, persistent, "
                           "peak activation, logits) and the head of memory_plan.txt")
    inspect.add_argument("--pass", dest="pass_name", metavar="NAME", default=None,
                         help="with --graph: the pass whose output to draw, by pass name "
                              "(aggregate: its last run) or dump name (02_aggregate_forward); "
                              "default: the final training graph")
    inspect.add_argument("--limit", type=B.LIMIT.arg, default=None, metavar="N",
                         help="list only the first N kernels (totals still cover all)")
    inspect.set_defaults(run=_cmd_inspect)


def _add_bench_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "bench", help="time compiled training steps and print a profile per kernel category",
        description="Compile SPEC, run warm-up steps, then N training steps on random tokens\n"
                    "under the profiler: time per kernel category, tokens/s, MFU where the\n"
                    "device peak is known, peak memory.",
        epilog="example:\n  titanc bench examples/tiny.yaml --steps 3 --threads 2 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("spec", metavar="SPEC", help="path to a YAML model spec (see examples/)")
    bench.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help=_SET_HELP)
    bench.add_argument("--steps", type=B.STEPS.arg, default=5, metavar="N",
                       help="profiled training steps (default 5)")
    bench.add_argument("--warmup", type=B.Bound(0, 1 << 20, "a number of steps").arg, default=1, metavar="N",
                       help="unprofiled warm-up steps first (default 1)")
    bench.add_argument("--threads", type=B.THREADS.arg, default=None, metavar="N",
                       help="torch CPU threads (default: torch's default); always reported")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.add_argument("--predict", choices=("h100", "h200"), default=None, metavar="GPU",
                       help="run nothing: the cost model's step on GPU (h100, h200) from the "
                            "lowered program (docs/cost_model.md)")
    bench.set_defaults(run=_cmd_bench)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from titanc.tools import inspect
    from titanc.tools.build_dir import open_artifact

    if args.pass_name is not None and not args.graph:
        raise TitancError("--pass selects the graph to draw; use it with --graph")
    if args.pipeline:
        from titanc.compiler import pipeline_text
        if args.dir is not None:
            raise TitancError("--pipeline prints the compiler's table and reads no DIR; "
                              "leave DIR out")
        sys.stdout.write(pipeline_text())
        return 0
    if args.dir is None:
        raise TitancError("inspect needs DIR, the directory 'titanc compile -o DIR' wrote "
                          "(or --pipeline)")
    art = open_artifact(args.dir)
    if args.kernel is not None:
        sys.stdout.write(inspect.kernel_source(art, args.kernel).rstrip("\n") + "\n")
    elif args.graph:
        stage, written, note = inspect.write_graph(art, args.pass_name)
        print(f"{stage}: wrote {', '.join(map(str, written))}")
        if note:
            print(note)
    elif args.memory:
        print(inspect.memory_summary(art))
    else:
        rows, note = inspect.resolved_rows(art)
        print(inspect.kernel_table(art, args.limit, rows, note))
        step = inspect.step_table(art)
        if step:
            print("\n" + step)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import json

    from titanc.tools.bench import bench_table, predict_bench, predict_table, run_bench

    if args.predict:
        result = predict_bench(_spec(args), args.predict)
        print(json.dumps(result, indent=2) if args.json else predict_table(result))
        return 0
    result = run_bench(_spec(args), steps=args.steps, warmup=args.warmup, threads=args.threads)
    print(json.dumps(result, indent=2) if args.json else bench_table(result))
    return 0


def _spec(args: argparse.Namespace) -> Any:
    return load_spec(args.spec, parse_set_args(args.overrides))
