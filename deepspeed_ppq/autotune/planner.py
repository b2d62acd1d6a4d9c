"""The planner: choose the pipeline that runs fastest within the per-stage memory budget.

Decision variables
  - outer knobs (enumerated): pipeline degree ``p`` (the rest of the world is data parallel),
    micro-batch size ``b`` and count ``m`` (global batch fixed, or free within a range), schedule,
    activation codec, gradient codec (within the quality bounds), 8-bit optimizer states;
  - inner knobs (exact dynamic program): the contiguous partition of the layers into ``p`` stages
    and, per stage, a precision level and activation recomputation. At level ``f`` every layer of the
    stage whose policy allows ``f`` stores its weights in ``f``, the others keep the training dtype;
    per-layer control comes from the policy (the quality loop removes formats from sensitive layers).

The planner's model of one step (``pipeline_time``): with ``t_s`` the time stage ``s`` spends per
micro-batch (forward, backward, recomputation, codec work and its blocking sends),
``sum_s t_s + (m - 1) * max_s t_s`` — the 1F1B/GPipe critical path — plus the optimizer step and the
data-parallel all-reduce of the slowest stage (``extras``), which do not depend on the schedule.
Stage ``s`` of 1F1B keeps ``min(p - s, m)`` micro-batches of activations (GPipe: ``m``) and
DeepSpeed's ``max(2, min(p - s, m))`` pipe buffers.

Exactness: for fixed outer knobs the DP returns the minimum of the pipeline term over all
partitions and stage options whose memory fits. For a bottleneck bound ``T`` let ``g(T)`` be the
smallest ``sum_s t_s`` with every ``t_s <= T`` (a min-sum DP); the optimum is
``min_T g(T) + (m - 1) T`` over the finitely many achievable stage times ``T``, scanned upward
from the smallest feasible one and stopped once ``min_sum + (m - 1) T`` cannot beat the best.
Within one segment the fastest option that fits memory dominates (smaller in both the sum and
the max), so options reduce to one table per stage position.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from itertools import product

import numpy as np

from deepspeed_ppq.autotune.costs import (
    DEFAULT_LINK,
    MASTER_FREE_FORMATS,
    NO_CODEC,
    CodecOption,
    LayerProfile,
)
from deepspeed_ppq.autotune.memory import PREDICTED
from deepspeed_ppq.autotune.plan import Plan, StagePlan, recomputes
from deepspeed_ppq.formats import GRAD_DTYPE_BYTES
from deepspeed_ppq.quant.master_free import IN_BACKWARD_BUCKET, in_backward_bucket_values
from deepspeed_ppq.quant.optim import MIN_8BIT_SIZE
from deepspeed_ppq.schedule import LinkModel

__all__ = [
    "PlanningProblem",
    "Knobs",
    "StageChoice",
    "InfeasibleBudgetError",
    "plan_pipeline",
    "solve_partition",
    "evaluate_stages",
    "stock_plan",
    "stock_candidates",
    "best_stock",
    "plan_fits",
    "MEMORY_CATEGORIES",
    "stage_levels",
]

MEMORY_CATEGORIES = PREDICTED  # weights, master_weights, gradients, optimizer, activations, comm_buffers, ...
_INF = float("inf")
_BIG = 1e30  # an empty range's maximum in the segment tables (finite: no inf - inf)


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget; the message gives the smallest budget that fits, and ``need`` the
    same in bytes where the planner computed it (None otherwise)."""

    def __init__(self, message: str, need: float | None = None):
        super().__init__(message)
        self.need = need


