"""Does a plan run as fast in the user's own run as it did in the tuner's trial?

``ppq tune examples/train_gpt_pipe.py --deepspeed_config configs/ds_cpu_smoke.json --budget-mb N``,
then the same script trains with ``"ppq": {"plan_file": ...}`` under the ``deepspeed`` launcher
(2 gloo ranks) ``--runs`` times; each run prints its median step time after two warm-up steps. The
result compares those with the plan's measured step time (``plan.measured_step_time``, the tuner's
median) and lists the memory model's error on every measured stage. Writes
``results/autotune_plan_reproduction.{md,json}``.

    .venv/bin/python benchmarks/autotune/bench_plan_reproduction.py [--budget-mb 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import machine, machine_line, write_report  # noqa: E402

from deepspeed_ppq.integrations.local_ranks import free_port  # noqa: E402

SCRIPT = ROOT / "examples" / "train_gpt_pipe.py"
CONFIG = ROOT / "configs" / "ds_cpu_smoke.json"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-mb", type=float, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ppq-repro-") as tmp:
        out = Path(tmp) / "tune"
        cmd = [sys.executable, "-m", "deepspeed_ppq.cli", "tune", str(SCRIPT), "--deepspeed_config",
               str(CONFIG), "--budget-mb", str(args.budget_mb), "--out", str(out)]
        tune = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if tune.returncode:
            raise SystemExit(tune.stdout[-3000:] + tune.stderr[-3000:])
        plan = json.loads((out / "plan.json").read_text())
        result = json.loads((out / "tune.json").read_text())
        cfg = json.loads(CONFIG.read_text())
        cfg.pop("csv_monitor", None)
        cfg["ppq"]["plan_file"] = str(out / "plan.json")
        cfg_path = Path(tmp) / "ds_plan.json"
        cfg_path.write_text(json.dumps(cfg))
        times = []
        for _ in range(args.runs):
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                   str(free_port()), str(SCRIPT), "--deepspeed_config", str(cfg_path),
                   "--steps", str(args.steps)]
            run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            m = re.search(r"step time: median ([0-9.]+) ms", run.stdout + run.stderr)
            if run.returncode or not m:
                raise SystemExit(run.stdout[-3000:] + run.stderr[-3000:])
            times.append(float(m.group(1)) / 1e3)
        report = (out / "report.md").read_text()
    tuned = plan["measured_step_time"]
    user = statistics.median(times)
    mem = [line for line in report.splitlines() if line.startswith("Memory model:")]
    md = ["# A tuned plan in the user's own run", "", machine_line(machine()), "",
          f"`ppq tune examples/train_gpt_pipe.py --deepspeed_config configs/ds_cpu_smoke.json --budget-mb "
          f"{args.budget_mb:g}`; plan: {plan['notes'][0]}, boundaries {plan['derived']['boundaries']}, "
          f"micro-batch {plan['micro_batch_size']} x {plan['num_microbatches']}, formats "
          f"{sorted({f for s in plan['stages'] for f in s['formats']})}, master-free {plan['master_free']}, "
          f"8-bit Adam {plan['optimizer_8bit']} (outcome: {result['outcome']}).", "",
          "| | step time |", "|---|---|",
          f"| the tuner's trial (plan.measured_step_time) | {tuned * 1e3:.1f} ms |",
          f"| the user's run with plan_file, median of {args.runs} | {user * 1e3:.1f} ms "
          f"({', '.join(f'{t * 1e3:.1f}' for t in times)}) |",
          f"| difference | {(user - tuned) / tuned:+.1%} |", "", *mem, ""]
    write_report("autotune_plan_reproduction",
                 {"machine": machine(), "budget_mb": args.budget_mb, "plan": plan, "tuner_step_time": tuned,
                  "user_step_times": times, "memory_model": mem}, "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
