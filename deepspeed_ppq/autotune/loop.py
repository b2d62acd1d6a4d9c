"""The tuning loop: plan, measure, calibrate, decide, over any engine that implements ``TuningRunner``.

1. **Profile** the user's model (``runner.profile``): layer times and activation bytes in every
   weight format the precision policy allows, codecs, link, optimizer kinds.
2. **The best stock configuration**: every setting a skilled user of the stock engine could choose
   (pipeline degree, the engine's own partition methods, micro-batch size, recomputation on/off,
   fp32 or 8-bit Adam) is predicted and measured best-first: after each trial the time and memory
   models are refitted to every trial so far (``calibrate``) and the candidates re-ranked; after
   ``stock_trials`` that fit, the search goes on while the next candidate that the model says may fit
   (predicted within the budget plus its tolerance, the limit the measurement applies) is predicted
   within ``stock_margin`` of the best measured; then the fastest candidate predicted over that limit but
   within ``MEMORY_PROBE`` of the budget is measured when it is predicted faster than the best measured
   (the tuned plans' memory probe, step 5, on the stock side). The stock configurations that fit and
   measured within ``stock_margin`` of the fastest are then timed ``ab_repeats`` more times,
   alternating (one trial swings by 10-30% on a shared machine: a single trial would pick the baseline
   by noise); the lowest median is the baseline. Its validation loss is measured over ``seeds`` seeds:
   the quality gate's noise. When no stock configuration fits (measured), stock DeepSpeed cannot
   train at this budget: the one with the smallest measured peak, run over the budget, is the quality
   reference, and a plan that passes the checks is the outcome (``"stock_does_not_fit"``) with no
   speedup claimed.
3. **Calibrate**: the models as fitted to every measured stock trial.
4. **Plan** jointly (``planner.plan_pipeline``): low-bit weights under the precision policy, 8-bit
   optimizer states, master-free weights, the memory they free spent on micro-batches and less
   recomputation, stage boundaries re-balanced for the stages' new costs, codecs.
5. **Measure the plan**. Over the budget (measured peak, with the same tolerance as the baseline):
   recalibrate memory and plan again. Validation loss outside the gate: back off (the most sensitive
   layer loses its format, master-free weights get their masters back, the most aggressive codec
   goes) and plan again. Accepted, or ``max_iterations`` spent. An accepted plan is then challenged
   by two more trials: the best plan of another schedule (the runner-up) when the model predicts it
   close, and the best plan under a budget ``MEMORY_PROBE`` wider when it is predicted faster (the
   budget binds on the measured peak, which the memory model misses by several percent either way).
6. **Against stock**: the accepted plan and the baseline alternate ``ab_repeats`` times; the speedup is
   the ratio of the medians. With ``ladder``, the rungs between them are measured one feature at a
   time (``ladder.py``).

Every rank runs this loop over its own runner; runners return the same measurements on every rank,
so every rank takes the same decisions. Nothing here imports an engine or a model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from typing import Any

from deepspeed_ppq.autotune import calibrate
from deepspeed_ppq.autotune.costs import CodecOption, LayerProfile
from deepspeed_ppq.autotune.gate import MIN_SEEDS, QualityGate
from deepspeed_ppq.autotune.ladder import ladder_plans, left_out_codecs, measured_bubble, repeat_ladder
from deepspeed_ppq.autotune.memory import coarse, fmt_mib
from deepspeed_ppq.autotune.plan import Plan
from deepspeed_ppq.autotune.planner import (
    InfeasibleBudgetError,
    PlanningProblem,
    plan_pipeline,
    simulate_plan,
    stock_candidates,
)
from deepspeed_ppq.autotune.runner import Profile, TrialResult, TuningRunner

__all__ = [
    "tune", "summarize", "build_problem", "back_off", "default_micro_batch_sizes",
    "same_configuration", "is_stock_configuration", "over_budget", "may_fit", "TuningError",
]


# stock trials at most, in multiples of ``stock_trials``
_STOCK_TRIAL_CAP = 4


class TuningError(RuntimeError):
    """The loop cannot go on (nothing fits the budget, no stock configuration runs, ...)."""


def default_micro_batch_sizes(global_batch: int, data_parallel: int = 1, limit: int = 16) -> list[int]:
    """Every micro-batch size up to ``limit`` that divides the global batch per replica."""
    per = global_batch // max(1, data_parallel)
    return [b for b in range(1, min(per, limit) + 1) if per % b == 0]


def _codec_key(c: dict) -> str:
    from deepspeed_ppq.config import CodecConfig

    return json.dumps(CodecConfig.model_validate(c).model_dump(mode="json"), sort_keys=True)


def _codec_bits(c: dict) -> int:
    m = c.get("method", "none")
    return 32 if m in ("none", "topk") else 8 if m == "fp8" else int(c.get("bits", 8))


def codec_dict(c) -> dict:
    """A ``CodecConfig`` as the short dict plans carry: ``method`` plus the non-default fields."""
    return {"method": c.method, **c.model_dump(mode="json", exclude_defaults=True)}


def build_problem(settings, world_size: int, global_batch: int, profile: Profile) -> PlanningProblem:
    """The planning problem for ``settings`` (an ``AutotuneConfig``) on ``profile``."""
    by_key = {_codec_key(c.as_dict): c for c in profile.codecs}

    def pick(cands, min_bits: int, field: str) -> list[CodecOption]:
        out = []
        for c in cands:
            d = codec_dict(c)
            if d["method"] != "none" and _codec_bits(d) < min_bits:
                continue
            out.append(by_key[_codec_key(d)])
        if not out:
            raise TuningError(
                f"ppq.autotune.{field}: no candidate has at least {min_bits} bits (min_*_bits); add "
                "{'method': 'none'} or a codec with more bits")
        return out

    opt = profile.optimizer_costs
    adam = opt.get("adam", 0.0)
    return PlanningProblem(
        layers=[LayerProfile.from_dict(lp.to_dict()) for lp in profile.layers],
        world_size=world_size,
        global_batch=global_batch,
        memory_budget=settings.memory_budget,
        micro_batch_sizes=list(settings.micro_batch_sizes or default_micro_batch_sizes(global_batch)),
        pipeline_degrees=settings.pipeline_degrees,
        schedules=list(settings.schedules),
        activation_codecs=pick(settings.activation_codecs, settings.min_activation_bits, "activation_codecs"),
        gradient_codecs=pick(settings.gradient_codecs, settings.min_gradient_bits, "gradient_codecs"),
        optimizer_8bit=[False, True] if settings.optimizer_8bit else [False],
        master_free=[False, True] if settings.master_free else [False],
        master_free_grad_dtype=settings.master_free_grad_dtype,
        allow_recompute=settings.allow_recompute,
        link=profile.link,
        optimizer_s_per_param=adam,
        optimizer_cost_ratio={k: v / adam for k, v in opt.items() if k != "adam" and adam > 0},
        step_transient_bytes_per_param=profile.step_transient_bytes_per_param,
        grads_freed_after_step=profile.grads_freed_after_step,
        master_free_update_in_backward=profile.master_free_update_in_backward,
        bf16_mode=profile.bf16_mode,
    )


def summarize(plan: Plan, trial: TrialResult) -> dict:
    """A trial next to its plan's prediction, per stage and memory category (reports, calibration)."""
    stages = []
    for sp, st in zip(plan.stages, trial.stages):
        stages.append({
            "stage": st.stage,
            "layers": list(sp.layers),
            "formats": sp.formats,
            "recompute": sp.recompute,
            "keep_last": sp.keep_last,
            "predicted_memory": coarse(sp.memory),
            "predicted_memory_total": sp.peak_memory,
            "measured_memory": dict(st.memory),
            "device_max_allocated": st.device_max_allocated,
            "predicted_time_per_microbatch": sp.time_per_microbatch,
            "measured_instructions_per_step": dict(st.instructions),
        })
    return {
        "predicted_step_time": plan.predicted_step_time,
        "measured_step_time": trial.step_time,
        "step_times": list(trial.step_times),
        "samples_per_second": plan.global_batch / trial.step_time,
        "val_loss": trial.val_loss,
        "stages": stages,
        "peak_memory": trial.peak_memory,
        "wire": trial.wire,
    }


