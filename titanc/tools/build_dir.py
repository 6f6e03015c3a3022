"""A `titanc compile` output directory as `titanc inspect` reads it: `open_artifact` checks
that a path is one and parses its report.json, checking every field inspect reads, so a
damaged or hand-edited report is one `TitancError` line naming the field and the fix
(recompile), never a traceback.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanc.errors import TitancError, printable

__all__ = ["BuildDir", "open_artifact", "MAX_COUNT", "MAX_DEPTH"]


@dataclass(frozen=True)
class BuildDir:
    """A compiled artifact directory and its parsed report.json."""
    path: Path
    report: dict[str, Any]

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def kernels(self) -> list[dict[str, Any]]:
        return list(self.report.get("kernels", []))


def open_artifact(path: str | Path) -> BuildDir:
    """Check that `path` is a `titanc compile` output directory and parse its report: every
    field inspect reads is checked here, so a damaged report is one line naming the field."""
    p = Path(path)
    fix = f"create one with 'titanc compile SPEC -o {p}'"
    if not p.exists():
        raise TitancError(f"{p}: no such artifact directory; {fix}")
    if not p.is_dir():
        raise TitancError(f"{p}: not a directory; pass the directory 'titanc compile -o' wrote")
    report = p / "report.json"
    if not report.exists():
        if (p / "spec.yaml").is_file() and (p / "metrics.jsonl").exists():
            raise TitancError(f"{p}: a run directory ('titanc train' wrote it), not a compiled "
                              f"artifact; compile its spec with 'titanc compile "
                              f"{p / 'spec.yaml'} -o build/NAME' and inspect that")
        raise TitancError(f"{p}: not a titanc artifact (no report.json); {fix}")
    try:
        data = json.loads(report.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise TitancError(f"{report}: unreadable ({exc}); recompile with "
                          f"'titanc compile'") from None
    if not isinstance(data, dict) or not isinstance(data.get("kernels", []), list):
        raise TitancError(f"{report}: not a titanc report; recompile with 'titanc compile'")
    for i, k in enumerate(data.get("kernels", [])):
        if not _kernel_row_ok(k):
            raise TitancError(f"{report}: kernels[{i}] is malformed (name and category must be "
                              f"strings, flops, bytes and nodes numbers); recompile with "
                              f"'titanc compile'")
        bad = _bad_row_field(k)
        if bad:
            raise TitancError(f"{report}: kernels[{i}].{bad}; recompile with "
                              f"'titanc compile'")
    bad = _bad_report_field(data)
    if bad:
        raise TitancError(f"{report}: {bad}; recompile with 'titanc compile'")
    return BuildDir(p, data)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _kernel_row_ok(k: Any) -> bool:
    return (isinstance(k, dict) and isinstance(k.get("name"), str)
            and isinstance(k.get("category"), str)
            and all(_number(k.get(f)) for f in ("flops", "bytes", "nodes"))
            and all(_number(k.get(f, 0)) for f in ("launches", "depth")))


MAX_COUNT = 2 ** 63        # FLOPs, bytes, launches: what an int64 counter holds
MAX_DEPTH = 64             # scans nested in scans (a model nests two or three)


def _count_ok(v: Any, integral: bool = False) -> bool:
    """A finite, non-negative number below MAX_COUNT (an integer when `integral`)."""
    if not _number(v) or not 0 <= v < MAX_COUNT:       # NaN fails both comparisons
        return False
    return not integral or float(v).is_integer()


def _bad_row_field(k: dict[str, Any]) -> str:
    """'' or '<field> is <value>, expected ...' for a kernel row's first bad number."""
    for f in ("flops", "bytes", "nodes", "launches"):
        if f in k and not _count_ok(k[f], integral=f in ("nodes", "launches")):
            return (f"{f} is {_show(k[f])}, expected a non-negative "
                    f"{'integer' if f in ('nodes', 'launches') else 'number'} below 2**63")
    if "depth" in k and not (_count_ok(k["depth"], integral=True) and k["depth"] <= MAX_DEPTH):
        return f"depth is {_show(k['depth'])}, expected an integer in [0, {MAX_DEPTH}]"
    return ""


def _bad_report_field(r: dict[str, Any]) -> str:
    """'' or the first field of report.json (besides `kernels`) that inspect reads and that
    has the wrong type: the header's name, hash, parameters and kernel counts, the memory
    sections and the step section."""
    for f in ("name", "spec_hash"):
        if f in r and not isinstance(r[f], str):
            return f"{f} is {_show(r[f])}, expected a string"
    if "parameters" in r and not (r["parameters"] is None or _count_ok(r["parameters"])):
        return f"parameters is {_show(r['parameters'])}, expected a non-negative number"
    counts = r.get("kernel_counts", {})
    if not isinstance(counts, dict):
        return f"kernel_counts is {_show(counts)}, expected a mapping of graph to count"
    for g, v in counts.items():
        if not _count_ok(v, integral=True):
            return f"kernel_counts.{printable(g, 40)} is {_show(v)}, expected a count"
    for sec in ("memory", "memory_forward"):
        m = r.get(sec)
        if m is None:
            continue
        if not isinstance(m, dict):
            return f"{sec} is {_show(m)}, expected a mapping of field to bytes"
        for f in _MEMORY_FIELDS:                     # the fields memory_summary reads
            if f in m and not _count_ok(m[f]):
                return f"{sec}.{f} is {_show(m[f])}, expected a number of bytes"
    step = r.get("step")
    if isinstance(step, dict) and all(isinstance(step.get(k), dict) for k in ("before", "after")):
        for side in ("before", "after"):
            s = step[side]
            for f in ("kernels", "kernels_all", "bytes", "flops"):
                if f in s and not (s[f] is None or _count_ok(s[f])):
                    return f"step.{side}.{f} is {_show(s[f])}, expected a count"
            fams = s.get("families", {})
            if not isinstance(fams, dict):
                return f"step.{side}.families is {_show(fams)}, expected a mapping"
            for fam, row in fams.items():
                where = f"step.{side}.families.{printable(fam, 40)}"
                if not isinstance(row, dict):
                    return f"{where} is {_show(row)}, expected a mapping"
                for f in ("kernels", "launches", "bytes", "flops"):
                    if not _count_ok(row.get(f)):
                        return f"{where}.{f} is {_show(row.get(f))}, expected a count"
    return ""


_MEMORY_FIELDS = ("arena_bytes", "lower_bound_bytes", "peak_activation_bytes",
                  "persistent_bytes", "logits_bytes")


def _show(v: Any) -> str:
    text = ascii(v)
    return text if len(text) <= 40 else text[:37] + "..."
