"""The method, measured: low-bit weights turned into pipeline fill, against the best stock DeepSpeed
configuration, per workload (``examples/demo/workloads.py``: ``pretrain`` and ``finetune``).

For each workload, ``ppq tune`` runs the unmodified example script on 2 ranks:

1. **The ladder** at the workload's reference budget: the best measured stock configuration (its
   validation loss over 3 seeds: the quality gate's noise), then one feature at a time up to the tuned
   plan (low-bit weights at the stock schedule, the freed memory spent on fill, re-balanced stages,
   codecs); each rung measured: samples/s, bubble, peak memory per stage, validation loss.
2. **A budget sweep** (``--budgets``, or 6 budgets from where the fastest stock configuration fits at its
   fastest down to where the smallest stock configuration is predicted to fit, and one more at the measured
   peak of the smallest stock configuration the lowest budget's tune ran, where only it fits: micro-batch 1
   with recomputation, say): at each per-stage budget the tuner
   measures the stock candidates that fit (the fastest measured is the baseline) and the tuned plan,
   then alternates baseline and plan ``ab_repeats`` more times; the speedup is the ratio of the
   medians. A budget where the stock configuration must compromise (recompute, or a smaller
   micro-batch than its unconstrained fastest) is marked; below every stock configuration the row
   says only the plan trains. The sweep budget nearest the ladder's (within 10%) is the ladder's, and
   its row is the ladder's tune.

Writes ``results/autotune_<workload>.{md,json}`` and ``results/autotune_<workload>_sweep.png``
(``--tag T``: ``autotune_<workload>_T.*``, a run beside the sweep's, e.g. the ladder alone).

    .venv/bin/python benchmarks/autotune/bench_tune.py [--workloads finetune,pretrain] [--budgets 64,48]
        [--no-ladder] [--quick] [--tag T]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path[:0] = [str(ROOT / "examples" / "demo"), str(ROOT / "examples")]  # workloads, stdlib_text

from _harness import RESULTS, loadavg, machine, machine_line, write_report  # noqa: E402
from workloads import (  # noqa: E402
    PRECISIONS,
    SCRIPT,
    choose_precision,
    ds_config,
    script_args,
    settings,
    timed_run,
)

from deepspeed_ppq.autotune.ladder import left_out_lines, measured_bubble, stage_compute  # noqa: E402
from deepspeed_ppq.autotune.plan import Plan  # noqa: E402


def _tune(w, budget_mb: float, out: Path, model: list[str], autotune: dict, precision: str) -> dict:
    """One ``ppq tune`` run in ``precision``; its ``tune.json`` (or ``{"error": ...}``)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = ds_config(out, w, budget_mb, autotune=autotune, precision=precision)
    cmd = [sys.executable, "-m", "deepspeed_ppq.cli", "tune", str(SCRIPT), "--deepspeed_config", str(cfg),
           *model, "--out", str(out / "tune")]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": next((x for x in reversed(lines) if x.startswith("ppq tune:")), lines[-1])}
    r = json.loads((out / "tune" / "tune.json").read_text())
    r["wall_s"] = time.perf_counter() - t0
    r["dir"], r["precision"] = str(out / "tune"), precision
    return r


def _plan_label(plan: dict) -> str:
    fmts = sorted({f for s in plan["stages"] for f in s["formats"]} - {"none"}) or ["fp32"]
    rec = Plan.from_dict(plan).recompute_label
    codecs = (("act", plan["activation_codec"]), ("grad", plan["gradient_codec"]))
    return (f"p={plan['pipeline_degree']} {plan['derived']['boundaries']}, {plan['micro_batch_size']} x "
            f"{plan['num_microbatches']}, recompute {rec}, weights {'+'.join(fmts)}"
            + (" master-free" if plan["master_free"] else "")
            + (", 8-bit Adam" if plan["optimizer_8bit"] else "")
            + "".join(f", {k} {c['method']}{c.get('bits', '')}" for k, c in codecs if c["method"] != "none"))


def _peaks_of(memory: list[dict]) -> str:
    return " / ".join(f"{m['total'] / 2**20:.1f}" for m in memory)


def _peaks(run: dict) -> str:
    return _peaks_of([st["measured_memory"] for st in run["stages"]])


