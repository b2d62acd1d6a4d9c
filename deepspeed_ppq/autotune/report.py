"""The tuning loop's outputs: ``plan.json``, ``baseline_plan.json``, ``tune.json`` and ``report.md``.

The report opens with the result (samples/s against the best measured stock configuration, the
quality gate), then the stock search, then each plan stage by stage: predicted against measured
time and peak memory per category (``memory.CATEGORIES``), against the budget.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from deepspeed_ppq.autotune.calibrate import describe_extra
from deepspeed_ppq.autotune.ladder import left_out_lines, stage_compute
from deepspeed_ppq.autotune.loop import CHALLENGERS
from deepspeed_ppq.autotune.memory import CATEGORIES, MIB
from deepspeed_ppq.autotune.plan import Plan

__all__ = ["format_report", "write_outputs", "memory_errors"]


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:.2f}"


def _pct(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas:+.1%}" if meas else "-"


def _plan_section(title: str, plan: dict, run: dict, budget: int | None) -> list[str]:
    p = Plan.from_dict(plan)
    out = [f"## {title}", ""]
    out.append(f"- boundaries {p.boundaries}, micro-batch {p.micro_batch_size} x {p.num_microbatches} "
               f"(global batch {p.global_batch}), schedule {p.schedule}")
    out.append(f"- weights {sorted(set(p.layer_formats))}, master-free {p.master_free}, 8-bit Adam "
               f"{p.optimizer_8bit}, recompute {' / '.join(s.recompute_label for s in p.stages)}")
    out.append(f"- codecs: activations {p.activation_codec}, gradients {p.gradient_codec}")
    t_meas = run["measured_step_time"]
    line = (f"- step time: predicted {p.predicted_step_time * 1e3:.1f} ms, measured {t_meas * 1e3:.1f} ms "
            f"({_pct(p.predicted_step_time, t_meas)})")
    if "calibrated_step_time" in run:
        line += f"; calibrated {run['calibrated_step_time'] * 1e3:.1f} ms"
    out.append(line)
    q = run.get("quality_val_loss")
    out.append(f"- validation loss {run['val_loss']:.4f} after the timing trial"
               + (f", {q:.4f} after the quality run" if q is not None else ""))
    out += ["", f"Peak memory per stage, MiB (predicted / measured; budget {_mib(budget)}):", "",
            "| stage | layers | " + " | ".join(CATEGORIES) + " | total | error |",
            "|---|---|" + "---|" * (len(CATEGORIES) + 2)]
    for st in run["stages"]:
        pm, mm = st["predicted_memory"], st["measured_memory"]
        cells = [f"{_mib(pm.get(c, 0))} / {_mib(mm.get(c, 0))}" for c in CATEGORIES]
        tot_p, tot_m = st["predicted_memory_total"], mm["total"]
        out.append(f"| {st['stage']} | {st['layers'][0]}-{st['layers'][1] - 1} | " + " | ".join(cells)
                   + f" | {_mib(tot_p)} / {_mib(tot_m)} | {_pct(tot_p, tot_m)} |")
    out += ["", "Time per stage and step, ms (measured engine instructions):", "",
            "| stage | predicted per micro-batch | ForwardPass | BackwardPass | OptimizerStep | send/recv |",
            "|---|---|---|---|---|---|"]
    for st in run["stages"]:
        ins = st["measured_instructions_per_step"]
        comm = sum(v for k, v in ins.items() if k.startswith(("Send", "Recv")))
        out.append(f"| {st['stage']} | {st['predicted_time_per_microbatch'] * 1e3:.2f} | "
                   f"{ins.get('ForwardPass', 0) * 1e3:.1f} | {ins.get('BackwardPass', 0) * 1e3:.1f} | "
                   f"{ins.get('OptimizerStep', 0) * 1e3:.1f} | {comm * 1e3:.1f} |")
    return out + [""]


def memory_errors(result: dict) -> dict[str, list[float]]:
    """|predicted - measured| / measured of every stage's peak: ``before`` calibration (the stock
    trials, each predicted with what the earlier ones taught) and ``after`` (the plans and the ladder)."""
    def errs(runs):
        seen, out = set(), []
        for run in runs:
            key = tuple(run["step_times"])  # the ladder's last rung is the accepted iteration's run
            if key not in seen:
                seen.add(key)
                out += [abs(st["predicted_memory_total"] - m) / m
                        for st in run["stages"] if (m := st["measured_memory"]["total"])]
        return out

    before = errs(m["run"] for m in result["stock"]["measured"])
    after = errs([r["run"] for r in result["iterations"]] + [r["run"] for r in result.get("ladder", [])[1:]])
    return {"before": before, "after": after}


def format_report(result: dict) -> str:
    """Markdown report of a ``loop.tune`` result."""
    s = result["settings"]
    budget = s.get("memory_budget")
    base = result["baseline"]
    ab = result["ab_step_times"]
    lines = ["# ppq tune report", ""]
    fp = result["fingerprint"]
    lines.append(f"Model: {fp['num_layers']} layers (fingerprint {fp['digest']}), world size "
                 f"{result['world_size']}, global batch {result['global_batch']}, budget "
                 f"{_mib(budget)} MiB per stage (+{s['memory_tolerance']:.0%} tolerance, measured peak).")
    lines.append("")
    if result.get("outcome") == "tuned":
        t_base, t_tuned = statistics.median(ab["baseline"]), statistics.median(ab["tuned"])
        lines.append(f"**Result: {t_base / t_tuned:.2f}x samples/s** over the best measured stock DeepSpeed "
                     f"configuration ({t_base * 1e3:.1f} -> {t_tuned * 1e3:.1f} ms per step, medians of "
                     f"{len(ab['baseline'])} and {len(ab['tuned'])} alternating runs).")
    elif result.get("outcome") == "stock_does_not_fit":
        ref = base["run"]
        lines.append(f"**Stock DeepSpeed cannot train at this budget**: the smallest stock configuration "
                     f"measured a peak of {_mib(ref['peak_memory'])} MiB per stage; the plan trains at "
                     f"{statistics.median(ab['tuned']) * 1e3:.1f} ms per step (median of {len(ab['tuned'])} "
                     "runs) within the budget. No speedup is claimed: there is no stock run to compare "
                     "with. The quality gate's reference is that smallest stock configuration, run over the "
                     "budget.")
    elif result["accepted"]:
        lines.append("**No gain over stock DeepSpeed**: the plan that passed the checks is a stock "
                     "configuration or ran no faster than the best one (see the log); plan.json holds the "
                     "best stock configuration.")
    else:
        lines.append("**No plan passed the checks** (see the iterations); plan.json holds the best stock "
                     "configuration.")
    if result.get("ladder"):
        t0 = result["ladder"][0]["run"]["measured_step_time"]
        n = len(result["ladder"][0]["run"].get("repeat_step_times", [t0]))
        timing = f"the median of {n} trials, the rungs alternating" if n > 1 else "one trial"
        lines += ["", "## The ladder: one feature at a time", "",
                  f"Each rung is {timing} (the result above is the A/B of the baseline and the plan, timed "
                  "apart, so it and the rungs differ by the machine's timing noise).", "",
                  "Forward + backward ms per stage: the compute each stage does per step (recomputation "
                  "included), apart from the bubble; low-bit weights change it by their dequantization, "
                  "the fill by the micro-batch size and recomputation.", "",
                  "| rung | samples/s | vs stock | bubble | forward + backward ms per stage "
                  "| peak MiB per stage | val loss | configuration |",
                  "|---|---|---|---|---|---|---|---|"]
        for rec in result["ladder"]:
            run, plan = rec["run"], Plan.from_dict(rec["plan"])
            peaks = " / ".join(_mib(st["measured_memory"]["total"]) for st in run["stages"])
            conf = (f"p={plan.pipeline_degree} {plan.boundaries}, "
                    f"{plan.micro_batch_size}x{plan.num_microbatches}, "
                    f"{'/'.join(sorted(set(plan.layer_formats)))}"
                    f"{', master-free' if plan.master_free else ''}"
                    f"{', 8-bit Adam' if plan.optimizer_8bit else ''}, recompute "
                    f"{plan.recompute_label}, codecs "
                    f"{plan.activation_codec.get('method')}/{plan.gradient_codec.get('method')}")
            compute = " / ".join(f"{t * 1e3:.0f}" for t in stage_compute(run))
            lines.append(f"| {rec['rung']} | {run['samples_per_second']:.1f} | "
                         f"{t0 / run['measured_step_time']:.2f}x | {rec['bubble']:.1%} | {compute} | "
                         f"{peaks} | {run.get('quality_val_loss', run['val_loss']):.4f} | {conf} |")
    if result.get("ladder"):
        lines += ["", *left_out_lines(result.get("ladder_left_out", []))]
    g = result["gate"]
    lines += ["", f"Quality gate: baseline validation loss {g.get('mean', 0):.4f} over "
              f"{len(g.get('losses', []))} seed(s), spread {g.get('spread', 0):.4f}, limit "
              f"{g.get('limit', 0):.4f}.", ""]
    lines += ["## Stock search (what a DeepSpeed user can set)", "",
              "| configuration | predicted ms | predicted peak MiB | measured ms | repeated (median ms) "
              "| measured peak MiB | fits |",
              "|---|---|---|---|---|---|---|"]
    measured = {m["plan"]["notes"][0]: m for m in result["stock"]["measured"]}
    # every measured configuration, then the fastest predicted of the others, to 12 rows
    cands = result["stock"]["candidates"]
    rows = [c for c in cands if c["notes"][0] in measured]
    rows += [c for c in cands if c["notes"][0] not in measured][: max(0, 12 - len(rows))]
    stop = next((x for x in result.get("log", []) if x.startswith("stock search:")), None)
    final = next((x for x in result.get("log", []) if x.startswith("stock final:")), None)
    for x in (stop, final):
        if x:
            lines[-2:-2] = [f"{x[0].upper()}{x[1:]}.", ""]

    def repeated(m: dict) -> str:  # the stock final's median, where the configuration was a finalist
        return f"{statistics.median(m['final_step_times']) * 1e3:.1f}" if "final_step_times" in m else "-"

    for c in rows:
        m = measured.get(c["notes"][0])
        lines.append(f"| {c['notes'][0].removeprefix('stock: ')} | {c['predicted_step_time'] * 1e3:.1f} | "
                     f"{_mib(c['predicted_peak'])} | "
                     + (f"{m['run']['measured_step_time'] * 1e3:.1f} | {repeated(m)} | "
                        f"{_mib(m['run']['peak_memory'])} | {'yes' if m['fits'] else 'no'} |" if m
                        else f"- | - | - | {'(yes)' if c['fits'] else 'no'} |"))
    lines.append("")
    title = ("Baseline: the best measured stock configuration" if result.get("stock_fits", True) else
             "Quality reference: the stock configuration with the smallest measured peak (over the budget)")
    lines += _plan_section(title, base["plan"], base["run"], budget)
    for rec in result["iterations"]:
        verdict = "accepted" if rec["accepted"] else f"rejected ({rec.get('back_off') or 'over budget'})"
        kind = next((k for k in CHALLENGERS if rec.get(k)), None)
        what = f"{CHALLENGERS[kind][0].capitalize()} ({CHALLENGERS[kind][1]})" if kind else "Iteration"
        lines += _plan_section(f"{what} {rec['iteration']}: {verdict}", rec["plan"], rec["run"], budget)
        lines += [f"Quality: {rec['quality']}", ""]
    errs = memory_errors(result)
    if errs["after"]:
        lines += [f"Memory model: predicted vs measured peak per stage, |error| median "
                  f"{statistics.median(errs['after']):.1%}, max {max(errs['after']):.1%} over "
                  f"{len(errs['after'])} stage measurements after calibration (before: median "
                  f"{statistics.median(errs['before']):.1%}, max {max(errs['before']):.1%} over "
                  f"{len(errs['before'])}).", ""] if errs["before"] else []
    cal = result["calibration"]
    lines += ["## Calibration", "",
              f"- layer times x{cal['time']['time_scale']:.3f}, engine "
              f"{cal['time']['fixed_per_microbatch_s'] * 1e3:.2f} ms per stage and micro-batch, link latency "
              f"{cal['time']['link_latency_s'] * 1e6:.0f} us",
              f"- {describe_extra(cal['memory']['activation_extra_bytes'])}; around the "
              f"optimizer step {cal['memory']['step_transient_bytes_per_param']:.2f} B per parameter + "
              f"{_mib(cal['memory']['step_fixed_bytes'])} MiB per stage", "", "## Log", ""]
    lines += [f"- {m}" for m in result["log"]]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_outputs(result: dict, out_dir: Path) -> None:
    """``plan.json`` (the accepted plan, if any), ``baseline_plan.json``, ``tune.json`` and ``report.md``;
    each written whole (temporary file + rename)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir / "tune.json", json.dumps(result, indent=1, default=str))
    _write(out_dir / "baseline_plan.json", json.dumps(result["baseline"]["plan"], indent=2))
    _write(out_dir / "plan.json", json.dumps(result["plan"], indent=2) + "\n")
    _write(out_dir / "report.md", format_report(result))
