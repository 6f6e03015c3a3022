"""Ahead-of-time compile of every kernel a program launches, for a CUDA architecture, no GPU.

Triton lowers a kernel to PTX and a cubin with the ptxas inside its wheel; only the launch needs
a driver. Two steps, in two processes (Triton decides at decoration time whether a kernel is
interpreted, so one process cannot do both):

    record_launches(plan)   under TRITON_INTERPRET=1: bind the plan's TritonExecutor and run it
                            once with every kernel launch *recorded instead of executed*: the
                            module source, the signature and specialisation Triton's JIT would
                            derive from the real arguments (`native_specialize_impl`: pointer
                            dtypes, i32/i64 by value, 1 -> constexpr, 16-divisibility), the
                            constexpr keywords and num_warps / num_stages. Distinct launches
                            only (each specialisation once).
    compile_launch(l, arch) without the interpreter: `triton.compile(ASTSource(...),
                            target=GPUTarget("cuda", arch, 32))`; returns shared memory, the
                            registers and spill bytes ptxas reports (`-v`), and whether the PTX
                            holds tensor-core instructions (`mma` / `wgmma`), and the
                            seconds the compile took (`compile_s`, wall; `compile_cpu_s`,
                            CPU seconds of the compiling process and its ptxas: the figure
                            a loaded machine does not inflate), and for a kernel with a
                            dot its main loop's SASS (`mainloop`, the wheel's nvdisasm).

Results are cached on disk (`codegen.render.cache_dir() / "aot"`, keyed by the launch, the
architecture and the Triton version), so a second run compiles nothing.

    python -m titanc.tools.aot examples/tiny.yaml --arch 80 90 [--allow-tf32] [--jobs 2]

prints one JSON line per (launch, arch) and a summary table (`titanc/tools/aot.py`).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from titanc.cache_files import read_regular
from titanc.codegen.render import cache_dir, load_module
from titanc.config import triton_interpret_mode

__all__ = ["Launch", "SHARED_LIMIT", "compile_launch", "fresh_kernel_modules",
           "launch_constexprs", "record_launches", "compile_all"]

# Largest dynamic shared memory a block may use (bytes), per compute capability: A100 163 KiB,
# sm_86/89 99 KiB, H100 227 KiB (the CUDA programming guide's opt-in maxima).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclass(frozen=True)
class Launch:
    """One kernel specialisation as the JIT would compile it."""

    name: str                                 # the @triton.jit function
    source: str                               # its module's text
    signature: tuple[tuple[str, str], ...]    # (argument, type or "constexpr")
    constexprs: tuple[tuple[str, Any], ...]   # (argument, value)
    divisible: tuple[str, ...]                # arguments Triton marks 16-divisible
    num_warps: int
    num_stages: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Launch":
        """The launch `asdict` (through JSON) gave."""
        return cls(**{k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
                      if isinstance(v, list) else v for k, v in d.items()})

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True, default=str)
                              .encode()).hexdigest()[:24]

    @property
    def uses_dot(self) -> bool:
        return "tl.dot(" in self.source

    @property
    def uses_dot16(self) -> bool:
        """A `tl.dot` of 16-bit operand tiles on the GPU (`codegen.meta.mma16`: the launcher's
        DOT_F32 constexpr, false there, picks it). The attention templates (`_mma`) always
        take DOT_F32 and multiply in 16 bits only when q, k and v are 16-bit tensors."""
        if "DOT_F32: tl.constexpr" not in self.source:
            return False
        return "def _mma(" not in self.source or any(
            t in ("*bf16", "*fp16") for _, t in self.signature)

    @property
    def is_scan(self) -> bool:
        return "scan kernel of graph" in self.source

    @property
    def is_matmul(self) -> bool:
        """The matmul family (per-architecture tiles, `tl.dot` at the graph's precision): its
        module defines `tiles_for` (a launch group holds its members' modules as text)."""
        return re.search(r"^def tiles_for\(", self.source, re.M) is not None


@contextlib.contextmanager
def fresh_kernel_modules(cuda_blocks: bool = False, attention: bool = False) -> Any:
    """Inside, kernel modules load afresh (none loaded before is reused, none loaded inside
    is kept after), so equal kernels share the module of the first one loaded inside, and
    the names `record_launches` gives are the same from run to run. `cuda_blocks`: every
    module launches with the blocks it takes on CUDA off CUDA too (the pointwise, reduction
    and cumsum families' `BLOCKS`, `codegen.meta.cuda_flat_block` and `cuda_row_block`): the
    interpreter runs, and `record_launches` records, the grids a GPU would; `attention`: the
    flash-attention kernels' (BLOCK_M, BLOCK_N) too (`meta.attention_cuda_blocks`: another
    summation order, so off where a test wants the same bits). Yields the list of the modules
    whose blocks that changed."""
    from titanc.codegen import render
    from titanc.runtime.targets import triton_executor

    changed: list[Any] = []
    load = render.load_module

    def load_fresh(source: str, name: str, interpret: bool | None = None) -> Any:
        module = load(source, name, interpret)
        blocks = getattr(module, "BLOCKS", None)
        cols = getattr(module, "COLS", None)            # a reduction's column blocks
        if (cuda_blocks and isinstance(blocks, dict)
                and (attention or not isinstance(blocks[True], tuple))
                and (blocks[False] != blocks[True] or (cols and cols[False] != cols[True]))):
            module.BLOCKS = {False: blocks[True], True: blocks[True]}
            if cols:
                module.COLS = {False: cols[True], True: cols[True]}
            changed.append(module)
        return module

    saved = (render.load_module, triton_executor.load_module)
    render.load_module = triton_executor.load_module = load_fresh
    loaded, modules = render.swap_loaded_modules({}), triton_executor.swap_modules({})
    try:
        yield changed
    finally:
        render.load_module, triton_executor.load_module = saved
        render.swap_loaded_modules(loaded)
        triton_executor.swap_modules(modules)


def record_launches(plan: Any, float_dtype: Any = None, allow_tf32: bool = False,
                    grids: dict[str, int] | None = None,
                    aliases: dict[str, str] | None = None,
                    cuda_blocks: bool = False) -> list[Launch]:
    """Every distinct launch of one run of `plan` on the triton target (interpreter process),
    rendered as `TritonExecutor(plan, allow_tf32=...)` renders it; `grids` gets each kernel's
    largest grid (programs per launch) by kernel name, `aliases` each schedule kernel's name
    -> the name of the kernel whose module it launches (equal sources share one module; a
    launch group's member: the group's). `cuda_blocks`: the launches (and grids) with the
    blocks a CUDA launch takes, from fresh modules (`fresh_kernel_modules`)."""
    if cuda_blocks:
        with fresh_kernel_modules(cuda_blocks=True):
            return record_launches(plan, float_dtype, allow_tf32, grids, aliases)
    from triton.runtime.interpreter import InterpretedFunction

    from titanc.runtime.targets.triton_executor import TritonExecutor, interpreting, module_for

    if not interpreting():
        raise RuntimeError("record_launches runs under TRITON_INTERPRET=1")
    recorder = _LaunchRecorder(grids)

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        recorder.record(self, args, grid, kwargs)

    saved = InterpretedFunction.run
    InterpretedFunction.run = record
    try:
        ex = TritonExecutor(plan, float_dtype=float_dtype, cuda_graphs=False,
                            allow_tf32=allow_tf32)
        ex.run()
    finally:
        InterpretedFunction.run = saved
    if aliases is not None:          # a module is named titanc_kernel_<first name>_<digest>
        modules = [(c.name, module_for(c)) for c in ex.kernels()] + [
            (sk.name, ex.scan_module(sk)) for sk in ex._scans.values() if not isinstance(sk, str)]
        for name, module in modules:
            aliases[name] = module.__name__.removeprefix("titanc_kernel_").rsplit("_", 1)[0]
        for group, members in ex.grouped.items():    # a group's members launch in its launch
            aliases.update({m: aliases[group] for m in members})
    return list(recorder.seen.values())


class _LaunchRecorder:
    """Stands in for the interpreter's launch: records each distinct specialisation once (and
    each kernel's largest grid) instead of running it."""

    def __init__(self, grids: dict[str, int] | None) -> None:
        self.grids = grids
        self.seen: dict[str, Launch] = {}
        self.by_fn: dict[Any, tuple[frozenset[str], str]] = {}  # constexprs and source, once
        self.by_spec: dict[tuple[Any, ...], Launch] = {}        # a specialisation met before

    def _constexprs_and_source(self, jit: Any) -> tuple[frozenset[str], str]:
        import inspect
        import linecache
        if jit.fn not in self.by_fn:     # a host loop launches the same kernels every iteration
            params = inspect.signature(jit.fn).parameters
            self.by_fn[jit.fn] = (frozenset(n for n in jit.arg_names
                                            if "constexpr" in str(params[n].annotation)),
                                  "".join(linecache.getlines(inspect.getsourcefile(jit.fn))))
        return self.by_fn[jit.fn]

    def record(self, jit: Any, args: tuple[Any, ...], grid: Any, kwargs: dict[str, Any]) -> None:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl

        names = jit.arg_names
        bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        sig, const, div = [], [], []
        constexpr, source = self._constexprs_and_source(jit)
        fixed = set(getattr(jit, "kwargs", {}).get("do_not_specialize") or ())
        for n in names:
            v = bound[n]
            if n in constexpr:
                sig.append((n, "constexpr"))
                const.append((n, v))
                continue
            ty, attr = native_specialize_impl(BaseBackend, v, False, n not in fixed, True)
            if ty == "constexpr":
                const.append((n, attr))
            if attr == "D":
                div.append(n)
            sig.append((n, ty))
        warps, stages = int(kwargs.get("num_warps", 4)), int(kwargs.get("num_stages", 3))
        # a host loop repeats its launches: hash the specialisation, not the module's text
        # (`Launch.key` serialises it: 13 of large_125m's 27 s of recording)
        fast = (jit.fn, tuple(sig), repr(const), tuple(div), warps, stages)
        if fast not in self.by_spec:
            launch = Launch(jit.fn.__name__, source, tuple(sig), tuple(const), tuple(div),
                            warps, stages)
            self.by_spec[fast] = self.seen.setdefault(launch.key(), launch)
        launch = self.by_spec[fast]
        if self.grids is not None:
            shape = grid(bound) if callable(grid) else grid
            programs = math.prod(int(x) for x in (shape if isinstance(shape, tuple) else
                                                  (shape,)))
            self.grids[launch.name] = max(self.grids.get(launch.name, 0), programs)


_PTXAS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


_MMA_SASS = re.compile(r"\b(HGMMA|HMMA|DMMA|IMMA)\b")
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_SASS_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\b[^;]*?\.?(L_x_\d+)")


def mainloop(sass: str) -> dict[str, int] | None:
    """The main loop of a kernel's SASS (`nvdisasm -c`): the longest loop (a label and a
    branch back to it) that holds a tensor-core instruction; its instructions (what the warp
    schedulers issue per iteration), the tensor-core instructions among them, and its shared
    memory stores (an operand staged through registers is stored each iteration; one loaded
    by async copy is not). None without such a loop."""
    ins: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            labels[label.group(1)] = len(ins)
        m = _SASS_LINE.search(line)
        if m:
            ins.append(m.group(2).strip())
    best: list[str] | None = None
    for i, text in enumerate(ins):
        m = _SASS_BRANCH.search(text)
        if m and labels.get(m.group(1), i) < i:
            body = ins[labels[m.group(1)]:i + 1]
            if any(_MMA_SASS.search(x) for x in body) and (best is None or len(body) > len(best)):
                best = body
    if best is None:
        return None
    return {"instructions": len(best), "mma": sum(bool(_MMA_SASS.search(x)) for x in best),
            "shared_stores": sum(bool(re.search(r"\bSTS\b", x)) for x in best)}


def _sass(cubin: bytes) -> str:
    """The wheel's `nvdisasm -c` of `cubin` ("" where the wheel has none)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    tool = Path(get_ptxas(80).path).with_name("nvdisasm")
    if not tool.exists():
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        r = subprocess.run([str(tool), "-c", str(path)], capture_output=True, text=True)
    return r.stdout


def _ptxas_log(ptx: str, arch: int) -> str:
    """`ptxas -v` of `ptx` for sm_`arch` (as Triton runs it: sm_90a on Hopper)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={name}", str(src), "-o",
                            str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    return r.stdout + r.stderr


def _cpu_seconds() -> float:
    """CPU seconds of this process (every thread) and its finished children (ptxas): what a
    compile costs, whatever else the machine runs."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ru.ru_utime + ru.ru_stime


def launch_constexprs(launch: Launch, module: Any, arch: int) -> tuple[dict[str, Any], int, int]:
    """The constexprs, num_warps and num_stages the CUDA launcher passes for `launch` (recorded
    off CUDA): the matmul family's tile of the architecture (`tiles_for`), a template's own
    CUDA blocks (`cuda_constexprs`; a launch group's members' too, and `cuda_options`), the
    16-bit MMA (`DOT_F32` off) and a split scan kernel's group barriers (`SPLIT_SERIAL`
    off)."""
    constexprs, warps, stages = dict(launch.constexprs), launch.num_warps, launch.num_stages
    if hasattr(module, "tiles_for"):
        bm, bn, bk, warps, stages = module.tiles_for(arch)
        constexprs |= {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    if hasattr(module, "cuda_constexprs"):
        constexprs |= module.cuda_constexprs(arch)
    if hasattr(module, "cuda_options"):        # a launch group: its members' largest
        warps, stages = module.cuda_options(arch)
    if "DOT_F32" in constexprs:
        constexprs["DOT_F32"] = False
    if "SPLIT_SERIAL" in constexprs:           # a split scan kernel: its programs meet
        constexprs["SPLIT_SERIAL"] = False     # at group barriers
    return constexprs, warps, stages


def _cached_result(path: Path) -> dict[str, Any] | None:
    """A compile result written before, or None when there is none or it is damaged, not a
    regular file of this user or too large (`cache_files.read_regular`): compiled again."""
    data = read_regular(path, 1 << 20)
    try:
        result = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return result if isinstance(result, dict) and result.get("ok") is True else None


def compile_launch(launch: Launch, arch: int) -> dict[str, Any]:
    """Compile `launch` for sm_`arch` (a process without the interpreter); cached on disk."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path = cache_dir() / "aot" / f"{launch.key()}_sm{arch}_{triton.__version__}_v4.json"
    cached = _cached_result(path)
    if cached is not None:
        return cached
    result: dict[str, Any] = {"name": launch.name, "arch": arch, "uses_dot": launch.uses_dot,
                              "scan": launch.is_scan, "matmul": launch.is_matmul}
    module = load_module(launch.source, launch.name, interpret=False)
    fn = getattr(module, launch.name)
    index = {n: i for i, (n, _) in enumerate(launch.signature)}
    sig = dict(launch.signature)
    # recorded off CUDA: the architecture's tile or blocks, and the 16-bit MMA
    constexprs, warps, stages = launch_constexprs(launch, module, arch)
    if hasattr(module, "tiles_for"):          # wgmma needs BLOCK_M >= 64 (a warpgroup's rows)
        result["tile"] = [constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")]
    result |= {"num_warps": warps, "num_stages": stages}
    attrs = {(index[n],): [["tt.divisibility", 16]] for n in launch.divisible}
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True
    t0, c0 = time.perf_counter(), _cpu_seconds()
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(fn, sig, constexprs, attrs),
                               target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": warps, "num_stages": stages})
    except Exception as e:  # a failed compile is a result, reported by the caller
        result |= {"ok": False, "error": f"{type(e).__name__}: {str(e)[-800:]}"}
    else:
        text, ptx = log.getvalue(), k.asm["ptx"]
        if not _PTXAS.search(text):             # Triton's own cache hit: no ptxas ran
            text = _ptxas_log(ptx, arch)
        regs, spill, stack = _PTXAS.search(text), _SPILL.search(text), _STACK.search(text)
        result |= {"ok": True, "compile_s": round(time.perf_counter() - t0, 2),
                   "compile_cpu_s": round(_cpu_seconds() - c0, 2),
                   "shared": int(k.metadata.shared),
                   "registers": int(regs.group(1)) if regs else None,
                   "spill_bytes": int(spill.group(1)) if spill else 0,
                   "stack_bytes": int(stack.group(1)) if stack else 0,
                   "mma": bool(re.search(r"\b(w?gmma|mma)\.", ptx)),
                   "mma_bf16": bool(re.search(r"\b(w?gmma|mma)\.[\w.]*\.bf16", ptx)),
                   "wgmma": "wgmma." in ptx}
        if launch.uses_dot:
            result["mainloop"] = mainloop(_sass(k.asm["cubin"]))
    finally:
        knobs.nvidia.dump_ptxas_log = False
    if not result["ok"]:          # not cached: a failure can be the process's, not the kernel's
        return result             # (a worker left in interpreter mode fails every kernel)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    return result


def _compile_one(item: tuple[dict[str, Any], int]) -> dict[str, Any]:
    data, arch = item
    return compile_launch(Launch.from_dict(data), arch)


def compile_all(launches: Iterable[Launch], archs: Iterable[int], jobs: int = 1
                ) -> list[dict[str, Any]]:
    """`compile_launch` for every (launch, arch), in a fresh process pool of `jobs` workers
    started without TRITON_INTERPRET (the caller may be an interpreter process), the largest
    kernels first (a pool's wall time ends with its last long compile)."""
    import multiprocessing as mp

    launches = list(launches)
    items = sorted(((asdict(l), a) for l in launches for a in archs),
                   key=lambda it: -len(it[0]["source"]))
    with triton_interpret_mode(None), mp.get_context("spawn").Pool(max(1, jobs)) as pool:
        done = pool.map(_compile_one, items, chunksize=1)
    by_key = {(Launch.from_dict(it[0]).key(), it[1]): r for it, r in zip(items, done)}
    results = [by_key[(l.key(), a)] for l in launches for a in archs]
    more = [{"dot16": l.uses_dot16} for l in launches for _ in archs]
    return [r | m for r, m in zip(results, more)]
