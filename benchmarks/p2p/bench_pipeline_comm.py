"""A 2-stage DeepSpeed pipeline step with and without compressed stage-to-stage traffic over a
bandwidth-limited link.

Both ranks run inside a fresh network namespace (``unshare -n``) whose loopback is shaped with
``tc tbf`` to each of ``--rates`` (default 1 Gbit/s and 200 Mbit/s). If the machine does not allow
that, the benchmark says so and runs on plain loopback. The model is cheap per element (channel
scale + tanh) on large activations, so communication dominates. For each codec the run first checks
the on-wire bytes against ``payload_nbytes`` (and the uncompressed engine's against the tensor bytes)
and the loss against the uncompressed run, then reports the byte ratio and the step-time speedup
next to the uncompressed engine measured in the same run, the link's own bandwidth (a plain send of
the same bytes), each rank's codec seconds and the speedup predicted from bytes and codec time alone.

    python benchmarks/p2p/bench_pipeline_comm.py [--rates 1gbit,200mbit] [--steps 3]
        # -> benchmarks/results/bench_pipeline_comm.{json,md}; run it on a quiet machine (load < 3)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

MB, GAS, T, D = 8, 4, 128, 1024  # one activation: 8 x 128 x 1024 fp32 = 4 MiB
CODECS = {
    "none": {},
    "quant8": {"activations": {"method": "quant", "bits": 8}, "gradients": {"method": "quant", "bits": 8}},
    "quant4/8": {"activations": {"method": "quant", "bits": 4}, "gradients": {"method": "quant", "bits": 8}},
    "quant4": {"activations": {"method": "quant", "bits": 4}, "gradients": {"method": "quant", "bits": 4}},
}
# The same codecs with blocking sends (overlap_sends=False): what the non-blocking sends buy.
BLOCKING = ("quant8", "quant4")


def _worker(steps: int) -> None:
    """One rank: time train steps for every codec, plus a raw send of one activation's bytes."""
    import deepspeed
    import torch
    from deepspeed import comm as dist
    from dist_utils import write_result
    from torch import nn

    import deepspeed_ppq
    from deepspeed_ppq.compress import payload_nbytes
    from deepspeed_ppq.config import load_ppq_config
    from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(D))

        def forward(self, x):
            return torch.tanh(x * self.w)

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    from deepspeed_ppq.ops import native_status

    env = {"threads": torch.get_num_threads(), "native": native_status()}
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(MB, T, D, generator=g), torch.randn(MB, T, D, generator=g)) for _ in range(GAS)]

    # Link bandwidth: a plain send of one activation's bytes, timed on the receiver.
    buf = torch.empty(MB, T, D)
    times = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    link = {"bytes": buf.numel() * 4, "seconds": min(times)}

    out = {"link": link, "codecs": {}, "env": env}
    runs = [(name, ppq, True) for name, ppq in CODECS.items()]
    runs += [(f"{name} blocking", CODECS[name], False) for name in BLOCKING]
    for name, ppq, overlap in runs:
        module = PPQPipelineModule([Scale(), Scale(), Scale(), Scale()], num_stages=2, boundaries=[0, 2, 4],
                                   loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD(module.parameters(), lr=0.01)
        cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS,
               "steps_per_print": 10**6, "ppq": ppq}
        engine, *_ = deepspeed_ppq.initialize(model=module, optimizer=opt, config=cfg, overlap_sends=overlap)
        first_loss = engine.train_batch(iter(batches)).item()  # warm-up (allocations, first meta)
        step_s = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(iter(batches))
            step_s.append(time.perf_counter() - t0)
        mine = engine.ppq_stats()  # this rank: what it encoded (sent) and decoded (received)
        rank_codec_s = sum(v["encode_s"] + v["decode_s"] for v in mine.values())
        stats = engine.ppq_stats(all_stages=True)
        c = load_ppq_config(ppq)
        theory = {}
        for d, codec in (("act", c.activations), ("grad", c.gradients)):
            s = stats[(0, d)]
            # the uncompressed engine's bytes go through DeepSpeed's own send: the tensor's bytes
            per_msg = payload_nbytes(codec, (MB, T, D), torch.float32) if codec.enabled else MB * T * D * 4
            theory[d] = s["messages"] * per_msg
        per_rank = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
        dist.all_gather(per_rank, torch.tensor([rank_codec_s], dtype=torch.float64))
        out["codecs"][name] = {"first_loss": first_loss, "step_s": step_s,
                               "rank_codec_s": [float(t) for t in per_rank],
                               "stats": {f"0.{d}": stats[(0, d)] for d in ("act", "grad")}, "theory": theory}
    write_result(out)


