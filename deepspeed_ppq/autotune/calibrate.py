"""Refit the planner's cost model to what the engine measured.

Time (``calibrate_time``): the profile times layers in isolation; the engine adds dispatch, buffer
handling and waiting, and runs on caches and threads the profile did not see. Each measured stage
gives a point (profiled vs measured forward + backward per micro-batch); a line through them gives a
time scale and a fixed cost per stage and micro-batch; the link latency and a cost per micro-batch
slot are refitted to the measured step times; the optimizer's seconds per parameter to the measured
optimizer steps.

Memory (``calibrate_memory``): the planner's static bytes (weights, masters, gradients, optimizer
states) are exact; the engine's transient around the optimizer step (a flattened gradient buffer,
the optimizer's temporaries) is refitted from every measured stage whose peak the model undershot:
``step_transient_bytes_per_param`` rises to what the largest such stage needed. It never falls, so a
plan the model says fits has fitted wherever the loop has looked.

Every trial is a ``(plan, summary)`` pair, ``summary`` as ``loop.summarize`` writes it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from deepspeed_ppq.autotune.costs import NO_CODEC, CodecOption
from deepspeed_ppq.autotune.memory import MIB
from deepspeed_ppq.autotune.plan import Plan
from deepspeed_ppq.autotune.planner import Knobs, PlanningProblem, optimizer_units

__all__ = ["calibrate_time", "calibrate_memory", "fit_link_and_slots", "predict", "stage_compute"]


def stage_compute(problem: PlanningProblem, sp, b: int) -> float:
    t = 0.0
    for i, layer in enumerate(problem.layers[sp.layers[0] : sp.layers[1]], start=sp.layers[0]):
        f, bi, bw = layer.time("none", b)
        t += f * (2 if sp.recomputes(i) and layer.recomputable else 1) + bi + bw
    return t


def calibrate_time(problem: PlanningProblem, runs: list[tuple[Plan, dict]]) -> dict:
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
            pred = stage_compute(problem, sp, b)
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
    residual = fit_link_and_slots(problem, runs)
    return {
        "link_latency_s": problem.link.latency_s,
        "time_scale": scale,
        "fixed_per_microbatch_s": fixed,
        "residual_per_slot_s": residual,
        "optimizer_s_per_param": problem.optimizer_s_per_param,
        "microbatch_overhead_s": problem.microbatch_overhead_s,
        "points": [[x, y] for x, y in zip(xs, ys)],
    }


def fit_link_and_slots(problem: PlanningProblem, runs: list[tuple[Plan, dict]]) -> float:
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
                plan.optimizer_8bit,
            )
            stages = [StageChoice(*sp.layers, "none", sp.recompute, sp.keep_last) for sp in plan.stages]
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


def _knobs_stages(problem: PlanningProblem, plan: Plan):
    from deepspeed_ppq.autotune.planner import StageChoice

    def codec(cands, cfg):
        return next((c for c in cands if c.as_dict == cfg), None) or CodecOption.make(cfg)

    k = Knobs(plan.pipeline_degree, plan.micro_batch_size, plan.num_microbatches, plan.schedule,
              codec(problem.activation_codecs, plan.activation_codec),
              codec(problem.gradient_codecs, plan.gradient_codec), plan.optimizer_8bit, plan.master_free)
    levels = []
    for sp in plan.stages:
        low = sorted({f for f in sp.formats if f != "none"})
        levels.append(low[0] if len(low) == 1 else "none")
    return k, [StageChoice(*sp.layers, lv, sp.recompute, sp.keep_last) for sp, lv in zip(plan.stages, levels)]


def predict(problem: PlanningProblem, plan: Plan) -> dict:
    """The (calibrated) model's step time, bubble and per-stage memory for an existing plan."""
    from deepspeed_ppq.autotune.planner import evaluate_stages

    k, stages = _knobs_stages(problem, plan)
    ev = evaluate_stages(problem, k, stages)
    return {"step_time": ev["step_time"], "bubble_fraction": ev["bubble_fraction"], "memory": ev["memory"]}


def calibrate_memory(problem: PlanningProblem, runs: list[tuple[Plan, dict]]) -> dict:
    """Refit the memory model to measured stages (in place on ``problem``); it only ever grows.

    Trials measure each stage's peak in two phases: the pipeline (forward, backward, sends: the
    activations) and the step (gradient reduce and optimizer: the step transient).

    1. ``activation_extra_bytes``: per micro-batch size, the largest excess, over stages without
       recomputation, of the measured pipeline-phase activations over the predicted activations + pipe
       buffers (the engine keeps clones of received activations, outputs until sent, ...), at least 0
       and at least the current value (``PlanningProblem.activation_extra_for``).
    2. ``step_fixed_bytes``: the measured step-phase peak minus the static bytes (weights, masters,
       gradients, optimizer states), the pipe buffers and the per-parameter step transient (the
       runner's figure: a flattened gradient buffer, the optimizer's temporaries) is what the engine
       still holds then; the largest over stages, at least the current value.

    Returns:
        ``{"activation_extra_bytes", "step_transient_bytes_per_param", "step_fixed_bytes", "before": {...}}``.
    """
    before = {"activation_extra_bytes": dict(problem.activation_extra_bytes),
              "step_fixed_bytes": problem.step_fixed_bytes}
    need = problem.step_fixed_bytes
    extra = dict(problem.activation_extra_bytes)
    per_param = problem.step_transient_bytes_per_param
    problem.activation_extra_bytes = {}  # predict the profile's bytes alone
    # the step phase holds every gradient: predicted without grads_freed_after_step, which lowers only
    # "gradients" (to what the pipeline phase's peak holds of them)
    whole = dataclasses.replace(problem, grads_freed_after_step=False)
    for plan, run in runs:
        b = plan.micro_batch_size
        for sp, pred, st in zip(plan.stages, predict(whole, plan)["memory"], run["stages"]):
            phases = st["measured_memory"].get("phases") or {"pipeline": st["measured_memory"]}
            pipe = phases.get("pipeline")
            if pipe and not sp.recompute:
                excess = pipe.get("activations", 0) - (pred["activations"] + pred["comm_buffers"])
                extra[b] = max(extra.get(b, 0.0), float(excess))
            step = phases.get("step")
            params = sum(layer.engine_params(f, plan.master_free)
                         for layer, f in zip(problem.layers[sp.layers[0] : sp.layers[1]], sp.formats))
            if step:
                fixed = sum(pred[k] for k in ("weights", "master_weights", "gradients", "optimizer"))
                need = max(need, step["total"] - fixed - pred["comm_buffers"] - per_param * params)
    problem.activation_extra_bytes = dict(sorted(extra.items()))
    problem.step_fixed_bytes = need
    return {"activation_extra_bytes": dict(problem.activation_extra_bytes),
            "step_transient_bytes_per_param": per_param, "step_fixed_bytes": need, "before": before}


def describe_extra(extra: dict) -> str:
    """``activation_extra_bytes`` in words, for logs and reports."""
    if not extra:
        return "activations as profiled (no trial without recomputation)"
    by_size = ", ".join(f"{b}: +{v / MIB:.2f}" for b, v in sorted(extra.items(), key=lambda kv: int(kv[0])))
    return f"activations beyond the profile, MiB per stage by micro-batch size: {by_size}"