def sweep_row(budget_mb: float, r: dict, unconstrained: dict | None) -> dict:
    """One budget's result: the measured best stock, the tuned plan, the A/B medians."""
    if "error" in r:
        return {"budget_mb": budget_mb, "error": r["error"]}
    if r["outcome"] == "stock_does_not_fit":  # no stock run to compare with: no speedup
        return {"budget_mb": budget_mb, "precision": r["precision"], "outcome": r["outcome"],
                "stock": "cannot train at this budget",
                "stock_smallest_peaks_mb": _peaks(r["baseline"]["run"]), "tuned": _plan_label(r["plan"]),
                "tuned_ms": r["plan"]["measured_step_time"] * 1e3,
                "tuned_peaks_mb": _peaks_of(r["plan"]["measured_memory"]),
                "gate": r["gate"], "wall_s": r["wall_s"], "log": r.get("log", [])}
    ab = r["ab_step_times"]
    t_base = statistics.median(ab["baseline"])
    t_ab = statistics.median(ab["tuned"]) if ab["tuned"] else None
    # no plan beat the stock configuration: the user runs it, 1.00x by construction (the A/B of a
    # configuration against itself is the timing noise, kept as noise_ratio)
    tuned = r["outcome"] == "tuned" and t_ab is not None
    t_tuned = t_ab if tuned else t_base
    noise = t_base / t_ab if t_ab is not None and not tuned else None
    base = r["baseline"]["plan"]
    compromise = None
    if unconstrained is not None:  # recompute, or another micro-batch than the unconstrained fastest
        compromise = (any(s["recompute"] for s in base["stages"])
                      or (base["pipeline_degree"], base["micro_batch_size"])
                      != (unconstrained["pipeline_degree"], unconstrained["micro_batch_size"]))
    return {"budget_mb": budget_mb, "stock": f"{r['precision']}: {_plan_label(base)}",
            "stock_ms": t_base * 1e3, "stock_peaks_mb": _peaks(r["baseline"]["run"]), "outcome": r["outcome"],
            "precision": r["precision"],
            "tuned": _plan_label(r["plan"]) if r["outcome"] == "tuned" else "(the stock configuration)",
            "tuned_ms": t_tuned * 1e3, "speedup": t_base / t_tuned, "stock_compromises": compromise,
            "tuned_peaks_mb": _peaks_of(r["plan"]["measured_memory"]),
            "noise_ratio": noise, "gate": r["gate"], "wall_s": r["wall_s"],
            "log": r.get("log", [])}  # why each plan was taken or refused


AB_ROUNDS = 3  # alternating rounds of the example script's A/Bs (alternating_ab)


def alternating_ab(w, b: float, tmp: Path, model: list[str], entries: dict[str, tuple[str, Path]]
                   ) -> dict[str, list[float]]:
    """Step times (ms) of the example script with each entry's plan file, ``name -> (precision, plan
    path)``: ``AB_ROUNDS`` rounds, the entries alternating within each."""
    times: dict[str, list[float]] = {name: [] for name in entries}
    for _ in range(AB_ROUNDS):
        for name, (prec, path) in entries.items():
            cfg = ds_config(tmp, w, b, plan_file=str(path), precision=prec)
            times[name].append(timed_run(cfg, model) * 1e3)
    return times


def script_ab_row(row: dict, w, b: float, tmp: Path, model: list[str], r: dict) -> dict:
    """``row`` with its stock and tuned times from the example script where a plan replaced the stock
    configuration (``alternating_ab`` of the two plan files): what the user's script runs, in steady steps,
    where the tuner's A/B times fresh engines in its trials (kept as ``tuner_ab_ms``)."""
    if "error" in r or r["outcome"] != "tuned" or "cross_precision" in row:
        return row
    plans = {"stock": "baseline_plan.json", "tuned": "plan.json"}
    times = alternating_ab(w, b, tmp, model,
                           {k: (r["precision"], Path(r["dir"]) / f) for k, f in plans.items()})
    stock, tuned = (statistics.median(times[k]) for k in ("stock", "tuned"))
    return {**row, "stock_ms": stock, "tuned_ms": tuned, "speedup": stock / tuned, "script_ab_ms": times,
            "tuner_ab_ms": {"stock": row["stock_ms"], "tuned": row["tuned_ms"]}}


