"""The ablation ladder: from the best stock configuration to the tuned plan, one feature at a time.

``ladder_plans`` builds the rungs (low-bit weights at the stock schedule, the freed memory spent on fill,
re-balanced stages, codecs); the tuning loop measures each on the engine and ``repeat_ladder`` times them
again, alternating. ``measured_bubble`` and ``stage_compute`` read a measured run apart into the pipeline's
idle time and each stage's compute, so a rung's gain can be credited to what it changed.
"""

from __future__ import annotations

import statistics

from deepspeed_ppq.autotune.costs import NO_CODEC
from deepspeed_ppq.autotune.plan import Plan
from deepspeed_ppq.autotune.planner import Knobs, PlanningProblem, StageChoice, _to_plan, evaluate_stages
from deepspeed_ppq.autotune.runner import TuningRunner

__all__ = ["ladder_plans", "rebalance_label", "repeat_ladder", "measured_bubble", "stage_compute"]

_COMPUTE = ("ForwardPass", "BackwardPass", "LoadMicroBatch", "OptimizerStep", "ReduceGrads",
            "ReduceTiedGrads")


def measured_bubble(run: dict) -> float:
    """Idle fraction of the step, averaged over stages: the step minus each stage's compute
    instructions (the rest is waiting on sends and receives, i.e. the pipeline bubble and transfers)."""
    step = run["measured_step_time"]
    idle = [max(0.0, 1 - sum(st["measured_instructions_per_step"].get(k, 0.0) for k in _COMPUTE) / step)
            for st in run["stages"]]
    return statistics.mean(idle) if idle and step > 0 else 0.0


def stage_compute(run: dict) -> list[float]:
    """Seconds per step each stage spends in forward and backward passes (recomputation included): what
    a rung's low-bit weights or re-balanced boundaries change, apart from the bubble."""
    return [st["measured_instructions_per_step"].get("ForwardPass", 0.0)
            + st["measured_instructions_per_step"].get("BackwardPass", 0.0) for st in run["stages"]]


def rebalance_label(fill: Plan, tuned: Plan) -> str:
    """The re-balancing rung's name: what the tuned plan changes after the fill rung (one low-bit level
    on every stage at the stock cut): the boundaries, each stage's precision, or both."""
    what = []
    if tuned.boundaries != fill.boundaries:
        what.append("boundaries")
    if tuned.layer_formats != fill.layer_formats:
        what.append("each stage's precision")
    return "+ re-balanced stages" + (f" ({' and '.join(what)})" if what else "")


def _compresses(plan: Plan) -> bool:
    """Whether a plan compresses the traffic between its stages (either direction)."""
    return plan.activation_codec != {"method": "none"} or plan.gradient_codec != {"method": "none"}


def left_out_codecs(tuned: Plan) -> str | None:
    """Why the ladder has no codec rung (None when it has one): the tuned plan compresses no traffic."""
    if _compresses(tuned):
        return None
    if tuned.pipeline_degree == 1:
        return "+ compressed boundaries: the tuned plan runs one stage, so no traffic goes between stages"
    return ("+ compressed boundaries: the tuned plan compresses no traffic (no codec candidate was predicted "
            "to pay on the measured link)")


def left_out_lines(left_out: list[str]) -> list[str]:
    """The rungs a ladder left out (``tune()``'s ``ladder_left_out``), as the lines below its table."""
    return [f"Left out: {why}." for why in left_out]