@dataclass
class PlanningProblem:
    """Everything the planner needs.

    Attributes:
        layers: per-layer profiles, in pipeline order.
        world_size: number of ranks (pipeline degree x data parallel).
        global_batch: samples per optimizer step; an int, or ``(low, high)`` to let the planner
            choose (it then maximises samples/s).
        memory_budget: bytes per stage (``None``: unlimited).
        micro_batch_sizes: candidates for the micro-batch size.
        pipeline_degrees: candidates for ``p`` (default: every divisor of ``world_size`` up to the
            layer count).
        schedules: ``"1f1b"`` (what DeepSpeed's TrainSchedule runs) and/or ``"gpipe"``.
        activation_codecs, gradient_codecs: codec options within the quality bounds.
        optimizer_8bit: candidates for 8-bit optimizer states.
        master_free: candidates for master-free low-bit weights (``weights.master="none"``: one setting
            for the whole model, as the config has it; with it on, stages use 8-bit levels only).
        master_free_grad_dtype: the gradient buffer of master-free weights (``weights.grad_dtype``:
            ``"fp32"`` or ``"bf16"``).
        allow_recompute: let the planner checkpoint a stage's activations.
        low_bit_only: every stage runs a low-bit level (its layers in the format the policy allows them;
            the others stay in the training dtype): the best plan with low-bit weights, for reports.
        recompute_keep: with recomputation, how many of a stage's last layers may keep their
            activations instead (partial recomputation: the memory left over buys back recompute
            time); None (default): any number of them; empty: a stage recomputes all of its layers
            or none.
        link: the point-to-point link between stages (also used for the data-parallel all-reduce).
        optimizer_s_per_param: optimizer step seconds per parameter (fp32 Adam).
        optimizer_cost_ratio: measured step cost per parameter of the other kinds relative to fp32 Adam
            (``adam8bit``, ``master_free``, ``master_free_8bit``; see ``profiler.optimizer_costs``); a
            missing kind costs as fp32 Adam.
        microbatch_overhead_s: fixed engine seconds per stage and micro-batch (instruction dispatch,
            buffer handling, waiting); the tuning loop calibrates it from the measured trials.
        step_transient_bytes_per_param: bytes per parameter the engine reduces and steps
            (``LayerProfile.engine_params``: not master-free weights, which have their own buffer and
            update) that it allocates around the optimizer step (a flattened gradient buffer, the
            optimizer's temporaries), when the activations are gone and the pipe buffers stay: a stage's
            peak is its static bytes plus its pipe buffers plus the larger of its activations and this
            transient. Counted over every trainable parameter, it had put the step phase of a one-stage
            int8 master-free plan of micro-batch 4 x 2 at 98.3 MiB; the pipeline phase peaks there, at
            86.7 MiB measured (its step phase at one stage of 8 x 1: 68.3 MiB).
        step_fixed_bytes: bytes per stage around the optimizer step that do not scale with its parameters
            (tensors the engine keeps from the last micro-batch); calibrated.
        grads_freed_after_step: the engine frees the parameter gradients after its optimizer step
            (DeepSpeed's pipeline engine zeroes them to None). A stage that runs all of a step's forwards
            before its first backward (no more micro-batches than it holds in flight: one micro-batch
            per step, or GPipe) then makes them during that backward while its activations go, layer
            by layer from the last: its pipeline-phase peak is the largest, over that backward, of the
            activations still kept plus the gradients made so far, not all of both. The pre-training
            trials measured 110.8 MiB in the pipeline phase of one stage of micro-batch 8 x 1 (gradients
            0.5 MiB there), which all of both had put at 146.1 (its step phase, 134.3 MiB, was the peak).
            Master-free weights keep their gradient buffers (``LayerProfile.freed_grad_bytes``).
        master_free_update_in_backward: the engine updates master-free weights in their backward where a
            step has one micro-batch (``quant.master_free.updates_in_backward``: no clipping, no fp16
            loss scaling): such plans hold no master-free gradient buffer, a workspace of the gradient's
            dtype and, with replicas, the bucket gradients wait in for their all-reduce
            (``master_free_gradient_bytes``).
        bf16_mode: the engine trains in DeepSpeed's bf16 mode (the profile is measured in bf16): its
            optimizer wrapper keeps fp32 masters and partitions them and the optimizer states over the
            data-parallel replicas (``LayerProfile.static_bytes``' ``bf16_replicas``).
        activation_extra_bytes: per micro-batch size measured, the bytes a stage holds in the pipeline
            phase beyond its profiled activations and pipe buffers (the engine keeps copies of received
            activations, outputs until they are sent, ...): the largest over the stages measured, added
            to every stage (``activation_extra_for``); calibrated, 0 before any trial.
    """

    layers: list[LayerProfile]
    world_size: int
    global_batch: int | tuple[int, int]
    memory_budget: int | None = None
    micro_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    pipeline_degrees: list[int] | None = None
    schedules: list[str] = field(default_factory=lambda: ["1f1b"])
    activation_codecs: list[CodecOption] = field(default_factory=lambda: [NO_CODEC])
    gradient_codecs: list[CodecOption] = field(default_factory=lambda: [NO_CODEC])
    optimizer_8bit: list[bool] = field(default_factory=lambda: [False])
    master_free: list[bool] = field(default_factory=lambda: [False])
    master_free_grad_dtype: str = "fp32"
    allow_recompute: bool = True
    recompute_keep: tuple[int, ...] | None = None
    low_bit_only: bool = False
    link: LinkModel = DEFAULT_LINK
    optimizer_s_per_param: float = 0.0
    optimizer_cost_ratio: dict[str, float] = field(default_factory=dict)
    microbatch_overhead_s: float = 0.0
    step_transient_bytes_per_param: float = 0.0
    step_fixed_bytes: float = 0.0
    activation_extra_bytes: dict[int, float] = field(default_factory=dict)
    grads_freed_after_step: bool = False
    master_free_update_in_backward: bool = False
    bf16_mode: bool = False

    def bf16_replicas(self, k: Knobs) -> int:
        """``LayerProfile.static_bytes``' ``bf16_replicas`` for knobs ``k``: the data-parallel replicas in
        bf16 mode, 0 otherwise."""
        return self.world_size // k.pipeline_degree if self.bf16_mode else 0

    def activation_extra_for(self, micro_batch_size: int) -> float:
        """The bytes a stage holds beyond the profile at a micro-batch size: those measured there, else
        those of the nearest smaller size measured, else of the smallest (0 before any trial).

        Added per stage, not scaled with a stage's activations: the extra bytes belong to the pipeline's
        buffers and the engine, not to the layers. A ratio carried them over to larger stages multiplied:
        on the fine-tuning demo the stock trials (2 stages, micro-batch 1) measured +1.56 and +2.5 MiB over
        6.4 and 3.6 MiB profiled; the one-stage plan of micro-batch 2 then measured 14.1 MiB against
        13.2 profiled, which the ratio (x1.34 there) had put at 17.4 MiB and held out of a budget it fitted.
        Held fixed across micro-batch sizes as well: they are mostly per buffer, not per sample (the
        pre-training trials measured the ratio over the profile falling, x1.89, 1.41, 1.16, 0.99 at
        micro-batch 1, 2, 4, 8)."""
        b, measured = micro_batch_size, self.activation_extra_bytes
        if not measured:
            return 0.0
        below = [m for m in measured if m <= b]
        return measured[max(below)] if below else measured[min(measured)]

    @property
    def master_free_grad_bytes(self) -> int:
        """Bytes per value of a master-free weight's gradient buffer."""
        if self.master_free_grad_dtype not in GRAD_DTYPE_BYTES:
            raise ValueError(f"master_free_grad_dtype={self.master_free_grad_dtype!r}: use one of "
                             f"{sorted(GRAD_DTYPE_BYTES)}")
        return GRAD_DTYPE_BYTES[self.master_free_grad_dtype]

    def master_free_gradient_bytes(self, num_microbatches: int, data_parallel: int) -> tuple[int, float, int]:
        """How a master-free weight's gradient is held at ``num_microbatches`` per step and
        ``data_parallel`` replicas: (bytes per value of its buffer, bytes of workspace per byte of the
        dequantization buffer, bytes per value of the buckets gradients wait in). The buffer; or, updated
        in the backward, none, a workspace of the gradient's dtype beside the fp32 one where it is
        narrower (``quant.master_free``'s ``_gradient``), and with replicas the buckets of
        ``in_backward_bucket_values`` (``bucket_bytes``)."""
        if self.master_free_update_in_backward and num_microbatches == 1:
            g = self.master_free_grad_bytes
            return 0, (g / 4 if g < 4 else 0.0), (g if data_parallel > 1 else 0)
        return self.master_free_grad_bytes, 0.0, 0

    def levels(self) -> list[str]:
        """Precision levels a stage can run at: ``none`` and every format some layer allows."""
        seen = ["none"]
        for layer in self.layers:
            seen += [f for f in layer.allowed_formats if f not in seen]
        return seen

    def recompute_options(self) -> list[tuple[bool, int]]:
        """``(recompute, keep_last)`` choices of a stage."""
        if not self.allow_recompute:
            return [(False, 0)]
        keep = range(1, len(self.layers)) if self.recompute_keep is None else self.recompute_keep
        return [(False, 0), (True, 0), *((True, n) for n in keep)]

    def degrees(self) -> list[int]:
        if self.pipeline_degrees is not None:
            return list(self.pipeline_degrees)
        return [
            p for p in range(1, self.world_size + 1) if self.world_size % p == 0 and p <= len(self.layers)
        ]