def _budget_limit(settings) -> float | None:
    b = settings.memory_budget
    return None if b is None else b * (1 + settings.memory_tolerance)


def may_fit(settings, plan: Plan) -> bool:
    """Whether a stock candidate is worth measuring: its predicted peak within the limit its measured
    peak is held to (``memory_budget * (1 + memory_tolerance)``). The stock search is as generous as
    the measurement: a configuration the model puts a little over the budget may still fit."""
    limit = _budget_limit(settings)
    return limit is None or all(sp.peak_memory <= limit for sp in plan.stages)


def over_budget(settings, run: dict) -> list[str]:
    """Why a measured run breaks the memory budget: one line per stage whose measured peak exceeds
    ``memory_budget * (1 + memory_tolerance)``.

    Args:
        settings: the ``ppq.autotune`` settings (``AutotuneConfig``).
        run: a measured run (``summarize``), with ``run["stages"][i]["measured_memory"]["total"]``.

    Returns:
        The stages over the limit, as messages; empty without a budget or when every stage fits.
    """
    limit = _budget_limit(settings)
    if limit is None:
        return []
    return [f"stage {st['stage']} measured {fmt_mib(st['measured_memory']['total'])} > "
            f"{fmt_mib(limit)} (budget {fmt_mib(settings.memory_budget)} + "
            f"{settings.memory_tolerance:.0%})"
            for st in run["stages"] if st["measured_memory"]["total"] > limit]


def back_off(plan: Plan, problem: PlanningProblem) -> str | None:
    """Make the next plan more conservative; returns what changed, or None if nothing is left.

    Order: master-free weights get their fp32 masters back; then the most sensitive layer (largest
    weight error) loses its low-bit format; then the most aggressive codec goes."""
    if plan.master_free and True in problem.master_free:
        problem.master_free = [False]
        return "master-free weights removed: low-bit layers keep an fp32 master again"
    layers = problem.layers
    quantized = [(layers[i].quant_error.get(f, 0.0), i, f) for i, f in enumerate(plan.layer_formats)
                 if f != "none"]
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


def is_stock_configuration(plan: Plan, partitions: dict[int, dict[str, list[int]]]) -> bool:
    """Whether stock DeepSpeed could run ``plan`` as it is: training-dtype weights, no codecs, no
    master-free weights, recomputation of every layer on every stage or none, and boundaries one of its
    partition methods gives (``partitions``: degree -> method -> boundaries)."""
    rec = {(s.recompute, s.keep_last) for s in plan.stages}
    return (all(f == "none" for f in plan.layer_formats) and not plan.master_free
            and rec in ({(False, 0)}, {(True, 0)})
            and plan.activation_codec == {"method": "none"} and plan.gradient_codec == {"method": "none"}
            and plan.boundaries in partitions.get(plan.pipeline_degree, {}).values())


