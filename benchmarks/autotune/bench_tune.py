"""Budget sweep: the tuned plan against the best measured stock DeepSpeed configuration, per budget.

The demo's workload (``examples/demo/run_demo.py``: a 12-block GPT of width 256 on 32-token
sequences, 2 pipeline stages, global batch 16) is tuned with ``ppq tune`` at each per-stage budget,
from where the best stock configuration fits at its fastest setting down to where only small
micro-batches with recomputation fit. At each budget the tuner measures the stock candidates that fit
(the fastest measured is the baseline) and the tuned plan, alternating baseline and plan
``--ab-repeats`` more times; the speedup is the ratio of the medians. Writes
``results/autotune_budget_sweep.{md,json,png}``.

    .venv/bin/python benchmarks/autotune/bench_tune.py [--budgets 120,100,80,64,52,44,38] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "demo"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, machine, write  # noqa: E402
from run_demo import FULL, QUICK, SCRIPT, _config  # noqa: E402


def tune_at(budget_mb: float, settings: dict, out: Path, ab_repeats: int) -> dict:
    settings = {**settings, "autotune": {**settings["autotune"], "ladder": False, "ab_repeats": ab_repeats}}
    cfg = _config(out, settings, budget_mb)
    cmd = [sys.executable, "-m", "deepspeed_ppq.cli", "tune", str(SCRIPT), "--deepspeed_config", str(cfg),
           *settings["model"], "--out", str(out / "tune")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        return {"budget_mb": budget_mb, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1]}
    r = json.loads((out / "tune" / "tune.json").read_text())
    ab = r["ab_step_times"]
    base, plan = r["baseline"]["plan"], r["plan"]
    t_base = statistics.median(ab["baseline"])
    t_tuned = statistics.median(ab["tuned"]) if ab["tuned"] else t_base
    return {"budget_mb": budget_mb, "baseline": base["notes"][0], "outcome": r["outcome"],
            "plan": f"{plan['micro_batch_size']}x{plan['num_microbatches']} {plan['derived']['boundaries']} "
                    f"{sorted(set(f for s in plan['stages'] for f in s['formats']))} master-free "
                    f"{plan['master_free']} 8-bit {plan['optimizer_8bit']}",
            "baseline_ms": t_base * 1e3, "tuned_ms": t_tuned * 1e3, "speedup": t_base / t_tuned,
            "baseline_peak_mb": r["baseline"]["run"]["peak_memory"] / 2**20,
            "tuned_peak_mb": (max(m["total"] for m in plan["measured_memory"]) / 2**20
                              if plan["measured_memory"] else None)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="120,100,80,64,52,44,38", help="MiB per stage, comma-separated")
    p.add_argument("--ab-repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    settings = QUICK if args.quick else FULL
    rows = []
    with tempfile.TemporaryDirectory(prefix="ppq-sweep-") as tmp:
        for b in [float(x) for x in args.budgets.split(",")]:
            out = Path(tmp) / f"b{b:g}"
            out.mkdir()
            rows.append(tune_at(b, settings, out, args.ab_repeats))
            print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "speedup" in r]
    md = ["# Budget sweep: tuned plan vs the best measured stock configuration", "",
          f"Machine: {machine()}", "",
          "| budget MiB | best stock (measured) | stock ms | tuned plan | tuned ms | speedup | "
          "peaks MiB (stock / tuned) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['budget_mb']:g} | {r['error']} | | | | | |")
            continue
        stock = r["baseline"].removeprefix("stock: ")
        md.append(f"| {r['budget_mb']:g} | {stock} | {r['baseline_ms']:.1f} | "
                  f"{r['plan'] if r['outcome'] == 'tuned' else '(stock stands)'} | {r['tuned_ms']:.1f} | "
                  f"{r['speedup']:.2f}x | {r['baseline_peak_mb']:.1f} / {r['tuned_peak_mb'] or 0:.1f} |")
    if ok:
        md += ["", f"Mean speedup over these budgets: {statistics.mean(r['speedup'] for r in ok):.2f}x; "
               f"best {max(r['speedup'] for r in ok):.2f}x."]
    write("autotune_budget_sweep", {"machine": machine(), "rows": rows}, "\n".join(md) + "\n")
    if ok:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["budget_mb"] for r in ok], [r["speedup"] for r in ok], "o-")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel("per-stage memory budget, MiB")
        ax.set_ylabel("samples/s vs best stock")
        fig.tight_layout()
        fig.savefig(RESULTS / "autotune_budget_sweep.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
