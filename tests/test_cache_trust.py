"""The compile cache and the kernel modules trust nothing this user's titanc did not write
(titanc/cache_files.py, titanc/compile_cache.py, codegen/render.py): a cache directory or
compile-slots directory that another user owns or may write is refused in one line; an entry
that is planted, copied from another key, damaged, oversized or not a regular file is never
unpickled or imported, and is compiled or written again; kernel files are trimmed."""
from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

import titanc.compiler
from tests.helpers import tiny_spec
from titanc import compile_cache, config
from titanc.cache_files import MAGIC, private_directory, read_regular
from titanc.codegen import render
from titanc.errors import TitancError

# the product's compile_graphs (tests/conftest.py wraps it in a per-process memo)
compile_graphs = titanc.compiler.compile_graphs.__wrapped__
ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="giving a directory to another uid needs root")


class Planted:
    """What another user plants: unpickling it creates `marker` (a stand-in for any command)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _small(**over: Any):
    """The smallest model: one attention layer (a compile of ~0.3 s)."""
    return tiny_spec(**{"model.block": "attn", "model.n_layers": 1, **over})


def _text(c: Any) -> list[Any]:
    """A compile's result as comparable data: each training kind's graph, kernels and plan."""
    out: list[Any] = []
    for kind in ("forward", "training", "optimizer"):
        cg = c.graphs[kind]
        out += [repr(cg.graph), [k.name for k in cg.schedule.kernels], cg.plan.arena_bytes]
    return out


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "cache"
    with config.override(cache_dir=root, compile_cache=True, debug=0):
        yield root


def _entry(cache: Path) -> Path:
    (entry,) = (cache / "compiled").glob("*.pickle")
    return entry


# -- row 1: a directory another user may write, or owns, is refused ------------------------------

@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_cache_directory_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, mode)
    with config.override(cache_dir=root, compile_cache=True, debug=0):
        with pytest.raises(TitancError) as e:
            compile_graphs(_small(), dumps=False)
        with pytest.raises(TitancError):
            render.load_module("X = 1\n", "k")
    msg = str(e.value)
    assert str(root) in msg and f"mode {mode:04o}" in msg and "TITANC_CACHE_DIR" in msg
    assert "\n" not in msg and list(root.iterdir()) == []        # nothing read, nothing written


@as_root
def test_a_cache_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    with config.override(cache_dir=root, compile_cache=True, debug=0):
        with pytest.raises(TitancError, match=f"belongs to uid {NOBODY}, not to you"):
            compile_graphs(_small(), dumps=False)
    link = tmp_path / "link"                       # their symlink where ours should be
    os.symlink(tmp_path, link)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(TitancError, match=f"symlink owned by uid {NOBODY}"):
        private_directory(link)


def test_a_new_or_readable_cache_directory_becomes_private(tmp_path: Path) -> None:
    fresh, readable = tmp_path / "a" / "fresh", tmp_path / "readable"
    readable.mkdir(mode=0o755)
    os.chmod(readable, 0o755)
    for root in (fresh, readable):
        with config.override(cache_dir=root):
            assert render.cache_dir() == root
        assert root.stat().st_mode & 0o777 == 0o700


def test_the_cli_refuses_a_world_writable_cache_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    (tmp_path / "c.txt").write_text("hello world " * 200)
    sets = ["model.d_model=32", "model.n_layers=1", "model.seq_len=32", "model.attention.segment=16",
            "model.memory.chunk_size=8", "train.batch_size=2", "compile.target=cpu"]
    cmd = [sys.executable, "-m", "titanc", "train", str(ROOT / "examples" / "tiny.yaml"),
           *[a for s in sets for a in ("--set", s)], "--data", "c.txt", "--steps", "1",
           "--out", "r"]
    env = {**os.environ, "TITANC_CACHE_DIR": str(root)}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("titanc: error: cache directory") and str(root) in lines[-1]
    assert "Traceback" not in r.stderr and list(root.iterdir()) == []


def test_the_compile_slots_directory_is_private(tmp_path: Path, monkeypatch) -> None:
    from functools import partial

    from titanc.runtime.targets import precompile as pc

    slots = pc.CompileSlots(1, root=tmp_path / "slots")
    slots.release(slots.try_acquire())
    assert (tmp_path / "slots").stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(TitancError, match="compile-slots directory .* may be written by other"):
        pc.CompileSlots(1, root=shared).try_acquire()
    monkeypatch.setattr(pc, "module_command", lambda *a: [sys.executable, "-c", "pass"])
    monkeypatch.setattr(pc, "CompileSlots", partial(pc.CompileSlots, root=shared))
    with config.override(cache_dir=tmp_path / "cache"):
        with pytest.raises(TitancError, match="compile-slots directory"):
            pc._pool([{"name": "k0", "source": ""}], 90, False, 1, False)
    assert list(shared.iterdir()) == []


@as_root
def test_a_compile_slots_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    from titanc.runtime.targets.precompile import CompileSlots

    theirs = tmp_path / "slots"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(TitancError, match=f"belongs to uid {NOBODY}"):
        CompileSlots(1, root=theirs).try_acquire()


def test_a_planted_compile_entry_runs_nothing_and_is_compiled_again(cache: Path,
                                                                    tmp_path: Path) -> None:
    want = _text(compile_graphs(_small(), dumps=False))
    entry, marker = _entry(cache), tmp_path / "ran"
    entry.write_bytes(pickle.dumps(Planted(marker)))
    assert _text(compile_graphs(_small(), dumps=False)) == want
    assert not marker.exists()
    assert entry.read_bytes().startswith(MAGIC)                # replaced by a sealed entry


def test_a_planted_rendered_entry_or_kernel_module_runs_nothing(cache: Path,
                                                               tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    render.store_rendered("plan", {"k": "source"})
    assert render.load_rendered("plan") == {"k": "source"}
    (path,) = (cache / "rendered").glob("*.pickle")
    path.write_bytes(pickle.dumps(Planted(marker)))
    assert render.load_rendered("plan") == {} and not marker.exists()
    source = "X = 1\n"
    render._LOADED.clear()
    render.load_module(source, "planted")
    (kernel,) = cache.glob("titanc_kernel_planted_*.py")
    kernel.write_text(f"open({str(marker)!r}, 'w')\nX = 2\n")
    render._LOADED.clear()
    assert render.load_module(source, "planted").X == 1 and not marker.exists()
    assert kernel.read_text() == source


# -- row 6: an entry is checked against its key -------------------------------------------------

def test_another_specs_entry_under_this_specs_name_is_a_miss(cache: Path) -> None:
    a, b = _small(), _small(**{"model.d_model": 24})
    want_a = _text(compile_graphs(a, dumps=False))
    entry_a = _entry(cache)
    compile_graphs(b, dumps=False)
    (entry_b,) = set((cache / "compiled").glob("*.pickle")) - {entry_a}
    want_b = _text(compile_graphs(b, dumps=False))
    entry_a.write_bytes(entry_b.read_bytes())
    got = _text(compile_graphs(a, dumps=False))
    assert got == want_a and got != want_b
    assert compile_cache.load(compile_cache.compile_key(a, None, True), False) is not None


# -- row 7: a damaged entry is a miss, never a traceback, and is replaced ----------------------

def test_flipped_bits_are_a_miss_and_the_entry_is_replaced(cache: Path) -> None:
    spec = _small()
    want = _text(compile_graphs(spec, dumps=False))
    entry, key = _entry(cache), compile_cache.compile_key(spec, None, True)
    good = entry.read_bytes()
    rng = random.Random(7)
    head = len(MAGIC) + 32
    # the header, the HMAC, the pickle's first bytes and 40 random places in the pickle
    spots = [0, len(MAGIC) - 1, len(MAGIC) + 3, head, head + 1, head + 2, len(good) - 1]
    spots += [rng.randrange(head, len(good)) for _ in range(40)]
    for pos in spots:
        bad = bytearray(good)
        bad[pos] ^= 1 << rng.randrange(8)
        entry.write_bytes(bytes(bad))
        assert compile_cache.load(key, False) is None, pos
    entry.write_bytes(good[: len(good) // 2])                    # cut short
    assert compile_cache.load(key, False) is None
    assert _text(compile_graphs(spec, dumps=False)) == want      # compiled again, no error
    assert compile_cache.load(key, False) is not None            # and the entry replaced


# -- row 8: a FIFO or a device as an entry is a miss, read without blocking ----------------------

CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))   # /dev/zero read whole: MemoryError
from pathlib import Path
from titanc import compile_cache, config
from titanc.codegen import render
fingerprint, key = Path(sys.argv[2]).read_text().split("\\x00")
compile_cache.source_fingerprint = lambda: fingerprint
with config.override(cache_dir=Path(sys.argv[1]), compile_cache=True, debug=0):
    print(compile_cache.load(key, False) is None, render.load_rendered("plan") == {},
          render.load_module("X = 1\\n", "fifo").X)
"""


