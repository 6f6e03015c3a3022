"""Tier (a): the lowered graphs of every examples/*.yaml are byte-identical to the ones recorded
before the memory family's spec knobs (issue 52) existed (the presets those knobs
make, examples/deltanet.yaml and the like, are new specs and not listed): a knob at its default emits exactly
the graph it emitted before there was a knob.

The digests are sha256 of each graph's printed text (the forward at the spec's batch, the
decode step of one token and the decode write at batch 1) and of the parameter table. A
change that alters them on purpose re-records them here and says why in its commit. MAC's
write was rmsnorm(ỹ) when they were recorded; it is the option `mac_write: attention_norm`
now (the default writes ỹ, as the paper does), so the MAC examples are checked under it
(`THEN`): the option emits exactly the graphs the former default did."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from titanc.model.decode import lower_step, lower_write
from titanc.model.frontend import lower_forward
from titanc.model.params import param_specs
from titanc.model.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]

RECORDED = {
    "large_125m": {"params": "ac1d62252be77a5c", "forward": "c274c5ad8855c61f", "decode_step": "aa9e457b64d82bae",
                   "decode_write": "3d6781ed21998180"},
    "tiny": {"params": "b5acda5fb16781ca", "forward": "a2a0c2269c5e69ac", "decode_step": "3877978065fb79b9",
             "decode_write": "be770cfadbf00820"},
    "tiny_attn": {"params": "dcd1698f82d9ddef", "forward": "e328658c9d3e6391", "decode_step": "1f74f3cc5b28be98"},
    "tiny_lmm": {"params": "b8712de682e2c4e3", "forward": "617a7f1ded1f0492", "decode_step": "7f5ea8b776bd42d7",
                 "decode_write": "be770cfadbf00820"},
    "tiny_mag": {"params": "34580af1ce516d93", "forward": "60c55af296050539", "decode_step": "ea957eb926e2c6c8",
                 "decode_write": "be770cfadbf00820"},
    "tiny_mal": {"params": "56aaea3d4d642f94", "forward": "0b06890c84dbed7e", "decode_step": "eca42f2be96e26f1",
                 "decode_write": "be770cfadbf00820"},
}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _then(name: str, over: dict | None = None):
    """The spec of an example as its graphs were recorded (`THEN` for a MAC example)."""
    s = load_spec(ROOT / "examples" / f"{name}.yaml", over)
    return load_spec(ROOT / "examples" / f"{name}.yaml", {**(over or {}), **THEN}) \
        if s.model.block == "mac" else s


# the settings that were the defaults when the digests were recorded
THEN = {"model.memory.mac_write": "attention_norm"}


def _digests(name: str) -> dict[str, str]:
    s = _then(name)
    out = {"params": _digest(str(param_specs(s.model))),
           "forward": _digest(str(lower_forward(s, s.train.batch_size))),
           "decode_step": _digest(str(lower_step(s, 1, 1)))}
    if s.model.has_memory:
        out["decode_write"] = _digest(str(lower_write(s, 1)))
    return out


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_example_graphs_are_unchanged(name: str) -> None:
    assert _digests(name) == RECORDED[name]


# the forward with data.documents (the memory scan's other path, the document resets),
# recorded before the knobs too
DOCUMENTS = {"tiny": "24b1e86f40976bc3", "tiny_lmm": "98ae5da4347b4c27"}


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_example_graphs_with_documents_are_unchanged(name: str) -> None:
    s = _then(name, {"data.documents": True})
    assert _digest(str(lower_forward(s, s.train.batch_size))) == DOCUMENTS[name]
