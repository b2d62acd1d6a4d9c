"""The tuning loop, run inside every rank of a gloo/NCCL job (``ppq tune`` starts the ranks).

baseline profile -> plan the DeepSpeed baseline and the tuned plan -> run each with a real
``PPQPipelineEngine`` (explicit boundaries, weights converted per plan, micro-batches set) for a few
steps, measuring step time and memory per stage against the prediction -> validation loss against
the baseline -> if worse than ``val_loss_tolerance``, take low-bit formats away from the most sensitive
layers (largest measured weight error) or drop the most aggressive codec, re-plan -> stop when
accepted or after ``max_iterations``. Every iteration is logged and ends up in the report.

Measured memory on CPU: the storage of weights, masters, gradients and optimizer states
(``quant.measure_storage`` just before an optimizer step, when gradients and states all exist), the
peak of the activations autograd keeps alive (a ``saved_tensors_hooks`` ledger: each saved storage is
counted while any saved reference to it lives) and DeepSpeed's pipe buffers. On CUDA
``torch.cuda.max_memory_allocated`` is reported beside it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from deepspeed_ppq.autotune.costs import NO_CODEC, CodecOption, LayerProfile
from deepspeed_ppq.autotune.plan import Plan
from deepspeed_ppq.autotune.planner import (
    InfeasibleBudgetError,
    Knobs,
    PlanningProblem,
    baseline_plan,
    optimizer_units,
    plan_pipeline,
    simulate_plan,
)

__all__ = ["TuneSpec", "run_tuning", "SavedTensorLedger"]


@dataclass
class TuneSpec:
    """What to tune (the ``ppq tune`` arguments).

    Attributes:
        model: ``GPTConfig`` fields of the shared small GPT.
        global_batch: samples per optimizer step.
        memory_budget: bytes per stage (``None``: unlimited).
        micro_batch_sizes, pipeline_degrees: candidates (``None`` degrees: all divisors).
        formats: low-bit weight formats the planner may use (the policy decides where).
        activation_codecs, gradient_codecs: candidate ``CodecConfig`` dicts; those under
            ``min_activation_bits``/``min_gradient_bits`` are dropped.
        weights: the ``WeightsConfig`` fields of the precision policy.
        optimizer_8bit: let the planner choose 8-bit Adam states.
        schedules: pipeline schedules to plan for; the DeepSpeed engine runs ``"1f1b"`` (its
            ``TrainSchedule``) only, so that is the one value a tuning run accepts.
        master_free: let the planner keep only the 8-bit codes of low-bit weights (``weights.master
            = "none"``, no fp32 master) for 8-bit formats.
        extra_baselines: other DeepSpeed partition methods to run and report (e.g. ``["uniform"]``).
        ab_repeats: after acceptance, run the baseline and the accepted plan alternately this many
            more times each (A B A B ...) so that load drifts on a shared machine hit both alike.
    """

    model: dict = field(
        default_factory=lambda: {"vocab_size": 512, "seq_len": 64, "d_model": 128, "n_layers": 4}
    )
    global_batch: int = 8
    memory_budget: int | None = None
    micro_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    pipeline_degrees: list[int] | None = None
    formats: list[str] = field(default_factory=lambda: ["int8"])
    activation_codecs: list[dict] = field(default_factory=lambda: [{"method": "none"}])
    gradient_codecs: list[dict] = field(default_factory=lambda: [{"method": "none"}])
    weights: dict = field(default_factory=dict)
    optimizer_8bit: bool = True
    schedules: list[str] = field(default_factory=lambda: ["1f1b"])
    master_free: bool = False
    allow_recompute: bool = True
    min_activation_bits: int = 4
    min_gradient_bits: int = 8
    trial_steps: int = 6
    warmup_steps: int = 2
    val_batches: int = 4
    val_loss_tolerance: float = 0.01
    max_iterations: int = 3
    lr: float = 1e-3
    seed: int = 0
    corpus_bytes: int = 400_000
    profile_reps: int = 5
    profile_cache: str | None = None
    out_dir: str = "ppq_tune"
    extra_baselines: list[str] = field(default_factory=list)
    ab_repeats: int = 0

    def __post_init__(self) -> None:
        bad = [s for s in self.schedules if s != "1f1b"]
        if bad or not self.schedules:
            raise ValueError(
                f"schedules={self.schedules!r}: the DeepSpeed pipeline engine runs only '1f1b' (its "
                "TrainSchedule), so a tuning run can plan for ['1f1b'] only"
            )
        if self.master_free and not master_free_supported():
            raise ValueError(
                "master_free=True: this deepspeed_ppq's QuantLinear still keeps an fp32 master weight with "
                "weights.master='none' (master-free training has not landed in deepspeed_ppq.quant); set "
                "master_free=false"
            )
        for name in ("activation_codecs", "gradient_codecs"):
            if not getattr(self, name):
                raise ValueError(f"{name}=[]: give at least one codec (e.g. {{'method': 'none'}})")


def master_free_supported() -> bool:
    """Whether ``QuantLinear`` with ``weights.master="none"`` really drops the fp32 master (probed on a
    small layer: no floating-point parameter of the weight's size is left)."""
    from deepspeed_ppq.config import WeightsConfig
    from deepspeed_ppq.quant import QuantLinear

    try:
        cfg = WeightsConfig(format="int8", master="none")
        q = QuantLinear.from_linear(torch.nn.Linear(64, 64, bias=False), "int8", cfg)
    except (TypeError, ValueError, NotImplementedError):
        return False
    return not any(p.is_floating_point() and p.numel() == 64 * 64 for p in q.parameters())


# ----------------------------------------------------------------------------------------------
# Measuring memory
# ----------------------------------------------------------------------------------------------
class SavedTensorLedger:
    """Peak bytes of the activations autograd keeps for backward (parameters excluded).

    Use as a context manager around training; each saved storage counts once while any saved
    reference to it is alive."""

    def __init__(self, exclude: list[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, list[int]] = {}  # storage ptr -> [nbytes, live references]
        self.live = 0
        self.peak = 0
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self._exclude or st.nbytes() == 0:
            return t
        holder = _Held(t)
        entry = self._refs.setdefault(ptr, [st.nbytes(), 0])
        if entry[1] == 0:
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr: int) -> None:
        entry = self._refs[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._refs[ptr]

    @staticmethod
    def _unpack(obj):
        return obj.t if isinstance(obj, _Held) else obj

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


# ----------------------------------------------------------------------------------------------
# Profile -> problem
# ----------------------------------------------------------------------------------------------
def _codec_bits(c: dict) -> int:
    m = c.get("method", "none")
    return 32 if m in ("none", "topk") else 8 if m == "fp8" else int(c.get("bits", 8))


def _canonical_codec(c: dict) -> str:
    from deepspeed_ppq.config import CodecConfig

    return json.dumps(CodecConfig.model_validate(c).model_dump(mode="json"), sort_keys=True)


def _problem(
    spec: TuneSpec, world: int, layers: list[LayerProfile], codecs: list[CodecOption], link, opt: dict
) -> PlanningProblem:
    by_label = {_canonical_codec(c.as_dict): c for c in codecs}

    def pick(cands: list[dict], min_bits: int) -> list[CodecOption]:
        out = []
        for c in cands:
            if c.get("method", "none") != "none" and _codec_bits(c) < min_bits:
                continue
            out.append(by_label[_canonical_codec(c)])
        if not out:
            raise ValueError(
                f"no codec candidate in {cands} has at least {min_bits} bits (min_activation_bits/"
                "min_gradient_bits): add {'method': 'none'} or a codec with more bits"
            )
        return out

    return PlanningProblem(
        layers=layers,
        world_size=world,
        global_batch=spec.global_batch,
        memory_budget=spec.memory_budget,
        micro_batch_sizes=list(spec.micro_batch_sizes),
        pipeline_degrees=spec.pipeline_degrees,
        schedules=list(spec.schedules),
        activation_codecs=pick(spec.activation_codecs, spec.min_activation_bits),
        gradient_codecs=pick(spec.gradient_codecs, spec.min_gradient_bits),
        optimizer_8bit=[False, True] if spec.optimizer_8bit else [False],
        master_free=[False, True] if spec.master_free else [False],
        allow_recompute=spec.allow_recompute,
        link=link,
        optimizer_s_per_param=opt["adam"],
        optimizer_cost_ratio={k: v / opt["adam"] for k, v in opt.items() if k != "adam" and opt["adam"] > 0},
    )


# ----------------------------------------------------------------------------------------------
# Carrying a plan out on the real engine
# ----------------------------------------------------------------------------------------------
def _linear_formats(spec: TuneSpec, plan: Plan, kinds: list[str], layers) -> dict[str, str]:
    """Linear name (``"3.attn.qkv"``) -> format: the policy's decisions under each layer's planned format."""
    from deepspeed_ppq.autotune.profiler import _decisions
    from deepspeed_ppq.config import WeightsConfig

    wcfg = WeightsConfig.model_validate(spec.weights)
    out = {}
    for fmt in {f for f in plan.layer_formats if f != "none"}:
        dec = _decisions(layers, kinds, wcfg, fmt)
        for i, f in enumerate(plan.layer_formats):
            if f == fmt:
                out.update({n: v for n, v in dec.items() if n.startswith(f"{i}.") and v != "none"})
    return out


def _batches(dataset, b: int, start: int, count: int):
    out = []
    n = len(dataset)
    for k in range(count):
        idx = [(start + k * b + j) % n for j in range(b)]
        items = [dataset[i] for i in idx]
        out.append((torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])))
    return out


