"""lm-evaluation-harness with the registered `titanc` model, offline, on tasks this test writes
(YAML over local JSONL): a 4-choice multiple-choice task, a rolling-loglikelihood task and a
generation task. Every score the harness reports equals what titanc's own compiled forward
graph gives (`Program.logprobs` / `Program.logits`, computed here independently of the decode
graphs the model runs): per-choice loglikelihoods, accuracy, bits per byte, greedy text."""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if "HF_DATASETS_CACHE" not in os.environ:        # read at import: one per test process
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="titanc-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], True)
lm_eval = pytest.importorskip("lm_eval")

import titanc  # noqa: E402
import titanc.integrations.lm_eval  # noqa: E402,F401 (registers "titanc")
from titanc.runtime.train.checkpoint import save_checkpoint  # noqa: E402

from tests.helpers import one_thread  # noqa: F401,E402 (autouse)

ROOT = Path(__file__).resolve().parent.parent
# train.batch_size: the rows of every forward-graph call below (one compiled batch)
SETS = {"model.d_model": 32, "model.n_layers": 1, "model.seq_len": 32,
        "model.attention.segment": 16, "model.memory.chunk_size": 8, "train.batch_size": 16,
        "train.dtype": "float64", "compile.target": "cpu"}
MC = [{"question": "2+2=", "choices": ["4", "5", "22", "four"]},
      {"question": "The sky is", "choices": ["blue", "red", "loud", "wet"]},
      {"question": "Cats say", "choices": ["woof", "meow", "moo", "baa"]},
      {"question": "Ice is", "choices": ["hot", "cold", "old", "soft"]},
      {"question": "One, two,", "choices": ["three", "ten", "one", "zero"]}]
ROLLING = [{"text": "Each night the lamp turned."}, {"text": "Grüße aus 東京"}]
GEN = ["ship", "The ", "Q: lamp", "night"]
GEN_TOKENS = 4


def _rows(prog: Any, rows: list[list[int]], output: str) -> torch.Tensor:
    """The compiled forward graph's `output` (logprobs or logits) for rows of ids, each padded
    to seq_len + 1, in calls of train.batch_size rows."""
    T, B = prog.seq_len + 1, prog.batch_size
    assert len(rows) <= B and all(len(r) <= T for r in rows)
    padded = [r + [0] * (T - len(r)) for r in rows] + [[0] * T] * (B - len(rows))
    return getattr(prog, output)(torch.tensor(padded))[:len(rows)]