@dataclass(frozen=True)
class Knobs:
    """The outer (enumerated) decisions."""

    pipeline_degree: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    activation_codec: CodecOption
    gradient_codec: CodecOption
    optimizer_8bit: bool
    master_free: bool = False

    @property
    def global_batch_per_replica(self) -> int:
        return self.micro_batch_size * self.num_microbatches


@dataclass(frozen=True)
class StageChoice:
    """One stage: its layers ``[first, last)``, precision level and recomputation (all of its layers but
    the last ``keep_last``)."""

    first: int
    last: int
    level: str
    recompute: bool
    keep_last: int = 0

    def recomputes(self, i: int) -> bool:
        return recomputes(self.last, self.recompute, self.keep_last, i)


# ----------------------------------------------------------------------------------------------
# The cost model, one stage at a time (plain loops: the reference the DP tables are tested against)
# ----------------------------------------------------------------------------------------------
def _inflight(schedule: str, p: int, s: int, m: int) -> tuple[int, int]:
    """(micro-batches of saved activations, DeepSpeed pipe buffers) held by stage ``s``."""
    if schedule == "gpipe":
        return m, m
    if schedule == "1f1b":
        n = min(p - s, m)
        return n, max(2, n)
    raise ValueError(f"schedule={schedule!r} is not modelled: use '1f1b' or 'gpipe'")


def _boundary_times(prob: PlanningProblem, k: Knobs, first: int, last: int) -> float:
    """Codec work and blocking sends of a stage holding ``[first, last)``, per micro-batch."""
    b, link, a, g = k.micro_batch_size, prob.link, k.activation_codec, k.gradient_codec
    t = 0.0
    if first > 0:  # receives activations, sends their gradient back
        raw = prob.layers[first].input_bytes * b
        t += raw * a.decode_s_per_byte + raw * g.encode_s_per_byte + link.time(raw * g.wire_ratio)
    if last < len(prob.layers):  # sends activations, receives their gradient
        raw = prob.layers[last - 1].output_bytes * b
        t += raw * a.encode_s_per_byte + link.time(raw * a.wire_ratio) + raw * g.decode_s_per_byte
    return t


def stage_time(prob: PlanningProblem, k: Knobs, c: StageChoice) -> float:
    """Seconds stage ``c`` spends per micro-batch."""
    t = 0.0
    for i, layer in enumerate(prob.layers[c.first : c.last], start=c.first):
        f, bi, bw = layer.time(layer.format_for(c.level), k.micro_batch_size)
        t += f * (2 if c.recomputes(i) and layer.recomputable else 1) + bi + bw
    return t + _boundary_times(prob, k, c.first, c.last) + prob.microbatch_overhead_s


def bucket_bytes(grad_bytes: int, values):
    """Bytes of the buckets in which a stage's ``values`` master-free gradient values of ``grad_bytes``
    each wait for their all-reduce when updated in the backward (``in_backward_bucket_values``);
    ``values`` may be an array."""
    return grad_bytes * in_backward_bucket_values(values, IN_BACKWARD_BUCKET)


def stage_memory(prob: PlanningProblem, k: Knobs, c: StageChoice, s: int) -> dict[str, int]:
    """Peak bytes of stage ``c`` at position ``s``, by category (``MEMORY_CATEGORIES``)."""
    b, layers = k.micro_batch_size, prob.layers[c.first : c.last]
    n_act, n_buf = _inflight(k.schedule, k.pipeline_degree, s, k.num_microbatches)
    mem = dict.fromkeys(MEMORY_CATEGORIES, 0)
    if c.level not in stage_levels(prob, k):
        raise ValueError(f"level {c.level!r} is not a choice under {k}: use one of {stage_levels(prob, k)}")
    dp = _data_parallel(prob, k)
    grad_bytes, grad_ws, bucket = (4, 0.0, 0)
    if k.master_free:
        grad_bytes, grad_ws, bucket = prob.master_free_gradient_bytes(k.num_microbatches, dp)
    for layer in layers:
        for cat, v in layer.static_bytes(layer.format_for(c.level), k.optimizer_8bit, k.master_free,
                                          grad_bytes, prob.bf16_replicas(k)).items():
            mem[cat] += v
    # the low-bit layers share one dequantization buffer: the largest of theirs (and one of the
    # gradient's dtype beside it, for a gradient made in the backward)
    ws = max(layer.workspace_bytes.get(layer.format_for(c.level), 0) for layer in layers)
    mem["weights"] += int(ws * (1.0 + grad_ws))
    if bucket:
        q = sum(layer.quantizable_params for layer in layers if layer.format_for(c.level) != "none")
        mem["gradients"] += bucket_bytes(bucket, q)
    saved = [layer.saved_bytes[layer.format_for(c.level)] * b for layer in layers]
    rec = [c.recomputes(i) for i in range(c.first, c.last)]
    trans = [layer.transient_bytes(layer.format_for(c.level), r, b) for layer, r in zip(layers, rec)]
    # checkpointed layers keep only their input
    kept = [b * layer.input_bytes if r and layer.recomputable else x
            for layer, x, r in zip(layers, saved, rec)]
    # one layer at a time runs its backward, from the last: while layer t does, the micro-batch holds
    # the kept activations of layers <= t and t's transient (a recomputed layer: all it rebuilds); the
    # other micro-batches in flight hold all of theirs
    peak = max(sum(kept[: t + 1]) + trans[t] for t in range(len(layers)))
    mem["activations"] = (n_act - 1) * sum(kept) + peak
    grad_buf = layers[-1].output_bytes if c.last < len(prob.layers) else 0
    mem["comm_buffers"] = n_buf * b * (layers[0].input_bytes + layers[-1].output_bytes) + b * grad_buf
    mem["activations"] += int(prob.activation_extra_for(b))
    # the engine's step transient scales with the parameters whose .grad it reduces and steps
    params = sum(layer.engine_params(layer.format_for(c.level), k.master_free) for layer in layers)
    transient = prob.step_transient_bytes_per_param * params + prob.step_fixed_bytes
    mem["temporaries"] = int(max(0.0, transient - mem["activations"]))
    if _grads_made_in_backward(prob, k, n_act):
        # the backward of layer t holds the kept activations of layers <= t, t's transient and the
        # gradients of layers >= t; the step all the gradients. "gradients" is what the peak holds
        # beyond the activations' own peak (the sum stays the peak, whichever phase it is in)
        freed = [layer.freed_grad_bytes(layer.format_for(c.level), k.master_free) for layer in layers]
        over = max(sum(kept[: t + 1]) + trans[t] + sum(freed[t:]) for t in range(len(layers))) - peak
        pg = sum(freed)
        mem["gradients"] -= pg - int(min(pg, max(over, pg + transient - mem["activations"])))
    return mem


