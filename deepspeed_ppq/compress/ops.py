"""``ppq::`` codec ops: fused quantize+pack, unpack+dequantize, FP8, TopK select and scatter, bit packing.

Every op writes into caller-provided buffers (views of one uint8 payload, or a reused output), so a
kernel never pays for a fresh allocation. Each op has a plain-PyTorch reference (the default on every
device); ``csrc/cpu/codecs.cpp`` overrides them on CPU and ``csrc/cuda/codecs.cu`` on CUDA.

Definitions every implementation follows bit for bit (the tests hold the C++ kernels to them):

* Rows and groups. ``x`` is ``[R, d]``; each row is cut into ``ceil(d / group)`` groups of ``group``
  consecutive values (the last one may be shorter). Per-sample, per-token and per-channel-group
  granularity are all this one shape (see ``codecs.py``).
* k-bit min-max (``quant_encode``), per group, in fp32:
  ``range = double(max) - double(min)``; ``scale = float(range / L)``, ``L = 2**bits - 1``; a prescale
  ``p = 0.5`` when range exceeds the largest float (huge values: ``x - min`` would overflow), else 1;
  ``inv = float(L / (range * p))`` (0 when range is 0);
  ``code = clamp(nearbyint((x * p - min * p) * inv), 0, L)`` (round half to even).
  Decode: ``x = fma(code, scale, min)`` (the reference computes it in float64: the fused fp32 result up
  to one rounding).
* Packing of the code stream, in element order (little-endian bit order):
  8 bits: one byte per value; 4 bits: value ``2i`` in the low nibble; 2 bits: value ``4i + j`` at bits
  ``2j``; 6 bits: four values ``v0..v3`` as the 24-bit little-endian word
  ``v0 | v1 << 6 | v2 << 12 | v3 << 18`` (3 bytes).
  The stream is ``ceil(n * bits / 8)`` bytes; unused bits are zero.
* FP8 (``fp8_encode``), per group: ``amax = max |x|``; ``scale = float(double(amax) / FMAX)`` and
  ``inv = float(FMAX / double(amax))`` (both 1 when amax is 0);
  ``code = fp8(clamp(x * inv, -FMAX, FMAX))`` with round-to-nearest-even (c10's conversion);
  FMAX = 448 (e4m3) or 57344 (e5m2). Decode: ``float(code) * scale``.
* TopK (``topk_encode``), per row of ``[B, L]``: the ``k`` elements of largest ``|x|``; ties go to the lower
  index (the order of a stable descending sort); the chosen indices are returned in ascending order.
* Bit packing of indices (``pack_bits``): value ``i`` occupies bits ``[i * bits, (i + 1) * bits)`` of a
  little-endian bit stream.
* ``status`` (one uint8) is set to 1 when ``x`` holds a NaN or an Inf, else 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepspeed_ppq.ops import define_op

__all__ = [
    "FP8_FORMATS",
    "quant_encode",
    "quant_decode",
    "fp8_encode",
    "fp8_decode",
    "topk_encode",
    "topk_decode",
    "pack_bits",
    "unpack_bits",
    "packed_nbytes",
    "pack_codes_reference",
    "unpack_codes_reference",
]

# fmt id -> (torch dtype, largest finite value)
FP8_FORMATS = {0: (torch.float8_e4m3fn, 448.0), 1: (torch.float8_e5m2, 57344.0)}


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of ``n`` values of ``bits`` bits each, densely packed."""
    return (n * bits + 7) // 8