def _read_in_child(cache: Path, key: str) -> str:
    """What a fresh process reads from `cache` (the entry of `key`, the rendered entry "plan",
    the kernel module "fifo"), bounded in time and memory: a blocking or endless read fails
    the test instead of hanging it or filling the machine's memory."""
    args = cache.parent / "child-args"
    args.write_text(f"{compile_cache.source_fingerprint()}\x00{key}")
    r = subprocess.run([sys.executable, "-c", CHILD, str(cache), str(args)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_entries_that_are_fifos_or_devices_are_misses_and_replaced(cache: Path,
                                                                   kind: str) -> None:
    spec = _small()
    want = _text(compile_graphs(spec, dumps=False))
    render.store_rendered("plan", {"k": 1})
    render._LOADED.clear()
    render.load_module("X = 1\n", "fifo")
    entry, key = _entry(cache), compile_cache.compile_key(spec, None, True)
    (rendered,) = (cache / "rendered").glob("*.pickle")
    (kernel,) = cache.glob("titanc_kernel_fifo_*.py")
    for path in (entry, rendered, kernel):
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        else:
            os.symlink("/dev/zero", path)
    assert _read_in_child(cache, key) == "True True 1"
    assert _text(compile_graphs(spec, dumps=False)) == want     # compiled again: no hang
    assert entry.is_file() and not entry.is_symlink()
    assert compile_cache.load(key, False) is not None           # and the entry replaced
    assert kernel.is_file() and kernel.read_text() == "X = 1\n"


def test_an_oversized_entry_is_a_miss(cache: Path, monkeypatch) -> None:
    spec = _small()
    compile_graphs(spec, dumps=False)
    entry, key = _entry(cache), compile_cache.compile_key(spec, None, True)
    assert read_regular(entry, entry.stat().st_size) is not None
    monkeypatch.setattr(compile_cache, "MAX_BYTES", entry.stat().st_size - 1)
    assert compile_cache.load(key, False) is None
    assert read_regular(entry, entry.stat().st_size - 1) is None


# -- row 9: a damaged kernel module is written again ---------------------------------------------

KERNEL = """import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(x_ptr + offs, x + 1, mask=mask)
"""


def test_a_damaged_kernel_module_is_written_again_and_runs(cache: Path) -> None:
    import torch

    render._LOADED.clear()
    render.load_module(KERNEL, "add_one", interpret=True)
    (path,) = cache.glob("titanc_kernel_add_one_*.py")
    path.write_bytes(b"\xff\xfe")
    render._LOADED.clear()
    module = render.load_module(KERNEL, "add_one", interpret=True)
    assert path.read_text() == KERNEL
    path.write_bytes(b"\xff\xfe")             # changed after the load: what runs is the source
    x = torch.zeros(5)
    with config.triton_interpret_mode(True):
        module.add_one[(1,)](x, 5, BLOCK=8)
    assert x.tolist() == [1.0] * 5


# -- row 10: kernel files follow a bound ---------------------------------------------------------

def test_kernel_files_are_trimmed_to_their_bound(cache: Path, monkeypatch) -> None:
    monkeypatch.setattr(render, "KERNELS_MAX_BYTES", 3000)
    monkeypatch.setattr(render, "_TRIM_EVERY", 1)
    render._LOADED.clear()
    for i in range(8):
        render.load_module(f"X = {i}\n" + "#" * 1000 + "\n", f"trim{i}")
        files = list(cache.glob("titanc_kernel_*.py"))
        assert sum(f.stat().st_size for f in files) <= 3000 + 1100
    newest = sorted(cache.glob("titanc_kernel_trim7_*.py"))
    assert len(newest) == 1 and len(list(cache.glob("titanc_kernel_*.py"))) <= 3


def test_a_damaged_precompile_marker_is_compiled_again(tmp_path: Path, monkeypatch) -> None:
    """A plan's precompile marker (`<cache>/precompiled/*.json`) that is damaged, a FIFO or
    not a summary is not cached: the plan is precompiled again and the marker rewritten."""
    from titanc.runtime.targets import precompile as pc

    marker = tmp_path / "marker.json"
    monkeypatch.setattr(pc, "_marker", lambda *a: marker)
    monkeypatch.setattr(pc, "recorded_launches", lambda *a: ([], {"grids": {}, "aliases": {}}))
    monkeypatch.setattr(pc, "_pool", lambda *a: [])
    for bad in (b"\xff\xfe", b'{"kernels": "x"}', b"[1]", None):
        marker.unlink(missing_ok=True)
        if bad is None:
            os.mkfifo(marker)
        else:
            marker.write_bytes(bad)
        assert pc._read_marker(marker) is None
        assert pc.precompile(object(), 90, jit=False, progress=False)["cached"] is False
        assert pc._read_marker(marker) is not None
        assert pc.precompile(object(), 90, jit=False, progress=False)["cached"] is True


def test_temporaries_of_killed_writers_are_dropped(cache: Path) -> None:
    """A `.tmp` a writer killed before its rename left is removed by a later write once it
    is an hour old; a fresh one (a live writer's) stays."""
    spec = _small()
    compile_graphs(spec, dumps=False)
    old, fresh = cache / "compiled" / "tmpa.tmp", cache / "compiled" / "tmpb.tmp"
    kernel_tmp = cache / "tmpc.tmp"
    for p in (old, fresh, kernel_tmp):
        p.write_bytes(b"x" * 100)
    for p in (old, kernel_tmp):
        os.utime(p, (1, 1))
    compile_cache.store(compile_cache.compile_key(spec, None, True),
                        compile_graphs(spec, dumps=False), True)
    render._written[0] = 0
    render._LOADED.clear()
    render.load_module("X = 3\n", "tmp")
    assert not old.exists() and not kernel_tmp.exists() and fresh.exists()


def test_a_damaged_or_foreign_aot_result_is_compiled_again(tmp_path):
    """runtime/targets/aot.py's per-launch compile results: a damaged JSON, a FIFO, a failed
    result or a non-object is not a cached result (compiled again), never a traceback."""
    from titanc.runtime.targets import aot
    path = tmp_path / "r.json"
    for data in (b"\xff\xfe{", b"[1, 2]", b'{"ok": false}', b"{" * 10):
        path.write_bytes(data)
        assert aot._cached_result(path) is None
    path.unlink()
    os.mkfifo(path)
    assert aot._cached_result(path) is None
    path.unlink()
    path.write_text('{"ok": true, "registers": 32}')
    assert aot._cached_result(path) == {"ok": True, "registers": 32}