def _inner(args) -> dict:
    from dist_utils import run_ranks

    res = run_ranks(Path(__file__), 2, ["--worker", "--steps", str(args.steps)], threads=1)
    return res[0]


def _shaped_run(args, rate: str) -> tuple[dict, str]:
    """Run the ranks inside a network namespace with a shaped loopback; fall back to plain loopback."""
    cmd = (f"ip link set lo up && tc qdisc add dev lo root tbf rate {rate} burst 512kb latency 100ms && "
           f"{sys.executable} {Path(__file__)} --inner --steps {args.steps} --out {args.tmp} && "
           "tc -s qdisc show dev lo")
    if shutil.which("unshare") and shutil.which("tc"):
        p = subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True, text=True)
        if p.returncode == 0:
            res = json.loads(Path(args.tmp).read_text())
            # the shaper's own counters (sent, dropped, overlimits): drops make TCP wait for retransmits
            res["qdisc"] = " ".join(p.stdout.split()[-40:])
            return res, f"netns loopback shaped by tc tbf to {rate}"
        print("shaping the link failed, falling back to plain loopback:\n" + p.stderr[-2000:],
              file=sys.stderr)
    return _inner(args), "plain loopback (shaping not available)"


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _rows(res: dict) -> list[dict]:
    """Check bytes and losses, then one row per codec against the uncompressed engine of the same run.

    ``predicted`` splits the uncompressed step into link time (measured bytes / measured link bandwidth)
    and the rest (compute, engine), then puts the codec's wire bytes and the busier rank's codec time in:
    what the step would take if nothing but bytes and codec time changed. A measured speedup far below
    it points at something else (scheduling, load); one close to it says where the remaining time goes.
    """
    base = res["codecs"]["none"]
    t_base = _median(base["step_s"])
    n_steps = len(base["step_s"]) + 1  # counters include the warm-up step
    base_wire = sum(s["wire_bytes"] for s in base["stats"].values())  # measured on DeepSpeed's own path
    bw = res["link"]["bytes"] / res["link"]["seconds"]
    other = max(t_base - base_wire / n_steps / bw, 0.0)
    rows = []
    for name, r in res["codecs"].items():
        for d in ("act", "grad"):
            s = r["stats"][f"0.{d}"]
            assert s["wire_bytes"] == r["theory"][d], (name, d, s, r["theory"])  # bytes == payload_nbytes
            assert s["raw_bytes"] == base["stats"][f"0.{d}"]["raw_bytes"], (name, d)
        assert abs(r["first_loss"] - base["first_loss"]) <= 0.05 * abs(base["first_loss"]), (name, r)
        wire = sum(s["wire_bytes"] for s in r["stats"].values())
        t = _median(r["step_s"])
        codec_rank = max(r["rank_codec_s"]) / n_steps
        predicted = t_base / (other + wire / n_steps / bw + codec_rank)
        ratio, speed = base_wire / wire, t_base / t
        speed_min = min(base["step_s"]) / min(r["step_s"])
        rows.append({"codec": name, "step_s_median": t, "step_s_all": r["step_s"], "byte_ratio": ratio,
                     "speedup": speed, "speedup_over_byte_ratio": speed / ratio,
                     "speedup_of_fastest_steps": speed_min,
                     "predicted_speedup": predicted, "codec_s_per_step_busier_rank": codec_rank,
                     "codec_s_per_step_both_ranks": sum(r["rank_codec_s"]) / n_steps,
                     "loss_step0": r["first_loss"]})
    return rows


