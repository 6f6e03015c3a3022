"""Tier (e) mode parity: token-by-token decoding equals the parallel forward (float64)."""
from __future__ import annotations

import pytest
import torch

import tests.reference as R
import titanc
from tests.helpers import BLOCKS, TINY, assert_decodes_like_forward, tokens
from titanc.runtime.serve.generate import DecodeState, Generator, Sampling, sample


def _program(block: str, **extra):
    prog = titanc.compile(TINY, **{"model.block": block, "train.batch_size": 1, **extra})
    params = R.init_params(prog.spec.model, seed=3)
    prog.load_state_dict({f"param.{k}": v for k, v in params.items()}, strict=False)
    return prog, params


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("prompt_len", [16, 11, 1])
def test_decoding_matches_parallel_forward(block: str, prompt_len: int) -> None:
    """Prefill (whole chunks in parallel, then token by token), then decode to the end: every
    position's logits equal the eager reference's parallel forward, prompts ending mid-chunk
    included."""
    prog, params = _program(block)
    toks = tokens(prog.spec, 1, seed=2)
    assert_decodes_like_forward(prog, params, toks, prompt_len)


@pytest.mark.parametrize("block", ["mal", "mac"])
def test_batch_of_different_lengths_equals_each_alone(block: str) -> None:
    prog, _ = _program(block)
    gen = Generator(prog)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [4] * 12]
    greedy = Sampling(temperature=0.0)
    together = gen.generate(prompts, 6, greedy)
    alone = [gen.generate([p], 6, greedy)[0] for p in prompts]
    assert together == alone


@pytest.mark.parametrize("block", ["attn", "lmm", "mac"])
def test_state_is_constant_in_context_length(block: str) -> None:
    prog, _ = _program(block)
    gen = Generator(prog)
    st, _ = gen.prefill([1, 2, 3])
    sizes = {k: v.shape for k, v in st.tensors.items()}
    for t in range(40):                                            # well past seq_len = 16
        gen.step(st, torch.tensor([[t % 32]]))
    assert {k: v.shape for k, v in st.tensors.items()} == sizes
    assert st.pos[0] == 43


def test_sampling_controls() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 5.0, 1.0, -2.0]] * 64)
    assert sample(logits, Sampling(temperature=0.0), gen).tolist() == [1] * 64
    topk = sample(logits, Sampling(top_k=2), gen)
    assert set(topk.tolist()) <= {1, 2}
    topp = sample(logits, Sampling(top_p=0.5), gen)
    assert set(topp.tolist()) == {1}
    a = sample(logits, Sampling(seed=1), torch.Generator().manual_seed(1))
    b = sample(logits, Sampling(seed=1), torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


def test_stop_sequence_ends_a_sequence() -> None:
    prog, _ = _program("lmm")
    gen = Generator(prog)
    out = gen.generate([[5, 6]], 20, Sampling(temperature=0.0))[0]
    text = bytes(out).decode("latin-1")
    stop = text[2:4]
    cut = gen.generate([[5, 6]], 20, Sampling(temperature=0.0, stop=[stop]))[0]
    assert bytes(cut).decode("latin-1").endswith(stop) and len(cut) <= 4


@pytest.mark.parametrize("block", ["attn", "mac"])
def test_logprobs_match_reference_and_never_build_full_logits(block: str) -> None:
    from titanc.model.frontend import lower_forward
    from titanc.ir import Op

    prog, params = _program(block, **{"train.loss_chunk": 4, "model.vocab_size": 64})
    toks = tokens(prog.spec, 1, seed=4)
    logits = R.forward_logits(params, toks[:, :-1], prog.spec.model)
    want = torch.log_softmax(logits, -1).gather(-1, toks[:, 1:, None])[..., 0]
    torch.testing.assert_close(prog.logprobs(toks), want, rtol=1e-10, atol=1e-10)
    g = lower_forward(prog.spec, batch=1, output="logprobs")
    head = [n for n in g if n.op is Op.SCAN and n.attr("body").name == "logprob_chunk"][0]
    widest = max(n.type.numel for n in head.attr("body") if n.type.shape[-1:] == (64,)
                 and n.op is not Op.INPUT)
    assert widest == 4 * 64


# make test: attention alone and MAC (attention and memory); lmm and mag in the slow tier
@pytest.mark.parametrize("block", ["attn", pytest.param("lmm", marks=pytest.mark.slow), "mac",
                                   pytest.param("mag", marks=pytest.mark.slow)])
def test_decode_step_allocates_nothing(block: str) -> None:
    from titanc.runtime.diagnostics.alloc_probe import allocations_during

    prog, _ = _program(block, **{"train.dtype": "float32"})
    gen = Generator(prog)
    st = DecodeState.cat([gen.prefill([1, 2, 3])[0], gen.prefill([4, 5])[0]])
    tok = torch.tensor([[7], [8]])
    for _ in range(2 * prog.spec.model.memory.chunk_size):         # warm-up, incl. a write
        gen.step(st, tok)
    known = prog.storages() + [tok, st.slot_pos, *st.tensors.values(), *st.pending.values()]
    known += [t for h in gen._graphs.values() if hasattr(h, "bias")
              for t in vars(h).values() if isinstance(t, torch.Tensor)]
    for _ in range(5):
        assert allocations_during(lambda: gen.step(st, tok), known) == []


@pytest.mark.parametrize("block", ["mag", "mac"])
def test_gate_attention_decodes_like_the_parallel_forward(block: str) -> None:
    """`memory.gate: attention` (σ of the attention output gates the memory's read) decodes
    token by token to the eager reference's parallel forward, a prompt ending mid-chunk
    included."""
    prog, params = _program(block, **{"model.memory.gate": "attention"})
    toks = tokens(prog.spec, 1, seed=2)
    assert_decodes_like_forward(prog, params, toks, 11)


@pytest.mark.parametrize("write,read", [("input", "residual"), ("attention", "residual"),
                                        ("attention_norm", "context")])
def test_mac_options_decode_like_the_parallel_forward(write: str, read: str) -> None:
    """MAC's options (memory.mac_write, memory.mac_read) decode token by token to the eager
    reference's parallel forward, a prompt ending mid-chunk included."""
    prog, params = _program("mac", **{"model.memory.mac_write": write,
                                      "model.memory.mac_read": read})
    toks = tokens(prog.spec, 1, seed=2)
    assert_decodes_like_forward(prog, params, toks, 11)


def test_ema_momentum_decodes_like_the_parallel_forward() -> None:
    """`memory.momentum_form: ema` decodes token by token to the eager reference's parallel
    forward, a prompt ending mid-chunk included."""
    prog, params = _program("lmm", **{"model.memory.momentum_form": "ema"})
    toks = tokens(prog.spec, 1, seed=2)
    assert_decodes_like_forward(prog, params, toks, 11)
