"""Stateless codecs: the payload layout, its exact size, and one encode/decode of a tensor.

A payload is one flat uint8 tensor whose size depends only on (shape, dtype, codec), so a receiver
allocates it from the logical shape with no metadata exchange. Layout (sections in this order, every
float section 4-byte aligned)::

    header   8 bytes: [status, method id, bits, values-only flag, dtype id, 0, 0, 0]
             status = 1 when the sender saw NaN/Inf (the receiver then decodes a NaN-filled tensor);
             dtype id = DTYPE_ID of the tensor encoded (0 only from senders older than this byte: rejected)
    none     raw bytes of x (its own dtype)
    quant    mins fp32[G] | scales fp32[G] | codes ceil(numel * bits / 8) bytes
    fp8      scales fp32[G] | codes numel bytes (fp8 bit patterns)
    topk     values x.dtype[B * K] | indices packed at ceil(log2(L)) bits each (absent when values_only)

Shapes: the first dimension is the sample (batch) dimension; B = shape[0], L = numel / B. Scale
granularity maps onto ``[R, d]`` rows with ``group`` values per scale:

    sample: R = B,             d = L,         group = L
    token:  R = numel / d,     d = shape[-1], group = d      (one scale per row of the last dim)
    group:  R = numel / d,     d = shape[-1], group = cfg.group_size (last group of a row may be short)

TopK keeps K = max(1, floor(topk_ratio * L)) elements of every sample, so no sample is zeroed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepspeed_ppq.compress import ops
from deepspeed_ppq.config import CodecConfig

__all__ = [
    "HEADER_NBYTES",
    "METHOD_ID",
    "DTYPE_ID",
    "PayloadLayout",
    "payload_layout",
    "payload_nbytes",
    "topk_k",
    "index_bits",
    "encode_into",
    "decode_from",
    "payload_status",
    "write_flagged",
]

HEADER_NBYTES = 8
METHOD_ID = {"none": 0, "quant": 1, "fp8": 2, "topk": 3}
"""The method id byte of the payload header, per codec method (the receiver checks it against its own)."""
DTYPE_ID = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
"""The dtype id byte of the payload header: the dtype of the tensor encoded (the receiver checks it against
the dtype it decodes for). 0 is never written: a payload carrying it predates the byte and is rejected."""
_DTYPE_OF_ID = {v: k for k, v in DTYPE_ID.items()}
_FP8_FMT = {"e4m3": 0, "e5m2": 1}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


def topk_k(cfg: CodecConfig, L: int) -> int:
    """Elements kept per sample of ``L`` elements."""
    return max(1, min(L, math.floor(cfg.topk_ratio * L)))


def index_bits(L: int) -> int:
    """Bits per packed index into a sample of ``L`` elements."""
    return max(1, (L - 1).bit_length())


@dataclass(frozen=True)
class PayloadLayout:
    """Where each section of a payload lies (byte offsets) and the shapes the kernels see."""

    method: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    rows: int = 0  # R
    cols: int = 0  # d
    group: int = 0
    ngroups: int = 0  # G = R * ceil(d / group)
    k: int = 0
    idx_bits: int = 0
    values_only: bool = False
    sec: tuple[tuple[int, int], ...] = ()  # (offset, nbytes) of each section after the header


def _check(shape, dtype) -> tuple[tuple[int, ...], torch.dtype]:
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0 or any(s <= 0 for s in shape):
        raise ValueError(f"shape={shape}: a compressed tensor needs at least one dimension and no empty dims")
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype={dtype}: codecs compress float32, bfloat16 or float16 tensors")
    return shape, dtype


def _rows(cfg: CodecConfig, shape: tuple[int, ...]) -> tuple[int, int, int]:
    numel = math.prod(shape)
    if cfg.granularity == "sample":
        d = numel // shape[0]
        return shape[0], d, d
    d = shape[-1]
    group = d if cfg.granularity == "token" else min(cfg.group_size, d)
    return numel // d, d, group


def payload_layout(cfg: CodecConfig, shape, dtype, *, values_only: bool = False) -> PayloadLayout:
    """The exact layout of ``cfg``'s payload for a tensor of ``shape`` and ``dtype``.

    Args:
        values_only: TopK gradients that reuse the activation's indices carry values only.
    """
    shape, dtype = _check(shape, dtype)
    numel = math.prod(shape)
    m = cfg.method
    h = HEADER_NBYTES
    if m == "none":
        n = numel * dtype.itemsize
        return PayloadLayout(m, shape, dtype, h + n, sec=((h, n),))
    if m in ("quant", "fp8"):
        R, d, group = _rows(cfg, shape)
        G = R * ((d + group - 1) // group)
        if m == "quant":
            nc = ops.packed_nbytes(numel, cfg.bits)
            secs = ((h, 4 * G), (h + 4 * G, 4 * G), (h + 8 * G, nc))
            total = h + 8 * G + nc
        else:
            secs = ((h, 4 * G), (h + 4 * G, numel))
            total = h + 4 * G + numel
        return PayloadLayout(m, shape, dtype, total, R, d, group, G, sec=secs)
    if m == "topk":
        B = shape[0]
        L = numel // B
        k = topk_k(cfg, L)
        b = index_bits(L)
        nv = _align4(B * k * dtype.itemsize)
        ni = 0 if values_only else ops.packed_nbytes(B * k, b)
        secs = ((h, B * k * dtype.itemsize), (h + nv, ni))
        return PayloadLayout(m, shape, dtype, h + nv + ni, B, L, 0, 0, k, b, values_only, secs)
    raise ValueError(f"method={m!r}: use none, quant, fp8 or topk")


def payload_nbytes(cfg: CodecConfig, shape, dtype, *, values_only: bool = False) -> int:
    """Exact size in bytes of ``cfg``'s payload for a tensor of ``shape`` and ``dtype``.

    Args:
        cfg: the codec of one direction.
        shape, dtype: the logical tensor.
        values_only: TopK gradients reusing the activation's indices (no index section).
    """
    return payload_layout(cfg, shape, dtype, values_only=values_only).nbytes


def _section(payload: torch.Tensor, sec: tuple[int, int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    off, n = sec
    return payload[off : off + n].view(dtype)


def payload_status(payload: torch.Tensor) -> int:
    """1 when the sender saw NaN/Inf, else 0."""
    return int(payload[0])


def write_flagged(payload: torch.Tensor, lay: PayloadLayout) -> torch.Tensor:
    """Fill ``payload`` (uint8, ``lay.nbytes``) as a flagged message: status 1, a valid header, zero body.
    A sender with nothing to encode (say a values-only TopK gradient whose activation was flagged, so no
    indices exist) sends this: the receiver gets a message of the agreed size and decodes NaN."""
    if payload.dtype != torch.uint8 or payload.numel() != lay.nbytes:
        raise ValueError(f"flagged payload must be uint8 of {lay.nbytes} bytes, got {payload.dtype} "
                         f"with {payload.numel()} elements")
    payload.zero_()
    bits = {"none": 0, "quant": 0, "fp8": 8, "topk": lay.idx_bits}[lay.method]
    _write_header(payload, lay, bits)
    payload[0] = 1
    return payload


def _write_header(payload: torch.Tensor, lay: PayloadLayout, bits: int) -> None:
    payload[1] = METHOD_ID[lay.method]
    payload[2] = bits
    payload[3] = int(lay.values_only)
    payload[4] = DTYPE_ID[lay.dtype]
    payload[5:HEADER_NBYTES] = 0


def _check_tensor(name: str, t: torch.Tensor, lay: PayloadLayout, dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != lay.shape or t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}; this payload layout is for {allowed} "
                         f"{lay.shape} (build the layout from the tensor's own shape and dtype)")


def encode_into(
    cfg: CodecConfig,
    x: torch.Tensor,
    payload: torch.Tensor,
    lay: PayloadLayout,
    *,
    indices: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Encode ``x`` into ``payload`` (uint8, ``lay.nbytes``), setting the status byte.

    Args:
        indices: TopK only: int64 ``[B, K]`` indices to gather at (values-only payloads or a caller's own
            selection, e.g. EF-mixed); when None the K largest per sample are chosen.

    Returns:
        The TopK indices ``[B, K]`` used (None for other methods).

    Raises:
        ValueError: ``x`` not of ``lay``'s shape and dtype, or ``payload`` not uint8 of ``lay.nbytes``.
    """
    _check_tensor("x", x, lay, (lay.dtype,))
    if payload.dtype != torch.uint8 or payload.numel() != lay.nbytes:
        raise ValueError(f"payload is {payload.dtype} with {payload.numel()} elements; this layout needs "
                         f"uint8 of {lay.nbytes} bytes")
    x = x.detach().contiguous()
    status = payload[0:1]
    if lay.method == "none":
        _section(payload, lay.sec[0]).copy_(x.reshape(-1).view(torch.uint8))
        status.fill_(int(not bool(torch.isfinite(x).all())))  # raw messages are checked too
        _write_header(payload, lay, 0)
        return None
    if lay.method == "quant":
        x2 = x.view(lay.rows, lay.cols)
        mins = _section(payload, lay.sec[0], torch.float32)
        scales = _section(payload, lay.sec[1], torch.float32)
        codes = _section(payload, lay.sec[2])
        ops.quant_encode(x2, lay.group, cfg.bits, mins, scales, codes, status)
        _write_header(payload, lay, cfg.bits)
        return None
    if lay.method == "fp8":
        x2 = x.view(lay.rows, lay.cols)
        scales = _section(payload, lay.sec[0], torch.float32)
        codes = _section(payload, lay.sec[1])
        ops.fp8_encode(x2, lay.group, _FP8_FMT[cfg.fp8_format], scales, codes, status)
        _write_header(payload, lay, 8)
        return None
    # topk
    B, L, k = lay.rows, lay.cols, lay.k
    x2 = x.view(B, L)
    values = _section(payload, lay.sec[0], x.dtype).view(B, k)
    if indices is None:
        indices = torch.empty(B, k, dtype=torch.int64, device=x.device)
        ops.topk_encode(x2, k, values, indices, status)
    else:
        if tuple(indices.shape) != (B, k):
            raise ValueError(f"indices shape {tuple(indices.shape)} does not match [B, K]=[{B}, {k}]")
        torch.gather(x2, 1, indices, out=values)
        status.fill_(int(not bool(torch.isfinite(x2).all())))
    if not lay.values_only:
        ops.pack_bits(indices, lay.idx_bits, _section(payload, lay.sec[1]))
    _write_header(payload, lay, lay.idx_bits)
    return indices