def other_precision_stock(w, b: float, tmp: Path, model: list[str], r: dict,
                          probe_s: dict | None) -> dict | None:
    """Stock DeepSpeed in the other precision at budget ``b`` MiB, where it may beat the chosen one's: no
    stock configuration fits in the chosen precision there, or the best one measured is slower than the
    other precision's fastest step (its timing run in ``choose_precision``: no stock run at a budget is
    faster). Its own tune at ``b`` measures its best stock configuration; that one, the chosen
    precision's best stock configuration (if one fits) and the tuned plan are then timed in one A/B,
    ``AB_ROUNDS`` rounds of the example script with their plan files, alternating.

    Returns:
        None when the other precision is not searched; else ``{"precision", "fits"}`` and, when its stock
        fits, ``"entries"``: per A/B entry its label, precision, step times (ms) and measured peaks.
    """
    if "error" in r or probe_s is None:
        return None
    other = next(p for p in PRECISIONS if p != r["precision"])
    fits = r["outcome"] != "stock_does_not_fit"
    if fits and statistics.median(r["ab_step_times"]["baseline"]) <= probe_s[other]:
        return None
    ro = _tune(w, b, tmp / f"b{b:g}_{other}", model, {"ladder": False}, other)
    if "error" in ro or ro["outcome"] == "stock_does_not_fit":
        return {"precision": other, "fits": False, "error": ro.get("error")}

    def base(t: dict) -> tuple:
        return Path(t["dir"]) / "baseline_plan.json", t["baseline"]["plan"], _peaks(t["baseline"]["run"])

    entries = {f"stock {other}": (other, *base(ro))}
    if fits:
        entries[f"stock {r['precision']}"] = (r["precision"], *base(r))
    if r["outcome"] in ("tuned", "stock_does_not_fit"):
        entries["tuned"] = (r["precision"], Path(r["dir"]) / "plan.json", r["plan"],
                            _peaks_of(r["plan"]["measured_memory"]))
    # otherwise the tuned plan is the chosen precision's stock configuration, timed once as that
    times = alternating_ab(w, b, tmp, model, {name: e[:2] for name, e in entries.items()})
    return {"precision": other, "fits": True,
            "entries": {name: {"precision": prec, "label": _plan_label(plan), "ms": times[name],
                               "peaks_mb": pk} for name, (prec, _, plan, pk) in entries.items()}}


def cross_precision_row(row: dict, other: dict) -> dict:
    """``row`` with its stock and tuned times from the cross-precision A/B (``other_precision_stock``):
    the best stock configuration is the faster of the two precisions' there."""
    e = other["entries"]
    med = {name: statistics.median(x["ms"]) for name, x in e.items()}
    stock = min((name for name in e if name.startswith("stock")), key=med.get)
    tuned = "tuned" if "tuned" in e else f"stock {row['precision']}"
    return {**row, "stock": f"{e[stock]['precision']}: {e[stock]['label']}", "stock_ms": med[stock],
            "stock_peaks_mb": e[stock]["peaks_mb"], "tuned_ms": med[tuned],
            "speedup": med[stock] / med[tuned],
            "outcome": row["outcome"] if row["outcome"] != "stock_does_not_fit" else "tuned",
            "stock_compromises": True if stock != f"stock {row['precision']}" else row["stock_compromises"],
            "cross_precision": other}


def _with_other_precision(row: dict, w, b: float, tmp: Path, model: list[str], r: dict,
                          precision: dict) -> dict:
    """``row``, with the other precision's stock searched where it may be faster
    (``other_precision_stock``)."""
    other = other_precision_stock(w, b, tmp, model, r, precision.get("probe_s"))
    if other is None:
        return row
    return cross_precision_row(row, other) if other["fits"] else {**row, "cross_precision": other}


def script_ab_lines(rows: list[dict]) -> list[str]:
    """Per budget where a plan replaced the stock configuration: the example script's A/B
    (``script_ab_row``) and the tuner's own."""
    out = [f"- {x['budget_mb']:g} MiB: stock {x['stock_ms']:.0f} ms, tuned {x['tuned_ms']:.0f} ms "
           f"({x['speedup']:.2f}x; runs {', '.join(f'{t:.0f}' for t in x['script_ab_ms']['stock'])} against "
           f"{', '.join(f'{t:.0f}' for t in x['script_ab_ms']['tuned'])}); the tuner's A/B "
           f"{x['tuner_ab_ms']['stock']:.0f} against {x['tuner_ab_ms']['tuned']:.0f} ms "
           f"({x['tuner_ab_ms']['stock'] / x['tuner_ab_ms']['tuned']:.2f}x)"
           for x in rows if "script_ab_ms" in x]
    if out:
        out = ["", "Where a plan replaced the stock configuration, the row's times are the example script's: "
               f"medians of {AB_ROUNDS} alternating runs with each plan file (steady steps; the tuner's own "
               "A/B times fresh engines in its trials):", "", *out]
    return out