def same_configuration(a: Plan, b: Plan) -> bool:
    """Whether two plans run the same: partition, micro-batches, formats, recomputation, optimizer,
    master-free weights and codecs (predictions and notes aside)."""
    def key(p: Plan):
        return (p.boundaries, p.micro_batch_size, p.num_microbatches, p.layer_formats,
                [(s.recompute, s.keep_last) for s in p.stages], p.optimizer_8bit, p.master_free,
                p.activation_codec, p.gradient_codec, p.schedule)

    return key(a) == key(b)


@dataclasses.dataclass
class _Tuning:
    """What one tuning run's steps share: the runner and settings, the model's fingerprint and profile,
    and the log (every rank keeps the same one)."""

    runner: TuningRunner
    settings: Any
    global_batch: int
    fingerprint: dict = dataclasses.field(default_factory=dict)
    profile: Profile | None = None
    log: list[str] = dataclasses.field(default_factory=list)

    def note(self, msg: str) -> None:
        self.log.append(msg)
        self.runner.log(msg)

    def stamp(self, plan: Plan) -> None:
        """What a plan records of the model and the machine it was made on, and the user's budget: the
        planner's own budget may be wider (a memory probe) or held back (after a plan measured over it),
        but the plan is made for, and measured against, the budget the user set."""
        plan.model_fingerprint = self.fingerprint
        plan.memory_budget = self.settings.memory_budget
        plan.threads_per_rank = self.profile.threads_per_rank

    def problem(self) -> PlanningProblem:
        """The planning problem afresh from the profile (uncalibrated)."""
        return build_problem(self.settings, self.runner.world_size, self.global_batch, self.profile)

    def timed(self, plan: Plan) -> float:
        """One timing-only trial of ``plan``: its step time."""
        return self.runner.run_trial(plan, self.settings, seed=0, timing_only=True).step_time

    def quality(self, plan: Plan, seed: int) -> float:
        """Validation loss after ``quality_steps`` steps (timing trials are too short for quality)."""
        steps = self.settings.quality_steps
        return self.runner.run_trial(plan, self.settings, seed=seed, steps=steps).val_loss

    def measure(self, problem: PlanningProblem, plan: Plan, quality: bool = False) -> tuple[dict, list[str]]:
        """A plan's trial beside its prediction and simulation, and why it breaks the budget (empty when it
        fits); with ``quality``, a plan within the budget also gets its quality run's validation loss."""
        run = summarize(plan, self.runner.run_trial(plan, self.settings, seed=0))
        run["simulated"] = simulate_plan(problem, plan)
        over = over_budget(self.settings, run)
        if quality and not over:
            run["quality_val_loss"] = self.quality(plan, 0)
        return run, over


@dataclasses.dataclass
class _StockSearch:
    """The stock search's outcome: the problem with its models fitted to the stock trials, what was
    predicted and measured, and the baseline (``best``; when none fits, the smallest measured)."""

    problem: PlanningProblem
    partitions: dict[int, dict[str, list[int]]]
    candidates: list[Plan]
    measured: list[dict]
    runs: list[tuple[Plan, dict]]
    time_cal: dict
    mem_cal: dict
    best: dict
    fits: bool


def _search_stock(t: _Tuning, problem: PlanningProblem) -> _StockSearch:
    """Step 2: the stock configurations measured best-first, the models refitted after each trial (a
    configuration that turned out too big takes the ones the model now says are too big with it), then the
    stock final among the fastest that fit."""
    settings = t.settings
    partitions = {p: t.runner.stock_partitions(p) for p in problem.degrees()}
    cands = stock_candidates(problem, partitions, optimizer_8bit=settings.optimizer_8bit)
    if not any(may_fit(settings, c) for c in cands):
        try:
            plan_pipeline(problem)
        except InfeasibleBudgetError as e:
            raise InfeasibleBudgetError(f"no configuration fits: {e}") from None
        t.note(f"no stock configuration is predicted to fit memory_budget={settings.memory_budget} B "
               f"({fmt_mib(settings.memory_budget)}) per stage (the smallest needs "
               f"{fmt_mib(min(max(sp.peak_memory for sp in c.stages) for c in cands))}), a low-bit plan is")
    measured: list[dict] = []
    runs: list[tuple[Plan, dict]] = []
    tried: set[str] = set()
    time_cal: dict = {}
    mem_cal: dict = {}
    stop = "every stock candidate the model says fits was measured"

    def measure_stock(plan: Plan) -> None:
        nonlocal problem, time_cal, mem_cal
        tried.add(plan.notes[0])
        t.stamp(plan)
        run = summarize(plan, t.runner.run_trial(plan, settings, seed=0))
        over = over_budget(settings, run)
        measured.append({"plan": plan.to_dict(), "run": run, "fits": not over, "over": over})
        runs.append((plan, run))
        t.note(f"{plan.notes[0]}: predicted {plan.predicted_step_time * 1e3:.1f} ms, measured "
               f"{run['measured_step_time'] * 1e3:.1f} ms, peak {fmt_mib(run['peak_memory'])} (predicted "
               f"{fmt_mib(max(sp.peak_memory for sp in plan.stages))})"
               + (f" -- over budget: {'; '.join(over)}" if over else ""))
        # the next pick is ranked by the models refitted to every trial so far
        problem = t.problem()
        time_cal, mem_cal = calibrate.calibrate_time(problem, runs), calibrate.calibrate_memory(problem, runs)

    while len(measured) < _STOCK_TRIAL_CAP * settings.stock_trials:
        cands = stock_candidates(problem, partitions, optimizer_8bit=settings.optimizer_8bit)
        plan = next((c for c in cands if may_fit(settings, c) and c.notes[0] not in tried), None)
        if plan is None:
            break
        done = [m["run"]["measured_step_time"] for m in measured if m["fits"]]
        t_next = plan.predicted_step_time
        if len(done) >= settings.stock_trials and not settings.stock_margin:
            stop = f"stock_margin=0: {settings.stock_trials} that fit measured, no more"
            break
        if len(done) >= settings.stock_trials and t_next > min(done) * (1 + settings.stock_margin):
            stop = (f"the next candidate ({plan.notes[0]}) is predicted {t_next * 1e3:.1f} ms, more than "
                    f"{settings.stock_margin:.0%} over the best measured ({min(done) * 1e3:.1f} ms)")
            break
        measure_stock(plan)
    else:
        stop = f"{len(measured)} stock trials, the cap ({_STOCK_TRIAL_CAP} x stock_trials)"
    t.note(f"stock search: {len(measured)} configurations measured; stopped: {stop}")
    fit_times = [m["run"]["measured_step_time"] for m in measured if m["fits"]]
    probe = _stock_probe(settings, cands, tried, fit_times)
    if probe is not None:
        t.note(f"stock memory probe (predicted over the budget, within {MEMORY_PROBE:.0%} of it, and faster "
               "than the best measured):")
        measure_stock(probe)
    fits = [m for m in measured if m["fits"]]
    smallest = min(cands, key=lambda c: max(sp.peak_memory for sp in c.stages))
    if not fits and smallest.notes[0] not in tried:
        # none fits: the configuration the model puts smallest is measured too (the refitted model can
        # have put it over the budget after a larger one measured over: at the budget where only
        # micro-batch 1 fits, by its own measured peak, it was never run); it fits, or it is the quality
        # reference
        measure_stock(smallest)
        fits = [m for m in measured if m["fits"]]
    if fits:
        # the global batch is the same for every candidate: the fastest step is the most samples per second
        best = _stock_final(t, fits)
        t_best = statistics.median(best.get("final_step_times", [best["run"]["measured_step_time"]]))
        t.note(f"baseline (best measured stock): {best['plan']['notes'][0]}, {t_best * 1e3:.1f} ms")
    else:
        # stock DeepSpeed cannot train at this budget: the stock configuration with the smallest measured
        # peak (run over the budget) is the quality reference; no speedup can be claimed over it
        best = min(measured, key=lambda m: m["run"]["peak_memory"])
        t.note(f"stock DeepSpeed cannot train at this budget: the smallest measured stock configuration, "
               f"{best['plan']['notes'][0]}, peaks at {fmt_mib(best['run']['peak_memory'])} "
               f"({'; '.join(best['over'])}); it is the quality reference, run over the budget")
    return _StockSearch(problem, partitions, cands, measured, runs, time_cal, mem_cal, best, bool(fits))