def _data_parallel(prob: PlanningProblem, k: Knobs) -> int:
    return prob.world_size // k.pipeline_degree


def _grads_made_in_backward(prob: PlanningProblem, k: Knobs, n_act: int) -> bool:
    """Whether a stage holding ``n_act`` micro-batches in flight makes its parameter gradients during
    its first backward of a step, after all of its forwards (``grads_freed_after_step``)."""
    return prob.grads_freed_after_step and k.num_microbatches <= n_act


def optimizer_units(prob: PlanningProblem, k: Knobs, layer: LayerProfile, fmt: str) -> float:
    """A layer's optimizer step cost in fp32-Adam parameters (times ``optimizer_s_per_param``: seconds),
    for its weights stored in ``fmt``: each parameter weighted by the measured cost ratio of whatever
    updates it: 8-bit states (tensors of at least ``MIN_8BIT_SIZE`` values, as ``build_optimizer``), the
    master-free update (the Linear weights of a low-bit layer under ``master_free``) or fp32 Adam. In
    bf16 mode each replica steps its partition of the engine's parameters (BF16_Optimizer)."""
    r = prob.optimizer_cost_ratio
    big = sum(n for n in layer.param_numels if n >= MIN_8BIT_SIZE) if k.optimizer_8bit else 0
    q = layer.quantizable_params if k.master_free and fmt != "none" else 0
    big = max(0, big - q)  # the quantized weights are big tensors too
    mf = r.get("master_free_8bit" if k.optimizer_8bit else "master_free", 1.0)
    engine = (layer.params - big - q) + big * r.get("adam8bit", 1.0)
    return engine / max(1, prob.bf16_replicas(k)) + q * mf


def _extras(prob: PlanningProblem, k: Knobs, layers: list[tuple[LayerProfile, str]]) -> float:
    """Optimizer step plus data-parallel gradient all-reduce (ring) of a stage: ``(layer, format)``s; in
    bf16 mode also the all-gather of the updated bf16 partitions."""
    dp = _data_parallel(prob, k)
    t = prob.optimizer_s_per_param * sum(optimizer_units(prob, k, layer, fmt) for layer, fmt in layers)
    if dp > 1:
        params = sum(layer.params for layer, _ in layers)
        t += 2 * (dp - 1) / dp * prob.link.time(4 * params)
        if prob.bf16_mode:
            engine = sum(layer.engine_params(fmt, k.master_free) for layer, fmt in layers)
            t += (dp - 1) / dp * prob.link.time(2 * engine)
    return t


def evaluate_stages(prob: PlanningProblem, k: Knobs, stages: list[StageChoice]) -> dict:
    """The planner's model for a given partition and stage options.

    Returns:
        dict with ``pipeline_time`` (the DP's objective), ``step_time`` (plus extras),
        ``stage_times``, ``memory`` (per stage, by category), ``fits`` and ``bubble_fraction``.
    """
    m = k.num_microbatches
    times = [stage_time(prob, k, c) for c in stages]
    mems = [stage_memory(prob, k, c, s) for s, c in enumerate(stages)]
    pipeline = sum(times) + (m - 1) * max(times)
    extras = max(
        _extras(prob, k, [(layer, layer.format_for(c.level)) for layer in prob.layers[c.first : c.last]])
        for c in stages
    )
    budget = prob.memory_budget
    return {
        "pipeline_time": pipeline,
        "step_time": pipeline + extras,
        "stage_times": times,
        "memory": mems,
        "fits": budget is None or all(sum(mm.values()) <= budget for mm in mems),
        "bubble_fraction": 1.0 - m * sum(times) / (len(stages) * pipeline) if pipeline > 0 else 0.0,
    }


# ----------------------------------------------------------------------------------------------
# Exact DP over partitions for fixed outer knobs
# ----------------------------------------------------------------------------------------------
@dataclass
class _Tables:
    time: np.ndarray  # [p, N, N] fastest fitting option's time for a segment at stage position s
    option: np.ndarray  # [p, N, N] index into options of that fastest option (-1: none fits)
    options: list[tuple[str, bool]]
    min_memory: np.ndarray  # [p, N, N] smallest peak memory over options (for infeasibility reports)


def _prefix(vals) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(vals, dtype=float))])


def _seg(pre: np.ndarray) -> np.ndarray:
    """``out[i, j] = pre[j] - pre[i]``: the sum over layers ``[i, j)``."""
    return pre[None, :] - pre[:, None]


def stage_levels(prob: PlanningProblem, k: Knobs) -> list[str]:
    """Precision levels a stage may use under knobs ``k`` (master-free: ``none`` and 8-bit formats)."""
    levels = prob.levels()
    if k.master_free:
        levels = [lv for lv in levels if lv == "none" or lv in MASTER_FREE_FORMATS]
    if prob.low_bit_only and len(levels) > 1:
        levels = [lv for lv in levels if lv != "none"]
    return levels


