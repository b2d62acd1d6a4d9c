"""The main job (``make demo``): low-bit weights turned into pipeline fill, against the best stock
DeepSpeed configuration, on a workload where weight memory binds.

The workload is pre-training a deep, narrow GPT (12 blocks of width 256, 32-token sequences, the
package's small GPT on stdlib text with a locally trained BPE) on 2 pipeline stages: its weights,
gradients and optimizer states are most of each stage's memory, as in an LLM's pipeline stages. The
demo is the user's flow, nothing more:

1. ``ppq tune examples/train_gpt_pipe.py --deepspeed_config <config>``: the unmodified training script
   hands its model to the tuner, which profiles it, measures the best stock configuration a DeepSpeed
   user could set under the per-stage memory budget (its seed noise too), plans low-bit weights and
   the pipeline together, measures the plan, checks its validation loss against the baseline's seeds,
   and measures the ladder from the stock configuration to the plan one feature at a time;
2. the same script trains with ``"ppq": {"plan_file": ...}``.

The report (``<out>/tune/report.md``) opens with the ladder; ``<out>/ladder.png`` draws it.
Options: ``--quick`` (a smaller model and shorter trials, for the test), ``--budget-mb``, ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gpt_pipe.py"

# The workload and the budget. Each stage holds about 4.9M parameters: fp32 weights, gradients and
# Adam states are 16 B per parameter (78 MiB), plus the 4 B per parameter DeepSpeed flattens the
# gradients into for its reduce. At 72 MiB per stage stock DeepSpeed cannot keep fp32 Adam states; with
# 8-bit Adam (14 B per parameter with that buffer, 66 MiB) it has a few MiB left for activations, so small
# micro-batches or recomputation. Master-free int8 blocks (1 B codes, no fp32 master) free 3 B per block
# parameter more: room for larger micro-batches.
FULL = {"model": ["--n-layers", "12", "--d-model", "256", "--seq-len", "32"], "budget_mb": 72,
        "autotune": {"trial_steps": 8, "warmup_steps": 2, "seeds": 3, "quality_steps": 60,
                     "val_loss_tolerance": 0.03,
                     "stock_trials": 3, "val_batches": 4, "profile_reps": 3, "max_iterations": 3,
                     "pipeline_degrees": [2], "ab_repeats": 2, "ladder": True},
        "train_steps": 30}
QUICK = {"model": ["--n-layers", "6", "--d-model", "128", "--seq-len", "32", "--max-bytes", "400000"],
         "budget_mb": 16,
         "autotune": {"trial_steps": 4, "warmup_steps": 1, "seeds": 1, "stock_trials": 2, "val_batches": 2,
                      "profile_reps": 2, "max_iterations": 2, "pipeline_degrees": [2], "ab_repeats": 0,
                      "quality_steps": 4,
                      "ladder": True},
         "train_steps": 6}


def _config(out: Path, settings: dict, budget_mb: float, plan_file: str | None = None) -> Path:
    cfg = {
        "train_batch_size": 16,
        "steps_per_print": 10,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "ppq": {"weights": {"keep_first_blocks": 1, "keep_last_blocks": 1},
                "autotune": {**settings["autotune"], "memory_budget": int(budget_mb * 2**20),
                             "formats": ["int8"], "master_free": True}},
    }
    if plan_file:
        cfg["ppq"]["plan_file"] = plan_file
    path = out / ("ds_plan.json" if plan_file else "ds_tune.json")
    path.write_text(json.dumps(cfg, indent=1))
    return path


def _run(cmd: list[str], log: Path) -> None:
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), PYTHONPATH=str(ROOT))
    print("$ " + " ".join(cmd), flush=True)
    tail: list[str] = []
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=ROOT)
        for line in proc.stdout:  # progress as it happens; everything goes to the log
            f.write(line)
            tail = (tail + [line])[-40:]
            if line.startswith(("[ppq tune]", "step time", "ppq tune:")):
                print("  " + line.rstrip(), flush=True)
        proc.wait()
    if proc.returncode:
        raise SystemExit(f"failed (exit {proc.returncode}); its output is in {log}:\n{''.join(tail)}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ladder = result["ladder"]
    names = [r["rung"].split(" (")[0] for r in ladder]
    sps = [r["run"]["samples_per_second"] for r in ladder]
    peaks = [max(st["measured_memory"]["total"] for st in r["run"]["stages"]) / 2**20 for r in ladder]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.barh(names[::-1], sps[::-1], color="tab:blue")
    a.set_xlabel("samples/s (measured)")
    a.set_title("The ladder: one feature at a time")
    b.barh(names[::-1], peaks[::-1], color="tab:orange")
    budget = result["settings"]["memory_budget"]
    if budget:
        b.axvline(budget / 2**20, color="k", ls="--", label="budget")
        b.legend()
    b.set_xlabel("largest stage's measured peak, MiB")
    b.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller model and shorter trials (the test)")
    p.add_argument("--budget-mb", type=float, help="per-stage memory budget in MiB (default: the workload's)")
    p.add_argument("--out", default="demo_out", help="output folder")
    args = p.parse_args(argv)
    settings = QUICK if args.quick else FULL
    budget = args.budget_mb or settings["budget_mb"]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = _config(out, settings, budget)
    _run([sys.executable, "-m", "deepspeed_ppq.cli", "tune", str(SCRIPT), "--deepspeed_config", str(cfg),
          *settings["model"], "--out", str(out / "tune")], out / "tune.log")
    result = json.loads((out / "tune" / "tune.json").read_text())
    plan_cfg = _config(out, settings, budget, plan_file=str(out / "tune" / "plan.json"))
    _run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
          str(_free_port()), str(SCRIPT), "--deepspeed_config", str(plan_cfg), *settings["model"], "--steps",
          str(settings["train_steps"])], out / "train.log")
    if result.get("ladder"):
        _plot(result, out / "ladder.png")
    report = (out / "tune" / "report.md").read_text()
    head = report.split("## Stock search")[0]
    print("\n" + head)
    print(f"demo: {time.perf_counter() - t0:.0f} s; report {out / 'tune' / 'report.md'}, plan "
          f"{out / 'tune' / 'plan.json'}" + (f", {out / 'ladder.png'}" if result.get("ladder") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
