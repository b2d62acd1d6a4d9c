"""CUDA kernels (csrc/cuda, ppq:: ops on CUDA tensors) against a device-to-device copy of the same bytes.

    .venv/bin/python benchmarks/ops/bench_cuda.py [--shape 4 2048 4096] [--reps 21] [--only topk]

Needs a CUDA GPU and a CUDA build of PyTorch with the extension built (``pip install --no-build-isolation
-e .`` on that machine); without one it exits saying so. Every kernel is first checked against its
plain-PyTorch reference on the benchmark's own tensors (codes, packed bytes and TopK indices bit for bit;
decoded values bit for bit or within the reference's documented bound; the 8-bit Adam step bit for bit) or,
for the weight formats, against the C++ CPU kernel bit for bit, and only then timed.

Timing: CUDA events around each call, ``--reps`` runs alternating with the baseline after a warm-up, medians
and minima (benchmarks/_harness.py's Timing). The baseline is a device-to-device copy (``dst.copy_(src)``,
uint8) of half the op's bytes, so that it reads and writes as many bytes as the op does. Columns:
  ms          median time of one call
  GB/s        the op's bytes read + written / time
  x copy      the op's bytes per second over the copy's (medians of the same run); 1.0 = copy bandwidth
  x copy min  the same from the fastest run of each
  x ref       reference time / op time (the reference: the op's plain-PyTorch default, on the GPU)
Bytes are counted honestly: every tensor the op must read or write (inputs, codes, scales, outputs,
status), not its scratch. TopK encode reads x and writes k values and k int64 indices per row; TopK decode
writes the whole output (zeros and values) and reads the values and indices. The benchmark tensors are
larger than the L2 cache, so both the op and the copy stream from memory.
Results: benchmarks/results/bench_cuda.{json,md}, with the machine (GPU name, torch, CUDA).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import Timing, machine, write_results, x_copy  # noqa: E402

import deepspeed_ppq.quant.adam8bit  # noqa: E402, F401  (declares ppq::adam8bit_blockwise_step_)
from deepspeed_ppq.compress import ops  # noqa: E402
from deepspeed_ppq.ops import has_kernel, native_status, registered_ops  # noqa: E402
from deepspeed_ppq.quant import ops as wops  # noqa: E402
from deepspeed_ppq.quant import sr_ops  # noqa: E402

REF = registered_ops()
CUDA_OPS = ("quant_encode", "quant_decode", "fp8_encode", "fp8_decode", "topk_encode", "topk_decode",
            "pack_bits", "unpack_bits", "adam8bit_blockwise_step_", "weight_quantize_out",
            "weight_dequantize_out", "weight_quantize_sr_out")


def cuda_time_against(op: Callable[[], object], base: Callable[[], object], reps: int,
                      warmup: int = 3) -> Timing:
    """Alternate ``base`` and ``op`` ``reps`` times, each between CUDA events: medians and minima (s)."""
    for _ in range(warmup):
        base()
        op()
    torch.cuda.synchronize()
    t_op, t_base = [], []
    for _ in range(reps):
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        base()
        e1.record()
        op()
        e2.record()
        e2.synchronize()
        t_base.append(e0.elapsed_time(e1) / 1e3)
        t_op.append(e1.elapsed_time(e2) / 1e3)
    return Timing(statistics.median(t_op), statistics.median(t_base), min(t_op), min(t_base))


def cuda_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` between CUDA events."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return statistics.median(ts)


def _bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equality, NaN equal to NaN."""
    if a.dtype.is_floating_point:
        ok = bool(((a == b) | (a.isnan() & b.isnan())).all())
    else:
        ok = torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                         if b.dtype.itemsize == 1 else b)
    assert ok, f"{what}: the CUDA kernel differs from the reference"


