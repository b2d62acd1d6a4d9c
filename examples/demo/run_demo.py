"""The main job (``make demo``): low-bit weights turned into pipeline fill, against the best stock
DeepSpeed configuration, on a workload where weight memory binds (``workloads.py``).

The demo is the user's flow, nothing more:

0. the training precision a DeepSpeed user would pick here: fp32 or DeepSpeed's bf16 mode, whichever
   trains faster on this machine (``workloads.choose_precision``); both sides train in it;
1. ``ppq tune examples/train_gpt_pipe.py --deepspeed_config <config>``: the unmodified training script
   hands its model to the tuner, which profiles it, measures the best stock configuration a DeepSpeed
   user could set under the per-stage memory budget (its seed noise too), plans low-bit weights and
   the pipeline together, measures the plan, checks its validation loss against the baseline's seeds,
   and measures the ladder from the stock configuration to the plan one feature at a time;
2. the same script trains with ``"ppq": {"plan_file": ...}``.

The report (``<out>/tune/report.md``) opens with the ladder; ``<out>/ladder.png`` draws it.
Options: ``--workload`` (``finetune``, the default, or ``pretrain``), ``--quick`` (a smaller model and
shorter trials, for the test), ``--budget-mb``, ``--out``, ``--precision`` (``auto``, ``fp32``, ``bf16``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # workloads; examples/ (stdlib_text)

from workloads import (  # noqa: E402
    PRECISIONS,
    ROOT,
    SCRIPT,
    STOP_SLOWER,
    WORKLOADS,
    choose_precision,
    ds_config,
    launch_cmd,
    script_args,
    script_env,
    settings,
)


def _run(cmd: list[str], log: Path) -> None:
    env = script_env()
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
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="finetune")
    p.add_argument("--quick", action="store_true", help="a smaller model and shorter trials (the test)")
    p.add_argument("--budget-mb", type=float, help="per-stage memory budget in MiB (default: the workload's)")
    p.add_argument("--out", default="demo_out", help="output folder")
    p.add_argument("--precision", choices=("auto", *PRECISIONS), default="auto",
                   help="the training precision of both sides (auto: the faster stock run here)")
    args = p.parse_args(argv)
    w = settings(args.workload, args.quick)
    budget = args.budget_mb or w.budget_mb
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = script_args(w, out / "pretrain.log")
    precision = args.precision
    if precision == "auto":
        precision, probe = choose_precision(w, model, out, stop_slower=True)
        print(f"precision: {precision} (the faster stock run on this machine: "
              + ", ".join(f"{k} {v * 1e3:.1f} ms per step" if v is not None else
                          f"{k} stopped at {STOP_SLOWER}x the first run's time" for k, v in probe.items())
              + ")", flush=True)
    cfg = ds_config(out, w, budget, precision=precision)
    _run([sys.executable, "-m", "deepspeed_ppq.cli", "tune", str(SCRIPT), "--deepspeed_config", str(cfg),
          *model, "--out", str(out / "tune")], out / "tune.log")
    result = json.loads((out / "tune" / "tune.json").read_text())
    plan_cfg = ds_config(out, w, budget, plan_file=str(out / "tune" / "plan.json"), precision=precision)
    _run(launch_cmd(plan_cfg, model, steps=w.train_steps), out / "train.log")
    if result.get("ladder"):
        _plot(result, out / "ladder.png")
    report = (out / "tune" / "report.md").read_text()
    head = report.split("## Stock search")[0]
    print(f"\n# {w.title}\n\n" + head)
    print(f"demo: {time.perf_counter() - t0:.0f} s; report {out / 'tune' / 'report.md'}, plan "
          f"{out / 'tune' / 'plan.json'}" + (f", {out / 'ladder.png'}" if result.get("ladder") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
