"""8-bit Adam on CPU: our fused step (``ppq::adam8bit_blockwise_step_``) against bitsandbytes' CPU
backend and torch's fp32 Adam, in one run.

    .venv/bin/python benchmarks/quant/bench_adam8bit.py [--numel 4194304] [--reps 9] [--threads 1]

First the check: one step of ours and of bitsandbytes' ``optimizer_update_8bit_blockwise`` from the same
states must give the same parameters (to 1e-5 of a step) and codes one step of the map apart at most.
Then each optimizer's ``step()`` on one weight of ``--numel`` values is timed, alternating with torch's
fused fp32 Adam (``Adam(fused=True)``, the baseline: "x fused Adam" = step time / its time, medians of
the same run, lower is faster; benchmarks/_harness.py): torch Adam (foreach and fused), bitsandbytes
``AdamW8bit``, ours (``AdamW8bit`` subclass). State bytes per parameter are counted from the
optimizer's state. One thread by default (a pipeline stage often has one core); ``--threads N``
writes bench_adam8bit_<N>t_<ISA path>.
Results: benchmarks/results/bench_adam8bit_<ISA path>.{json,md}, with the machine and the C++ kernel path.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import machine, results_name, time_against, write_results  # noqa: E402

from deepspeed_ppq.quant.adam8bit import adam8bit_step, optimizer_class  # noqa: E402


def check() -> None:
    import bitsandbytes.functional as F

    n = 1 << 16
    g = torch.Generator().manual_seed(0)
    q1, q2 = F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)

    def state():
        g.manual_seed(1)
        codes = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for _ in range(2)]
        absmax = [torch.rand(n // 256, generator=g) * s for s in (1e-3, 1e-6)]
        return [torch.randn(n, generator=g) * 0.02, *codes, *absmax]

    grad = torch.randn(n, generator=g) * 1e-3
    a, b = state(), state()
    adam8bit_step(
        a[0], grad, *a[1:], q1, q2, beta1=0.9, beta2=0.999, eps=1e-8, step=3, lr=1e-3, weight_decay=0.01
    )
    F.optimizer_update_8bit_blockwise(
        "adam", grad, b[0], b[1], b[2], 0.9, 0.999, 0.0, 0.0, 1e-8, 3, 1e-3, q1, q2, b[3], b[4], 0.01, 1.0
    )
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-8)
    for k, q in ((1, q1), (2, q2)):
        step = (q[a[k].long()] - q[b[k].long()]).abs()
        assert bool((step <= 0.015).all()), f"state{k}: codes further apart than one step of the map"


def _state_bytes(opt) -> float:
    total, n = 0, 0
    for p, st in opt.state.items():
        n += p.numel()
        shared = ("step", "qmap1", "qmap2")  # a counter, and bitsandbytes' code maps (one pair for all)
        own = [v for k, v in st.items() if torch.is_tensor(v) and k not in shared]
        total += sum(v.numel() * v.element_size() for v in own)
    return total / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import bitsandbytes as bnb

    check()
    side = int(args.numel**0.5)
    n = side * side
    torch.manual_seed(0)
    grad = torch.randn(side, side) * 1e-3

    def make(build):
        p = torch.nn.Parameter(torch.randn(side, side) * 0.02)
        p.grad = grad
        opt = build([p])
        opt.step()
        return opt

    m = machine()
    base = make(lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True))
    cases = [
        ("torch Adam, fp32 states, foreach", lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True)),
        ("torch Adam, fp32 states, fused", lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True)),
        ("bitsandbytes AdamW8bit (its CPU backend)", lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)),
        ("deepspeed_ppq AdamW8bit (fused C++ step)", lambda ps: optimizer_class("adamw8bit")(ps, lr=1e-3)),
    ]
    rows = []
    for name, build in cases:
        opt = make(build)
        t = time_against(opt.step, base.step, args.reps)
        rows.append(
            {
                "optimizer": name,
                "ms": 1e3 * t.op,
                "ns_per_param": 1e9 * t.op / n,
                "fused_adam_ns_per_param": 1e9 * t.base / n,
                "x_fused_adam": t.op / t.base,
                "state_bytes_per_param": _state_bytes(opt),
            }
        )
    name = results_name("bench_adam8bit" if args.threads == 1 else f"bench_adam8bit_{args.threads}t")
    notes = [
        f"bitsandbytes {bnb.__version__}; {args.threads} thread(s). One weight of {n} values, median of "
        f"{args.reps} steps alternating with torch's fused fp32 Adam; checked against bitsandbytes' kernel "
        "first.",
        "x fused Adam = step time / fused Adam step time (same run); lower is faster. Target: "
        "ours <= 1.0.",
        "Threads: torch's fused Adam runs over torch's intra-op threads, ours splits its blocks with "
        f"OpenMP over the same count (at::get_num_threads()); --threads sets both ({args.threads} here).",
        f"Run: `.venv/bin/python benchmarks/quant/bench_adam8bit.py --threads {args.threads}`",
    ]
    md = write_results(
        name,
        rows,
        meta={"numel": n, "reps": args.reps, "threads": args.threads},
        title="bench_adam8bit: one optimizer step on CPU",
        notes=notes,
        machine_=m,
        save=not args.no_save,
    )
    print(md)


if __name__ == "__main__":
    main()
