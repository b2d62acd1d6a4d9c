"""``ppq simulate``: simulate one training step of a GPT-style model on a pipeline.

    ppq simulate --layers 48 --hidden 4096 --heads 32 --seq-len 2048 --vocab 50304 --micro-batch 1 \\
        --stages 8 --microbatches 32 --schedule 1f1b --weights int4 --act-codec quant:4 \\
        --grad-codec quant:8 --hardware h100 --bandwidth 25e9 --out-dir sim_out

prints a per-stage table (busy, idle, communication, peak memory by category) and writes
``trace.json`` (Perfetto), ``timeline.png`` and ``memory.png`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deepspeed_ppq.formats import WEIGHT_FORMATS

__all__ = ["add_parser", "run"]


def _codec(text: str):
    """``none`` | ``quant:<bits>`` | ``fp8`` | ``topk:<ratio>`` -> CodecConfig."""
    from deepspeed_ppq.config import CodecConfig

    method, _, arg = text.partition(":")
    try:
        if method == "none":
            return CodecConfig()
        if method == "quant":
            return CodecConfig(method="quant", bits=int(arg or 8))
        if method == "fp8":
            return CodecConfig(method="fp8")
        if method == "topk":
            return CodecConfig(method="topk", topk_ratio=float(arg or 0.3), reuse_indices=False)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"codec {text!r}: {e}") from None
    raise argparse.ArgumentTypeError(f"codec {text!r} is unknown: use none, quant:<2|4|6|8>, fp8 or "
                                     "topk:<ratio>")


def _message_bytes(codec, shape) -> int:
    import torch

    from deepspeed_ppq.compress.codecs import payload_nbytes

    from .costs import boundary_shape

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[shape.dtype]
    if not codec.enabled:
        n = 1
        for d in boundary_shape(shape):
            n *= d
        return n * shape.act_bytes
    return payload_nbytes(codec, boundary_shape(shape), dtype)


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a pipeline schedule: step time, bubbles, memory, PNGs",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=24)
    m.add_argument("--hidden", type=int, default=2048)
    m.add_argument("--heads", type=int, default=16)
    m.add_argument("--seq-len", type=int, default=2048)
    m.add_argument("--vocab", type=int, default=50304)
    m.add_argument("--micro-batch", type=int, default=1)
    m.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    s = p.add_argument_group("pipeline")
    s.add_argument("--stages", type=int, default=4)
    s.add_argument("--microbatches", type=int, default=8)
    s.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, zbh1, chimera, deepspeed")
    s.add_argument("--virtual-stages", type=int, default=1)
    s.add_argument("--schedule-csv", help="a custom schedule (CSV) instead of --schedule")
    s.add_argument("--boundaries", help="layer boundaries, e.g. 0,6,12,18,24 (default: even)")
    s.add_argument("--recompute", default="", help="stages with full activation recomputation, e.g. 0,1")
    q = p.add_argument_group("precision and compression")
    q.add_argument("--weights", default="none", help=f"weight format: none, {', '.join(WEIGHT_FORMATS)}")
    q.add_argument("--optimizer", default="adam", choices=["adam", "adam8bit", "sgd"])
    q.add_argument("--act-codec", type=_codec, default="none",
                   help="none | quant:<bits> | fp8 | topk:<ratio>")
    q.add_argument("--grad-codec", type=_codec, default="none", help="as --act-codec")
    q.add_argument("--codec-seconds", type=float, default=0.0, help="codec time per message (encode+decode)")
    h = p.add_argument_group("hardware and links")
    h.add_argument("--hardware", default="h100", help="h100, h200, a100, cpu")
    h.add_argument("--latency", type=float, help="link latency in s (default: the hardware's)")
    h.add_argument("--bandwidth", type=float, help="link bandwidth in bytes/s (default: the hardware's)")
    h.add_argument("--no-overlap", action="store_true", help="transfers block the sender")
    p.add_argument("--out-dir", default="ppq_sim", help="where trace.json, timeline.png, memory.png go")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run, _parser=p)


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"ppq simulate: --{what}={text!r} must be comma-separated integers") from None


def run(args) -> int:
    from . import LinkModel, build_schedule, load_schedule_csv, simulate, validate_schedule
    from .costs import ModelShape, stage_costs_roofline, stage_memory
    from .hardware import get_hardware
    from .plots import plot_memory, plot_timeline
    from .simulator import split_costs
    from .trace import write_chrome_trace

    act_codec = args.act_codec if not isinstance(args.act_codec, str) else _codec(args.act_codec)
    grad_codec = args.grad_codec if not isinstance(args.grad_codec, str) else _codec(args.grad_codec)
    try:
        shape = ModelShape(args.layers, args.hidden, args.heads, args.seq_len, args.vocab, args.micro_batch,
                           args.dtype)
        hw = get_hardware(args.hardware)
        if args.schedule_csv:
            sched = load_schedule_csv(Path(args.schedule_csv))
        else:
            sched = build_schedule(args.schedule, args.stages, args.microbatches, args.virtual_stages)
        validate_schedule(sched)
        p = sched.num_ranks
        boundaries = _ints(args.boundaries, "boundaries") if args.boundaries else None
        rec_stages = set(_ints(args.recompute, "recompute"))
        recompute = [i in rec_stages for i in range(p)]
        if sched.placement == "interleaved" and sched.virtual_stages > 1:
            if args.layers % (p * sched.virtual_stages):
                raise ValueError(f"--layers={args.layers} must be divisible by stages x virtual stages "
                                 f"= {p * sched.virtual_stages} for an interleaved schedule")
        costs = split_costs(stage_costs_roofline(shape, p, hw, args.weights, boundaries, recompute), sched)
        memory = stage_memory(shape, p, args.weights, args.optimizer, boundaries, recompute)
        act_b, grad_b = _message_bytes(act_codec, shape), _message_bytes(grad_codec, shape)
        memory = [type(mm)(mm.static, mm.activation_per_microbatch // sched.virtual_stages
                           if sched.placement == "interleaved" else mm.activation_per_microbatch,
                           comm_buffers=2 * (act_b + grad_b), feedback_buffers=mm.feedback_buffers)
                  for mm in memory]
        link = LinkModel(hw.link_latency if args.latency is None else args.latency,
                         hw.link_bw if args.bandwidth is None else args.bandwidth,
                         overlap=not args.no_overlap)
        nb = sched.num_pieces - 1
        codec = [(args.codec_seconds if act_codec.enabled else 0.0,
                  args.codec_seconds if grad_codec.enabled else 0.0)] * nb
        res = simulate(sched, costs, [(act_b, grad_b)] * nb, link, memory, codec)
    except ValueError as e:  # ScheduleError is a ValueError
        args._parser.error(str(e))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(res, out / "trace.json")
    plot_timeline(res, out / "timeline.png")
    plot_memory(res, out / "memory.png")
    summary = {"schedule": sched.name, "stages": p, "microbatches": sched.num_microbatches,
               "step_time_s": res.step_time, "bubble_fraction": res.bubble_fraction,
               "activation_bytes": act_b, "gradient_bytes": grad_b,
               "per_stage": [{"busy_s": st.busy, "idle_s": st.idle, "comm_s": st.comm,
                              "comm_blocked_s": st.comm_blocked, "peak_bytes": st.peak_total,
                              "peak_by_category": st.peak_memory} for st in res.per_stage]}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{sched.name}: {p} stages, {sched.num_microbatches} micro-batches on {hw.name}; "
              f"messages {act_b / 2**20:.2f} MiB forward, {grad_b / 2**20:.2f} MiB backward")
        print(f"step {res.step_time * 1e3:.2f} ms, bubble {res.bubble_fraction:.1%}")
        print(f"{'stage':>5} {'busy ms':>9} {'idle ms':>9} {'comm ms':>9} {'peak GiB':>9}  "
              "largest categories")
        for r, st in enumerate(res.per_stage):
            top = sorted(st.peak_memory.items(), key=lambda kv: -kv[1])[:3]
            cats = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in top)
            print(f"{r:>5} {st.busy * 1e3:9.2f} {st.idle * 1e3:9.2f} {st.comm * 1e3:9.2f} "
                  f"{st.peak_total / 2**30:9.2f}  {cats}")
        print(f"wrote {out / 'trace.json'}, {out / 'timeline.png'}, {out / 'memory.png'}")
    return 0
