"""The tuning report: per stage layers, precision mix, memory by category (predicted and measured),
time and bubble, before (the DeepSpeed baseline) and after (the accepted plan), plus the DeepSpeed
settings and the equivalent Megatron flags."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from deepspeed_ppq.autotune.plan import Plan

__all__ = ["format_report", "write_outputs"]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _ratio(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas * 100:+.1f}%" if meas else "n/a"


def _plan_section(title: str, plan: Plan, run: dict) -> list[str]:
    pred_t, meas_t = run["predicted_step_time"], run["measured_step_time"]
    lines = [
        f"## {title}",
        "",
        f"- pipeline degree {plan.pipeline_degree} x data parallel {plan.data_parallel}, "
        f"schedule {plan.schedule}, "
        f"boundaries `{plan.boundaries}`",
        f"- micro-batch {plan.micro_batch_size} x {plan.num_microbatches} micro-batches "
        f"(global batch {plan.global_batch})",
        f"- activations codec `{plan.activation_codec}`, gradients codec `{plan.gradient_codec}`, "
        f"8-bit Adam states: {plan.optimizer_8bit}, master-free weights: {plan.master_free}",
        f"- step time: predicted {pred_t * 1e3:.1f} ms, measured {meas_t * 1e3:.1f} ms "
        f"(prediction error {_ratio(pred_t, meas_t)}); {run['samples_per_second']:.2f} samples/s measured",
        f"- predicted bubble fraction {plan.predicted_bubble_fraction:.3f}; "
        f"validation loss {run['val_loss']:.4f}",
    ]
    if "calibrated_step_time" in run:
        cal = run["calibrated_step_time"]
        lines.append(
            f"- after calibration (the model refitted to the baseline and probe runs): predicted "
            f"{cal * 1e3:.1f} ms vs measured {meas_t * 1e3:.1f} ms ({_ratio(cal, meas_t)}), bubble "
            f"{run['calibrated_bubble_fraction']:.3f}"
        )
    sim = run.get("simulated") or run.get("simulated_after_calibration")
    if sim:
        lines.append(
            "- schedule simulator (DeepSpeed TrainSchedule, same costs): "
            f"step {sim['step_time'] * 1e3:.1f} ms, "
            f"bubble {sim['bubble_fraction']:.3f}"
        )
    lines += [
        "",
        "| stage | layers | precision | recompute | time/µb ms | memory MiB predicted | measured | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for st in run["stages"]:
        mix = ", ".join(f"{f}x{n}" for f, n in Counter(st["formats"]).items())
        pm = sum(st["predicted_memory"].values())
        mm = sum(v for k, v in st["measured_memory"].items() if k != "cuda_max_allocated")
        lines.append(
            f"| {st['stage']} | {st['layers'][0]}-{st['layers'][1] - 1} | {mix} | {st['recompute']} | "
            f"{st['predicted_time_per_microbatch'] * 1e3:.2f} | {_mib(pm)} | {_mib(mm)} | {_ratio(pm, mm)} |"
        )
    lines += ["", "Measured engine time per step by instruction (ms):", ""]
    names = sorted({n for st in run["stages"] for n in st.get("measured_instructions_per_step", {})})
    if names:
        lines.append("| stage | " + " | ".join(names) + " |")
        lines.append("|---" * (len(names) + 1) + "|")
        for st in run["stages"]:
            ins = st.get("measured_instructions_per_step", {})
            lines.append(
                f"| {st['stage']} | " + " | ".join(f"{ins.get(n, 0.0) * 1e3:.1f}" for n in names) + " |"
            )
    lines += ["", "Memory by category (MiB, predicted / measured):", ""]
    cats = list(run["stages"][0]["predicted_memory"])
    lines.append("| stage | " + " | ".join(cats) + " |")
    lines.append("|---" * (len(cats) + 1) + "|")
    for st in run["stages"]:
        cells = [f"{_mib(st['predicted_memory'][c])} / {_mib(st['measured_memory'].get(c, 0))}" for c in cats]
        lines.append(f"| {st['stage']} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def format_report(result: dict, base: Plan, tuned: Plan | None) -> str:
    """Markdown report of a ``run_tuning`` result."""
    lines = ["# ppq tune report", ""]
    lines += _plan_section(
        "Before: DeepSpeed baseline (partition_method=parameters, fp32, no compression)",
        base,
        result["baseline"]["run"],
    )
    for method, rec in result.get("extra_baselines", {}).items():
        lines += _plan_section(
            f"Also measured: DeepSpeed partition_method={method}", Plan.from_dict(rec["plan"]), rec["run"]
        )
    for rec in result["iterations"]:
        plan = Plan.from_dict(rec["plan"])
        verdict = "accepted" if rec["accepted"] else f"rejected; back-off: {rec.get('back_off')}"
        lines += _plan_section(f"Iteration {rec['iteration']} ({verdict})", plan, rec["run"])
    if tuned is not None:
        b, t = result["baseline"]["run"], result["iterations"][-1]["run"]
        lines += [
            "## Before vs after",
            "",
            f"- samples/s: {b['samples_per_second']:.2f} -> {t['samples_per_second']:.2f} "
            f"({t['samples_per_second'] / b['samples_per_second']:.2f}x)",
            f"- predicted bubble fraction: {base.predicted_bubble_fraction:.3f} -> "
            f"{tuned.predicted_bubble_fraction:.3f}",
            f"- validation loss: {b['val_loss']:.4f} -> {t['val_loss']:.4f}",
            "",
            "## DeepSpeed settings",
            "",
            "```json",
            json.dumps(tuned.deepspeed_config(), indent=2),
            "```",
            "",
            "## Equivalent Megatron flags",
            "",
            "```",
            " \\\n  ".join(tuned.megatron_flags()),
            "```",
        ]
    else:
        lines += ["## No plan accepted", "", "Every iteration missed the validation-loss tolerance."]
    lines += ["", "## Log", ""] + [f"- {m}" for m in result["log"]]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, base: Plan, tuned: Plan | None, out_dir: Path) -> None:
    """``plan.json`` (the accepted plan), ``baseline_plan.json``, ``tune.json`` and ``report.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if tuned is not None:
        tuned.save(out_dir / "plan.json")
    base.save(out_dir / "baseline_plan.json")
    (out_dir / "tune.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out_dir / "report.md").write_text(format_report(result, base, tuned))
