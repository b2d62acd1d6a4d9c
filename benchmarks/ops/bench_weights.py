"""Weight-format kernels (ppq::weight_*, C++ CPU) against their references, bitsandbytes and a copy.

    .venv/bin/python benchmarks/ops/bench_weights.py [--rows 4096 --cols 4096] [--block 64] [--reps 7]

For every format (int8, int4, nf4, fp8_e4m3, fp8_e5m2) and input dtype (fp32, bf16) the C++ kernel's
codes, scales and dequantized values are first checked bit for bit against the plain-PyTorch
reference, then each op is timed into reused buffers (median of ``--reps``; references
``--ref-reps``). Columns:
  ms         median time of one call
  GB/s       bytes of the full-precision tensor / time (input of quantize, output of dequantize)
  x copy     median time of ``dst.copy_(w)`` (same dtype, same bytes; copy and op alternate, so
             both see the same load from other processes) / median op time
  x copy min the same ratio from the fastest run of each (the least disturbed)
  x ref      reference time / op time
  bnb        bitsandbytes' op where it has one: ``quantize_4bit``/``dequantize_4bit`` (nf4, same
             codes) and ``quantize_blockwise``/``dequantize_blockwise`` (int8 row: its dynamic
             8-bit code, a different format of the same size). bnb cannot write into a reused
             buffer on CPU (``out=`` raises), so its dequantize allocates.
Dequantize writes the input dtype (fp32 -> fp32, bf16 -> bf16).
Results: benchmarks/results/bench_weights.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch

from deepspeed_ppq.ops import has_kernel, native_status, registered_ops
from deepspeed_ppq.quant import ops as wops

REF = registered_ops()
HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "..", "results")


def _time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _time_vs_copy(fn, copy, reps: int) -> tuple[float, float, float, float]:
    """Alternate copy and op so both see the same load: (op median, copy median, op min, copy min)."""
    fn()
    copy()
    t_op, t_copy = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        t_copy.append(t1 - t0)
        t_op.append(t2 - t1)
    return statistics.median(t_op), statistics.median(t_copy), min(t_op), min(t_copy)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _loadavg() -> str:
    """1/5/15-minute load averages: the CPU is shared, so say how busy it was."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def _bnb():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes
            import bitsandbytes.functional as F
        return F, bitsandbytes.__version__
    except Exception as e:  # bnb is optional for this benchmark
        return None, f"unavailable: {e}"


def _check(w, fmt, block, codes, scales, out):
    """C++ == reference, bit for bit, on the benchmark tensor itself."""
    rc, rs = torch.empty_like(codes), torch.empty_like(scales)
    REF["weight_quantize_out"](w, fmt, block, rc, rs)
    torch.ops.ppq.weight_quantize_out(w, fmt, block, codes, scales)
    assert torch.equal(scales, rs), f"{fmt} {w.dtype}: scales differ from the reference"
    assert torch.equal(codes.view(torch.uint8), rc.view(torch.uint8)), f"{fmt} {w.dtype}: codes differ"
    ro = torch.empty_like(out)
    REF["weight_dequantize_out"](codes, scales, fmt, block, ro)
    torch.ops.ppq.weight_dequantize_out(codes, scales, fmt, block, out)
    assert torch.equal(out, ro), f"{fmt} {w.dtype}: dequantized values differ from the reference"


