"""Reading a text corpus: files, directories, .jsonl and .parquet, cut into pieces for workers.

    pieces = plan(["notes.txt", "wiki/", "dump.jsonl", "web.parquet"], ext=None)
    for text, doc_end in read_piece(pieces[0], text_field="text"): ...

A *piece* is a unit of work small enough for one worker call: a byte range of a text file
(cut after a newline, never inside a UTF-8 character), a range of whole lines of a .jsonl
file, or one row group of a .parquet file. `read_piece` yields `(text, doc_end)`: `doc_end` is
True where a document ends (the end of a text file, every .jsonl record and parquet row), which
is where `titanc data prepare` appends the end-of-text token. A .jsonl record or parquet row
whose text is null or "" holds no document and is skipped (a parquet text column may be
dictionary-encoded, as pandas writes a Categorical).

Directories are walked in sorted order, skipping hidden entries and `__pycache__`; `ext`
(e.g. `{"md", "py"}`) keeps only files with those suffixes there. Every problem is a
`TitancError` naming the file (and line or byte offset) and the fix: a missing input, text that
is not UTF-8, a .jsonl line that is not JSON or lacks the text field or whose text holds a lone
surrogate (`"\\ud800"`: valid JSON, no Unicode), a .parquet file that is not parquet or lacks
the column.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from titanc.errors import TitancError
from titanc.runtime.data.shards import HEADER

__all__ = ["Piece", "PIECE_BYTES", "find_files", "plan", "read_piece", "iter_texts"]

PIECE_BYTES = 1 << 20          # target size of a text / jsonl piece
_SKIP_DIRS = frozenset({"__pycache__"})


@dataclass(frozen=True, slots=True)
class Piece:
    path: str
    kind: str        # "text" | "jsonl" | "parquet"
    start: int       # byte offset (text, jsonl) or row group (parquet)
    length: int      # bytes (text, jsonl); 0 for parquet
    line: int        # 1-based number of the piece's first line (jsonl)
    last: bool       # the last piece of its file (text: the document ends here)
    size: int        # bytes, for progress


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


def find_files(inputs: Iterable[str | os.PathLike], ext: Iterable[str] | None = None,
               exclude: Iterable[str | os.PathLike] = (),
               notice: Callable[[str], None] | None = None) -> list[Path]:
    """The files `inputs` name, directories expanded in sorted order (see the module doc).
    Directories that hold a token-shard set (a header.json beside train.bin) and those in
    `exclude` (the output being written) are skipped, with one line to `notice` (stderr)."""
    exts = {e.lower().lstrip(".") for e in ext} if ext else None
    skip = {os.path.realpath(e) for e in exclude}
    say = notice or (lambda line: print(line, file=sys.stderr))
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if not p.exists():
            raise TitancError(f"input {p} does not exist; pass text files, directories, .jsonl "
                              f"or .parquet files")
        if p.is_file():
            parent = p.parent
            if not _skipped(parent, os.listdir(parent), skip, say, p):
                files.append(p)
            continue
        if not p.is_dir():
            raise TitancError(f"input {p} is not a regular file or a directory (a device, FIFO "
                              f"or socket); pass text files, directories, .jsonl or .parquet "
                              f"files")
        found = []
        for root, dirs, names in os.walk(p):
            if _skipped(Path(root), names, skip, say):
                dirs[:] = []
                continue
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
            for name in sorted(names):
                f = Path(root) / name
                if name.startswith(".") or not f.is_file():
                    continue
                if exts is None or f.suffix.lower().lstrip(".") in exts:
                    found.append(f)
        if not found:
            only = f" with suffixes {','.join(sorted(exts))}" if exts else ""
            raise TitancError(f"input directory {p} holds no files{only} (shard sets and the "
                              f"output are skipped); pass a directory with text in it")
        files.extend(found)
    return files


def _skipped(root: Path, names: list[str], skip: set[str], say: Callable[[str], None],
             file: Path | None = None) -> bool:
    """Whether a directory of the walk (or `file` in it) is left out: the output, or a shard
    set."""
    what = f"{file}: it is in" if file is not None else f"{root}: it is"
    if os.path.realpath(root) in skip:
        say(f"titanc: note: skipping {what} the output directory")
        return True
    if HEADER in names and "train.bin" in names:
        say(f"titanc: note: skipping {what} a token-shard set, not text")
        return True
    return False


def _cut(block: bytes, kind: str) -> int:
    """Where to end a piece inside `block`: after its last newline; for text without one,
    before a UTF-8 character start. jsonl pieces always end at a newline (whole records)."""
    nl = block.rfind(b"\n")
    if nl >= 0:
        return nl + 1
    if kind == "jsonl":
        return 0                                   # no line end yet: take a bigger block
    cut = len(block) - 1                           # cut before a byte that starts a char
    while cut > 0 and (block[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut or len(block)


def _byte_pieces(path: Path, kind: str, piece_bytes: int) -> list[Piece]:
    size = path.stat().st_size
    pieces: list[Piece] = []
    start, line = 0, 1
    try:
        with open(path, "rb") as f:
            while start < size:
                want = piece_bytes
                while True:
                    f.seek(start)
                    block = f.read(want)
                    cut = len(block) if start + len(block) >= size else _cut(block, kind)
                    if cut:
                        break
                    want *= 2                      # a line longer than the piece size
                pieces.append(Piece(str(path), kind, start, cut, line, False, cut))
                line += block[:cut].count(b"\n")
                start += cut
    except OSError as exc:
        raise TitancError(f"input {path} cannot be read: {exc.strerror or exc}") from None
    if pieces:
        last = pieces[-1]
        pieces[-1] = Piece(last.path, kind, last.start, last.length, last.line, True, last.size)
    return pieces


def _parquet_file(path: Path):  # noqa: ANN202 - pyarrow type
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError variants
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TitancError(f"input {path} is not a parquet file ({first}); pass a .parquet "
                          f"file with a text column") from None


def plan(inputs: Iterable[str | os.PathLike], ext: Iterable[str] | None = None,
         piece_bytes: int = PIECE_BYTES, exclude: Iterable[str | os.PathLike] = ()) -> list[Piece]:
    """Every piece of every input, in order (`exclude`: see find_files)."""
    pieces: list[Piece] = []
    for path in find_files(inputs, ext, exclude):
        kind = _kind(path)
        if kind == "parquet":
            pf = _parquet_file(path)
            n = pf.metadata.num_row_groups
            for i in range(n):
                size = pf.metadata.row_group(i).total_byte_size
                pieces.append(Piece(str(path), kind, i, 0, 0, i == n - 1, size))
        else:
            pieces.extend(_byte_pieces(path, kind, piece_bytes))
    return pieces


def _utf8(raw: bytes, path: str, offset: int, where: str = "") -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TitancError(
            f"input {path}{where} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
            f"{offset + exc.start}); convert it to UTF-8 or leave it out (--ext filters the "
            f"files of a directory)") from None


def _read_range(piece: Piece) -> bytes:
    try:
        with open(piece.path, "rb") as f:
            f.seek(piece.start)
            return f.read(piece.length)
    except OSError as exc:
        raise TitancError(f"input {piece.path} cannot be read: {exc.strerror or exc}") from None


def _jsonl(piece: Piece, field: str) -> Iterator[tuple[str, bool]]:
    raw = _read_range(piece)
    offset = piece.start
    for k, line in enumerate(raw.split(b"\n")):
        where = f":{piece.line + k}"
        text = _utf8(line, piece.path, offset, where)
        if offset == 0 and text.startswith("\ufeff"):   # a byte-order mark (Windows tools
            text = text[1:]                              # write one) is no part of the JSON
        offset += len(line) + 1
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TitancError(f"input {piece.path}{where}: not valid JSON ({exc.msg}); each "
                              f"line of a .jsonl file is one JSON object") from None
        if not isinstance(record, dict) or field not in record:
            raise TitancError(f"input {piece.path}{where}: no {field!r} field; name the text "
                              f"field with --text-field")
        value = record[field]
        if value is None:
            continue
        if not isinstance(value, str):
            raise TitancError(f"input {piece.path}{where}: field {field!r} is "
                              f"{type(value).__name__}, not a string; name the text field "
                              f"with --text-field")
        if "\\u" in text:      # JSON escapes may spell a lone surrogate, which is no text
            _check_unicode(value, f"{piece.path}{where}", field)
        if value:               # "" is no document (as in parquet): under the byte tokenizer
            yield value, True   # it would be a zero-length one, a repeated document start


def _check_unicode(value: str, where: str, field: str) -> None:
    """`value` is Unicode text: a JSON escape such as "\\ud800" (half of a surrogate pair,
    alone) is valid JSON but encodes to no UTF-8; refused as non-UTF-8 text is."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TitancError(f"input {where}: field {field!r} holds a lone surrogate "
                          f"{ascii(value[exc.start])} (a JSON escape that is no Unicode "
                          f"character; its pair is missing); fix or drop the record") from None


