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

LLaMA-style blocks (``ModelShape(arch="llama", kv_heads=..., ffn_hidden=...)``): grouped-query attention
(``kv_heads`` key/value heads), a SwiGLU MLP (three ``h x f`` matrices), RMSNorm, no biases, no dropout,
flash attention (no ``a s^2`` score tensors saved). Matmul FLOPs are ``2 b s`` per matmul weight in
every case. Saved activations (2-byte, per layer) generalise Korthikanti et al.'s ``34 s b h``:
attention ``(2 + 2 + 4 kv/a + 2 + mask) s b h``, MLP ``(2 + k 2 f/h + mask) s b h`` with ``k = 3``
(gate, up, product) gated or ``2`` (fc, GELU) otherwise, norms ``4 s b h``; the GPT default gives 34.
``tensor_parallel = t`` (Megatron tensor + sequence parallelism) divides a device's parameters, FLOPs,
weight bytes and saved activations by ``t``; the head is vocabulary-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepspeed_ppq.formats import FORMATS

from .hardware import Hardware
from .simulator import StageCost, StageMemory

__all__ = ["ModelShape", "layer_flops", "layer_activation_bytes", "stage_costs_roofline", "stage_memory",
           "stage_costs_from_profile", "boundary_shape", "FORMAT_BITS", "OPTIMIZER_BYTES"]

# bits per stored weight value: the training dtypes ("none": the model's dtype), then the format table's
FORMAT_BITS = {"none": None, "fp32": 32, "bf16": 16, "fp16": 16, **{s.name: s.bits for s in FORMATS}}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "tf32": 4}


