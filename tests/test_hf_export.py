"""`titanc export RUN --hf DIR` and the directory it writes, loaded with `transformers` on CPU
(offline): `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` gives the same
next-token log-probabilities as titanc's own program (float32, 1e-5) and the same greedy tokens
as `titanc generate`; the weights file holds the parameters only; rows with padding match
their solo runs; a weight edited in the HF module reaches the compiled program;
save_pretrained writes a directory that loads back to the same logits."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# transformers copies a directory's remote code under HF_MODULES_CACHE (read at import): one
# per test process, not the user's ~/.cache, where parallel workers would share a name
if "HF_MODULES_CACHE" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="titanc-hf-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], True)
transformers = pytest.importorskip("transformers")

import titanc  # noqa: E402
from titanc.integrations.hf_export import byte_tokenizer_json, unstack  # noqa: E402
from titanc.runtime.data.tokenizer import train_bpe  # noqa: E402
from titanc.runtime.serve.generate import Generator, Sampling  # noqa: E402
from titanc.runtime.train.checkpoint import save_checkpoint  # noqa: E402
from titanc.tools.cli import main  # noqa: E402

from tests.helpers import one_thread  # noqa: F401,E402 (autouse)

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("The old lighthouse keeper counted the ships. Grüße aus 東京 — naïve café.\n"
        "Each night the lamp turned, and each night the sea answered.\n") * 20
SETS = {"model.d_model": 32, "model.n_layers": 1, "model.seq_len": 32,
        "model.attention.segment": 16, "model.memory.chunk_size": 8, "train.batch_size": 2,
        "train.dtype": "float32", "compile.target": "cpu"}
PROMPTS = ["Each night the lamp", "The old keeper counted the ships of the sea. Each night"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory of a tiny MAC model over a BPE tokenizer, its weights moved off their
    initialisation (a load that silently kept fresh weights would match nothing)."""
    d = tmp_path_factory.mktemp("hf")
    tok = train_bpe([TEXT], 300, d / "tok.json")
    prog = titanc.compile(ROOT / "examples" / "tiny.yaml",
                          **{**SETS, "model.vocab_size": tok.vocab_size})
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in prog.parameters().values():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    save_checkpoint(d / "run" / "checkpoint.safetensors", prog,
                    extra={"tokenizer_hash": tok.hash})
    shutil.copyfile(d / "tok.json", d / "run" / "tokenizer.json")
    return d / "run"


