"""Simulator speed: 96 layers on 16 stages, 64 micro-batches, 1F1B with links and the memory model.

    .venv/bin/python benchmarks/sim/bench_simulator.py     # target: under 50 ms per simulate() call

First checks the result against the closed form (equal stages, free links: bubble (p-1)/(m+p-1)),
then times ``simulate`` for each schedule beside the baseline of the same run: building the schedule
and a bare loop over its actions (the least any simulator must do). Writes
benchmarks/results/sim_bench.{json,md}.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import loadavg, machine, machine_line  # noqa: E402

from deepspeed_ppq.schedule import (  # noqa: E402
    LinkModel,
    StageCost,
    build_schedule,
    simulate,
    split_costs,
)
from deepspeed_ppq.schedule.costs import ModelShape, stage_costs_roofline, stage_memory  # noqa: E402
from deepspeed_ppq.schedule.hardware import get_hardware  # noqa: E402

P, M, LAYERS = 16, 64, 96


def _timeit(fn, reps: int = 15) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    # 1. Correctness first.
    one = build_schedule("1f1b", P, M)
    r = simulate(one, [StageCost(1.0, 2.0)] * P)
    expect = (P - 1) / (M + P - 1)
    assert abs(r.bubble_fraction - expect) < 1e-12, (r.bubble_fraction, expect)

    shape = ModelShape(LAYERS, 8192, 64, 4096, 128256, micro_batch=1, dtype="bf16")
    hw = get_hardware("h100")
    per_rank = stage_costs_roofline(shape, P, hw, "int4")
    memory = stage_memory(shape, P, "int4")
    link = LinkModel(5e-6, 50e9, overlap=True)
    msg = shape.micro_batch * shape.seq_len * shape.hidden * 2
    rows = []
    for name, v in [("1f1b", 1), ("gpipe", 1), ("deepspeed", 1), ("zbh1", 1), ("interleaved", 2),
                    ("chimera", 1)]:
        build = _timeit(lambda name=name, v=v: build_schedule(name, P, M, v), reps=5)
        sched = build_schedule(name, P, M, v)
        costs = split_costs(per_rank, sched)
        nb = sched.num_pieces - 1
        mem = memory

        def run(sched=sched, costs=costs, nb=nb, mem=mem):
            return simulate(sched, costs, [(msg, msg)] * nb, link, mem)

        def bare(sched=sched):
            n = 0
            for row in sched.actions:
                for a in row:
                    n += a.microbatch
            return n

        ts = _timeit(run)
        tb = _timeit(bare)
        actions = sum(len(x) for x in sched.actions)
        res = run()
        rows.append({"schedule": sched.name, "actions": actions, "simulate_ms": statistics.median(ts) * 1e3,
                     "simulate_min_ms": min(ts) * 1e3, "build_ms": statistics.median(build) * 1e3,
                     "bare_loop_ms": statistics.median(tb) * 1e3,
                     "us_per_action": statistics.median(ts) / actions * 1e6,
                     "step_time_s": res.step_time, "bubble_fraction": res.bubble_fraction})
    print(f"{LAYERS} layers, {P} stages, {M} micro-batches (roofline H100, int4 weights, 50 GB/s links)")
    print(f"{'schedule':<14}{'actions':>8}{'simulate ms':>13}{'build ms':>10}{'bare loop ms':>14}"
          f"{'x bare':>8}{'step s':>9}{'bubble':>8}")
    for x in rows:
        print(f"{x['schedule']:<14}{x['actions']:>8}{x['simulate_ms']:>13.2f}{x['build_ms']:>10.2f}"
              f"{x['bare_loop_ms']:>14.3f}{x['simulate_ms'] / x['bare_loop_ms']:>8.0f}"
              f"{x['step_time_s']:>9.3f}{x['bubble_fraction']:>8.1%}")
    m = machine()
    m["loadavg_end"] = loadavg()
    meta = {"python": platform.python_version(), "machine": m,
            "command": "python benchmarks/sim/bench_simulator.py", "target_ms": 50}
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_bench.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    md = ["# Simulator speed", "", machine_line(m), "", f"Python {meta['python']}. "
          f"Command: `{meta['command']}`. {LAYERS} layers, {P} stages, {M} micro-batches, links and "
          "memory on.",
          "", "| schedule | actions | simulate ms (median) | build ms | bare loop ms | step s | bubble |",
          "|---|---|---|---|---|---|---|"]
    md += [f"| {x['schedule']} | {x['actions']} | {x['simulate_ms']:.2f} | {x['build_ms']:.2f} | "
           f"{x['bare_loop_ms']:.3f} | {x['step_time_s']:.3f} | {x['bubble_fraction']:.1%} |" for x in rows]
    (out / "sim_bench.md").write_text("\n".join(md) + "\n")
    one_f = rows[0]["simulate_ms"]
    print(f"1f1b simulate: {one_f:.2f} ms ({'under' if one_f < 50 else 'OVER'} the 50 ms target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