def _stock_probe(settings, cands: list[Plan], tried: set[str], fit_times: list[float]) -> Plan | None:
    """The stock configuration the search measures beyond what the model says fits, as the tuned plans
    get ``_memory_probe``: the fastest predicted one not yet measured that the model puts over the limit
    (``may_fit``) but within ``MEMORY_PROBE`` of the budget, when it is predicted faster than the best
    measured. A skilled user tries the faster setting that may just fit; the model's prediction misses a
    measured peak by several percent either way."""
    if settings.memory_budget is None or not fit_times:
        return None
    wider = settings.memory_budget * (1 + MEMORY_PROBE)
    nxt = next((c for c in cands if c.notes[0] not in tried and not may_fit(settings, c)
                and all(sp.peak_memory <= wider for sp in c.stages)), None)  # the fastest first
    return nxt if nxt is not None and nxt.predicted_step_time < min(fit_times) else None


def _stock_final(t: _Tuning, fits: list[dict]) -> dict:
    """The best stock configuration among those that fit (``fits``: measured stock trials), by repeated
    trials: every one whose first trial came within ``stock_margin`` of the fastest is timed
    ``ab_repeats`` more times, the candidates alternating, and the lowest median wins (a single trial
    per candidate picked the baseline by the machine's noise: an 8-bit Adam configuration "beat" the same
    schedule with fp32 Adam, whose optimizer step is ~3x cheaper). Each finalist's entry keeps its
    ``final_step_times``."""
    settings = t.settings
    fastest = min(m["run"]["measured_step_time"] for m in fits)
    close = [m for m in fits if m["run"]["measured_step_time"] <= fastest * (1 + settings.stock_margin)]
    if len(close) < 2 or not settings.ab_repeats:
        return min(fits, key=lambda m: m["run"]["measured_step_time"])
    for m in close:
        m["final_step_times"] = [m["run"]["measured_step_time"]]
    for _ in range(settings.ab_repeats):
        for m in close:
            m["final_step_times"].append(t.timed(Plan.from_dict(m["plan"])))
    best = min(close, key=lambda m: statistics.median(m["final_step_times"]))
    t.note(f"stock final: the {len(close)} configurations within {settings.stock_margin:.0%} of the fastest, "
           f"each timed {1 + settings.ab_repeats} times, alternating (median ms): "
           + "; ".join(f"{m['plan']['notes'][0].removeprefix('stock: ')} "
                       f"{statistics.median(m['final_step_times']) * 1e3:.1f}" for m in close))
    return best


