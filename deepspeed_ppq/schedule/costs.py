"""Stage costs for the simulator: from a measured profile, or from a roofline model of a GPT layer.

Roofline: a kernel takes ``max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth)``. Per
transformer layer with hidden ``h``, ``a`` heads, sequence ``s``, micro-batch ``b`` (MLP 4h):

- parameters ``12 h^2 + 13 h``; forward FLOPs ``24 b s h^2`` (matmuls) ``+ 4 b s^2 h`` (attention);
- backward: input gradient = forward FLOPs, weight gradient = the matmul part ``24 b s h^2``;
- bytes: weights read once per pass at their storage size (low-bit weights are dequantized into a
  compute copy: read low-bit, write and read the compute dtype), activations read and written;
- saved activations (Korthikanti et al., 2022) ``s b h (34 + 5 a s / h)`` bytes at 2-byte
  activations, scaled by the activation dtype; with full recomputation only the layer input
  ``s b h`` x dtype is kept and backward adds one forward.

The embedding and the LM head (vocab ``V``) sit on the first and last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware
from .simulator import StageCost, StageMemory

__all__ = ["ModelShape", "layer_flops", "stage_costs_roofline", "stage_memory", "stage_costs_from_profile",
           "boundary_shape", "FORMAT_BITS"]

FORMAT_BITS = {"none": None, "fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "fp8_e4m3": 8, "fp8_e5m2": 8,
               "int4": 4, "nf4": 4}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "tf32": 4}


@dataclass(frozen=True)
class ModelShape:
    """A GPT-style model: ``layers`` blocks of ``hidden`` with ``heads``, ``seq_len``, ``vocab``."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    micro_batch: int = 1
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for k in ("layers", "hidden", "heads", "seq_len", "vocab", "micro_batch"):
            if getattr(self, k) < 1:
                raise ValueError(f"ModelShape.{k}={getattr(self, k)} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"ModelShape.hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"ModelShape.dtype={self.dtype!r} is unknown: use one of "
                             f"{', '.join(_DTYPE_BYTES)}")

    @property
    def act_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def layer_params(self) -> int:
        return 12 * self.hidden ** 2 + 13 * self.hidden


def layer_flops(shape: ModelShape) -> tuple[float, float, float]:
    """(forward, backward_input, backward_weight) FLOPs of one transformer layer, one micro-batch."""
    b, s, h = shape.micro_batch, shape.seq_len, shape.hidden
    mm = 24 * b * s * h * h
    attn = 4 * b * s * s * h
    return mm + attn, mm + attn, mm