class Bench:
    def __init__(self, reps: int, ref_reps: int, only: str | None):
        self.reps, self.ref_reps, self.only = reps, ref_reps, only
        self.rows: list[dict] = []
        self.skipped: list[str] = []
        self._copy_buf: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def wanted(self, name: str) -> bool:
        return self.only is None or self.only in name

    def copy_of(self, nbytes: int) -> tuple[Callable[[], object], int]:
        """A D2D copy reading and writing ``nbytes`` in all (half each way), and its byte count."""
        half = max(1, nbytes // 2)
        if half not in self._copy_buf:
            self._copy_buf[half] = (torch.empty(half, dtype=torch.uint8, device="cuda").random_(0, 255),
                                    torch.empty(half, dtype=torch.uint8, device="cuda"))
        src, dst = self._copy_buf[half]
        return (lambda: dst.copy_(src)), 2 * half

    def add(self, name: str, fn: Callable[[], object], op_bytes: int, ref: Callable[[], object] | None = None,
            extra: dict | None = None) -> None:
        copy, copy_bytes = self.copy_of(op_bytes)
        t = cuda_time_against(fn, copy, self.reps)
        tr = cuda_time(ref, self.ref_reps) if ref is not None else None
        row = {
            "kernel": name,
            "ms": t.op * 1e3,
            "GB/s": op_bytes / t.op / 1e9,
            "copy_ms": t.base * 1e3,
            "x_copy": x_copy(op_bytes, t.op, copy_bytes, t.base),
            "x_copy_min": x_copy(op_bytes, t.op_min, copy_bytes, t.base_min),
            "x_ref": tr / t.op if tr else None,
            "op_bytes": op_bytes,
        }
        row.update(extra or {})
        self.rows.append(row)
        print(f"{name:58s} {row['ms']:8.3f} ms  {row['GB/s']:7.0f} GB/s  x copy {row['x_copy']:.2f}",
              flush=True)


def _quant_case(b: Bench, x: torch.Tensor, group: int, bits: int) -> None:
    dev, (R, D) = x.device, x.shape
    n, es, dn = x.numel(), x.element_size(), str(x.dtype).replace("torch.", "")
    name = f"quant {bits}b {dn} group {group}" + (" (two passes)" if (group * bits) % 8 else "")
    if not b.wanted(name):
        return
    G = R * math.ceil(D / group)
    nb = ops.packed_nbytes(n, bits)
    bufs = (torch.empty(G, device=dev), torch.empty(G, device=dev),
            torch.empty(nb, dtype=torch.uint8, device=dev), torch.empty(1, dtype=torch.uint8, device=dev))
    rbufs = tuple(torch.empty_like(t) for t in bufs)
    ops.quant_encode(x, group, bits, *bufs)
    REF["quant_encode"](x, group, bits, *rbufs)
    for a, r, what in zip(bufs, rbufs, ("mins", "scales", "codes", "status")):
        _bits_equal(a, r, f"{name} encode {what}")
    out, rout = torch.empty_like(x), torch.empty_like(x)
    ops.quant_decode(bufs[2], bufs[0], bufs[1], group, bits, out)
    REF["quant_decode"](bufs[2], bufs[0], bufs[1], group, bits, rout)
    rtol = 2e-7 if x.dtype == torch.float32 else 8e-3  # fp32 fma vs the float64 reference
    torch.testing.assert_close(out.float(), rout.float(), rtol=rtol, atol=1e-30)
    b.add(f"{name} encode", lambda: ops.quant_encode(x, group, bits, *bufs), n * es + nb + 8 * G + 1,
          lambda: REF["quant_encode"](x, group, bits, *rbufs))
    b.add(f"{name} decode", lambda: ops.quant_decode(bufs[2], bufs[0], bufs[1], group, bits, out),
          nb + 8 * G + n * es, lambda: REF["quant_decode"](bufs[2], bufs[0], bufs[1], group, bits, rout))


def _fp8_case(b: Bench, x: torch.Tensor, fmt: int) -> None:
    dev, (R, D) = x.device, x.shape
    n, es, dn = x.numel(), x.element_size(), str(x.dtype).replace("torch.", "")
    name = f"fp8 {('e4m3', 'e5m2')[fmt]} {dn} per token"
    if not b.wanted(name):
        return
    sc, codes = torch.empty(R, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    st = torch.empty(1, dtype=torch.uint8, device=dev)
    rsc, rcodes, rst = torch.empty_like(sc), torch.empty_like(codes), torch.empty_like(st)
    ops.fp8_encode(x, D, fmt, sc, codes, st)
    REF["fp8_encode"](x, D, fmt, rsc, rcodes, rst)
    for a, r, what in ((sc, rsc, "scales"), (codes, rcodes, "codes"), (st, rst, "status")):
        _bits_equal(a, r, f"{name} encode {what}")
    out, rout = torch.empty_like(x), torch.empty_like(x)
    ops.fp8_decode(codes, sc, D, fmt, out)
    REF["fp8_decode"](codes, sc, D, fmt, rout)
    _bits_equal(out, rout, f"{name} decode")
    b.add(f"{name} encode", lambda: ops.fp8_encode(x, D, fmt, sc, codes, st), n * es + n + 4 * R + 1,
          lambda: REF["fp8_encode"](x, D, fmt, rsc, rcodes, rst))
    b.add(f"{name} decode", lambda: ops.fp8_decode(codes, sc, D, fmt, out), n + 4 * R + n * es,
          lambda: REF["fp8_decode"](codes, sc, D, fmt, rout))


def _topk_case(b: Bench, xs: torch.Tensor, ratio: float) -> None:
    dev, (B, L) = xs.device, xs.shape
    n, es, dn = xs.numel(), xs.element_size(), str(xs.dtype).replace("torch.", "")
    k = max(1, math.floor(ratio * L))
    name = f"topk {ratio:.0%} of {L} per sample {dn}"
    if not b.wanted(name):
        return
    v, idx = torch.empty(B, k, dtype=xs.dtype, device=dev), torch.empty(B, k, dtype=torch.int64, device=dev)
    st = torch.empty(1, dtype=torch.uint8, device=dev)
    rv, ridx, rst = torch.empty_like(v), torch.empty_like(idx), torch.empty_like(st)
    ops.topk_encode(xs, k, v, idx, st)
    REF["topk_encode"](xs, k, rv, ridx, rst)
    _bits_equal(idx, ridx, f"{name} indices")
    _bits_equal(v, rv, f"{name} values")
    sel_bytes = n * es + B * k * (es + 8)

    def torch_topk():
        i = xs.abs().topk(k, dim=1, sorted=False).indices
        return xs.gather(1, i)

    b.add(f"{name} encode", lambda: ops.topk_encode(xs, k, v, idx, st), sel_bytes,
          lambda: REF["topk_encode"](xs, k, rv, ridx, rst))
    b.add(f"  torch.topk-based selection (abs, topk, gather) {ratio:.0%}", torch_topk, sel_bytes)
    out, rout = torch.empty_like(xs), torch.empty_like(xs)
    ops.topk_decode(v, idx, out)
    REF["topk_decode"](v, idx, rout)
    _bits_equal(out, rout, f"{name} decode")
    b.add(f"{name} decode (zero + scatter)", lambda: ops.topk_decode(v, idx, out), n * es + B * k * (es + 8),
          lambda: REF["topk_decode"](v, idx, rout))
    if xs.dtype == torch.float32:
        _pack_case(b, idx.view(-1), max(1, (L - 1).bit_length()))


def _pack_case(b: Bench, flat: torch.Tensor, bits: int) -> None:
    packed = torch.empty(ops.packed_nbytes(flat.numel(), bits), dtype=torch.uint8, device=flat.device)
    rpacked, unpacked, runpacked = torch.empty_like(packed), torch.empty_like(flat), torch.empty_like(flat)
    ops.pack_bits(flat, bits, packed)
    REF["pack_bits"](flat, bits, rpacked)
    _bits_equal(packed, rpacked, f"pack_bits {bits}b")
    ops.unpack_bits(packed, bits, unpacked)
    _bits_equal(unpacked, flat, f"unpack_bits {bits}b")
    pb = 8 * flat.numel() + packed.numel()
    b.add(f"pack_bits {bits}b ({flat.numel()} TopK indices)", lambda: ops.pack_bits(flat, bits, packed), pb,
          lambda: REF["pack_bits"](flat, bits, rpacked))
    b.add(f"unpack_bits {bits}b", lambda: ops.unpack_bits(packed, bits, unpacked), pb,
          lambda: REF["unpack_bits"](packed, bits, runpacked))


def bench_codecs(b: Bench, B: int, T: int, D: int, topk_ratios: list[float]) -> None:
    x32 = torch.randn(B * T, D, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype)
        for bits, group in ((8, D), (6, D), (4, D), (2, D), (4, 128), (4, 33)):
            _quant_case(b, x, group, bits)
        for fmt in (0, 1):
            _fp8_case(b, x, fmt)
        for ratio in topk_ratios:
            _topk_case(b, x.view(B, T * D), ratio)


def bench_adam8bit(b: Bench, n: int) -> None:
    name = f"adam8bit_blockwise_step_ {n} params"
    if not b.wanted(name):
        return
    try:  # its maps: the states' code books
        import bitsandbytes.functional as F
    except ImportError as e:
        b.skipped.append(f"{name}: bitsandbytes (its code maps) does not import here ({e})")
        print(b.skipped[-1], flush=True)
        return

    dev = "cuda"
    q1, q2 = F.create_dynamic_map(signed=True).to(dev), F.create_dynamic_map(signed=False).to(dev)
    g = torch.Generator(device=dev).manual_seed(1)
    nb = -(-n // 256)

    def state():
        gg = torch.Generator(device=dev).manual_seed(2)
        return [torch.randn(n, generator=gg, device=dev) * 0.02,
                torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gg, device=dev),
                torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gg, device=dev),
                torch.rand(nb, generator=gg, device=dev) * 1e-3,
                torch.rand(nb, generator=gg, device=dev) * 1e-6]

    grad = torch.randn(n, generator=g, device=dev) * 1e-3
    a, r = state(), state()
    hyper = (q1, q2, 0.9, 0.999, 1e-8, 5, 1e-3, 0.01, 1.0)
    torch.ops.ppq.adam8bit_blockwise_step_(a[0], grad, a[1], a[2], a[3], a[4], *hyper)
    REF["adam8bit_blockwise_step_"](r[0], grad, r[1], r[2], r[3], r[4], *hyper)
    for what, x, y in zip(("p", "state1", "state2", "absmax1", "absmax2"), a, r):
        _bits_equal(x, y, f"{name} {what}")
    # one step moves p, g, both states (read) and p, both states (written), and both absmax arrays
    b.add(name, lambda: torch.ops.ppq.adam8bit_blockwise_step_(a[0], grad, a[1], a[2], a[3], a[4], *hyper),
          16 * n + 16 * nb,
          lambda: REF["adam8bit_blockwise_step_"](r[0], grad, r[1], r[2], r[3], r[4], *hyper))


def _cpu_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype)