def _run_plan(spec: TuneSpec, plan: Plan, train_ds, val_ds) -> dict:
    """Train ``trial_steps`` steps of ``plan`` on the real engine; measure time, memory and val loss."""
    import torch.distributed as dist

    import deepspeed_ppq
    from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule
    from deepspeed_ppq.models.gpt import GPTConfig, gpt_layers, gpt_loss, layer_kinds
    from deepspeed_ppq.quant import QuantLinear, build_optimizer, measure_storage

    cfg = GPTConfig(**spec.model)
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = rank // plan.data_parallel
    layers = gpt_layers(cfg, seed=spec.seed)
    lin_fmt = _linear_formats(spec, plan, layer_kinds(cfg), layers)
    plan.linear_formats = dict(lin_fmt)
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    topo = PipeDataParallelTopology(num_pp=plan.pipeline_degree, num_dp=plan.data_parallel)
    kinds = layer_kinds(cfg)
    wcfg = deepspeed_ppq.config.WeightsConfig.model_validate(spec.weights)
    plan.block_size = wcfg.block_size
    ppq_section = plan.ppq_section()
    # the storage settings the profile measured (scale dtype, double quant, ...) under the plan's rules
    ppq_section["weights"] = {
        **wcfg.model_dump(mode="json", exclude={"format", "rules"}),
        **ppq_section["weights"],
    }
    # the plugin's module converts this stage's Linear layers by the plan's exact rules (global names)
    module = PPQPipelineModule(
        layers,
        topology=topo,
        boundaries=plan.boundaries,
        loss_fn=gpt_loss,
        weights=ppq_section["weights"],
        block_layers=[i for i, k in enumerate(kinds) if k == "block"],
        activation_checkpoint_interval=1 if plan.stages[stage].recompute else 0,
        # what the cost model recomputes (``LayerProfile.recomputable``): every layer but the embedding
        checkpointable_layers=sorted(
            {type(layer).__name__ for layer, kind in zip(layers, kinds) if kind != "embed"}
        ),
    )
    planned = {n for n in lin_fmt if n.split(".", 1)[0].isdigit() and plan.boundaries[stage]
               <= int(n.split(".", 1)[0]) < plan.boundaries[stage + 1]}
    converted = {n for n, m in module.named_modules() if isinstance(m, QuantLinear)}
    if converted != planned:
        raise RuntimeError(
            f"stage {stage}: the module converted {sorted(converted)}, the plan has {sorted(planned)}"
        )
    params = [p for p in module.parameters() if p.requires_grad]
    opt = build_optimizer(params, "adam8bit" if plan.optimizer_8bit else "adam", lr=spec.lr)
    ds_cfg = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_microbatches,
        "steps_per_print": 10**9,
        "ppq": {k: v for k, v in ppq_section.items() if k != "weights"},
    }
    # initialize wires the re-quantization of train-mode low-bit layers after every optimizer step
    engine, _, _, _ = deepspeed_ppq.initialize(model=module, optimizer=opt, config=ds_cfg)
    if plan.master_free and any(getattr(m, "master_free", False) for m in module.modules()):
        # master-free layers are updated from their gradient buffers after each main optimizer step
        from deepspeed_ppq.quant.master_free import attach_master_free

        if getattr(engine, "ppq_master_free_handle", None) is None:
            engine.ppq_master_free_handle = attach_master_free(engine, module)
    instr_time: dict[str, float] = {}

    def timed(name, fn):
        def run(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                instr_time[name] = instr_time.get(name, 0.0) + time.perf_counter() - t0

        return run

    # per-instruction times (DeepSpeed's own wall_clock_breakdown crashes the PipelineEngine in 0.19.8)
    engine._INSTRUCTION_MAP = {k: timed(k.__name__, v) for k, v in type(engine)._INSTRUCTION_MAP.items()}
    static = {}

    def measure_static(_opt, _a, _k):
        static.update(measure_storage(module, opt).groups())

    handle = opt.register_step_pre_hook(measure_static)
    b, m = plan.micro_batch_size, plan.num_microbatches
    replica = rank % plan.data_parallel
    times = []
    with SavedTensorLedger(exclude=list(module.parameters())) as saved:
        for step in range(spec.trial_steps):
            data = _batches(train_ds, b, (step * plan.data_parallel + replica) * b * m, m)
            dist.barrier()
            if step == spec.warmup_steps:
                instr_time.clear()
            t0 = time.perf_counter()
            engine.train_batch(iter(data))
            times.append(time.perf_counter() - t0)
    timed_steps = max(1, spec.trial_steps - spec.warmup_steps)
    handle.remove()
    buf_bytes, seen = 0, set()
    for key in ("inputs", "outputs"):
        for t in engine.pipe_buffers.get(key, []):
            for x in t if isinstance(t, tuple) else (t,):
                if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in seen:
                    seen.add(x.untyped_storage().data_ptr())
                    buf_bytes += x.untyped_storage().nbytes()
    val = _batches(val_ds, b, 0, m * spec.val_batches)
    losses = []
    for k in range(spec.val_batches):
        loss = engine.eval_batch(iter(val[k * m : (k + 1) * m]))
        losses.append(float(loss) if loss is not None else 0.0)
    val_loss = torch.tensor(statistics.mean(losses))
    dist.all_reduce(val_loss, op=dist.ReduceOp.MAX)  # only the last stage holds a loss; others hold 0
    measured = {
        "weights": static.get("weights", 0) + static.get("buffers", 0),
        "master": static.get("master_weights", 0),
        "gradients": static.get("gradients", 0),
        "optimizer": static.get("optimizer", 0),
        "activations": saved.peak,
        "buffers": buf_bytes,
    }
    if torch.cuda.is_available():
        measured["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    mine = {
        "rank": rank,
        "stage": stage,
        "step_times": times,
        "step_time": statistics.median(times[spec.warmup_steps :] or times),
        "mean_step_time": statistics.mean(times[spec.warmup_steps :] or times),
        "memory": measured,
        "val_loss": float(val_loss),
        "instructions": {k: v / timed_steps for k, v in instr_time.items()},
        "wire": {f"{k[0]}.{k[1]}": v for k, v in engine.ppq_stats().items()}
        if hasattr(engine, "ppq_stats")
        else {},
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    return {"ranks": gathered}


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------
def _bcast(obj, src: int = 0):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _summary(plan: Plan, run: dict) -> dict:
    ranks = run["ranks"]
    step = max(r["step_time"] for r in ranks)
    mean_step = max(r["mean_step_time"] for r in ranks)
    stages = []
    for s, sp in enumerate(plan.stages):
        rs = [r for r in ranks if r["stage"] == s]
        mem = {k: max(r["memory"].get(k, 0) for r in rs) for k in rs[0]["memory"]}
        stages.append(
            {
                "stage": s,
                "layers": list(sp.layers),
                "formats": sp.formats,
                "recompute": sp.recompute,
                "predicted_memory": sp.memory,
                "measured_memory": mem,
                "predicted_time_per_microbatch": sp.time_per_microbatch,
                "measured_instructions_per_step": rs[0].get("instructions", {}),
            }
        )
    return {
        "predicted_step_time": plan.predicted_step_time,
        "measured_step_time": step,
        "measured_mean_step_time": mean_step,
        "samples_per_second": plan.global_batch / step,
        "predicted_samples_per_second": plan.samples_per_second,
        "val_loss": ranks[0]["val_loss"],
        "stages": stages,
        "wire": [r["wire"] for r in ranks],
    }


def _stage_compute(problem: PlanningProblem, sp, b: int) -> float:
    t = 0.0
    for layer in problem.layers[sp.layers[0] : sp.layers[1]]:
        f, bi, bw = layer.time("none", b)
        t += f * (2 if sp.recompute and layer.recomputable else 1) + bi + bw
    return t


def _calibrate(problem: PlanningProblem, runs: list[tuple[Plan, dict]]) -> dict:
    """Refit the cost model to what the engine measured (in place on ``problem``).

    Each stage of each run gives a point (profiled forward+backward time per micro-batch, measured
    ``ForwardPass + BackwardPass`` per micro-batch); a least-squares line ``measured = a * profiled + c``
    over the points gives the time scale ``a`` (the isolated profile and the engine see different
    caches, threads and load) and a fixed engine cost ``c >= 0`` per stage and micro-batch (buffer
    handling, instruction dispatch). Runs at two micro-batch sizes are what separate the two. The
    optimizer cost per parameter is refit from the measured optimizer steps. What is left of the first
    run's step time, if positive, is spread per micro-batch slot (``m + p - 1``). The measured link is
    kept (on a busy machine its latency is mostly the peer's wake-up)."""

    xs, ys, opt = [], [], []
    for plan, run in runs:
        m, b = plan.num_microbatches, plan.micro_batch_size
        for sp, st in zip(plan.stages, run["stages"]):
            ins = st["measured_instructions_per_step"]
            meas = (ins.get("ForwardPass", 0.0) + ins.get("BackwardPass", 0.0)) / m
            pred = _stage_compute(problem, sp, b)
            if meas > 0 and pred > 0:
                xs.append(pred)
                ys.append(meas)
            k = Knobs(plan.pipeline_degree, b, m, plan.schedule, NO_CODEC, NO_CODEC, plan.optimizer_8bit,
                      plan.master_free)
            lo, hi = sp.layers
            units = sum(optimizer_units(problem, k, layer, fmt)
                        for layer, fmt in zip(problem.layers[lo:hi], sp.formats))
            if ins.get("OptimizerStep") and units > 0:
                opt.append(ins["OptimizerStep"] / units)
    scale, fixed = 1.0, 0.0
    if xs:
        mx, my = statistics.mean(xs), statistics.mean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var > 0:
            scale = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
            fixed = my - scale * mx
        if var == 0 or scale <= 0 or fixed < 0:  # one size only, or a line through noise: scale alone
            scale, fixed = sum(ys) / sum(xs), 0.0
    for layer in problem.layers:
        layer.times = {f: {mb: [x * scale for x in v] for mb, v in t.items()} for f, t in layer.times.items()}
    if opt:
        problem.optimizer_s_per_param = statistics.median(opt)
    problem.microbatch_overhead_s = fixed
    residual = _fit_link_and_slots(problem, runs)
    return {
        "link_latency_s": problem.link.latency_s,
        "time_scale": scale,
        "fixed_per_microbatch_s": fixed,
        "residual_per_slot_s": residual,
        "optimizer_s_per_param": problem.optimizer_s_per_param,
        "microbatch_overhead_s": problem.microbatch_overhead_s,
        "points": [[x, y] for x, y in zip(xs, ys)],
    }


def _fit_link_and_slots(problem: PlanningProblem, runs: list[tuple[Plan, dict]]) -> float:
    """Refit the link latency and a cost per micro-batch slot to the measured step times.

    After the compute refit, each run's predicted step time is linear in the link latency ``lat``
    (``P0 + n * lat``, ``n`` the messages on the critical path) and the model leaves out a cost ``c``
    per micro-batch slot (``m + p - 1``: synchronisation the profile cannot see). With two runs at
    different micro-batch counts both are fitted (non-negative least squares over the candidates: both,
    latency only, slot cost only); with one run the measured latency is kept and ``c`` takes the
    positive remainder. Returns ``c`` (also added to ``problem.microbatch_overhead_s``)."""
    import dataclasses

    from deepspeed_ppq.autotune.planner import StageChoice, evaluate_stages

    def predicted(plan: Plan, latency: float) -> float:
        saved = problem.link
        problem.link = dataclasses.replace(saved, latency_s=latency)
        try:
            k = Knobs(
                plan.pipeline_degree,
                plan.micro_batch_size,
                plan.num_microbatches,
                plan.schedule,
                NO_CODEC,
                NO_CODEC,
                False,
            )
            stages = [StageChoice(*sp.layers, "none", sp.recompute) for sp in plan.stages]
            return evaluate_stages(problem, k, stages)["step_time"]
        finally:
            problem.link = saved

    lat0 = problem.link.latency_s
    rows = []  # (n, slots, measured - P0)
    for plan, run in runs:
        p0 = predicted(plan, 0.0)
        n = (predicted(plan, 1e-3) - p0) / 1e-3
        rows.append((n, plan.num_microbatches + plan.pipeline_degree - 1, run["measured_step_time"] - p0))
    best = (float("inf"), lat0, 0.0)
    cands = []
    if len(rows) >= 2:
        (n1, s1, r1), (n2, s2, r2) = rows[:2]
        det = n1 * s2 - n2 * s1
        if abs(det) > 1e-12:
            cands.append(((r1 * s2 - r2 * s1) / det, (n1 * r2 - n2 * r1) / det))
        nn = sum(n * n for n, _, _ in rows)
        ss = sum(sl * sl for _, sl, _ in rows)
        if nn > 0:
            cands.append((sum(n * r for n, _, r in rows) / nn, 0.0))
        if ss > 0:
            cands.append((0.0, sum(sl * r for _, sl, r in rows) / ss))
    else:
        n, sl, r = rows[0]
        cands.append((lat0, max(0.0, (r - n * lat0) / sl)))
    for lat, c in cands:
        if lat < 0 or c < 0:
            continue
        err = sum((n * lat + sl * c - r) ** 2 for n, sl, r in rows)
        if err < best[0]:
            best = (err, lat, c)
    if not math.isfinite(best[0]):  # nothing non-negative fits: keep the measured link, no slot cost
        best = (0.0, lat0, 0.0)
    _, lat, c = best
    problem.link = dataclasses.replace(problem.link, latency_s=lat)
    problem.microbatch_overhead_s += c
    return c


def _calibration_plan(problem: PlanningProblem, base: Plan) -> Plan | None:
    """The baseline's partition at a second micro-batch size, to separate the per-micro-batch fixed
    cost from the time scale (and the link latency from the per-slot cost: the micro-batch count
    changes too). The probe runs whether or not it fits the budget (it calibrates, it is not a
    candidate): the size farthest from the baseline's (by ratio; larger on a tie, where tuned plans
    tend to go) among those that split the global batch."""
    from deepspeed_ppq.autotune.planner import StageChoice, _to_plan, evaluate_stages

    dp, gb, b0 = base.data_parallel, base.global_batch, base.micro_batch_size
    sizes = [b for b in problem.micro_batch_sizes if b != b0 and gb % (b * dp) == 0]
    if not sizes:
        return None
    b = max(sizes, key=lambda x: (abs(math.log(x / b0)), x))
    k = Knobs(base.pipeline_degree, b, gb // (b * dp), base.schedule, NO_CODEC, NO_CODEC, False)
    stages = [StageChoice(*sp.layers, "none", sp.recompute) for sp in base.stages]
    ev = evaluate_stages(problem, k, stages)
    note = "calibration probe: the baseline at another micro-batch size" + (
        "" if ev["fits"] else " (over the budget: run for calibration only)"
    )
    return _to_plan(problem, k, stages, ev, [note])


def _predict(problem: PlanningProblem, plan: Plan) -> dict:
    """The (calibrated) model's step time and bubble for an existing plan."""
    from deepspeed_ppq.autotune.planner import StageChoice, evaluate_stages

    def codec(cands, cfg):
        return next((c for c in cands if c.as_dict == cfg), None) or CodecOption.make(cfg)

    k = Knobs(
        plan.pipeline_degree,
        plan.micro_batch_size,
        plan.num_microbatches,
        plan.schedule,
        codec(problem.activation_codecs, plan.activation_codec),
        codec(problem.gradient_codecs, plan.gradient_codec),
        plan.optimizer_8bit,
        plan.master_free,
    )
    levels = []
    for sp in plan.stages:
        low = sorted({f for f in sp.formats if f != "none"})
        levels.append(low[0] if len(low) == 1 else "none")
    stages = [StageChoice(*sp.layers, lv, sp.recompute) for sp, lv in zip(plan.stages, levels)]
    ev = evaluate_stages(problem, k, stages)
    return {"step_time": ev["step_time"], "bubble_fraction": ev["bubble_fraction"]}


def _back_off(layers: list[LayerProfile], plan: Plan, problem: PlanningProblem) -> str | None:
    """Make the next plan more conservative; returns what was changed, or None if nothing is left.

    Order: master-free weights get their fp32 masters back; then the most sensitive layer (largest
    weight error) loses its low-bit format; then the most aggressive codec goes."""
    if plan.master_free and True in problem.master_free:
        problem.master_free = [False]
        return "master-free weights removed: low-bit layers keep an fp32 master again"
    quantized = [
        (layers[i].quant_error.get(f, 0.0), i, f) for i, f in enumerate(plan.layer_formats) if f != "none"
    ]
    if quantized:
        err, i, f = max(quantized)
        layers[i].allowed_formats = [x for x in layers[i].allowed_formats if x != f]
        return f"layer {i}: {f} removed (weight error {err:.4f}, the largest)"
    for attr in ("activation_codecs", "gradient_codecs"):
        cands = getattr(problem, attr)
        lossy = [c for c in cands if c.as_dict.get("method", "none") != "none"]
        if lossy:
            worst = min(lossy, key=lambda c: c.bits)
            setattr(problem, attr, [c for c in cands if c is not worst])
            return f"{attr}: {worst.label} removed"
    return None


def run_tuning(spec: TuneSpec) -> dict | None:
    """Run the loop on this rank (``torch.distributed`` must be initialised on every rank).

    Returns:
        On rank 0: the result (baseline, iterations, accepted plan); elsewhere None. Rank 0 also
        writes ``plan.json``, ``report.md`` and ``tune.json`` to ``spec.out_dir``.
    """
    import torch.distributed as dist

    from deepspeed_ppq.autotune import profiler
    from deepspeed_ppq.autotune.report import write_outputs
    from deepspeed_ppq.data import build_token_datasets
    from deepspeed_ppq.models.gpt import GPTConfig, gpt_layers, gpt_loss, layer_kinds

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**spec.model)
    log = []

    def note(msg: str) -> None:
        log.append(msg)
        if rank == 0:
            print(f"[ppq tune] {msg}", flush=True)

    if rank == 0:  # build the tokenizer cache once, then every rank reads it
        build_token_datasets(cfg.seq_len, cfg.vocab_size, spec.corpus_bytes)
    dist.barrier()
    train_ds, val_ds, _ = build_token_datasets(cfg.seq_len, cfg.vocab_size, spec.corpus_bytes)

    # 1. profile (rank 0; the others wait), cached
    t0 = time.perf_counter()
    if rank == 0:
        layers = gpt_layers(cfg, seed=spec.seed)
        kinds = layer_kinds(cfg)
        from deepspeed_ppq.config import WeightsConfig

        wcfg = WeightsConfig.model_validate(spec.weights)
        key = profiler.profile_key(
            layers,
            mbs=spec.micro_batch_sizes,
            formats=spec.formats,
            weights=spec.weights,
            codecs=[spec.activation_codecs, spec.gradient_codecs],
            reps=spec.profile_reps,
        )
        cached = profiler.load_cached(spec.profile_cache, key) if spec.profile_cache else None
        if cached:
            lprof, codecs = profiler.layers_from_cache(cached)
            opt = cached["optimizer_costs"]
            note(f"profile: loaded from {spec.profile_cache}")
        else:
            sample = train_ds[0][0]

            def make_batch(b):
                items = [train_ds[i] for i in range(b)]
                return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

            lprof = profiler.profile_layers(
                layers,
                kinds,
                make_batch,
                gpt_loss,
                wcfg,
                spec.formats,
                spec.micro_batch_sizes,
                reps=spec.profile_reps,
            )
            shape = (max(spec.micro_batch_sizes), sample.shape[0], cfg.d_model)
            uniq = {json.dumps(c, sort_keys=True): c for c in spec.activation_codecs + spec.gradient_codecs}
            codecs = profiler.profile_codecs(list(uniq.values()), shape)
            opt = profiler.optimizer_costs()
            if spec.profile_cache:
                profiler.save_cache(spec.profile_cache, key, lprof, codecs, {"optimizer_costs": opt})
        payload = ([lp.to_dict() for lp in lprof], [asdict(c) for c in codecs], opt)
    else:
        payload = None
    lp_d, codec_d, opt = _bcast(payload)
    lprof = [LayerProfile.from_dict(d) for d in lp_d]
    codecs = [CodecOption(**{**c, "config": tuple(tuple(x) for x in c["config"])}) for c in codec_d]
    link = profiler.measure_link()
    link = _bcast(link)  # rank 0's measurement for everyone
    note(
        f"profile: {len(lprof)} layers, link {link.latency_s * 1e6:.0f} us + "
        f"{link.bandwidth_Bps / 1e9:.2f} GB/s, optimizer ns/param "
        + ", ".join(f"{k} {v * 1e9:.1f}" for k, v in opt.items())
        + f", {time.perf_counter() - t0:.1f} s"
    )

    problem = _problem(spec, world, lprof, codecs, link, opt)
    degree = max(problem.degrees())
    base = None
    if rank == 0:
        try:
            base = baseline_plan(problem, "parameters", pipeline_degree=degree)
        except InfeasibleBudgetError as baseline_error:  # every rank must learn of it
            base = baseline_error
            try:
                plan_pipeline(problem)
            except InfeasibleBudgetError as smallest:  # names the smallest budget that fits
                base = smallest
    base = _bcast(base)
    if isinstance(base, Exception):
        raise base
    note(
        f"baseline: boundaries {base.boundaries}, micro-batch {base.micro_batch_size} x "
        f"{base.num_microbatches}, "
        f"recompute {[s.recompute for s in base.stages]}, predicted {base.predicted_step_time * 1e3:.1f} ms"
    )
    base_run = _summary(base, _run_plan(spec, base, train_ds, val_ds))
    note(
        f"baseline: measured {base_run['measured_step_time'] * 1e3:.1f} ms, "
        f"val loss {base_run['val_loss']:.4f}"
    )

    extra = {}
    for method in spec.extra_baselines:
        other = baseline_plan(problem, method, pipeline_degree=degree) if rank == 0 else None
        other = _bcast(other)
        extra[method] = {
            "plan": other.to_dict(),
            "run": _summary(other, _run_plan(spec, other, train_ds, val_ds)),
        }
        note(
            f"baseline {method}: boundaries {other.boundaries}, measured "
            f"{extra[method]['run']['measured_step_time'] * 1e3:.1f} ms"
        )
    runs = [(base, base_run)]
    calib = _calibration_plan(problem, base) if rank == 0 else None
    calib = _bcast(calib)
    if calib is not None:
        runs.append((calib, _summary(calib, _run_plan(spec, calib, train_ds, val_ds))))
        note(
            f"calibration run: micro-batch {calib.micro_batch_size} x {calib.num_microbatches}, "
            f"measured {runs[-1][1]['measured_step_time'] * 1e3:.1f} ms"
        )
    calibration = _calibrate(problem, runs)
    base_run["simulated_after_calibration"] = simulate_plan(problem, base)
    for plan, run in runs:  # in-sample: these runs are what the model was fitted to
        cal = _predict(problem, plan)
        run["calibrated_step_time"] = cal["step_time"]
        run["calibrated_bubble_fraction"] = cal["bubble_fraction"]
    for rec in extra.values():
        cal = _predict(problem, Plan.from_dict(rec["plan"]))
        rec["run"]["calibrated_step_time"] = cal["step_time"]
        rec["run"]["calibrated_bubble_fraction"] = cal["bubble_fraction"]
    if calib is not None:
        calibration["probe"] = {
            "micro_batch_size": calib.micro_batch_size,
            "num_microbatches": calib.num_microbatches,
            "measured_step_time": runs[-1][1]["measured_step_time"],
            "calibrated_step_time": runs[-1][1]["calibrated_step_time"],
        }
    note(
        f"calibration: layer times x{calibration['time_scale']:.3f}, "
        f"engine {calibration['fixed_per_microbatch_s'] * 1e3:.2f} ms per stage and micro-batch "
        f"(+{calibration['residual_per_slot_s'] * 1e3:.2f} ms per slot), "
        f"link latency {calibration['link_latency_s'] * 1e6:.0f} us, "
        f"optimizer {calibration['optimizer_s_per_param'] * 1e9:.2f} ns/param (fp32 Adam; other kinds keep "
        "their profiled ratios)"
    )

    iterations, accepted = [], None
    for it in range(spec.max_iterations):
        try:
            plan = plan_pipeline(problem) if rank == 0 else None
        except InfeasibleBudgetError as e:
            plan = e
        plan = _bcast(plan)
        if isinstance(plan, Exception):
            raise plan
        run = _summary(plan, _run_plan(spec, plan, train_ds, val_ds))
        run["simulated"] = simulate_plan(problem, plan)
        limit = base_run["val_loss"] * (1 + spec.val_loss_tolerance)
        ok = run["val_loss"] <= limit
        rec = {"iteration": it, "plan": plan.to_dict(), "run": run, "accepted": ok}
        note(
            f"iteration {it}: boundaries {plan.boundaries}, micro-batch {plan.micro_batch_size} x "
            f"{plan.num_microbatches}, formats {plan.layer_formats}, 8-bit Adam {plan.optimizer_8bit}, "
            f"master-free {plan.master_free}, "
            f"predicted {plan.predicted_step_time * 1e3:.1f} ms, "
            f"measured {run['measured_step_time'] * 1e3:.1f} ms, "
            f"val loss {run['val_loss']:.4f} (limit {limit:.4f}) -> {'accepted' if ok else 'rejected'}"
        )
        if ok:
            accepted = (plan, run)
            iterations.append(rec)
            break
        change = _back_off(problem.layers, plan, problem)
        rec["back_off"] = change
        iterations.append(rec)
        if change is None:
            note("nothing left to back off")
            break
        note(f"back off: {change}")
    ab = {"baseline": [base_run["measured_step_time"]], "tuned": []}
    if accepted is not None:
        ab["tuned"].append(accepted[1]["measured_step_time"])
        for r in range(spec.ab_repeats):
            for name, plan in (("baseline", base), ("tuned", accepted[0])):
                again = _summary(plan, _run_plan(spec, plan, train_ds, val_ds))
                ab[name].append(again["measured_step_time"])
            note(
                f"A/B repeat {r}: baseline {ab['baseline'][-1] * 1e3:.1f} ms, "
                f"tuned {ab['tuned'][-1] * 1e3:.1f} ms"
            )
    result = {
        "ab_step_times": ab,
        "spec": asdict(spec),
        "world_size": world,
        "baseline": {"plan": base.to_dict(), "run": base_run},
        "iterations": iterations,
        "accepted": accepted is not None,
        "calibration": calibration,
        "extra_baselines": extra,
        "log": log,
        "profile": [lp.to_dict() for lp in lprof],
    }
    if rank == 0:
        os.makedirs(spec.out_dir, exist_ok=True)
        write_outputs(result, base, accepted[0] if accepted else None, Path(spec.out_dir))
        return result
    return None


def copy_spec(spec: TuneSpec, **changes) -> TuneSpec:
    return TuneSpec(**{**copy.deepcopy(asdict(spec)), **changes})