@dataclass(frozen=True)
class ModelShape:
    """A transformer: ``layers`` blocks of ``hidden`` with ``heads``, ``seq_len``, ``vocab``.

    ``arch="gpt"`` (default): GPT-2 blocks (MLP ``4 h`` unless ``ffn_hidden``, biases, LayerNorm, dropout
    masks saved, attention scores saved). ``arch="llama"``: GQA with ``kv_heads``, SwiGLU MLP of
    ``ffn_hidden``, RMSNorm, no biases or dropout, flash attention. ``tensor_parallel``: the
    Megatron tensor-parallel degree (with sequence parallelism); every per-device figure is divided by it.
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    micro_batch: int = 1
    dtype: str = "bf16"
    arch: str = "gpt"
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        for k in ("layers", "hidden", "heads", "seq_len", "vocab", "micro_batch", "tensor_parallel"):
            if getattr(self, k) < 1:
                raise ValueError(f"ModelShape.{k}={getattr(self, k)} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"ModelShape.hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"ModelShape.dtype={self.dtype!r} is unknown: use one of "
                             f"{', '.join(_DTYPE_BYTES)}")
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"ModelShape.arch={self.arch!r} is unknown: use 'gpt' or 'llama'")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"ModelShape.kv_heads={self.kv_heads} must be >= 1 and divide "
                             f"heads={self.heads}")
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            raise ValueError(f"ModelShape.ffn_hidden={self.ffn_hidden} must be >= 1")

    @property
    def act_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def ffn(self) -> int:
        """MLP width ``f`` (default ``4 h``)."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: ``kv_heads * hidden / heads``."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matmuls (all devices of a tensor-parallel group together)."""
        h, f = self.hidden, self.ffn
        return 2 * h * h + 2 * h * self.kv_dim + (3 if self.arch == "llama" else 2) * h * f

    @property
    def layer_params(self) -> int:
        """Parameters of one layer (all devices together): ``12 h^2 + 13 h`` for the GPT default."""
        h = self.hidden
        if self.arch == "llama":
            return self.layer_matmul_params + 2 * h  # two RMSNorm weights
        biases = h + 2 * self.kv_dim + h + self.ffn + h  # qkv, proj, fc, proj
        return self.layer_matmul_params + biases + 4 * h  # two LayerNorms (weight and bias)


def layer_flops(shape: ModelShape) -> tuple[float, float, float]:
    """(forward, backward_input, backward_weight) FLOPs of one transformer layer, one micro-batch, one
    device (``/ tensor_parallel``); attention counted as ``4 b s^2 h`` (no causal discount)."""
    b, s, h = shape.micro_batch, shape.seq_len, shape.hidden
    mm = 2 * b * s * shape.layer_matmul_params / shape.tensor_parallel
    attn = 4 * b * s * s * h / shape.tensor_parallel
    if shape.tensor_parallel == 1 and shape.arch == "gpt":
        mm, attn = int(mm), int(attn)
    return mm + attn, mm + attn, mm


def layer_activation_bytes(shape: ModelShape) -> int:
    """Bytes one layer saves for its backward, one micro-batch, one device (module docstring)."""
    b, s, h, a = shape.micro_batch, shape.seq_len, shape.hidden, shape.heads
    llama = shape.arch == "llama"
    mask = 0 if llama else 1
    attn = 2 + 2 + 4 * shape.kv_dim / h + 2 + mask  # qkv input, Q, K and V, proj input, dropout mask
    mlp = 2 + (3 if llama else 2) * 2 * shape.ffn / h + mask
    scores = 0 if llama else 5 * a * s / h
    per = s * b * h * (attn + mlp + 4 + scores) * shape.act_bytes / 2
    return int(per / shape.tensor_parallel)


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
    tp = shape.tensor_parallel
    peak = hw.matmul_flops(shape.dtype)
    mem_bw = hw.mem_bw * hw.achievable_mem
    params = shape.layer_params // tp
    wbytes = _weight_bytes(params, weight_format, shape)
    compute_copy = params * shape.act_bytes if FORMAT_BITS.get(weight_format) else 0
    if shape.arch == "gpt":
        act_io = 2 * 34 * shape.seq_len * shape.micro_batch * shape.hidden * shape.act_bytes // 2 // tp
    else:
        act_io = 2 * layer_activation_bytes(shape)

    def t(flops: float, nbytes: float) -> float:
        return max(flops / peak, nbytes / mem_bw)

    lay_f = t(f, wbytes + 2 * compute_copy + act_io) + (dequant_overhead if compute_copy else 0.0)
    lay_bi = t(bi, wbytes + 2 * compute_copy + act_io) + (dequant_overhead if compute_copy else 0.0)
    lay_bw = t(bw, params * 4 + act_io)
    b, s, h, v = shape.micro_batch, shape.seq_len, shape.hidden, shape.vocab
    head = t(2 * b * s * h * v / tp, v * h * shape.act_bytes / tp)
    out = []
    for i, n in enumerate(counts):
        cf, cbi, cbw = n * lay_f, n * lay_bi, n * lay_bw
        if i == stages - 1:
            cf, cbi, cbw = cf + head, cbi + head, cbw + head
        out.append(StageCost(cf, cbi, cbw, recompute=cf if recompute[i] else 0.0))
    return out


OPTIMIZER_BYTES = {"adam": 8, "adam8bit": 2, "sgd": 0}
"""Optimizer-state bytes per parameter: AdamW fp32 moments, block-wise 8-bit moments (scales aside)."""


def stage_memory(shape: ModelShape, stages: int, weight_format: str = "none", optimizer: str = "adam",
                 boundaries: list[int] | None = None, recompute: list[bool] | None = None,
                 comm_buffers: int = 0, feedback_buffers: int = 0, master_free: bool = False,
                 high_precision_optimizer: str | None = None) -> list[StageMemory]:
    """Per-stage ``StageMemory`` of one device (``/ shape.tensor_parallel``).

    Weights by format (the blocks' at ``weight_format``; the embedding and LM head stay in
    ``shape.dtype``), fp32 gradients, fp32 master weights when the stored weights are not fp32,
    optimizer states (``OPTIMIZER_BYTES``), activations per micro-batch (``layer_activation_bytes``;
    the layer input only with recomputation) and the last stage's fp32 logits.

    Args:
        master_free: the low-bit blocks keep no fp32 master (``quant.master_free``: the stored codes are
            the weights); the embedding and head keep theirs.
        high_precision_optimizer: optimizer of the embedding and head (the precision policy keeps them
            high-precision, e.g. fp32 ``"adam"`` beside 8-bit states for the blocks); default ``optimizer``.
    """
    hp_opt = high_precision_optimizer or optimizer
    for name, o in (("optimizer", optimizer), ("high_precision_optimizer", hp_opt)):
        if o not in OPTIMIZER_BYTES:
            raise ValueError(f"{name}={o!r} is unknown: use one of {', '.join(OPTIMIZER_BYTES)}")
    if master_free and FORMAT_BITS.get(weight_format) in (None, 32):
        raise ValueError(f"master_free=True needs a low-bit weight_format (got {weight_format!r})")
    counts = _split_layers(shape.layers, stages, boundaries)
    recompute = recompute or [False] * stages
    tp = shape.tensor_parallel
    b, s, h, v = shape.micro_batch, shape.seq_len, shape.hidden, shape.vocab
    full_act = layer_activation_bytes(shape)
    fmt_name = "weights." + (shape.dtype if weight_format == "none" else weight_format)
    needs_master = weight_format != "none" or shape.dtype != "fp32"
    out = []
    for i, n in enumerate(counts):
        params = n * shape.layer_params // tp
        emb = v * h // tp if i == 0 else 0
        head = v * h // tp if i == stages - 1 else 0
        static = {fmt_name: _weight_bytes(params, weight_format, shape)}
        hi = f"weights.{shape.dtype}"  # embedding and LM head stay in the training dtype
        static[hi] = static.get(hi, 0) + (emb + head) * shape.act_bytes
        total_params = params + emb + head
        static["gradients"] = total_params * 4
        if needs_master:
            static["master_weights"] = (emb + head if master_free else total_params) * 4
        static["optimizer"] = (params * OPTIMIZER_BYTES[optimizer]
                                      + (emb + head) * OPTIMIZER_BYTES[hp_opt])
        act = n * (s * b * h * shape.act_bytes // tp if recompute[i] else full_act)
        if i == stages - 1:
            act += b * s * v * 4 // tp  # logits for the loss
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