def _plan_and_measure(t: _Tuning, problem: PlanningProblem, gate) -> tuple[list[dict], tuple | None]:
    """Steps 4-5: plan, measure, decide, until a plan fits its budget (measured) and passes the quality
    gate, or ``max_iterations`` are spent. Over the budget: the memory model recalibrated on the plan and
    what it still misses held back from the planner's budget; outside the gate: ``back_off``.

    Returns:
        The iterations (plan, run, verdict each) and the accepted ``(plan, run)``, or None.
    """
    iterations: list[dict] = []
    for it in range(t.settings.max_iterations):
        try:
            plan = plan_pipeline(problem)
        except InfeasibleBudgetError as e:
            # what an over-budget plan's trial held back left no plan: hold back only down to the
            # smallest plan the recalibrated model has (the most frugal one, the likeliest to fit)
            budget = t.settings.memory_budget
            if not iterations or e.need is None or budget is None or e.need > budget:
                raise
            t.note(f"the budget held back ({fmt_mib(problem.memory_budget)}) leaves no plan; planning at "
                   f"the smallest the model has, {fmt_mib(e.need)}")
            problem.memory_budget = int(math.ceil(e.need))
            plan = plan_pipeline(problem)
        t.stamp(plan)
        run, over = t.measure(problem, plan, quality=True)
        ok_q, why = _gate_check(gate, run.get("quality_val_loss", run["val_loss"]))
        rec = {"iteration": it, "plan": plan.to_dict(), "run": run, "over_budget": over,
               "quality": why, "accepted": ok_q and not over}
        t.note(f"iteration {it}: boundaries {plan.boundaries}, micro-batch {plan.micro_batch_size} x "
               f"{plan.num_microbatches}, formats {sorted(set(plan.layer_formats))}, 8-bit Adam "
               f"{plan.optimizer_8bit}, master-free {plan.master_free}, codecs "
               f"{plan.activation_codec.get('method')}/{plan.gradient_codec.get('method')}: predicted "
               f"{plan.predicted_step_time * 1e3:.1f} ms, measured {run['measured_step_time'] * 1e3:.1f} ms, "
               f"peak {fmt_mib(run['peak_memory'])}; {why}")
        iterations.append(rec)
        if over:
            rec["back_off"] = "memory recalibrated: " + json.dumps(
                calibrate.calibrate_memory(problem, [(plan, run)]))
            # what the recalibrated model still misses of this plan's peak (the activations of a stage
            # with recomputation are not refitted) is held back from the planner's budget, so the next
            # plan is not the same one again
            again = calibrate.predict(problem, plan)["memory"]
            miss = max(st["measured_memory"]["total"] - sum(m.values())
                       for st, m in zip(run["stages"], again))
            if miss > 0:
                problem.memory_budget = int(problem.memory_budget - miss)
                rec["back_off"] += f"; {fmt_mib(miss)} held back from the planner's budget"
            t.note(f"over budget: {'; '.join(over)}; memory recalibrated"
                   + (f", {fmt_mib(miss)} the model still misses held back" if miss > 0 else "")
                   + ", planning again")
            continue
        if ok_q:
            return iterations, (plan, run)
        change = back_off(plan, problem)
        rec["back_off"] = change
        if change is None:
            t.note("quality gate failed and nothing is left to back off")
            break
        t.note(f"quality gate failed: back off: {change}")
    return iterations, None


RUNNER_UP_WITHIN = 0.25  # a runner-up predicted this much slower than the accepted plan is still measured
MEMORY_PROBE = 0.10  # plans predicted up to this much over the planner's budget are measured too
# the challengers of an accepted plan: their record's key -> (name, what they try)
CHALLENGERS = {"runner_up": ("runner-up", "another schedule"),
               "memory_probe": ("memory probe", "predicted over the budget")}


def _challenge(t: _Tuning, problem: PlanningProblem, accepted: tuple, alt: Plan, gate, iterations: list[dict],
               kind: str) -> tuple:
    """Measure ``alt`` against the accepted plan: it replaces it when it fits the budget by its measured
    peak, runs faster and passes the quality gate. ``kind`` names the challenger in the log and marks
    its record (``runner_up`` or ``memory_probe``)."""
    plan, run = accepted
    t.stamp(alt)
    alt_run, over = t.measure(problem, alt)
    faster = not over and alt_run["measured_step_time"] < run["measured_step_time"]
    if faster:
        alt_run["quality_val_loss"] = t.quality(alt, 0)
    ok_q, why = _gate_check(gate, alt_run.get("quality_val_loss", alt_run["val_loss"]))
    keep = faster and ok_q
    rec = {"iteration": len(iterations), "plan": alt.to_dict(), "run": alt_run, "over_budget": over,
           "quality": why, "accepted": keep, kind: True}
    name, what = CHALLENGERS[kind]
    if keep:  # the plan accepted before gives way
        for r in iterations:
            if r["accepted"]:
                r.update(accepted=False, back_off=f"the {name} ran faster")
    else:
        rec["back_off"] = f"{name}: " + ("over budget" if over else "quality gate" if faster else "slower")
    iterations.append(rec)
    t.note(f"{name} ({what}): micro-batch {alt.micro_batch_size} x {alt.num_microbatches} on "
           f"{alt.pipeline_degree} stage(s), formats {sorted(set(alt.layer_formats))}, 8-bit Adam "
           f"{alt.optimizer_8bit}, recompute {alt.recompute_label}: "
           f"predicted {alt.predicted_step_time * 1e3:.1f} ms, measured "
           f"{alt_run['measured_step_time'] * 1e3:.1f} ms against {run['measured_step_time'] * 1e3:.1f} ms, "
           f"peak {fmt_mib(alt_run['peak_memory'])}"
           + ("; over budget" if over else "") + (f"; {why}" if faster else "")
           + ("; it replaces the accepted plan" if keep else "; the accepted plan stays"))
    return (alt, alt_run) if keep else accepted