def _option_tables(prob: PlanningProblem, b: int, optimizer_8bit: bool, master_free: bool = False,
                   grad_bytes: tuple[int, float, int] | None = None, bf16_replicas: int = 0) -> tuple:
    """Per stage option (level, recompute, keep_last): compute time, static bytes, activation bytes per
    in-flight micro-batch and transient bytes of every segment. Independent of codecs and schedule, and
    of the pipeline degree but through the master-free gradient bytes (``grad_bytes``:
    ``PlanningProblem.master_free_gradient_bytes``, default the buffer's) and the bf16 mode's replicas
    (``PlanningProblem.bf16_replicas``), so ``plan_pipeline`` caches it per (micro-batch size,
    optimizer, master-free, gradient bytes, bf16 replicas)."""
    grad_bytes, grad_ws, bucket = grad_bytes or (prob.master_free_grad_bytes, 0.0, 0)
    layers, L = prob.layers, len(prob.layers)
    N = L + 1
    levels = stage_levels(prob, Knobs(1, b, 1, "1f1b", NO_CODEC, NO_CODEC, optimizer_8bit, master_free))
    options = [(lv, r, keep) for lv in levels for r, keep in prob.recompute_options()]
    in_b = np.array([layer.input_bytes for layer in layers], dtype=float)
    rc = np.array([layer.recomputable for layer in layers])
    shape = (len(options), N, N)
    t_opt, static_opt, act_opt, transient_opt, ws_opt = (np.zeros(shape) for _ in range(5))
    freed_opt, over_opt = np.zeros(shape), np.zeros(shape)  # gradients made in the backward (stage_memory)
    engine_opt = np.zeros(shape)  # parameters the engine's step transient scales with
    ii, jj = np.meshgrid(np.arange(N), np.arange(N), indexing="ij")

    def range_max(x: np.ndarray, empty: float = 0.0) -> np.ndarray:  # out[i, j] = max(x[i:j])
        out = np.full((N, N), empty)
        for i in range(L):
            out[i, i + 1 :] = np.maximum.accumulate(x[i:])
        return out

    per_level = {}
    for level in levels:
        fmts = [layer.format_for(level) for layer in layers]
        tm = np.array([layer.time(f, b) for layer, f in zip(layers, fmts)])
        stat = [
            sum(layer.static_bytes(f, optimizer_8bit, master_free, grad_bytes, bf16_replicas).values())
            for layer, f in zip(layers, fmts)
        ]
        stat = _seg(_prefix(stat))
        if bucket:  # stage_memory's buckets
            q = _prefix([layer.quantizable_params if f != "none" else 0 for layer, f in zip(layers, fmts)])
            stat = stat + bucket_bytes(bucket, _seg(q))
        saved = np.array([layer.saved_bytes[f] * b for layer, f in zip(layers, fmts)], dtype=float)
        tr = {r: np.array([layer.transient_bytes(f, r, b) for layer, f in zip(layers, fmts)], dtype=float)
              for r in (False, True)}
        ws = np.array([layer.workspace_bytes.get(f, 0) for layer, f in zip(layers, fmts)], dtype=float)
        pre_saved = _prefix(saved)
        pre_rc = _prefix(np.where(rc, in_b * b, saved))  # checkpointed layers keep only their input
        pre_g = _prefix([layer.freed_grad_bytes(f, master_free) for layer, f in zip(layers, fmts)])
        engine = _seg(_prefix([layer.engine_params(f, master_free) for layer, f in zip(layers, fmts)]))
        per_level[level] = (
            _seg(_prefix(tm[:, 0])),
            _seg(_prefix(np.where(rc, tm[:, 0], 0.0))),
            _seg(_prefix(tm[:, 1] + tm[:, 2])),
            stat,
            pre_saved,
            pre_rc,
            range_max(ws) * (1.0 + grad_ws),  # the largest dequantization buffer of the segment
            pre_g,
            # the backward of layer t in [i, j): kept activations of [i, t] + t's transient is
            # (pre[t + 1] + tr[t]) - pre[i], plus the gradients of [t, j): - pre_g[t] + pre_g[j]; pre and
            # tr by whether t recomputes
            range_max(pre_rc[1:] + tr[True], -_BIG),
            range_max(pre_saved[1:] + tr[False], -_BIG),
            range_max(pre_rc[1:] + tr[True] - pre_g[:-1], -_BIG),
            range_max(pre_saved[1:] + tr[False] - pre_g[:-1], -_BIG),
            engine,
        )
    for o, (level, rec, keep) in enumerate(options):
        (fwd, fwd_rc, bwd, stat, pre_saved, pre_rc, ws, pre_g, peak_rc, peak_saved, top_rc, top_saved,
         engine) = per_level[level]
        # layers [i, m) recompute, [m, j) keep their activations
        m = np.maximum(ii, jj - keep) if rec else ii
        t_opt[o] = fwd + fwd_rc[ii, m] + bwd
        static_opt[o] = stat
        act_opt[o] = pre_rc[m] - pre_rc[ii] + pre_saved[jj] - pre_saved[m]
        # stage_memory's peak over the backward, kept as its excess over the kept activations
        shift = pre_rc[m] - pre_saved[m]  # the kept region's prefix continues the recomputed one's
        peak = np.maximum(peak_rc[ii, m], peak_saved[m, jj] + shift) - pre_rc[ii]
        transient_opt[o] = np.where(jj > ii, peak - act_opt[o], 0.0)
        ws_opt[o] = ws
        freed_opt[o] = _seg(pre_g)
        # stage_memory's "over": the largest of the backward sums with gradients beyond that peak
        top = np.maximum(top_rc[ii, m], top_saved[m, jj] + shift)
        over_opt[o] = np.where(jj > ii, top - pre_rc[ii] + pre_g[jj] - peak, 0.0)
        engine_opt[o] = engine
    return options, t_opt, static_opt + ws_opt, act_opt, transient_opt, freed_opt, over_opt, engine_opt


