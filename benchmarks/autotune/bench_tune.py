"""The autotuner against the DeepSpeed baseline on real engines (2 gloo ranks, one core each).

A small GPT with a heavy embedding and LM head (vocabulary 4096, d_model 128: each is worth about
2.5 blocks of parameters, the head also of compute, the embedding of none) trains on the stdlib
corpus. Under the same per-stage memory budget and global batch:
  - baseline: what a DeepSpeed user configures: ``partition_method="parameters"``, fp32 weights, no
    compression, fp32 Adam, recomputation only if needed, the largest micro-batch that fits;
  - also measured: ``partition_method="uniform"`` with the same settings;
  - tuned: the accepted plan of ``ppq tune`` (checked on validation loss by the loop itself).
Reported: measured samples/s, predicted and measured bubble (1 - compute / step time, per stage,
from the engine's per-instruction times), validation loss, prediction error. Checks first: each run
executed its planned partition and held memory within the budget.

Run: ``.venv/bin/python benchmarks/autotune/bench_tune.py [--budget-mib 22]``  (about 3-6 minutes on
2 cores). The default budget lets the baseline keep its activations at micro-batch 1 (21.7 MiB on its
fuller stage); ``--budget-mib 21`` is a budget where it must recompute them (results then go to
``autotune_tune_21mib.*``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, write  # noqa: E402

from deepspeed_ppq.autotune import autotune  # noqa: E402

BUDGET_MB = 22.0


def _measured_bubble(run: dict, pipeline_only: bool = False) -> float:
    """1 - (ForwardPass + BackwardPass) / step time on the most idle stage. ``pipeline_only``: of the
    pipelined part of the step only (the step minus that stage's OptimizerStep, which every schedule
    pays once per step and which also holds the stages' gradient-norm synchronisation)."""
    step = run["measured_mean_step_time"]  # instruction times are means over the timed steps
    fr = []
    for st in run["stages"]:
        ins = st["measured_instructions_per_step"]
        busy = ins.get("ForwardPass", 0.0) + ins.get("BackwardPass", 0.0)
        span = step - ins.get("OptimizerStep", 0.0) if pipeline_only else step
        fr.append(1.0 - busy / span)
    return max(fr)


def _check(run: dict, plan: dict, budget: int) -> None:
    bounds = plan["derived"]["boundaries"]
    for st in run["stages"]:
        if st["layers"] != [bounds[st["stage"]], bounds[st["stage"] + 1]]:
            raise SystemExit(f"stage {st['stage']} ran layers {st['layers']}, planned {bounds}")
        meas = sum(v for k, v in st["measured_memory"].items() if k != "cuda_max_allocated")
        if meas > 1.1 * budget:
            raise SystemExit(
                f"stage {st['stage']} held {meas} B, budget {budget} B: measured {st['measured_memory']}, "
                f"predicted {st['predicted_memory']}, "
                f"plan {plan['micro_batch_size']} x {plan['num_microbatches']}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-mib", type=float, default=BUDGET_MB, help="per-stage memory budget (MiB)")
    args = ap.parse_args()
    budget_mb = args.budget_mib
    result_name = "autotune_tune" if budget_mb == BUDGET_MB else f"autotune_tune_{budget_mb:g}mib"
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "model": {"vocab_size": 4096, "seq_len": 64, "d_model": 128, "n_layers": 6, "n_heads": 4},
            "global_batch": 16,
            "micro_batch_sizes": [1, 2, 4, 8, 16],
            "pipeline_degrees": [2],
            "formats": ["int8"],
            "weights": {"keep_first_blocks": 1, "keep_last_blocks": 1},
            "memory_budget": int(budget_mb * 2**20),
            "trial_steps": 16,
            "warmup_steps": 3,
            "val_batches": 4,
            "profile_reps": 5,
            "corpus_bytes": 600_000,
            "extra_baselines": ["uniform"],
            "ab_repeats": 3,
            "out_dir": str(Path(tmp) / "out"),
        }
        res = autotune(spec, nproc=2)
        report = (Path(tmp) / "out" / "report.md").read_text()
    budget = spec["memory_budget"]
    rows = [("DeepSpeed parameters", res["baseline"]["plan"], res["baseline"]["run"])]
    rows += [(f"DeepSpeed {m}", r["plan"], r["run"]) for m, r in res["extra_baselines"].items()]
    last = res["iterations"][-1]
    rows.append(("ppq tune" + ("" if last["accepted"] else " (NOT accepted)"), last["plan"], last["run"]))
    for _, plan, run in rows:
        _check(run, plan, budget)
    base_sps = rows[0][2]["samples_per_second"]
    md = [
        "# Autotuner vs DeepSpeed baseline (real engines, 2 gloo ranks)",
        "",
        f"Machine: {machine()}",
        "",
        f"Model: GPT {spec['model']}; global batch {spec['global_batch']}; per-stage budget "
        f"{budget_mb:g} MiB; {spec['trial_steps']} steps per run ({spec['warmup_steps']} untimed).",
        "",
        "| config | boundaries | micro-batch | formats | samples/s | x baseline | bubble pred | bubble meas "
        "| pipeline bubble meas | step pred ms | step calibrated ms | step meas ms | val loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    out = []
    for name, plan, run in rows:
        fm = sorted(
            set(
                plan["derived"]["deepspeed"]["ppq"]["weights"]["rules"]
                and [r["format"] for r in plan["derived"]["deepspeed"]["ppq"]["weights"]["rules"]]
            )
        )
        mb = f"{plan['micro_batch_size']} x {plan['num_microbatches']}"
        rec = {
            "config": name,
            "boundaries": plan["derived"]["boundaries"],
            "micro_batch": mb,
            "formats": fm,
            "samples_per_second": run["samples_per_second"],
            "speedup": run["samples_per_second"] / base_sps,
            "bubble_predicted": plan["predicted_bubble_fraction"],
            "bubble_measured": _measured_bubble(run),
            "pipeline_bubble_measured": _measured_bubble(run, pipeline_only=True),
            "step_predicted_s": run["predicted_step_time"],
            # baselines: the model after calibration (fitted to the baseline and probe runs); the tuned
            # plan was planned with that model, so its prediction already is the calibrated one
            "step_calibrated_s": run.get("calibrated_step_time", run["predicted_step_time"]),
            "step_measured_s": run["measured_step_time"],
            "val_loss": run["val_loss"],
        }
        out.append(rec)
        md.append(
            f"| {name} | {rec['boundaries']} | {mb} | {','.join(fm)} | {rec['samples_per_second']:.1f} | "
            f"{rec['speedup']:.2f}x | {rec['bubble_predicted']:.3f} | {rec['bubble_measured']:.3f} | "
            f"{rec['pipeline_bubble_measured']:.3f} | "
            f"{rec['step_predicted_s'] * 1e3:.1f} | {rec['step_calibrated_s'] * 1e3:.1f} | "
            f"{rec['step_measured_s'] * 1e3:.1f} | "
            f"{rec['val_loss']:.4f} |"
        )
    b, t = out[0], out[-1]
    ab = res["ab_step_times"]
    gb = spec["global_batch"]
    ab_speedup = statistics.median(ab["baseline"]) / statistics.median(ab["tuned"]) if ab["tuned"] else 0.0
    md += [
        "",
        f"A/B (baseline and tuned run alternately, {len(ab['baseline'])} runs each, median step): baseline "
        f"{statistics.median(ab['baseline']) * 1e3:.1f} ms "
        f"({gb / statistics.median(ab['baseline']):.1f} samples/s), "
        f"tuned {statistics.median(ab['tuned']) * 1e3:.1f} ms -> **{ab_speedup:.2f}x**; all runs (ms): "
        f"baseline {[round(x * 1e3, 1) for x in ab['baseline']]}, "
        f"tuned {[round(x * 1e3, 1) for x in ab['tuned']]}",
        "",
        f"- speedup {t['speedup']:.2f}x (target >= 1.5x); measured bubble {b['bubble_measured']:.3f} -> "
        f"{t['bubble_measured']:.3f}, of the pipelined part {b['pipeline_bubble_measured']:.3f} -> "
        f"{t['pipeline_bubble_measured']:.3f} (predicted {b['bubble_predicted']:.3f} -> "
        f"{t['bubble_predicted']:.3f}; target: halved); validation loss "
        f"{b['val_loss']:.4f} -> {t['val_loss']:.4f} "
        f"({(t['val_loss'] / b['val_loss'] - 1) * 100:+.2f}%, target within 1%)",
        f"- the tuned plan's step-time prediction was made before it ran (cost model calibrated on the "
        f"baseline run and a probe of the baseline at micro-batch "
        f"{res['calibration'].get('probe', {}).get('micro_batch_size')}: {res['calibration']})",
        "- step-time prediction error (calibrated model vs measured): "
        + ", ".join(
            f"{r['config']} {(r['step_calibrated_s'] / r['step_measured_s'] - 1) * 100:+.1f}%" for r in out
        ),
        "- bubble measured = 1 - (ForwardPass + BackwardPass time) / step time on the most idle stage; "
        "pipeline bubble: the same over the step minus that stage's OptimizerStep (paid once per step "
        "whatever the schedule; it also holds the stages' gradient-norm synchronisation)",
        "",
        "Run: `.venv/bin/python benchmarks/autotune/bench_tune.py"
        + ("" if budget_mb == BUDGET_MB else f" --budget-mib {budget_mb:g}") + "`",
        "",
        "## The loop's report",
        "",
        report,
    ]
    print("\n".join(md[:20]))
    write(
        result_name,
        {
            "machine": machine(),
            "spec": spec,
            "rows": out,
            "calibration": res["calibration"],
            "log": res["log"],
        },
        "\n".join(md),
    )


if __name__ == "__main__":
    main()