def _ngroups(d: int, group: int) -> int:
    return (d + group - 1) // group


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[R, d]`` -> fp32 ``[R * ngroups, group]``; the last group of a row is padded by repeating its last
    value (so padding never changes a group's min, max or absmax)."""
    R, d = x.shape
    ng = _ngroups(d, group)
    xf = x.float()
    pad = ng * group - d
    if pad:
        xf = F.pad(xf, (0, pad), mode="replicate")
    return xf.reshape(R * ng, group)


def _ungrouped(q: torch.Tensor, R: int, d: int) -> torch.Tensor:
    """Inverse of ``_grouped`` for per-element results: ``[R * ngroups, group]`` -> flat ``[R * d]``."""
    return q.reshape(R, -1)[:, :d].reshape(-1)


def pack_codes_reference(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (any int dtype, values < 2**bits) into ``ceil(n * bits / 8)`` bytes."""
    n = q.numel()
    q = q.reshape(-1).to(torch.int32)
    if bits == 8:
        return q.to(torch.uint8)
    per = {4: 2, 2: 4, 6: 4}[bits]
    pad = (-n) % per
    if pad:
        q = F.pad(q, (0, pad))
    q = q.view(-1, per)
    shifts = torch.arange(per, dtype=torch.int32, device=q.device) * bits
    word = (q << shifts).sum(1, dtype=torch.int32)
    if bits == 6:
        out = torch.stack([word & 255, (word >> 8) & 255, (word >> 16) & 255], 1).reshape(-1)
    else:
        out = word
    return out.to(torch.uint8)[: packed_nbytes(n, bits)]


def unpack_codes_reference(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_codes_reference``: int32 codes ``[n]``."""
    p = packed.reshape(-1).to(torch.int32)
    if bits == 8:
        return p[:n]
    per = {4: 2, 2: 4, 6: 4}[bits]
    if bits == 6:
        nb = (-p.numel()) % 3
        if nb:
            p = F.pad(p, (0, nb))
        p = p.view(-1, 3)
        word = p[:, 0] | (p[:, 1] << 8) | (p[:, 2] << 16)
    else:
        word = p
    shifts = torch.arange(per, dtype=torch.int32, device=word.device) * bits
    q = (word[:, None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(-1)[:n]


# ---------------------------------------------------------------------------------------------------
# k-bit min-max


def _quant_encode_ref(x, group, bits, mins, scales, codes, status):
    R, d = x.shape
    xg = _grouped(x, group)
    mn = xg.amin(1)
    mx = xg.amax(1)
    levels = (1 << bits) - 1
    rng = mx.double() - mn.double()
    scale = (rng / levels).float()
    p = torch.where(rng > torch.finfo(torch.float32).max, 0.5, 1.0).float()
    inv = torch.where(rng > 0, levels / (rng * p.double()), torch.zeros_like(rng)).float()
    q = ((xg * p[:, None] - (mn * p)[:, None]) * inv[:, None]).round().clamp_(0, levels)
    q = torch.nan_to_num(q, nan=0.0)
    codes.copy_(pack_codes_reference(_ungrouped(q, R, d).to(torch.int32), bits))
    mins.copy_(mn)
    scales.copy_(scale)
    finite = torch.isfinite(mn).all() & torch.isfinite(mx).all()
    status.copy_((~finite).to(torch.uint8).reshape(1))


def _quant_decode_ref(codes, mins, scales, group, bits, out):
    R, d = out.shape
    ng = _ngroups(d, group)
    q = unpack_codes_reference(codes, bits, R * d).view(R, d)
    gidx = torch.arange(d, device=out.device) // group  # group of each column
    mn = mins.view(R, ng).double()[:, gidx]
    sc = scales.view(R, ng).double()[:, gidx]
    out.copy_((q.double() * sc + mn).float())


def _quant_encode_fake(x, group, bits, mins, scales, codes, status):
    return None


def _quant_decode_fake(codes, mins, scales, group, bits, out):
    return None


quant_encode = define_op(
    "quant_encode(Tensor x, int group, int bits, Tensor(a!) mins, Tensor(b!) scales, Tensor(c!) codes, "
    "Tensor(d!) status) -> ()",
    _quant_encode_ref,
    _quant_encode_fake,
)
quant_decode = define_op(
    "quant_decode(Tensor codes, Tensor mins, Tensor scales, int group, int bits, Tensor(a!) out) -> ()",
    _quant_decode_ref,
    _quant_decode_fake,
)


# ---------------------------------------------------------------------------------------------------
# FP8


def _fp8_encode_ref(x, group, fmt, scales, codes, status):
    R, d = x.shape
    dt, fmax = FP8_FORMATS[fmt]
    xg = _grouped(x, group)
    amax = xg.abs().amax(1)
    a = amax.double()
    pos = a > 0
    scale = torch.where(pos, a / fmax, torch.ones_like(a)).float()
    inv = torch.where(pos, fmax / a, torch.ones_like(a)).float()
    y = (xg * inv[:, None]).clamp(-fmax, fmax)
    codes.copy_(_ungrouped(y, R, d).to(dt).view(torch.uint8))
    scales.copy_(scale)
    status.copy_((~torch.isfinite(amax).all()).to(torch.uint8).reshape(1))


def _fp8_decode_ref(codes, scales, group, fmt, out):
    R, d = out.shape
    dt, _ = FP8_FORMATS[fmt]
    ng = _ngroups(d, group)
    gidx = torch.arange(d, device=out.device) // group
    v = codes.view(dt).float().view(R, d)
    out.copy_(v * scales.view(R, ng)[:, gidx])


fp8_encode = define_op(
    "fp8_encode(Tensor x, int group, int fmt, Tensor(a!) scales, Tensor(b!) codes, Tensor(c!) status) -> ()",
    _fp8_encode_ref,
    lambda x, group, fmt, scales, codes, status: None,
)
fp8_decode = define_op(
    "fp8_decode(Tensor codes, Tensor scales, int group, int fmt, Tensor(a!) out) -> ()",
    _fp8_decode_ref,
    lambda codes, scales, group, fmt, out: None,
)


# ---------------------------------------------------------------------------------------------------
# TopK


def _topk_encode_ref(x, k, values, indices, status):
    key = x.abs().float()
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    idx = order.sort(dim=1).values
    indices.copy_(idx)
    values.copy_(x.gather(1, idx))
    status.copy_((~torch.isfinite(x).all()).to(torch.uint8).reshape(1))


def _topk_decode_ref(values, indices, out):
    out.zero_()
    out.scatter_(1, indices, values.to(out.dtype))


topk_encode = define_op(
    "topk_encode(Tensor x, int k, Tensor(a!) values, Tensor(b!) indices, Tensor(c!) status) -> ()",
    _topk_encode_ref,
    lambda x, k, values, indices, status: None,
)
topk_decode = define_op(
    "topk_decode(Tensor values, Tensor indices, Tensor(a!) out) -> ()",
    _topk_decode_ref,
    lambda values, indices, out: None,
)


# ---------------------------------------------------------------------------------------------------
# bit packing of indices


def _pack_bits_ref(idx, bits, out):
    v = idx.reshape(-1).to(torch.int64)
    b = ((v[:, None] >> torch.arange(bits, device=v.device)) & 1).reshape(-1)
    pad = (-b.numel()) % 8
    if pad:
        b = F.pad(b, (0, pad))
    byte = (b.view(-1, 8) << torch.arange(8, device=b.device)).sum(1)
    out.copy_(byte.to(torch.uint8))


def _unpack_bits_ref(packed, bits, out):
    n = out.numel()
    dev = packed.device
    b = (packed.reshape(-1).to(torch.int64)[:, None] >> torch.arange(8, device=dev)) & 1
    b = b.reshape(-1)[: n * bits]
    v = (b.view(n, bits) << torch.arange(bits, device=dev)).sum(1)
    out.copy_(v.view(out.shape))


pack_bits = define_op(
    "pack_bits(Tensor idx, int bits, Tensor(a!) out) -> ()",
    _pack_bits_ref,
    lambda idx, bits, out: None,
)
unpack_bits = define_op(
    "unpack_bits(Tensor packed, int bits, Tensor(a!) out) -> ()",
    _unpack_bits_ref,
    lambda packed, bits, out: None,
)
