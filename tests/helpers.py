"""Shared test helpers: tiny specs and parameter sets."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterator

import pytest
import torch

from titanc.ir import Op
from titanc.model.spec import Spec, load_spec, spec_to_dict

TINY: dict[str, Any] = {
    "name": "t",
    "model": {"vocab_size": 32, "d_model": 16, "n_layers": 2, "block": "lmm", "seq_len": 16,
              "ffn_hidden": 24,
              "attention": {"heads": 2, "window": 6, "segment": 8, "persistent_tokens": 2},
              "memory": {"heads": 2, "depth": 2, "expansion": 2, "chunk_size": 4,
                         "lr_max": 0.5}},
    "train": {"batch_size": 2, "dtype": "float64"},
}
BLOCKS = ["attn", "lmm", "mag", "mal", "mac"]
# the small MAC the serving tests compile (the `artifact` fixture of tests/conftest.py)
SERVE_SETS = ["model.d_model=32", "model.n_layers=1", "model.ffn_hidden=64", "train.dtype=float64",
              "train.batch_size=1", "compile.target=cpu"]
MEMORY_BLOCKS = ["lmm", "mag", "mal", "mac"]


def tiny_spec(**overrides: Any) -> Spec:
    return load_spec(TINY, overrides)


def tokens(spec: Spec, batch: int | None = None, seed: int = 0) -> torch.Tensor:
    B = batch or spec.train.batch_size
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.model.vocab_size, (B, spec.model.seq_len + 1), generator=gen)


_COMPILED: dict[tuple[str, Any, Any], Any] = {}


def memoize_compiles(real: Any) -> Any:
    """`compile_graphs` that compiles each distinct (spec, batch, options) once per process and
    hands out a copy of the first result: the compiled graphs, schedules and plans shared
    (a program, an executor and every test only read them; passes return new graphs), the
    table of kinds and the pass log its own (a kind compiled later on first use, and its
    records, stay with the copy that asked). Off while debug output is asked for (a compile
    then prints what it does)."""
    from titanc import config

    memo: dict[str, Any] = {}

    def compile_graphs(spec: Spec, batch: int | None = None, *args: Any, **options: Any) -> Any:
        if config.current().debug:
            return real(spec, batch, *args, **options)
        key = json.dumps([spec_to_dict(spec), batch, list(args), sorted(options.items())],
                         sort_keys=True, default=str)
        if key not in memo:
            memo[key] = real(spec, batch, *args, **options)
        c = memo[key]
        log = dataclasses.replace(c.log, records=list(c.log.records), dumps=list(c.log.dumps),
                                  callbacks=list(c.log.callbacks))
        return dataclasses.replace(c, spec=spec, log=log, graphs=dict(c.graphs))

    compile_graphs.__wrapped__ = real
    return compile_graphs


def compile_each_model_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that build a few tiny specs over and over, differing in fields the graphs do not
    depend on (train.steps, eval cadence, data, distribution), compile each model once.
    Programs only read their Compiled graphs, so sharing them is safe; each gets its own spec."""
    import titanc.compiler as compiler
    from titanc.runtime.train.checkpoint import RUN_CONTROL
    real = compiler.compile_graphs

    def cached(spec: Any, batch: int | None = None, **options: bool) -> Any:
        fields = spec_to_dict(spec)
        fields["train"] = {k: v for k, v in fields["train"].items()
                           if f"train.{k}" not in RUN_CONTROL}
        del fields["data"], fields["name"]
        key = (json.dumps(fields, sort_keys=True), batch, tuple(sorted(options.items())))
        if key not in _COMPILED:
            _COMPILED[key] = real(spec, batch=batch, **options)
        return dataclasses.replace(_COMPILED[key], spec=spec)

    monkeypatch.setattr(compiler, "compile_graphs", cached)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is faster, and steady when other jobs share the cores
    (autouse in every test module that imports it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def graphs_nested(g: Any) -> Iterator[Any]:
    """A graph and every scan body inside it, depth first."""
    yield g
    for n in g:
        if n.op is Op.SCAN:
            yield from graphs_nested(n.attr("body"))


def plans_nested(plan: Any) -> Iterator[Any]:
    """A buffer plan and the plans of every scan body inside it, depth first."""
    yield plan
    for sub in plan.bodies.values():
        yield from plans_nested(sub)


def one_step_on_both_targets(path: Any, over: dict[str, Any], batch: int) -> dict[str, Any]:
    """One training step of the spec at `path` on the cpu and (interpreted) triton targets,
    float64 parity asserted (loss 1e-10 relative, every parameter after the update); the two
    programs, by target."""
    import titanc

    progs = {t: titanc.compile(path, **over, **{"compile.target": t}) for t in ("cpu", "triton")}
    toks = torch.randint(0, 16, (batch, 9), generator=torch.Generator().manual_seed(7))
    losses = {t: p.train_step(toks) for t, p in progs.items()}
    assert abs(losses["triton"] - losses["cpu"]) <= 1e-10 * max(1.0, abs(losses["cpu"]))
    for name, p in progs["cpu"].parameters().items():
        torch.testing.assert_close(progs["triton"].parameters()[name], p, rtol=1e-10,
                                   atol=1e-12, msg=lambda m: f"parameter {name}: {m}")
    return progs