def _bnb_rows(F, w, fmt, block, reps, copy_t):
    rows = []
    if fmt == "nf4":
        q, state = F.quantize_4bit(w, blocksize=block, quant_type="nf4")
        t = _time(lambda: F.quantize_4bit(w, blocksize=block, quant_type="nf4"), max(2, reps // 3))
        rows.append(("quantize", "bnb quantize_4bit nf4", t))
        t = _time(lambda: F.dequantize_4bit(q, state), reps)
        rows.append(("dequantize", "bnb dequantize_4bit nf4 (allocates)", t))
    elif fmt == "int8":
        q, state = F.quantize_blockwise(w, blocksize=block)
        qb = torch.empty_like(q)
        t = _time(lambda: F.quantize_blockwise(w, blocksize=block, out=qb), reps)
        rows.append(("quantize", "bnb quantize_blockwise (dynamic 8-bit code)", t))
        t = _time(lambda: F.dequantize_blockwise(q, state), reps)
        rows.append(("dequantize", "bnb dequantize_blockwise (allocates)", t))
    return [(kind, name, t, copy_t / t) for kind, name, t in rows]


def _format_rows(w, dst, fmt, block, reps, ref_reps, F) -> list[dict]:
    n = w.numel()
    fp_bytes = n * w.element_size()
    dtype = str(w.dtype).replace("torch.", "")
    codes = torch.empty(wops.codes_numel(fmt, n), dtype=wops.code_dtype(fmt))
    scales = torch.empty(wops.num_blocks(n, block))
    out = torch.empty_like(w)
    _check(w, fmt, block, codes, scales, out)
    rc, rs, ro = torch.empty_like(codes), torch.empty_like(scales), torch.empty_like(out)
    ops = {
        "quantize": (lambda: torch.ops.ppq.weight_quantize_out(w, fmt, block, codes, scales),
                     lambda: REF["weight_quantize_out"](w, fmt, block, rc, rs)),
        "dequantize": (lambda: torch.ops.ppq.weight_dequantize_out(codes, scales, fmt, block, out),
                       lambda: REF["weight_dequantize_out"](codes, scales, fmt, block, ro)),
    }
    rows = []
    for kind, (fast, ref) in ops.items():
        t, copy_t, t_min, copy_min = _time_vs_copy(fast, lambda: dst.copy_(w), reps)
        tr = _time(ref, ref_reps)
        rows.append({"format": fmt, "dtype": dtype, "op": kind, "ms": t * 1e3, "GB/s": fp_bytes / t / 1e9,
                     "copy_ms": copy_t * 1e3, "x_copy": copy_t / t, "min_ms": t_min * 1e3,
                     "copy_min_ms": copy_min * 1e3, "x_copy_min": copy_min / t_min,
                     "ref_ms": tr * 1e3, "x_ref": tr / t})
    if F is not None and fmt in ("nf4", "int8"):
        copy_t = _time(lambda: dst.copy_(w), reps)
        for kind, name, t, xc in _bnb_rows(F, w, fmt, block, reps, copy_t):
            mine = next(r for r in rows if r["op"] == kind)
            mine.update({"bnb": name, "bnb_ms": t * 1e3, "bnb_x_copy": xc, "x_bnb": t / (mine["ms"] / 1e3)})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--ref-reps", type=int, default=2)
    ap.add_argument("--formats", nargs="*", default=list(wops.WEIGHT_FORMATS))
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    assert native_status()["_C"] == "loaded", f"C++ extension: {native_status()['_C']} (run `make build`)"
    assert all(has_kernel(n) for n in ("weight_quantize_out", "weight_dequantize_out"))
    F, bnb_version = _bnb()
    load_start = _loadavg()
    shape, block, reps = (args.rows, args.cols), args.block, args.reps
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
        dst = torch.empty_like(w)
        for fmt in args.formats:
            results.extend(_format_rows(w, dst, fmt, block, reps, args.ref_reps, F))
    meta = {
        "shape": list(shape), "block_size": block, "reps": reps, "ref_reps": args.ref_reps,
        "torch": torch.__version__, "bitsandbytes": bnb_version, "threads": torch.get_num_threads(),
        "cpu": _cpu_model(), "cores": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": _loadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python benchmarks/ops/bench_weights.py", *(sys.argv[1:] if argv is None
                                                                            else argv)]),
    }
    md = _table(results, meta)
    print(md)
    if not args.no_save:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "bench_weights.json"), "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        with open(os.path.join(RESULTS, "bench_weights.md"), "w") as f:
            f.write(md)
    return {"meta": meta, "results": results}


def _table(results, meta) -> str:
    lines = [
        f"# bench_weights: {meta['shape'][0]}x{meta['shape'][1]} weight, block {meta['block_size']}",
        "",
        f"torch {meta['torch']}, bitsandbytes {meta['bitsandbytes']}, {meta['cpu']}, {meta['cores']} cores, "
        f"{meta['threads']} threads, {meta['date']}, load average {meta['loadavg_start']} at the start and "
        f"{meta['loadavg_end']} at the end. Median of {meta['reps']} "
        f"(references: {meta['ref_reps']}). "
        "Every C++ result was checked bit for bit against the reference first.",
        "GB/s = full-precision bytes / time; x copy = time of copying the same fp bytes / op time "
        "(medians; x copy min: fastest runs); "
        "x ref = reference time / op time; x bnb = bitsandbytes time / op time.",
        "",
        "| format | dtype | op | ms | GB/s | copy ms | x copy | x copy min | ref ms | x ref "
        "| bitsandbytes | bnb ms | bnb x copy | x bnb |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        bnb = (f"{r['bnb']} | {r['bnb_ms']:.1f} | {r['bnb_x_copy']:.2f} | {r['x_bnb']:.1f}"
               if "bnb" in r else "- | - | - | -")
        lines.append(f"| {r['format']} | {r['dtype']} | {r['op']} | {r['ms']:.2f} | {r['GB/s']:.1f} | "
                     f"{r['copy_ms']:.2f} | {r['x_copy']:.2f} | {r['x_copy_min']:.2f} | {r['ref_ms']:.0f} | "
                     f"{r['x_ref']:.0f} | {bnb} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
