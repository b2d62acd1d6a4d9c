"""Weight-format kernels (ppq::weight_*, C++ CPU) against their references, bitsandbytes and a copy.

    .venv/bin/python benchmarks/ops/bench_weights.py [--rows 4096 --cols 4096] [--block 64] [--reps 7]

For every format (int8, int4, nf4, fp8_e4m3, fp8_e5m2) and input dtype (fp32, bf16) the C++ kernel's
codes, scales and dequantized values are first checked bit for bit against the plain-PyTorch
reference, then each op is timed into reused buffers (median of ``--reps``, alternating with a copy;
references ``--ref-reps``), with benchmarks/_harness.py. Columns:
  ms         median time of one call
  GB/s       bytes of the full-precision tensor / time (input of quantize, output of dequantize)
  x copy     the op's bytes read + written per second (fp tensor + codes + scales) over those of
             ``dst.copy_(w)`` (reads and writes the fp tensor), medians of the same run (copy and op
             alternate, so both see the same load from other processes)
  x copy min the same ratio from the fastest run of each (the least disturbed)
  x ref      reference time / op time
  bnb        bitsandbytes' op where it has one: ``quantize_4bit``/``dequantize_4bit`` (nf4, same
             codes) and ``quantize_blockwise``/``dequantize_blockwise`` (int8 row: its dynamic
             8-bit code, a different format of the same size). bnb cannot write into a reused
             buffer on CPU (``out=`` raises), so its dequantize allocates.
Dequantize writes the input dtype (fp32 -> fp32, bf16 -> bf16).
Results: benchmarks/results/bench_weights_<ISA path>.{json,md} (``_avx512``, ``_avx2``, or a forced
``PPQ_CPU_ISA=scalar`` run's ``_scalar``), with the machine and the C++ kernel path.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import machine, results_name, time_against, time_once, write_results, x_copy  # noqa: E402

from deepspeed_ppq.ops import cpu_isa, has_kernel, native_status, registered_ops  # noqa: E402
from deepspeed_ppq.quant import ops as wops  # noqa: E402

REF = registered_ops()


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


def _bnb_rows(F, w, fmt, block, reps, copy_t, op_bytes):
    rows = []
    if fmt == "nf4":
        q, state = F.quantize_4bit(w, blocksize=block, quant_type="nf4")
        t = time_once(lambda: F.quantize_4bit(w, blocksize=block, quant_type="nf4"), max(2, reps // 3))
        rows.append(("quantize", "bnb quantize_4bit nf4", t))
        t = time_once(lambda: F.dequantize_4bit(q, state), reps)
        rows.append(("dequantize", "bnb dequantize_4bit nf4 (allocates)", t))
    elif fmt == "int8":
        q, state = F.quantize_blockwise(w, blocksize=block)
        qb = torch.empty_like(q)
        t = time_once(lambda: F.quantize_blockwise(w, blocksize=block, out=qb), reps)
        rows.append(("quantize", "bnb quantize_blockwise (dynamic 8-bit code)", t))
        t = time_once(lambda: F.dequantize_blockwise(q, state), reps)
        rows.append(("dequantize", "bnb dequantize_blockwise (allocates)", t))
    copy_bytes = 2 * w.numel() * w.element_size()
    return [(kind, name, t, x_copy(op_bytes[kind], t, copy_bytes, copy_t)) for kind, name, t in rows]


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
        "quantize": (
            lambda: torch.ops.ppq.weight_quantize_out(w, fmt, block, codes, scales),
            lambda: REF["weight_quantize_out"](w, fmt, block, rc, rs),
        ),
        "dequantize": (
            lambda: torch.ops.ppq.weight_dequantize_out(codes, scales, fmt, block, out),
            lambda: REF["weight_dequantize_out"](codes, scales, fmt, block, ro),
        ),
    }
    # bytes read + written: the fp tensor, the codes and the scales (either way round)
    op_bytes = fp_bytes + codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
    copy_bytes = 2 * fp_bytes
    rows = []
    for kind, (fast, ref) in ops.items():
        t = time_against(fast, lambda: dst.copy_(w), reps)
        tr = time_once(ref, ref_reps)
        rows.append(
            {
                "format": fmt,
                "dtype": dtype,
                "op": kind,
                "ms": t.op * 1e3,
                "GB/s": fp_bytes / t.op / 1e9,
                "copy_ms": t.base * 1e3,
                "x_copy": x_copy(op_bytes, t.op, copy_bytes, t.base),
                "x_copy_min": x_copy(op_bytes, t.op_min, copy_bytes, t.base_min),
                "ref_ms": tr * 1e3,
                "x_ref": tr / t.op,
                "op_bytes": op_bytes,
            }
        )
    if F is not None and fmt in ("nf4", "int8"):
        copy_t = time_once(lambda: dst.copy_(w), reps)
        for kind, name, t, xc in _bnb_rows(
            F, w, fmt, block, reps, copy_t, {"quantize": op_bytes, "dequantize": op_bytes}
        ):
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
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    assert native_status()["_C"] == "loaded", f"C++ extension: {native_status()['_C']} (run `make build`)"
    assert all(has_kernel(n) for n in ("weight_quantize_out", "weight_dequantize_out"))
    F, bnb_version = _bnb()
    m = machine()
    shape, block, reps = (args.rows, args.cols), args.block, args.reps
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
        dst = torch.empty_like(w)
        for fmt in args.formats:
            results.extend(_format_rows(w, dst, fmt, block, reps, args.ref_reps, F))
    env = f"PPQ_CPU_ISA={os.environ['PPQ_CPU_ISA']} " if os.environ.get("PPQ_CPU_ISA") else ""
    cli = sys.argv[1:] if argv is None else argv
    command = env + " ".join([".venv/bin/python benchmarks/ops/bench_weights.py", *cli])
    meta = {
        "shape": list(shape),
        "block_size": block,
        "reps": reps,
        "ref_reps": args.ref_reps,
        "bitsandbytes": bnb_version,
        "command": command,
    }
    notes = [
        f"Weight {shape[0]}x{shape[1]}, blocks of {block}, bitsandbytes {bnb_version}. Median of {reps} runs "
        f"alternating with the copy (references: {args.ref_reps}). Every C++ result was checked bit for bit "
        "against the reference first. Command: `" + command + "`.",
        "x copy = (op bytes read + written: fp tensor + codes + scales) / op time over (copy bytes read + "
        "written: 2 x the fp tensor) / copy time, medians of the same run (x copy min: fastest runs); "
        "GB/s = full-precision bytes / time; x ref = reference time / op time; x bnb = bitsandbytes time / "
        "op time (bnb x copy counts the same bytes as ours). Target: x copy >= 0.6.",
    ]
    cols = [
        "format",
        "dtype",
        "op",
        "ms",
        "GB/s",
        "copy_ms",
        "x_copy",
        "x_copy_min",
        "ref_ms",
        "x_ref",
        "bnb",
        "bnb_ms",
        "bnb_x_copy",
        "x_bnb",
    ]
    name = results_name("bench_weights")
    md = write_results(
        name,
        results,
        meta=meta,
        title=f"bench_weights: {shape[0]}x{shape[1]} weight, block {block}, C++ kernel path {cpu_isa()}",
        notes=notes,
        columns=cols,
        machine_=m,
        save=not args.no_save,
    )
    print(md)
    return {"meta": meta, "results": results}


if __name__ == "__main__":
    main()
