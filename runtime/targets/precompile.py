"""Compile every kernel of a program before its first launch, in parallel, into the caches.

Triton compiles a kernel at its first launch, one after another in the launching process:
tiny.yaml's first training step on an H100 waited minutes for it. `precompile(plan)` instead

1. records the plan's distinct launches (`runtime.targets.aot.record_launches`) in a subprocess under
   Triton's interpreter (a process picks compile or interpreter mode once; nothing runs);
2. compiles them in a process pool (`jobs`, default one per CPU core) with a progress bar
   (`compiling 84 kernels for sm_90`), each worker one kernel at a time. The workers of every
   titanc process on the machine share `compile_slots` (`TITANC_COMPILE_JOBS`, default one
   per core; a worker starts only once it holds one, a lock file in the temp dir): an H100
   check running 19 programs at once, each with a pool of 16, started 300 workers on 16 cores
   and 128 GiB, and every first step waited 400 s;
   - `jit=True` (on the GPU, before the first step): the worker calls the kernel's own
     `JITFunction.warmup` with stand-ins that specialise as the recorded arguments did
     (pointer dtypes and 16-byte alignment, integer widths and divisibility, the constexpr
     values the CUDA launcher passes), so Triton computes the very cache key the launch will
     and writes the compiled kernel into its persistent cache (`TRITON_CACHE_DIR`); the first
     launch then loads it;
   - `jit=False` (ahead of time, no GPU needed): `runtime.targets.aot.compile_launch` for the
     architecture (ptxas from the wheel), which also reports registers, spills and shared
     memory (report.json `occupancy`);
3. writes a marker keyed by the plan, the architecture, the Triton version, titanc's
   code generator and whether launches are grouped and matmuls split
   (`TITANC_GROUP_LAUNCHES`, `TITANC_SPLIT_K`, which the recording subprocess is given), so
   a second run records and compiles nothing. While one process compiles a plan it holds a
   lock beside the marker: another process precompiling the same plan (a rank of `titanc
   train --nproc`) waits for the marker instead of compiling the same kernels again.

A kernel that fails to precompile is left to its first launch (and named); the program runs
the same either way.

The recording subprocess and the compile workers are `runtime/targets/precompile_worker.py`
(this module imports no compiler, so the triton target can call it).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from titanc.cache_files import private_directory, read_regular
from titanc.codegen.render import cache_dir
from titanc.config import child_environment, current, module_command
from titanc.errors import TitancError

__all__ = ["precompile", "precompile_for_device", "recorded_launches"]

_CODEGEN = Path(__file__).resolve().parents[2] / "codegen"

# torch dtype of each pointer type a recorded signature names
def _code_hash() -> str:
    """A hash of the code that renders kernels (codegen/ and the ops' Triton lowerings)."""
    h = hashlib.sha256()
    for root in (_CODEGEN, _CODEGEN.parent / "ir"):
        for f in sorted(root.rglob("*")):
            if f.suffix in (".py", ".jinja"):
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def recorded_launches(plans: Any, allow_tf32: bool = False, float_dtype: Any = None
                      ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The distinct launches of one run of each of `plans` (a plan or a list; `aot.Launch` as
    dicts, a launch several plans share once), and {"grids": each kernel's largest grid
    (programs), "aliases": each schedule kernel -> the kernel whose module it launches},
    recorded in one subprocess under Triton's interpreter (this process may have Triton in
    compile mode)."""
    plans = list(plans) if isinstance(plans, (list, tuple)) else [plans]
    with tempfile.TemporaryDirectory(prefix="titanc-record-") as tmp:
        src, out = Path(tmp) / "plans.pickle", Path(tmp) / "launches.json"
        src.write_bytes(pickle.dumps((plans, float_dtype)))
        env = child_environment(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
                                TITANC_CACHE_DIR=str(cache_dir()),
                                # the kernels this process launches: its groups or none
                                TITANC_GROUP_LAUNCHES="1" if current().group_launches else "0",
                                TITANC_SPLIT_K="1" if current().split_k else "0",
                                TITANC_GPU_BLOCKS="1" if current().gpu_blocks else "0",
                                TITANC_SCAN_COST="1" if current().scan_cost else "0",
                                TITANC_SCAN_SPLIT=str(current().scan_split),
                                TITANC_SCAN_KERNELS="1" if current().scan_kernels else "0")
        cmd = module_command("titanc.runtime.targets.precompile_worker", "--record", str(src),
                             str(out), *(["--allow-tf32"] if allow_tf32 else []))
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"recording the launches failed: {r.stderr[-1500:]}")
        data = json.loads(out.read_text())
    return data["launches"], {k: data[k] for k in ("grids", "aliases")}


def _marker(plan: Any, key: str | None, arch: int, allow_tf32: bool, jit: bool) -> Path:
    """The marker of one plan: `key` (what the plan was compiled from, stable across
    processes) when the caller has one, else the plan's pickle, which is stable only within
    one process (a plan read back from the compile cache pickles its shared objects
    differently from the one compiled fresh)."""
    import triton

    what = key.encode() if key is not None else pickle.dumps(plan)
    split = f"|split{current().scan_split}" if current().scan_split > 1 else ""
    digest = hashlib.sha256(what + f"{arch}|{allow_tf32}|{jit}|{triton.__version__}|"
                            f"{_code_hash()}|{current().group_launches}|"
                            f"{current().split_k}|{current().gpu_blocks}|"
                            f"{current().scan_cost}|{current().scan_kernels}{split}".encode()
                            ).hexdigest()[:24]
    return cache_dir() / "precompiled" / f"{digest}.json"


def precompile(plans: Any, arch: int, *, allow_tf32: bool = False, float_dtype: Any = None,
               jit: bool = True, jobs: int | None = None, progress: bool = True,
               keys: list[str] | None = None) -> dict[str, Any]:
    """Compile every kernel `plans` (a plan, or a list: one pool for all of them) launch for
    sm_`arch` (module docstring); returns {"kernels", "compiled", "failed": [{"name",
    "error"}], "seconds", "cached", "grids", "aliases", "results"} (`results`:
    `compile_launch`'s rows when `jit` is False). A plan whose marker exists is not recorded
    again; `cached` is true when every plan's was. `keys`, one per plan: what each was
    compiled from (`Program` passes the compile cache's key), so that a later process finds
    the markers."""
    plans = list(plans) if isinstance(plans, (list, tuple)) else [plans]
    keys = list(keys) if keys is not None else [None] * len(plans)
    if len(keys) != len(plans):
        raise ValueError(f"precompile: {len(keys)} keys for {len(plans)} plans")
    markers = [_marker(p, k, arch, allow_tf32, jit) for p, k in zip(plans, keys)]
    done = [_read_marker(m) for m in markers]
    todo = [i for i, d in enumerate(done) if d is None]
    if not todo:
        return _merge(done) | {"cached": True}
    # one process compiles a plan at a time (the ranks of `titanc train --nproc` precompile
    # the same plans at once): the others wait for its marker instead of compiling it again
    with _plan_locks([markers[i] for i in todo], progress):
        done = [_read_marker(m) for m in markers]
        todo = [i for i, d in enumerate(done) if d is None]
        if not todo:
            return _merge(done) | {"cached": True}
        t0 = time.perf_counter()
        launches, shape = recorded_launches([plans[i] for i in todo], allow_tf32, float_dtype)
        results = _pool(launches, arch, jit, jobs or current().compile_slots(), progress)
        failed = [{"name": r["name"], "error": r["error"]} for r in results if not r["ok"]]
        summary = {"kernels": len(launches), "compiled": len(launches) - len(failed),
                   "failed": failed, "seconds": round(time.perf_counter() - t0, 1),
                   "arch": arch, **shape, "results": [] if jit else results}
        if not failed:
            for i in todo:
                tmp = markers[i].with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(summary))
                os.replace(tmp, markers[i])
    return summary | {"cached": False}


MARKER_MAX_BYTES = 64 << 20


def _read_marker(path: Path) -> dict[str, Any] | None:
    """A plan's marker, or None when it is missing, not a regular file of this user, larger
    than `MARKER_MAX_BYTES` or damaged: the plan is then precompiled and the marker written
    again."""
    data = read_regular(path, MARKER_MAX_BYTES)
    try:
        summary = json.loads(data) if data is not None else None
    except ValueError:                 # not JSON, or not UTF-8
        return None
    types = {"kernels": int, "compiled": int, "seconds": (int, float), "failed": list,
             "results": list, "aliases": dict, "grids": dict, "arch": int}
    if not isinstance(summary, dict) or not all(isinstance(summary.get(k), t)
                                                for k, t in types.items()):
        return None
    if not all(isinstance(v, int) for v in summary["grids"].values()):
        return None
    return summary


@contextmanager
def _plan_locks(markers: list[Path], progress: bool) -> Iterator[None]:
    """Hold an exclusive `flock` on each marker's `.lock` file (in sorted order: two
    processes never wait on each other), waiting, with a line on stderr, while another
    process holds one; a killed holder's locks drop with its files."""
    fds: list[int] = []
    try:
        for marker in sorted(set(markers)):
            marker.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(marker.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if progress:
                    print("titanc: another process is compiling these kernels; waiting for it",
                          file=sys.stderr, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        for fd in fds:
            os.close(fd)


def _merge(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several plans' cached summaries as one (a summary several plans share counts once)."""
    distinct = list({json.dumps(s, sort_keys=True): s for s in summaries}.values())
    out: dict[str, Any] = {"kernels": 0, "compiled": 0, "failed": [], "seconds": 0.0,
                           "grids": {}, "aliases": {}, "results": []}
    for s in distinct:
        for k in ("kernels", "compiled", "seconds"):
            out[k] += s[k]
        out["failed"] += s["failed"]
        out["results"] += s["results"]
        out["aliases"] |= s["aliases"]
        for name, programs in s["grids"].items():
            out["grids"][name] = max(out["grids"].get(name, 0), programs)
        out["arch"] = s["arch"]
    return out


def precompile_for_device(plans: Any, allow_tf32: bool = False, float_dtype: Any = None,
                          keys: list[str] | None = None) -> None:
    """`precompile(plans)` for this process's CUDA device, through the JIT (the triton
    target's hook, before it binds a plan; `Program` calls it once with every plan a
    training run launches, and their `keys`). Kernels that fail are named and left to their
    first launch."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    try:
        s = precompile(plans, 10 * major + minor, allow_tf32=allow_tf32,
                       float_dtype=float_dtype, jit=True, keys=keys)
    except RuntimeError as e:          # recording failed: every kernel compiles at launch
        print(f"titanc: precompile skipped ({e})", file=sys.stderr)
        return
    if s["failed"]:
        print(f"titanc: {len(s['failed'])} of {s['kernels']} kernels left to their first "
              f"launch: " + "; ".join(f"{f['name']}: {f['error'][:200]}"
                                      for f in s["failed"][:3]), file=sys.stderr)


class CompileSlots:
    """`count` slots that every titanc process on this machine shares (a user's, through
    the temp dir): slot i is an exclusive `flock` on `<dir>/<i>.lock`, dropped when its file
    is closed, so a killed process frees its slots. The directory is private to its user
    (`cache_files.private_directory`: another user's, or one others may write, is a one-line
    TitancError from `check`: they could hold every slot or point a lock at another file), and
    a lock file is never opened through a symlink."""

    def __init__(self, count: int, root: Path | None = None) -> None:
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        self.count = max(1, count)
        self.root = root or Path(tempfile.gettempdir()) / f"titanc-compile-slots-{uid}"

    def check(self) -> None:
        """Create the directory 0700, or refuse one that is not this user's alone
        (TitancError); OSError when it cannot be made (the pool then runs unlimited)."""
        private_directory(self.root, "compile-slots directory",
                          "set TMPDIR to a directory of your own")

    def try_acquire(self) -> int | None:
        """A free slot's open file descriptor (hold it; `release` it), or None."""
        self.check()
        for i in range(self.count):
            fd = os.open(self.root / f"{i}.lock",
                         os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                os.close(fd)
        return None

    def acquire(self, give_up: Any = lambda: False) -> int | None:
        """A slot, waiting for one (polling, up to 0.5 s apart); None once `give_up()` is
        true while every slot is held."""
        delay = 0.02
        while True:
            fd = self.try_acquire()
            if fd is not None or give_up():
                return fd
            time.sleep(delay)
            delay = min(0.5, 2 * delay)

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)                # closing drops the flock


def _pool(launches: list[dict[str, Any]], arch: int, jit: bool, jobs: int, progress: bool
          ) -> list[dict[str, Any]]:
    """Compile `launches` in `jobs` worker processes (`python -m titanc.runtime.targets.precompile
    --worker`, without the interpreter: subprocesses, not multiprocessing, so a user's
    script is never re-imported), fed one kernel at a time by a thread each (`_feed_worker`).
    A thread starts its worker once it holds one of the machine's `CompileSlots` and keeps it
    until the queue is empty; a thread still waiting then gives up."""
    import threading

    from tqdm import tqdm

    todo: "queue.Queue[dict[str, Any]]" = queue.Queue()
    # the largest kernels first: the pool's wall time ends with its last long compile (a
    # scan kernel started last would be the whole tail)
    for launch in sorted(launches, key=lambda l: -len(l.get("source", ""))):
        todo.put(launch)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    env = child_environment(TRITON_INTERPRET="0", TITANC_CACHE_DIR=str(cache_dir()))
    slots = CompileSlots(current().compile_slots())
    try:
        slots.check()          # a directory another user may write: one line, no pool
    except OSError:
        pass                   # none can be made: each worker finds out and runs unlimited
    bar = tqdm(total=len(launches), desc=f"compiling {len(launches)} kernels for sm_{arch}",
               disable=not progress, file=sys.stderr)

    def record(r: dict[str, Any]) -> None:
        with lock:
            results.append(r)
            bar.update(1)

    def serve() -> None:
        try:
            slot = slots.acquire(give_up=todo.empty)
        except OSError:        # no lock files (an unwritable temp dir): compile unlimited
            slot = -1
        except TitancError:    # the directory was handed to someone else since `check`
            return
        if slot is None:
            return
        try:
            _feed_worker(todo, arch, jit, env, record)
        finally:
            if slot >= 0:
                slots.release(slot)

    threads = [threading.Thread(target=serve) for _ in range(max(1, min(jobs, len(launches))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    done = {r["name"] for r in results}
    # a launch no worker took (a worker that could not start): failed, so no marker claims it
    return results + [{"name": l["name"], "ok": False, "error": "no compile worker ran it"}
                      for l in launches if l["name"] not in done]


def _feed_worker(todo: "queue.Queue[dict[str, Any]]", arch: int, jit: bool,
                 env: dict[str, str], record: Callable[[dict[str, Any]], None]) -> None:
    """Start one compile worker process and feed it the launches of queue `todo`, one at a
    time, until the queue is empty or the worker dies; `record` takes each result (the
    launch a dead worker held fails)."""
    worker = subprocess.Popen(module_command("titanc.runtime.targets.precompile_worker",
                                             "--worker", str(arch), "jit" if jit else "aot"),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert worker.stdin is not None and worker.stdout is not None
    try:
        while True:
            try:
                launch = todo.get_nowait()
            except queue.Empty:
                return
            try:
                worker.stdin.write(json.dumps(launch, default=str) + "\n")
                worker.stdin.flush()
                line = worker.stdout.readline()
            except OSError:                   # it exited before reading (a broken pipe)
                line = ""
            record(json.loads(line) if line else {"name": launch["name"], "ok": False,
                                                  "error": "the worker process died"})
            if not line:
                return
    finally:
        try:
            worker.stdin.close()
        except OSError:
            pass
        worker.wait()
