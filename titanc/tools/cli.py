"""The `titanc` command line.

    titanc compile SPEC [-o DIR] [--set KEY=VALUE ...]
    titanc train SPEC --out RUN [--set KEY=VALUE ...] [--data SRC] [--steps N] [--resume RUN]
                 [--reschedule] [--until STEP] [--nproc N]
    titanc inspect DIR [--kernel NAME | --graph [--pass NAME] | --memory] | --pipeline
    titanc bench SPEC [--set KEY=VALUE ...] [--steps N] [--warmup N] [--threads N] [--json]
                      [--predict h100|h200]
    titanc tokenizer train | data prepare | eval     (titanc/tools/corpus_cli.py)
    titanc generate RUN --prompt TEXT [--max-new-tokens N] [--session FILE] ...
    titanc serve RUN [--host H] [--port N] [--slots N] [--max-queue N] [--grace S]
                     [--max-sessions N] [--sessions-dir DIR] [--api-key KEY] ...

`main` returns the exit status: 0 on success, 2 for bad input. A `TitancError` is printed as
one line, `titanc: error: <message>`, never as a traceback. The heavy modules (artifact writer,
trainer) are imported inside the commands, so `titanc --help` and spec errors stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from titanc import bounds as B
from titanc import config
from titanc.errors import TitancError, printable
from titanc.files import check_file_target
from titanc.model.spec import Spec, load_spec, parse_set_args
from titanc.tools.inspect_cli import INSPECT_KERNEL_EXAMPLE, add_inspect_commands

__all__ = ["main", "build_parser", "INSPECT_KERNEL_EXAMPLE"]

_DESCRIPTION = """\
titanc compiles Titans-style language models (attention plus a neural long-term memory that
learns at test time) from a YAML spec into an IR, optimises it, and trains the result.
See examples/ for specs and docs/semantics.md for the exact model they describe."""

_EPILOG = """\
examples:
  titanc compile examples/tiny.yaml -o build/tiny
  titanc compile examples/tiny.yaml --set model.d_model=128 --set train.batch_size=2
  titanc train examples/tiny.yaml --steps 100 --out runs/tiny
  titanc inspect build/tiny --memory
  titanc bench examples/tiny.yaml --steps 3