def ladder_plans(problem: PlanningProblem, base: Plan, tuned: Plan,
                 partitions: dict[int, dict[str, list[int]]] | None = None) -> list[tuple[str, Plan]]:
    """The rungs between the best stock configuration and the tuned plan, one feature at a time:
    low-bit weights (and the tuned plan's optimizer states) at the stock schedule and partition; then
    the freed memory spent on fill: the tuned micro-batches and recomputation at the stock partition,
    or, where the tuned plan runs fewer pipeline stages, that degree cut the way stock DeepSpeed would
    cut it (``partitions``: degree -> method -> boundaries, the stock method's cut); then the tuned
    partition and per-stage precision (re-balanced for the stages' new costs); then the tuned codecs.
    A rung the model cannot express (a format the tuned optimizer setting does not allow) is left out."""
    low = [f for f in tuned.layer_formats if f != "none"]
    level = max(set(low), key=low.count) if low else "none"

    def make(label, p, b, m, bounds, recompute, codecs: bool):
        act = next((c for c in problem.activation_codecs if c.as_dict == tuned.activation_codec), NO_CODEC)
        grad = next((c for c in problem.gradient_codecs if c.as_dict == tuned.gradient_codec), NO_CODEC)
        k = Knobs(p, b, m, tuned.schedule, act if codecs else NO_CODEC, grad if codecs else NO_CODEC,
                  tuned.optimizer_8bit, tuned.master_free)
        stages = [StageChoice(i, j, level, r, keep)
                  for (i, j), (r, keep) in zip(zip(bounds, bounds[1:]), recompute)]
        return _to_plan(problem, k, stages, evaluate_stages(problem, k, stages), [label])

    rungs = []
    rec_base = [(sp.recompute, sp.keep_last) for sp in base.stages]
    rec_tuned = [(sp.recompute, sp.keep_last) for sp in tuned.stages]
    try:
        rungs.append(("+ low-bit weights and optimizer states at the stock schedule",
                      make("ladder: low-bit", base.pipeline_degree, base.micro_batch_size,
                           base.num_microbatches, base.boundaries, rec_base, False)))
        if tuned.pipeline_degree == base.pipeline_degree:
            rungs.append(("+ freed memory spent on fill (micro-batches, recomputation)",
                          make("ladder: fill", base.pipeline_degree, tuned.micro_batch_size,
                               tuned.num_microbatches, base.boundaries, rec_tuned, False)))
        else:  # fewer (or more) stages: the stock cut of that degree, by the baseline's method
            methods = (partitions or {}).get(base.pipeline_degree, {})
            method = next((name for name, cut in methods.items() if cut == base.boundaries), None)
            cuts = (partitions or {}).get(tuned.pipeline_degree, {})
            bounds = cuts.get(method) or next(iter(cuts.values()), tuned.boundaries)
            rungs.append((f"+ freed memory spent on fill ({base.pipeline_degree} -> {tuned.pipeline_degree} "
                          "pipeline stages, micro-batches, recomputation)",
                          make("ladder: fill", tuned.pipeline_degree, tuned.micro_batch_size,
                               tuned.num_microbatches, bounds, rec_tuned, False)))
        fill = rungs[-1][1]
        rungs.append((rebalance_label(fill, tuned),
                      make("ladder: re-balanced", tuned.pipeline_degree, tuned.micro_batch_size,
                           tuned.num_microbatches, tuned.boundaries, rec_tuned, False)))
    except ValueError:  # a level the optimizer setting does not allow: no intermediate rungs
        rungs = []
    if _compresses(tuned):
        rungs.append(("+ compressed boundaries (the tuned plan)", tuned))
    elif rungs:
        rungs[-1] = (rungs[-1][0] + " (the tuned plan)", tuned)
    return rungs


def repeat_ladder(runner: TuningRunner, settings, ladder: list[dict]) -> None:
    """Time every rung ``settings.ab_repeats`` more times, the rungs alternating so that load drifts hit
    each alike (one trial per rung swung by 10-30% on a shared 2-core machine): a rung's step time becomes
    the median over its trials (``repeat_step_times`` keeps them), its per-instruction times the mean."""
    runs = [[] for _ in ladder]
    for _ in range(settings.ab_repeats):
        for k, rec in enumerate(ladder):
            runs[k].append(runner.run_trial(Plan.from_dict(rec["plan"]), settings, seed=0, timing_only=True))
    for rec, trials in zip(ladder, runs):
        run = rec["run"]
        times = [run["measured_step_time"], *(t.step_time for t in trials)]
        run["repeat_step_times"] = times
        run["measured_step_time"] = statistics.median(times)
        run["samples_per_second"] *= times[0] / run["measured_step_time"]
        stages = []
        for k, st in enumerate(run["stages"]):
            seen = [st["measured_instructions_per_step"], *(t.stages[k].instructions for t in trials)]
            mean = {name: statistics.mean(d.get(name, 0.0) for d in seen) for name in seen[0]}
            stages.append({**st, "measured_instructions_per_step": mean})
        run["stages"] = stages
