"""Shared test helpers: tiny specs and parameter sets."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import pytest
import torch

from titanc.ir import Op
from titanc.compile_cache import compile_key
from titanc.model.spec import Spec, load_spec

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


def assert_gradients_match_reference(spec: Spec, params: dict[str, torch.Tensor],
                                     toks: torch.Tensor) -> torch.Tensor:
    """The spec's forward graph with its gradient graph on the IR interpreter against the eager
    reference (tests/reference), float64: the loss to 1e-10, every parameter's gradient to
    rtol 1e-8 (a parameter the loss does not reach: zeros). Returns the reference loss."""
    import tests.reference as R
    from titanc.ir import interpret
    from titanc.model.frontend import lower_forward
    from titanc.passes.autodiff import grad_graph

    leaf = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref = R.forward_loss(leaf, toks, spec.model)
    ref.backward()
    out = interpret(grad_graph(lower_forward(spec), list(params)), {"tokens": toks, **params})
    assert abs(float(out["loss"]) - float(ref)) < 1e-10
    for name, p in leaf.items():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(out[f"grad.{name}"], want, rtol=1e-8, atol=1e-12,
                                   msg=lambda m: f"grad of {name}: {m}")
    return ref.detach()


def assert_decodes_like_forward(prog: Any, params: dict[str, torch.Tensor], toks: torch.Tensor,
                                prompt: int) -> Any:
    """Prefill `prompt` tokens of `toks` (1, T+1), then decode token by token to the end:
    every position's logits equal the eager reference's parallel forward (float64, 1e-10).
    Returns the decode state."""
    import tests.reference as R
    from titanc.runtime.serve.generate import Generator

    want = R.forward_logits(params, toks[:, :-1], prog.spec.model)
    gen = Generator(prog)
    st, logits = gen.prefill(toks[0, :prompt].tolist())
    rest = [gen.step(st, toks[:, t:t + 1]).clone() for t in range(prompt, toks.shape[1] - 1)]
    torch.testing.assert_close(torch.cat([logits] + rest, 1), want, rtol=1e-10, atol=1e-10)
    return st


@dataclasses.dataclass
class _Entry:
    compiled: Any
    verified: bool          # compiled with verify_each: every pass's output was verified
    dumps: bool             # its log keeps the graph after each pass

    def serves(self, verify_each: bool, dumps: bool) -> bool:
        return (self.verified or not verify_each) and (self.dumps or not dumps)


def memoize_compiles(real: Any) -> Any:
    """`compile_graphs` that compiles each distinct `compile_key` once per test process (again
    only where a caller asks for more checks or dumps than the first compile made; across
    processes, the workers and the CLI, server and rank subprocesses share compiles through
    titanc's own on-disk cache, titanc/compile_cache.py) and hands out a copy: the compiled
    graphs, schedules and plans shared (a program, an executor and every test only read them;
    passes return new graphs), the table of kinds too (a kind compiled later on first use,
    such as `logits` or `decode_step`, serves every later copy; its pass records stay in the
    log of the copy that compiled it), the spec and the pass log the caller's own.
    Off while debug output is asked for (a compile then prints what it does)."""
    import inspect

    from titanc import config

    memo: dict[str, _Entry] = {}
    signature = inspect.signature(real)

    def compile_graphs(*args: Any, **kwargs: Any) -> Any:
        if config.current().debug:
            return real(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        spec, verify_each, dumps = (call.arguments[k] for k in ("spec", "verify_each", "dumps"))
        key = compile_key(spec, call.arguments["batch"], call.arguments["patterns"])
        entry = memo.get(key)
        if entry is None or not entry.serves(verify_each, dumps):
            memo[key] = entry = _Entry(real(*call.args, **call.kwargs), verify_each, dumps)
        c = entry.compiled
        log = dataclasses.replace(c.log, records=list(c.log.records),
                                  dumps=list(c.log.dumps) if dumps else [],
                                  callbacks=list(c.log.callbacks), verify_each=verify_each,
                                  keep_dumps=dumps)
        return dataclasses.replace(c, spec=spec, log=log, graphs=c.graphs)

    compile_graphs.__wrapped__ = real
    return compile_graphs


def memoize_for_batch(real: Any) -> Any:
    """`Compiled.for_batch` that returns one object per `compile_key` in a test process: its
    kinds compile on first use and stay for the next program at that batch (a program and
    `launches_per_step` only ask it for compiled graphs; its log is the unverified one
    `for_batch` makes, no test reads it)."""
    memo: dict[str, Any] = {}

    def for_batch(self: Any, batch: int) -> Any:
        key = compile_key(self.spec, batch, self.patterns)
        if key not in memo:
            memo[key] = real(self, batch)
        return memo[key]

    for_batch.__wrapped__ = real
    return for_batch


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


def set_at(*path_value: Any) -> Any:
    """A function that sets `value` at the nested key path of a JSON document in place:
    `set_at("splits", "train", "tokens", "abc")` (the damaged-file tests)."""
    *keys, value = path_value

    def mutate(doc: Any) -> None:
        d = doc
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return mutate


def start_server(app: Any, http: Any = None) -> tuple[Any, Any, int]:
    """`app` served by uvicorn on 127.0.0.1 and a free port in a daemon thread, started within
    30 s: (server, thread, port). Stop it with `server.should_exit = True; thread.join()`."""
    import threading
    import time

    import uvicorn

    extra = {} if http is None else {"http": http}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical",
                                           lifespan="off", **extra))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "did not start"
        time.sleep(0.01)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


def generator_and_codec(artifact: Any) -> tuple[Any, Any]:
    """A compiled artifact's Generator with its tokenizer, and its codec."""
    import titanc
    from titanc.runtime.serve.codec import codec_for
    from titanc.runtime.serve.generate import Generator

    prog = titanc.load(artifact)
    codec = codec_for(prog, artifact)
    return Generator(prog, codec.tok), codec
