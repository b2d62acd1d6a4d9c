"""A 2-stage DeepSpeed pipeline step with and without compressed stage-to-stage traffic over a
bandwidth-limited link.

Both ranks run inside a fresh network namespace (``unshare -n``) whose loopback is shaped with
``tc tbf`` to ``--rate`` (default 1 Gbit/s). If the machine does not allow that, the benchmark says so
and runs on plain loopback. The model is cheap per element (channel scale + tanh) on large activations,
so communication dominates; for each codec the run first checks the on-wire bytes against
``payload_nbytes`` and the loss against the uncompressed run, then reports the byte ratio and the
step-time speedup next to the uncompressed engine measured in the same run, and the link's own
bandwidth (a plain send of the same bytes).

    python benchmarks/p2p/bench_pipeline_comm.py   # -> benchmarks/results/bench_pipeline_comm.{json,md}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

MB, GAS, T, D = 8, 4, 128, 1024  # one activation: 8 x 128 x 1024 fp32 = 4 MiB
CODECS = {
    "none": {},
    "quant8": {"activations": {"method": "quant", "bits": 8}, "gradients": {"method": "quant", "bits": 8}},
    "quant4/8": {"activations": {"method": "quant", "bits": 4}, "gradients": {"method": "quant", "bits": 8}},
    "quant4": {"activations": {"method": "quant", "bits": 4}, "gradients": {"method": "quant", "bits": 4}},
}


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

    out = {"link": link, "codecs": {}}
    for name, ppq in CODECS.items():
        module = PPQPipelineModule([Scale(), Scale(), Scale(), Scale()], num_stages=2, boundaries=[0, 2, 4],
                                   loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD(module.parameters(), lr=0.01)
        cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS,
               "steps_per_print": 10**6, "ppq": ppq}
        engine, *_ = deepspeed_ppq.initialize(model=module, optimizer=opt, config=cfg)
        first_loss = engine.train_batch(iter(batches)).item()  # warm-up (allocations, first meta)
        step_s = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(iter(batches))
            step_s.append(time.perf_counter() - t0)
        stats = engine.ppq_stats(all_stages=True)
        c = load_ppq_config(ppq)
        theory = {}
        for d, codec in (("act", c.activations), ("grad", c.gradients)):
            s = stats[(0, d)]
            per_msg = payload_nbytes(codec, (MB, T, D), torch.float32) if codec.enabled else 0
            theory[d] = s["messages"] * per_msg
        out["codecs"][name] = {"first_loss": first_loss, "step_s": step_s,
                               "stats": {f"0.{d}": stats[(0, d)] for d in ("act", "grad")}, "theory": theory}
    write_result(out)


def _inner(args) -> dict:
    from dist_utils import run_ranks

    res = run_ranks(Path(__file__), 2, ["--worker", "--steps", str(args.steps)], threads=1)
    return res[0]


def _shaped_run(args) -> tuple[dict, str]:
    """Run the ranks inside a network namespace with a shaped loopback; fall back to plain loopback."""
    cmd = (f"ip link set lo up && tc qdisc add dev lo root tbf rate {args.rate} burst 512kb latency 100ms && "
           f"{sys.executable} {Path(__file__)} --inner --steps {args.steps} --out {args.tmp}")
    if shutil.which("unshare") and shutil.which("tc"):
        p = subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True, text=True)
        if p.returncode == 0:
            return json.loads(Path(args.tmp).read_text()), f"netns loopback shaped by tc tbf to {args.rate}"
        print("shaping the link failed, falling back to plain loopback:\n" + p.stderr[-2000:],
              file=sys.stderr)
    return _inner(args), "plain loopback (shaping not available)"


def _report(res: dict, link: str, args) -> tuple[dict, str]:
    import torch

    base = res["codecs"]["none"]
    t_base = sorted(base["step_s"])[len(base["step_s"]) // 2]
    raw_total = sum(s["raw_bytes"] for s in res["codecs"]["quant8"]["stats"].values())
    rows = []
    for name, r in res["codecs"].items():
        for d in ("act", "grad"):
            s = r["stats"][f"0.{d}"]
            assert s["wire_bytes"] == r["theory"][d], (name, d, s, r["theory"])  # bytes == payload_nbytes
        assert abs(r["first_loss"] - base["first_loss"]) <= 0.05 * abs(base["first_loss"]), (name, r)
        wire = sum(s["wire_bytes"] for s in r["stats"].values()) or raw_total
        t = sorted(r["step_s"])[len(r["step_s"]) // 2]
        codec_s = sum(s["encode_s"] + s["decode_s"] for s in r["stats"].values()) / (len(r["step_s"]) + 1)
        ratio, speed = raw_total / wire, t_base / t
        rows.append({"codec": name, "step_s_median": t, "step_s_all": r["step_s"], "byte_ratio": ratio,
                     "speedup": speed, "speedup_over_byte_ratio": speed / ratio,
                     "codec_s_per_step_both_ranks": codec_s, "loss_step0": r["first_loss"]})
    lk = res["link"]
    meta = {"link": link, "link_GBps_measured": lk["bytes"] / lk["seconds"] / 1e9,
            "activation_shape": [MB, T, D], "micro_batches": GAS, "timed_steps": args.steps,
            "torch": torch.__version__, "machine": _machine(), "date": datetime.datetime.now().isoformat()}
    md = [f"# bench_pipeline_comm: 2-stage DeepSpeed pipeline step, {link}", "",
          f"Measured link: {meta['link_GBps_measured']:.3f} GB/s for a plain send of one 4 MiB activation. "
          f"Activation {MB}x{T}x{D} fp32, {GAS} micro-batches per step; {meta['machine']}, torch "
          f"{meta['torch']}, {meta['date'][:16]}.", "",
          "| codec | step s (median) | byte ratio | speedup vs none | speedup / byte ratio | codec s/step |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['codec']} | {r['step_s_median']:.3f} | {r['byte_ratio']:.2f} | {r['speedup']:.2f} | "
                  f"{r['speedup_over_byte_ratio']:.2f} | {r['codec_s_per_step_both_ranks']:.3f} |")
    return {"meta": meta, "rows": rows}, "\n".join(md) + "\n"


def _machine() -> str:
    model = "?"
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.machine()}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--inner", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--out", default=None)
    p.add_argument("--tmp", default="/tmp/ppq_bench_pipeline_comm.json")
    args = p.parse_args()
    if args.worker:
        return _worker(args.steps)
    if args.inner:
        Path(args.out).write_text(json.dumps(_inner(args)))
        return
    res, link = _shaped_run(args)
    data, md = _report(res, link, args)
    print(md)
    out = ROOT / "benchmarks" / "results"
    (out / "bench_pipeline_comm.json").write_text(json.dumps(data, indent=1))
    (out / "bench_pipeline_comm.md").write_text(md)


if __name__ == "__main__":
    main()