Run 'titanc COMMAND --help' for the options of a command."""

_SET_HELP = ("override a spec field by its dotted path; VALUE is read as YAML "
             "(--set model.d_model=128, --set train.betas=[0.9,0.99], "
             "--set train.remat_budget_mb=null); repeatable, later ones win")


def _version() -> str:
    try:
        return metadata.version("titanc")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


_temperature = B.finite_float(0.0, 1e6, "a finite temperature (0 is greedy)")


def _add_spec_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="path to a YAML model spec (see examples/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help=_SET_HELP)


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is its own usage error (with its
    usage line), not the top-level parser's."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="titanc", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"titanc {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands",
                                     required=True, parser_class=_CommandParser)
    for add in (_add_compile_parser, _add_train_parser, _add_generate_parser,
                _add_serve_parser, add_inspect_commands):
        add(commands)
    from titanc.tools.corpus_cli import add_commands   # tokenizer train, data prepare, eval
    add_commands(commands)
    from titanc.integrations.hf_export import add_command as add_export   # export --hf
    add_export(commands)
    return parser


def _add_compile_parser(commands: Any) -> None:
    compile_ = commands.add_parser(
        "compile", help="validate a spec and write the compiled artifact to a directory",
        description="Validate SPEC, lower it to the IR and write the compiled artifact to DIR:\n"
                    "report.json (graph sizes, spec hash), manifest.json (spec hash, versions)\n"
                    "and the IR as text under DIR/ir/. A spec compiled before is copied from\n"
                    "the compile cache (TITANC_CACHE_DIR; TITANC_COMPILE_CACHE=0 compiles).",
        epilog="example:\n  titanc compile examples/tiny.yaml -o build/tiny --set model.n_layers=4",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_spec_args(compile_)
    compile_.add_argument("-o", "--out", metavar="DIR", default=None,
                          help="output directory (default: build/<name>, with the spec name "
                               "reduced to letters, digits and underscores)")
    compile_.add_argument("--force", action="store_true",
                          help="write the artifact even when its buffer plan needs more memory "
                               "than this machine has (to read the plan; it cannot run here)")
    compile_.add_argument("--arch", type=int, default=None, metavar="CC",
                          help="also compile every kernel for this CUDA compute capability "
                               "(90: H100, 80: A100), in parallel, into the kernel caches a "
                               "run then loads, and add report.json `occupancy` (grids, "
                               "registers, spills); no GPU needed")
    compile_.set_defaults(run=_cmd_compile)


def _add_train_parser(commands: Any) -> None:
    train = commands.add_parser(
        "train", help="train the model a spec describes and write a run directory",
        description="Compile SPEC and train it, writing metrics, plots and checkpoints to RUN.\n"
                    "Ctrl-C (SIGINT) or SIGTERM stops at the next step with a checkpoint.",
        epilog="examples:\n"
               "  titanc train examples/tiny.yaml --out runs/tiny\n"
               "  titanc train examples/tiny.yaml --data notes.txt --steps 500 --out runs/notes\n"
               "  titanc train examples/tiny.yaml --data data/corpus --out runs/corpus  "
               "(shards: tokenizer and vocabulary from their header)\n"
               "  titanc train examples/tiny.yaml --resume runs/tiny --steps 400 --out runs/tiny\n"
               "  titanc train examples/tiny.yaml --nproc 2 --out runs/ddp   (2 local ranks)\n"
               "  torchrun --nproc-per-node 2 -m titanc.train examples/tiny.yaml --out runs/ddp",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_spec_args(train)
    train.add_argument("--data", metavar="FILE|DIR|synthetic:recall", default=None,
                       help="training data, instead of the spec's data.source: a UTF-8 text "
                            "file (byte-level tokens), a token-shard directory from 'titanc "
                            "data prepare' (data.tokenizer and model.vocab_size are taken from "
                            "its header) or synthetic:recall, an associative-recall task that "
                            "needs a working memory")
    train.add_argument("--steps", metavar="N", type=B.STEPS.arg, default=None,
                       help="total optimizer steps of the run, instead of the spec's "
                            "train.steps; with --resume, the step to train to (the "
                            "learning-rate schedule keeps the checkpoint's span)")
    train.add_argument("--out", metavar="RUN", required=True,
                       help="run directory for metrics.jsonl, checkpoints and loss.png "
                            "(loss.png needs matplotlib: pip install 'titanc[plot]')")
    train.add_argument("--resume", metavar="RUN", default=None,
                       help="continue from the last checkpoint in RUN; parameters the spec adds "
                            "are initialised fresh and listed")
    train.add_argument("--reschedule", action="store_true",
                       help="with --resume and a new --steps: spread the warmup + cosine "
                            "schedule over the new total instead of keeping the checkpoint's "
                            "(the learning rate rises again)")
    train.add_argument("--strict", action="store_true",
                       help="with --resume: refuse any difference between the checkpoint and "
                            "the spec instead of loading the tensors that match")
    train.add_argument("--profile", action="store_true",
                       help="print time per kernel category, tokens/s and peak memory")
    train.add_argument("--threads", type=B.THREADS.arg, default=None, metavar="N",
                       help="torch CPU threads (default: $TITANC_THREADS, else one per 4 GFLOP "
                            "of step work, at most the cores not already busy); shown in the "
                            "progress line")
    train.add_argument("--until", metavar="STEP", type=B.STEPS.arg, default=None,
                       help="stop (with a checkpoint) at this step while the learning-rate "
                            "schedule still spans train.steps; continue later with --resume")
    train.add_argument("--nproc", metavar="N", type=B.NPROC.arg, default=1,
                       help="data-parallel ranks on this machine (torch.distributed, gloo on "
                            "CPU, NCCL on CUDA); train.batch_size is per rank. For several "
                            "machines use torchrun ... -m titanc.train")
    train.set_defaults(run=_cmd_train)


def _add_generate_parser(commands: Any) -> None:
    gen = commands.add_parser(
        "generate", help="sample text from a trained run (or a compiled artifact)",
        description="Load RUN (a run directory or checkpoint file) and continue PROMPT.\n"
                    "Prefill runs whole memory chunks in parallel; decoding is token by token\n"
                    "with a sliding-window KV cache and the memory state (constant memory).",
        epilog="example:\n  titanc generate runs/tiny --prompt 'Once upon' --max-new-tokens 64 "
               "--stream",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("source", metavar="RUN", help="run directory, checkpoint or artifact directory")
    gen.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                     help="prompt text (encoded with the run's tokenizer); repeat for a batch")
    gen.add_argument("--max-new-tokens", type=B.TOKENS.arg, default=64, metavar="N",
                     help="tokens to generate per prompt (default 64)")
    gen.add_argument("--temperature", type=_temperature, default=0.8,
                     help="sampling temperature; 0 is greedy (default 0.8)")
    gen.add_argument("--top-k", type=B.TOP_K.arg, default=None, metavar="K",
                     help="sample among the K most likely tokens")
    gen.add_argument("--top-p", type=B.finite_float(0.0, 1.0, "a probability"), default=None, metavar="P",
                     help="nucleus sampling: the smallest set of tokens with probability > P")
    gen.add_argument("--seed", type=B.SEED.arg, default=0, help="sampling seed (default 0)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop a sequence once its output ends with TEXT; repeatable")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are sampled")
    gen.add_argument("--session", metavar="FILE", default=None,
                     help="a conversation file: continue the state it holds (if it exists) "
                          "with the one --prompt, then save the state after this turn into it")
    gen.set_defaults(run=_cmd_generate)


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve", help="serve a run over HTTP with an OpenAI-compatible API",
        description="Load RUN (a run directory, checkpoint or artifact directory) and serve\n"
                    "POST /v1/completions, GET /v1/models, /health and /metrics, decoding a\n"
                    "fixed pool of SLOTS sequences per batched step (continuous batching).\n"
                    "SIGTERM stops admission, lets requests finish for --grace seconds, exits 0.",
        epilog="example:\n  titanc serve runs/tiny --port 8000 --slots 8\n"
               "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' "
               "-d '{\"prompt\": \"Once\", \"max_tokens\": 32}'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("source", metavar="RUN", help="run directory, checkpoint or artifact directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=B.PORT.arg, default=8000,
                       help="port (default 8000; 0 picks a free one and prints it)")
    serve.add_argument("--slots", type=B.SLOTS.arg, default=8, metavar="N",
                       help="sequences decoded together in each step (default 8)")
    serve.add_argument("--max-queue", type=B.QUEUE.arg, default=64, metavar="N",
                       help="completions that may wait for a slot; more get 429 (default 64)")
    serve.add_argument("--max-prompt-tokens", type=B.PROMPT_TOKENS.arg, default=8192, metavar="N",
                       help="longest prompt accepted, in tokens (default 8192)")
    serve.add_argument("--max-tokens", type=B.TOKENS.arg, default=4096, metavar="N",
                       help="largest max_tokens accepted (default 4096)")
    serve.add_argument("--max-body-bytes", type=B.BODY_BYTES.arg, default=1 << 20, metavar="N",
                       help="largest request body accepted (default 1 MiB)")
    serve.add_argument("--grace", type=B.finite_float(0.0, 86400.0, "seconds"), default=30.0, metavar="SECONDS",
                       help="on SIGTERM, how long running requests may finish (default 30)")
    serve.add_argument("--threads", type=B.THREADS.arg, default=None, metavar="N",
                       help="torch CPU threads (default: torch's default)")
    serve.add_argument("--model-name", default=None, metavar="NAME",
                       help="model id in the API (default: the spec's name)")
    serve.add_argument("--max-sessions", type=B.QUEUE.arg, default=64, metavar="N",
                       help="sessions held in memory (default 64); when full, the least "
                            "recently used idle one is evicted to --sessions-dir, or without "
                            "it a new session gets 429")
    serve.add_argument("--sessions-dir", default=None, metavar="DIR",
                       help="where session snapshots and evicted sessions are written; a "
                            "server restarted on it continues them")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template (or a tokenizer_config.json with "
                            "chat_template) for /v1/chat/completions (default: the run's "
                            "chat_template.jinja or tokenizer_config.json, else none)")
    from titanc.runtime.serve.options import add_trust_arguments
    add_trust_arguments(serve)            # --api-key, --allowed-host, the size limits, ...
    serve.set_defaults(run=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from titanc.runtime.serve.completions import Limits

    try:
        serve = _import("titanc.runtime.serve.server", "serve", "titanc serve")
    except ModuleNotFoundError as exc:
        raise TitancError(f"titanc serve needs {exc.name}: pip install 'titanc[serve]'") from None
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    if args.model_name is not None:
        _text(args.model_name, "--model-name")          # it goes out in every JSON reply
    from titanc.runtime.serve.options import trust_kwargs
    limits = Limits(args.max_prompt_tokens, args.max_tokens, args.max_body_bytes,
                    args.max_response_bytes)
    return serve(args.source, args.host, args.port, args.slots, args.max_queue, limits,
                 args.grace, args.model_name, max_sessions=args.max_sessions,
                 sessions_dir=args.sessions_dir, chat_template=args.chat_template,
                 **trust_kwargs(args))


def _load(args: argparse.Namespace) -> Spec:
    return load_spec(args.spec, parse_set_args(args.overrides))


def _import(module: str, name: str, what: str) -> Callable[..., Any]:
    """Import `module.name`, turning "module not built yet" into a one-line error."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            raise
        raise TitancError(
            f"{what} is not available in this install ({module} is missing)") from None
    return getattr(mod, name)


