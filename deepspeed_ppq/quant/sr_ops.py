"""``ppq::weight_quantize_sr_out``: blockwise 8-bit weight quantization with STOCHASTIC rounding.

Master-free training (``WeightsConfig.master="none"``, ``quant.master_free``) keeps only the 8-bit codes
of a weight and applies each optimizer update as dequantize -> update in fp32 -> re-quantize. With
round-to-nearest an update smaller than half a code step is lost every time; stochastic rounding
rounds up with probability equal to the distance from the lower grid point, so the expected code is
the input and small updates survive on average.

The math every implementation (this reference, ``csrc/cpu/weights_sr.cpp``, ``csrc/cuda/weights_sr.cu``)
follows bit for bit, given the same ``seed`` and ``offset``:

* Scales exactly as the deterministic op (``quant.ops``): per block ``s = absmax / Q`` rounded to the
  scale dtype (fp32 or bf16), or one scale for the whole tensor when ``scales`` has one element
  (fp8 only); ``inv = min(1/s, FLT_MAX)`` (0 when ``s == 0``); ``y = x * inv`` in fp32, clamped to
  ``[-Q, Q]``. A block holding NaN/Inf gets a NaN scale and zero codes (the front end raises).
* Random bits per element ``i`` (flat index): a counter ``c = offset + i`` and

      key = h(seed mod 2^32);  r = h((c mod 2^32) xor h(key xor (c >> 32) mod 2^32));  u = (r >> 8) / 2^24

  with ``h`` the 32-bit integer hash "lowbias32" (x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15;
  x *= 0x846ca68b; x ^= x >> 16, arithmetic mod 2^32), a bijection with full avalanche. The inner hash
  depends only on the counter's high word, so it is one constant per 2^32 elements and each element
  costs one hash (the hash is most of a vector kernel's work per value). ``u`` is uniform on the 2^24
  multiples of 2^-24 in [0, 1). Counter-based: no generator state, any element can be computed alone
  (the CUDA kernel, threads in any order), and one ``(seed, offset)`` names one draw.
* Rounding on the magnitude ``a = |y|``: ``lo`` is the largest grid value ``<= a`` and ``hi`` the next
  one (int8: ``floor(a)`` and ``floor(a) + 1``; fp8: neighbouring codes of the format, found from the
  round-to-nearest-even code). Round up iff ``u * (hi - lo) < a - lo``; both sides are exact in fp32
  (``hi - lo`` is a power of two, ``a - lo`` is exact by Sterbenz), so ``P(up) = (a - lo)/(hi - lo)``
  up to the 2^-24 resolution of ``u``: ``E[value(q)] = y`` within 2^-24 of a grid step. The sign is
  then put back (int8: ``-q``; fp8: the sign bit, so ``-0`` is ``0x80``).

Formats: ``SR_FORMATS``, the rows of ``deepspeed_ppq.formats`` with ``stochastic_rounding`` (int8,
fp8_e4m3, fp8_e5m2; 4-bit grids lose most updates even with stochastic rounding).
"""

from __future__ import annotations

import torch

from deepspeed_ppq.formats import FORMATS, SR_FORMATS
from deepspeed_ppq.ops import define_op
from deepspeed_ppq.quant import ops as _ops

__all__ = ["SR_FORMATS", "sr_uniform", "weight_quantize_sr_out", "weight_quantize_sr"]

# fp8 formats with a stochastic-rounding quantizer: (code dtype, largest finite code <= Q), from the table
_FP8 = {s.name: (getattr(torch, s.code_dtype), s.max_code) for s in FORMATS
        if s.kind == "fp8" and s.stochastic_rounding}
