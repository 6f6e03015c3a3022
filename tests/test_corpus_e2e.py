"""Acceptance tests of real corpora, end to end through the CLI.

1. From the files of a fresh clone: train a 4,096-token byte-level BPE on the repository's own
   text (docs, sources, examples, README), prepare shards with it, train tiny.yaml on them for
   100 steps, evaluate, and generate with the run's own copy of the tokenizer (the original file is deleted first). To keep the test's
   runtime modest, training uses `model.seq_len=32, train.batch_size=2` (tiny.yaml's own sizes
   are 128 and 8); the model itself (widths, layers, memory) is tiny.yaml's.
2. Peak RSS while training on a 1 GiB shard stays far below 1 GiB: the shard is read through
   numpy.memmap, only the sampled windows are touched.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titanc.tools.cli import main
from titanc.runtime.data.tokenizer import ByteTokenizer, tokenizer_info

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.yaml"
# the text a fresh clone holds (directories are walked; __pycache__ and hidden files skipped)
CORPUS = [str(ROOT / d) for d in ("docs", "titanc", "ir", "passes", "codegen", "runtime",
                                  "examples", "benchmarks")] + [str(ROOT / "README.md")]
EXT = "md,py,yaml,jinja"
SMALL = ["--set", "model.seq_len=32", "--set", "train.batch_size=2"]


def test_bpe_prepare_train_eval_generate_from_the_repository(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    tok, shards, run = tmp_path / "tok.json", tmp_path / "shards", tmp_path / "run"

    assert main(["tokenizer", "train", *CORPUS, "--ext", EXT, "--vocab-size", "4096",
                 "-o", str(tok)]) == 0
    assert "byte-level BPE of 4096 tokens" in capsys.readouterr().out

    assert main(["data", "prepare", *CORPUS, "--ext", EXT, "--tokenizer", str(tok),
                 "-o", str(shards), "--no-progress"]) == 0
    header = json.loads((shards / "header.json").read_text())
    assert header["dtype"] == "uint16" and header["tokenizer"]["vocab_size"] == 4096
    assert header["text_bytes"] > 300_000 and len(header["sources"]) > 50
    n_train = header["splits"]["train"]["tokens"]
    assert header["text_bytes"] / n_train > 2.5                 # BPE compresses the bytes
    assert (shards / "train.bin").stat().st_size == 2 * n_train

    sets = [*SMALL, "--set", "model.vocab_size=4096", "--set", f"data.tokenizer={tok}",
            "--set", "train.eval_every=50"]
    assert main(["train", str(TINY), *sets, "--data", str(shards), "--steps", "100",
                 "--out", str(run)]) == 0
    assert (run / "tokenizer.json").exists()
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert len(losses) == 100 and len(evals) == 2
    assert losses[0] > math.log(4096) - 0.5                      # starts near uniform
    # and learns (the corpus is this repository, so the text moves with every change: a
    # clear margin on a 10-step mean of batches of 64 tokens, not a tuned one)
    assert np.mean(losses[-10:]) < losses[0] - 1.0
    capsys.readouterr()
    # resuming under another tokenizer (same vocabulary size) is refused before any step
    assert main(["train", str(TINY), *SMALL, "--set", "model.vocab_size=4096", "--data",
                 "synthetic:recall", "--steps", "110", "--resume", str(run),
                 "--out", str(tmp_path / "run2")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"titanc: error: checkpoint {run / 'checkpoint.safetensors'} was trained with another "
        f"tokenizer (hash {header['tokenizer']['hash'][:12]}) than data.tokenizer byte (hash "
        f"{ByteTokenizer.hash[:12]}); resume with the tokenizer the run holds (its "
        f"tokenizer.json, or byte) or train from scratch")

    tok.unlink()                                                 # the run carries its own copy
    assert main(["eval", str(run), "--data", str(shards), "--batches", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 100 and result["tokens"] == 4 * 2 * 32
    # the corpus is the repository itself, so its text (and these numbers) move with every
    # change: held-out loss clearly below the untrained start, not a fixed value
    assert result["loss"] < losses[0] - 0.75
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    bpb = result["loss"] * result["tokens"] / math.log(2) / result["bytes"]
    assert result["bits_per_byte"] == pytest.approx(bpb) and 0 < bpb < 8

    from titanc.runtime.serve.generate import Generator
    from titanc.runtime.data.tokenizer import load_tokenizer

    seen: list[tuple[list[list[int]], list[int]]] = []
    stream = Generator.stream

    def record(self, prompts, *args, **kwargs):  # noqa: ANN001, ANN202 - a spy
        ids: list[int] = []
        seen.append((prompts, ids))
        for i, tok in stream(self, prompts, *args, **kwargs):
            ids.append(tok)
            yield i, tok

    monkeypatch.setattr(Generator, "stream", record)
    assert main(["generate", str(run), "--prompt", "def load(", "--max-new-tokens", "12",
                 "--temperature", "1", "--seed", "0", "--stream"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    out = out[:-1]                                               # the line end the CLI adds
    bpe = load_tokenizer(run)
    (prompts, ids), = seen
    assert prompts == [bpe.encode("def load(")] and len(prompts[0]) < len("def load(")
    assert len(ids) == 12 and max(ids) >= 256                    # BPE ids, not bytes
    assert out == "def load(" + bpe.decode(ids)                  # streamed, character-whole

    # served over HTTP from the run directory: the same tokenizer, the same greedy text
    assert main(["generate", str(run), "--prompt", "def load(", "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out[:-1]
    from tests.test_serve import Server

    server = Server(run, "--slots", "2")
    try:
        status, _, body = server.post({"prompt": "def load(", "max_tokens": 8,
                                       "temperature": 0})
    finally:
        server.stop()
    assert status == 200 and body["usage"]["prompt_tokens"] == len(bpe.encode("def load("))
    assert "def load(" + body["choices"][0]["text"] == greedy


_RSS_SCRIPT = r"""
import json, resource, sys
import torch
torch.set_num_threads(1)
from titanc.runtime.train.trainer import Trainer
from titanc.model.spec import load_spec
spec, data, out = sys.argv[1:4]