def decode_from(
    cfg: CodecConfig,
    payload: torch.Tensor,
    lay: PayloadLayout,
    out: torch.Tensor,
    *,
    indices: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Decode ``payload`` into ``out`` (contiguous, ``lay.shape``); ignores the status byte.

    Args:
        out: ``lay.dtype``, or float32 for a compressing method (the codec state decodes in fp32).
        indices: values-only TopK payloads: the int64 ``[B, K]`` indices the sender gathered at.

    Returns:
        The TopK indices ``[B, K]`` (decoded from the payload or the ones given); None for other methods.

    Raises:
        ValueError: a payload of another size, method or dtype than ``lay``'s, or ``out`` of another shape
            or dtype.
    """
    _check_tensor("out", out, lay, (lay.dtype,) if lay.method == "none" else (lay.dtype, torch.float32))
    if payload.dtype != torch.uint8 or payload.numel() != lay.nbytes:
        raise ValueError(
            f"payload has dtype {payload.dtype} and {payload.numel()} bytes; this codec expects uint8 and "
            f"{lay.nbytes} bytes for shape {lay.shape} {lay.dtype} (same codec on both stages?)"
        )
    _, mid, _, _, did = payload[:5].tolist()  # one read (a device sync on GPU)
    if mid != METHOD_ID[lay.method]:
        raise ValueError(
            f"payload was encoded with method id {mid}, the receiver expects {lay.method!r} "
            f"(id {METHOD_ID[lay.method]}): sender and receiver codec configs differ"
        )
    if did != DTYPE_ID[lay.dtype]:
        sent = _DTYPE_OF_ID.get(did, f"an unknown dtype (id {did})" if did else
                                "no recorded dtype (dtype id 0: a sender older than the dtype byte)")
        raise ValueError(
            f"payload was encoded from {sent}, the receiver decodes it as {lay.dtype} (id "
            f"{DTYPE_ID[lay.dtype]}): sender and receiver must use the same boundary dtype and version"
        )
    if lay.method == "none":
        out.view(-1).view(torch.uint8).copy_(_section(payload, lay.sec[0]))
        return None
    if lay.method == "quant":
        mins = _section(payload, lay.sec[0], torch.float32)
        scales = _section(payload, lay.sec[1], torch.float32)
        ops.quant_decode(_section(payload, lay.sec[2]), mins, scales, lay.group, cfg.bits,
                         out.view(lay.rows, lay.cols))
        return None
    if lay.method == "fp8":
        scales = _section(payload, lay.sec[0], torch.float32)
        ops.fp8_decode(_section(payload, lay.sec[1]), scales, lay.group, _FP8_FMT[cfg.fp8_format],
                       out.view(lay.rows, lay.cols))
        return None
    B, k = lay.rows, lay.k
    values = _section(payload, lay.sec[0], lay.dtype).view(B, k)
    if lay.values_only:
        if indices is None:
            raise ValueError("this TopK payload carries values only: pass the activation's indices=")
        if tuple(indices.shape) != (B, k):
            raise ValueError(f"indices shape {tuple(indices.shape)} does not match [B, K]=[{B}, {k}]")
    else:
        indices = torch.empty(B, k, dtype=torch.int64, device=payload.device)
        ops.unpack_bits(_section(payload, lay.sec[1]), lay.idx_bits, indices)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= lay.cols):
        raise ValueError(f"TopK indices outside [0, {lay.cols}) (min {int(indices.min())}, max "
                         f"{int(indices.max())}): a corrupted payload or indices from another tensor")
    if values.dtype != out.dtype:  # a float32 out (codec state): widen exactly, as the kernels need one dtype
        values = values.to(out.dtype)
    ops.topk_decode(values, indices, out.view(B, lay.cols))
    return indices