def _logprobs(prog: Any, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """log p(continuation | context) of each (context, continuation), from the forward graph."""
    lp = _rows(prog, [c + x for c, x in pairs], "logprobs")
    return [float(lp[i, len(c) - 1:len(c) + len(x) - 1].sum()) for i, (c, x) in enumerate(pairs)]


def _greedy(prog: Any, prompts: list[str]) -> list[list[int]]:
    """GEN_TOKENS greedy bytes after each prompt, each the argmax of the forward graph."""
    ids = [list(p.encode()) for p in prompts]
    for _ in range(GEN_TOKENS):
        logits = _rows(prog, ids, "logits")
        ids = [r + [int(logits[i, len(r) - 1].argmax())] for i, r in enumerate(ids)]
    return [r[len(p.encode()):] for r, p in zip(ids, prompts)]


def _task(d: Path, name: str, rows: list[dict[str, Any]], body: str) -> None:
    (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {d / f'{name}.jsonl'}\ntest_split: test\n{body}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A byte-level run (weights moved off their initialisation), what titanc's forward graph
    gives for every request, and tasks whose answers make accuracy 3/5 under those scores
    and whose generation stops at a character the greedy text holds."""
    d = tmp_path_factory.mktemp("lm_eval")
    prog = titanc.compile(ROOT / "examples" / "tiny.yaml", **SETS)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in prog.parameters().values():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    save_checkpoint(d / "run" / "checkpoint.safetensors", prog)
    flat = _logprobs(prog, [(list(doc["question"].encode()), list((" " + c).encode()))
                            for doc in MC[:4] for c in doc["choices"]])
    flat += _logprobs(prog, [(list(MC[4]["question"].encode()), list((" " + c).encode()))
                             for c in MC[4]["choices"]])
    mc = [flat[4 * i:4 * i + 4] for i in range(len(MC))]
    best = [max(range(4), key=lambda i: lls[i]) for lls in mc]
    answers = [b if i % 2 == 0 else (b + 1) % 4 for i, b in enumerate(best)]   # 3 of 5 right
    rolling = _logprobs(prog, [([10], list(doc["text"].encode())) for doc in ROLLING])
    greedy = dict(zip(GEN, _greedy(prog, GEN)))
    # the stop: the first printable ASCII byte past the first of some prompt's greedy output
    stop = next(chr(t) for q in GEN for t in greedy[q][1:] if 33 <= t < 127)
    tasks = d / "tasks"
    tasks.mkdir()
    _task(tasks, "titanc_mc", [{**doc, "answer": a} for doc, a in zip(MC, answers)],
          "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
          "doc_to_choice: '{{choices}}'\ndoc_to_target: answer\nmetric_list:\n"
          "  - metric: acc\n")
    _task(tasks, "titanc_rolling", ROLLING, "output_type: loglikelihood_rolling\n"
          "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
          "  - metric: bits_per_byte\n  - metric: word_perplexity\n")
    _task(tasks, "titanc_gen", [{"question": q, "answer": "x"} for q in GEN],
          f"output_type: generate_until\ndoc_to_text: '{{{{question}}}}'\n"
          f"doc_to_target: '{{{{answer}}}}'\ngeneration_kwargs:\n  until: {json.dumps([stop])}\n"
          f"  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\nmetric_list:\n"
          f"  - metric: exact_match\n")
    return {"run": d / "run", "tasks": tasks, "prog": prog, "mc": mc, "answers": answers,
            "rolling": rolling, "greedy": greedy, "stop": stop}


@pytest.fixture(scope="module")
def results(setup: dict[str, Any]) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model="titanc", model_args=f"run={setup['run']}",
                           tasks=["titanc_mc", "titanc_rolling", "titanc_gen"],
                           task_manager=TaskManager(include_path=str(setup["tasks"]),
                                                    include_defaults=False),
                           log_samples=True, bootstrap_iters=0)


def _by_doc(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(samples, key=lambda s: s["doc_id"])


def test_multiple_choice_scores_equal_titanc_logprobs(setup: dict[str, Any],
                                                     results: dict[str, Any]) -> None:
    samples = _by_doc(results["samples"]["titanc_mc"])
    assert len(samples) == len(MC)
    for want, sample in zip(setup["mc"], samples):
        assert [r[0][0] for r in sample["resps"]] == pytest.approx(want, rel=0, abs=1e-9)
    assert results["results"]["titanc_mc"]["acc,none"] == pytest.approx(3 / 5)


def test_rolling_loglikelihood_equals_titanc_logprobs(setup: dict[str, Any],
                                                      results: dict[str, Any]) -> None:
    samples = _by_doc(results["samples"]["titanc_rolling"])
    got = [s["resps"][0][0] for s in samples]
    assert got == pytest.approx(setup["rolling"], rel=0, abs=1e-9)   # after "\n", a byte
    n_bytes = sum(len(doc["text"].encode()) for doc in ROLLING)      # run's prefix token
    bpb = results["results"]["titanc_rolling"]["bits_per_byte,none"]
    assert bpb == pytest.approx(-sum(setup["rolling"]) / n_bytes / math.log(2), rel=1e-9)


def test_generate_until_is_greedy_text_cut_at_the_stop(setup: dict[str, Any],
                                                       results: dict[str, Any]) -> None:
    stop, cut = setup["stop"], 0
    for q, sample in zip(GEN, _by_doc(results["samples"]["titanc_gen"])):
        text = bytes(setup["greedy"][q]).decode("utf-8", errors="replace")
        cut += stop in text
        assert sample["resps"][0][0] == text.partition(stop)[0]
    assert cut >= 1                                   # the stop string cut some output


def test_model_arguments_are_checked(setup: dict[str, Any]) -> None:
    from titanc.errors import TitancError
    from titanc.integrations.lm_eval import TitancLM

    prog = setup["prog"]
    with pytest.raises(TitancError, match=r"^the titanc lm-eval model needs run=RUN"):
        TitancLM()
    with pytest.raises(TitancError, match=r"^prefix_token: 999 is outside the vocabulary "
                                          r"\[0, 256\); pass prefix_token=ID$"):
        TitancLM(program=prog, prefix_token=999)
    with pytest.raises(TitancError, match=r"^max_gen_toks: 'many' is not an integer; "
                                          r"pass max_gen_toks=N$"):
        TitancLM(program=prog, max_gen_toks="many")