def cross_precision_lines(rows: list[dict]) -> list[str]:
    """Per budget where the other precision's stock was searched: what it found and the A/B."""
    out = []
    for x in rows:
        o = x.get("cross_precision")
        if not o:
            continue
        if not o["fits"]:
            out.append(f"- {x['budget_mb']:g} MiB: no {o['precision']} stock configuration fits either"
                       + (f" ({o['error']})" if o.get("error") else ""))
            continue
        out.append(f"- {x['budget_mb']:g} MiB, medians of {AB_ROUNDS} alternating runs of the example "
                   "script: "
                   + "; ".join(f"{name} ({e['label']}, peaks {e['peaks_mb']} MiB) "
                               f"{statistics.median(e['ms']):.0f} ms" for name, e in o["entries"].items())
                   + ("" if "tuned" in o["entries"] else
                      f"; the tuned plan is the {x['precision']} stock configuration"))
    if out:
        out = ["", "Where the chosen precision's stock cannot train or is slower than the other "
               "precision's fastest stock step, the other precision's stock configurations are searched "
               "too (their own tune at the budget), and the best of each precision and the tuned plan are "
               "timed together; the row's times are that A/B's:", "", *out]
    return out


def sweep_budgets(free: dict, n: int = 6) -> list[float]:
    """``n`` budgets (MiB) from the measured peak of the fastest stock configuration with no budget
    (where it fits at its fastest) down to where only the smallest stock configuration fits (micro-batch
    1 with recomputation, say), evenly spaced on a log scale."""
    top = free["baseline"]["run"]["peak_memory"] / 2**20
    # the candidates' predictions are uncalibrated and measure up to ~11% higher (the no-budget run
    # measures only the fastest): 12% over the smallest prediction lands where the smallest one fits
    bottom = 1.12 * min(c["predicted_peak"] for c in free["stock"]["candidates"]) / 2**20
    if bottom >= top:
        return [round(top)]
    # the top one rounded up: the fastest stock configuration fits it
    return sorted({math.ceil(top), *(round(top * (bottom / top) ** (i / (n - 1))) for i in range(1, n))},
                  reverse=True)


def floor_budget(r: dict) -> float | None:
    """The budget (MiB, rounded up to 0.1) where only the smallest stock configuration fits, from the tune
    at the lowest budget: the smallest configuration it measured, at its measured peak over 1 +
    ``memory_tolerance`` (the limit trials are held to), or, when the configuration its calibrated model
    puts smallest was never measured, that one's predicted peak (the tolerance is then the slack its
    measurement gets); the lower of the two. None when the tune's baseline already is the smallest."""
    if "error" in r:
        return None
    stock, base = r.get("stock", {}), r["baseline"]["plan"]["notes"]
    tol = r["settings"]["memory_tolerance"]
    measured = stock.get("measured") or []
    floors = []
    if measured:
        smallest = min(measured, key=lambda m: m["run"]["peak_memory"])
        if smallest["plan"]["notes"] != base:
            floors.append(smallest["run"]["peak_memory"] / (1 + tol))
    cands = stock.get("candidates") or []
    if cands:
        least = min(cands, key=lambda c: c["predicted_peak"])
        if least["notes"] != base and all(m["plan"]["notes"] != least["notes"] for m in measured):
            floors.append(least["predicted_peak"])
    return math.ceil(min(floors) / 2**20 * 10) / 10 if floors else None


def ladder_rows(r: dict) -> list[dict]:
    rows = []
    for rung in r.get("ladder", []):
        run = rung["run"]
        rows.append({"rung": rung["rung"], "plan": _plan_label(rung["plan"]),
                     "samples_per_s": r["global_batch"] / run["measured_step_time"],
                     "step_ms": run["measured_step_time"] * 1e3, "bubble": measured_bubble(run),
                     "compute_ms": " / ".join(f"{t * 1e3:.0f}" for t in stage_compute(run)),
                     "peaks_mb": _peaks(run), "val_loss": run.get("quality_val_loss", run["val_loss"])})
    return rows