@pytest.fixture(scope="module")
def exported(run: Path) -> Path:
    out = run.parent / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def hf(exported: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    return model, tok


@pytest.fixture(scope="module")
def titanc_gen(run: Path) -> Generator:
    from titanc.runtime.train.rundir import run_tokenizer
    return Generator(titanc.load(run), run_tokenizer(run))


def test_directory_holds_weights_only_config_and_tokenizer(run: Path, exported: Path) -> None:
    from safetensors.torch import load_file

    from titanc.runtime.train.checkpoint import load_checkpoint

    assert sorted(os.listdir(exported)) == [
        "config.json", "configuration_titanc.py", "model.safetensors", "modeling_titanc.py",
        "tokenizer.json", "tokenizer_config.json"]
    tensors, meta = load_checkpoint(run / "checkpoint.safetensors")
    weights = load_file(exported / "model.safetensors")
    want = unstack({k[len("param."):]: t for k, t in tensors.items() if k.startswith("param.")})
    assert sorted(weights) == sorted(want) and "model.layers.0.attn_wq" in weights
    assert all(torch.equal(weights[k], want[k]) for k in want)     # no opt.* / rng entries
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "titanc" and config["auto_map"] == {
        "AutoConfig": "configuration_titanc.TitancConfig",
        "AutoModelForCausalLM": "modeling_titanc.TitancForCausalLM"}
    assert titanc.load_spec(config["titanc_spec"]) == titanc.load_spec(meta["spec"])
    assert (exported / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()
    # the code files are constants: no value of the spec reaches them
    code = (exported / "modeling_titanc.py").read_text()
    assert "tiny" not in code and "from titanc.integrations.hf_modeling import" in code


def test_logprobs_equal_titanc_program(hf: tuple[Any, Any], titanc_gen: Generator) -> None:
    model, tok = hf
    for text in PROMPTS:
        ids = tok.encode(text)
        assert ids == titanc_gen.tokenizer.encode(text)
        got = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        _, logits = titanc_gen.prefill(ids)                          # titanc generate's path
        torch.testing.assert_close(got, torch.log_softmax(logits[0].double(), -1),
                                   rtol=0, atol=1e-5)
        if len(ids) <= 32:                                          # the compiled forward graph
            full = torch.tensor([ids + [0] * (33 - len(ids))])
            lp = titanc_gen.prog.logprobs(full)[0, :len(ids) - 1].double()
            torch.testing.assert_close(got[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0],
                                       lp, rtol=0, atol=1e-5)


def test_greedy_generate_equals_titanc_generate(hf: tuple[Any, Any], titanc_gen: Generator,
                                                run: Path, capsys: pytest.CaptureFixture) -> None:
    model, tok = hf
    text = PROMPTS[0]
    ids = tok.encode(text)
    gen = model.titanc_generator
    fed: list[int] = []
    prefill = gen.prefill
    gen.prefill = lambda prompt, state=None: (fed.append(len(prompt)), prefill(prompt, state))[1]
    try:
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    finally:
        del gen.prefill
    new = out[0, len(ids):].tolist()
    # each step runs only its new token (the prompt once, unless a forward already ran it)
    assert fed[-7:] == [1] * 7 and fed[:-7] in ([], [len(ids)])
    assert new == titanc_gen.generate([ids], 8, Sampling(temperature=0))[0]
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", text, "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == text + tok.decode(new) + "\n"


def test_padded_batch_rows_equal_their_solo_runs(hf: tuple[Any, Any],
                                                 titanc_gen: Generator) -> None:
    model, tok = hf
    rows = [tok.encode(t) for t in PROMPTS]
    T = max(map(len, rows))
    ids = torch.zeros(2, T, dtype=torch.int64)
    mask = torch.zeros(2, T, dtype=torch.int64)
    for b, r in enumerate(rows):                                    # left padding
        ids[b, T - len(r):] = torch.tensor(r)
        mask[b, T - len(r):] = 1
    logits = model(ids, attention_mask=mask).logits
    for b, r in enumerate(rows):
        _, want = titanc_gen.prefill(r)
        torch.testing.assert_close(logits[b, T - len(r):], want[0], rtol=0, atol=1e-5)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                         pad_token_id=tok.pad_token_id or 0)
    for b, r in enumerate(rows):
        assert out[b, T:].tolist() == titanc_gen.generate([r], 5, Sampling(temperature=0))[0]


def test_an_edited_weight_reaches_the_program(hf: tuple[Any, Any]) -> None:
    model, tok = hf
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    before = model(ids).logits.clone()
    norm = model.get_parameter("model.norm_f")
    with torch.no_grad():
        norm.mul_(2.0)
    try:
        after = model(ids).logits
        assert not torch.allclose(before, after)
        assert torch.equal(model.titanc_program.parameters()["norm_f"], norm.detach())
    finally:
        with torch.no_grad():
            norm.div_(2.0)
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=1e-6)


def test_save_pretrained_round_trip(hf: tuple[Any, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, tok = hf
    ids = torch.tensor([tok.encode(PROMPTS[1])])
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", trust_remote_code=True)
    assert torch.equal(again(ids).logits, model(ids).logits)


def test_byte_runs_export_a_tokenizer_of_utf8_bytes() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(byte_tokenizer_json()))
    text = "Grüße aus 東京 🚀\n\ttabs  and spaces"
    assert tok.encode(text).ids == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text
    assert tok.get_vocab_size() == 256


def test_export_errors_are_one_line(run: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    cases = [
        ([str(tmp_path / "nope"), "--hf", str(tmp_path / "o")],
         f"titanc: error: RUN {tmp_path / 'nope'}: no such run directory or checkpoint file"),
        ([str(run), "--hf", str(tmp_path / "taken")],
         f"titanc: error: --hf {tmp_path / 'taken'} is not empty and holds no titanc export; "
         f"name a new or empty directory"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err
        assert err == message + "\n", err
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
