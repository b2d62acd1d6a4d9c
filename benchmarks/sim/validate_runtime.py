"""Simulated vs measured step time of real DeepSpeed pipeline training on 2 CPU ranks (gloo).

For each configuration, each rank (one thread, one core) builds a ``PipelineModule`` of MLP blocks,
1. profiles its own layers in isolation: forward and backward time per layer for one micro-batch
   (medians) and the optimizer step; measures the link with a ping-pong of the boundary tensor;
2. trains with DeepSpeed's ``PipelineEngine`` (``TrainSchedule``), alternating profile steps (each
   engine instruction timed: per-stage F, B, optimizer) with measured steps (nothing timed inside);
then the launcher simulates the ``deepspeed`` schedule from the profile (blocking links, as
DeepSpeed's ``p2p.send``) and compares with the median measured step. The simulation from the
isolated per-layer profile is reported beside it: it misses the engine's own per-instruction work
(buffer clones, loss) and, on a machine other processes share, a different load.

    .venv/bin/python benchmarks/sim/validate_runtime.py            # writes benchmarks/results/sim_validate_*

On CPU ranks over gloo, compute dominates the step, so the figures test the simulator's schedule model
(which rank waits for which) more than its link model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CONFIGS = [
    # name, layers, hidden, micro-batch size, micro-batches, layer boundaries (None: uniform)
    dict(name="balanced_m4", layers=8, hidden=512, mbs=64, m=4, parts=None),
    dict(name="balanced_m8", layers=8, hidden=768, mbs=32, m=8, parts=None),
    dict(name="unbalanced_m6", layers=9, hidden=640, mbs=48, m=6, parts=[0, 6, 9]),
]


def _block(h: int):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(h, 2 * h), torch.nn.GELU(), torch.nn.Linear(2 * h, h))


def _median_time(fn, reps: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def rank_main(cfg: dict, steps: int) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from dist_utils import write_result

    torch.set_num_threads(1)
    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    h, mbs, m = cfg["hidden"], cfg["mbs"], cfg["m"]

    class Explicit(PipelineModule):
        def _partition_layers(self, method="uniform"):
            if cfg["parts"] is None:
                return super()._partition_layers(method)
            self.parts = list(cfg["parts"])
            self._set_bounds(self.parts[self.stage_id], self.parts[self.stage_id + 1])

    model = Explicit(layers=[_block(h) for _ in range(cfg["layers"])], num_stages=2,
                     loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    local = list(model.forward_funcs)

    # 1. Profile this rank's layers on one micro-batch.
    x = torch.randn(mbs, h)
    fwd, bwd = [], []
    for layer in local:
        inp = x.clone().requires_grad_(True)
        fwd.append(_median_time(lambda layer=layer, inp=inp: layer(inp)))
        out = layer(inp)
        g = torch.randn_like(out)

        def back(layer=layer, inp=inp, g=g):
            layer(inp).backward(g)

        bwd.append(max(0.0, _median_time(back) - fwd[-1]))
    params = [p for p in model.parameters()]
    opt_probe = torch.optim.SGD(params, lr=1e-3)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt_time = _median_time(opt_probe.step)
    # Link: ping-pong of one boundary tensor (fp32 [mbs, h]).
    buf = torch.zeros(mbs, h)

    def pingpong():
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    dist.barrier()
    link_rtt = _median_time(pingpong, reps=20, warmup=3)
    small = torch.zeros(1)

    def ping_small():
        if rank == 0:
            dist.send(small, 1)
            dist.recv(small, 1)
        else:
            dist.recv(small, 0)
            dist.send(small, 0)

    small_rtt = _median_time(ping_small, reps=20, warmup=3)
    dist.barrier()

    # 2. Real DeepSpeed pipeline training.
    ds_cfg = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": m,
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_cfg)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(mbs, h, generator=gen), torch.randn(mbs, h, generator=gen)) for _ in range(m)]

    def batches():
        while True:
            yield from data

    # Profile steps time each engine instruction; measured steps run untouched. They alternate, so
    # both see the same load from whatever else runs on the machine.
    timings: dict[str, list[float]] = {}
    profiling = [False]

    def timed(fn, name):
        def run(self, *a, **kw):
            if not profiling[0]:
                return fn(self, *a, **kw)
            t0 = time.perf_counter()
            out = fn(self, *a, **kw)
            timings.setdefault(name, []).append(time.perf_counter() - t0)
            return out
        return run

    engine._INSTRUCTION_MAP = {k: timed(v, k.__name__) for k, v in type(engine)._INSTRUCTION_MAP.items()}
    it = batches()
    engine.train_batch(it)  # warm-up: buffers, shape exchange
    step_times, profiles = [], []
    for i in range(2 * steps):
        profiling[0] = i % 2 == 0
        timings.clear()
        dist.barrier()
        t = time.perf_counter()
        engine.train_batch(it)
        dist.barrier()
        if profiling[0]:
            med = {k: statistics.median(v) for k, v in timings.items()}
            profiles.append({
                "forward": med["ForwardPass"] + med.get("LoadMicroBatch", 0.0),
                "backward": med["BackwardPass"],
                "optimizer": sum(med.get(k, 0.0) for k in ("OptimizerStep", "ReduceGrads",
                                                           "ReduceTiedGrads")),
            })
        else:
            step_times.append(time.perf_counter() - t)
    write_result({"rank": rank, "fwd": fwd, "bwd": bwd, "opt": opt_time, "link_rtt": link_rtt,
                  "small_rtt": small_rtt, "step_times": step_times, "boundary_bytes": mbs * h * 4,
                  "engine_profiles": profiles})


def simulate_config(cfg: dict, ranks: list[dict]) -> dict:
    """Simulate DeepSpeed's TrainSchedule from (a) the engine-instrumented per-stage profile and (b) the
    isolated per-layer profile, and compare both with the measured median step time."""
    from deepspeed_ppq.schedule import LinkModel, StageCost, build_schedule, simulate

    nbytes = ranks[0]["boundary_bytes"]
    lat = min(r["small_rtt"] for r in ranks) / 2
    per_msg = min(r["link_rtt"] for r in ranks) / 2
    bw = nbytes / max(per_msg - lat, 1e-9)
    link = LinkModel(latency_s=lat, bandwidth_Bps=bw, overlap=False)
    sched = build_schedule("deepspeed", 2, cfg["m"])
    # Pair each measured step with the profile step just before it (same load from other processes).
    pairs = []
    for i in range(len(ranks[0]["step_times"])):
        costs = [StageCost(r["engine_profiles"][i]["forward"], r["engine_profiles"][i]["backward"],
                           optimizer=r["engine_profiles"][i]["optimizer"]) for r in ranks]
        sim = simulate(sched, costs, [(nbytes, nbytes)], link)
        pairs.append((sim.step_time, max(r["step_times"][i] for r in ranks), sim.bubble_fraction, costs))
    errors = [s / m - 1 for s, m, _, _ in pairs]
    k = min(range(len(pairs)), key=lambda j: abs(errors[j] - statistics.median(errors)))
    engine_costs = pairs[k][3]
    layer_costs = [StageCost(sum(r["fwd"]), sum(r["bwd"]), optimizer=r["opt"]) for r in ranks]
    sim_layers = simulate(sched, layer_costs, [(nbytes, nbytes)], link)
    per_step = [m for _, m, _, _ in pairs]
    return {"config": cfg, "simulated_s": statistics.median(s for s, _, _, _ in pairs),
            "measured_s": statistics.median(per_step), "error": statistics.median(errors),
            "errors_per_pair": errors, "bubble_fraction": statistics.median(b for _, _, b, _ in pairs),
            "simulated_from_isolated_layers_s": sim_layers.step_time,
            "stage_forward_s": [c.forward for c in engine_costs],
            "stage_backward_s": [c.backward_input for c in engine_costs],
            "optimizer_s": [c.optimizer for c in engine_costs],
            "isolated_layer_forward_s": [r["fwd"] for r in ranks],
            "isolated_layer_backward_s": [r["bwd"] for r in ranks],
            "link_latency_s": lat, "link_bandwidth_Bps": bw,
            "measured_step_times_s": per_step, "simulated_step_times_s": [s for s, _, _, _ in pairs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=9, help="measured steps (as many profile steps between)")
    ap.add_argument("--configs", nargs="*", default=[c["name"] for c in CONFIGS])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sim_validate_runtime"))
    ap.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_config:
        rank_main(json.loads(args.rank_config), args.steps)
        return 0

    import torch
    from dist_utils import run_ranks

    rows = []
    for cfg in CONFIGS:
        if cfg["name"] not in args.configs:
            continue
        ranks = run_ranks(Path(__file__).resolve(), 2,
                          ["--rank-config", json.dumps(cfg), "--steps", str(args.steps)], timeout=900)
        rows.append(simulate_config(cfg, ranks))
        r = rows[-1]
        print(f"{cfg['name']:<16} simulated {r['simulated_s'] * 1e3:8.1f} ms  measured "
              f"{r['measured_s'] * 1e3:8.1f} ms  error {r['error']:+.1%}  (from isolated layer profile: "
              f"{r['simulated_from_isolated_layers_s'] * 1e3:.1f} ms)", flush=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _harness import loadavg, machine, machine_line

    m = machine()
    meta = {"torch": torch.__version__, "deepspeed": __import__("deepspeed").__version__,
            "machine": machine_line({**m, "loadavg_end": loadavg()}), "machine_record": m,
            "date": m["date"],
            "command": "python benchmarks/sim/validate_runtime.py", "ranks": 2, "threads_per_rank": 1}
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    lines = ["# Simulated vs measured DeepSpeed pipeline step time (2 CPU ranks, gloo)", "",
             f"{meta['date']}, torch {meta['torch']}, deepspeed {meta['deepspeed']}, {meta['machine']}. "
             f"Command: `{meta['command']}`.", "",
             "Simulated: DeepSpeed's TrainSchedule order, per-stage F/B/optimizer times from profile steps "
             "(engine instructions timed) alternating with the measured steps; blocking links from a "
             "ping-pong. Each measured step is compared with the simulation from the profile step just "
             "before it (the load from other processes changes); error = median of those pairs. The last "
             "column simulates from per-layer times measured in isolation instead.", "",
             "| config | layers | hidden | mbs | m | simulated ms | measured ms | error | sim bubble "
             "| sim from isolated layers ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["config"]
        lines.append(f"| {c['name']} | {c['layers']} | {c['hidden']} | {c['mbs']} | {c['m']} | "
                     f"{r['simulated_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | {r['error']:+.1%} | "
                     f"{r['bubble_fraction']:.2f} | {r['simulated_from_isolated_layers_s'] * 1e3:.1f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    bad = [r["config"]["name"] for r in rows if abs(r["error"]) > 0.15]
    print("within 15%" if not bad else f"outside 15%: {bad}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