def _segment_tables(prob: PlanningProblem, k: Knobs, cache: dict | None = None) -> _Tables:
    """Vectorised ``stage_time``/``stage_memory`` for every segment ``[i, j)`` and stage position."""
    layers, L, b = prob.layers, len(prob.layers), k.micro_batch_size
    N, p = L + 1, k.pipeline_degree
    grad_bytes = (prob.master_free_gradient_bytes(k.num_microbatches, _data_parallel(prob, k))
                  if k.master_free else None)
    key = (b, k.optimizer_8bit, k.master_free, grad_bytes, prob.bf16_replicas(k))
    if cache is None or key not in cache:
        tabs = _option_tables(prob, b, k.optimizer_8bit, k.master_free, grad_bytes, prob.bf16_replicas(k))
        if cache is not None:
            cache[key] = tabs
    else:
        tabs = cache[key]
    options, t_compute, static_opt, act_opt, transient_opt, freed_opt, over_opt, engine_opt = tabs
    ii, jj = np.meshgrid(np.arange(N), np.arange(N), indexing="ij")
    valid = jj > ii
    # boundary costs: the receive side depends on i, the send side on j
    recv_side = np.array([_boundary_times(prob, k, i, L) if i < L else 0.0 for i in range(N)])
    send_side = np.array([_boundary_times(prob, k, 0, j) if j > 0 else 0.0 for j in range(N)])
    t_opt = np.where(valid, t_compute + (recv_side[ii] + send_side[jj] + prob.microbatch_overhead_s), _INF)
    in_b = np.array([layer.input_bytes for layer in layers] + [0], dtype=float)
    out_b = np.array([0] + [layer.output_bytes for layer in layers], dtype=float)  # out_b[j]: layer j-1
    buf_per = b * (in_b[ii] + out_b[jj])  # one pipe buffer: stage input + stage output
    grad_buf = b * out_b[jj] * (jj < L)
    step_transient = prob.step_transient_bytes_per_param * engine_opt + prob.step_fixed_bytes  # [O, N, N]
    t_tab = np.full((p, N, N), _INF)
    opt_tab = np.full((p, N, N), -1, dtype=np.int64)
    min_mem = np.full((p, N, N), _INF)
    budget = _INF if prob.memory_budget is None else float(prob.memory_budget)
    extra = prob.activation_extra_for(b)
    done: dict[tuple[int, int], int] = {}
    for s in range(p):
        held = _inflight(k.schedule, p, s, k.num_microbatches)
        if held in done:  # same in-flight counts as an earlier stage position: same tables
            t_tab[s], opt_tab[s], min_mem[s] = t_tab[done[held]], opt_tab[done[held]], min_mem[done[held]]
            continue
        done[held] = s
        n_act, n_buf = held
        act = n_act * act_opt + transient_opt + extra
        bufs = n_buf * buf_per + grad_buf
        if _grads_made_in_backward(prob, k, n_act):  # stage_memory's sum
            mem = static_opt - freed_opt + np.maximum(act + over_opt, freed_opt + step_transient) + bufs
        else:
            mem = static_opt + np.maximum(act, step_transient) + bufs  # [O, N, N]
        mem = np.where(valid, mem, _INF)
        min_mem[s] = mem.min(axis=0)
        t_fit = np.where(mem <= budget, t_opt, _INF)
        best = t_fit.min(axis=0)
        opt_tab[s] = np.where(np.isfinite(best), t_fit.argmin(axis=0), -1)
        t_tab[s] = best
    return _Tables(t_tab, opt_tab, options, min_mem)


def _min_sum_dp(tab: np.ndarray, bound: float) -> tuple[float, list[int] | None]:
    """Smallest ``sum_s t_s`` over partitions with every ``t_s <= bound``; returns (value, cuts)."""
    p, N, _ = tab.shape
    cost = np.where(tab <= bound, tab, _INF)
    f = np.full(N, _INF)
    f[0] = 0.0
    back = []
    for s in range(p):
        tot = f[:, None] + cost[s]  # [i, j]
        back.append(tot.argmin(axis=0))
        f = tot.min(axis=0)
    if not np.isfinite(f[N - 1]):
        return _INF, None
    cuts, j = [N - 1], N - 1
    for s in range(p - 1, -1, -1):
        j = int(back[s][j])
        cuts.append(j)
    return float(f[N - 1]), cuts[::-1]


def solve_partition(
    prob: PlanningProblem, k: Knobs, upper: float = _INF, cache: dict | None = None
) -> tuple[float, list[StageChoice]] | None:
    """Exact minimum of the pipeline term for fixed outer knobs.

    Args:
        upper: only solutions strictly below this pipeline time are of interest (pruning).
        cache: reused between calls for the same problem (``plan_pipeline`` passes one).

    Returns:
        ``(pipeline_time, stages)``, or ``None`` if nothing fits (or nothing beats ``upper``).
    """
    tabs = _segment_tables(prob, k, cache)
    m = k.num_microbatches
    min_sum, _ = _min_sum_dp(tabs.time, _INF)
    if not math.isfinite(min_sum):
        return None
    cand = np.unique(tabs.time[np.isfinite(tabs.time)])
    # g(T) is non-increasing in T: binary search for the smallest feasible bottleneck
    lo, hi = 0, len(cand) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if math.isfinite(_min_sum_dp(tabs.time, cand[mid])[0]):
            hi = mid
        else:
            lo = mid + 1
    best, best_cuts = upper, None
    for T in cand[lo:]:
        if min_sum + (m - 1) * T >= best:
            break
        g, cuts = _min_sum_dp(tabs.time, T)
        if g + (m - 1) * T < best:
            best, best_cuts = g + (m - 1) * T, cuts
        if g <= min_sum:
            break  # larger T cannot lower the sum further
    if best_cuts is None:
        return None
    stages = []
    for s, (i, j) in enumerate(zip(best_cuts, best_cuts[1:])):
        level, rec, keep = tabs.options[int(tabs.option[s, i, j])]
        stages.append(StageChoice(int(i), int(j), level, rec, min(keep, int(j - i))))
    return best, stages


