"""Frequency and presence penalties (runtime/serve/penalties.py), vLLM's and OpenAI's semantics:
logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0) over the tokens
a request generated, per request in the engine's batched decode.

(a) at 0 nothing changes; (b) a large presence penalty under greedy decoding stops a
repetition greedy decoding falls into; (c) a request's tokens are the same alone and next to
a request with other penalties; (d) out of [-2, 2] is a 400 naming the field (and a
TitancError naming it in the Python API). The model is tests/conftest.py's `artifact` (fresh
weights: greedy decoding repeats one token).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from titanc.errors import TitancError
from titanc.runtime.serve.engine import Engine, Request
from titanc.runtime.serve.generate import Generator, Sampling
from titanc.runtime.serve.penalties import penalize
from tests.helpers import generator_and_codec

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def parts(artifact: Path) -> tuple[Generator, Any]:
    return generator_and_codec(artifact)


@pytest.fixture(scope="module")
def engine(parts: Any) -> Engine:
    """One 2-slot engine for the module, driven step by step (a freed slot starts afresh)."""
    return Engine(*parts, slots=2)


def _run(eng: Engine, *reqs: tuple[list[int], Sampling], n: int = 16) -> list[list[int]]:
    """Tokens of each request, all submitted together to the engine."""
    rs = [Request(p, n, s, on_update=lambda u: None) for p, s in reqs]
    eng.submit(rs)
    for _ in range(10 * n):
        if all(r.done for r in rs):
            break
        eng.iterate()
    eng.iterate()                                                  # the slots freed
    assert all(r.finish_reason == "length" for r in rs) and eng.active == 0
    return [r.tokens for r in rs]


def test_the_formula_and_zero_is_unchanged(engine: Engine) -> None:
    logits = torch.zeros(2, 6)
    out = penalize(logits, [[1, 1, 2], []], Sampling(presence_penalty=0.5,
                                                     frequency_penalty=0.25))
    assert out[0].tolist() == [0.0, -1.0, -0.75, 0.0, 0.0, 0.0] and out[1].tolist() == [0.0] * 6
    assert logits.eq(0).all()                                      # not changed in place
    assert penalize(logits, [[1, 1, 2], [3]], Sampling()) is logits
    prompt = list(b"The memory of")
    plain = _run(engine, (prompt, Sampling(0.9, seed=3)))
    zero = _run(engine, (prompt, Sampling(0.9, seed=3, presence_penalty=0.0,
                                         frequency_penalty=0.0)))
    assert plain == zero


def test_a_presence_penalty_stops_greedy_repetition(engine: Engine) -> None:
    prompt = list(b"The memory of")
    greedy = _run(engine, (prompt, Sampling(0.0)))[0]
    assert len(set(greedy)) < len(greedy)                          # greedy repeats
    penalised = _run(engine, (prompt, Sampling(0.0, presence_penalty=2.0)))[0]
    assert len(set(penalised)) == len(penalised)                   # no token twice
    freq = _run(engine, (prompt, Sampling(0.0, frequency_penalty=2.0)))[0]
    assert freq != greedy


def test_a_requests_tokens_do_not_depend_on_its_neighbours_penalties(
        engine: Engine) -> None:
    a = (list(b"The memory of"), Sampling(0.9, seed=7, presence_penalty=1.5,
                                          frequency_penalty=0.5))
    b = (list(b"Once upon"), Sampling(0.0, frequency_penalty=-1.0))
    c = (list(b"x"), Sampling(0.7, seed=2, presence_penalty=-2.0))
    alone = _run(engine, a)[0]
    assert _run(engine, a, b)[0] == alone
    assert _run(engine, c, a)[1] == alone


def test_out_of_range_penalties_are_refused_naming_the_field(parts: Any) -> None:
    from tests.test_serve_chat import MODEL, Live

    for field in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(TitancError, match=field):
            Sampling(**{field: 2.5})
    s = Live(*parts, None)
    try:
        for field in ("presence_penalty", "frequency_penalty"):
            for value in (2.01, -3, "1"):
                with pytest.raises(openai.BadRequestError) as bad:
                    s.client.completions.create(model=MODEL, prompt="a", max_tokens=2,
                                                **{field: value})
                assert bad.value.body["param"] == field, bad.value.body
                assert bad.value.body["message"].startswith(field + ": "), bad.value.body
        ok = s.client.completions.create(model=MODEL, prompt="a", max_tokens=4,
                                         presence_penalty=2.0, frequency_penalty=-2.0)
        assert ok.usage.completion_tokens == 4
    finally:
        s.close()
