"""Planner speed and partition quality.

1. Check: the DP's optimum equals brute force on small random instances.
2. Planning a 96-layer, 16-stage problem over all knobs (3 low-bit formats, 3 activation and 2 gradient
   codecs, 8-bit Adam on/off, 1F1B and GPipe, 4 micro-batch sizes, recomputation): seconds (target < 5 s).
3. A model with a heavy embedding and LM head (GPT-2-like shapes, costs from a roofline of this CPU):
   predicted step time of the DP's partition against DeepSpeed's ``parameters`` and ``uniform``.

Run: ``.venv/bin/python benchmarks/autotune/bench_planner.py``
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from itertools import combinations, product
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import machine, machine_line, write_report  # noqa: E402

from deepspeed_ppq.autotune.costs import NO_CODEC, CodecOption, LayerProfile  # noqa: E402
from deepspeed_ppq.autotune.planner import (  # noqa: E402
    Knobs,
    PlanningProblem,
    StageChoice,
    best_stock,
    evaluate_stages,
    plan_pipeline,
    solve_partition,
)
from deepspeed_ppq.config import WeightFormat  # noqa: E402
from deepspeed_ppq.schedule import LinkModel  # noqa: E402

FLOPS = 1.0e11  # fp32 FLOP/s of one core of this CPU with AMX/AVX-512 (roofline, achievable ~50%)
BW = 10e9  # bytes/s per core

def baseline_plan(prob, method: str = "parameters", optimizer_8bit: bool = False):
    """The fastest stock configuration with DeepSpeed's ``method`` partition at the largest degree."""
    from deepspeed_ppq.integrations.model_layers import deepspeed_partitions

    p = max(prob.degrees())
    cuts = deepspeed_partitions([layer.params for layer in prob.layers], p)[method]
    return best_stock(prob, {p: {method: cuts}}, optimizer_8bit)