def _runner_up(t: _Tuning, problem: PlanningProblem, accepted: tuple, gate, iterations: list[dict]) -> tuple:
    """Measure the best plan of another schedule (pipeline degree, micro-batch size) than the accepted
    one when the model predicts it within ``RUNNER_UP_WITHIN`` of it: the calibration is fitted to a few
    noisy stock trials, and a wrong slope or per-micro-batch cost ranks schedules wrongly. The faster of
    the two measured plans that fits and passes the quality gate is kept."""
    plan, _ = accepted
    try:
        alt = plan_pipeline(problem, exclude=frozenset({(plan.pipeline_degree, plan.micro_batch_size)}))
    except InfeasibleBudgetError:
        return accepted
    if alt.predicted_step_time > plan.predicted_step_time * (1 + RUNNER_UP_WITHIN):
        return accepted
    return _challenge(t, problem, accepted, alt, gate, iterations, "runner_up")


def _memory_probe(t: _Tuning, problem: PlanningProblem, accepted: tuple, gate,
                  iterations: list[dict]) -> tuple:
    """Measure the best plan under a budget ``MEMORY_PROBE`` larger than the planner's when it is predicted
    faster than the accepted plan: the budget binds on the measured peak, and the memory model errs by
    several percent either way per run (its activation scales are fitted to the few stock trials that run
    measured), so a plan predicted just over the budget may fit it. In the fine-tuning sweep a plan that
    measured 26.6 MiB was predicted over a 27 MiB budget (+5% tolerance) in one run and chosen at 25.5 MiB
    in another, 1.2x faster than the plan the 27 MiB run kept."""
    plan, _ = accepted
    if problem.memory_budget is None:
        return accepted
    wider = dataclasses.replace(problem, memory_budget=int(problem.memory_budget * (1 + MEMORY_PROBE)))
    try:
        alt = plan_pipeline(wider)
    except InfeasibleBudgetError:
        return accepted
    if same_configuration(alt, plan) or alt.predicted_step_time >= plan.predicted_step_time:
        return accepted
    return _challenge(t, problem, accepted, alt, gate, iterations, "memory_probe")


@dataclasses.dataclass
class _Outcome:
    """What the tuning run hands the user: the plan to run (``chosen``), the verdict, the A/B times, and the
    baseline as it finally stands (a tuned plan that is itself a stock configuration and won the A/B
    replaces it)."""

    chosen: Plan
    outcome: str
    ab: dict
    base: Plan
    base_run: dict


def _plan_alone(t: _Tuning, stock: _StockSearch, accepted: tuple) -> _Outcome:
    """Stock DeepSpeed cannot train at this budget: the accepted plan is the outcome, timed
    ``ab_repeats`` more times (its time is what the user's run sees); no speedup is claimed. The baseline
    stays the smallest stock configuration, run over the budget: the quality reference."""
    plan, run = accepted
    ab = {"baseline": [], "tuned": [run["measured_step_time"]]}
    for _ in range(t.settings.ab_repeats):
        ab["tuned"].append(t.timed(plan))
    plan.measured_step_time = statistics.median(ab["tuned"])
    plan.measured_memory = [st["measured_memory"] for st in run["stages"]]
    t.note(f"accepted: stock DeepSpeed cannot train at this budget; the plan trains at "
           f"{plan.measured_step_time * 1e3:.1f} ms per step (median of {len(ab['tuned'])}), peak "
           f"{fmt_mib(run['peak_memory'])}")
    return _Outcome(plan, "stock_does_not_fit", ab, Plan.from_dict(stock.best["plan"]), stock.best["run"])


def _against_stock(t: _Tuning, stock: _StockSearch, accepted: tuple | None) -> _Outcome:
    """The accepted plan against the best stock configuration: ``ab_repeats`` alternating trials of each
    (load drifts hit both alike), the speedup the ratio of the medians. A plan identical to the baseline, a
    plan that is itself a stock configuration, or one no faster claims nothing."""
    settings = t.settings
    base, base_run = Plan.from_dict(stock.best["plan"]), stock.best["run"]
    first = stock.best.get("final_step_times", [base_run["measured_step_time"]])
    ab = {"baseline": list(first), "tuned": []}
    same = accepted is not None and same_configuration(accepted[0], base)
    if same:
        t.note("the tuned plan is the best stock configuration itself: nothing to gain over it")
    if accepted is None or same:  # every trial of the configuration, the accepted iteration's too
        base.measured_step_time = statistics.median(
            ab["baseline"] + ([accepted[1]["measured_step_time"]] if same else []))
        base.measured_memory = [st["measured_memory"] for st in base_run["stages"]]
        return _Outcome(base, "baseline", ab, base, base_run)
    plan, run = accepted
    if settings.ab_repeats:  # alternate, and compare only these
        ab = {"baseline": [], "tuned": []}
        for _ in range(settings.ab_repeats):
            ab["baseline"].append(t.timed(base))
            ab["tuned"].append(t.timed(plan))
    else:  # the first measurements, taken at different times
        ab = {"baseline": [base_run["measured_step_time"]], "tuned": [run["measured_step_time"]]}
    t_base, t_tuned = statistics.median(ab["baseline"]), statistics.median(ab["tuned"])
    # what the user's run should see: every trial of this plan (the speedup compares the A/B alone)
    plan.measured_step_time = statistics.median(
        ab["tuned"] + ([run["measured_step_time"]] if settings.ab_repeats else []))
    plan.measured_memory = [st["measured_memory"] for st in run["stages"]]
    if is_stock_configuration(plan, stock.partitions):
        # a configuration the stock search could have picked: the A/B only corrects its noisy pick
        verdict = "faster" if t_tuned < t_base else "slower"
        t.note(f"the tuned plan is itself a stock configuration ({verdict} in the A/B: "
               f"{t_base * 1e3:.1f} vs {t_tuned * 1e3:.1f} ms): it claims nothing over stock "
               "DeepSpeed; the faster of the two is the best stock configuration")
        if t_tuned < t_base:  # it keeps its own measured time (set above), not the old baseline's
            return _Outcome(plan, "baseline", ab, plan, run)
    elif t_tuned < t_base:
        t.note(f"accepted: {t_base / t_tuned:.2f}x samples/s over the best stock configuration "
               f"({t_base * 1e3:.1f} -> {t_tuned * 1e3:.1f} ms)")
        return _Outcome(plan, "tuned", ab, base, base_run)
    else:
        t.note(f"the plan passed the checks but ran no faster than the best stock configuration "
               f"({t_base * 1e3:.1f} vs {t_tuned * 1e3:.1f} ms): the stock configuration is the plan")
    base.measured_step_time = t_base
    base.measured_memory = [st["measured_memory"] for st in base_run["stages"]]
    return _Outcome(base, "baseline", ab, base, base_run)


