"""At scale, on paper: the ablation ladder for a LLaMA-style 70B on 8 and 16 pipeline stages of H100s.

    .venv/bin/python benchmarks/sim/at_scale.py            # ~1-2 min on one core
    .venv/bin/python benchmarks/sim/at_scale.py --out /tmp/x

Everything goes through the package's roofline cost model (``schedule.costs``), hardware table
(``schedule.hardware``: H100 SXM5 80GB) and simulator (``schedule.simulate``, which models the schedule,
per-link transfers, codec time and per-rank memory). Nothing here is measured on a GPU; every assumption
is in ``ASSUMPTIONS`` and printed with the results. The ladder, per layout (pipeline stages p x tensor
parallel t):

1. best stock: bf16 weights + fp32 master + fp32 AdamW, DeepSpeed's 1F1B, the fastest micro-batch size,
   activation checkpointing (all stages or none) and ``partition_method`` (uniform / parameters) that fits;
2. + low-bit weights at the stock schedule: FP8 (e4m3) master-free block weights, 8-bit AdamW states;
   embedding, LM head and norms stay bf16 with fp32 master and fp32 AdamW (the precision policy);
3. + the freed memory spent on fill: micro-batch size, interleaved virtual stages, recomputation only on
   the ranks that need it;
4. + re-balanced boundaries: layers moved between pipeline pieces (hill climb on simulated step time);
5. + P2P codecs on the inter-node boundaries: activations 8-bit per token, gradients 8-bit per token.

Writes benchmarks/results/at_scale_70b.{md,json} and docs/at_scale_70b.png (see docs/at_scale.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import machine  # noqa: E402

from deepspeed_ppq import memory_categories as mc  # noqa: E402
from deepspeed_ppq.schedule import LinkModel, StageCost, StageMemory, build_schedule, simulate  # noqa: E402
from deepspeed_ppq.schedule.costs import (  # noqa: E402
    ModelShape,
    stage_costs_roofline,
    stage_memory,
)
from deepspeed_ppq.schedule.hardware import get_hardware  # noqa: E402

GiB = 1 << 30
HW = get_hardware("h100")
MODEL = dict(layers=80, hidden=8192, heads=64, seq_len=4096, vocab=128256, arch="llama", kv_heads=8,
             ffn_hidden=28672, dtype="bf16")
SEQS_PER_STEP = 32          # sequences per pipeline replica per optimizer step (global batch / DP)
GPUS_PER_NODE = 8
RESERVED = 5 * GiB          # CUDA context, NCCL/cuBLAS workspaces, allocator fragmentation
BUDGET = HW.mem_bytes - RESERVED
IB_BW, IB_LAT = 50e9, 5e-6  # 400 Gb/s InfiniBand NDR per GPU (one NIC per GPU), per direction
NVLINK_BW, NVLINK_LAT = HW.link_bw, 2e-6
TP_COMM_EFF = 0.8           # fraction of NVLink bandwidth the tensor-parallel collectives reach
LOW_BIT_FMT = "fp8_e4m3"
OPT_STEP_BYTES = {"stock": 30, "low_bit": 10}  # bytes moved per parameter by one optimizer step
LAYOUTS = [(8, 4), (16, 2), (8, 8), (16, 8)]  # (pipeline stages, tensor parallel)
MAIN_LAYOUTS = [(8, 4), (16, 2)]
# sensitivity: (sequence length, dequantization fused into the GEMM, GiB reserved outside the model)
SCENARIOS = [(8192, False, 5.0), (4096, True, 5.0), (4096, False, 10.0)]

ASSUMPTIONS = [
    "Model: LLaMA-3-70B shape: 80 layers, d=8192, 64 query / 8 key-value heads (GQA), SwiGLU FFN 28672, "
    "RMSNorm, no biases, untied embedding and LM head, vocabulary 128256, sequence 4096, bf16 activations; "
    "70.55e9 parameters.",
    f"Device: {HW.name}: bf16 dense {HW.flops['bf16'] / 1e12:.0f} TFLOP/s at {HW.achievable_flops:.0%} "
    f"achievable, HBM {HW.mem_bw / 1e12:.2f} TB/s at {HW.achievable_mem:.0%} (schedule/hardware.py); "
    "matmuls run in bf16 on every rung (FP8 weights are dequantized into a bf16 compute copy, as the "
    "package's QuantLinear does; FP8 GEMMs are not assumed).",
    f"Memory budget per GPU: {HW.mem_bytes / GiB:.0f} GiB minus {RESERVED / GiB:.0f} GiB reserved for the "
    f"CUDA context, NCCL/cuBLAS workspaces and fragmentation = {BUDGET / GiB:.0f} GiB.",
    "Parallelism: one pipeline replica = p stages x t-way tensor parallelism (Megatron TP with sequence "
    "parallelism) inside a node of 8 GPUs, so 8/t consecutive stages share a node; data parallelism "
    "replicates the replica, its gradient reduction is not modelled (the same on every rung).",
    f"Batch: {SEQS_PER_STEP} sequences of 4096 tokens per replica and optimizer step (e.g. a 4M-token "
    f"global batch over 32 data-parallel replicas); micro-batch sizes are the divisors of "
    f"{SEQS_PER_STEP}.",
    f"Links: pipeline hops inside a node over NVLink ({NVLINK_BW / 1e9:.0f} GB/s per direction, "
    f"{NVLINK_LAT * 1e6:.0f} us); between nodes over 400 Gb/s InfiniBand, one NIC per GPU "
    f"({IB_BW / 1e9:.0f} GB/s per direction, {IB_LAT * 1e6:.0f} us). Each GPU sends its 1/t sequence "
    "shard of the boundary tensor. Sends block the sender (DeepSpeed's p2p; LinkModel overlap=False).",
    f"Tensor-parallel collectives: 2 all-gathers + 2 reduce-scatters of the [b, s, h] bf16 tensor per layer "
    f"and pass, (t-1)/t of it per GPU at {TP_COMM_EFF:.0%} of NVLink, not overlapped with compute.",
    "Compute: roofline per kernel, max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth); "
    "attention counted as 4 b s^2 h FLOPs (no causal discount); backward = input gradient (= forward) + "
    "weight gradient (matmul FLOPs); full recomputation adds one forward to the backward.",
    "Low-bit blocks: FP8 e4m3 codes + one fp32 scale per 64 values, no fp32 master (master-free, "
    "stochastic rounding), 8-bit AdamW moments (2 B/param); the dequantization to bf16 is a separate "
    "memory-bound kernel in forward and backward (read codes, write bf16), and one layer's bf16 compute "
    "copy is live at a time.",
    f"Optimizer step: memory-bound, {OPT_STEP_BYTES['stock']} B/param moved for fp32 AdamW with fp32 master "
    f"and bf16 weights, {OPT_STEP_BYTES['low_bit']} B/param for master-free FP8 + 8-bit AdamW.",
    "Memory per GPU: weights by format, fp32 gradients (4 B/param, also for low-bit blocks), fp32 master "
    "where kept, optimizer states, saved activations (33.5 s b h bytes per layer with flash attention, / t; "
    "layer input only with recomputation) times the micro-batches in flight as the simulator counts them, "
    "fp32 logits on the last stage, send/receive buffers, one SP all-gather buffer and (low-bit) one layer's "
    "bf16 compute copy. Interleaved ranks are charged their largest chunk's activations per chunk in flight.",
    "Codecs (rung 5): per-token min-max quantization (payload size from compress.codecs.payload_nbytes) on "
    "the inter-node boundaries only; encode and decode are memory-bound kernels (read bf16, write codes; "
    "read codes, write bf16) charged to sender and receiver.",
    "Stock search: DeepSpeed 1F1B, micro-batch size, activation checkpointing on all stages or none, "
    "partition_method uniform or parameters. The tuned rungs may also use Megatron's interleaved 1F1B "
    "(virtual stages v with 80 % (p v) == 0 and micro-batches a multiple of p) and per-rank "
    "recomputation; a stock Megatron-core user can interleave too, shown as a reference row.",
]


@dataclass(frozen=True)
class Config:
    """One point of the search: a layout, a schedule, and the low-bit/codec switches."""

    p: int
    t: int
    micro_batch: int
    schedule: str = "1f1b"
    v: int = 1
    counts: tuple[int, ...] = ()       # layers per pipeline piece (p * v pieces), forward order
    recompute: tuple[bool, ...] = ()   # per rank
    low_bit: bool = False              # low-bit weights allowed (all ranks unless low_bit_ranks says)
    low_bit_ranks: tuple[bool, ...] = ()  # per rank, chosen by the tuned search
    codec: str = "none"                # none | a8g8 | a4g8
    partition: str = "uniform"
    seq: int = 4096                    # sequence length (a sensitivity scenario changes it)
    fused_dequant: bool = False        # what-if: dequantization fused into the GEMM (no extra kernel)
    reserved_gib: float = RESERVED / GiB  # per-GPU memory outside the model (sensitivity: 10 GiB)


def _shape(cfg: Config) -> ModelShape:
    return ModelShape(micro_batch=cfg.micro_batch, tensor_parallel=cfg.t, **(MODEL | {"seq_len": cfg.seq}))


def uniform_counts(layers: int, pieces: int) -> tuple[int, ...]:
    base, extra = divmod(layers, pieces)
    return tuple(base + (1 if i < extra else 0) for i in range(pieces))


def parameter_counts(shape: ModelShape, stages: int) -> tuple[int, ...]:
    """DeepSpeed ``partition_method='parameters'``: contiguous parts of ``[embedding, blocks, head]`` with
    the largest part's parameter count as small as possible (the embedding and head weigh as layers;
    exact min-max by dynamic programming). Returns the blocks per stage."""
    w = [shape.vocab * shape.hidden] + [shape.layer_params] * shape.layers + [shape.vocab * shape.hidden]
    n = len(w)
    pre = [0]
    for x in w:
        pre.append(pre[-1] + x)
    inf = float("inf")
    # best[k][i]: min over partitions of w[:i] into k parts of the largest part; cut[k][i]: last cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                val = max(best[k - 1][j], pre[i] - pre[j])
                if val < best[k][i]:
                    best[k][i], cut[k][i] = val, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    sizes.reverse()
    sizes[0] -= 1   # the embedding entry
    sizes[-1] -= 1  # the head entry
    return tuple(sizes)


def _codec_bytes(kind: str, bits: int, nvals_shape: tuple[int, int, int]) -> int:
    import torch

    from deepspeed_ppq.compress.codecs import payload_nbytes
    from deepspeed_ppq.config import CodecConfig

    cfg = CodecConfig() if kind == "none" else CodecConfig(method="quant", bits=bits, granularity="token")
    return payload_nbytes(cfg, nvals_shape, torch.bfloat16)


def evaluate(cfg: Config) -> dict:
    """Simulate one optimizer step of ``cfg``; returns times, bubble and per-rank memory."""
    shape = _shape(cfg)
    p, t, v = cfg.p, cfg.t, cfg.v
    n = p * v
    counts = cfg.counts or uniform_counts(shape.layers, n)
    assert len(counts) == n and sum(counts) == shape.layers and min(counts) >= 1, counts
    rank_of = [i % p for i in range(n)]  # interleaved placement: piece = chunk * p + rank
    rec_rank = cfg.recompute or (False,) * p
    rec_piece = [rec_rank[rank_of[i]] for i in range(n)]
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    lb_rank = cfg.low_bit_ranks or (cfg.low_bit,) * p
    lb_piece = [lb_rank[rank_of[i]] for i in range(n)]
    mem_bw = HW.mem_bw * HW.achievable_mem
    b, s, h = cfg.micro_batch, shape.seq_len, shape.hidden
    lp = shape.layer_params // t
    # a separate kernel per low-bit layer and pass: read fp8 + scales, write bf16
    dequant = (lp * 1.0625 + lp * 2) / mem_bw if not cfg.fused_dequant else 0.0
    tp_comm = 4 * (t - 1) / t * b * s * h * 2 / (NVLINK_BW * TP_COMM_EFF) if t > 1 else 0.0
    hi = stage_costs_roofline(shape, n, HW, "none", bounds, None)
    lo = stage_costs_roofline(shape, n, HW, LOW_BIT_FMT, bounds, None, dequant_overhead=dequant)
    base = [lo[i] if lb_piece[i] else hi[i] for i in range(n)]
    emb_head = shape.vocab * h // t
    costs = []
    for i, c in enumerate(base):
        extra = counts[i] * tp_comm
        params = counts[i] * lp
        opt_bytes = params * OPT_STEP_BYTES["low_bit" if lb_piece[i] else "stock"]
        opt_bytes += emb_head * OPT_STEP_BYTES["stock"] * ((i == 0) + (i == n - 1))
        f = c.forward + extra
        costs.append(StageCost(f, c.backward_input + extra, c.backward_weight,
                               recompute=f if rec_piece[i] else 0.0, optimizer=opt_bytes / mem_bw))

    # Memory: per piece from the cost model, summed per rank (activations: the largest chunk per chunk).
    pm_hi = stage_memory(shape, n, "none", "adam", bounds, rec_piece)
    pm_lo = stage_memory(shape, n, LOW_BIT_FMT, "adam8bit", bounds, rec_piece, master_free=True,
                         high_precision_optimizer="adam")
    pm = [pm_lo[i] if lb_piece[i] else pm_hi[i] for i in range(n)]
    shard = (b, s // t, h)  # what one GPU sends: its sequence shard of the boundary tensor
    raw = _codec_bytes("none", 16, shard)
    memory = []
    for r in range(p):
        mine = [pm[i] for i in range(n) if rank_of[i] == r]
        static: dict[str, int] = {}
        for m in mine:
            for k, x in m.static.items():
                static[k] = static.get(k, 0) + x
        static["workspace"] = b * s * h * 2 + (2 * lp if lb_rank[r] else 0)
        memory.append(StageMemory(static, max(m.activation_per_microbatch for m in mine), 4 * raw))

    # Links: stages 8/t to a node; NVLink inside, InfiniBand between nodes.
    per_node = max(1, GPUS_PER_NODE // t)
    node = [r // per_node for r in range(p)]
    overrides = {}
    for a in range(p):
        for d in (a - 1, a + 1, (a + 1) % p, (a - 1) % p):
            if 0 <= d < p and d != a and node[a] == node[d]:
                overrides[(a, d)] = (NVLINK_LAT, NVLINK_BW)
    link = LinkModel(IB_LAT, IB_BW, overlap=False, overrides=overrides)
    bbytes, ctime = [], []
    for i in range(n - 1):
        inter = node[rank_of[i]] != node[rank_of[i + 1]]
        if cfg.codec != "none" and inter:
            abits = 8 if cfg.codec == "a8g8" else 4
            act, grad = _codec_bytes("quant", abits, shard), _codec_bytes("quant", 8, shard)
            vals = b * (s // t) * h  # encode reads bf16 and writes the payload; decode the reverse
            ta, tg = (vals * 2 + act) / mem_bw, (vals * 2 + grad) / mem_bw
            ctime.append((ta, ta, tg, tg))
            bbytes.append((act, grad))
        else:
            bbytes.append((raw, raw))
            ctime.append((0.0, 0.0, 0.0, 0.0))
    m = SEQS_PER_STEP // b
    sched = build_schedule(cfg.schedule, p, m, v)
    res = simulate(sched, costs, bbytes, link, memory, ctime)
    peaks = [st.peak_total for st in res.per_stage]
    tokens = SEQS_PER_STEP * s
    return {
        "config": asdict(cfg) | {"counts": list(counts), "recompute": list(rec_rank), "microbatches": m},
        "step_time_s": res.step_time,
        "tokens_per_s": tokens / res.step_time,
        "tokens_per_s_per_gpu": tokens / res.step_time / (p * t),
        "samples_per_s": SEQS_PER_STEP / res.step_time,
        "bubble": res.bubble_fraction,
        "budget_gib": (HW.mem_bytes / GiB - cfg.reserved_gib),
        "fits": max(peaks) <= HW.mem_bytes - cfg.reserved_gib * GiB,
        "peak_gib": [x / GiB for x in peaks],
        "peak_by_category_gib": [{k: v_ / GiB for k, v_ in st.peak_memory.items()} for st in res.per_stage],
        "busy_s": [st.busy for st in res.per_stage],
        "inflight": [st.peak_inflight for st in res.per_stage],
        "comm_blocked_s": [st.comm_blocked for st in res.per_stage],
    }


def _runs(counts) -> str:
    """``3,2,2,2,1`` -> ``3,2x3,1``."""
    out: list[list[int]] = []
    for c in counts:
        if out and out[-1][0] == c:
            out[-1][1] += 1
        else:
            out.append([c, 1])
    return ",".join(f"{c}x{k}" if k > 2 else ",".join([str(c)] * k) for c, k in out)


def _label(cfg: Config) -> str:
    sch = "1F1B" if cfg.schedule == "1f1b" else f"interleaved v={cfg.v}"
    rec = sum(cfg.recompute) if cfg.recompute else 0
    rtxt = "none" if rec == 0 else ("all" if rec == cfg.p else f"{rec} ranks")
    lb = cfg.low_bit_ranks or (cfg.low_bit,) * cfg.p
    nlb = sum(lb)
    prec = "bf16" if nlb == 0 else "FP8 blocks" if nlb == cfg.p else \
        "FP8 blocks on ranks " + ",".join(str(k) for k in range(cfg.p) if lb[k])
    parts = [prec, f"b={cfg.micro_batch} x {SEQS_PER_STEP // cfg.micro_batch}", sch, f"recompute {rtxt}"]
    if cfg.partition != "uniform":
        parts.append(f"{cfg.partition} layers " + _runs(cfg.counts))
    return ", ".join(parts)


def _schedules(p: int, layers: int, m: int, interleave: bool) -> list[tuple[str, int]]:
    out = [("1f1b", 1)]
    if interleave and m % p == 0:
        out += [("interleaved", v) for v in range(2, layers // p + 1) if layers % (p * v) == 0]
    return out


def _fit_recompute(cfg: Config, per_rank: bool) -> tuple[Config, dict] | None:
    """``cfg`` with the cheapest memory savers that fit.

    Stock (``per_rank=False``): no recomputation, else recomputation on every stage (DeepSpeed's
    activation checkpointing is global); precision as ``cfg`` says. Tuned (``per_rank=True``): each rank
    independently takes the first option that fits of: bf16, low-bit (when ``cfg.low_bit``), bf16 +
    recomputation, low-bit + recomputation -- in order of cost. A rank's memory depends only on its own
    options, so this is exact for a given schedule and partition.
    """
    p = cfg.p
    if not per_rank:
        for rec in (False, True):
            c = replace(cfg, recompute=(rec,) * p)
            r = evaluate(c)
            if r["fits"]:
                return c, r
        return None
    options = [(False, False), (True, False), (False, True), (True, True)]
    if not cfg.low_bit:
        options = [o for o in options if not o[0]]
    choice: list[tuple[bool, bool] | None] = [None] * p
    for lb, rec in options:
        r = evaluate(replace(cfg, low_bit_ranks=(lb,) * p, recompute=(rec,) * p))
        for k, peak in enumerate(r["peak_gib"]):
            if choice[k] is None and peak <= r["budget_gib"]:
                choice[k] = (lb, rec)
        if all(choice):
            break
    if not all(choice):
        return None
    c = replace(cfg, low_bit_ranks=tuple(x[0] for x in choice), recompute=tuple(x[1] for x in choice))
    r = evaluate(c)
    return (c, r) if r["fits"] else None


def search(base: Config, low_bit: bool, interleave: bool, per_rank_recompute: bool,
           partitions=("uniform", "parameters")) -> list[tuple[Config, dict]]:
    """Every fitting configuration of the space around ``base`` (its layout and scenario), fastest
    first."""
    p = base.p
    shape = _shape(base)
    found = []
    for b in (d for d in range(1, SEQS_PER_STEP + 1) if SEQS_PER_STEP % d == 0):
        for name, v in _schedules(p, shape.layers, SEQS_PER_STEP // b, interleave):
            for part in partitions if v == 1 else ("uniform",):
                counts = (parameter_counts(shape, p) if part == "parameters"
                          else uniform_counts(shape.layers, p * v))
                cfg = replace(base, micro_batch=b, schedule=name, v=v, counts=counts, low_bit=low_bit,
                              partition=part)
                got = _fit_recompute(cfg, per_rank_recompute)
                if got:
                    found.append(got)
    return sorted(found, key=lambda cr: cr[1]["step_time_s"])


def rebalance(cfg: Config, res: dict, per_rank_recompute: bool = True, max_iter: int = 12
              ) -> tuple[Config, dict]:
    """Hill climb: move one layer from one piece to another while the simulated step gets faster and
    every rank fits (recomputation re-fitted: per rank, or all-or-none as a stock user sets it)."""
    best_c, best_r = cfg, res
    n = cfg.p * cfg.v
    for _ in range(max_iter):
        busy = best_r["busy_s"]
        by_busy = sorted(range(cfg.p), key=lambda r: busy[r])
        if n <= 16:
            srcs = dsts = set(range(n))
        else:  # from the two busiest ranks and the last piece, to the three least busy and the first
            srcs = {n - 1} | {i for i in range(n) if i % cfg.p in by_busy[-2:]}
            dsts = {0} | {i for i in range(n) if i % cfg.p in by_busy[:3]}
        step = None
        for a in sorted(srcs):
            if best_c.counts[a] <= 1:
                continue
            for d in sorted(dsts):
                if d == a:
                    continue
                counts = list(best_c.counts)
                counts[a] -= 1
                counts[d] += 1
                got = _fit_recompute(replace(best_c, counts=tuple(counts), partition="re-balanced"),
                                     per_rank_recompute)
                if got and got[1]["step_time_s"] < (step[1]["step_time_s"] if step else best_r["step_time_s"]
                                                    * (1 - 1e-4)):
                    step = got
        if step is None:
            break
        best_c, best_r = step
    return best_c, best_r


def memory_aware_counts(cfg: Config) -> tuple[int, ...] | None:
    """1F1B layers per stage for bf16 without recomputation: each stage gets at most the layers its
    memory holds (a stage's bytes per layer = weights, gradients, master and AdamW states + its
    micro-batches in flight x one layer's activations), then as evenly as those caps allow (water
    filling, the surplus taken from the last stages). A seed for the stock re-balancing, whose one-layer
    moves cannot leave recomputation behind on their own. None if no such layout fits."""
    shape = _shape(cfg)
    p = cfg.p
    counts = uniform_counts(shape.layers, p)
    r = evaluate(replace(cfg, schedule="1f1b", v=1, counts=counts, recompute=(False,) * p, low_bit=False,
                         low_bit_ranks=()))
    per_static = shape.layer_params // cfg.t * (2 + 4 + 4 + 8)
    from deepspeed_ppq.schedule.costs import layer_activation_bytes

    per_act = layer_activation_bytes(shape)
    budget = r["budget_gib"] * GiB
    caps = []
    for k in range(p):
        per_layer = per_static + r["inflight"][k] * per_act
        fixed = r["peak_gib"][k] * GiB - counts[k] * per_layer
        caps.append(int((budget - fixed) // per_layer))
    if sum(max(c, 0) for c in caps) < shape.layers or min(caps) < 1:
        return None
    top = next(x for x in range(1, shape.layers + 1) if sum(min(c, x) for c in caps) >= shape.layers)
    out = [min(c, top) for c in caps]
    k = p - 1
    while sum(out) > shape.layers:
        if out[k] == top and out[k] > 1:
            out[k] -= 1
        k = k - 1 if k > 0 else p - 1
    return tuple(out)


def ladder(p: int, t: int, seq: int = 4096, fused_dequant: bool = False,
           reserved_gib: float = RESERVED / GiB) -> dict:
    """The five rungs and the stock references for one layout (and scenario)."""
    base = Config(p, t, 1, seq=seq, fused_dequant=fused_dequant, reserved_gib=reserved_gib)
    out: dict = {"p": p, "t": t, "gpus": p * t, "seq": seq, "fused_dequant": fused_dequant,
                 "reserved_gib": reserved_gib, "rungs": [], "stock_top": []}
    stock = search(base, low_bit=False, interleave=False, per_rank_recompute=False)
    out["stock_top"] = [{"label": _label(c), "step_time_s": r["step_time_s"],
                         "max_peak_gib": max(r["peak_gib"])} for c, r in stock[:6]]
    if not stock:
        out["note"] = "no stock configuration fits the budget"
        return out
    # What a hand-tuning stock user can reach without this package: re-balanced layers (Megatron-core's
    # custom pipeline layout) and interleaving, all-or-none recomputation.
    ds_starts = [stock[0]]
    seed = memory_aware_counts(stock[0][0])
    if seed:
        got = _fit_recompute(replace(stock[0][0], counts=seed, partition="re-balanced"), False)
        if got:
            ds_starts.append(got)
    refs = {"stock DeepSpeed, re-balanced layers": min(
        (rebalance(c, r, per_rank_recompute=False) for c, r in ds_starts),
        key=lambda cr: cr[1]["step_time_s"])}
    mega = search(base, low_bit=False, interleave=True, per_rank_recompute=False,
                  partitions=("uniform",))
    mega_key = "stock Megatron-core, interleaved + re-balanced"
    if mega:
        refs["stock Megatron-core, interleaved"] = mega[0]
        # re-balance from the best plan of each schedule: one that needs recomputation may shed it
        firsts: dict = {}
        for c, r in mega:
            firsts.setdefault((c.schedule, c.v), (c, r))
        refs[mega_key] = min((rebalance(c, r, per_rank_recompute=False) for c, r in firsts.values()),
                             key=lambda cr: cr[1]["step_time_s"])
    best_any = min([stock[0], *refs.values()], key=lambda cr: cr[1]["step_time_s"])

    def rung(name: str, cfg: Config, res: dict) -> None:
        out["rungs"].append({"rung": name, "label": _label(cfg), **res})

    c1, r1 = stock[0]
    rung("1. best stock (DeepSpeed)", c1, r1)
    c2 = replace(c1, low_bit=True)
    r2 = evaluate(c2)
    rung("2. + low-bit weights (stock schedule)", c2, r2)
    filled = search(base, low_bit=True, interleave=True, per_rank_recompute=True)
    c3, r3 = filled[0]
    rung("3. + freed memory on fill", c3, r3)
    # Re-balance from the best filled plans and from the best stock layouts made low-bit.
    starts = list(filled[:2])
    for c, _ in [best_any, refs["stock DeepSpeed, re-balanced layers"]]:
        got = _fit_recompute(replace(c, low_bit=True, low_bit_ranks=(), codec="none"), True)
        if got:
            starts.append(got)
    c4, r4 = min([rebalance(c, r) for c, r in starts] + [(c3, r3)], key=lambda cr: cr[1]["step_time_s"])
    rung("4. + re-balanced boundaries", c4, r4)
    # The tuned schedule and layout in bf16 with all-or-none recomputation is a stock plan too: a hand
    # tuner could find it, so it competes for the best stock.
    got = _fit_recompute(replace(c4, low_bit=False, low_bit_ranks=(), recompute=(), codec="none"), False)
    if got:
        cb, rb = rebalance(*got, per_rank_recompute=False)
        if mega_key not in refs or rb["step_time_s"] < refs[mega_key][1]["step_time_s"]:
            refs[mega_key] = (cb, rb)
    out["stock_refs"] = [{"rung": k, "label": _label(c), **r} for k, (c, r) in refs.items()]
    best_any = min([stock[0], *refs.values()], key=lambda cr: cr[1]["step_time_s"])
    for codec, key in (("a8g8", None), ("a4g8", "variant_a4g8")):
        got = _fit_recompute(replace(c4, codec=codec), True)
        c5, r5 = got if got else (replace(c4, codec=codec), evaluate(replace(c4, codec=codec)))
        if key is None:
            rung("5. + P2P codecs a8/g8", c5, r5)
        else:
            out[key] = {"rung": "variant: rung 4 + codecs a4/g8", "label": _label(c5), **r5}
    out["best_stock_any"] = {"label": _label(best_any[0]), **best_any[1]}
    final = out["rungs"][-1]["step_time_s"]
    out["speedup_vs_deepspeed_stock"] = r1["step_time_s"] / final
    out["speedup_vs_best_stock_any"] = best_any[1]["step_time_s"] / final
    return out


def _row(r: dict, base: float) -> str:
    return (f"| {r['rung']} | {r['label']} | {r['step_time_s']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {r['tokens_per_s'] / base:.3f}x | {r['bubble']:.1%} | "
            f"{max(r['peak_gib']):.1f}" + ("" if r["fits"] else " (over)") + " |")


def _scenario(res: dict) -> str:
    out = f"seq {res['seq']}"
    if res["reserved_gib"] != RESERVED / GiB:
        out += f", {res['reserved_gib']:.0f} GiB reserved"
    return out + (", dequant fused into the GEMM" if res["fused_dequant"] else "")


def _md(results: list[dict], wall: float) -> str:
    lines = ["# LLaMA-style 70B on 8 and 16 pipeline stages of H100s: the ladder, on paper", "",
             "Simulated, not measured: `python benchmarks/sim/at_scale.py` (roofline cost model, hardware "
             f"table and pipeline simulator of `deepspeed_ppq.schedule`; {wall:.0f} s on one CPU core). "
             "Explained in docs/at_scale.md.", "",
             "## Summary: the full ladder (rung 5) against the stock configurations", "",
             "| layout | scenario | DeepSpeed stock tokens/s | best stock (any) tokens/s | which "
             "| rung 5 tokens/s | vs DeepSpeed stock | vs best stock |", "|---|---|---|---|---|---|---|---|"]
    for res in results:
        if not res["rungs"]:
            lines.append(f"| p={res['p']} x TP={res['t']} | {_scenario(res)} | {res.get('note')} | | | | | |")
            continue
        b = res["best_stock_any"]
        lines.append(f"| p={res['p']} x TP={res['t']} | {_scenario(res)} | "
                     f"{res['rungs'][0]['tokens_per_s']:,.0f} | {b['tokens_per_s']:,.0f} | {b['label']} | "
                     f"{res['rungs'][-1]['tokens_per_s']:,.0f} | "
                     f"{res['speedup_vs_deepspeed_stock']:.3f}x | {res['speedup_vs_best_stock_any']:.3f}x |")
    lines += ["", "## Assumptions", ""]
    lines += [f"- {a}" for a in ASSUMPTIONS]
    for res in results:
        if not res["rungs"] or _scenario(res) != "seq 4096":
            continue
        p, t = res["p"], res["t"]
        lines += ["", f"## p = {p} stages x TP = {t} ({res['gpus']} GPUs per replica, "
                  f"{max(1, GPUS_PER_NODE // t)} stage(s) per node), {_scenario(res)}", ""]
        base = res["rungs"][0]["tokens_per_s"]
        lines += ["| rung | configuration | step s | tokens/s | tokens/s/GPU | vs stock | bubble | "
                  f"max peak GiB (of {BUDGET / GiB:.0f}) |", "|---|---|---|---|---|---|---|---|"]
        lines += [_row(r, base) for r in res["rungs"]]
        lines += [_row(dict(r, rung="ref: " + r["rung"]), base) for r in res.get("stock_refs", [])]
        if res.get("variant_a4g8"):
            lines.append(_row(res["variant_a4g8"], base))
        lines += ["", "Peak memory per stage (GiB per GPU) by category, best DeepSpeed stock vs rung 5:", "",
                  "| stage | " + " | ".join(_CATS) + " | total |", "|---" * (len(_CATS) + 2) + "|"]
        for name, r in (("stock", res["rungs"][0]), ("rung 5", res["rungs"][-1])):
            for s_, cats in enumerate(r["peak_by_category_gib"]):
                g = _group(cats)
                lines.append(f"| {name} {s_} | " + " | ".join(f"{g[c]:.1f}" for c in _CATS)
                             + f" | {sum(g.values()):.1f} |")
        lines += ["", "Top of the stock search (DeepSpeed 1F1B):", ""]
        lines += [f"- {x['label']}: {x['step_time_s']:.2f} s, max peak {x['max_peak_gib']:.1f} GiB"
                  for x in res["stock_top"]]
    return "\n".join(lines) + "\n"


_CATS = ["weights", "gradients", "master", "optimizer", "activations", "buffers"]
# memory category -> column of the report; the rest (workspace, comm and feedback buffers) is "buffers"
_COLUMN = {mc.WEIGHTS: "weights", mc.GRADIENTS: "gradients", mc.MASTER_WEIGHTS: "master",
           mc.OPTIMIZER: "optimizer", mc.ACTIVATIONS: "activations"}


def _group(cats: dict) -> dict:
    """A rank's peak by category (recorded files' older names read too) -> the report's columns."""
    g = dict.fromkeys(_CATS, 0.0)
    for k, x in cats.items():
        g[_COLUMN.get(mc.category(k), "buffers")] += x
    return g


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [r for r in results
            if (r["p"], r["t"]) in MAIN_LAYOUTS and r["rungs"] and _scenario(r) == "seq 4096"]
    fig, axes = plt.subplots(2, len(main), figsize=(6.5 * len(main), 8.5), squeeze=False)
    colors = {"weights": "#4c72b0", "gradients": "#55a868", "master": "#c44e52", "optimizer": "#8172b2",
              "activations": "#ccb974", "buffers": "#64b5cd"}
    for j, res in enumerate(main):
        ax = axes[0][j]
        rungs = res["rungs"]
        base = rungs[0]["tokens_per_s"]
        names = ["stock", "+low-bit", "+fill", "+re-bal.", "+codecs"]
        vals = [r["tokens_per_s"] / 1e3 for r in rungs]
        bars = ax.bar(names, vals, color=["#999999"] + ["#4c72b0"] * (len(vals) - 1))
        for bar, r in zip(bars, rungs):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                    f"{r['tokens_per_s'] / base:.2f}x\nbubble {r['bubble']:.0%}", ha="center", va="bottom",
                    fontsize=8)
        best = res["best_stock_any"]
        ax.axhline(best["tokens_per_s"] / 1e3, ls="--", color="k", lw=1,
                   label=f"best hand-tuned stock (no low-bit): rung 5 is "
                         f"{res['speedup_vs_best_stock_any']:.2f}x of it")
        ax.legend(loc="upper left", fontsize=8)
        ax.set_ylim(0, max(vals + [best["tokens_per_s"] / 1e3]) * 1.35)
        ax.set_ylabel("tokens/s per replica (thousands)")
        ax.set_title(f"LLaMA-70B, p={res['p']} x TP={res['t']} ({res['gpus']} H100s), simulated", fontsize=10)
        ax = axes[1][j]
        p = res["p"]
        w = 0.38
        for k, r in enumerate((rungs[0], rungs[-1])):
            bottom = [0.0] * p
            for cat in _CATS:
                ys = [_group(c)[cat] for c in r["peak_by_category_gib"]]
                xs = [s_ + (k - 0.5) * w for s_ in range(p)]
                ax.bar(xs, ys, w, bottom=bottom, color=colors[cat], edgecolor="white", lw=0.3,
                       label=cat if k == 0 else None, hatch="" if k == 0 else "//")
                bottom = [a + b for a, b in zip(bottom, ys)]
        ax.axhline(BUDGET / GiB, color="r", lw=1, ls="--")
        ax.text(-0.5, BUDGET / GiB, f"budget {BUDGET / GiB:.0f} GiB", color="r", ha="left", va="bottom",
                fontsize=8)
        ax.set_ylim(0, 100)
        ax.set_xticks(range(p))
        ax.set_xlabel("pipeline stage (left: best DeepSpeed stock; right, hatched: rung 5)")
        ax.set_ylabel("peak GiB per GPU")
        ax.legend(fontsize=7, ncol=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rounded(x):
    """Floats to 5 significant digits, for a readable JSON record."""
    if isinstance(x, float):
        return float(f"{x:.5g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the md/json")
    ap.add_argument("--png", default=str(ROOT / "docs" / "at_scale_70b.png"))
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite the markdown and the PNG from the recorded JSON (nothing is simulated)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.render_only:
        rec = json.loads((out / "at_scale_70b.json").read_text())
        (out / "at_scale_70b.json").write_text(json.dumps(_rounded(rec), indent=1))
        (out / "at_scale_70b.md").write_text(_md(rec["layouts"], rec["wall_s"]))
        plot(rec["layouts"], Path(a.png))
        return 0
    # Check first: the simulator's equal-stage bubble against the closed form (p-1)/(m+p-1).
    chk = simulate(build_schedule("1f1b", 8, 32), [StageCost(1.0, 2.0)] * 8)
    assert math.isclose(chk.bubble_fraction, 7 / 39, rel_tol=1e-9), chk.bubble_fraction
    t0 = time.perf_counter()
    results = []
    runs = [(p, t, 4096, False, RESERVED / GiB) for p, t in LAYOUTS]
    runs += [(p, t, *sc) for p, t in MAIN_LAYOUTS for sc in SCENARIOS]
    for p, t, seq, fused, reserved in runs:
        res = ladder(p, t, seq, fused, reserved)
        results.append(res)
        for r in res["rungs"]:
            print(f"p={p} t={t} {_scenario(res)}: {r['rung']:<40} {r['label']:<60} "
                  f"{r['step_time_s']:.3f} s {r['tokens_per_s']:>9,.0f} tok/s bubble {r['bubble']:.1%} "
                  f"peak {max(r['peak_gib']):.1f} GiB", flush=True)
    wall = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "at_scale_70b.json").write_text(json.dumps(_rounded(
        {"assumptions": ASSUMPTIONS, "budget_gib": BUDGET / GiB, "seqs_per_step": SEQS_PER_STEP,
         "hardware": HW.name, "layouts": results, "wall_s": wall, "machine": machine()}), indent=1))
    (out / "at_scale_70b.md").write_text(_md(results, wall))
    plot(results, Path(a.png))
    print(f"wrote {out / 'at_scale_70b.md'}, {a.png} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
