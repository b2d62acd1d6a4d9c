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
import math
from pathlib import Path

from deepspeed_ppq.formats import WEIGHT_FORMATS

__all__ = ["add_parser", "run"]


_CODEC_FORMS = "none, quant:<2|4|6|8>, fp8 or topk:<ratio in (0, 1]>"

# Pipeline flags default to None so that a flag given beside --schedule-csv can be told from one left out.
_PIPELINE_DEFAULTS = {"schedule": "1f1b", "stages": 4, "microbatches": 8, "virtual_stages": 1}


def _codec(text: str):
    """``none`` | ``quant:<bits>`` | ``fp8`` | ``topk:<ratio>`` -> CodecConfig."""
    from deepspeed_ppq.config import CodecConfig

    method, _, arg = text.partition(":")
    if method not in ("none", "quant", "fp8", "topk"):
        raise argparse.ArgumentTypeError(f"codec {text!r} is unknown: use {_CODEC_FORMS}")
    try:
        if method == "quant":
            return CodecConfig(method="quant", bits=int(arg or 8))
        if method == "topk":
            return CodecConfig(method="topk", topk_ratio=float(arg or 0.3), reuse_indices=False)
        if not arg:
            return CodecConfig(method=method)
    except ValueError:  # int()/float() and pydantic's ValidationError (a ValueError) alike
        pass
    raise argparse.ArgumentTypeError(f"codec {text!r} is invalid: use {_CODEC_FORMS}")


def _float_type(lowest: float, *, inclusive: bool):
    """An argparse ``type``: a finite float ``>= lowest`` (``inclusive``) or ``> lowest``."""
    allowed = f"a finite number {'>=' if inclusive else '>'} {lowest:g}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v < lowest or (v == lowest and not inclusive):
            raise argparse.ArgumentTypeError(f"{text!r} must be {allowed}")
        return v

    return parse


_non_negative = _float_type(0.0, inclusive=True)
_positive = _float_type(0.0, inclusive=False)


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
    s.add_argument("--stages", type=int, help=f"(default: {_PIPELINE_DEFAULTS['stages']})")
    s.add_argument("--microbatches", type=int, help=f"(default: {_PIPELINE_DEFAULTS['microbatches']})")
    s.add_argument("--schedule", help="gpipe, 1f1b, interleaved, zbh1, chimera, deepspeed "
                   f"(default: {_PIPELINE_DEFAULTS['schedule']})")
    s.add_argument("--virtual-stages", type=int, help=f"(default: {_PIPELINE_DEFAULTS['virtual_stages']})")
    s.add_argument("--schedule-csv", help="a custom schedule (CSV) instead of --schedule; the four flags "
                   "above may be given only where they agree with it")
    s.add_argument("--boundaries", help="layer boundaries, e.g. 0,6,12,18,24 (default: even)")
    s.add_argument("--recompute", default="", help="stages with full activation recomputation, e.g. 0,1")
    q = p.add_argument_group("precision and compression")
    q.add_argument("--weights", default="none", help=f"weight format: none, {', '.join(WEIGHT_FORMATS)}")
    q.add_argument("--optimizer", default="adam", choices=["adam", "adam8bit", "sgd"])
    q.add_argument("--act-codec", type=_codec, default="none",
                   help="none | quant:<bits> | fp8 | topk:<ratio>")
    q.add_argument("--grad-codec", type=_codec, default="none", help="as --act-codec")
    q.add_argument("--codec-seconds", type=_non_negative, default=0.0,
                   help="codec time per message (encode+decode)")
    h = p.add_argument_group("hardware and links")
    h.add_argument("--hardware", default="h100", help="h100, h200, a100, cpu")
    h.add_argument("--latency", type=_non_negative, help="link latency in s (default: the hardware's)")
    h.add_argument("--bandwidth", type=_positive, help="link bandwidth in bytes/s (default: the hardware's)")
    h.add_argument("--no-overlap", action="store_true", help="transfers block the sender")
    p.add_argument("--out-dir", default="ppq_sim", help="where trace.json, timeline.png, memory.png go")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run, _parser=p)


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what}={text!r} must be comma-separated integers") from None


def _schedule_from_csv(args):
    """Load ``--schedule-csv``; refuse any pipeline flag given beside it that disagrees with the CSV."""
    from . import load_schedule_csv

    path = args.schedule_csv
    try:
        sched = load_schedule_csv(Path(path))
    except OSError as e:
        raise ValueError(f"--schedule-csv={path!r} cannot be read: {e.strerror or e}") from None
    except ValueError as e:  # ScheduleError, UnicodeDecodeError
        raise ValueError(f"--schedule-csv={path!r}: {e}") from None
    in_csv = {"schedule": sched.name, "stages": sched.num_ranks, "microbatches": sched.num_microbatches,
              "virtual_stages": sched.virtual_stages}
    for key, value in in_csv.items():
        given = getattr(args, key)
        if given is not None and given != value:
            raise ValueError(f"--{key.replace('_', '-')}={given} conflicts with --schedule-csv={path!r}, "
                             f"which has {value}: leave the flag out or give {value}")
    return sched


def run(args) -> int:
    from . import LinkModel, build_schedule, simulate, validate_schedule
    from .costs import ModelShape, stage_costs_roofline, stage_memory
    from .hardware import get_hardware
    from .plots import plot_memory, plot_timeline
    from .simulator import split_costs
    from .trace import write_chrome_trace

    act_codec = args.act_codec if not isinstance(args.act_codec, str) else _codec(args.act_codec)
    grad_codec = args.grad_codec if not isinstance(args.grad_codec, str) else _codec(args.grad_codec)
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        args._parser.error(f"--out-dir={args.out_dir!r} is a file: give a directory (created if missing)")
    try:
        shape = ModelShape(args.layers, args.hidden, args.heads, args.seq_len, args.vocab, args.micro_batch,
                           args.dtype)
        hw = get_hardware(args.hardware)
        if args.schedule_csv:
            sched = _schedule_from_csv(args)
        else:
            flag = {k: default if getattr(args, k) is None else getattr(args, k)
                    for k, default in _PIPELINE_DEFAULTS.items()}
            sched = build_schedule(flag["schedule"], flag["stages"], flag["microbatches"],
                                   flag["virtual_stages"])
        validate_schedule(sched)
        p = sched.num_ranks
        boundaries = _ints(args.boundaries, "boundaries") if args.boundaries else None
        rec_stages = set(_ints(args.recompute, "recompute"))
        if not rec_stages <= set(range(p)):
            bad = sorted(rec_stages - set(range(p)))
            raise ValueError(f"--recompute={args.recompute!r} names stage {bad[0]}, but the stages are "
                             f"0..{p - 1} ({p} stages)")
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
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_chrome_trace(res, out / "trace.json")
        plot_timeline(res, out / "timeline.png")
        plot_memory(res, out / "memory.png")
    except OSError as e:
        args._parser.error(f"--out-dir={args.out_dir!r} cannot be written: {e.strerror or e} ({e.filename})")
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