def _measure_ladder(t: _Tuning, stock: _StockSearch, res: _Outcome, accepted: tuple,
                    seed_losses: list[float]) -> tuple[list[dict], list[str]]:
    """The ladder from the best stock configuration to the tuned plan, each rung measured (a rung the
    previous one equals is left out), then every rung timed ``ab_repeats`` more times, alternating.
    Returns the rungs and, for the report, the rungs left out and why."""
    ladder = [{"rung": "best stock configuration", "plan": res.base.to_dict(),
               "run": {**res.base_run, "quality_val_loss": seed_losses[0]}}]
    left_out = []
    previous = res.base
    for label, rung in ladder_plans(stock.problem, res.base, accepted[0], stock.partitions):
        if same_configuration(rung, previous):  # this feature changes nothing here
            one = " (one stage: no boundary to move)" if rung.pipeline_degree == 1 else ""
            name = label.removesuffix(" (the tuned plan)")
            left_out.append(f"{name}: the same configuration as the rung before it{one}")
            if name != label and len(ladder) > 1:  # the rung before it is the tuned plan
                ladder[-1]["rung"] += " (the tuned plan)"
            continue
        previous = rung
        t.stamp(rung)
        if same_configuration(rung, accepted[0]):  # the tuned plan's own trial and quality run
            run = dict(accepted[1])
        else:
            run = summarize(rung, t.runner.run_trial(rung, t.settings, seed=0))
            run["quality_val_loss"] = t.quality(rung, 0)
        ladder.append({"rung": label, "plan": rung.to_dict(), "run": run})
        t.note(f"ladder: {label}: {run['measured_step_time'] * 1e3:.1f} ms, peak "
               f"{fmt_mib(run['peak_memory'])}, val loss "
               f"{run.get('quality_val_loss', run['val_loss']):.4f}")
    if t.settings.ab_repeats:
        repeat_ladder(t.runner, t.settings, ladder)
        medians = ", ".join(f"{rec['run']['measured_step_time'] * 1e3:.1f}" for rec in ladder)
        t.note(f"ladder: every rung timed {1 + t.settings.ab_repeats} times, the rungs alternating; "
               f"median ms {medians}")
    for rec in ladder:
        rec["bubble"] = measured_bubble(rec["run"])
    codecs = left_out_codecs(accepted[0])
    return ladder, left_out + ([codecs] if codecs else [])


class _Gate:
    """Validation loss of a plan against a baseline measured over fewer than ``gate.MIN_SEEDS`` seeds:
    the relative tolerance alone, with no measure of the noise (quick runs and tests only; reports
    say so)."""

    def __init__(self, losses: list[float], tolerance: float):
        self.losses = list(losses)
        self.mean = statistics.mean(losses)
        self.spread = max(losses) - min(losses) if len(losses) > 1 else 0.0
        self.tolerance = tolerance
        self.limit = self.mean * (1 + tolerance)

    def check(self, loss: float) -> tuple[bool, str]:
        ok = loss <= self.limit
        return ok, (f"val loss {loss:.4f} vs baseline {self.mean:.4f} over {len(self.losses)} seed(s) "
                    f"(noise not measured: fewer than {MIN_SEEDS} seeds), limit {self.limit:.4f}")

    def to_dict(self) -> dict:
        return {"losses": self.losses, "mean": self.mean, "spread": self.spread,
                "tolerance": self.tolerance, "limit": self.limit}


def _make_gate(losses: list[float], tolerance: float):
    if len(losses) < MIN_SEEDS:
        return _Gate(losses, tolerance)
    try:
        return QualityGate(losses, tolerance)
    except ValueError as e:
        raise TuningError(f"the quality gate cannot be built: {e}") from None


def _gate_check(gate, loss: float) -> tuple[bool, str]:
    res = gate.check(loss)
    if isinstance(res, tuple):
        return res
    return bool(res.accepted), str(getattr(res, "reason", res))


def _low_bit_alternative(problem: PlanningProblem, plan: Plan, note) -> dict | None:
    """Why the plan keeps the training dtype, with figures: when it has no low-bit weights though the
    policy allows some, the best plan whose every stage runs low-bit, as the calibrated model predicts it
    (not run), against the same model's prediction for ``plan``."""
    if any(f != "none" for f in plan.layer_formats) or len(problem.levels()) < 2:
        return None
    mine = calibrate.predict(problem, plan)["step_time"]
    try:
        alt = plan_pipeline(dataclasses.replace(problem, low_bit_only=True))
    except InfeasibleBudgetError as e:
        note(f"no plan with low-bit weights on every stage fits the budget: {e}")
        return {"fits": False, "reason": str(e)}
    peak = max(sp.peak_memory for sp in alt.stages)
    note(f"the best plan with low-bit weights on every stage (predicted, not run): p={alt.pipeline_degree} "
         f"{alt.boundaries}, {alt.micro_batch_size} x {alt.num_microbatches}, formats "
         f"{sorted(set(alt.layer_formats))}, 8-bit Adam {alt.optimizer_8bit}, master-free {alt.master_free}, "
         f"recompute {alt.recompute_label}: "
         f"{alt.predicted_step_time * 1e3:.1f} ms, peak {fmt_mib(peak)}, against {mine * 1e3:.1f} ms "
         f"predicted for the plan ({alt.predicted_step_time / mine:.2f}x its time)")
    return {"fits": True, "plan": alt.to_dict(), "predicted_step_time": alt.predicted_step_time,
            "plan_predicted_step_time": mine}


