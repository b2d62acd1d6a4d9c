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
   re-quantize) vs master-free (dequantize + AdamW + SR re-quantize) with fp32 or 8-bit states, both
   the fused op (``ppq::master_free_adamw_step_``, what a training step runs) and the same update as
   three ops (dequantize to a dense fp32 copy, the AdamW op or torch ops, the SR op: what it cost
   before the fused op), checked equal first; and the SR quantize ops (int8, fp8 e4m3/e5m2; fp32 and
   bf16 weights) and the round-to-nearest ones against a copy of the weight (bytes read + written
   per second; target: SR >= 0.5x copy). Timing: benchmarks/_harness.py.
Results: benchmarks/results/bench_master_free_<ISA path>.{json,md}, with the machine, load and kernel path.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import loadavg, machine, machine_line, results_name, time_against, write_report, x_copy  # noqa: E402

from deepspeed_ppq.config import WeightsConfig  # noqa: E402
from deepspeed_ppq.models.gpt import GPT, GPTConfig, gpt_loss, layer_kinds  # noqa: E402
from deepspeed_ppq.ops import has_kernel, registered_ops  # noqa: E402
from deepspeed_ppq.quant import (  # noqa: E402
    QuantLinear,
    attach_master_free,
    build_optimizer,
    convert_model,
    ledger_from_model,
    ledger_from_shapes,
    measure_storage,
    requantize_after_step,
)
from deepspeed_ppq.quant import ops as wops  # noqa: E402
from deepspeed_ppq.quant.adam8bit import adam8bit_step  # noqa: E402
from deepspeed_ppq.quant.ledger import ParamSpec  # noqa: E402
from deepspeed_ppq.quant.master_free import shared_code_maps  # noqa: E402
from deepspeed_ppq.quant.sr_ops import weight_quantize_sr_out  # noqa: E402

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
    return WeightsConfig(
        format=fmt, master=master, optimizer_8bit=o8, keep_first_blocks=0, keep_last_blocks=0
    )


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
        led = ledger_from_shapes(
            ents,
            _wcfg(fmt, master, o8),
            optimizer="adamw8bit" if o8 else "adamw",
            compute_dtype=torch.float32,
        )
        rows.append({"setting": label, "bytes": led.total, "groups": led.groups()})
    return rows


def _alternate(fn, base, reps):
    """Run base and fn alternately (benchmarks/_harness.py): medians and their ratio fn / base."""
    t = time_against(fn, base, reps)
    return t.op, t.base, t.op / t.base


def _three_op_update(mf, g):
    """The master-free update as three ops on a dense fp32 copy (before the fused op): dequantize, AdamW
    (the 8-bit op, or torch's in-place ops on fp32 moments), SR quantize. Works on copies of the
    layer's codes, scales and states."""
    qw, st = mf.qweight, {k: v.clone() for k, v in mf.optim_state.items()}
    codes, scales = qw.qdata.clone(), qw.scale.clone()
    q1, q2 = shared_code_maps()[str(g.device)] if "state1" in st else (None, None)  # the layer's maps
    t = mf.optim_step + 1

    def run():
        w = wops.weight_dequantize(codes, scales, qw.fmt.value, qw.block_size, qw.shape, torch.float32)
        if "state1" in st:
            adam8bit_step(w, g, st["state1"], st["state2"], st["absmax1"], st["absmax2"], q1, q2, beta1=0.9,
                          beta2=0.999, eps=1e-8, step=t, lr=1e-3, weight_decay=0.01)
        else:
            st["exp_avg"].lerp_(g, 0.1)
            st["exp_avg_sq"].mul_(0.999).addcmul_(g, g, value=0.001)
            w.mul_(1 - 1e-3 * 0.01)
            denom = (st["exp_avg_sq"].sqrt() / (1 - 0.999**t) ** 0.5).add_(1e-8)
            w.addcdiv_(st["exp_avg"], denom, value=-1e-3 / (1 - 0.9**t))
        weight_quantize_sr_out(w, qw.fmt.value, qw.block_size, mf.sr_seed, t * w.numel(), codes, scales)
        return codes, scales, st

    return run