# ----------------------------------------------------------------------------------------------
# Outer search
# ----------------------------------------------------------------------------------------------
def _knob_space(prob: PlanningProblem) -> list[Knobs]:
    out = []
    gb = prob.global_batch
    for p in prob.degrees():
        dp = prob.world_size // p
        for b in prob.micro_batch_sizes:
            if isinstance(gb, int):
                if gb % (b * dp):
                    continue
                ms = [gb // (b * dp)]
            else:
                lo, hi = gb
                ms = [m for m in range(max(1, math.ceil(lo / (b * dp))), hi // (b * dp) + 1)]
            for m, sched, a, g, o8, mf in product(
                ms,
                prob.schedules,
                prob.activation_codecs,
                prob.gradient_codecs,
                prob.optimizer_8bit,
                prob.master_free,
            ):
                out.append(Knobs(p, b, m, sched, a, g, o8, mf))
    if not out:
        raise ValueError(
            f"global_batch={gb} cannot be split into micro_batch_sizes={prob.micro_batch_sizes} "
            f"on world_size={prob.world_size} with pipeline degrees {prob.degrees()}"
        )
    return out


def _to_plan(prob: PlanningProblem, k: Knobs, stages: list[StageChoice], ev: dict, notes: list[str]) -> Plan:
    sp = [
        StagePlan(
            layers=(c.first, c.last),
            formats=[layer.format_for(c.level) for layer in prob.layers[c.first : c.last]],
            recompute=c.recompute,
            keep_last=c.keep_last,
            time_per_microbatch=t,
            memory=mem,
        )
        for c, t, mem in zip(stages, ev["stage_times"], ev["memory"])
    ]
    return Plan(
        world_size=prob.world_size,
        pipeline_degree=k.pipeline_degree,
        micro_batch_size=k.micro_batch_size,
        num_microbatches=k.num_microbatches,
        schedule=k.schedule,
        stages=sp,
        layer_names=[layer.name for layer in prob.layers],
        activation_codec=k.activation_codec.as_dict,
        gradient_codec=k.gradient_codec.as_dict,
        optimizer_8bit=k.optimizer_8bit,
        master_free=k.master_free,
        master_free_grad_dtype=prob.master_free_grad_dtype if k.master_free else "fp32",
        predicted_step_time=ev["step_time"],
        predicted_bubble_fraction=ev["bubble_fraction"],
        memory_budget=prob.memory_budget,
        notes=notes,
    )


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _infeasible(prob: PlanningProblem, space: list[Knobs]) -> InfeasibleBudgetError:
    """The error naming the smallest budget any knob setting needs (min over partitions of the max stage
    memory) and what fills it."""
    best = (_INF, None, None)
    for k in space:
        relaxed = PlanningProblem(**{**prob.__dict__, "memory_budget": None})
        tabs = _segment_tables(relaxed, k)
        p, N = k.pipeline_degree, len(prob.layers) + 1
        f = np.full(N, _INF)
        f[0] = 0.0
        back = []
        for s in range(p):
            tot = np.maximum(f[:, None], tabs.min_memory[s])
            back.append(tot.argmin(axis=0))
            f = tot.min(axis=0)
        if f[N - 1] < best[0]:
            cuts, j = [N - 1], N - 1
            for s in range(p - 1, -1, -1):
                j = int(back[s][j])
                cuts.append(j)
            best = (float(f[N - 1]), k, cuts[::-1])
    need, k, cuts = best
    # describe the fullest stage of that partition at its most frugal option
    worst = None
    options = _segment_tables(PlanningProblem(**{**prob.__dict__, "memory_budget": None}), k).options
    for s, (i, j) in enumerate(zip(cuts, cuts[1:])):
        for level, rec, keep in options:
            mem = stage_memory(prob, k, StageChoice(i, j, level, rec, keep), s)
            if abs(sum(mem.values()) - need) < 1:
                worst = (s, i, j, level, rec, mem)
    msg = (
        f"memory_budget={prob.memory_budget} B ({_fmt_bytes(prob.memory_budget)}) per stage is too small: "
        f"the smallest budget that fits is {need:.0f} B ({_fmt_bytes(need)}), with pipeline degree "
        f"{k.pipeline_degree}, micro-batch {k.micro_batch_size}, boundaries {cuts}"
    )
    if worst:
        s, i, j, level, rec, mem = worst
        fill = ", ".join(f"{c} {_fmt_bytes(v)}" for c, v in mem.items() if v)
        msg += f"; its fullest stage {s} (layers {i}-{j - 1}, level {level}, recompute {rec}) holds {fill}"
    return InfeasibleBudgetError(msg, need)


def plan_pipeline(prob: PlanningProblem, exclude: frozenset[tuple[int, int]] = frozenset()) -> Plan:
    """The plan with the smallest predicted step time per sample that fits the budget.

    With a fixed global batch this is the smallest step time; with a range it is the highest
    samples/s. ``exclude``: (pipeline degree, micro-batch size) pairs not to consider (the tuning loop's
    runner-up: the best plan of another schedule).

    Raises:
        InfeasibleBudgetError: nothing fits; the message names the smallest budget that does and
            what fills it.
    """
    t0 = time.perf_counter()
    space = [k for k in _knob_space(prob) if (k.pipeline_degree, k.micro_batch_size) not in exclude]
    if not space:
        raise InfeasibleBudgetError(
            "no knob setting is left to plan: every (pipeline degree, micro-batch size) pair the problem "
            f"allows is excluded ({sorted(exclude)})")
    best, cache = None, {}
    for k in space:
        samples = k.global_batch_per_replica * (prob.world_size // k.pipeline_degree)
        upper = _INF if best is None else best[0] * samples  # extras >= 0: the pipeline term must beat it
        res = solve_partition(prob, k, upper, cache)
        if res is None:
            continue
        _, stages = res
        ev = evaluate_stages(prob, k, stages)
        score = ev["step_time"] / samples
        if best is None or score < best[0]:
            best = (score, k, stages, ev)
    if best is None:
        raise _infeasible(prob, space)
    _, k, stages, ev = best
    notes = [f"searched {len(space)} knob settings in {time.perf_counter() - t0:.3f} s"]
    return _to_plan(prob, k, stages, ev, notes)


# ----------------------------------------------------------------------------------------------
# What a user of the stock engine can configure
# ----------------------------------------------------------------------------------------------
def stock_plan(prob: PlanningProblem, boundaries: list[int], micro_batch_size: int, recompute: bool,
               optimizer_8bit: bool, label: str) -> Plan:
    """A stock configuration as a plan: the given stage boundaries (one of the engine's own partition
    methods), training-dtype weights, no compression, recomputation on every stage or none, fp32 or
    8-bit Adam states, and as many micro-batches as the global batch needs."""
    p = len(boundaries) - 1
    dp = prob.world_size // p
    gb = prob.global_batch if isinstance(prob.global_batch, int) else prob.global_batch[1]
    if gb % (micro_batch_size * dp):
        raise ValueError(f"micro_batch_size={micro_batch_size} x data parallel {dp} does not divide the "
                         f"global batch {gb}")
    k = Knobs(p, micro_batch_size, gb // (micro_batch_size * dp), "1f1b", NO_CODEC, NO_CODEC, optimizer_8bit)
    stages = [StageChoice(i, j, "none", recompute) for i, j in zip(boundaries, boundaries[1:])]
    return _to_plan(prob, k, stages, evaluate_stages(prob, k, stages), [label])


def stock_candidates(prob: PlanningProblem, partitions: dict[int, dict[str, list[int]]],
                     optimizer_8bit: bool = True) -> list[Plan]:
    """Every stock configuration a skilled user of the engine could set, predicted, fastest first.

    Args:
        partitions: pipeline degree -> partition method -> boundaries (what the engine's own methods
            give; identical cuts under two names are tried once).
        optimizer_8bit: also try 8-bit Adam states (bitsandbytes, which a user can configure by hand).

    Returns:
        Plans for every degree x partition x micro-batch size dividing the global batch x
        recomputation on/off x optimizer, sorted by predicted time per sample; each plan's
        ``notes[0]`` names its settings. Plans that do not fit the budget are included (the caller
        filters on ``plan_fits``).
    """
    gb = prob.global_batch if isinstance(prob.global_batch, int) else prob.global_batch[1]
    out = []
    for p, by_method in partitions.items():
        dp = prob.world_size // p
        seen = set()
        for method, cuts in by_method.items():
            if tuple(cuts) in seen:
                continue
            seen.add(tuple(cuts))
            for b in prob.micro_batch_sizes:
                if gb % (b * dp):
                    continue
                for rec in ((False, True) if prob.allow_recompute else (False,)):
                    for o8 in ((False, True) if optimizer_8bit else (False,)):
                        label = (f"stock: p={p} partition_method={method!r} micro-batch {b} x "
                                 f"{gb // (b * dp)}, recompute {'on' if rec else 'off'}, "
                                 f"{'8-bit' if o8 else 'fp32'} Adam")
                        out.append(stock_plan(prob, list(cuts), b, rec, o8, label))
    out.sort(key=lambda pl: pl.predicted_step_time / pl.global_batch)
    return out


def best_stock(prob: PlanningProblem, partitions: dict[int, dict[str, list[int]]],
               optimizer_8bit: bool = True) -> Plan:
    """The fastest predicted stock configuration that fits (``stock_candidates``).

    Raises:
        InfeasibleBudgetError: none fits.
    """
    for plan in stock_candidates(prob, partitions, optimizer_8bit):
        if plan_fits(prob, plan):
            return plan
    raise InfeasibleBudgetError(
        f"no stock configuration fits memory_budget={prob.memory_budget} B per stage (partitions "
        f"{partitions}, micro-batch sizes {prob.micro_batch_sizes})")


def plan_fits(prob: PlanningProblem, plan: Plan) -> bool:
    """Whether every stage's predicted peak fits the problem's budget."""
    return prob.memory_budget is None or all(sp.peak_memory <= prob.memory_budget for sp in plan.stages)


def simulate_plan(prob: PlanningProblem, plan: Plan) -> dict:
    """Replay a plan in the schedule simulator (``deepspeed_ppq.schedule``) on DeepSpeed's own
    TrainSchedule ordering, as a second opinion beside the planner's closed-form model.

    Stage costs are the planner's (profiled layer times in the planned formats, the calibrated engine
    overhead charged to the forward, recomputation, the optimizer step); messages carry the codec's
    wire bytes over the planner's link with blocking sends, as DeepSpeed's p2p does.

    Returns:
        ``{"step_time", "bubble_fraction", "idle": [per stage]}``.
    """
    from deepspeed_ppq.schedule import StageCost, build_schedule, simulate

    b, m = plan.micro_batch_size, plan.num_microbatches
    codecs = {}
    for name, cands, cfg in (
        ("act", prob.activation_codecs, plan.activation_codec),
        ("grad", prob.gradient_codecs, plan.gradient_codec),
    ):
        codecs[name] = next((c for c in cands if c.as_dict == cfg), NO_CODEC)
    a, g = codecs["act"], codecs["grad"]
    costs, bbytes, ctime = [], [], []
    for sp in plan.stages:
        f = bi = bw = 0.0
        layers = prob.layers[sp.layers[0] : sp.layers[1]]
        for layer, fmt in zip(layers, sp.formats):
            x, y, z = layer.time(fmt, b)
            f, bi, bw = f + x, bi + y, bw + z
        k = Knobs(plan.pipeline_degree, b, m, plan.schedule, a, g, plan.optimizer_8bit, plan.master_free)
        costs.append(
            StageCost(
                forward=f + prob.microbatch_overhead_s,
                backward_input=bi,
                backward_weight=bw,
                recompute=sum(layer.time(fmt, b)[0]
                              for i, (layer, fmt) in enumerate(zip(layers, sp.formats), start=sp.layers[0])
                              if layer.recomputable and sp.recomputes(i)),
                optimizer=_extras(prob, k, list(zip(layers, sp.formats))),
            )
        )
        if sp.layers[1] < len(prob.layers):
            raw = layers[-1].output_bytes * b
            bbytes.append((int(raw * a.wire_ratio), int(raw * g.wire_ratio)))
            ctime.append(
                (
                    raw * (a.encode_s_per_byte + a.decode_s_per_byte),
                    raw * (g.encode_s_per_byte + g.decode_s_per_byte),
                )
            )
    sched = build_schedule("deepspeed" if plan.schedule == "1f1b" else plan.schedule, plan.pipeline_degree, m)
    link = LinkModel(latency_s=prob.link.latency_s, bandwidth_Bps=prob.link.bandwidth_Bps, overlap=False)
    res = simulate(sched, costs, bbytes, link, codec_time=ctime)
    return {
        "step_time": res.step_time,
        "bubble_fraction": res.bubble_fraction,
        "idle": [st.idle for st in res.per_stage],
    }
