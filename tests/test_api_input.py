"""The Python API (`titanc.compile`, `titanc.load`, `Program`, `Generator`, `Sampling`) under
bad input and odd use: one clear error naming the argument, never a deep torch error, a hang
or a silently wrong result."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import titanc
from tests.helpers import TINY, tokens
from tests.test_trainer import tiny
from titanc.errors import SpecError, TitancError
from titanc.runtime.serve.generate import Generator, Sampling, sample

SMALL = {"model.n_layers": 1, "compile.target": "cpu"}


def small(**over: Any) -> Any:
    return titanc.compile(TINY, **{**SMALL, **over})


@pytest.fixture(scope="module")
def prog() -> Any:
    return small()


@pytest.fixture(scope="module")
def gen(prog: Any) -> Generator:
    return Generator(prog)


# -- Program: results and threads ----------------------------------------------------------------

@pytest.mark.parametrize("method", ["logits", "logprobs"])
def test_a_result_survives_the_next_call(prog: Any, method: str) -> None:
    """logits / logprobs were views of the executor's buffer: the next call overwrote them."""
    a, b = tokens(prog.spec, seed=1), tokens(prog.spec, seed=2)
    first = getattr(prog, method)(a)
    want = first.clone()
    getattr(prog, method)(b)
    assert torch.equal(first, want)


def test_one_program_from_two_threads_gives_each_its_own_results(prog: Any) -> None:
    a, b = tokens(prog.spec, seed=1), tokens(prog.spec, seed=2)
    want = {0: prog.logprobs(a), 1: prog.logprobs(b)}
    wrong, errors = [0], []

    def run(i: int, toks: torch.Tensor) -> None:
        try:
            for _ in range(60):
                wrong[0] += not torch.equal(prog.logprobs(toks), want[i])
        except Exception as exc:               # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(0, a)), threading.Thread(target=run, args=(1, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and wrong[0] == 0


# -- Program: tokens --------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["loss", "logprobs", "grads", "train_step"])
def test_tokens_on_the_meta_device_are_refused(prog: Any, method: str) -> None:
    toks = tokens(prog.spec).to("meta")
    with pytest.raises(TitancError, match="tokens is a tensor on the meta device"):
        getattr(prog, method)(toks)


@pytest.mark.parametrize("method", ["loss", "logits", "logprobs", "grads"])
def test_an_empty_batch_is_refused(prog: Any, method: str) -> None:
    toks = torch.zeros(0, prog.seq_len + 1, dtype=torch.int64)
    with pytest.raises(TitancError, match=r"tokens must be int64 \[batch >= 1"):
        getattr(prog, method)(toks)


def test_document_inputs_must_be_a_mapping_of_tensors() -> None:
    p = small(**{"data.documents": True})
    toks = tokens(p.spec)
    mask = torch.ones(toks.shape[0], p.seq_len)
    with pytest.raises(TypeError, match=r"docs\['loss_mask'\] must be a torch.Tensor"):
        p.loss(toks, {"loss_mask": mask.numpy()})
    with pytest.raises(TypeError, match="docs must be a mapping"):
        p.loss(toks, [mask])
    with pytest.raises(TitancError, match="loss_mask must be a real tensor"):
        p.loss(toks, {"loss_mask": mask.to("meta")})


# -- Program: the learning-rate schedule ------------------------------------------------------

def test_a_long_schedule_keeps_a_bounded_lr_table() -> None:
    """The lr table held every step of train.steps: 10**12 steps (what --steps admits) never
    finished building it."""
    from titanc.runtime.lr_schedule import LR_WINDOW, lr_at

    p = small(**{"train.steps": 10**6, "train.warmup": 10})
    assert p.stepper.lr_table.table.numel() <= LR_WINDOW
    toks = tokens(p.spec)
    for step in (10**6 - 3, 10**6 + 5):           # near the end and past it
        p.load_state_dict({"opt.step": step}, strict=False)
        p.train_step(toks)
        want = lr_at(min(step, 10**6), p.spec.train)
        assert float(p.stepper.scalars["lr"]) == pytest.approx(want, rel=1e-12)


def test_a_moving_lr_window_trains_as_the_whole_table(monkeypatch: pytest.MonkeyPatch) -> None:
    import titanc.runtime.lr_schedule as lr_schedule

    over = {"train.steps": 10, "train.warmup": 3}
    whole = small(**over)
    monkeypatch.setattr(lr_schedule, "LR_WINDOW", 4)
    windowed = small(**over)
    assert windowed.stepper.lr_table.table.numel() == 4
    toks = tokens(whole.spec)
    for _ in range(13):                           # past the schedule's end
        assert windowed.train_step(toks) == whole.train_step(toks)
    for k, t in whole.parameters().items():
        assert torch.equal(windowed.parameters()[k], t), k


# -- Program: state dicts ---------------------------------------------------------------------