def status(key):  # this process image's own numbers, in bytes (VmHWM: peak RSS)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":")) * 1024

sets = {"model.seq_len": 32, "train.batch_size": 2, "train.eval_every": 10,
        "train.eval_batches": 2}
trainer = Trainer(load_spec(spec, sets), out, data=data, steps=20, progress=False,
                  log=lambda m: None)                       # compiled, shards opened
before = status("VmRSS")
summary = trainer.run()
assert summary["steps"] == 20 and summary["eval_loss"] is not None

def mapped_rss(name):  # resident bytes of the memory maps of the file `name`
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                inside = line.rstrip().endswith(name)
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total

print(json.dumps({"before": before, "peak": status("VmHWM"), "data": trainer.data.description,
                  "shard_rss": mapped_rss(data + "/train.bin")}))
"""


def _shard_dir(path: Path, train_tokens: int, val_tokens: int) -> Path:
    """A byte-tokenizer shard directory; train.bin is sparse apart from its first MiB."""
    path.mkdir()
    rng = np.random.default_rng(0)
    with open(path / "train.bin", "wb") as f:
        f.write(rng.integers(0, 256, 1 << 19, dtype=np.uint16).tobytes())
        f.truncate(2 * train_tokens)
    (path / "val.bin").write_bytes(rng.integers(0, 256, val_tokens, dtype=np.uint16).tobytes())
    header = {"format": "titanc-shards", "version": 1, "dtype": "uint16",
              "tokenizer": tokenizer_info(ByteTokenizer()),
              "splits": {"train": {"file": "train.bin", "tokens": train_tokens},
                         "val": {"file": "val.bin", "tokens": val_tokens}},
              "val_fraction": 0.0, "text_bytes": train_tokens + val_tokens, "sources": []}
    (path / "header.json").write_text(json.dumps(header))
    return path


def test_peak_rss_training_on_a_1gib_shard_stays_far_below_1gib(tmp_path: Path) -> None:
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux /proc to read the peak RSS")
    big = _shard_dir(tmp_path / "big", 1 << 29, 1 << 16)         # 2^29 uint16 = 1 GiB
    assert (big / "train.bin").stat().st_size == 1 << 30
    try:
        r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(TINY), str(big),
                            str(tmp_path / "run")], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        (big / "train.bin").unlink()
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert "536,936,448 uint16 tokens" in got["data"]              # the whole 1 GiB is the set
    mib = 1 << 20
    print(f"RSS before training {got['before'] / mib:.1f} MiB, peak while training on the "
          f"1 GiB shard {got['peak'] / mib:.1f} MiB, resident pages of the shard "
          f"{got['shard_rss'] / 1024:.0f} KiB")
    # the whole process (model, program, opened shards) stays far below the shard's size,
    # and of the shard itself only the sampled windows' pages were ever read
    assert got["peak"] < 512 * mib, got
    assert got["shard_rss"] < 16 * mib, got
