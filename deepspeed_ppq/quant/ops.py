"""``ppq::weight_*`` ops: blockwise low-bit weight quantization, with plain-PyTorch references.

The math every implementation (this reference, ``csrc/cpu/weights.cpp``, ``csrc/cuda/weights.cu``)
follows bit for bit. A tensor is flattened and cut into blocks of ``block_size`` values (the last
block may be partial). Per block, ``absmax = max |x|`` in fp32 and the stored scale is

    s = absmax / Q     (Q = ``qmax`` of the format's row in ``deepspeed_ppq.formats``: 127 int8, 7 int4,
                        1 nf4, 448 fp8_e4m3, 57344 fp8_e5m2)

rounded to the scale dtype (fp32 or bf16, round-to-nearest-even); the codes are computed against the
*stored* scale (so a bf16 scale that rounded down clamps instead of overflowing):

* int8: ``q = clamp(rne(x * inv), -127, 127)`` with ``inv = min(1/s, FLT_MAX)`` (0 when s == 0).
* int4: the same with 7; stored as the nibble ``q + 8`` (1..15), two per byte, the **first value in
  the high nibble** (bitsandbytes' order); an odd tail is padded with the zero code.
* nf4: bitsandbytes' rule exactly: ``y = clamp(x * (1 / max(s, 1e-38)), -1, 1)`` for full blocks and
  ``clamp(x / max(s, 1e-38), -1, 1)`` for a partial last block; the code is the number of midpoints
  between neighbouring NF4 values that are ``< y`` (``torch.bucketize``, ties go to the lower code).
  Packing as int4. With fp32 scales the codes and scales equal ``bitsandbytes.functional.quantize_4bit``.
* fp8_e4m3 / fp8_e5m2: ``float8(clamp(x * inv, -Q, Q))`` (round-to-nearest-even); the scale is per
  block, or one scale for the whole tensor when ``scales`` has a single element ("tensor" scaling).

Dequantize: ``value(q) * s`` in fp32, then rounded to the output dtype (fp32 or bf16).

Non-finite input: a block holding NaN or Inf gets a NaN scale; the Python front ends
(``deepspeed_ppq.quant.formats``, ``quant.sr_ops``) check the scales with ``check_quantized_scales`` and
raise ``ValueError``. So does a finite block whose scale overflows a bf16 scale (nf4: absmax above
about 3.39e38). Given scales (``weight_quantize_codes_out``) must be finite and ``>= 0`` (0 for an
all-zero block); others would silently give zero codes, so the front end rejects them.

Ops (schemas below): ``weight_quantize_out`` (codes and scales in one pass into caller buffers),
``weight_quantize_codes_out`` (codes from given fp32 scales: double quantization),
``weight_dequantize_out`` (into a reused buffer), and the allocating ``weight_quantize`` /
``weight_dequantize``.
"""

from __future__ import annotations

import math

import torch

from deepspeed_ppq.formats import FORMATS, WEIGHT_FORMATS, format_spec
from deepspeed_ppq.ops import define_op

__all__ = [
    "WEIGHT_FORMATS",
    "NF4_CODE",
    "format_qmax",
    "code_dtype",
    "codes_numel",
    "num_blocks",
    "check_block_size",
    "check_format",
    "check_float_input",
    "check_quantized_scales",
    "weight_quantize",
    "weight_quantize_out",
    "weight_quantize_codes_out",
    "weight_dequantize",
    "weight_dequantize_out",
]

# The QLoRA NF4 codebook (the format table's), the same fp32 literals as
# bitsandbytes.functional.get_4bit_type("nf4").
NF4_CODE = format_spec("nf4").code_map

_FP8_DTYPE = {s.name: getattr(torch, s.code_dtype) for s in FORMATS if s.kind == "fp8"}
_FLT_MAX = 3.4028234663852886e38
_FLOATS = (torch.float32, torch.bfloat16)


def format_qmax(fmt: str) -> float:
    """The ``Q`` of a format: the stored scale is ``absmax / Q``."""
    return format_spec(fmt).qmax


def code_dtype(fmt: str) -> torch.dtype:
    """The dtype of a format's code tensor."""
    return getattr(torch, format_spec(fmt).code_dtype)


def codes_numel(fmt: str, n: int) -> int:
    """Number of code elements for ``n`` values (4-bit formats pack two per byte)."""
    return format_spec(fmt).code_elements(n)


def num_blocks(n: int, block_size: int) -> int:
    return max(1, -(-n // block_size))


def check_format(fmt: str) -> None:
    """Raise ``ValueError`` naming ``fmt`` and the allowed formats unless it is a low-bit weight format."""
    format_spec(fmt)


def check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or not 16 <= block_size <= 4096 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size!r} is not allowed: use a power of two in [16, 4096]")


def check_float_input(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise ValueError(
            f"{name} has dtype {x.dtype}; weight quantization takes torch.float32 or torch.bfloat16"
        )
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}); nothing to quantize")