def _report(runs: list[tuple[str, dict, str]], args) -> tuple[dict, str]:
    import torch
    from _harness import loadavg, machine_line

    m = {**args.machine, "loadavg_end": loadavg()}
    meta = {"activation_shape": [MB, T, D], "micro_batches": GAS, "timed_steps": args.steps,
            "torch": torch.__version__, "machine": machine_line(m), "machine_record": m, "date": m["date"],
            "load_avg_before": args.load, "rank_env": runs[0][1].get("env")}
    md = ["# bench_pipeline_comm: 2-stage DeepSpeed pipeline step over a bandwidth-limited link", "",
          f"Activation {MB}x{T}x{D} fp32 (4 MiB), {GAS} micro-batches per step, both directions; "
          f"{meta['machine']}, torch {meta['torch']}, {meta['date'][:16]}, load average before the run "
          f"{args.load}. Rank threads/native kernels: {meta['rank_env']}.", "",
          "Byte ratio: bytes between the stages of the uncompressed engine (measured by its counters) over "
          "the codec's. Speedup: median step of the uncompressed engine over the codec's (and the same for "
          "the fastest step of each, less exposed to other processes on a shared CPU). Serial model: the "
          "uncompressed step split into link time (bytes / measured link) and the rest, with the link "
          "time scaled to the codec's bytes and the busier rank's codec time added -- it assumes nothing "
          "overlaps, so a measured speedup above it means transfers overlapped compute.", ""]
    out_runs = []
    for rate, res, link in runs:
        rows = _rows(res)
        lk = res["link"]
        gbps = lk["bytes"] / lk["seconds"] / 1e9
        out_runs.append({"rate": rate, "link": link, "link_GBps_measured": gbps, "rows": rows,
                         "qdisc": res.get("qdisc")})
        md += [f"## {link}", "",
               f"Measured link: {gbps:.3f} GB/s (a plain send of one 4 MiB activation). Shaper counters "
               f"after the run: `{res.get('qdisc', 'n/a')}`", "",
               "| codec | step s (median) | byte ratio | speedup vs none | speedup / byte ratio | "
               "fastest-step speedup / byte ratio | serial-model speedup | codec s/step (busier rank) |",
               "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            md.append(f"| {r['codec']} | {r['step_s_median']:.3f} | {r['byte_ratio']:.2f} "
                      f"| {r['speedup']:.2f} | {r['speedup_over_byte_ratio']:.2f} "
                      f"| {r['speedup_of_fastest_steps'] / r['byte_ratio']:.2f} "
                      f"| {r['predicted_speedup']:.2f} | {r['codec_s_per_step_busier_rank']:.3f} |")
        md.append("")
    return {"meta": meta, "runs": out_runs}, "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--inner", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rates", default="1gbit,200mbit", help="comma-separated tc rates, one run each")
    p.add_argument("--out", default=None)
    p.add_argument("--tmp", default="/tmp/ppq_bench_pipeline_comm.json")
    args = p.parse_args()
    if args.worker:
        return _worker(args.steps)
    if args.inner:
        Path(args.out).write_text(json.dumps(_inner(args)))
        return
    from _harness import machine

    args.machine = machine()
    args.load = args.machine["loadavg"]
    runs = []
    for rate in args.rates.split(","):
        res, link = _shaped_run(args, rate)
        runs.append((rate, res, link))
        if link.startswith("plain"):
            break  # no shaping: one run says it all
    data, md = _report(runs, args)
    print(md)
    out = ROOT / "benchmarks" / "results"
    (out / "bench_pipeline_comm.json").write_text(json.dumps(data, indent=1))
    (out / "bench_pipeline_comm.md").write_text(md)


if __name__ == "__main__":
    main()