def gpt_layers(
    n_blocks: int, d: int, vocab: int, seq: int, formats=("int8", "nf4", "fp8_e4m3")
) -> list[LayerProfile]:
    """Roofline costs of a GPT's pipeline layers (per sample): blocks 24 d^2 T FLOPs forward, the head
    2 d V T, the embedding a gather; low-bit formats add a dequantization pass over the weights."""
    bits = {f: WeightFormat(f).bits for f in ("none", *formats)}
    out = []
    act = seq * d * 4
    for i in range(n_blocks + 2):
        kind = "embed" if i == 0 else "head" if i == n_blocks + 1 else "block"
        if kind == "block":
            numels, wq, fl = (
                [3 * d * d, d * d, 4 * d * d, 4 * d * d, 9 * d + 4 * d],
                12 * d * d,
                24 * d * d * seq,
            )
            allowed = ["none", *formats] if 1 < i < n_blocks else ["none"]
            saved = 34 * seq * d + 5 * seq * seq * 16
        elif kind == "embed":
            numels, wq, fl, allowed, saved = [vocab * d, seq * d], 0, 2 * seq * d, ["none"], 8 * seq
        else:
            numels, wq, fl, allowed, saved = (
                [vocab * d, 2 * d],
                0,
                2 * d * vocab * seq,
                ["none"],
                4 * seq * (vocab + d),
            )
        times, wbytes = {}, {}
        for f in allowed:
            deq = 0.0 if f == "none" else wq * (4 + bits[f] / 8) / BW
            times[f] = {
                mb: [fl * mb / FLOPS + deq, fl * mb / FLOPS + deq, fl * mb / FLOPS] for mb in (1, 2, 4, 8)
            }
            wbytes[f] = 4 * (sum(numels) - wq) + (wq * bits[f] // 8 + wq // 64 * 4 if f != "none" else 4 * wq)
        out.append(
            LayerProfile(
                str(i),
                kind,
                numels,
                wq if kind == "block" else 0,
                allowed,
                times,
                wbytes,
                {f: saved * 4 for f in allowed},
                8 * seq if kind == "embed" else act,
                act,
            )
        )
    return out


def _check_against_brute_force() -> int:
    rng = random.Random(0)
    checked = 0
    for trial in range(6):
        layers = gpt_layers(4, 64, 512, 32)
        for lp in layers:
            for f in lp.times:
                lp.times[f] = {mb: [x * rng.uniform(0.7, 1.3) for x in v] for mb, v in lp.times[f].items()}
        prob = PlanningProblem(layers=layers, world_size=3, global_batch=8, link=LinkModel(1e-4, 1e9))
        k = Knobs(3, 2, 4, "1f1b", NO_CODEC, NO_CODEC, bool(trial % 2))
        free = evaluate_stages(
            prob,
            k,
            [
                StageChoice(0, 2, "none", False),
                StageChoice(2, 4, "none", False),
                StageChoice(4, 6, "none", False),
            ],
        )
        peaks = sorted(sum(m.values()) for m in free["memory"])
        prob.memory_budget = int(peaks[0] + rng.uniform(0.3, 1.0) * (peaks[-1] - peaks[0]))
        opts = [(lv, r) for lv in prob.levels() for r in (False, True)]
        best = float("inf")
        for cuts in combinations(range(1, 6), 2):
            b = [0, *cuts, 6]
            for choice in product(opts, repeat=3):
                st = [StageChoice(i, j, lv, r) for (i, j), (lv, r) in zip(zip(b, b[1:]), choice)]
                ev = evaluate_stages(prob, k, st)
                if ev["fits"]:
                    best = min(best, ev["pipeline_time"])
        got = solve_partition(prob, k)
        value = got[0] if got else float("inf")
        if abs(value - best) > 1e-12 * max(1.0, abs(best)):
            raise SystemExit(f"DP {value} != brute force {best} on trial {trial}")
        checked += 1
    return checked


def main() -> None:
    n_checked = _check_against_brute_force()
    print(f"check: DP optimum == brute force on {n_checked} random instances")

    codecs_a = [NO_CODEC] + [
        CodecOption.make(
            {"method": "quant", "bits": b},
            wire_ratio=b / 32 + 0.01,
            encode_s_per_byte=1e-10,
            decode_s_per_byte=1e-10,
            bits=b,
        )
        for b in (8, 4)
    ]
    big = PlanningProblem(
        layers=gpt_layers(94, 1024, 50304, 512),
        world_size=16,
        global_batch=256,
        memory_budget=None,
        micro_batch_sizes=[1, 2, 4, 8],
        pipeline_degrees=[16],
        schedules=["1f1b", "gpipe"],
        activation_codecs=codecs_a,
        gradient_codecs=codecs_a[:2],
        optimizer_8bit=[False, True],
        link=LinkModel(2e-5, 25e9),
        optimizer_s_per_param=2e-10,
    )
    free = plan_pipeline(big)
    big.memory_budget = int(0.8 * max(s.peak_memory for s in free.stages))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        plan = plan_pipeline(big)
        times.append(time.perf_counter() - t0)
    n_knobs = 4 * 2 * 3 * 2 * 2
    print(
        f"96 layers, 16 stages, {n_knobs} knob settings x (partition, level, recompute) per stage: "
        f"median {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f})"
    )

    heavy = PlanningProblem(
        layers=gpt_layers(22, 768, 50304, 256),
        world_size=4,
        global_batch=64,
        micro_batch_sizes=[1, 2, 4, 8],
        pipeline_degrees=[4],
        link=LinkModel(2e-5, 25e9),
        optimizer_s_per_param=2e-10,
    )
    tuned_k = None
    rows = []
    for method in ("parameters", "uniform"):
        base = baseline_plan(heavy, method)
        k = Knobs(4, base.micro_batch_size, base.num_microbatches, "1f1b", NO_CODEC, NO_CODEC, False)
        dp_time, dp_stages = solve_partition(heavy, k)
        same = evaluate_stages(heavy, k, dp_stages)
        rows.append(
            (
                method,
                base.boundaries,
                base.predicted_step_time,
                [s.first for s in dp_stages] + [len(heavy.layers)],
                same["step_time"],
            )
        )
        tuned_k = k
    full = plan_pipeline(heavy)
    md = [
        "# Planner benchmark",
        "",
        machine_line(machine()),
        "",
        f"- Check: the DP's optimum equals brute force on {n_checked} random 6-layer, 3-stage instances.",
        f"- **96 layers, 16 stages, all knobs** ({n_knobs} outer settings; per stage 4 precision levels x "
        f"recompute): median **{statistics.median(times):.2f} s** over 3 runs "
        f"(min {min(times):.2f}, max {max(times):.2f}; target < 5 s). "
        f"Budget {big.memory_budget / 2**30:.2f} GiB "
        f"per stage; plan: micro-batch {plan.micro_batch_size} x {plan.num_microbatches}, {plan.schedule}, "
        f"8-bit Adam {plan.optimizer_8bit}, recompute on {sum(s.recompute for s in plan.stages)} stages.",
        "",
        "## Heavy embedding and LM head (GPT-2 small shapes, V=50304, 24 layers on 4 stages), same knobs",
        "",
        "| DeepSpeed partition | its boundaries | predicted step s | DP boundaries | DP step s | speedup |",
        "|---|---|---|---|---|---|",
    ]
    for method, bb, bt, db, dt in rows:
        md.append(f"| {method} | {bb} | {bt:.4f} | {db} | {dt:.4f} | {bt / dt:.2f}x |")
    md += [
        "",
        f"Whole search (micro-batch, codecs, 8-bit Adam free): {full.predicted_step_time:.4f} s, boundaries "
        f"{full.boundaries}, micro-batch {full.micro_batch_size} x {full.num_microbatches}.",
        "",
        "Run: `.venv/bin/python benchmarks/autotune/bench_planner.py`",
        "",
    ]
    data = {
        "machine": machine(),
        "checked_instances": n_checked,
        "plan_96x16_seconds": times,
        "knob_settings": n_knobs,
        "heavy_ends": [
            dict(zip(("method", "ds_boundaries", "ds_step_s", "dp_boundaries", "dp_step_s"), r)) for r in rows
        ],
        "heavy_full_search_step_s": full.predicted_step_time,
    }
    print("\n".join(md))
    write_report("autotune_planner", data, "\n".join(md))
    del tuned_k


if __name__ == "__main__":
    main()
