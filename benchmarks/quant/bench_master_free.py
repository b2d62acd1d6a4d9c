"""Master-free low-bit training (weights.master="none"): bytes and optimizer-step time against the fp32
master path and dense fp32, measured in one run.

    .venv/bin/python benchmarks/quant/bench_master_free.py [--threads 2] [--reps 7]

1. Check first: the C++ stochastic-rounding kernel equals the reference bit for bit on the benchmark
   tensor, and the live model's measured bytes equal the ledger's prediction in every setting.
2. Memory of a small GPT stage trained for two steps (measured with ``measure_storage`` after a
   backward, when gradients and optimizer states are all alive), and the ledger's projection for a
   larger stage (embedding 50304 x 2048 + 6 blocks of d=2048; what W2 reported as 6.04 GiB fp32 +
   Adam and 6.43 GiB int8 + Adam with an fp32 master).
3. Update time of one 4096 x 1024 layer, each against ``torch.optim.Adam`` on the dense fp32 weight
   measured alternately in the same run (ratio of medians): fp32 master (Adam step + round-to-nearest
   re-quantize) vs master-free (dequantize + AdamW + SR re-quantize) with fp32 or 8-bit states; and
   the SR quantize op alone against the round-to-nearest op and a copy of the same fp32 bytes.
Results: benchmarks/results/bench_master_free.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
from torch import nn

from deepspeed_ppq.config import WeightsConfig
from deepspeed_ppq.models.gpt import GPT, GPTConfig, gpt_loss, layer_kinds
from deepspeed_ppq.ops import has_kernel
from deepspeed_ppq.quant import (
    QuantLinear,
    attach_master_free,
    build_optimizer,
    convert_model,
    ledger_from_model,
    ledger_from_shapes,
    measure_storage,
    requantize_after_step,
)
from deepspeed_ppq.quant import ops as wops
from deepspeed_ppq.quant.ledger import ParamSpec
from deepspeed_ppq.quant.sr_ops import _quantize_sr_out_ref, weight_quantize_sr_out

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "..", "results")
GiB = 2**30

SETTINGS = [  # label, format, master, 8-bit states (master-free layers and the main optimizer)
    ("fp32 + Adam", "none", "fp32", False),
    ("int8 + fp32 master + Adam", "int8", "fp32", False),
    ("int8 + fp32 master + Adam8bit", "int8", "fp32", True),
    ("int8 master-free + AdamW", "int8", "none", False),
    ("int8 master-free + AdamW8bit", "int8", "none", True),
    ("fp8_e4m3 master-free + AdamW8bit", "fp8_e4m3", "none", True),
]


def _wcfg(fmt, master, o8):
    return WeightsConfig(format=fmt, master=master, optimizer_8bit=o8, keep_first_blocks=0,
                         keep_last_blocks=0)


def measured_memory() -> list[dict]:
    cfg = GPTConfig(vocab_size=512, seq_len=64, d_model=256, n_heads=4, n_layers=4)
    blocks = [i for i, k in enumerate(layer_kinds(cfg)) if k == "block"]
    rows = []
    for label, fmt, master, o8 in SETTINGS:
        model = GPT(cfg, seed=0)
        if fmt != "none":
            convert_model(model, _wcfg(fmt, master, o8), block_layers=blocks)
        kind = "adamw8bit" if o8 else "adamw"
        opt = build_optimizer(model.parameters(), kind, lr=1e-3)
        if master == "none":
            attach_master_free(opt, model)
        elif fmt != "none":
            requantize_after_step(opt, model)
        x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
        for _ in range(2):
            opt.zero_grad()
            gpt_loss(model(x), x).backward()
            opt.step()
        gpt_loss(model(x), x).backward()
        led = measure_storage(model, opt)
        pred = ledger_from_model(model, None, optimizer=kind)
        if led.bytes != pred.bytes:
            raise AssertionError(f"{label}: measured {led.bytes} != predicted {pred.bytes}")
        rows.append({"setting": label, "bytes": led.total, "groups": led.groups()})
    return rows


def projected_stage() -> list[dict]:
    d, nblocks = 2048, 6
    rows = []
    for label, fmt, master, o8 in SETTINGS:
        ents = [ParamSpec("embed", (50304, d))]
        for b in range(nblocks):
            for nm, shp in (("qkv", (3 * d, d)), ("proj", (d, d)), ("fc", (4 * d, d)), ("fc2", (d, 4 * d))):
                ents.append(ParamSpec(f"{b}.{nm}.weight", shp, fmt))
                ents.append(ParamSpec(f"{b}.{nm}.bias", (shp[0],)))
            ents += [ParamSpec(f"{b}.ln{i}.{p}", (d,)) for i in (1, 2) for p in ("weight", "bias")]
        led = ledger_from_shapes(ents, _wcfg(fmt, master, o8), optimizer="adamw8bit" if o8 else "adamw",
                                 compute_dtype=torch.float32)
        rows.append({"setting": label, "bytes": led.total, "groups": led.groups()})
    return rows


def _alternate(fn, base, reps):
    """Run base and fn alternately; medians and the median of per-pair ratios."""
    fn()
    base()
    tf, tb, ratios = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        tb.append(t1 - t0)
        tf.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(tf), statistics.median(tb), statistics.median(ratios)


def step_times(reps: int) -> list[dict]:
    out_f, in_f = 4096, 1024
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f)
    g = torch.randn(out_f, in_f) * 1e-3

    dense = nn.Parameter(lin.weight.detach().clone())
    dense_opt = torch.optim.Adam([dense], lr=1e-3)

    def dense_step():
        dense.grad = g
        dense_opt.step()

    rows = []
    # check first: the SR kernel equals the reference on this tensor
    w = lin.weight.detach().contiguous()
    codes, scales = torch.empty(w.numel(), dtype=torch.int8), torch.empty(w.numel() // 64)
    weight_quantize_sr_out(w, "int8", 64, 5, 123, codes, scales)
    c_ref, s_ref = torch.empty_like(codes), torch.empty_like(scales)
    _quantize_sr_out_ref(w, "int8", 64, 5, 123, c_ref, s_ref)
    assert torch.equal(codes, c_ref) and torch.equal(scales, s_ref), "SR kernel != reference"

    def layer(master, o8):
        return QuantLinear.from_linear(lin, "int8", _wcfg("int8", master, o8))

    q = layer("fp32", False)
    qopt = torch.optim.Adam([q.weight], lr=1e-3)
    requantize_after_step(qopt, q)

    def master_step():
        q.weight.grad = g
        qopt.step()

    t, tb, r = _alternate(master_step, dense_step, reps)
    rows.append({"op": "fp32 master: Adam + requantize_ (RTN)", "ms": 1e3 * t, "base_ms": 1e3 * tb,
                 "x_base": r, "base": "dense Adam step"})
    for o8 in (False, True):
        mf = layer("none", o8)
        holder = nn.Sequential(mf)
        mopt = torch.optim.AdamW(holder.parameters(), lr=1e-3)
        attach_master_free(mopt, holder)
        mf.weight_grad = torch.zeros(out_f, in_f)

        def mf_step(mf=mf, mopt=mopt):
            mf.weight_grad.copy_(g)
            mopt.step()  # bias (4096 values) + the hook: dequantize, AdamW, SR re-quantize

        t, tb, r = _alternate(mf_step, dense_step, reps)
        label = f"master-free: dequant + AdamW{'8bit' if o8 else ''} + SR"
        rows.append({"op": label, "ms": 1e3 * t, "base_ms": 1e3 * tb, "x_base": r, "base": "dense Adam step"})
    buf = torch.empty_like(w)
    t, tb, r = _alternate(lambda: weight_quantize_sr_out(w, "int8", 64, 5, 123, codes, scales),
                          lambda: buf.copy_(w), reps)
    rows.append({"op": "SR quantize int8 (C++)", "ms": 1e3 * t, "base_ms": 1e3 * tb, "x_base": r,
                 "base": "copy of the fp32 bytes"})
    t, tb, r = _alternate(lambda: wops.weight_quantize_out(w, "int8", 64, codes, scales),
                          lambda: buf.copy_(w), reps)
    rows.append({"op": "RTN quantize int8 (C++)", "ms": 1e3 * t, "base_ms": 1e3 * tb, "x_base": r,
                 "base": "copy of the fp32 bytes"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not has_kernel("weight_quantize_sr_out"):
        raise SystemExit("the C++ extension is not built (make build)")
    mem = measured_memory()
    proj = projected_stage()
    times = step_times(args.reps)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    meta = {"torch": torch.__version__, "cpu": cpu, "cores": os.cpu_count(), "threads": args.threads,
            "date": datetime.date.today().isoformat(), "load_avg_1m": os.getloadavg()[0]}
    lines = ["# Master-free low-bit training: memory and update time\n",
             f"torch {meta['torch']}, {cpu}, {meta['cores']} cores, {args.threads} threads, {meta['date']}, "
             f"load average {meta['load_avg_1m']:.1f} (a shared machine: timings are noisy, see the ratios).",
             "Command: `.venv/bin/python benchmarks/quant/bench_master_free.py`\n",
             "## Measured: small GPT (d=256, 4 blocks, all blocks low-bit), after a backward "
             "(measured == ledger in every row)\n"]
    cats = sorted({k for r in mem for k in r["groups"]})
    lines.append("| setting | total MiB | x fp32 | " + " | ".join(cats) + " |")
    lines.append("|" + "---|" * (3 + len(cats)))
    for r in mem:
        lines.append(f"| {r['setting']} | {r['bytes'] / 2**20:.2f} | {r['bytes'] / mem[0]['bytes']:.3f} | "
                     + " | ".join(f"{r['groups'].get(c, 0) / 2**20:.2f}" for c in cats) + " |")
    lines += ["", "## Ledger projection: embedding 50304x2048 + 6 blocks d=2048 (GiB)\n",
              "| setting | total GiB | x fp32 |", "|---|---|---|"]
    base = proj[0]["bytes"]
    lines += [f"| {r['setting']} | {r['bytes'] / GiB:.3f} | {r['bytes'] / base:.3f} |" for r in proj]
    lines += ["", "## Update time of one 4096x1024 int8 layer (medians; ratio of alternating pairs)\n",
              "| op | ms | baseline | baseline ms | x baseline |", "|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['ms']:.2f} | {r['base']} | {r['base_ms']:.2f} | {r['x_base']:.2f} |"
              for r in times]
    md = "\n".join(lines) + "\n"
    print(md)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "bench_master_free.json"), "w") as f:
        json.dump({"meta": meta, "measured": mem, "projected": proj, "times": times}, f, indent=1)
    with open(os.path.join(RESULTS, "bench_master_free.md"), "w") as f:
        f.write(md)


if __name__ == "__main__":
    main()
