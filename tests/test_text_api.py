"""Text in, text out (titanc/integrations/text.py): a run's model with its own tokenizer. The
continuation equals `Generator`'s on the encoded prompt and `titanc generate`'s printed text,
streamed pieces join to it, `score` equals the compiled forward graph's logprobs, and text
where ids are expected (or ids where text is) is one TitancError."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import titanc
from titanc.errors import TitancError
from titanc.integrations.text import TextGenerator
from titanc.runtime.data.tokenizer import train_bpe
from titanc.runtime.serve.generate import Sampling
from titanc.runtime.train.checkpoint import save_checkpoint
from titanc.tools.cli import main

from tests.helpers import one_thread  # noqa: F401 (autouse)

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("The old lighthouse keeper counted the ships. Grüße aus 東京 — naïve café.\n"
        "Each night the lamp turned, and each night the sea answered.\n") * 20
SETS = {"model.d_model": 32, "model.n_layers": 1, "model.seq_len": 32,
        "model.attention.segment": 16, "model.memory.chunk_size": 8, "train.batch_size": 1,
        "train.dtype": "float64", "compile.target": "cpu"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("text")
    tok = train_bpe([TEXT], 300, d / "tok.json")
    prog = titanc.compile(ROOT / "examples" / "tiny.yaml",
                          **{**SETS, "model.vocab_size": tok.vocab_size})
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in prog.parameters().values():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    save_checkpoint(d / "run" / "checkpoint.safetensors", prog,
                    extra={"tokenizer_hash": tok.hash})
    shutil.copyfile(d / "tok.json", d / "run" / "tokenizer.json")
    return d / "run"


@pytest.fixture(scope="module")
def tg(run: Path) -> TextGenerator:
    return TextGenerator(run)


def test_generate_equals_generator_and_the_cli(tg: TextGenerator, run: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    prompt = "Each night the"
    text = tg.generate(prompt, 8, temperature=0)
    ids = tg.tokenizer.encode(prompt)
    assert text == tg.tokenizer.decode(tg.generator.generate([ids], 8, Sampling(0))[0])
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", prompt, "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == prompt + text + "\n"
    assert tg.generate([prompt, "The old"], 8, Sampling(0)) == [
        text, tg.generate("The old", 8, temperature=0)]
    assert "".join(tg.stream(prompt, 8, temperature=0)) == text


def test_score_equals_the_forward_graph(tg: TextGenerator) -> None:
    context, continuation = "The old lighthouse", " keeper counted"
    whole = tg.tokenizer.encode(context + continuation)
    n = len(tg.tokenizer.encode(context))
    T = tg.program.seq_len + 1
    lp = tg.program.logprobs(torch.tensor([whole + [0] * (T - len(whole))]))[0]
    assert tg.score(context, continuation) == pytest.approx(
        float(lp[n - 1:len(whole) - 1].sum()), rel=0, abs=1e-9)


def test_wrong_input_is_one_error(tg: TextGenerator) -> None:
    cases = [
        (lambda: tg.generate([[1, 2]], 4), r"^prompt: expected text \(a str\), got list; "
                                           r"Generator takes token ids$"),
        (lambda: tg.generate("", 4), r"^prompt: '' encodes to no tokens; give some text$"),
        (lambda: tg.generate("a\udc80", 4), r"^prompt: .* is not valid Unicode"),
        (lambda: tg.generate("a", 4, temprature=0), r"^unknown sampling field 'temprature'"),
        (lambda: tg.generate(b"a", 4), r"^prompts: expected a str or a non-empty list of str"),
    ]
    for call, message in cases:
        with pytest.raises(TitancError, match=message):
            call()