def check_quantized_scales(scales: torch.Tensor, x: torch.Tensor, fmt: str, what: str = "tensor") -> None:
    """Raise ``ValueError`` if quantizing ``x`` wrote a non-finite scale (reads only the scales).

    A non-finite scale means NaN/Inf in ``x`` (the message counts them) or, with finite ``x``, a block
    whose scale ``absmax / Q`` overflowed the scale dtype (bf16 with nf4's ``Q = 1``).
    """
    if bool(torch.isfinite(scales).all()):
        return
    head = f"cannot quantize a {what} of shape {tuple(x.shape)} to {fmt}"
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        raise ValueError(f"{head}: {bad} NaN/Inf value(s) of {x.numel()}")
    q = format_qmax(fmt)
    raise ValueError(
        f"{head}: a block's scale (absmax / {q:g}) overflows the scale dtype {scales.dtype}, whose largest "
        f"absmax is about {torch.finfo(scales.dtype).max * q:.4g}; use float32 scales"
    )


# ---------------------------------------------------------------------------------------------
# Reference math (plain PyTorch). Shape legend: nb = number of blocks, B = block_size, n = numel.
# ---------------------------------------------------------------------------------------------
def _nf4_table(device) -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def _nf4_midpoints(device) -> torch.Tensor:
    t = _nf4_table(device)
    return (t[:-1] + t[1:]) / 2


def _as_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """x (any shape) -> fp32 [nb, B] zero-padded, and n."""
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    nb = num_blocks(n, block_size)
    if nb * block_size != n:
        flat = torch.nn.functional.pad(flat, (0, nb * block_size - n))
    return flat.view(nb, block_size), n


def _ref_scales(xb: torch.Tensor, fmt: str, nscales: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """[nb, B] fp32 -> stored scales [nscales] (NaN where a block holds NaN/Inf)."""
    bad = ~torch.isfinite(xb).all(dim=1)
    absmax = xb.abs().amax(dim=1)
    if nscales == 1 and xb.shape[0] > 1:
        absmax, bad = absmax.amax().reshape(1), bad.any().reshape(1)
    s = absmax / format_qmax(fmt)
    s = torch.where(bad, torch.full_like(s, float("nan")), s)
    return s.to(scale_dtype)


def _pack_nibbles(q: torch.Tensor, n: int, pad: int) -> torch.Tensor:
    """uint8 nibble values [>= n] -> packed [ceil(n/2)], first value in the high nibble."""
    q = q.reshape(-1)[:n]
    if n % 2:
        q = torch.cat([q, q.new_full((1,), pad)])
    return (q[0::2] << 4) | q[1::2]


def _unpack_nibbles(codes: torch.Tensor, n: int) -> torch.Tensor:
    c = codes.reshape(-1)
    return torch.stack([c >> 4, c & 0xF], dim=1).reshape(-1)[:n]


def _ref_codes(xb: torch.Tensor, s: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
    """[nb, B] fp32 and fp32 scales [nb] or [1] -> flat codes."""
    s = s.reshape(-1, 1)
    if fmt == "nf4":
        sc = s.clamp(min=1e-38)
        y = xb * (1.0 / sc)
        if n % xb.shape[1]:  # bitsandbytes divides the partial last block instead of multiplying
            y[-1] = xb[-1] / sc[-1 if sc.shape[0] > 1 else 0]
        q = torch.bucketize(y.clamp(-1, 1), _nf4_midpoints(xb.device)).to(torch.uint8)
        return _pack_nibbles(q, n, pad=7)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s)).clamp(max=_FLT_MAX)
    qmax = format_qmax(fmt)
    y = xb * inv
    if fmt in _FP8_DTYPE:
        return y.clamp(-qmax, qmax).reshape(-1)[:n].to(_FP8_DTYPE[fmt])
    q = torch.round(y).clamp(-qmax, qmax).to(torch.int8)
    if fmt == "int8":
        return q.reshape(-1)[:n]
    return _pack_nibbles((q + 8).to(torch.uint8), n, pad=8)