def _parquet(piece: Piece, field: str) -> Iterator[tuple[str, bool]]:
    import pyarrow as pa

    pf = _parquet_file(Path(piece.path))
    names = pf.schema_arrow.names
    if field not in names:
        raise TitancError(f"input {piece.path}: no column {field!r} (columns: "
                          f"{', '.join(names[:8])}); name the text column with --text-field")
    column = pf.schema_arrow.field(field)
    kind = column.type
    if pa.types.is_dictionary(kind):          # dictionary-encoded text (pandas Categorical)
        kind = kind.value_type
    if not _is_string(pa, kind):
        raise TitancError(f"input {piece.path}: column {field!r} has type {column.type}, not "
                          f"string; name the text column with --text-field")
    table = pf.read_row_group(piece.start, columns=[field])
    for value in table.column(0).to_pylist():
        if value:
            yield value, True


def _is_string(pa, kind) -> bool:  # noqa: ANN001 - pyarrow module and type
    view = getattr(pa.types, "is_string_view", None)
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or (view is not None and view(kind)))


def read_piece(piece: Piece, text_field: str = "text") -> Iterator[tuple[str, bool]]:
    """The texts of one piece as (text, doc_end) pairs (see the module docstring)."""
    if piece.kind == "jsonl":
        yield from _jsonl(piece, text_field)
    elif piece.kind == "parquet":
        yield from _parquet(piece, text_field)
    else:
        yield _utf8(_read_range(piece), piece.path, piece.start), piece.last


def iter_texts(inputs: Iterable[str | os.PathLike], ext: Iterable[str] | None = None,
               text_field: str = "text") -> Iterator[str]:
    """Every text of the corpus, in order (pieces of long files as separate strings)."""
    for piece in plan(inputs, ext):
        for text, _ in read_piece(piece, text_field):
            yield text