def _fmt_bytes(n: Any) -> str:
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        return "?"
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def _cmd_compile(args: argparse.Namespace) -> int:
    spec = _load(args)
    out = Path(args.out) if args.out else Path("build") / spec.safe_name
    write_artifact = _import("titanc.tools.artifact", "write_artifact", "titanc compile")
    from titanc.tools.status import status
    with status(f"compiling {printable(spec.name)} into {printable(str(out))} (lowering, "
                f"passes, kernels; a spec compiled before is read from the cache)"):
        report = write_artifact(spec, out, force=args.force, arch=args.arch)
    forward = (report or {}).get("graphs", {}).get("forward", {})
    nodes = forward.get("nodes", "?")
    nodes = len(nodes) if isinstance(nodes, (list, dict)) else nodes
    print(f"compiled {printable(spec.name)} -> {printable(str(out))}")
    print(f"  forward graph: {nodes} nodes, largest tensor "
          f"{_fmt_bytes(forward.get('largest_tensor_bytes'))}")
    from titanc.tools.alignment import note_lines
    for line in note_lines((report or {}).get("gpu_alignment", [])):
        print(f"  {line}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    import torch

    from titanc.runtime.train.threads import resolve_threads

    spec = _load(args)
    if args.nproc > 1:                 # N local ranks of `python -m titanc.train` (same flags)
        from titanc.runtime.train.launch import check_nproc, launch
        check_nproc(args.nproc)
        return launch(_train_argv(args), args.nproc, args.out, spec.train.dist_timeout_s)
    run_training = _import("titanc.runtime.train.trainer", "run_training", "titanc train")
    torch.set_num_threads(resolve_threads(spec, args.threads)[0])
    dist = None
    if "WORLD_SIZE" in config.current().torchrun:     # a rank under torchrun or --nproc
        from titanc.runtime.train.distributed import init_from_env
        dist = init_from_env(spec)
    explicit = set(parse_set_args(args.overrides))     # fields a shard header may not replace
    try:
        summary = run_training(spec, out=args.out, data=args.data, steps=args.steps,
                               resume=args.resume, strict=args.strict, profile=args.profile,
                               until=args.until, dist=dist, reschedule=args.reschedule,
                               explicit=explicit)
    finally:
        if dist is not None:
            from titanc.runtime.train.distributed import shutdown
            shutdown()
    # Ctrl-C stopped it (checkpointed): 130 as for any interrupted command; SIGTERM: 0
    return 130 if isinstance(summary, dict) and summary.get("stopped") == "SIGINT" else 0


def _train_argv(args: argparse.Namespace) -> list[str]:
    """The `titanc train` flags of `args`, less --nproc, for each rank."""
    argv = [args.spec, "--out", args.out]
    for kv in args.overrides:
        argv += ["--set", kv]
    for flag in ("data", "steps", "resume", "until", "threads"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag}", str(getattr(args, flag))]
    argv += [f for f, on in (("--strict", args.strict), ("--profile", args.profile),
                             ("--reschedule", args.reschedule)) if on]
    return argv


def _cmd_generate(args: argparse.Namespace) -> int:
    import titanc
    from titanc.fit import generation_bytes
    from titanc.runtime.capacity import TOKEN_BYTES, check_fits
    from titanc.runtime.data.tokenizer import StreamDecoder
    from titanc.runtime.serve.generate import Generator, Sampling, load_session, save_session
    from titanc.runtime.train.rundir import run_tokenizer

    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise TitancError(f"--top-p: {args.top_p} must be in (0, 1]")
    if args.session is not None and len(args.prompt) != 1:
        raise TitancError(f"--session continues one conversation: give one --prompt, not "
                          f"{len(args.prompt)}")
    if args.session is not None:
        _check_session_path(args.session)       # before the model loads and the turn runs
    prog = titanc.load(args.source)
    tokenizer = run_tokenizer(args.source)        # the run's own, checked against its record
    prompts = [tokenizer.encode(_text(p, "--prompt")) for p in args.prompt]
    stops = tuple(_text(s, "--stop") for s in args.stop)
    n_tokens = sum(map(len, prompts)) + len(prompts) * args.max_new_tokens
    check_fits(generation_bytes(prog.spec, len(prompts)) + n_tokens * TOKEN_BYTES, prog.spec,
               lower=True, reduce="--max-new-tokens or the number of --prompt")
    gen = Generator(prog, tokenizer)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed, stops)
    state = None
    if args.session is not None:
        state = (load_session(args.session, gen) if os.path.exists(args.session)
                 else gen.new_state(1))
    if args.stream and len(prompts) == 1:
        sys.stdout.write(args.prompt[0])
        out = StreamDecoder(tokenizer)           # holds back a character split over tokens
        for _, tok in gen.stream(prompts, args.max_new_tokens, sampling, state):
            sys.stdout.write(out.push(tok))
            sys.stdout.flush()
        sys.stdout.write(out.flush() + "\n")
    else:
        outs = gen.generate(prompts, args.max_new_tokens, sampling, state)
        for prompt, toks in zip(args.prompt, outs):
            print(prompt + tokenizer.decode(toks))
    if state is not None:
        save_session(args.session, gen, state)
    return 0