def _check_three_ops_equal_fused(mf, g, three):
    """The fused op and the three ops agree on the next step (8-bit states: bit for bit; fp32 moments:
    the torch ops round differently, so the codes agree but for a few values)."""
    codes, scales, st = three()
    mf.weight_grad.copy_(g)
    from deepspeed_ppq.quant.master_free import master_free_step

    master_free_step([mf], 1e-3, weight_decay=0.01)
    differ = int((mf.qweight.qdata.view(torch.uint8) != codes.view(torch.uint8)).sum())
    if "state1" in st:
        assert differ == 0 and torch.equal(mf.qweight.scale, scales), "fused 8-bit update != three ops"
    else:
        assert differ <= mf.qweight.qdata.numel() // 1000, f"fused: {differ} codes differ from the three ops"


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
    registered_ops()["weight_quantize_sr_out"](w, "int8", 64, 5, 123, c_ref, s_ref)  # its reference
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
    rows.append(
        {
            "op": "fp32 master: Adam + requantize_ (RTN)",
            "ms": 1e3 * t,
            "base_ms": 1e3 * tb,
            "x_base": r,
            "base": "dense Adam step",
        }
    )
    n = out_f * in_f
    for o8 in (False, True):
        mf = layer("none", o8)
        holder = nn.Sequential(mf)
        mopt = torch.optim.AdamW(holder.parameters(), lr=1e-3)
        attach_master_free(mopt, holder)
        # the gradient buffer as backward leaves it; the step reads it and never writes it, so it is set
        # once (copying it in every timed step had charged the fused op 16 MB of traffic the three ops,
        # which read g as it is, did not pay)
        mf.weight_grad = g.clone()

        def mf_step(mopt=mopt):
            mopt.step()  # bias (4096 values) + the hook: the fused dequantize, AdamW, SR re-quantize

        mf_step()  # the states exist from here on
        three = _three_op_update(mf, g)
        _check_three_ops_equal_fused(mf, g, three)
        label = f"AdamW{'8bit' if o8 else ''}"
        t, tb, r = _alternate(mf_step, dense_step, reps)
        op = f"master-free, fused op: dequant + {label} + SR"
        rows.append({"op": op, "ms": 1e3 * t, "base_ms": 1e3 * tb, "x_base": r, "base": "dense Adam step",
                     "ns_per_param": 1e9 * t / n})
        t3, tf, r3 = _alternate(three, lambda mf_step=mf_step: mf_step(), reps)
        op = f"master-free, three ops (dense fp32 copy): dequant + {label} + SR"
        rows.append({"op": op, "ms": 1e3 * t3, "base_ms": 1e3 * tf, "x_base": r3, "base": "the fused op",
                     "ns_per_param": 1e9 * t3 / n})
    rows.append(
        {
            "op": "SR quantize, blocks of 64 (C++), against a copy of the fp weight (x copy: bytes/s, "
            "fp + codes + scales over 2 x fp)",
            "ms": None,
            "base_ms": None,
            "x_base": None,
            "base": "",
        }
    )
    def sr_rows(wd, fmt):
        buf = torch.empty_like(wd)
        c = torch.empty(wd.numel(), dtype=wops.code_dtype(fmt))
        fp = wd.numel() * wd.element_size()
        op_bytes = fp + c.numel() + scales.numel() * 4
        for name, fn in (
            ("SR", lambda: weight_quantize_sr_out(wd, fmt, 64, 5, 123, c, scales)),
            ("RTN", lambda: wops.weight_quantize_out(wd, fmt, 64, c, scales)),
        ):
            t = time_against(fn, lambda: buf.copy_(wd), reps)
            rows.append(
                {
                    "op": f"{name} quantize {fmt} {str(wd.dtype)[6:]}",
                    "ms": 1e3 * t.op,
                    "base_ms": 1e3 * t.base,
                    "x_base": t.op / t.base,
                    "base": "copy of the fp weight",
                    "x_copy": x_copy(op_bytes, t.op, 2 * fp, t.base),
                    "ns_per_param": 1e9 * t.op / wd.numel(),
                }
            )

    for dt in (torch.float32, torch.bfloat16):
        for fmt in ("int8", "fp8_e4m3", "fp8_e5m2"):
            sr_rows(w.to(dt), fmt)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not has_kernel("weight_quantize_sr_out"):
        raise SystemExit("the C++ extension is not built (make build)")
    m = machine()
    mem = measured_memory()
    proj = projected_stage()
    times = step_times(args.reps)
    m["loadavg_end"] = loadavg()
    meta = {"threads": args.threads, "reps": args.reps}
    lines = [
        "# Master-free low-bit training: memory and update time\n",
        machine_line(m) + " Timings on a shared machine are noisy: see the ratios of alternating runs.",
        f"Command: `.venv/bin/python benchmarks/quant/bench_master_free.py --threads {args.threads}`\n",
        "## Measured: small GPT (d=256, 4 blocks, all blocks low-bit), after a backward "
        "(measured == ledger in every row)\n",
    ]
    cats = sorted({k for r in mem for k in r["groups"]})
    lines.append("| setting | total MiB | x fp32 | " + " | ".join(cats) + " |")
    lines.append("|" + "---|" * (3 + len(cats)))
    for r in mem:
        lines.append(
            f"| {r['setting']} | {r['bytes'] / 2**20:.2f} | {r['bytes'] / mem[0]['bytes']:.3f} | "
            + " | ".join(f"{r['groups'].get(c, 0) / 2**20:.2f}" for c in cats)
            + " |"
        )
    lines += [
        "",
        "## Ledger projection: embedding 50304x2048 + 6 blocks d=2048 (GiB)\n",
        "| setting | total GiB | x fp32 |",
        "|---|---|---|",
    ]
    base = proj[0]["bytes"]
    lines += [f"| {r['setting']} | {r['bytes'] / GiB:.3f} | {r['bytes'] / base:.3f} |" for r in proj]
    lines += [
        "",
        "## Update time of one 4096x1024 int8 layer (medians; ratio of alternating pairs)\n",
        "x baseline = time / baseline time (lower is faster); ns/param = time / values of the layer; "
        "x copy = bytes read + written per second over the copy's (target for SR quantize: "
        ">= 0.5).\n",
        "| op | ms | ns/param | baseline | baseline ms | x baseline | x copy |",
        "|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines += [
        f"| {r['op']} | {f(r['ms'], '.2f')} | {f(r.get('ns_per_param'), '.2f')} | {r['base']} | "
        f"{f(r['base_ms'], '.2f')} | "
        f"{f(r['x_base'], '.2f')} | {f(r.get('x_copy'), '.2f')} |"
        for r in times
    ]
    md = "\n".join(lines) + "\n"
    print(md)
    write_report(results_name("bench_master_free"),
                 {"machine": m, "meta": meta, "measured": mem, "projected": proj, "times": times}, md)


if __name__ == "__main__":
    main()
