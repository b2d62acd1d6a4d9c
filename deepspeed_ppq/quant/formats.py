"""Low-bit weight formats: a blockwise-quantized weight as a small object of plain tensors.

    qw = quantize_weight(w, "nf4", block_size=64)          # or QuantizedWeight.from_float(w, "nf4", ...)
    w_hat = qw.dequantize(torch.bfloat16)                   # or qw.dequantize(out=buffer): in place
    qw.requantize_(w_new)                                   # same shape: reuses qdata/scale storage
    qw.nbytes, qw.storage_tensors()                         # exact bytes, for the memory ledger
    weight_storage_bytes(shape, "nf4", 64)                  # the same bytes from the shape alone

Formats (one row each in ``deepspeed_ppq.formats``; math in ``deepspeed_ppq.quant.ops``; all blockwise
over the flattened tensor, the last block may be partial):

======== ============================== ===================================== ==================
format   codes (``qdata``)              value                                 scale ``s``
======== ============================== ===================================== ==================
int8     int8 [n], -127..127            ``q * s``                             absmax / 127
int4     uint8 [ceil(n/2)], nibble q+8  ``(nibble - 8) * s``, q in -7..7      absmax / 7
nf4      uint8 [ceil(n/2)], nibble idx  ``NF4_CODE[idx] * s`` (QLoRA code)    absmax
fp8_e4m3 float8_e4m3fn [n]              ``float(q) * s``                      absmax / 448
fp8_e5m2 float8_e5m2 [n]                ``float(q) * s``                      absmax / 57344
======== ============================== ===================================== ==================

Nibble order (int4, nf4): the first of two consecutive values sits in the **high** nibble, as in
bitsandbytes; an odd count pads the last low nibble with the zero code. NF4 codes and fp32 scales
are bit-identical to ``bitsandbytes.functional.quantize_4bit(x, blocksize=B, quant_type="nf4")``
(packed there as shape ``[ceil(n/2), 1]``).

Scales are stored in fp32 or bf16 (``scale_dtype``); the codes are computed against the stored,
rounded scale. FP8 formats may use one scale for the whole tensor (``fp8_scale="tensor"``).

Double quantization (``double_quant=True``, like bitsandbytes' ``compress_statistics``): the fp32
block scales are grouped in blocks of 256 and stored as **uint8** codes ``c = ceil(s / S)`` with one
fp32 ``S = max(s in group) / 255`` per group (``scale_scale``). Scales are non-negative, so all 256
levels serve magnitudes (bitsandbytes instead subtracts the mean and uses its signed dynamic 8-bit
code). Rounding *up* means a dequantized scale is never smaller than the block's absmax needs, so no
weight clips; the weight codes are computed against the dequantized scales. ``scale_dtype`` has no
effect then: what is stored is the uint8 codes plus the fp32 group scales (a 64-block weight costs
4.13 instead of 4.5 bits per value for nf4 with fp32 scales).

Non-finite weights raise ``ValueError`` naming the shape, the format and the number of NaN/Inf
values (the kernels mark such a block with a NaN scale; the check reads only the scales); a finite
block whose scale overflows bf16 (nf4 with ``scale_dtype="bf16"`` and absmax above about 3.39e38)
raises a different ``ValueError`` naming the scale dtype. If ``requantize_`` raises, the buffers hold
partial results and must be requantized from finite data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from deepspeed_ppq.config import WeightFormat
from deepspeed_ppq.formats import FORMATS, format_spec
from deepspeed_ppq.quant import ops as _ops

__all__ = [
    "QuantizedWeight",
    "quantize_weight",
    "weight_storage_bytes",
    "DOUBLE_QUANT_GROUP",
]

DOUBLE_QUANT_GROUP = 256  # double quantization: uint8 scale codes in groups of 256, one fp32 scale each
_SCALE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, torch.float32: torch.float32,
                 torch.bfloat16: torch.bfloat16}
_FP8_SCALES = ("block", "tensor")
_PER_TENSOR = ", ".join(s.name for s in FORMATS if s.per_tensor_scale)


def _scale_dtype(scale_dtype) -> torch.dtype:
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale_dtype={scale_dtype!r} is not allowed: use 'fp32' or 'bf16'")
    return _SCALE_DTYPES[scale_dtype]


def _check_fp8_scale(fp8_scale) -> None:
    if fp8_scale not in _FP8_SCALES:
        raise ValueError(f"fp8_scale={fp8_scale!r} is not allowed: use 'block' or 'tensor'")


def _to_format(fmt) -> WeightFormat:
    """The ``WeightFormat`` of a low-bit format name (``ValueError`` naming the allowed ones otherwise)."""
    return WeightFormat(format_spec(fmt).name)


class QuantizedWeight:
    """A blockwise low-bit weight: codes, scales and what is needed to rebuild the float tensor.

    Attributes:
        fmt: the ``WeightFormat``.
        qdata: codes, flat (see the module table for dtype and length).
        scale: block scales, fp32 or bf16 [num_blocks] (fp8 per-tensor: [1]); uint8 codes of the
            scales when ``double_quant`` (then ``scale_scale`` holds fp32 per-256 group scales).
        shape, dtype: of the original float tensor (``dequantize()`` returns this dtype by default).
        block_size: values per scale.
    """

    def __init__(self, fmt, qdata: torch.Tensor, scale: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                 block_size: int, *, scale_scale: torch.Tensor | None = None, fp8_scale: str = "block"):
        self.fmt = _to_format(fmt)
        self.qdata = qdata
        self.scale = scale
        self.scale_scale = scale_scale
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.block_size = block_size
        self.fp8_scale = fp8_scale

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_float(cls, w: torch.Tensor, fmt, block_size: int = 64, scale_dtype="fp32",
                   double_quant: bool = False, fp8_scale: str = "block") -> QuantizedWeight:
        """Quantize a float tensor (fp32 or bf16, any shape).

        Args:
            w: the weight.
            fmt: the low-bit format (a ``WeightFormat`` or its name).
            block_size: values per scale, a power of two in [16, 4096].
            scale_dtype: ``"fp32"`` or ``"bf16"`` (ignored with ``double_quant``, see the module doc).
            double_quant: store the scales as uint8 codes with fp32 scales per 256 of them.
            fp8_scale: ``"block"`` or ``"tensor"`` (one scale for the whole tensor; fp8 formats only).

        Returns:
            The quantized weight.

        Raises:
            ValueError: a bad argument, or NaN/Inf values in ``w``.
        """
        f = _to_format(fmt).value
        _ops.check_block_size(block_size)
        _ops.check_float_input(w, "w")
        sdt = _scale_dtype(scale_dtype)
        _check_fp8_scale(fp8_scale)
        if fp8_scale == "tensor" and not format_spec(f).per_tensor_scale:
            raise ValueError(f"fp8_scale='tensor' is only for fp8 formats ({_PER_TENSOR}), got fmt={f!r}; "
                             "use 'block'")
        n = w.numel()
        nscales = 1 if fp8_scale == "tensor" else _ops.num_blocks(n, block_size)
        qdata = torch.empty(_ops.codes_numel(f, n), dtype=_ops.code_dtype(f), device=w.device)
        if double_quant:
            ngroups = -(-nscales // DOUBLE_QUANT_GROUP)
            scale = torch.empty(nscales, dtype=torch.uint8, device=w.device)
            scale_scale = torch.empty(ngroups, dtype=torch.float32, device=w.device)
        else:
            scale = torch.empty(nscales, dtype=sdt, device=w.device)
            scale_scale = None
        qw = cls(f, qdata, scale, w.shape, w.dtype, block_size, scale_scale=scale_scale, fp8_scale=fp8_scale)
        qw.requantize_(w)
        return qw

    def requantize_(self, w: torch.Tensor) -> None:
        """Quantize ``w`` (same shape, fp32 or bf16) into this object's existing buffers."""
        if not isinstance(w, torch.Tensor) or w.shape != self.shape:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"requantize_ needs a tensor of shape {tuple(self.shape)}, got {got}")
        _ops.check_float_input(w, "w")
        f = self.fmt.value
        w = w.contiguous()
        if self.scale_scale is None:
            _ops.weight_quantize_out(w, f, self.block_size, self.qdata, self.scale)
            _ops.check_quantized_scales(self.scale, w, f, "weight")
            return
        # Double quantization: fp32 scales -> uint8 codes per group of 256 -> codes against them.
        s = torch.empty(self.scale.numel(), dtype=torch.float32, device=w.device)
        _ops.weight_quantize_out(w, f, self.block_size, self.qdata, s)
        _ops.check_quantized_scales(s, w, f, "weight")
        _quantize_scales(s, self.scale, self.scale_scale)
        _ops.weight_quantize_codes_out(w, self.block_scales(), f, self.block_size, self.qdata)

    # -- reading -----------------------------------------------------------------------------
    def block_scales(self) -> torch.Tensor:
        """The scales as used by the kernels (fp32 after undoing double quantization)."""
        if self.scale_scale is None:
            return self.scale
        return _dequantize_scales(self.scale, self.scale_scale)

    def dequantize(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float tensor.

        Args:
            dtype: fp32 or bf16; default the original dtype (or ``out``'s).
            out: a reused buffer (contiguous, ``self.shape``, fp32 or bf16) written in place.

        Returns:
            ``out`` if given, else a new tensor of ``self.shape``.
        """
        f = self.fmt.value
        if out is not None:
            if out.shape != self.shape:
                raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(self.shape)}")
            if dtype is not None and out.dtype != dtype:
                raise ValueError(f"out has dtype {out.dtype} but dtype={dtype} was asked for")
            return _ops.weight_dequantize_out(self.qdata, self.block_scales(), f, self.block_size, out)
        return _ops.weight_dequantize(self.qdata, self.block_scales(), f, self.block_size, self.shape,
                                      dtype or self.dtype)

    @property
    def nbytes(self) -> int:
        """Exact bytes of every stored tensor (codes, scales, double-quantization group scales)."""
        return sum(t.numel() * t.element_size() for t in self.storage_tensors().values())

    def storage_tensors(self) -> dict[str, torch.Tensor]:
        """``{"qdata", "scale"[, "scale_scale"]}`` -> tensor, for the memory ledger."""
        d = {"qdata": self.qdata, "scale": self.scale}
        if self.scale_scale is not None:
            d["scale_scale"] = self.scale_scale
        return d

    @property
    def double_quant(self) -> bool:
        return self.scale_scale is not None

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.nbytes / math.prod(self.shape)

    def __repr__(self) -> str:
        dq = ", double_quant" if self.double_quant else ""
        return (f"{type(self).__name__}(fmt={self.fmt.value}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"block_size={self.block_size}, scale={self.scale.dtype}{dq}, nbytes={self.nbytes})")


def quantize_weight(w: torch.Tensor, fmt, block_size: int = 64, scale_dtype="fp32",
                    double_quant: bool = False, fp8_scale: str = "block") -> QuantizedWeight:
    """Quantize ``w`` to ``fmt`` (a ``WeightFormat`` or its name); see ``QuantizedWeight.from_float``."""
    return QuantizedWeight.from_float(w, fmt, block_size, scale_dtype, double_quant, fp8_scale)


def weight_storage_bytes(
    shape: Sequence[int],
    fmt,
    block_size: int = 64,
    scale_dtype: str = "fp32",
    double_quant: bool = False,
    fp8_scale: str = "block",
) -> dict[str, int]:
    """Exact bytes of a low-bit weight's storage, from its shape alone: ``{"codes": ..., "scales": ...}``.

    The same bytes as ``quantize_weight(w, fmt, ...).nbytes`` splits into codes and scales: blocks run
    over the flattened weight (the last may be partial), codes take the format's bits per value (4-bit
    formats pack two per byte), a per-tensor scale (``fp8_scale="tensor"``, where the format allows it) is
    one; with ``double_quant`` the scales are uint8 codes plus one fp32 scale per ``DOUBLE_QUANT_GROUP`` of
    them (``scale_dtype`` is then unused; it is still checked, as in ``quantize_weight``). An
    ``fp8_scale="tensor"`` with a format that has only block scales counts block scales (the ledger
    passes one setting for every format).

    Raises:
        ValueError: a bad argument (the same allowed values as ``quantize_weight``), or a shape that is
            not a sequence of ints >= 0.
    """
    spec = format_spec(fmt)
    _ops.check_block_size(block_size)
    _scale_dtype(scale_dtype)
    _check_fp8_scale(fp8_scale)
    if not isinstance(shape, Sequence) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"shape={shape!r} is not allowed: use a sequence of ints >= 0")
    n = math.prod(shape)
    nb = 1 if spec.per_tensor_scale and fp8_scale == "tensor" else math.ceil(n / block_size)
    if double_quant:
        scales = nb + math.ceil(nb / DOUBLE_QUANT_GROUP) * 4
    else:
        scales = nb * _scale_dtype(scale_dtype).itemsize
    return {"codes": spec.code_elements(n), "scales": scales}


# -- double quantization of the scales (small tensors: num_blocks values) -----------------------
def _quantize_scales(s: torch.Tensor, codes: torch.Tensor, group_scales: torch.Tensor) -> None:
    """fp32 scales [nb] >= 0 -> uint8 codes [nb] = ceil(s / S), S = group max / 255 per 256."""
    nb = s.numel()
    g = DOUBLE_QUANT_GROUP
    ng = group_scales.numel()
    sp = torch.nn.functional.pad(s, (0, ng * g - nb)).view(ng, g)
    S = sp.amax(dim=1) / 255.0
    inv = torch.where(S > 0, 1.0 / S, torch.zeros_like(S)).clamp(max=3.4028234663852886e38)
    c = torch.ceil(sp * inv.view(ng, 1)).clamp(0, 255).to(torch.uint8)
    codes.copy_(c.reshape(-1)[:nb])
    group_scales.copy_(S)


def _dequantize_scales(codes: torch.Tensor, group_scales: torch.Tensor) -> torch.Tensor:
    nb = codes.numel()
    g = DOUBLE_QUANT_GROUP
    ng = group_scales.numel()
    c = torch.nn.functional.pad(codes.to(torch.float32), (0, ng * g - nb)).view(ng, g)
    return (c * group_scales.view(ng, 1)).reshape(-1)[:nb].contiguous()