def _other_flags(argv: list[str]) -> str:
    """The command line's flags other than --workloads, as the results' run line repeats them."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--workloads":
            skip = True
        elif not a.startswith("--workloads="):
            out.append(a)
    return "".join(f" {a}" for a in out)


def _precision_line(precision: dict) -> str:
    """What the precision both sides train in is and how it was chosen."""
    times = precision.get("probe_s") or {}
    how = ("the faster of " + " and ".join(f"{k} ({v * 1e3:.1f} ms per step)" for k, v in times.items())
           + " in the stock timing run (workloads.choose_precision)") if times else "set by --precision"
    mode = "DeepSpeed's bf16 mode" if precision["chosen"] == "bf16" else "fp32"
    return f"Training precision, both sides: **{precision['chosen']}** ({mode}; {how})."


def _markdown(w, m: dict, ladder: dict | None, rows: list[dict], budget_ref: float, end_load: str,
              flags: str = "", precision: dict | None = None) -> str:
    md = [f"# The method on {w.title}", "", machine_line(m) + f"; load at the end {end_load}", "",
          f"Workload `{w.name}` (examples/demo/workloads.py): `examples/train_gpt_pipe.py "
          f"{' '.join(w.model)}`{' --finetune <pretrained base>' if w.pretrain_steps else ''}, 2 ranks, "
          f"global batch 16, the tuner choosing 1 or 2 pipeline stages. Run: `.venv/bin/python "
          f"benchmarks/autotune/bench_tune.py --workloads {w.name}{flags}`.", ""]
    if precision is not None:
        md += [_precision_line(precision), ""]
    if ladder is not None:
        if "error" in ladder:
            md += [f"## The ladder at {budget_ref:g} MiB per stage", "", f"failed: {ladder['error']}", ""]
        else:
            g = ladder["gate"]
            md += [f"## The ladder at {budget_ref:g} MiB per stage", "",
                   f"Quality gate: baseline validation loss {g['mean']:.4f} over {len(g['losses'])} seeds "
                   f"(spread {g['spread']:.4f}), limit {g['limit']:.4f} (+{g['tolerance']:.0%}). Outcome: "
                   f"**{ladder['outcome']}**.", "",
                   "Forward + backward ms per stage: each stage's compute per step (recomputation "
                   "included), apart from the bubble.", "",
                   "| rung | configuration | samples/s | step ms | bubble | forward + backward ms per stage "
                   "| peak MiB per stage | val loss |",
                   "|---|---|---|---|---|---|---|---|"]
            lrows = ladder_rows(ladder)
            for x in lrows:
                md.append(f"| {x['rung']} | {x['plan']} | {x['samples_per_s']:.1f} | {x['step_ms']:.0f} | "
                          f"{x['bubble']:.2f} | {x['compute_ms']} | {x['peaks_mb']} | {x['val_loss']:.4f} |")
            if not lrows:
                md.append("| (no ladder: the tuned plan did not beat the best stock configuration) |"
                          " | | | | | | |")
            if lrows:
                md += ["", *left_out_lines(ladder.get("ladder_left_out", []))]
            md += ["", "Tuner log:", "", *[f"    {line}" for line in ladder["log"]], ""]
    if rows:
        md += ["## Budget sweep", "",
               "| budget MiB | best stock (measured) | stock ms | stock compromises | tuned plan | "
               "tuned ms | speedup | peaks MiB stock / tuned |", "|---|---|---|---|---|---|---|---|"]
        for x in rows:
            if "error" in x:
                md.append(f"| {x['budget_mb']:g} | {x['error']} | | | | | | |")
                continue
            if x["outcome"] == "stock_does_not_fit":
                md.append(f"| {x['budget_mb']:g} | none fits (the smallest measured "
                          f"{x['stock_smallest_peaks_mb']} MiB) | - | cannot train | {x['tuned']} | "
                          f"{x['tuned_ms']:.0f} | only the plan trains | - / {x['tuned_peaks_mb']} |")
                continue
            md.append(f"| {x['budget_mb']:g} | {x['stock']} | {x['stock_ms']:.0f} | "
                      f"{'yes' if x['stock_compromises'] else 'no'} | {x['tuned']} | {x['tuned_ms']:.0f} | "
                      f"{x['speedup']:.2f}x | {x['stock_peaks_mb']} / {x['tuned_peaks_mb']} |")
        ok = [x for x in rows if "speedup" in x]
        comp = [x["speedup"] for x in ok if x["stock_compromises"]]
        above = [x["speedup"] for x in ok if x["stock_compromises"] and not x.get("floor")]
        if ok:
            md += ["", f"Speedup over the best measured stock configuration: mean "
                   f"{statistics.mean(comp):.2f}x over the {len(comp)} budgets where it must compromise"
                   + (f" ({statistics.mean(above):.2f}x over the {len(above)} above the floor budget, where "
                      "only stock's smallest configuration fits)" if above and len(above) < len(comp) else "")
                   + ";" if comp else "",
                   f"best {max(x['speedup'] for x in ok):.2f}x; mean over all {len(ok)} budgets "
                   f"{statistics.mean(x['speedup'] for x in ok):.2f}x."]
        alone = [x["budget_mb"] for x in rows if x.get("outcome") == "stock_does_not_fit"]
        if alone:
            md.append(f"Where no stock configuration fits ({', '.join(f'{b:g}' for b in alone)} MiB) "
                      "only the low-bit plan trains.")
        md += script_ab_lines(rows)
        md += cross_precision_lines(rows)
        md += why_stock_stays(rows)
    return "\n".join(md) + "\n"


def _tuner_stock_ms(row: dict) -> float:
    """The row's stock time as the tuner's trials measured it (``script_ab_row`` keeps it apart)."""
    return row.get("tuner_ab_ms", {}).get("stock", row["stock_ms"])


def unconstrained_lines(unconstrained: dict, rows: list[dict]) -> str:
    """The fastest stock configuration with no budget and, per budget, the most any plan could gain
    there by buying that configuration's schedule back: the best stock time over its time (from
    another run, so within the trials' noise)."""
    t = unconstrained.get("measured_step_time")
    out = f"\nFastest stock configuration with no budget: {_plan_label(unconstrained)}"
    if not t:
        return out + ".\n"
    # the tuner's stock times where the row's are the script's: the unconstrained time is a tuner trial's
    ceil = ", ".join(f"{x['budget_mb']:g} MiB {_tuner_stock_ms(x) / (t * 1e3):.2f}x"
                     for x in rows if "stock_ms" in x)
    return (out + f", {t * 1e3:.0f} ms. Best stock time over it, per budget (what the compromise costs stock "
            f"DeepSpeed there, the gain a plan that only bought its schedule back would make): {ceil}.\n")


