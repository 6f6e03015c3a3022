"""The on-disk compile cache (titanc/compile_cache.py): a second compile of the same model in
another process is a file read; anything that changes a compile's result misses."""
from __future__ import annotations

from pathlib import Path

import pytest

import titanc.compiler
from tests.helpers import graphs_nested, tiny_spec
from titanc import compile_cache, config
from titanc.compile_cache import NOT_COMPILED, compile_key

# the product's compile_graphs (tests/conftest.py wraps it in a per-process memo)
compile_graphs = titanc.compiler.compile_graphs.__wrapped__

# every field `NOT_COMPILED` names, set to another valid value than tiny_spec's
OTHER = {"name": "other", "train.steps": 7, "train.lr": 0.5, "train.warmup": 3, "train.seed": 9,
         "train.grad_accum": 3, "train.eval_every": 11, "train.eval_batches": 5,
         "train.checkpoint_every": 13, "train.log_every": 17, "train.bucket_mb": 3.0,
         "train.zero": 1, "train.dist_timeout_s": 99.0, "train.memory_stats_every": 19,
         "train.tensorboard": "tb",
         "data.source": "corpus.txt", "data.val_fraction": 0.25, "data.tokenizer": "tok.json",
         "compile.target": "cpu", "compile.cuda_graphs": False, "compile.allow_tf32": False}


def _small(**over):
    """The smallest model: one attention layer (a compile of ~0.3 s)."""
    return tiny_spec(**{"model.block": "attn", "model.n_layers": 1, **over})


def _text(c) -> list:
    """A compile's result as comparable data: every graph and scan body, its kernels, its plan."""
    out = []
    for kind in ("forward", "training", "optimizer"):
        cg = c.graphs[kind]
        out += [repr(g) for g in graphs_nested(cg.graph)]
        out += [k.name for k in cg.schedule.kernels]
        out.append(cg.plan.arena_bytes)
    return out


@pytest.fixture
def cache(tmp_path: Path):
    with config.override(cache_dir=tmp_path, compile_cache=True, debug=0):
        yield tmp_path / "compiled"


def _no_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self, kind, n):
        raise AssertionError(f"compiled {kind}: expected a cache hit")
    monkeypatch.setattr(titanc.compiler.Compiled, "_compile", refuse)


def test_the_fields_no_compile_reads_change_nothing_a_compile_makes() -> None:
    """Every `NOT_COMPILED` field, changed, gives the same graphs, kernels and plans (with the
    cache off): what lets specs that differ only there share an entry."""
    assert {f"{s}.{n}" if s else n for s, ns in NOT_COMPILED.items() for n in ns} == set(OTHER)
    base = tiny_spec(**{"model.block": "mac", "model.n_layers": 1})
    other = tiny_spec(**{"model.block": "mac", "model.n_layers": 1, **OTHER})
    assert compile_key(base, None, True) == compile_key(other, None, True)
    with config.override(compile_cache=False):
        assert _text(compile_graphs(base, dumps=False)) == _text(compile_graphs(other, dumps=False))


def test_a_second_compile_reads_the_entry(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _small()
    first = compile_graphs(spec, dumps=False)
    assert len(list(cache.glob("*.pickle"))) == 1
    _no_compiling(monkeypatch)
    again = _small(**{"train.steps": 3})
    hit = compile_graphs(again, dumps=False)
    assert hit.spec is again and hit.log.dumps == []
    assert _text(hit) == _text(first)
    assert [r["name"] for r in hit.log.records] == [r["name"] for r in first.log.records]


def test_what_changes_a_compile_misses(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _small()
    compile_graphs(spec, dumps=False, verify_each=False)
    calls: list[str] = []
    real = titanc.compiler.Compiled._compile

    def counted(self, kind, n):
        calls.append(kind)
        return real(self, kind, n)
    monkeypatch.setattr(titanc.compiler.Compiled, "_compile", counted)
    compile_graphs(_small(**{"model.d_model": 24}), dumps=False)     # another model
    compile_graphs(spec, batch=4, dumps=False)                           # another batch
    compile_graphs(spec, dumps=False, verify_each=True)                  # entry unverified
    compile_graphs(spec, dumps=True)                                     # dumps asked for
    with config.override(debug=1):
        compile_graphs(spec, dumps=False)                                # debug prints
    monkeypatch.setattr(compile_cache, "source_fingerprint", lambda: "edited compiler")
    compile_graphs(spec, dumps=False)                                    # other source
    assert calls.count("forward") == 6
    calls.clear()
    monkeypatch.undo()
    monkeypatch.setattr(titanc.compiler.Compiled, "_compile", counted)
    compile_graphs(spec, dumps=False, verify_each=True)                  # verified now
    assert calls == []


def test_a_damaged_entry_is_compiled_again(cache: Path) -> None:
    spec = _small()
    want = _text(compile_graphs(spec, dumps=False))
    (entry,) = cache.glob("*.pickle")
    entry.write_bytes(b"not a pickle")
    assert _text(compile_graphs(spec, dumps=False)) == want
    assert entry.stat().st_size > 100                       # written again


def test_off_by_config(cache: Path) -> None:
    with config.override(compile_cache=False):
        compile_graphs(_small(), dumps=False)
    assert not cache.exists()
    assert config.Config.from_env({"TITANC_COMPILE_CACHE": "0"}).compile_cache is False
    assert config.Config.from_env({}).compile_cache is True


def test_the_directory_keeps_the_most_recently_used(cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    compile_graphs(_small(), dumps=False)
    (first,) = cache.glob("*.pickle")
    monkeypatch.setattr(compile_cache, "MAX_BYTES", first.stat().st_size + 1)
    compile_graphs(_small(**{"model.d_model": 24}), dumps=False)
    assert len(list(cache.glob("*.pickle"))) == 1 and not first.exists()