def _ref_values(codes: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
    """flat codes -> fp32 values before scaling [n]."""
    if fmt == "int8":
        return codes.reshape(-1).to(torch.float32)
    if fmt in _FP8_DTYPE:
        return codes.reshape(-1).to(torch.float32)
    nib = _unpack_nibbles(codes, n)
    if fmt == "nf4":
        return _nf4_table(codes.device)[nib.long()]
    return nib.to(torch.float32) - 8.0


def _ref_dequantize_into(codes, scales, fmt, block_size, n) -> torch.Tensor:
    v = _ref_values(codes, fmt, n)
    s = scales.to(torch.float32).reshape(-1)
    if s.numel() == 1:
        return v * s
    nb = s.numel()
    pad = nb * block_size - n
    v = torch.nn.functional.pad(v, (0, pad)).view(nb, block_size)
    return (v * s.view(nb, 1)).reshape(-1)[:n]


# ---------------------------------------------------------------------------------------------
# Op bodies: reference kernels (registered as the default) and fake kernels.
# ---------------------------------------------------------------------------------------------
def _quantize_out_ref(x, fmt, block_size, codes, scales):
    xb, n = _as_blocks(x, block_size)
    s = _ref_scales(xb, fmt, scales.numel(), scales.dtype)
    scales.copy_(s)
    codes.copy_(_ref_codes(xb, s.to(torch.float32), fmt, n).view(codes.dtype).view(codes.shape))


def _quantize_out_fake(x, fmt, block_size, codes, scales):
    return None


def _quantize_codes_out_ref(x, scales, fmt, block_size, codes):
    xb, n = _as_blocks(x, block_size)
    codes.copy_(_ref_codes(xb, scales.to(torch.float32), fmt, n).view(codes.dtype).view(codes.shape))


def _quantize_codes_out_fake(x, scales, fmt, block_size, codes):
    return None


def _dequantize_out_ref(codes, scales, fmt, block_size, out):
    out.copy_(_ref_dequantize_into(codes, scales, fmt, block_size, out.numel()).view(out.shape))


def _dequantize_out_fake(codes, scales, fmt, block_size, out):
    return None


def _nscales(n, block_size, per_tensor):
    return 1 if per_tensor else num_blocks(n, block_size)


def _quantize_ref(x, fmt, block_size, scale_dtype, per_tensor):
    n = x.numel()
    codes = torch.empty(codes_numel(fmt, n), dtype=code_dtype(fmt), device=x.device)
    scales = torch.empty(_nscales(n, block_size, per_tensor), dtype=scale_dtype, device=x.device)
    _quantize_out_ref(x, fmt, block_size, codes, scales)
    return codes, scales


def _quantize_fake(x, fmt, block_size, scale_dtype, per_tensor):
    n = x.numel()
    codes = x.new_empty(codes_numel(fmt, n), dtype=code_dtype(fmt))
    scales = x.new_empty(_nscales(n, block_size, per_tensor), dtype=scale_dtype)
    return codes, scales


def _dequantize_ref(codes, scales, fmt, block_size, shape, dtype):
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    _dequantize_out_ref(codes, scales, fmt, block_size, out)
    return out


def _dequantize_fake(codes, scales, fmt, block_size, shape, dtype):
    return codes.new_empty(shape, dtype=dtype)


_quantize_out_op = define_op(
    "weight_quantize_out(Tensor x, str fmt, int block_size, Tensor(a!) codes, Tensor(b!) scales) -> ()",
    _quantize_out_ref, _quantize_out_fake,
)
_quantize_codes_out_op = define_op(
    "weight_quantize_codes_out(Tensor x, Tensor scales, str fmt, int block_size, Tensor(a!) codes) -> ()",
    _quantize_codes_out_ref, _quantize_codes_out_fake,
)
_dequantize_out_op = define_op(
    "weight_dequantize_out(Tensor codes, Tensor scales, str fmt, int block_size, Tensor(a!) out) -> ()",
    _dequantize_out_ref, _dequantize_out_fake,
)
_quantize_op = define_op(
    "weight_quantize(Tensor x, str fmt, int block_size, ScalarType scale_dtype, bool per_tensor)"
    " -> (Tensor, Tensor)",
    _quantize_ref, _quantize_fake,
)
_dequantize_op = define_op(
    "weight_dequantize(Tensor codes, Tensor scales, str fmt, int block_size, int[] shape, ScalarType dtype)"
    " -> Tensor",
    _dequantize_ref, _dequantize_fake,
)


# ---------------------------------------------------------------------------------------------
# Checked front ends: validate in Python (clear errors) before dispatch.
# ---------------------------------------------------------------------------------------------
def _check_common(x, fmt, block_size):
    check_format(fmt)
    check_block_size(block_size)
    check_float_input(x)


def _check_quantize_args(x, fmt, block_size, scale_dtype, per_tensor):
    """The arguments of an allocating quantize (``weight_quantize``, ``sr_ops.weight_quantize_sr``)."""
    _check_common(x, fmt, block_size)
    if scale_dtype not in _FLOATS:
        raise ValueError(f"scale_dtype={scale_dtype} is not allowed: use torch.float32 or torch.bfloat16")
    if per_tensor and fmt not in _FP8_DTYPE:
        raise ValueError(f"per_tensor=True is only for fp8 formats, got fmt={fmt!r}")


def _check_scale_values(scales):
    """Given scales must be finite and >= 0 (an all-zero block's scale is 0): one reduction."""
    lo, hi = torch.stack(torch.aminmax(scales)).tolist()
    if lo >= 0 and hi <= _FLT_MAX:  # NaN fails both
        return
    flat = scales.reshape(-1)
    bad = ~(torch.isfinite(flat) & (flat >= 0))
    i = int(bad.nonzero()[0])
    raise ValueError(
        f"scales[{i}]={flat[i].item()} is not allowed ({int(bad.sum())} of {flat.numel()} bad): "
        "scales must be finite and >= 0 (a block's absmax / Q; 0 for an all-zero block)"
    )


def _check_scales(scales, n, fmt, block_size, *, fp32_only=False):
    nb = num_blocks(n, block_size)
    allowed = (torch.float32,) if fp32_only else _FLOATS
    if scales.dtype not in allowed:
        raise ValueError(f"scales has dtype {scales.dtype}; allowed: {', '.join(map(str, allowed))}")
    ok = (nb, 1) if fmt in _FP8_DTYPE else (nb,)
    if scales.numel() not in ok or not scales.is_contiguous():
        raise ValueError(
            f"scales must be a contiguous tensor of {' or '.join(map(str, ok))} elements for {n} values "
            f"in blocks of {block_size} ({fmt}), got shape {tuple(scales.shape)}"
        )


def _check_codes(codes, n, fmt):
    want = codes_numel(fmt, n)
    if codes.dtype != code_dtype(fmt) or codes.numel() != want or not codes.is_contiguous():
        raise ValueError(
            f"codes for {fmt} must be a contiguous {code_dtype(fmt)} tensor of {want} elements, "
            f"got {codes.dtype} of shape {tuple(codes.shape)}"
        )


def weight_quantize_out(x: torch.Tensor, fmt: str, block_size: int, codes: torch.Tensor,
                        scales: torch.Tensor) -> None:
    """Quantize ``x`` into ``codes`` and ``scales`` (caller-provided, reused buffers).

    Args:
        x: fp32 or bf16 tensor, any shape.
        fmt: one of ``WEIGHT_FORMATS``.
        block_size: values per scale, a power of two in [16, 4096].
        codes: ``code_dtype(fmt)`` tensor of ``codes_numel(fmt, x.numel())`` elements.
        scales: fp32 or bf16, ``num_blocks`` elements, or 1 element (fp8 only: per-tensor scale).
    """
    _check_common(x, fmt, block_size)
    _check_codes(codes, x.numel(), fmt)
    _check_scales(scales, x.numel(), fmt, block_size)
    _quantize_out_op(x.contiguous(), fmt, block_size, codes, scales)


def weight_quantize_codes_out(x: torch.Tensor, scales: torch.Tensor, fmt: str, block_size: int,
                              codes: torch.Tensor) -> None:
    """Quantize ``x`` against given fp32 ``scales`` (used by double quantization) into ``codes``.

    The scales must be finite and ``>= 0`` (``ValueError`` naming the first bad one otherwise).
    """
    _check_common(x, fmt, block_size)
    _check_codes(codes, x.numel(), fmt)
    _check_scales(scales, x.numel(), fmt, block_size, fp32_only=True)
    _check_scale_values(scales)
    _quantize_codes_out_op(x.contiguous(), scales, fmt, block_size, codes)


def weight_dequantize_out(codes: torch.Tensor, scales: torch.Tensor, fmt: str, block_size: int,
                          out: torch.Tensor) -> torch.Tensor:
    """Dequantize into ``out`` (fp32 or bf16, contiguous, ``n`` elements), in place; returns ``out``."""
    check_format(fmt)
    check_block_size(block_size)
    check_float_input(out, "out")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")
    _check_codes(codes, out.numel(), fmt)
    _check_scales(scales, out.numel(), fmt, block_size)
    _dequantize_out_op(codes, scales, fmt, block_size, out)
    return out


def weight_quantize(x: torch.Tensor, fmt: str, block_size: int = 64, scale_dtype: torch.dtype = torch.float32,
                    per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocating quantize: returns ``(codes, scales)``."""
    _check_quantize_args(x, fmt, block_size, scale_dtype, per_tensor)
    return _quantize_op(x.contiguous(), fmt, block_size, scale_dtype, per_tensor)


def weight_dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str, block_size: int,
                      shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Allocating dequantize to ``shape`` in ``dtype`` (fp32 or bf16)."""
    check_format(fmt)
    check_block_size(block_size)
    if dtype not in _FLOATS:
        raise ValueError(f"dtype={dtype} is not allowed: use torch.float32 or torch.bfloat16")
    n = math.prod(shape)
    _check_codes(codes, n, fmt)
    _check_scales(scales, n, fmt, block_size)
    return _dequantize_op(codes, scales, fmt, block_size, list(shape), dtype)