def tune(runner: TuningRunner, settings, global_batch: int) -> dict:
    """Run the loop (see the module docstring) on every rank.

    Args:
        runner: the engine (``TuningRunner``).
        settings: an ``AutotuneConfig``.
        global_batch: samples per optimizer step (``settings.global_batch`` or the engine config's).

    Returns:
        The result: ``fingerprint``, ``profile``, ``stock`` (the search: candidates predicted, the
        ones measured), ``baseline`` (plan, run, seeds), ``calibration``, ``iterations``,
        ``accepted`` (a plan passed memory and quality), ``outcome`` (``"tuned"`` when it also ran
        faster than the baseline, ``"stock_does_not_fit"`` when it is the only configuration that fits,
        else ``"baseline"``), ``stock_fits`` and ``plan`` (the faster of the two, with its
        measurements: what ``plan.json`` holds), ``log``.

    Raises:
        TuningError / InfeasibleBudgetError: nothing fits; the message says the smallest budget that
            would and what fills it.
    """
    t_start = time.perf_counter()
    t = _Tuning(runner, settings, global_batch)
    t.fingerprint = runner.fingerprint()
    t.profile = profile = runner.profile(settings)  # 1. profile
    t.note(f"profile: {len(profile.layers)} layers, link {profile.link.latency_s * 1e6:.0f} us + "
           f"{profile.link.bandwidth_Bps / 1e9:.2f} GB/s, optimizer ns/param "
           + ", ".join(f"{k} {v * 1e9:.2f}" for k, v in profile.optimizer_costs.items()))
    problem = t.problem()
    if len(problem.layers) < min(problem.degrees(), default=1):
        raise TuningError(f"the model has {len(problem.layers)} layers, fewer than the smallest pipeline "
                          f"degree {min(problem.degrees())}")

    stock = _search_stock(t, problem)  # 2. the best stock configuration, measured
    problem, base = stock.problem, Plan.from_dict(stock.best["plan"])
    for plan, run in stock.runs:  # 3. the models as fitted to every measured stock trial
        run["calibrated_step_time"] = calibrate.predict(problem, plan)["step_time"]
    tc, mc = stock.time_cal, stock.mem_cal
    t.note(f"calibration: layer times x{tc['time_scale']:.3f}, engine "
           f"{tc['fixed_per_microbatch_s'] * 1e3:.2f} ms per stage and micro-batch; "
           f"{calibrate.describe_extra(mc['activation_extra_bytes'])}, around the step "
           f"{mc['step_transient_bytes_per_param']:.1f} B/param + {fmt_mib(mc['step_fixed_bytes'])}")

    # quality noise: the baseline over seeds, each trained quality_steps steps
    seed_losses = [t.quality(base, s) for s in range(settings.seeds)]
    gate = _make_gate(seed_losses, settings.val_loss_tolerance)
    t.note(f"baseline val loss after {settings.quality_steps} steps over {settings.seeds} seed(s): "
           + ", ".join(f"{v:.4f}" for v in seed_losses))

    iterations, accepted = _plan_and_measure(t, problem, gate)  # 4-5. plan, measure, decide
    for challenger in (_runner_up, _memory_probe):  # one trial each, after an accepted plan
        if accepted is not None:
            accepted = challenger(t, problem, accepted, gate, iterations)
    lowbit = _low_bit_alternative(problem, accepted[0] if accepted else base, t.note)
    if stock.fits:
        res = _against_stock(t, stock, accepted)
    elif accepted is not None:
        res = _plan_alone(t, stock, accepted)
    else:
        raise TuningError(
            "stock DeepSpeed cannot train at this budget (every stock configuration measured over it: "
            + "; ".join(f"{m['plan']['notes'][0]}: {'; '.join(m['over'])}" for m in stock.measured)
            + ") and no plan passed the checks (see the iterations in the log)")
    ladder, left_out = _measure_ladder(t, stock, res, accepted, seed_losses) if (
        settings.ladder and res.outcome == "tuned") else ([], [])
    return {
        "fingerprint": t.fingerprint,
        "settings": settings.model_dump(mode="json"),
        "world_size": runner.world_size,
        "global_batch": global_batch,
        "profile": profile.to_dict(),
        "stock": {"candidates": [{"notes": c.notes, "predicted_step_time": c.predicted_step_time,
                                  "predicted_peak": max(sp.peak_memory for sp in c.stages),
                                  "fits": may_fit(settings, c)} for c in stock.candidates],
                  "measured": stock.measured},
        "baseline": {"plan": res.base.to_dict(), "run": res.base_run, "seeds": seed_losses},
        "gate": gate.to_dict(),
        "calibration": {"time": stock.time_cal, "memory": stock.mem_cal},
        "iterations": iterations,
        "accepted": accepted is not None,
        "outcome": res.outcome,
        "stock_fits": stock.fits,
        "plan": res.chosen.to_dict(),
        "ab_step_times": res.ab,
        "ladder": ladder,
        "ladder_left_out": left_out,
        "low_bit_alternative": lowbit,
        "log": t.log,
        "seconds": time.perf_counter() - t_start,
    }
