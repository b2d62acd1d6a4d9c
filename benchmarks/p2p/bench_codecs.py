"""Codec kernels (ppq:: ops, C++ CPU) against their plain-PyTorch references and a copy, in one run.

    .venv/bin/python benchmarks/p2p/bench_codecs.py [--shape 4 1024 4096] [--reps 5]

Each kernel is first checked against its reference (bit-exact codes/indices, bounded decode error),
then timed into reused buffers (median of ``--reps``). Columns:
  ms          median time of one call
  GB/s        bytes of the full-precision tensor / time
  x copy      time of ``dst.copy_(x)`` for the same activation / kernel time (1.0 = as fast as a copy)
  x ref       reference time / kernel time (reference = the op's plain-PyTorch default)
TopK is also compared with ``torch.topk``-based selection per sample (abs, topk, gather).
Results: benchmarks/results/bench_codecs.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import time

import torch

from deepspeed_ppq.compress import ops
from deepspeed_ppq.ops import has_kernel, registered_ops

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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _quant_rows(x2, bits, reps, ref_reps):
    R, D = x2.shape
    rows = []
    G = R
    bufs = (
        torch.empty(G),
        torch.empty(G),
        torch.empty(ops.packed_nbytes(x2.numel(), bits), dtype=torch.uint8),
        torch.empty(1, dtype=torch.uint8),
    )
    rbufs = tuple(torch.empty_like(b) for b in bufs)
    ops.quant_encode(x2, D, bits, *bufs)
    REF["quant_encode"](x2, D, bits, *rbufs)
    assert all(torch.equal(a, b) for a, b in zip(bufs, rbufs)), f"quant_encode {bits}b != reference"
    out, rout = torch.empty_like(x2), torch.empty_like(x2)
    ops.quant_decode(bufs[2], bufs[0], bufs[1], D, bits, out)
    REF["quant_decode"](bufs[2], bufs[0], bufs[1], D, bits, rout)
    torch.testing.assert_close(out, rout, rtol=2e-7, atol=1e-30)
    t = _time(lambda: ops.quant_encode(x2, D, bits, *bufs), reps)
    tr = _time(lambda: REF["quant_encode"](x2, D, bits, *rbufs), ref_reps)
    rows.append((f"quant_encode {bits}b per token", t, tr))
    if bits in (8, 4):
        t = _time(lambda: ops.quant_decode(bufs[2], bufs[0], bufs[1], D, bits, out), reps)
        tr = _time(lambda: REF["quant_decode"](bufs[2], bufs[0], bufs[1], D, bits, rout), ref_reps)
        rows.append((f"quant_decode {bits}b per token (into out)", t, tr))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[4, 1024, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ref-reps", type=int, default=2)
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    args = ap.parse_args()
    if not has_kernel("quant_encode"):
        raise SystemExit("the C++ extension is not built: run `make build` first")
    torch.set_num_threads(os.cpu_count() or 1)
    B, T, D = args.shape
    x = torch.randn(B, T, D)
    x2 = x.view(B * T, D)
    nbytes = x.numel() * 4
    dst = torch.empty_like(x)
    t_copy = _time(lambda: dst.copy_(x), args.reps)
    rows = [("copy (dst.copy_(x))", t_copy, None)]

    # ---- min-max quantization per token
    for bits in (8, 6, 4, 2):
        rows += _quant_rows(x2, bits, args.reps, args.ref_reps)

    # ---- FP8 e4m3 per token
    sc, codes, st = (
        torch.empty(B * T),
        torch.empty(x.numel(), dtype=torch.uint8),
        torch.empty(1, dtype=torch.uint8),
    )
    rsc, rcodes = torch.empty_like(sc), torch.empty_like(codes)
    ops.fp8_encode(x2, D, 0, sc, codes, st)
    REF["fp8_encode"](x2, D, 0, rsc, rcodes, st)
    assert torch.equal(sc, rsc) and torch.equal(codes, rcodes), "fp8_encode != reference"
    out = torch.empty_like(x2)
    rows.append(
        (
            "fp8_encode e4m3 per token",
            _time(lambda: ops.fp8_encode(x2, D, 0, sc, codes, st), args.reps),
            _time(lambda: REF["fp8_encode"](x2, D, 0, rsc, rcodes, st), args.ref_reps),
        )
    )
    rows.append(
        (
            "fp8_decode e4m3 (into out)",
            _time(lambda: ops.fp8_decode(codes, sc, D, 0, out), args.reps),
            _time(lambda: REF["fp8_decode"](codes, sc, D, 0, out), args.ref_reps),
        )
    )

    # ---- TopK per sample
    L = T * D
    k = max(1, math.floor(args.topk_ratio * L))
    xs = x.view(B, L)
    v, idx = torch.empty(B, k), torch.empty(B, k, dtype=torch.int64)
    ops.topk_encode(xs, k, v, idx, st)
    rv, ridx = torch.empty_like(v), torch.empty_like(idx)
    t_ref_topk = _time(lambda: REF["topk_encode"](xs, k, rv, ridx, st), 1)
    assert torch.equal(idx, ridx) and torch.equal(v, rv), "topk_encode != reference (stable-sort order)"

    def torch_topk():
        i = xs.abs().topk(k, dim=1, sorted=False).indices
        return xs.gather(1, i)

    t_tt = _time(torch_topk, max(1, args.ref_reps))
    t = _time(lambda: ops.topk_encode(xs, k, v, idx, st), args.reps)
    rows.append((f"topk_encode {args.topk_ratio:.0%} per sample", t, t_ref_topk))
    rows.append((f"  torch.topk-based selection {args.topk_ratio:.0%}", t_tt, None))
    outs = dst.view(B, L)
    t = _time(lambda: ops.topk_decode(v, idx, outs), args.reps)
    tr = _time(lambda: REF["topk_decode"](v, idx, outs), args.ref_reps)
    rows.append(("topk_decode (zero + scatter, into out)", t, tr))

    # ---- report
    table = []
    for name, t, tr in rows:
        table.append(
            {
                "kernel": name,
                "ms": t * 1e3,
                "GB/s": nbytes / t / 1e9,
                "x_copy": t_copy / t,
                "x_ref": (tr / t) if tr else None,
            }
        )
    topk_vs_torch = (
        t_tt / rows[[r[0] for r in rows].index(f"topk_encode {args.topk_ratio:.0%} per sample")][1]
    )
    meta = {
        "shape": [B, T, D],
        "dtype": "float32",
        "bytes": nbytes,
        "reps": args.reps,
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "topk_vs_torch_topk": topk_vs_torch,
    }
    lines = [
        f"# bench_codecs: {B}x{T}x{D} fp32 ({nbytes / 2**20:.0f} MiB), {meta['cpu']}, {meta['cores']} cores, "
        f"torch {meta['torch']}, {meta['date']}",
        "",
        "Command: `.venv/bin/python benchmarks/p2p/bench_codecs.py "
        + " ".join(["--shape", str(B), str(T), str(D), "--reps", str(args.reps)])
        + "`",
        "",
        "| kernel | ms (median) | GB/s of fp32 | x copy | x reference |",
        "|---|---|---|---|---|",
    ]
    for r in table:
        xr = f"{r['x_ref']:.1f}" if r["x_ref"] else "-"
        lines.append(f"| {r['kernel']} | {r['ms']:.2f} | {r['GB/s']:.2f} | {r['x_copy']:.2f} | {xr} |")
    lines += [
        "",
        f"TopK select vs torch.topk-based selection: {topk_vs_torch:.1f}x",
        "x copy = time of dst.copy_(x) for the same fp32 tensor / kernel time. The CPU is shared "
        "with other jobs; expect run-to-run spread of about +-30%.",
    ]
    md = "\n".join(lines)
    print(md)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "bench_codecs.json"), "w") as f:
        json.dump({"meta": meta, "rows": table}, f, indent=2)
    with open(os.path.join(RESULTS, "bench_codecs.md"), "w") as f:
        f.write(md + "\n")


if __name__ == "__main__":
    main()