def _check_session_path(path: str) -> None:
    """--session names a file this turn can be saved to: not empty, not a directory, device
    or FIFO, in a place that takes a new file. Checked before the turn runs, so a turn is
    never computed and then lost to a session that cannot be written."""
    import tempfile

    if not path:
        raise TitancError("--session: an empty path; pass a file such as conv.safetensors")
    p = Path(path)
    shown = printable(path)
    check_file_target(p, "--session", "conv.safetensors")
    where = Path(os.path.abspath(p)).parent
    while not where.exists() and where != where.parent:
        where = where.parent                    # save_session creates the folders below
    try:
        fd, probe = tempfile.mkstemp(dir=where, prefix=".titanc-session-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise TitancError(f"--session {shown}: cannot write in {printable(str(where))} "
                          f"({exc.strerror or exc}); choose a writable place for the session "
                          f"file") from None


def _text(arg: str, flag: str) -> str:
    """A command-line text argument as valid Unicode. Bytes that are not UTF-8 reach Python
    as lone surrogates (PEP 383), which no encoder takes: refused in one line."""
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TitancError(f"{flag}: the argument is not valid UTF-8 text (byte "
                          f"0x{ord(arg[exc.start]) & 0xFF:02x} at character {exc.start}); "
                          f"pass UTF-8 text") from None
    return arg


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on `argv` (default: sys.argv[1:]) and return the exit status."""
    with config.using(config.Config.from_env(os.environ)):   # the one read of the environment
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version exit 0, usage errors exit 2
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return args.run(args)
    except TitancError as exc:
        print(f"titanc: error: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print("titanc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed by its reader (`titanc inspect DIR | head`)
        with contextlib.suppress(OSError):  # nothing more reaches it, not even Python's flush
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141                          # 128 + SIGPIPE, as a shell reports it
    except OSError as exc:  # a write or read the command did not expect to fail (disk full)
        where = f"{printable(str(exc.filename))}: " if exc.filename is not None else ""
        print(f"titanc: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