# The weight kernels are checked against the C++ CPU kernels (which tests/quant hold to the reference bit for
# bit on the CPU), not against the reference run on the GPU: PyTorch's CUDA division by a scalar multiplies
# by its reciprocal, so the reference's scales on a GPU can differ from its own on a CPU in the last bit.
def _quantized_alike_on_cpu(name: str, quantize, w: torch.Tensor, args: tuple, codes: torch.Tensor,
                            scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(w, *args, codes, scales)`` run again on the CPU kernel: its codes and scales, checked equal
    to the GPU's bit for bit."""
    cc, cs = _cpu_like(codes), _cpu_like(scales)
    quantize(w.cpu(), *args, cc, cs)
    _bits_equal(scales.cpu(), cs, f"{name} scales")
    _bits_equal(codes.cpu().view(torch.uint8), cc.view(torch.uint8), f"{name} codes")
    return cc, cs


def _weight_case(b: Bench, w: torch.Tensor, fmt: str, block: int) -> None:
    dev, n, es = w.device, w.numel(), w.element_size()
    name = f"weight {fmt} {str(w.dtype).replace('torch.', '')} block {block}"
    if not b.wanted(name):
        return
    codes = torch.empty(wops.codes_numel(fmt, n), dtype=wops.code_dtype(fmt), device=dev)
    scales = torch.empty(wops.num_blocks(n, block), device=dev)
    rc, rs = torch.empty_like(codes), torch.empty_like(scales)
    torch.ops.ppq.weight_quantize_out(w, fmt, block, codes, scales)
    cc, cs = _quantized_alike_on_cpu(name, torch.ops.ppq.weight_quantize_out, w, (fmt, block), codes, scales)
    out, rout = torch.empty_like(w), torch.empty_like(w)
    torch.ops.ppq.weight_dequantize_out(codes, scales, fmt, block, out)
    cout = _cpu_like(out)
    torch.ops.ppq.weight_dequantize_out(cc, cs, fmt, block, cout)
    _bits_equal(out.cpu(), cout, f"{name} dequantize")
    op_bytes = n * es + codes.numel() * codes.element_size() + 4 * scales.numel()
    b.add(f"{name} quantize", lambda: torch.ops.ppq.weight_quantize_out(w, fmt, block, codes, scales),
          op_bytes, lambda: REF["weight_quantize_out"](w, fmt, block, rc, rs))
    b.add(f"{name} dequantize", lambda: torch.ops.ppq.weight_dequantize_out(codes, scales, fmt, block, out),
          op_bytes, lambda: REF["weight_dequantize_out"](codes, scales, fmt, block, rout))


def _sr_case(b: Bench, w: torch.Tensor, fmt: str, block: int) -> None:
    dev, n, es = w.device, w.numel(), w.element_size()
    name = f"weight SR {fmt} {str(w.dtype).replace('torch.', '')} block {block}"
    if not b.wanted(name):
        return
    codes = torch.empty(n, dtype=wops.code_dtype(fmt), device=dev)
    scales = torch.empty(wops.num_blocks(n, block), device=dev)
    rc, rs = torch.empty_like(codes), torch.empty_like(scales)
    seed, offset = 7, 123
    torch.ops.ppq.weight_quantize_sr_out(w, fmt, block, seed, offset, codes, scales)
    _quantized_alike_on_cpu(name, torch.ops.ppq.weight_quantize_sr_out, w, (fmt, block, seed, offset), codes,
                            scales)
    b.add(f"{name} quantize",
          lambda: torch.ops.ppq.weight_quantize_sr_out(w, fmt, block, seed, offset, codes, scales),
          n * es + n + 4 * scales.numel(),
          lambda: REF["weight_quantize_sr_out"](w, fmt, block, seed, offset, rc, rs))


def bench_weights(b: Bench, rows: int, cols: int, block: int) -> None:
    w32 = torch.randn(rows, cols, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        w = w32.to(dtype)
        for fmt in wops.WEIGHT_FORMATS:
            _weight_case(b, w, fmt, block)
        for fmt in sr_ops.SR_FORMATS:
            _sr_case(b, w, fmt, block)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[4, 2048, 4096], help="activation B T D")
    ap.add_argument("--topk-ratios", type=float, nargs="*", default=[0.1, 0.01])
    ap.add_argument("--adam-n", type=int, default=1 << 26)
    ap.add_argument("--weights", type=int, nargs=2, default=[8192, 8192], help="weight rows cols")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--ref-reps", type=int, default=3)
    ap.add_argument("--only", default=None, help="run the kernels whose name contains this")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda needs a CUDA GPU and a CUDA build of PyTorch: torch "
                         f"{torch.__version__} (CUDA {torch.version.cuda}) sees no GPU here")
    missing = [name for name in CUDA_OPS if not has_kernel(name, "cuda")]
    if missing:
        raise SystemExit(f"no CUDA kernel for {missing}: extensions {native_status()}; build them on this "
                         "machine with `pip install --no-build-isolation -e .`")
    m = machine()
    props = torch.cuda.get_device_properties(0)
    gpu = {"gpu": props.name, "sm": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
           "gpu_mem_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda}
    B, T, D = args.shape
    b = Bench(args.reps, args.ref_reps, args.only)
    bench_codecs(b, B, T, D, args.topk_ratios)
    bench_adam8bit(b, args.adam_n)
    bench_weights(b, *args.weights, args.block)
    notes = [
        f"GPU: {gpu['gpu']} (sm_{gpu['sm'].replace('.', '')}, {gpu['sms']} SMs, {gpu['gpu_mem_gib']} GiB), "
        f"CUDA {gpu['cuda']}. Activation {B}x{T}x{D}; TopK per sample of {T * D}; 8-bit Adam on "
        f"{args.adam_n} parameters; weights {args.weights[0]}x{args.weights[1]}, block {args.block}.",
        "Command: `.venv/bin/python benchmarks/ops/bench_cuda.py "
        + " ".join(argv if argv is not None else sys.argv[1:]) + "`",
        f"Median of {args.reps} CUDA-event timings alternating with a D2D copy of as many bytes (read + "
        "written) as the op moves; x copy = op bytes/s over copy bytes/s (target >= 0.8). Every kernel was "
        "checked first, bit for bit: the codecs and the 8-bit Adam step against their reference, the weight "
        "formats against the C++ CPU kernels.",
        *(f"Not measured: {why}" for why in b.skipped),
    ]
    md = write_results(
        "bench_cuda", b.rows, meta={"shape": [B, T, D], "reps": args.reps, **gpu},
        title="bench_cuda: CUDA kernels", notes=notes,
        columns=["kernel", "ms", "GB/s", "copy_ms", "x_copy", "x_copy_min", "x_ref"], machine_=m,
        save=not args.no_save)
    print(md)


if __name__ == "__main__":
    main()
