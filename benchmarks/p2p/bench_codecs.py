"""Codec kernels (ppq:: ops, C++ CPU) against their plain-PyTorch references and a copy, in one run.

    .venv/bin/python benchmarks/p2p/bench_codecs.py [--shape 4 1024 4096] [--reps 11]

Each kernel is first checked against its reference (bit-exact codes/indices, bounded decode error),
then timed into reused buffers, alternating with a copy of the activation (benchmarks/_harness.py).
Columns:
  ms          median time of one call
  x copy      the kernel's bytes read + written per second / the copy's (``dst.copy_(x)``: reads and
              writes the fp32 activation) bytes read + written per second, medians of the same run
  x copy min  the same from the fastest run of each
  x ref       reference time / kernel time (reference = the op's plain-PyTorch default)
TopK is also compared with ``torch.topk``-based selection per sample (abs, topk, gather).
Results: benchmarks/results/bench_codecs_<ISA path>.{json,md}, with the machine and the C++ kernel path (ISA).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import machine, results_name, time_against, time_once, write_results, x_copy  # noqa: E402

from deepspeed_ppq.compress import ops  # noqa: E402
from deepspeed_ppq.ops import has_kernel, registered_ops  # noqa: E402

REF = registered_ops()


def _check_quant(x2, bits, bufs, out):
    R, D = x2.shape
    rbufs = tuple(torch.empty_like(b) for b in bufs)
    ops.quant_encode(x2, D, bits, *bufs)
    REF["quant_encode"](x2, D, bits, *rbufs)
    assert all(torch.equal(a, b) for a, b in zip(bufs, rbufs)), f"quant_encode {bits}b != reference"
    rout = torch.empty_like(out)
    ops.quant_decode(bufs[2], bufs[0], bufs[1], D, bits, out)
    REF["quant_decode"](bufs[2], bufs[0], bufs[1], D, bits, rout)
    torch.testing.assert_close(out, rout, rtol=2e-7, atol=1e-30)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[4, 1024, 4096])
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--ref-reps", type=int, default=1)
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not has_kernel("quant_encode"):
        raise SystemExit("the C++ extension is not built: run `make build` first")
    m = machine()
    B, T, D = args.shape
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(0))
    x2 = x.view(B * T, D)
    R, n = B * T, x.numel()
    dst = torch.empty_like(x)
    copy, copy_bytes = (lambda: dst.copy_(x)), 8 * n
    rows = []

    def add(name, fn, op_bytes, ref=None):
        t = time_against(fn, copy, args.reps)
        tr = time_once(ref, args.ref_reps, warmup=0) if ref is not None else None
        rows.append(
            {
                "kernel": name,
                "ms": t.op * 1e3,
                "copy_ms": t.base * 1e3,
                "x_copy": x_copy(op_bytes, t.op, copy_bytes, t.base),
                "x_copy_min": x_copy(op_bytes, t.op_min, copy_bytes, t.base_min),
                "x_ref": tr / t.op if tr else None,
                "op_bytes": op_bytes,
            }
        )

    # ---- min-max quantization per token
    def quant(bits):
        nb = ops.packed_nbytes(n, bits)
        bufs = (
            torch.empty(R),
            torch.empty(R),
            torch.empty(nb, dtype=torch.uint8),
            torch.empty(1, dtype=torch.uint8),
        )
        rbufs = tuple(torch.empty_like(b) for b in bufs)
        out, rout = torch.empty_like(x2), torch.empty_like(x2)
        _check_quant(x2, bits, bufs, out)
        add(
            f"quant_encode {bits}b per token",
            lambda: ops.quant_encode(x2, D, bits, *bufs),
            4 * n + nb + 8 * R,
            lambda: REF["quant_encode"](x2, D, bits, *rbufs),
        )
        add(
            f"quant_decode {bits}b per token (into out)",
            lambda: ops.quant_decode(bufs[2], bufs[0], bufs[1], D, bits, out),
            nb + 8 * R + 4 * n,
            lambda: REF["quant_decode"](bufs[2], bufs[0], bufs[1], D, bits, rout),
        )

    for bits in (8, 6, 4, 2):
        quant(bits)

    # ---- FP8 per token
    def fp8(fmt, fname):
        sc, codes, st = torch.empty(R), torch.empty(n, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
        rsc, rcodes = torch.empty_like(sc), torch.empty_like(codes)
        ops.fp8_encode(x2, D, fmt, sc, codes, st)
        REF["fp8_encode"](x2, D, fmt, rsc, rcodes, st)
        assert torch.equal(sc, rsc) and torch.equal(codes, rcodes), f"fp8_encode {fname} != reference"
        out, rout = torch.empty_like(x2), torch.empty_like(x2)
        ops.fp8_decode(codes, sc, D, fmt, out)
        REF["fp8_decode"](codes, sc, D, fmt, rout)
        assert torch.equal(out, rout), f"fp8_decode {fname} != reference"
        add(
            f"fp8_encode {fname} per token",
            lambda: ops.fp8_encode(x2, D, fmt, sc, codes, st),
            5 * n + 4 * R,
            lambda: REF["fp8_encode"](x2, D, fmt, rsc, rcodes, st),
        )
        add(
            f"fp8_decode {fname} (into out)",
            lambda: ops.fp8_decode(codes, sc, D, fmt, out),
            5 * n + 4 * R,
            lambda: REF["fp8_decode"](codes, sc, D, fmt, rout),
        )

    fp8(0, "e4m3")
    fp8(1, "e5m2")

    # ---- TopK per sample
    L = T * D
    k = max(1, math.floor(args.topk_ratio * L))
    xs = x.view(B, L)
    st = torch.empty(1, dtype=torch.uint8)
    v, idx = torch.empty(B, k), torch.empty(B, k, dtype=torch.int64)
    rv, ridx = torch.empty_like(v), torch.empty_like(idx)
    ops.topk_encode(xs, k, v, idx, st)
    REF["topk_encode"](xs, k, rv, ridx, st)
    assert torch.equal(idx, ridx) and torch.equal(v, rv), "topk_encode != reference (stable-sort order)"

    def torch_topk():
        i = xs.abs().topk(k, dim=1, sorted=False).indices
        return xs.gather(1, i)

    sel_bytes = 4 * n + B * k * 12
    add(
        f"topk_encode {args.topk_ratio:.0%} per sample",
        lambda: ops.topk_encode(xs, k, v, idx, st),
        sel_bytes,
        lambda: REF["topk_encode"](xs, k, rv, ridx, st),
    )
    add(f"  torch.topk-based selection {args.topk_ratio:.0%}", torch_topk, sel_bytes)
    outs = dst.view(B, L)
    add(
        "topk_decode (zero + scatter, into out)",
        lambda: ops.topk_decode(v, idx, outs),
        4 * n + B * k * 12,
        lambda: REF["topk_decode"](v, idx, outs),
    )
    # the index stream packed to ceil(log2 L) bits (TopK with index packing)
    bits = max(1, math.ceil(math.log2(L)))
    flat = idx.view(-1)
    packed = torch.empty(ops.packed_nbytes(flat.numel(), bits), dtype=torch.uint8)
    unpacked = torch.empty_like(flat)
    pb = 8 * flat.numel() + packed.numel()
    add(f"pack_bits {bits}b (TopK indices)", lambda: ops.pack_bits(flat, bits, packed), pb)
    add(f"unpack_bits {bits}b", lambda: ops.unpack_bits(packed, bits, unpacked), pb)
    assert torch.equal(unpacked, flat), "unpack_bits(pack_bits(idx)) != idx"

    notes = [
        f"Activation {B}x{T}x{D} fp32 ({4 * n / 2**20:.0f} MiB); per-token groups of {D}; TopK k = "
        f"{args.topk_ratio:.0%} of {L} per sample. Median of {args.reps} runs alternating with the copy.",
        "Command: `.venv/bin/python benchmarks/p2p/bench_codecs.py "
        + " ".join(argv if argv is not None else sys.argv[1:])
        + "`",
        "x copy = (kernel bytes read + written) / kernel time over (copy bytes read + written) / copy "
        "time, both medians of the same run; targets: encode/decode >= 0.5, TopK select >= 0.3.",
    ]
    md = write_results(
        results_name("bench_codecs"),
        rows,
        meta={"shape": [B, T, D], "reps": args.reps, "k": k},
        title="bench_codecs: stage-boundary codec kernels",
        notes=notes,
        columns=["kernel", "ms", "copy_ms", "x_copy", "x_copy_min", "x_ref"],
        machine_=m,
        save=not args.no_save,
    )
    print(md)


if __name__ == "__main__":
    main()