_M32 = 0xFFFFFFFF
_FLT_MAX = 3.4028234663852886e38


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (split x in 16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + ((hi * (c & 0xFFFF)) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sr_uniform(n: int, seed: int, offset: int = 0, device=None) -> torch.Tensor:
    """The ``n`` random numbers ``u`` in [0, 1) (fp32, multiples of 2^-24) of draw ``(seed, offset)``."""
    c = torch.arange(n, dtype=torch.int64, device=device) + offset
    key = _hash32(torch.tensor(seed & _M32, dtype=torch.int64, device=device))
    r = _hash32((c & _M32) ^ _hash32(key ^ ((c >> 32) & _M32)))
    return (r >> 8).to(torch.float32) * (2.0**-24)


def _sr_codes_ref(xb: torch.Tensor, s: torch.Tensor, fmt: str, n: int, seed: int,
                  offset: int) -> torch.Tensor:
    """[nb, B] fp32 and fp32 stored scales [nb] or [1] -> flat stochastic codes [n]."""
    s = s.reshape(-1, 1)
    qmax = _ops.format_qmax(fmt)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s)).clamp(max=_FLT_MAX)
    y = (xb * inv).clamp(-qmax, qmax).reshape(-1)[:n]
    ok = torch.isfinite(s).expand_as(xb).reshape(-1)[:n]
    y = torch.where(ok, y, torch.zeros_like(y))
    a = y.abs()
    u = sr_uniform(n, seed, offset, xb.device)
    if fmt == "int8":
        lo = torch.floor(a)
        up = u * 1.0 < a - lo
        q = (lo + up.to(torch.float32)).to(torch.int8)
        return torch.where(y < 0, -q, q)
    dt, top = _FP8[fmt]
    c = a.to(dt).view(torch.uint8).to(torch.int16)
    v = c.to(torch.uint8).view(dt).to(torch.float32)
    lo_c = torch.where(v > a, c - 1, c)
    hi_c = torch.where(lo_c >= top, lo_c, lo_c + 1)
    lo = lo_c.to(torch.uint8).view(dt).to(torch.float32)
    hi = hi_c.to(torch.uint8).view(dt).to(torch.float32)
    q = torch.where(u * (hi - lo) < a - lo, hi_c, lo_c)
    q = torch.where(y < 0, q | 0x80, q)
    return q.to(torch.uint8).view(dt)


def _quantize_sr_out_ref(x, fmt, block_size, seed, offset, codes, scales):
    xb, n = _ops._as_blocks(x, block_size)
    s = _ops._ref_scales(xb, fmt, scales.numel(), scales.dtype)
    scales.copy_(s)
    codes.copy_(_sr_codes_ref(xb, s.to(torch.float32), fmt, n, seed, offset).view(codes.shape))


def _quantize_sr_out_fake(x, fmt, block_size, seed, offset, codes, scales):
    return None


_quantize_sr_out_op = define_op(
    "weight_quantize_sr_out(Tensor x, str fmt, int block_size, int seed, int offset, Tensor(a!) codes, "
    "Tensor(b!) scales) -> ()",
    _quantize_sr_out_ref,
    _quantize_sr_out_fake,
)


def _check_sr_format(fmt: str) -> None:
    if fmt not in SR_FORMATS:
        raise ValueError(
            f"fmt={fmt!r} has no stochastic-rounding quantizer: use one of {', '.join(SR_FORMATS)}"
        )


def _check_seed(seed: int, offset: int) -> None:
    if not isinstance(seed, int) or not 0 <= seed <= _M32:
        raise ValueError(f"seed={seed!r} is not allowed: use an int in [0, 2^32)")
    if not isinstance(offset, int) or not 0 <= offset < 2**62:
        raise ValueError(f"offset={offset!r} is not allowed: use an int in [0, 2^62)")


def weight_quantize_sr_out(x: torch.Tensor, fmt: str, block_size: int, seed: int, offset: int,
                           codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize ``x`` with stochastic rounding into ``codes`` and ``scales`` (reused buffers).

    Args:
        x: fp32 or bf16 tensor, any shape.
        fmt: one of ``SR_FORMATS``.
        block_size: values per scale, a power of two in [16, 4096].
        seed: in [0, 2^32); with ``offset`` it names the random draw (same draw -> same codes).
        offset: counter of the first element, in [0, 2^62): advance it by ``x.numel()`` per call.
        codes, scales: as ``quant.ops.weight_quantize_out``.

    Raises:
        ValueError: a bad argument, or NaN/Inf in ``x`` (after writing; the scales mark the blocks).
    """
    _check_sr_format(fmt)
    _check_seed(seed, offset)
    _ops._check_common(x, fmt, block_size)
    _ops._check_codes(codes, x.numel(), fmt)
    _ops._check_scales(scales, x.numel(), fmt, block_size)
    _quantize_sr_out_op(x.contiguous(), fmt, block_size, seed, offset, codes, scales)
    _ops.check_quantized_scales(scales, x, fmt)


def weight_quantize_sr(x: torch.Tensor, fmt: str, block_size: int = 64, seed: int = 0, offset: int = 0,
                       scale_dtype: torch.dtype = torch.float32,
                       per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocating form of ``weight_quantize_sr_out``: returns ``(codes, scales)``."""
    _check_sr_format(fmt)
    _check_seed(seed, offset)
    _ops._check_quantize_args(x, fmt, block_size, scale_dtype, per_tensor)  # before allocating
    n = x.numel()
    codes = torch.empty(n, dtype=_ops.code_dtype(fmt), device=x.device)
    nsc = 1 if per_tensor else _ops.num_blocks(n, block_size)
    scales = torch.empty(nsc, dtype=scale_dtype, device=x.device)
    weight_quantize_sr_out(x, fmt, block_size, seed, offset, codes, scales)
    return codes, scales
