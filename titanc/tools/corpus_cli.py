"""The corpus commands of the `titanc` CLI: tokenizers, token shards and evaluation.

    titanc tokenizer train CORPUS... --vocab-size N -o tokenizer.json [--ext md,py]
    titanc data prepare INPUT... -o DIR [--tokenizer byte|PATH] [--val-fraction F] [--workers N]
    titanc eval RUN --data DIR|FILE|synthetic:recall [--batches N] [--recall] [--split val]
    titanc eval RUN --task recall [--distances 8,64,256] [--recall-layout n_pairs=4,...]

`add_commands` registers them on the main parser's subcommands (titanc/tools/cli.py); their bodies
import the runtime lazily, so `titanc --help` stays fast.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from titanc import bounds as B
from titanc.errors import TitancError

__all__ = ["add_commands"]

_RAW = argparse.RawDescriptionHelpFormatter


def _exts(text: str) -> list[str]:
    return [e.strip().lstrip(".") for e in text.split(",") if e.strip()]


def _add_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ext", type=_exts, default=None, metavar="EXT[,EXT]",
                   help="inside directories, read only files with these suffixes "
                        "(e.g. md,py,txt); default: every non-hidden file")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the text field of .jsonl records / column of .parquet files "
                        "(default: text)")


def add_commands(commands: Any) -> None:
    """Register `tokenizer`, `data` and `eval` on the CLI's subparsers object."""
    _add_tokenizer(commands)
    _add_data(commands)
    _add_eval(commands)


def _add_tokenizer(commands: Any) -> None:
    tok = commands.add_parser(
        "tokenizer", help="train a byte-level BPE tokenizer on a corpus",
        description="Tokenizers through the Hugging Face 'tokenizers' library.",
        formatter_class=_RAW)
    tok_sub = tok.add_subparsers(dest="tokenizer_command", metavar="COMMAND", required=True,
                                 title="commands")
    train = tok_sub.add_parser(
        "train", help="train a byte-level BPE and write tokenizer.json",
        description="Train a byte-level BPE (GPT-2 style: 256 byte symbols, then merges,\n"
                    "<|endoftext|> as id 0) on text files, directories, .jsonl and .parquet.\n"
                    "Prepare shards with it (data prepare --tokenizer PATH): 'titanc train --data DIR'\n"
                    "takes data.tokenizer and model.vocab_size from their header.",
        epilog="example:\n  titanc tokenizer train docs/ README.md --ext md --vocab-size 4096 "
               "-o tok.json",
        formatter_class=_RAW)
    train.add_argument("inputs", nargs="+", metavar="CORPUS",
                       help="text files, directories (read recursively), .jsonl or .parquet "
                            "files to learn the merges from")
    train.add_argument("--vocab-size", type=B.VOCAB_SIZE.arg, required=True, metavar="N",
                       help="vocabulary size, including the 256 byte symbols and <|endoftext|>")
    train.add_argument("-o", "--out", required=True, metavar="FILE",
                       help="where to write tokenizer.json")
    train.add_argument("--min-frequency", type=B.MIN_FREQUENCY.arg, default=2, metavar="N",
                       help="merge only pairs seen at least N times (default 2)")
    _add_corpus_args(train)
    train.set_defaults(run=_cmd_tokenizer_train)


def _add_data(commands: Any) -> None:
    data = commands.add_parser(
        "data", help="prepare token shards (train.bin/val.bin) from text",
        description="Token shards: a corpus tokenized once into train.bin / val.bin and\n"
                    "header.json, which 'titanc train --data DIR' and 'titanc eval' read.",
        epilog="example:\n  titanc data prepare corpus/ -o data/corpus --tokenizer tok.json",
        formatter_class=_RAW)
    data_sub = data.add_subparsers(dest="data_command", metavar="COMMAND", required=True,
                                   title="commands")
    prep = data_sub.add_parser(
        "prepare", help="tokenize a corpus into train.bin / val.bin + header.json",
        description="Tokenize text files, directories, .jsonl and .parquet in parallel worker\n"
                    "processes into DIR/train.bin and DIR/val.bin (uint16 when the vocabulary\n"
                    "fits, else uint32) plus DIR/header.json (tokenizer hash, dtype, token\n"
                    "counts, sources). Train on them with data.source: DIR.",
        epilog="example:\n  titanc data prepare corpus/ -o data/corpus --tokenizer tok.json",
        formatter_class=_RAW)
    prep.add_argument("inputs", nargs="+", metavar="INPUT",
                      help="text files, directories (read recursively), .jsonl or .parquet "
                           "files to tokenize")
    prep.add_argument("-o", "--out", required=True, metavar="DIR",
                      help="output directory for the shards, outside the input folders "
                           "(e.g. data/corpus)")
    prep.add_argument("--tokenizer", default="byte", metavar="byte|PATH",
                      help="byte (default) or a tokenizer.json from 'titanc tokenizer train'")
    prep.add_argument("--val-fraction", type=B.finite_float(0.0, 0.99, "a fraction"), default=0.1, metavar="F",
                      help="the last F of the token stream is held out as val.bin (default 0.1)")
    prep.add_argument("--workers", type=B.WORKERS.arg, default=None, metavar="N",
                      help="worker processes (default: the number of CPUs)")
    prep.add_argument("--overwrite", action="store_true",
                      help="replace shards already in DIR")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_corpus_args(prep)
    prep.set_defaults(run=_cmd_data_prepare)