def _weight_bytes(params: int, fmt: str, shape: ModelShape, block: int = 64) -> int:
    bits = FORMAT_BITS.get(fmt, "?")
    if bits == "?":
        raise ValueError(f"weight format {fmt!r} is unknown: use one of "
                         f"{', '.join(FORMAT_BITS)}")
    if bits is None:
        return params * shape.act_bytes
    scales = 0 if bits >= 16 else (params // block) * 4
    return params * bits // 8 + scales


def _split_layers(layers: int, stages: int, boundaries: list[int] | None) -> list[int]:
    if boundaries is None:
        if stages > layers:
            raise ValueError(f"stages={stages} is more than layers={layers}: each stage needs at least "
                             "one layer")
        base, extra = divmod(layers, stages)
        return [base + (1 if i < extra else 0) for i in range(stages)]
    if len(boundaries) != stages + 1 or boundaries[0] != 0 or boundaries[-1] != layers or any(
            x >= y for x, y in zip(boundaries, boundaries[1:])):
        raise ValueError(f"boundaries={boundaries} must be {stages + 1} strictly increasing numbers "
                         f"from 0 to layers={layers}")
    return [y - x for x, y in zip(boundaries, boundaries[1:])]


def stage_costs_roofline(shape: ModelShape, stages: int, hw: Hardware, weight_format: str = "none",
                         boundaries: list[int] | None = None, recompute: list[bool] | None = None,
                         dequant_overhead: float = 0.0) -> list[StageCost]:
    """Per-stage ``StageCost`` from the roofline model.

    Args:
        shape: the model and micro-batch.
        stages: pipeline stages.
        hw: device (``hardware.get_hardware``).
        weight_format: storage format of the layer weights (``none`` keeps ``shape.dtype``).
        boundaries: layer boundaries ``[0, ..., layers]``; default: as even as possible.
        recompute: per stage, full activation recomputation.
        dequant_overhead: extra seconds per low-bit layer and pass (measured kernel time), if known.
    """
    counts = _split_layers(shape.layers, stages, boundaries)
    recompute = recompute or [False] * stages
    f, bi, bw = layer_flops(shape)
    peak = hw.matmul_flops(shape.dtype)
    mem_bw = hw.mem_bw * hw.achievable_mem
    wbytes = _weight_bytes(shape.layer_params, weight_format, shape)
    compute_copy = shape.layer_params * shape.act_bytes if FORMAT_BITS.get(weight_format) else 0
    act_io = 2 * 34 * shape.seq_len * shape.micro_batch * shape.hidden * shape.act_bytes // 2

    def t(flops: float, nbytes: float) -> float:
        return max(flops / peak, nbytes / mem_bw)

    lay_f = t(f, wbytes + 2 * compute_copy + act_io) + (dequant_overhead if compute_copy else 0.0)
    lay_bi = t(bi, wbytes + 2 * compute_copy + act_io) + (dequant_overhead if compute_copy else 0.0)
    lay_bw = t(bw, shape.layer_params * 4 + act_io)
    b, s, h, v = shape.micro_batch, shape.seq_len, shape.hidden, shape.vocab
    head = t(2 * b * s * h * v, v * h * shape.act_bytes)
    out = []
    for i, n in enumerate(counts):
        cf, cbi, cbw = n * lay_f, n * lay_bi, n * lay_bw
        if i == stages - 1:
            cf, cbi, cbw = cf + head, cbi + head, cbw + head
        out.append(StageCost(cf, cbi, cbw, recompute=cf if recompute[i] else 0.0))
    return out


def stage_memory(shape: ModelShape, stages: int, weight_format: str = "none", optimizer: str = "adam",
                 boundaries: list[int] | None = None, recompute: list[bool] | None = None,
                 comm_buffers: int = 0, feedback_buffers: int = 0) -> list[StageMemory]:
    """Per-stage ``StageMemory``: weights by format, fp32 gradients, fp32 master weights when the
    stored weights are not fp32, optimizer states (``adam``: 8 B/param, ``adam8bit``: 2, ``sgd``: 0),
    activations per micro-batch (Korthikanti et al.; the layer input only with recomputation)."""
    opt_bytes = {"adam": 8, "adam8bit": 2, "sgd": 0}
    if optimizer not in opt_bytes:
        raise ValueError(f"optimizer={optimizer!r} is unknown: use one of {', '.join(opt_bytes)}")
    counts = _split_layers(shape.layers, stages, boundaries)
    recompute = recompute or [False] * stages
    b, s, h, a, v = shape.micro_batch, shape.seq_len, shape.hidden, shape.heads, shape.vocab
    full_act = int(s * b * h * (34 + 5 * a * s / h) * shape.act_bytes / 2)
    fmt_name = "weights:" + (shape.dtype if weight_format == "none" else weight_format)
    out = []
    for i, n in enumerate(counts):
        params = n * shape.layer_params
        emb = v * h if i == 0 else 0
        head = v * h if i == stages - 1 else 0
        static = {fmt_name: _weight_bytes(params, weight_format, shape)}
        hi = f"weights:{shape.dtype}"  # embedding and LM head stay in the training dtype
        static[hi] = static.get(hi, 0) + (emb + head) * shape.act_bytes
        total_params = params + emb + head
        static["gradients"] = total_params * 4
        if weight_format != "none" or shape.dtype != "fp32":
            static["master_weights"] = total_params * 4
        static["optimizer_states"] = total_params * opt_bytes[optimizer]
        act = n * (s * b * h * shape.act_bytes if recompute[i] else full_act)
        if i == stages - 1:
            act += b * s * v * 4  # logits for the loss
        out.append(StageMemory(static, act, comm_buffers, feedback_buffers))
    return out


def boundary_shape(shape: ModelShape) -> tuple[int, int, int]:
    """The tensor that crosses a stage boundary: ``(micro_batch, seq_len, hidden)``."""
    return (shape.micro_batch, shape.seq_len, shape.hidden)


def stage_costs_from_profile(forward: list[float], backward: list[float], boundaries: list[int],
                             backward_weight: list[float] | None = None,
                             recompute: list[bool] | None = None) -> list[StageCost]:
    """Per-stage costs from measured per-layer seconds (``forward[i]``, ``backward[i]`` of layer ``i``).

    ``backward`` is the whole backward, or the input-gradient part when ``backward_weight`` is given.
    """
    n = len(forward)
    if len(backward) != n or (backward_weight is not None and len(backward_weight) != n):
        raise ValueError(f"profile lists differ in length: forward {n}, backward {len(backward)}"
                         + ("" if backward_weight is None else f", backward_weight {len(backward_weight)}"))
    counts = _split_layers(n, len(boundaries) - 1, boundaries)
    recompute = recompute or [False] * len(counts)
    out = []
    for i, (lo, hi) in enumerate(zip(boundaries, boundaries[1:])):
        f = sum(forward[lo:hi])
        bi = sum(backward[lo:hi])
        bw = sum(backward_weight[lo:hi]) if backward_weight is not None else 0.0
        out.append(StageCost(f, bi, bw, recompute=f if recompute[i] else 0.0))
    assert len(out) == len(counts)
    return out
