"""`titanc eval RUN --data DIR`: held-out loss, perplexity, bits per byte (and recall accuracy).

    result = evaluate_run("runs/wiki", "data/wiki", batches=8)
    # {"loss": 2.91, "perplexity": 18.4, "bits_per_byte": 1.12, "tokens": 8192, ...}

The windows are fixed, not sampled: `batches x train.batch_size` windows of seq_len + 1 tokens
with evenly spaced starts over the whole split (disjoint when the split is long enough), so two
evaluations of the same run and data agree exactly. A run trained with `data.documents` is
scored as it trained: the windows carry their document starts and loss mask, and under
`data.pack: false` each row is one document (evenly spaced over the split's documents) from
its first token, padding masked; only the targets the mask keeps count, in the loss, the
token count and the bytes. Loss is the mean next-token cross-entropy in
nats; perplexity is exp(loss); bits per byte is the summed loss over ln 2 divided by the UTF-8
bytes the target tokens stand for (`Tokenizer.token_bytes`), comparable across tokenizers.
`recall=True` adds the synthetic associative-recall accuracy (runtime/data/datasets.py) over as many
batches; `--data synthetic:recall` evaluates on that task alone.

`titanc eval RUN --task recall --distances 8,64,256` (`evaluate_recall`) scores recall against
the pair -> query distance: for each distance the run's weights are loaded into the same spec at
the shortest seq_len that holds it (a multiple of the memory chunk, and of the segment for mac)
and scored on `batches x train.batch_size` held-out sequences whose first query key sits exactly
that many positions after the last pair's value.
"""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from titanc.errors import TitancError

from titanc.runtime.data.datasets import SYNTHETIC_RECALL, SyntheticRecall, TextData
from titanc.runtime.data.shards import ShardData
from titanc.runtime.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from titanc.runtime.train.rundir import run_tokenizer

__all__ = ["evaluate", "evaluate_run", "evaluate_recall", "open_eval_data", "recall_seq_len"]

RECALL_SEED = 1_000_003


EvalData = ShardData | TextData | SyntheticRecall


def open_eval_data(source: str, spec: Any, tok: Tokenizer) -> EvalData:
    """The dataset `--data` names for a model of `spec` read with `tok`."""
    m = spec.model
    if source == SYNTHETIC_RECALL:
        return SyntheticRecall(m.seq_len, m.vocab_size, spec.train.seed)
    if os.path.isdir(source):
        return ShardData(source, m.seq_len, m.vocab_size, tokenizer=tok, seed=spec.train.seed)
    _check_text_source(source, tok)
    return TextData(source, m.seq_len, spec.data.val_fraction, spec.train.seed)


def _check_text_source(source: str, tok: Tokenizer) -> None:
    """A text file is read as bytes: only a byte-tokenizer run can be evaluated on one."""
    if (source != SYNTHETIC_RECALL and os.path.isfile(source)
            and not isinstance(tok, ByteTokenizer)):
        raise TitancError(f"--data {source} is a text file, but the run uses the tokenizer "
                          f"{tok.name}; prepare shards with 'titanc data prepare {source} -o DIR "
                          f"--tokenizer {tok.name}' and pass --data DIR")


def _split_tokens(data: ShardData | TextData, split: str) -> Any:
    if isinstance(data, ShardData):
        return data.split_array(split)
    return data.split_tokens(split).numpy()


def _windows(tokens: Any, seq_len: int, count: int) -> np.ndarray:
    """`count` evenly spaced window starts over `tokens` (each window seq_len + 1 tokens)."""
    last = len(tokens) - (seq_len + 1)
    return np.linspace(0, last, count).round().astype(np.int64)