@pytest.mark.parametrize("bad, error, match", [
    (lambda sd: None, TypeError, "state_dict must be a mapping"),
    (lambda sd: list(sd), TypeError, "state_dict must be a mapping"),
    (lambda sd: {**sd, "param.embed": sd["param.embed"].numpy()}, TypeError,
     r"state_dict\['param.embed'\] must be a torch.Tensor"),
    (lambda sd: {**sd, "param.embed": sd["param.embed"].to("meta")}, TitancError,
     r"state_dict\['param.embed'\] is on the meta device"),
    (lambda sd: {**sd, "param.embed": sd["param.embed"].long()}, TitancError,
     "param.embed is torch.int64"),
    (lambda sd: {**sd, "param.embed": sd["param.embed"] > 0}, TitancError,
     "param.embed is torch.bool"),
    (lambda sd: {**sd, "opt.m.embed": torch.full_like(sd["opt.m.embed"], float("nan"))},
     TitancError, "opt.m.embed holds a NaN"),
    (lambda sd: {**sd, "opt.step": torch.tensor(-5)}, TitancError, "opt.step must be one integer"),
    (lambda sd: {**sd, "opt.step": torch.tensor(2.5)}, TitancError, "opt.step must be one integer"),
    (lambda sd: {**sd, "opt.step": torch.tensor([1, 2])}, TitancError,
     "opt.step must be one integer"),
])
def test_load_state_dict_refuses_bad_state_before_copying(bad: Any, error: type, match: str) -> None:
    src, dst = small(), small()
    src.train_step(tokens(src.spec))
    before = {k: t.clone() for k, t in dst.state_dict().items()}
    sd = {k: t.clone() for k, t in src.state_dict().items()}
    with pytest.raises(error, match=match):
        dst.load_state_dict(bad(sd))
    assert dst.step == 0
    for k, t in dst.state_dict().items():
        assert torch.equal(t, before[k]), k


def test_mixed_unknown_keys_are_named(prog: Any) -> None:
    with pytest.raises(TitancError, match="unexpected"):
        prog.load_state_dict({**prog.state_dict(), 5: torch.zeros(1), "x": torch.zeros(1)})


def test_state_dict_of_sharded_moments_is_a_titanc_error() -> None:
    p = small()
    p.bind_moments(None, None)
    with pytest.raises(TitancError, match="sharded"):
        p.state_dict()


# -- titanc.load ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [None, 5, b"runs/x"])
def test_load_of_a_non_path_names_the_argument(path: Any) -> None:
    with pytest.raises(TypeError, match="titanc.load: path must be a str or os.PathLike"):
        titanc.load(path)


def test_load_of_an_empty_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TitancError, match="path is empty"):
        titanc.load("")


def test_load_of_a_spec_file_points_at_compile(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: t\n")
    with pytest.raises(TitancError, match=r"is a spec or metadata file.*titanc.compile"):
        titanc.load(spec)


def test_load_of_an_artifact_with_an_invalid_spec_names_its_manifest(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"spec": {"model": {"d_model": 8}}}))
    with pytest.raises(SpecError, match=r"manifest.json: its spec is invalid"):
        titanc.load(tmp_path)


# -- Sampling ---------------------------------------------------------------------------------

def test_sampling_takes_numpy_numbers() -> None:
    s = Sampling(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float32(0.5),
                 seed=np.uint64(7))
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.5, 3, 0.5, 7)
    assert type(s.top_k) is int and type(s.seed) is int and type(s.temperature) is float


def test_a_stop_string_is_one_stop_sequence() -> None:
    """A str is a Sequence[str] of its characters: stop="ab" stopped at "a" or at "b"."""
    assert Sampling(stop="ab").stop == ("ab",)
    assert Sampling(stop=None).stop == ()
    assert Sampling(stop=["x", "yz"]).stop == ("x", "yz")


@pytest.mark.parametrize("stop", [[1], [b"a"], ["\ud800"], 5])
def test_bad_stop_sequences_are_named(stop: Any) -> None:
    with pytest.raises(TitancError, match="^stop: "):
        Sampling(stop=stop)


def test_a_tiny_temperature_samples_the_argmax() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]], dtype=torch.float64)
    for t in (1e-310, 5e-324, 1e-200):
        got = sample(logits, Sampling(temperature=t), torch.Generator().manual_seed(0))
        assert got.tolist() == [1]


# -- Generator --------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts, match", [
    ([1, 2, 3], "flat list of token ids"),
    (torch.tensor([1, 2, 3]), r"a tensor of prompts must be \[batch, T\]"),
    ([torch.tensor([[1, 2], [3, 4]])], "a prompt tensor must be 1-D"),
    ([None], "a prompt must be a sequence of integer token ids, got NoneType"),
    (5, "prompts: expected a non-empty list of prompts"),
    ([torch.tensor([1, 2]).to("meta")], "prompt is a tensor on the meta device"),
])
def test_bad_prompts_are_named(gen: Generator, prompts: Any, match: str) -> None:
    with pytest.raises(TitancError, match=match):
        gen.generate(prompts, 2)


