"""report.json `gpu_alignment` (titanc/tools/alignment.py): the contractions whose rows a GPU
cannot load 16 bytes at a time, named by the spec field that sets their width, per dtype."""
from __future__ import annotations

from titanc.compiler import compile_graphs
from titanc.model.spec import load_spec
from titanc.tools.alignment import note_lines, unaligned_rows

from .conftest import EXAMPLES

SMALL = {"model.d_model": 16, "model.n_layers": 1, "model.seq_len": 16, "model.vocab_size": 32,
         "train.batch_size": 1, "model.memory.chunk_size": 4, "model.attention.segment": 8,
         "model.attention.window": 8}


def _rows(**over: object) -> list[dict]:
    return unaligned_rows(compile_graphs(load_spec(EXAMPLES / "tiny.yaml", {**SMALL, **over})))


def test_an_odd_ffn_width_is_named_in_bf16_only() -> None:
    # 44 bf16 elements are 88-byte rows; 44 float32 ones 176 bytes, a multiple of 16
    rows = _rows(**{"model.ffn_hidden": 44, "train.dtype": "bfloat16"})
    ffn = [r for r in rows if r["size"] == 44]
    assert ffn and ffn[0]["fields"] == ["model.ffn_hidden"] and ffn[0]["aligned_size"] == 48
    assert ffn[0]["dtype"] == "bf16" and ffn[0]["row_bytes"] == 88 and ffn[0]["einsums"] >= 3
    assert "model.ffn_hidden = 44" in note_lines(ffn)[0]
    assert not [r for r in _rows(**{"model.ffn_hidden": 44}) if r["size"] == 44]
    # an aligned width, and rows narrower than one load (the memory's per-head gates), are not
    assert _rows(**{"model.ffn_hidden": 48, "train.dtype": "bfloat16"}) == []