def _add_eval(commands: Any) -> None:
    ev = commands.add_parser(
        "eval", help="held-out loss, perplexity and bits per byte of a trained run (JSON)",
        description="Load RUN (run directory, checkpoint or compiled artifact) with its\n"
                    "tokenizer and evaluate it on fixed windows of DATA: loss (nats/token),\n"
                    "perplexity, bits per byte; --recall adds synthetic recall accuracy.",
        epilog="example:\n  titanc eval runs/corpus --data data/corpus --batches 8",
        formatter_class=_RAW)
    ev.add_argument("run_dir", metavar="RUN",
                    help="run directory, checkpoint or compiled artifact to evaluate")
    ev.add_argument("--data", metavar="DIR|FILE|synthetic:recall",
                    help="a token-shard directory, a text file (byte tokenizer) or "
                         "synthetic:recall")
    ev.add_argument("--batches", type=B.BATCHES.arg, default=8, metavar="N",
                    help="batches of train.batch_size windows (default 8)")
    ev.add_argument("--split", choices=("val", "train"), default="val",
                    help="which split of DATA to score: val (held out, the default) or train")
    ev.add_argument("--recall", action="store_true",
                    help="also report the synthetic associative-recall accuracy")
    ev.add_argument("--task", choices=("lm", "recall"), default="lm",
                    help="lm (default): loss on --data; recall: synthetic recall accuracy by "
                         "pair -> query distance (no --data)")
    ev.add_argument("--distances", default="8,16,32,64,128,256", metavar="D,D,...",
                    help="--task recall: pair -> query distances (default 8,16,32,64,128,256)")
    ev.add_argument("--recall-layout", default="", metavar="KEY=N,...",
                    help="--task recall: SyntheticRecall options, e.g. n_pairs=4,n_queries=4,"
                         "n_keys=8,n_values=8,filler_tokens=4 (default: synthetic:recall's)")
    ev.set_defaults(run=_cmd_eval)


def _cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from titanc.runtime.data.corpus import iter_texts
    from titanc.runtime.data.tokenizer import train_bpe

    tok = train_bpe(iter_texts(args.inputs, args.ext, args.text_field), args.vocab_size,
                    args.out, min_frequency=args.min_frequency)
    note = ("" if tok.vocab_size == args.vocab_size else
            f" (fewer than the {args.vocab_size} asked for: the corpus has too few distinct "
            f"pairs)")
    print(f"trained a byte-level BPE of {tok.vocab_size} tokens{note} -> {args.out} "
          f"(hash {tok.hash[:12]}); prepare shards with it: 'titanc data prepare INPUT... -o "
          f"DIR --tokenizer {args.out}' ('titanc train --data DIR' takes the tokenizer and "
          f"model.vocab_size {tok.vocab_size} from their header)")
    return 0


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from titanc.runtime.data.prepare import prepare

    h = prepare(args.inputs, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                text_field=args.text_field, ext=args.ext, workers=args.workers,
                progress=not args.no_progress, overwrite=args.overwrite)
    n_train, n_val = h["splits"]["train"]["tokens"], h["splits"]["val"]["tokens"]
    mb = h["text_bytes"] / 1e6
    print(f"prepared {len(h['sources'])} files, {mb:.2f} MB of text -> {args.out}: "
          f"{n_train:,} train + {n_val:,} val {h['dtype']} tokens "
          f"({mb / max(h['seconds'], 1e-9):.2f} MB/s, {h['workers']} workers)")
    return 0


RECALL_OPTIONS = ("n_pairs", "n_queries", "n_keys", "n_values", "filler_tokens")


def _int_list(text: str, flag: str) -> list[int]:
    items = [x for x in text.split(",") if x.strip()]
    if not items:
        raise TitancError(f"{flag}: {text[:40]!r} is not a comma-separated list of integers, "
                          f"e.g. 8,64,256")
    return [B.DISTANCE.parse(x, flag) for x in items]


_LAYOUT = B.Bound(0, 1 << 16, "a count")


def _recall_layout(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in RECALL_OPTIONS:
            raise TitancError(f"--recall-layout: {item[:40]!r} must be KEY=N with KEY one of "
                              f"{', '.join(RECALL_OPTIONS)}")
        out[key] = _LAYOUT.parse(value, f"--recall-layout {key}")
    return out


def _cmd_eval(args: argparse.Namespace) -> int:
    from titanc.runtime.train.evaluate import evaluate_recall, evaluate_run

    if args.task == "recall":
        if args.data is not None:
            raise TitancError("--task recall generates its own sequences; drop --data")
        result = evaluate_recall(args.run_dir, _int_list(args.distances, "--distances"),
                                 batches=args.batches,
                                 task=_recall_layout(args.recall_layout))
        print(json.dumps(result, indent=2))
        return 0
    if args.data is None:
        raise TitancError("titanc eval: --data is required (or use --task recall)")
    result = evaluate_run(args.run_dir, args.data, batches=args.batches, split=args.split,
                          recall=args.recall)
    print(json.dumps(result, indent=2))
    return 0