def why_stock_stays(rows: list[dict]) -> list[str]:
    """For each budget where the stock configuration compromises and still stays the plan: the plans the
    tuner tried there and why none replaced it, from its log."""
    out = []
    for x in rows:
        if x.get("outcome") != "baseline" or not x.get("stock_compromises"):
            continue
        tries = ("iteration", "runner-up", "memory probe")
        lines = [line for line in x.get("log", []) if line.startswith(tries)
                 or "the stock configuration is the plan" in line]
        out += [f"- {x['budget_mb']:g} MiB:", *[f"    {line}" for line in lines]]
    if out:
        out = ["", "Where the stock configuration compromises and stays the plan, what the tuner tried "
               "(its log):", "", *out]
    return out


def _plot(w, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [x for x in rows if "speedup" in x]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.plot([x["budget_mb"] for x in ok], [x["speedup"] for x in ok], "o-", label="tuned plan")
    for x in ok:
        if x["stock_compromises"]:
            ax.plot(x["budget_mb"], x["speedup"], "o", mfc="none", ms=12, color="tab:red")
    for x in rows:
        if x.get("outcome") == "stock_does_not_fit":
            ax.axvline(x["budget_mb"], color="tab:gray", ls=":", lw=1)
            ax.annotate("only the plan\ntrains", (x["budget_mb"], 1.0), fontsize=7, color="tab:gray",
                        xytext=(3, 6), textcoords="offset points")
    ax.axhline(1.0, color="k", lw=0.8, label="best measured stock configuration")
    ax.set_xlabel("per-stage memory budget, MiB (measured peak)")
    ax.set_ylabel("samples/s over best stock")
    ax.set_title(f"{w.title} (red: stock must compromise)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="finetune,pretrain")
    p.add_argument("--budgets", default=None, help="MiB per stage, comma-separated (default: from where the "
                   "fastest stock configuration fits down to where only the smallest does)")
    p.add_argument("--no-ladder", action="store_true")
    p.add_argument("--quick", action="store_true", help="the workloads' quick settings (a smoke run)")
    p.add_argument("--tag", default="", help="results as autotune_<workload>_<tag>.* (beside the sweep)")
    p.add_argument("--precision", choices=("auto", *PRECISIONS), default="auto",
                   help="the training precision of both sides (auto: the faster stock run here)")
    args = p.parse_args()
    for name in args.workloads.split(","):
        w = settings(name, args.quick)
        m = machine()
        budgets = [float(b) for b in args.budgets.split(",")] if args.budgets else []
        with tempfile.TemporaryDirectory(prefix=f"ppq-bench-{name}-") as tmp:
            model = script_args(w, Path(tmp) / "pretrain.log")
            if args.precision == "auto":
                chosen, probe = choose_precision(w, model, Path(tmp))
                precision = {"chosen": chosen, "probe_s": probe}
            else:
                precision = {"chosen": args.precision}
            print(json.dumps({"precision": precision}), flush=True)
            ladder = None
            if not args.no_ladder:
                ladder = _tune(w, w.budget_mb, Path(tmp) / "ladder", model, {"ladder": True},
                               precision["chosen"])
                print(json.dumps({"ladder": ladder_rows(ladder) if "error" not in ladder else ladder}),
                      flush=True)
            # the fastest stock configuration with no budget: what "must compromise" is measured against
            free = _tune(w, 1 << 20, Path(tmp) / "free", model, {"ladder": False, "seeds": 1, "ab_repeats": 0,
                                                              "max_iterations": 1}, precision["chosen"])
            unconstrained = free["baseline"]["plan"] if "error" not in free else None
            ladder_ok = ladder is not None and "error" not in ladder
            if not budgets and unconstrained is not None:
                budgets = sweep_budgets(free)
                # the ladder's tune is the sweep's row at its budget: the nearest sweep budget within
                # 10% moves onto it (one tune less)
                near = min(budgets, key=lambda b: abs(b - w.budget_mb))
                if ladder_ok and abs(near / w.budget_mb - 1) < 0.1:
                    budgets[budgets.index(near)] = w.budget_mb
            rows = []
            auto = not args.budgets
            for b in list(budgets):
                reuse = ladder_ok and b == w.budget_mb  # the ladder's tune is this budget's
                r = ladder if reuse else _tune(w, b, Path(tmp) / f"b{b:g}", model, {"ladder": False},
                                                precision["chosen"])
                row = _with_other_precision(sweep_row(b, r, unconstrained), w, b, Path(tmp), model, r,
                                            precision)
                rows.append(script_ab_row(row, w, b, Path(tmp), model, r))
                print(json.dumps(rows[-1]), flush=True)
                # the sweep goes down to where only the smallest stock configuration fits (micro-batch 1
                # with recomputation, say): where the lowest budget's baseline is still a larger one, one
                # more budget at the smallest's peak (floor_budget: measured, or as predicted)
                floor = floor_budget(r) if auto and b == min(budgets) else None
                if floor is not None and floor < b:
                    budgets.append(floor)
                    rf = _tune(w, floor, Path(tmp) / f"b{floor:g}", model, {"ladder": False},
                               precision["chosen"])
                    row = sweep_row(floor, rf, unconstrained)
                    row = _with_other_precision(row, w, floor, Path(tmp), model, rf, precision)
                    rows.append({**script_ab_row(row, w, floor, Path(tmp), model, rf), "floor": True})
                    print(json.dumps(rows[-1]), flush=True)
        md = _markdown(w, m, ladder, rows, w.budget_mb, loadavg(), _other_flags(sys.argv[1:]), precision)
        if unconstrained is not None:
            md += unconstrained_lines(unconstrained, rows)
        stem = f"autotune_{name}" + (f"_{args.tag}" if args.tag else "")
        write_report(stem, {
            "machine": m, "workload": name, "precision": precision,
            "ladder": ladder_rows(ladder) if ladder and "error" not in ladder else ladder,
            "ladder_log": (ladder or {}).get("log"), "sweep": rows, "unconstrained_stock": unconstrained}, md)
        if any("speedup" in x or "tuned_ms" in x for x in rows):
            _plot(w, rows, Path(RESULTS) / f"{stem}_sweep.png")
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
