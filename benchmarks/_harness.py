"""The benchmarks' shared harness: machine record, timing against a baseline, results files.

Small on purpose; a benchmark uses these:

    from benchmarks._harness import machine, results_name, time_against, x_copy, write_results
    # (a script in benchmarks/<concern>/: sys.path.insert(0, <repo>/benchmarks); from _harness import ...)

    m = machine()                                   # CPU model, ISA flags, cores, load, torch, ISA path
    t = time_against(op, lambda: dst.copy_(src), reps=11)   # alternating runs, medians and minima
    ratio = x_copy(op_bytes, t.op, copy_bytes, t.base)       # bytes/s of the op over bytes/s of the copy
    write_results(results_name("bench_weights"), rows, meta={"shape": ...}, title="...", machine_=m)
                                                    # -> benchmarks/results/bench_weights_avx512.{json,md}

* ``machine()`` returns a dict: ``cpu`` (model name), ``cpu_flags`` (the SIMD flags of
  /proc/cpuinfo), ``cores`` (os.cpu_count), ``threads`` (torch's), ``loadavg`` (1/5/15 min),
  ``torch``, ``python``, ``cpu_isa`` (deepspeed_ppq.ops.cpu_isa(): the C++ kernels' path),
  ``supported_cpu_isas``, ``gpu`` and ``date`` (UTC). Call it at the start and ``loadavg()`` again at
  the end: the CPU may be shared, so results say how busy it was. ``machine_line(m)`` formats it as
  the one line a results file starts with.
* ``time_against(op, base, reps)`` runs ``base`` then ``op`` alternately ``reps`` times after one
  warm-up call of each, so both see the same load from other processes; it returns a ``Timing`` with
  the medians (``op``, ``base``) and minima (``op_min``, ``base_min``) in seconds, and ``ratio``
  (= base / op, the time ratio). ``time_once(fn, reps)`` is the same without a baseline.
* ``x_copy(op_bytes, op_s, copy_bytes, copy_s)``: "x copy" counted honestly, the op's bytes read +
  written per second over the copy's bytes read + written per second.
* ``results_name("bench_weights")`` is ``"bench_weights_<ISA path>"`` (``bench_weights_avx512``): a kernel
  benchmark's results are named by the path it ran, so the records of an AVX2 and an AVX-512 machine
  (and of a forced ``PPQ_CPU_ISA=scalar`` run) stand side by side.
* ``write_results(name, rows, meta, title, notes, columns)`` writes ``<name>.json`` ({"machine",
  "meta", "results"}) and ``<name>.md`` (title, one machine line with the ISA path and the load,
  notes, a table of ``rows``, a list of dicts, in ``columns`` order) under benchmarks/results/.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "Timing",
    "machine",
    "machine_line",
    "loadavg",
    "time_against",
    "time_once",
    "x_copy",
    "results_name",
    "write_results",
    "write_report",
    "md_table",
]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "bmi2",
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512vbmi",
    "avx512_bf16",
    "amx_tile",
    "asimd",
    "sve",
)


@dataclasses.dataclass
class Timing:
    """Seconds per call: medians (op, base) and minima (op_min, base_min) of alternating runs."""

    op: float
    base: float
    op_min: float
    base_min: float

    @property
    def ratio(self) -> float:
        """base / op: how many times faster than the baseline the op is (medians)."""
        return self.base / self.op


def loadavg() -> str:
    """1/5/15-minute load averages ("unknown" where there is no /proc/loadavg)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key == "model name" and model in ("", platform.processor() or platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif key in ("flags", "Features") and not flags:
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    return model, [f for f in _SIMD_FLAGS if f in flags]


def machine() -> dict:
    """Where and with what the benchmark runs (see the module docstring)."""
    from deepspeed_ppq import ops

    model, flags = _cpuinfo()
    return {
        "cpu": model,
        "cpu_flags": " ".join(flags),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "loadavg": loadavg(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_isa": ops.cpu_isa(),
        "supported_cpu_isas": " ".join(ops.supported_cpu_isas()),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def time_once(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def time_against(op: Callable[[], object], base: Callable[[], object], reps: int, warmup: int = 1) -> Timing:
    """Alternate ``base`` and ``op`` ``reps`` times (after ``warmup`` calls of each): medians and minima."""
    for _ in range(warmup):
        base()
        op()
    t_op, t_base = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        op()
        t2 = time.perf_counter()
        t_base.append(t1 - t0)
        t_op.append(t2 - t1)
    return Timing(statistics.median(t_op), statistics.median(t_base), min(t_op), min(t_base))


def x_copy(op_bytes: float, op_s: float, copy_bytes: float, copy_s: float) -> float:
    """(op bytes read + written per second) / (copy bytes read + written per second)."""
    return (op_bytes / op_s) / (copy_bytes / copy_s)


def machine_line(m: dict) -> str:
    """One markdown line saying where a result comes from (a ``machine()`` record)."""
    end = f", {m['loadavg_end']} at the end" if "loadavg_end" in m else ""
    return (
        f"{m['cpu']} ({m['cores']} cores, {m['threads']} threads; flags: {m['cpu_flags'] or 'n/a'}), "
        f"**C++ kernel path: {m['cpu_isa']}** (this CPU runs: {m['supported_cpu_isas']}), "
        f"torch {m['torch']}, {m['date']}, load average {m['loadavg']} at the start{end}."
    )


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "-" if v is None else str(v)


def md_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """A markdown table of ``rows`` (dicts), columns in ``columns`` order (default: the first row's keys)."""
    if not rows:
        return "(no rows)\n"
    cols = list(columns or rows[0].keys())
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def results_name(base: str) -> str:
    """``<base>_<ISA path>``: the results file of a kernel benchmark, per C++ kernel path it ran."""
    from deepspeed_ppq import ops

    return f"{base}_{ops.cpu_isa()}"


def write_results(
    name: str,
    rows: Sequence[dict],
    meta: dict | None = None,
    title: str = "",
    notes: Sequence[str] = (),
    columns: Sequence[str] | None = None,
    machine_: dict | None = None,
    save: bool = True,
) -> str:
    """Write benchmarks/results/<name>.json and .md (unless ``save`` is False); return the markdown."""
    m = dict(machine_ or machine())
    m["loadavg_end"] = loadavg()
    md = [f"# {title or name}", "", machine_line(m)]
    md.append("")
    md += [f"{n}" for n in notes]
    if notes:
        md.append("")
    md.append(md_table(rows, columns))
    text = "\n".join(md)
    if save:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
            json.dump({"machine": m, "meta": meta or {}, "results": list(rows)}, f, indent=1, default=str)
        with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
            f.write(text)
    return text


def write_report(name: str, data: dict, markdown: str) -> None:
    """Write benchmarks/results/<name>.json (``data``) and .md (``markdown``, written by the benchmark,
    which starts it with ``machine_line``): for results that are not one table."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(markdown)
    print(f"wrote {os.path.join(RESULTS, name)}.json and .md")