def test_prompts_from_an_iterator_and_numpy_counts(gen: Generator) -> None:
    greedy = Sampling(temperature=0.0)
    want = gen.generate([[1, 2, 3]], 3, greedy)
    assert gen.generate(iter([[1, 2, 3]]), np.int64(3), greedy) == want
    assert gen.generate([np.array([1, 2, 3])], 3, greedy) == want


def test_wrong_argument_types_are_named(gen: Generator) -> None:
    with pytest.raises(TypeError, match="Generator: prog must be a titanc Program"):
        Generator("runs/x")
    with pytest.raises(TypeError, match="sampling must be a Sampling"):
        gen.generate([[1]], 2, {"temperature": 0})
    with pytest.raises(TypeError, match="state must be a DecodeState"):
        gen.generate([[1]], 2, state={})
    with pytest.raises(TypeError, match="state must be a DecodeState"):
        gen.state_dict(None)
    with pytest.raises(TitancError, match="new_state: batch 0 must be an integer >= 1"):
        gen.new_state(0)


def test_two_generators_on_one_program_from_two_threads(prog: Any) -> None:
    g1, g2 = Generator(prog), Generator(prog)
    greedy = Sampling(temperature=0.0)
    want = {0: g1.generate([[1, 2, 3]], 8, greedy), 1: g1.generate([[9, 8, 7, 6, 5]], 8, greedy)}
    wrong, errors = [0], []

    def run(g: Generator, i: int, prompt: list[int]) -> None:
        try:
            for _ in range(4):
                wrong[0] += g.generate([prompt], 8, greedy) != want[i]
        except Exception as exc:               # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(g1, 0, [1, 2, 3])),
               threading.Thread(target=run, args=(g2, 1, [9, 8, 7, 6, 5]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and wrong[0] == 0


@pytest.mark.parametrize("block", ["lmm", "mag", "attn"])
def test_a_conversation_state_round_trips(block: str) -> None:
    g = Generator(small(**{"model.block": block}))
    st = g.new_state(1)
    g.generate([[1, 2, 3, 4, 5]], 4, Sampling(temperature=0.0), state=st)
    back = g.load_state_dict(g.state_dict(st))
    assert back.pos == st.pos and back.unfed == st.unfed


def test_damaged_conversation_states_are_refused(gen: Generator) -> None:
    st = gen.new_state(1)
    gen.generate([[1, 2, 3, 4, 5, 6]], 3, Sampling(temperature=0.0), state=st)
    sd = gen.state_dict(st)
    name = next(k for k in sd if k.startswith("state."))
    cases = [
        (None, TypeError, "sd must be a mapping"),
        ({**sd, name: sd[name].numpy()}, TypeError, f"tensor '{name}' must be a torch.Tensor"),
        ({**sd, name: sd[name].to("meta")}, TitancError, "is on the meta device"),
        ({**sd, name: torch.full_like(sd[name], float("nan"))}, TitancError,
         f"tensor '{name}' holds a NaN"),
        ({**sd, "slot_pos": torch.full_like(sd["slot_pos"], 10**6)}, TitancError,
         "'slot_pos' holds positions outside"),
    ]
    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            gen.load_state_dict(bad)


# ---------------------------------------------------------------- token tensors, the docstring

def test_token_tensors_are_checked() -> None:
    spec = tiny("lmm", model__vocab_size=64)
    prog = titanc.compile(spec)
    good = tokens(spec)
    prog.loss(good)
    cases = {"float": (good.float(), "must hold integer token ids, got a torch.float32"),
             "bool": (good > 3, "must hold integer token ids, got a torch.bool"),
             "too large": (good + 64, "id [0-9]+ is outside the vocabulary \\[0, 64\\)"),
             "negative": (good - 64, "id -[0-9]+ is outside the vocabulary")}
    for t, msg in cases.values():
        for fn in (prog.loss, prog.train_step):
            with pytest.raises(TitancError, match=msg):
                fn(t)
    gen = Generator(prog)
    with pytest.raises(TitancError, match="max_new_tokens: -1 must be an integer >= 0"):
        gen.generate([[1, 2]], -1)
    with pytest.raises(TitancError, match="expected a non-empty list of prompts"):
        gen.generate([], 3)
    with pytest.raises(TitancError, match="prompt: id 64 is outside"):
        gen.generate([[1, 64]], 3)
    with pytest.raises(TitancError, match="integer token ids"):
        gen.generate([[1.5, 2]], 3)
    assert gen.generate([[1, 2]], 0) == [[]]


def test_help_of_titanc_compile_documents_it() -> None:
    doc = titanc.compile.__doc__ or ""
    assert len(doc.splitlines()) > 10
    for word in ("Args:", "overrides", "Returns:", "Raises:", "SpecError", "Example:"):
        assert word in doc