def evaluate(prog: Any, data: EvalData, tok: Tokenizer, *,
             batches: int = 8, split: str = "val", recall: bool = False) -> dict[str, Any]:
    """Evaluate `prog` on `data` (see the module docstring); returns the result dict."""
    spec = prog.spec
    B, T = spec.train.batch_size, spec.model.seq_len
    out: dict[str, Any] = {"split": split, "batches": batches, "batch_size": B, "seq_len": T}
    if isinstance(data, SyntheticRecall):
        recall = True
    else:
        tokens = _split_tokens(data, split)
        if len(tokens) < T + 1:
            where = getattr(data, "path", None) or data.directory
            fix = ("a larger --val-fraction when preparing it" if isinstance(data, ShardData)
                   else "a larger data.val_fraction, or --split train")
            raise TitancError(f"the {split} split of {where} has {len(tokens)} tokens, fewer "
                              f"than one window of model.seq_len+1 = {T + 1}; use more data or "
                              f"{fix}")
        documents = isinstance(data, ShardData) and spec.data.documents
        per_doc = documents and not spec.data.pack
        if per_doc:       # data.pack: false trained one document per row: score it so
            n_docs = len(data.doc_starts(split))
            starts = np.linspace(0, n_docs - 1, batches * B).round().astype(np.int64)
        else:
            starts = _windows(tokens, T, batches * B)
        nbytes = tok.token_bytes()
        loss_sum, n_tok, n_bytes = 0.0, 0, 0
        for b in range(batches):
            idx = starts[b * B:(b + 1) * B]
            docs = None
            if per_doc:
                rows, docs = data.document_rows(split, idx)
            elif isinstance(data, ShardData):
                rows = data.windows(split, idx)
                if documents:                  # the windows' document starts and loss mask
                    docs = data.window_documents(split, idx)
            else:
                rows = torch.from_numpy(tokens[idx[:, None] + np.arange(T + 1)].astype(np.int64))
            target_bytes = nbytes[np.clip(rows[:, 1:].numpy(), 0, len(nbytes) - 1)]
            if docs is None:
                kept = B * T
                loss_sum += prog.loss(rows) * kept
            else:                              # the program's loss is the mean over the
                mask = docs["loss_mask"].numpy() > 0       # targets the mask keeps
                kept = int(mask.sum())
                target_bytes = target_bytes[mask]
                if kept:
                    loss_sum += prog.loss(rows, docs) * kept
            n_tok += kept
            n_bytes += int(target_bytes.sum())
        if n_tok == 0:
            raise TitancError(f"the {split} split's evaluated rows hold no target to score "
                              f"(every document is one token long); use more data")
        loss = loss_sum / n_tok
        out.update(tokens=n_tok, bytes=n_bytes, loss=loss, perplexity=math.exp(min(loss, 700)),
                   bits_per_byte=loss_sum / math.log(2) / max(n_bytes, 1))
    if recall:
        task = (data if isinstance(data, SyntheticRecall)
                else SyntheticRecall(T, spec.model.vocab_size, spec.train.seed))
        gen = torch.Generator().manual_seed(spec.train.seed + RECALL_SEED)
        losses, accs = [], []
        for _ in range(batches):
            rows = task.batch(B, "val", gen)
            losses.append(prog.loss(rows))
            accs.append(task.accuracy(prog, rows))
        out["recall_loss"] = sum(losses) / batches
        out["recall_accuracy"] = sum(accs) / batches
        out["recall_chance"] = task.chance
        if isinstance(data, SyntheticRecall):
            out.update(loss=out["recall_loss"], perplexity=math.exp(min(out["recall_loss"], 700)))
    return out


def evaluate_run(run: str | os.PathLike, data: str, *, batches: int = 8, split: str = "val",
                 recall: bool = False) -> dict[str, Any]:
    """Load RUN (run directory, checkpoint or artifact) and its tokenizer; evaluate on `data`."""
    import titanc

    tok = run_tokenizer(run)                       # checked against the checkpoint's record
    _check_text_source(os.fspath(data), tok)       # before paying for a compile
    from titanc.runtime.train.shard_source import check_eval_shards
    check_eval_shards(os.fspath(data), tok, os.fspath(run))
    prog = titanc.load(run)
    dataset = open_eval_data(os.fspath(data), prog.spec, tok)
    result = evaluate(prog, dataset, tok, batches=batches, split=split, recall=recall)
    return {"run": os.fspath(run), "data": os.fspath(data), "step": prog.step,
            "tokenizer": tok.name, **result}


def recall_seq_len(spec: Any, distance: int, n_pairs: int, n_queries: int) -> int:
    """The shortest seq_len valid for `spec` whose recall sequences reach `distance`."""
    m = spec.model
    align = 1
    if m.block == "mac":
        align = m.attention.segment
    elif m.has_memory:
        align = m.memory.chunk_size
    need = distance + 2 * (n_pairs + n_queries) - 2
    return align * math.ceil(need / align)


def evaluate_recall(run: str | os.PathLike, distances: list[int], *, batches: int = 8,
                    task: dict[str, int] | None = None) -> dict[str, Any]:
    """Recall accuracy of RUN at each pair -> query distance (see the module docstring).
    `task`: SyntheticRecall options (n_pairs, n_queries, n_keys, n_values, filler_tokens);
    the defaults are those of data.source synthetic:recall."""
    import titanc

    task = dict(task or {})
    run_tokenizer(run)                             # the run's files belong together
    prog = titanc.load(run)
    spec = prog.spec
    V, B = spec.model.vocab_size, spec.train.batch_size
    probe = SyntheticRecall(max(spec.model.seq_len, 16), V, **task)   # validates the options
    lay = probe.layout
    acc: dict[str, float] = {}
    for d in distances:
        if d < 1:
            raise TitancError(f"--distances: {d} must be >= 1")
        T = recall_seq_len(spec, d, lay.n_pairs, lay.n_queries)
        ev = prog if T == spec.model.seq_len else titanc.load(run, **{"model.seq_len": T})
        data = SyntheticRecall(T, V, spec.train.seed, **task)
        gen = torch.Generator().manual_seed(spec.train.seed + RECALL_SEED)
        accs = [data.accuracy(ev, data.batch(B, "val", gen, distance=d)) for _ in range(batches)]
        acc[str(d)] = sum(accs) / batches
    window = spec.model.attention.window if spec.model.block != "lmm" else None
    return {"run": os.fspath(run), "task": "recall", "step": prog.step, "block": spec.model.block,
            "sequences": batches * B, "n_pairs": lay.n_pairs, "n_queries": lay.n_queries,
            "chance": probe.chance, "attention_window": window, "accuracy_by_distance": acc}
