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

import titanc
from titanc.errors import TitancError
from titanc.runtime.serve.codec import codec_for
from titanc.runtime.serve.engine import Engine, Request
from titanc.runtime.serve.generate import Generator, Sampling
from titanc.runtime.serve.penalties import penalize

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def parts(artifact: Path) -> tuple[Generator, Any]:
    prog = titanc.load(artifact)
    codec = codec_for(prog, artifact)
    return Generator(prog, codec.tok), codec


def _run(parts: Any, *reqs: tuple[list[int], Sampling], n: int = 24) -> list[list[int]]:
    """Tokens of each request, all submitted together to one 2-slot engine."""
    gen, codec = parts
    eng = Engine(gen, codec, slots=2)
    rs = [Request(p, n, s, on_update=lambda u: None) for p, s in reqs]
    eng.submit(rs)
    for _ in range(10 * n):
        if all(r.done for r in rs):
            break
        eng.iterate()
    assert all(r.finish_reason == "length" for r in rs)
    return [r.tokens for r in rs]


def test_the_formula_and_zero_is_unchanged(parts: Any) -> None:
    logits = torch.zeros(2, 6)
    out = penalize(logits, [[1, 1, 2], []], Sampling(presence_penalty=0.5,
                                                     frequency_penalty=0.25))
    assert out[0].tolist() == [0.0, -1.0, -0.75, 0.0, 0.0, 0.0] and out[1].tolist() == [0.0] * 6
    assert logits.eq(0).all()                                      # not changed in place
    assert penalize(logits, [[1, 1, 2], [3]], Sampling()) is logits
    prompt = list(b"The memory of")
    plain = _run(parts, (prompt, Sampling(0.9, seed=3)))
    zero = _run(parts, (prompt, Sampling(0.9, seed=3, presence_penalty=0.0,
                                         frequency_penalty=0.0)))
    assert plain == zero


def test_a_presence_penalty_stops_greedy_repetition(parts: Any) -> None:
    prompt = list(b"The memory of")
    greedy = _run(parts, (prompt, Sampling(0.0)))[0]
    assert len(set(greedy)) < len(greedy)                          # greedy repeats
    penalised = _run(parts, (prompt, Sampling(0.0, presence_penalty=2.0)))[0]
    assert len(set(penalised)) == len(penalised)                   # no token twice
    freq = _run(parts, (prompt, Sampling(0.0, frequency_penalty=2.0)))[0]
    assert freq != greedy


def test_a_requests_tokens_do_not_depend_on_its_neighbours_penalties(parts: Any) -> None:
    a = (list(b"The memory of"), Sampling(0.9, seed=7, presence_penalty=1.5,
                                          frequency_penalty=0.5))
    b = (list(b"Once upon"), Sampling(0.0, frequency_penalty=-1.0))
    c = (list(b"x"), Sampling(0.7, seed=2, presence_penalty=-2.0))
    alone = _run(parts, a)[0]
    assert _run(parts, a, b)[0] == alone
    assert _run(parts, c, a)[1] == alone


def test_out_of_range_penalties_are_refused_naming_the_field(artifact: Path) -> None:
    from tests.test_serve_chat import MODEL, Live

    for field in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(TitancError, match=field):
            Sampling(**{field: 2.5})
    prog = titanc.load(artifact)
    codec = codec_for(prog, artifact)
    s = Live(Generator(prog, codec.tok), codec, None)
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
