"""Tokenizers: the byte tokenizer and byte-level BPE through the Hugging Face `tokenizers` library.

    tok = load_tokenizer("byte")                      # UTF-8 bytes, vocab 256
    tok = load_tokenizer("runs/notes")                # what a run directory / artifact names
    tok = load_tokenizer(spec)                        # what data.tokenizer names
    ids = tok.encode("The old "); text = tok.decode(ids)
    train_bpe(["corpus/"], vocab_size=4096, out="tokenizer.json")

Every tokenizer has `encode`, `decode`, `vocab_size`, `eot` (the end-of-text id appended after
each document by `titanc data prepare`, or None), `hash` (sha256 of its content, recorded in
token shards so a shard is never read with the wrong vocabulary) and `token_bytes()` (UTF-8
bytes per token id, for bits per byte).

Where a tokenizer lives:
- spec: `data.tokenizer: byte | PATH/tokenizer.json`;
- run directory and compiled artifact: `tokenizer.json` beside the checkpoint / manifest (copied
  there by `titanc train` and `titanc compile`), so generation never depends on the original
  file still existing. A directory without one falls back to the spec it holds.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from titanc.errors import TitancError
from titanc.files import check_file_target

__all__ = [
    "Tokenizer", "ByteTokenizer", "BPETokenizer", "StreamDecoder", "BYTE", "TOKENIZER_FILE", "EOT_TOKEN",
    "load_tokenizer", "train_bpe", "check_vocab", "check_same_tokenizer", "save_tokenizer",
    "tokenizer_info",
]

BYTE = "byte"
TOKENIZER_FILE = "tokenizer.json"
EOT_TOKEN = "<|endoftext|>"


@runtime_checkable
class Tokenizer(Protocol):
    """What the runtime needs from a tokenizer."""
    name: str             # "byte" or the file it was read from
    vocab_size: int
    eot: int | None       # end-of-text id between documents, or None
    hash: str             # sha256 hex of the tokenizer's content

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self) -> np.ndarray: ...


def _sha256_json(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _ids(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(t) for t in ids]


class ByteTokenizer:
    """UTF-8 bytes, one token per byte. Ids >= 256 (a model with a larger vocabulary may sample
    them) decode to U+FFFD, like invalid UTF-8."""
    name = BYTE
    vocab_size = 256
    eot = None
    hash = _sha256_json({"type": "titanc-byte", "vocab_size": 256})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        out, run = [], bytearray()
        for t in _ids(ids):
            if 0 <= t < 256:
                run.append(t)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            out.append("\ufffd")
            run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class BPETokenizer:
    """A `tokenizers` tokenizer read from a tokenizer.json (byte-level BPE from `train_bpe`, or
    any other the library reads)."""

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as HFTokenizer

        self.path = Path(path)
        self.name = str(self.path)
        text = _read_text(self.path, "tokenizer file")
        try:
            content = json.loads(text)
            self._tok = HFTokenizer.from_str(text)
        except Exception as exc:  # json or the library's own parse error
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TitancError(f"tokenizer file {self.path} is not a tokenizers JSON file "
                              f"({first}); train one with 'titanc tokenizer train'") from None
        self.text = text
        self.hash = _sha256_json(content)
        self._byte_level = (content.get("decoder") or {}).get("type") == "ByteLevel"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot = self._tok.token_to_id(EOT_TOKEN)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text; the library's offset-free batch encoder where it has one."""
        fast = getattr(self._tok, "encode_batch_fast", None)
        batch = fast if fast is not None else self._tok.encode_batch
        return [e.ids for e in batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [t for t in _ids(ids) if 0 <= t < self.vocab_size]
        return self._tok.decode(ids)

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each id stands for; special tokens count 0. Byte-level BPE tokens are
        strings over the 256-character byte alphabet, so their length is their byte count."""
        special = {t.content for t in self._tok.get_added_tokens_decoder().values()
                   if t.special}
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            tok = self._tok.id_to_token(i)
            if tok is None or tok in special:
                continue
            out[i] = len(tok) if self._byte_level else len(self._tok.decode([i]).encode())
        return out

    def __repr__(self) -> str:
        return f"BPETokenizer({self.name!r}, vocab_size={self.vocab_size})"


def _read_text(path: Path, what: str) -> str:
    if not path.exists():
        raise TitancError(f"{what} {path} does not exist; train one with 'titanc tokenizer "
                          f"train CORPUS --vocab-size N -o {path}' or use data.tokenizer: byte")
    if path.is_dir():
        raise TitancError(f"{what} {path} is a directory; pass the tokenizer.json file")
    if not path.is_file():
        raise TitancError(f"{what} {path} is not a regular file; pass the tokenizer.json file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise TitancError(f"{what} {path} is not UTF-8 JSON; pass a tokenizer.json "
                          f"file") from None
    except OSError as exc:
        raise TitancError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None


class StreamDecoder:
    """Incremental decoding for streaming: `push(id)` returns the text that became complete.
    A token that ends inside a multi-byte UTF-8 character is held back until the character
    is whole, so a stream never shows U+FFFD for a character split across tokens."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._pending: list[int] = []

    def push(self, token: int) -> str:
        self._pending.append(int(token))
        text = self.tok.decode(self._pending)
        if text.endswith("\ufffd") and len(self._pending) < 8:
            return ""                               # wait for the rest of the character
        self._pending = []
        return text

    def flush(self) -> str:
        """Whatever is held back (as U+FFFD when it never became a whole character)."""
        text = self.tok.decode(self._pending) if self._pending else ""
        self._pending = []
        return text


# ---------------------------------------------------------------------------------- resolving


def _from_name(name: str) -> Tokenizer:
    return ByteTokenizer() if name == BYTE else BPETokenizer(name)


def _spec_tokenizer(spec_dict: dict[str, Any]) -> str:
    return str((spec_dict.get("data") or {}).get("tokenizer", BYTE))


def _dir_spec(d: Path) -> dict[str, Any] | None:
    """The spec a run directory (spec.yaml / checkpoint) or artifact (manifest.json) holds."""
    import yaml

    if (d / "manifest.json").exists():
        try:
            spec = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        spec = spec.get("spec") if isinstance(spec, dict) else None
        return spec if isinstance(spec, dict) else None
    if (d / "spec.yaml").exists():
        try:
            doc = yaml.safe_load((d / "spec.yaml").read_text())
            return doc if isinstance(doc, dict) else None
        except (OSError, yaml.YAMLError):
            return None
    return None


def load_tokenizer(source: Any = BYTE) -> Tokenizer:
    """The tokenizer `source` names: a Tokenizer (returned as is), a Spec (its
    data.tokenizer), "byte", a tokenizer.json path, a run directory or checkpoint file, or a
    compiled artifact directory (their tokenizer.json, else the tokenizer their spec names)."""
    if isinstance(source, Tokenizer):
        return source
    data = getattr(source, "data", None)
    if data is not None and hasattr(data, "tokenizer"):   # a Spec
        return _from_name(data.tokenizer)
    if isinstance(source, dict):
        return _from_name(_spec_tokenizer(source))
    name = os.fspath(source)
    if name == BYTE:
        return ByteTokenizer()
    p = Path(name)
    if p.suffix == ".safetensors":                 # a checkpoint: its run directory
        p = p.parent
    if p.is_dir():
        if (p / TOKENIZER_FILE).exists():
            return BPETokenizer(p / TOKENIZER_FILE)
        spec = _dir_spec(p)
        if spec is None:
            from titanc.runtime.train.checkpoint import CHECKPOINT_NAME, load_checkpoint
            if (p / CHECKPOINT_NAME).exists():
                spec = load_checkpoint(p / CHECKPOINT_NAME)[1]["spec"]
        if spec is None:
            raise TitancError(f"{p} holds no tokenizer.json and no spec; pass a run directory, "
                              f"an artifact directory or a tokenizer.json file")
        return _from_name(_spec_tokenizer(spec))
    if not p.exists() and p.suffix != ".json":
        raise TitancError(f"load {p}: no such run directory, artifact directory or "
                          f"tokenizer.json")
    return BPETokenizer(p)


def check_vocab(spec: Any, tok: Tokenizer) -> None:
    """model.vocab_size must equal a BPE tokenizer's vocabulary. (The byte tokenizer is checked
    where text is read: synthetic tasks may use a smaller vocabulary.)"""
    v = spec.model.vocab_size
    if not isinstance(tok, ByteTokenizer) and v != tok.vocab_size:
        raise TitancError(f"model.vocab_size: {v} does not match the tokenizer {tok.name} "
                          f"({tok.vocab_size} tokens); set model.vocab_size={tok.vocab_size}")


def check_same_tokenizer(tok: Tokenizer, recorded: str | None, checkpoint: Any) -> None:
    """Resuming must keep the tokenizer: `recorded` is the hash a checkpoint was trained with
    (None for checkpoints older than tokenizers, which were byte-level)."""
    recorded = recorded or ByteTokenizer.hash
    if recorded != tok.hash:
        raise TitancError(f"checkpoint {checkpoint} was trained with another tokenizer (hash "
                          f"{recorded[:12]}) than data.tokenizer {tok.name} (hash "
                          f"{tok.hash[:12]}); resume with the tokenizer the run holds (its "
                          f"tokenizer.json, or byte) or train from scratch")


def save_tokenizer(tok: Tokenizer, directory: str | os.PathLike) -> Path | None:
    """Copy a BPE tokenizer's file into `directory` as tokenizer.json, atomically (the byte
    tokenizer needs no file: an old copy is removed). Returns the path written, or None."""
    dest = Path(directory) / TOKENIZER_FILE
    if not isinstance(tok, BPETokenizer):
        dest.unlink(missing_ok=True)               # a stale copy would shadow the spec's choice
        return None
    if dest.exists() and dest.resolve() == tok.path.resolve():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        shutil.copyfile(tok.path, tmp)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def tokenizer_info(tok: Tokenizer) -> dict[str, Any]:
    """What shard headers and manifests record about a tokenizer."""
    return {"name": tok.name, "kind": "byte" if isinstance(tok, ByteTokenizer) else "bpe",
            "vocab_size": tok.vocab_size, "eot": tok.eot, "hash": tok.hash}


# ---------------------------------------------------------------------------------- training


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | os.PathLike,
              min_frequency: int = 2) -> BPETokenizer:
    """Train a byte-level BPE (GPT-2 style: the 256 byte symbols, then merges; `<|endoftext|>`
    as id 0) on `texts` and write it to `out`. The vocabulary can come out smaller than
    `vocab_size` when the corpus has too few distinct pairs."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from titanc.bounds import VOCAB_SIZE

    VOCAB_SIZE.check(vocab_size, "--vocab-size")
    out = Path(out)
    check_file_target(out, "-o", TOKENIZER_FILE)
    if out.is_file() and not _is_tokenizer_file(out):   # a corpus file, a typo: never lost
        raise TitancError(f"-o {out} already exists and is not a tokenizer.json, so it "
                          f"would be overwritten; choose a new file name such as "
                          f"{out.with_name(TOKENIZER_FILE)} (or remove {out} first)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    seen = [0]
    tok.train_from_iterator(_nonempty(texts, seen), trainer)
    if not seen[0]:
        raise TitancError("the corpus holds no text, so there is nothing to learn merges from; "
                          "pass files with text in them")
    tmp = out.with_name(out.name + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(tmp))
        os.replace(tmp, out)
    except Exception as exc:  # OSError, or the library's own error for a failed write
        with contextlib.suppress(OSError):
            tmp.unlink()
        reason = getattr(exc, "strerror", None) or " ".join(str(exc).split())[:120]
        raise TitancError(f"could not write tokenizer {out}: {reason}; pick a writable path "
                          f"with space for it") from None
    return BPETokenizer(out)


_MAX_TOKENIZER_BYTES = 1 << 30


def _is_tokenizer_file(path: Path) -> bool:
    """Whether `path` holds a tokenizers JSON document (one `train_bpe` may replace)."""
    try:
        if path.stat().st_size > _MAX_TOKENIZER_BYTES:
            return False
        with open(path, "rb") as f:
            if f.read(64).lstrip()[:1] != b"{":
                return False
            f.seek(0)
            doc = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("model"), dict)


def _nonempty(texts: Iterable[str], seen: list[int]) -> Iterator[str]:
    for t in texts:
        if t:
            seen[0] += 1
            yield t
