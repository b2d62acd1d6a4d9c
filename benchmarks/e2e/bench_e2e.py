"""End to end: the ppq-tuned pipeline against stock DeepSpeed under one per-stage memory budget, over seeds.

The demo's setting (``deepspeed_ppq.demo``): the small GPT over 2 pipeline stages, each run a real
``deepspeed`` launcher job with 2 gloo ranks. One profile and one plan (the autotuner's planner):
  - baseline: stock DeepSpeed: ``partition_method="parameters"``, fp32 weights, fp32 AdamW, no
    compression, the largest micro-batch that fits the budget (recomputation if needed);
  - tuned: the planner's plan (low-bit weights by the precision policy, codecs, 8-bit optimizer
    states, re-balanced partition, micro-batches, recomputation per stage).
Each seed trains both from the same initialisation on the same samples in the same order (the seed
changes both); the runs alternate (baseline first on even seeds, tuned first on odd) so load drifts
on a shared machine hit both alike.

Checks before the table: each run executed its planned partition, global batch and weight formats;
the baseline is fp32 with no codecs; training lowered the loss. Then, per seed and as medians:
samples/s ratio, bubble ratio, validation-loss difference. Definitions:
  - samples/s: global batch / median step time after the first step (the slowest stage's clock);
  - bubble, measured: time each stage spends inside send/recv instructions (waiting for its peer
    plus the transfer) / step time, mean over the stages, from the last traced steps; it misses the
    wait inside OptimizerStep (DeepSpeed all-reduces the gradient norm over the pipeline group);
  - not computing: 1 - (ForwardPass + BackwardPass) / step time, mean over the stages (an upper
    bound of the idle share: the optimizer's own work counts too);
  - bubble, predicted: the planner's cost model, (idle slots of the schedule) / step time.

    python benchmarks/e2e/bench_e2e.py                    # 3 seeds, ~8-10 min on 2 shared cores
    python benchmarks/e2e/bench_e2e.py --seeds 0 --steps 10   # a smoke run

Results: benchmarks/results/e2e_small_gpt.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from deepspeed_ppq.demo import deepspeed_config_for, demo_settings, launch_run, tune  # noqa: E402
from deepspeed_ppq.plots import run_summary  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def check_run(name: str, plan, ranks: list[dict], summary: dict, settings: dict) -> None:
    """The run did what its plan says (else SystemExit naming the mismatch)."""
    parts = ranks[0]["parts"]
    if parts != plan.boundaries:
        raise SystemExit(f"{name}: ran partition {parts}, planned {plan.boundaries}")
    if summary["global_batch"] != settings["global_batch"]:
        raise SystemExit(f"{name}: global batch {summary['global_batch']} != {settings['global_batch']}")
    if summary["micro_batch"] != plan.micro_batch_size:
        raise SystemExit(f"{name}: micro-batch {summary['micro_batch']} != planned {plan.micro_batch_size}")
    ran_lowbit = any(r["weight_formats"] for r in ranks)
    planned_lowbit = any(f != "none" for f in plan.layer_formats)
    if ran_lowbit != planned_lowbit:
        raise SystemExit(f"{name}: QuantLinear layers {[r['weight_formats'] for r in ranks]}, "
                         f"planned formats {plan.layer_formats}")
    losses = ranks[-1]["losses"]
    if not all(math.isfinite(v) for v in losses) or min(losses[-3:]) >= losses[0]:
        raise SystemExit(f"{name}: training did not lower the loss ({losses[0]:.4f} -> {losses[-1]:.4f})")


def _machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu,
            "cores": os.cpu_count(), "loadavg_at_start": os.getloadavg()[0],
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _row(seed: int, b: dict, t: dict) -> dict:
    return {
        "seed": seed,
        "samples_per_s": [b["samples_per_s"], t["samples_per_s"]],
        "speedup": t["samples_per_s"] / b["samples_per_s"],
        "bubble_measured": [b["bubble_measured"], t["bubble_measured"]],
        "bubble_ratio_measured": t["bubble_measured"] / max(b["bubble_measured"], 1e-9),
        "non_compute_measured": [b["non_compute_measured"], t["non_compute_measured"]],
        "non_compute_ratio": t["non_compute_measured"] / max(b["non_compute_measured"], 1e-9),
        "bubble_predicted": [b["bubble_predicted"], t["bubble_predicted"]],
        "step_time_predicted": [b["step_time_predicted"], t["step_time_predicted"]],
        "val_loss": [b["val_loss"], t["val_loss"]],
        "val_loss_diff_pct": (t["val_loss"] / b["val_loss"] - 1) * 100,
        "wire_bytes_per_step": [b["wire_bytes_per_step"], t["wire_bytes_per_step"]],
    }


def write_results(rows: list[dict], meta: dict, plans: dict) -> str:
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("speedup", "bubble_ratio_measured", "non_compute_ratio", "val_loss_diff_pct")}
    base_vals = [r["val_loss"][0] for r in rows]
    seed_spread = (max(base_vals) - min(base_vals)) / statistics.mean(base_vals) * 100 if len(rows) > 1 else 0
    s, b, t = meta["settings"], plans["baseline"], plans["tuned"]
    m, mach = s["model"], meta["machine"]
    lines = [
        "# End to end: ppq-tuned pipeline vs stock DeepSpeed, same per-stage budget",
        "",
        f"{mach['date']}, torch {mach['torch']}, {mach['cpu']}, "
        f"{mach['cores']} cores (load average {mach['loadavg_at_start']:.1f} at start); "
        f"`python benchmarks/e2e/bench_e2e.py {meta['argv']}`".rstrip() + f" ({meta['wall_seconds']:.0f} s).",
        f"Small GPT: {m['n_layers']} blocks, d={m['d_model']}, {m['n_heads']} heads, seq {m['seq_len']}, "
        f"BPE vocab {m['vocab_size']}; 2 pipeline stages (deepspeed launcher, 2 gloo ranks, 1 thread each); "
        f"{s['train_steps']} steps x global batch {s['global_batch']} per run; per-stage budget "
        f"{meta['budget'] / 2**20:.2f} MiB ({meta['budget_note']}).",
        "",
        f"- baseline: boundaries {b.boundaries}, micro-batch {b.micro_batch_size} x {b.num_microbatches}, "
        f"recompute {[x.recompute for x in b.stages]}, fp32, no codecs",
        f"- tuned: boundaries {t.boundaries}, micro-batch {t.micro_batch_size} x {t.num_microbatches}, "
        f"recompute {[x.recompute for x in t.stages]}, formats {t.layer_formats}, 8-bit Adam "
        f"{t.optimizer_8bit}, codecs act {json.dumps(t.activation_codec)} / "
        f"grad {json.dumps(t.gradient_codec)}",
        "",
        "| seed | samples/s base | samples/s tuned | speedup | bubble meas base | tuned | ratio | "
        "not computing base | tuned | bubble pred base | tuned | val loss base | tuned | Δ % | "
        "MiB/step between stages base | tuned |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['samples_per_s'][0]:.2f} | {r['samples_per_s'][1]:.2f} | "
            f"{r['speedup']:.2f}x | {r['bubble_measured'][0]:.3f} | {r['bubble_measured'][1]:.3f} | "
            f"{r['bubble_ratio_measured']:.2f} | {r['non_compute_measured'][0]:.3f} | "
            f"{r['non_compute_measured'][1]:.3f} | "
            f"{r['bubble_predicted'][0]:.3f} | {r['bubble_predicted'][1]:.3f} | {r['val_loss'][0]:.4f} | "
            f"{r['val_loss'][1]:.4f} | {r['val_loss_diff_pct']:+.2f} | "
            f"{r['wire_bytes_per_step'][0] / 2**20:.2f} | {r['wire_bytes_per_step'][1] / 2**20:.2f} |")
    lines += [
        "",
        f"**Median over {len(rows)} seeds: speedup {med['speedup']:.2f}x (target >= 1.5x), measured bubble "
        f"ratio {med['bubble_ratio_measured']:.2f} (predicted "
        f"{rows[0]['bubble_predicted'][1] / max(rows[0]['bubble_predicted'][0], 1e-9):.2f}; target <= 0.5), "
        f"not-computing ratio {med['non_compute_ratio']:.2f}, "
        f"validation loss {med['val_loss_diff_pct']:+.2f}% (target within 1%).** "
        f"Seed-to-seed spread of the baseline's validation loss: {seed_spread:.2f}%.",
        "",
        "Definitions. samples/s: global batch / median step time after the first step. Bubble measured: "
        "time inside send/recv instructions (waiting for the peer plus the transfer) / step time, mean over "
        "stages, last traced steps; it misses the wait inside OptimizerStep (DeepSpeed all-reduces the "
        "gradient norm over the pipeline group, so the first stage done waits there). Not computing: "
        "1 - (ForwardPass + BackwardPass) / step time, mean over stages (an upper bound of the idle share: "
        "it also counts the optimizer's own work). Bubble predicted: the planner's cost model. "
        "Validation loss: the same "
        "held-out windows for every run, evaluated by the trained engine (with codecs where the tuned "
        "plan uses them). Bytes between stages: the engine's counters where they count, else computed.",
    ]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "e2e_small_gpt.md").write_text(text)
    data = {"meta": meta, "median": med, "baseline_val_loss_seed_spread_pct": seed_spread, "rows": rows,
            "plans": {k: p.to_dict() for k, p in plans.items()}}
    (RESULTS / "e2e_small_gpt.json").write_text(json.dumps(data, indent=1, default=str))
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: the demo's)")
    p.add_argument("--budget-mb", type=float, default=None, help="per-stage budget (default: the demo's)")
    a = p.parse_args(argv)
    try:
        seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--seeds={a.seeds!r}: expected comma-separated integers such as 0,1,2")
    if not seeds:
        p.error("--seeds: at least one seed")
    if a.steps is not None and a.steps < 4:
        p.error(f"--steps={a.steps}: need at least 4 (the last 3 are traced)")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    settings = demo_settings()
    if a.steps is not None:
        settings["train_steps"] = a.steps
    meta = {"machine": _machine(), "argv": " ".join(argv), "settings": settings}
    t0 = time.perf_counter()
    rows, runs_raw = [], {}
    with tempfile.TemporaryDirectory(prefix="ppq-e2e-") as tmp:
        out = Path(tmp)
        planned = tune(settings, a.budget_mb, out)
        plans = {"baseline": planned["baseline"], "tuned": planned["tuned"]}
        meta.update(budget=planned["budget"], budget_note=planned["budget_note"])
        for name, plan in plans.items():
            (out / f"ds_{name}.json").write_text(json.dumps(deepspeed_config_for(plan, name == "baseline")))
        with open(out / "train.log", "w") as log:
            for seed in seeds:
                order = ("baseline", "tuned") if seed % 2 == 0 else ("tuned", "baseline")
                summ = {}
                for name in order:
                    job = {**settings, "seed": seed, "name": f"{name}_seed{seed}",
                           "ds_config": str(out / f"ds_{name}.json")}
                    ranks = launch_run(job, out, log)
                    summ[name] = run_summary(plans[name], ranks, settings)
                    check_run(job["name"], plans[name], ranks, summ[name], settings)
                    runs_raw[job["name"]] = {"losses": ranks[-1]["losses"],
                                             "step_times": ranks[0]["step_times"]}
                rows.append(_row(seed, summ["baseline"], summ["tuned"]))
                print(f"seed {seed}: speedup {rows[-1]['speedup']:.2f}x, val loss "
                      f"{rows[-1]['val_loss_diff_pct']:+.2f}%", flush=True)
    meta["wall_seconds"] = time.perf_counter() - t0
    meta["runs"] = runs_raw
    print(write_results(rows, meta, plans))
    print(f"wrote {RESULTS / 'e2e_small_gpt.json'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
