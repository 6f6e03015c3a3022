"""The tokenizer and vocabulary of a token-shard data source, read from its header.json.

    spec, note = from_shards(spec, explicit={"train.steps"})

`titanc data prepare` records the tokenizer it used in the shards' header (name, vocabulary,
hash). Training on those shards needs `data.tokenizer` and `model.vocab_size` to match; rather
than asking the user to repeat both on the command line, `from_shards` takes them from the
header:

- the spec's own tokenizer already has the shards' hash: the spec is kept;
- otherwise, unless the user set `data.tokenizer` on the command line (`explicit`), the
  header's tokenizer file is found (the shard directory's tokenizer.json, the path the header
  names, or that file name beside the shard directory: the first whose hash matches) and
  becomes data.tokenizer, its vocabulary model.vocab_size;
- a `--set data.tokenizer` or `--set model.vocab_size` that disagrees with the header is a
  one-line error naming both and the fix.

A directory without a header is refused with the command that prepares it into a directory
outside the source folder.
"""
from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from titanc.errors import TitancError, printable
from titanc.model.spec import Spec, load_spec
from titanc.runtime.data.shards import HEADER, read_header
from titanc.runtime.data.tokenizer import BYTE, TOKENIZER_FILE, load_tokenizer

__all__ = ["from_shards", "prepare_hint", "check_eval_shards"]


def prepare_hint(source: str) -> str:
    """The command that prepares the text in directory `source` into shards beside it,
    never inside it (data/<name>)."""
    name = Path(os.path.abspath(source)).name or "corpus"
    return (f"prepare it with 'titanc data prepare {source} -o data/{name}' and pass "
            f"--data data/{name}")


def from_shards(spec: Spec, explicit: Collection[str] = ()) -> tuple[Spec, str | None]:
    """`spec` with data.tokenizer and model.vocab_size taken from the shard header of
    data.source (when it is a shard directory), and a line saying what was taken (or None)."""
    source = spec.data.source
    if not os.path.isdir(source):
        return spec, None
    d = Path(source)
    if not (d / HEADER).exists():
        raise TitancError(f"data.source {printable(source)} is a directory without {HEADER}, "
                          f"so not token shards; {prepare_hint(source)}")
    info = read_header(d)["tokenizer"]
    want_hash, vocab = info.get("hash"), info.get("vocab_size")
    shown = f"{d / HEADER}"
    if info.get("kind") != "bpe" or not isinstance(want_hash, str):
        return spec, None                    # byte shards: the loader checks the spec's
    tok = load_tokenizer(spec)
    if tok.hash != want_hash:
        if "data.tokenizer" in explicit:
            raise TitancError(
                f"--set data.tokenizer={spec.data.tokenizer}: the shards in {d} were prepared "
                f"with tokenizer {info.get('name')} (hash {want_hash[:12]}, see {shown}), not "
                f"this one (hash {tok.hash[:12]}); drop the --set to use the shards' tokenizer, "
                f"or prepare the shards again with --tokenizer {spec.data.tokenizer}")
        if spec.data.tokenizer != BYTE:
            return spec, None                # the spec file names one: the loader says why
        path = _find_tokenizer(d, info)
    else:
        path = spec.data.tokenizer
    if "model.vocab_size" in explicit and spec.model.vocab_size != vocab:
        raise TitancError(
            f"--set model.vocab_size={spec.model.vocab_size}: the shards' tokenizer "
            f"{info.get('name')} has {vocab} tokens ({shown}); drop the --set (the vocabulary "
            f"is taken from the header) or set model.vocab_size={vocab}")
    if path == spec.data.tokenizer and vocab == spec.model.vocab_size:
        return spec, None
    new = load_spec(spec, {"data.tokenizer": path, "model.vocab_size": vocab})
    return new, (f"data.tokenizer {path} and model.vocab_size {vocab}, from the shard header "
                 f"{shown}")


def _find_tokenizer(d: Path, info: dict[str, Any]) -> str:
    """The tokenizer file the shards were prepared with: the first candidate whose hash is
    the header's."""
    name = str(info.get("name", ""))
    candidates = [d / TOKENIZER_FILE]
    if name and name != BYTE:
        candidates += [Path(name), d.parent / Path(name).name]
    for path in candidates:
        if not path.is_file():
            continue
        try:
            if load_tokenizer(path).hash == info["hash"]:
                return str(path)
        except TitancError:
            continue
    raise TitancError(f"the shards in {d} were prepared with tokenizer {printable(name)} (hash "
                      f"{info['hash'][:12]}), which is not at {printable(name)} nor in {d}; "
                      f"pass --set data.tokenizer=PATH to that tokenizer.json")


def check_eval_shards(data: str, tok: Any, run: str) -> None:
    """`titanc eval RUN --data DIR`: DIR holds shards prepared with RUN's tokenizer (eval has
    no --set: the fix is the shards, prepared again with the run's tokenizer)."""
    if not os.path.isdir(data):
        return
    d = Path(data)
    if not (d / HEADER).exists():
        raise TitancError(f"--data {printable(data)} is a directory without {HEADER}, so not "
                          f"token shards; {prepare_hint(data)}")
    info = read_header(d)["tokenizer"]
    if info.get("hash") == tok.hash:
        return
    theirs = str(info.get("hash", ""))[:12]
    again = ("byte" if tok.name == BYTE
             else f"{Path(run) if Path(run).is_dir() else Path(run).parent}/{TOKENIZER_FILE}")
    raise TitancError(f"--data {printable(data)}: the shards were prepared with tokenizer "
                      f"{printable(str(info.get('name')))} (hash {theirs}), but {printable(run)} "
                      f"was trained with {printable(tok.name)} (hash {tok.hash[:12]}); "
                      f"evaluate on shards prepared with the run's tokenizer: 'titanc data "
                      f"prepare INPUT... -o DIR --tokenizer {printable(again)}'")
