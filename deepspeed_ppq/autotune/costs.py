"""What the planner knows about a model: measured per-layer costs, codec options and the link.

Pure data: the profiler fills these from measurements, tests fill them by hand, and the
planner reads them. Times are seconds, sizes bytes; per-sample sizes scale with the micro-batch size.

Memory accounting per parameter (what a stage keeps; see ``layer_static_bytes``):
  - weights: the storage of the layer's parameters and buffers in the chosen format (codes + scales
    for quantized Linear weights, training dtype for the rest), measured by the profiler;
  - master_weights: an fp32 master copy of every quantized weight (4 B/param; the optimizer updates it), none
    when the weights are master-free (8-bit codes updated in place with stochastic rounding);
  - gradients: fp32, 4 B per trainable parameter; a master-free weight's gradient buffer in its
    ``grad_dtype`` (4 B fp32 or 2 B bf16 per value);
  - optimizer: Adam, 8 B per trainable parameter (+ 4 B step per tensor); with 8-bit states
    (bitsandbytes blockwise, 256 values per fp32 absmax) 2 B + 2 x 4 B per 256 values, except tensors
    below 4096 elements, which keep fp32 states. The two 8-bit code maps the optimizer shares (2 KiB in
    all, per stage) are left out. This mirrors ``quant.optim.optimizer_state_bytes``.
In DeepSpeed's bf16 mode (``static_bytes(..., bf16_replicas=dp)``) the weights are bf16 (the profile
is measured in bf16) and the engine's optimizer wrapper (BF16_Optimizer) adds, for the parameters it
steps (``engine_params``), fp32 master weights and the optimizer states partitioned over the ``dp``
data-parallel replicas, and keeps an fp32 gradient buffer of them whole (the 4 B above).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepspeed_ppq.formats import MASTER_FREE_FORMATS
from deepspeed_ppq.quant.optim import optimizer_state_bytes
from deepspeed_ppq.schedule.simulator import LinkModel

__all__ = [
    "LayerProfile",
    "CodecOption",
    "DEFAULT_LINK",
    "optimizer_bytes",
    "interpolate_time",
    "NO_CODEC",
    "MASTER_FREE_FORMATS",
]



def optimizer_bytes(param_numels: list[int], eight_bit: bool) -> int:
    """Adam state bytes for parameter tensors of the given sizes: ``quant.optim.optimizer_state_bytes``
    (the ledger's exact accounting) summed, for fp32 Adam or 8-bit Adam."""
    kind = "adam8bit" if eight_bit else "adam"
    return sum(sum(optimizer_state_bytes(n, kind=kind).values()) for n in param_numels)


def interpolate_time(timing: dict[int, float], micro_batch: int) -> float:
    """Time at ``micro_batch`` from times measured at some micro-batch sizes: exact where measured,
    linear between the two nearest sizes otherwise, and proportional to size beyond a single point."""
    if micro_batch in timing:
        return timing[micro_batch]
    sizes = sorted(timing)
    if not sizes:
        raise ValueError("no timing measured")
    if len(sizes) == 1:
        return timing[sizes[0]] * micro_batch / sizes[0]
    lo = max([s for s in sizes if s < micro_batch], default=sizes[0])
    hi = min([s for s in sizes if s > micro_batch], default=sizes[-1])
    if lo == hi:
        lo, hi = (sizes[-2], sizes[-1]) if micro_batch > sizes[-1] else (sizes[0], sizes[1])
    slope = (timing[hi] - timing[lo]) / (hi - lo)
    return max(0.0, timing[lo] + slope * (micro_batch - lo))


@dataclass
class LayerProfile:
    """One layer of the pipeline module, measured (or described) for each weight format.

    Attributes:
        name: the layer's name (e.g. ``"BlockPipe"`` or ``"3"``).
        kind: ``"embed"``, ``"block"``, ``"head"`` or ``"other"``.
        param_numels: sizes of its trainable parameter tensors.
        quantizable_params: trainable parameters the precision policy may store in low bit (Linear
            weights; a weight the model froze goes low-bit too, but keeps no master and no gradient).
        allowed_formats: formats the policy allows for this layer; ``"none"`` is always allowed.
        times: format -> micro-batch size -> ``[forward, backward_input, backward_weight]`` seconds.
        weight_bytes: format -> storage bytes of the layer's parameters and buffers.
        saved_bytes: format -> activation bytes saved for backward, per sample.
        input_bytes: bytes of the tensor entering the layer, per sample.
        output_bytes: bytes of the tensor leaving the layer, per sample.
        quant_error: format -> relative weight error ``||W - Q(W)|| / ||W||`` (sensitivity).
        workspace_bytes: format -> bytes of the dense buffer its largest low-bit weight dequantizes into;
            the layers of a process share one such buffer (``quant.linear``), so a stage holds the largest
            of its layers' (missing: none).
        peak_bytes: format -> micro-batch size -> the peak of activation and temporary bytes while
            the layer runs forward and backward alone (saved tensors, output, backward temporaries; not
            linear in the micro-batch size: kernels change with it); missing: ``saved_bytes``.
    """

    name: str
    kind: str
    param_numels: list[int]
    quantizable_params: int
    allowed_formats: list[str]
    times: dict[str, dict[int, list[float]]]
    weight_bytes: dict[str, int]
    saved_bytes: dict[str, int]
    input_bytes: int
    output_bytes: int
    quant_error: dict[str, float] = field(default_factory=dict)
    peak_bytes: dict[str, dict[int, int]] = field(default_factory=dict)
    workspace_bytes: dict[str, int] = field(default_factory=dict)

    def transient_bytes(self, fmt: str, recompute: bool, micro_batch: int) -> float:
        """Bytes this layer needs on top of what the stage keeps for it while its backward runs, at
        ``micro_batch``: a checkpointed layer rebuilds all of its activations (its peak); any other
        layer needs its peak beyond its saved tensors."""
        saved = self.saved_bytes[fmt] * micro_batch
        measured = self.peak_bytes.get(fmt)
        peak = interpolate_time(measured, micro_batch) if measured else saved
        return peak if recompute and self.recomputable else max(0.0, peak - saved)

    @property
    def params(self) -> int:
        return sum(self.param_numels)

    @property
    def recomputable(self) -> bool:
        """Whether a recomputing stage checkpoints this layer. The embedding is not: its input is token
        ids (a reentrant checkpoint would cut the graph) and it saves only those ids, so the tuning loop
        checkpoints the other layers (``checkpointable_layers``) and the cost model does the same."""
        return self.kind != "embed"

    def formats(self) -> list[str]:
        return ["none", *[f for f in self.allowed_formats if f != "none"]]

    def format_for(self, level: str) -> str:
        """The format this layer uses when its stage runs at precision ``level``."""
        return level if level in self.allowed_formats else "none"

    def time(self, fmt: str, micro_batch: int) -> tuple[float, float, float]:
        t = self.times[fmt]
        parts = [{mb: v[k] for mb, v in t.items()} for k in range(3)]
        f, bi, bw = (interpolate_time(p, micro_batch) for p in parts)
        return f, bi, bw

    def static_bytes(self, fmt: str, optimizer_8bit: bool, master_free: bool = False,
                     master_free_grad_bytes: int = 4, bf16_replicas: int = 0) -> dict[str, int]:
        """Bytes this layer keeps regardless of micro-batches, by category.

        ``master_free``: low-bit weights keep only their codes (``weights.master="none"``, 8-bit
        formats): no fp32 master; the weight gradient (a buffer of ``master_free_grad_bytes`` per value:
        4 fp32, 2 bf16) and the optimizer states stay. ``bf16_replicas``: DeepSpeed's bf16 mode on that
        many data-parallel replicas (0: not bf16 mode): the engine's parameters get fp32 masters, and
        their optimizer states are partitioned (see the module docstring); a low-bit layer's own master
        is a bf16 parameter there (2 B)."""
        if master_free and fmt not in ("none", *MASTER_FREE_FORMATS):
            raise ValueError(f"format {fmt!r} cannot be master-free: use one of {MASTER_FREE_FORMATS}")
        q = self.quantizable_params if fmt != "none" else 0
        opt = optimizer_bytes(self.param_numels, optimizer_8bit)
        master = (4 if not bf16_replicas else 2) * q if not master_free else 0
        if bf16_replicas:
            engine = self.engine_params(fmt, master_free)
            master += -(-4 * engine // bf16_replicas)
            # the engine's share of the states, partitioned; a master-free weight's own stay whole
            engine_opt = opt * engine // max(1, self.params)
            opt = opt - engine_opt + -(-engine_opt // bf16_replicas)
        return {
            "weights": self.weight_bytes[fmt],
            "master_weights": master,
            "gradients": 4 * self.params - (4 - master_free_grad_bytes) * (q if master_free else 0),
            "optimizer": opt,
        }

    def engine_params(self, fmt: str, master_free: bool = False) -> int:
        """Trainable parameters whose gradients are the engine's ``.grad`` tensors (4 B per value), which
        it reduces and steps: every one but a master-free weight, whose gradient buffer and update are
        the layer's own (``quant.master_free``)."""
        return self.params - (self.quantizable_params if master_free and fmt != "none" else 0)

    def freed_grad_bytes(self, fmt: str, master_free: bool = False) -> int:
        """The part of ``static_bytes``' gradients that is ``.grad`` tensors (``engine_params``). An
        engine that frees gradients after its optimizer step (``PlanningProblem.grads_freed_after_step``)
        holds these only from a backward to the step; a master-free weight's buffer stays allocated."""
        return 4 * self.engine_params(fmt, master_free)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: dict) -> LayerProfile:
        d = dict(d)
        d["times"] = {f: {int(mb): v for mb, v in t.items()} for f, t in d["times"].items()}
        d["peak_bytes"] = {f: {int(mb): v for mb, v in t.items()} for f, t in d.get("peak_bytes", {}).items()}
        return cls(**d)


@dataclass(frozen=True)
class CodecOption:
    """One way to send a boundary tensor: its config, wire bytes per raw byte and codec cost.

    Attributes:
        config: the ``CodecConfig`` fields (``{"method": "quant", "bits": 8}``).
        wire_ratio: payload bytes / raw bytes (1.0 for ``none``).
        encode_s_per_byte, decode_s_per_byte: measured codec seconds per raw byte.
        bits: precision for the quality bounds (32 for ``none``).
    """

    config: tuple[tuple[str, object], ...]
    wire_ratio: float = 1.0
    encode_s_per_byte: float = 0.0
    decode_s_per_byte: float = 0.0
    bits: int = 32

    @property
    def as_dict(self) -> dict:
        return dict(self.config)

    @property
    def label(self) -> str:
        c = self.as_dict
        if c.get("method", "none") == "none":
            return "none"
        if c["method"] == "topk":
            return f"topk{c.get('topk_ratio')}"
        return f"{c['method']}{c.get('bits', '')}"

    @staticmethod
    def make(config: dict, **kw) -> CodecOption:
        return CodecOption(config=tuple(sorted(config.items())), **kw)


NO_CODEC = CodecOption.make({"method": "none"})


DEFAULT_LINK = LinkModel(latency_s=1e-4, bandwidth_Bps=2.2e9)
"""The stage-to-stage link the planner assumes until the profiler measures one (``profiler.measure_link``)."""
