"""Measure what the planner needs, with the real kernels on the current device.

Per layer and per weight format the precision policy allows:
  - forward time, input-gradient time (``autograd.grad`` w.r.t. the layer input only) and
    weight-gradient time (full backward minus the input-gradient part), medians of ``reps`` runs
    after ``warmup`` runs, at each micro-batch size asked for;
  - activation bytes saved for backward (every tensor autograd packs during forward, counted once
    per storage, parameters excluded), bytes entering and leaving the layer;
  - storage bytes of the layer's weights in that format (``quant.measure_storage``) and the relative
    weight error of the quantized Linear layers (the sensitivity the quality loop uses).
Per codec: payload bytes per raw byte (``compress.payload_nbytes``) and encode/decode seconds per raw
byte on a boundary-shaped tensor. Between ranks: latency and bandwidth (``measure_link``).
Per optimizer kind (``optimizer_costs``): step seconds per parameter of fp32 Adam, bitsandbytes' 8-bit
Adam and the master-free update (fp32 or 8-bit states), which differ by up to 40x on a CPU.

The profile is cached as JSON keyed by the layer shapes, micro-batch sizes, formats, device and
versions; a cache written for anything else is ignored with a warning and measured again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from deepspeed_ppq.autotune.costs import DEFAULT_LINK, CodecOption, LayerProfile
from deepspeed_ppq.schedule import LinkModel

__all__ = [
    "profile_layers", "merge_parts", "profile_codecs", "measure_link", "optimizer_costs", "profile_key",
    "load_cached", "save_cache", "save_profile",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], None], device: torch.device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Stack(nn.Module):
    """The layers under the names a ``PipelineModule`` gives them (``"3.attn.qkv"``)."""

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        for i, layer in enumerate(layers):
            self.add_module(str(i), layer)


def _decisions(layers, kinds, weights_cfg, fmt: str) -> dict[str, str]:
    """Linear name -> format under the user's policy with ``fmt`` as the low-bit format."""
    from deepspeed_ppq.quant import plan as policy_plan

    cfg = weights_cfg.model_copy(update={"format": fmt})
    blocks = [i for i, k in enumerate(kinds) if k == "block"]
    shadow = _Stack([copy.deepcopy(layer).to("meta") for layer in layers])
    return {
        d.name: d.format.value for d in policy_plan(shadow, cfg, block_layers=blocks, num_blocks=len(blocks))
    }


def _convert(
    layer: nn.Module, index: int, decisions: dict[str, str], weights_cfg
) -> tuple[nn.Module, int, float]:
    """A converted copy of ``layer``: (copy, quantized trainable parameters, relative weight error)."""
    from deepspeed_ppq.quant import QuantLinear

    layer = copy.deepcopy(layer)
    nq, err2, norm2 = 0, 0.0, 0.0
    prefix = f"{index}."
    for name, fmt in decisions.items():
        if not name.startswith(prefix) or fmt == "none":
            continue
        sub = name[len(prefix) :]
        mod = layer.get_submodule(sub)
        q = QuantLinear.from_linear(mod, fmt, weights_cfg.model_copy(update={"format": fmt}))
        w = mod.weight.detach().float()
        err2 += float((q.dequantized_weight() - w).pow(2).sum())
        norm2 += float(w.pow(2).sum())
        if mod.weight.requires_grad:  # a weight the model froze has no master to keep
            nq += w.numel()
        parent, _, child = sub.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, child, q)
    return layer, nq, (err2 / norm2) ** 0.5 if norm2 > 0 else 0.0


def _workspace_bytes(layer: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the dense buffer the layer's largest low-bit weight dequantizes into (in the dtype of the
    activations it computes with)."""
    from deepspeed_ppq.quant import QuantLinear

    dtype = x.dtype if x.is_floating_point() else torch.float32
    sizes = [math.prod(m.qweight.shape) for m in layer.modules() if isinstance(m, QuantLinear)]
    return max(sizes, default=0) * dtype.itemsize


def _saved_bytes(layer: nn.Module, x: torch.Tensor, loss_fn=None, labels=None) -> int:
    """Bytes of the tensors autograd saves during ``layer(x)`` (and the loss on it, for the last
    layer), each storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
        if loss_fn is not None:
            loss_fn(y, labels)
    return sum(seen.values())


def _peak_bytes(layer: nn.Module, x: torch.Tensor, loss_fn=None, labels=None) -> int:
    """Peak activation + temporary bytes while ``layer`` runs forward and backward alone (its input
    and the incoming gradient excluded: the stage's pipe buffers hold those), measured by the same
    tracker the trials use."""
    from deepspeed_ppq.autotune.memory import StageMemTracker

    xin = x.detach().requires_grad_(x.is_floating_point())
    with torch.no_grad():
        probe = layer(xin)
    grad_out = None if loss_fn is not None else torch.randn_like(probe)
    del probe
    tracker = StageMemTracker()
    tracker.track_external(layer, xin, *([] if grad_out is None else [grad_out]))
    with tracker:
        out = layer(xin)
        if loss_fn is not None:
            out = loss_fn(out, labels)
        if _has_backward(layer, x):
            out.backward(grad_out)
        del out
    layer.zero_grad(set_to_none=True)
    peak = tracker.peak()
    return peak["activations"] + peak["temporaries"]


def _has_backward(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether a backward runs through ``layer``: a floating input, or a parameter to train (a frozen
    embedding on token ids has none)."""
    return x.is_floating_point() or any(p.requires_grad for p in layer.parameters())


def _layer_times(layer, x, loss_fn, labels, device, reps, warmup) -> tuple[list[float], torch.Tensor]:
    """[forward, backward_input, backward_weight] seconds and the layer's output."""
    needs_input_grad = x.is_floating_point()
    xin = x.detach().requires_grad_(needs_input_grad)

    def out_of(inp):
        y = layer(inp)
        return loss_fn(y, labels) if loss_fn is not None else y

    with torch.no_grad():
        y0 = layer(xin)
    if not _has_backward(layer, x):
        return [_median_time(lambda: out_of(xin), device, reps, warmup), 0.0, 0.0], y0.detach()
    grad_out = None if loss_fn is not None else torch.randn_like(y0)

    def fwd():
        with torch.no_grad():
            layer(xin)

    def full():
        layer.zero_grad(set_to_none=True)
        out = out_of(xin)
        out.backward(grad_out)

    t_fwd = _median_time(lambda: out_of(xin), device, reps, warmup)
    t_full = _median_time(full, device, reps, warmup) - t_fwd
    if needs_input_grad:

        def input_only():
            out = out_of(xin)
            torch.autograd.grad(out, xin, grad_out)

        t_in = min(_median_time(input_only, device, reps, warmup) - t_fwd, t_full)
    else:
        t_in = 0.0
    layer.zero_grad(set_to_none=True)
    return [t_fwd, max(t_in, 0.0), max(t_full - t_in, 0.0)], y0.detach()


def profile_layers(
    layers: Sequence[nn.Module],
    kinds: Sequence[str],
    make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    weights_cfg=None,
    formats: Sequence[str] = ("int8", "nf4"),
    micro_batch_sizes: Sequence[int] = (1, 2),
    reps: int = 5,
    warmup: int = 2,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    share: tuple[int, int] = (0, 1),
) -> list[LayerProfile]:
    """Profile every layer in every format the policy allows (see the module docstring).

    Args:
        layers: the pipeline's layer list (``PipelineModule`` order).
        kinds: ``"embed"``, ``"block"``, ``"head"`` or ``"other"`` per layer.
        make_batch: ``make_batch(b) -> (inputs, labels)`` for a micro-batch of ``b`` samples.
        loss_fn: ``loss_fn(last layer output, labels)``; its time counts in the last layer.
        weights_cfg: the ``WeightsConfig`` whose policy (rules, kept blocks, sensitive names)
            says which Linear layers may go low-bit; its ``format`` is replaced by each of ``formats``.
        formats: low-bit formats to measure.
        micro_batch_sizes: sizes to time at (the planner interpolates between them).
        reps, warmup: timed and untimed repetitions; the median is kept.
        device: where to measure (default: CUDA if available, else CPU).
        dtype: the training dtype the layers run in (``torch.bfloat16`` for DeepSpeed's bf16 mode):
            their floating-point weights and inputs are cast to it, so times, saved activations and
            weight bytes are the bf16 engine's.
        share: ``(index, count)``: measure only layer ``i`` at the ``s``-th size where
            ``(i + s) % count == index`` (the ranks of a tuning run each take a share, every rank
            a mix of small and large sizes); a layer not measured at a size runs forward once, to give
            the next layer its input. Merge the shares with ``merge_parts``.

    Returns:
        One ``LayerProfile`` per layer; its size-independent fields (saved, weight, workspace and I/O
        bytes, quantization error) are measured at the smallest size it is measured at, and a layer
        measured at no size has none of them.
    """
    from deepspeed_ppq.config import WeightsConfig
    from deepspeed_ppq.quant import measure_storage

    if len(kinds) != len(layers):
        raise ValueError(f"kinds has {len(kinds)} entries for {len(layers)} layers")
    weights_cfg = weights_cfg or WeightsConfig()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    decisions = {f: _decisions(layers, kinds, weights_cfg, f) for f in formats}
    profiles: list[LayerProfile] = []
    per_layer: list[dict] = [
        {"times": {}, "weight_bytes": {}, "saved_bytes": {}, "peak_bytes": {}, "quant_error": {}, "nq": 0,
         "workspace_bytes": {}}
        for _ in layers
    ]
    allowed = [
        [f for f in formats if any(n.startswith(f"{i}.") and v != "none" for n, v in decisions[f].items())]
        for i in range(len(layers))
    ]
    index, count = share
    if not 0 <= index < count:
        raise ValueError(f"share {share!r}: want (index, count) with 0 <= index < count")
    io_bytes = [[0, 0] for _ in layers]
    measured = [False] * len(layers)  # at some size already: the size-independent fields are held
    for s, b in enumerate(micro_batch_sizes):
        x, labels = make_batch(b)
        x, labels = x.to(device), labels.to(device)
        if x.is_floating_point():
            x = x.to(dtype)
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            if (i + s) % count != index:  # another share's: only its output, for the next layer
                if not last:
                    with torch.no_grad():
                        x = copy.deepcopy(layer).to(device=device, dtype=dtype)(x)
                continue
            first = not measured[i]
            measured[i] = True
            y_next = None
            for fmt in ["none", *allowed[i]]:
                if fmt == "none":
                    mod, nq, err = copy.deepcopy(layer), 0, 0.0
                else:
                    mod, nq, err = _convert(layer, i, decisions[fmt], weights_cfg)
                    per_layer[i]["nq"] = max(per_layer[i]["nq"], nq)
                mod = mod.to(device=device, dtype=dtype)
                t, y = _layer_times(mod, x, loss_fn if last else None, labels, device, reps, warmup)
                rec = per_layer[i]
                rec["times"].setdefault(fmt, {})[b] = t
                peak = _peak_bytes(mod, x, loss_fn if last else None, labels)
                rec["peak_bytes"].setdefault(fmt, {})[b] = peak
                if first:
                    xin = x.detach().requires_grad_(x.is_floating_point())
                    rec["saved_bytes"][fmt] = _saved_bytes(mod, xin, loss_fn if last else None, labels) // b
                    led = measure_storage(mod).groups()
                    rec["weight_bytes"][fmt] = led.get("weights", 0) + led.get("buffers", 0)
                    rec["workspace_bytes"][fmt] = _workspace_bytes(mod, x)
                    rec["quant_error"][fmt] = err
                    io_bytes[i] = [x.nbytes // b, y.nbytes // b]
                if fmt == "none":
                    y_next = y
            x = y_next
    for i, layer in enumerate(layers):
        rec = per_layer[i]
        profiles.append(
            LayerProfile(
                name=str(i),
                kind=kinds[i],
                param_numels=[p.numel() for p in layer.parameters() if p.requires_grad],
                quantizable_params=rec["nq"],
                allowed_formats=["none", *allowed[i]],
                times=rec["times"],
                weight_bytes=rec["weight_bytes"],
                saved_bytes=rec["saved_bytes"],
                input_bytes=io_bytes[i][0],
                output_bytes=io_bytes[i][1],
                quant_error=rec["quant_error"],
                peak_bytes=rec["peak_bytes"],
                workspace_bytes=rec["workspace_bytes"],
            )
        )
    return profiles


def merge_parts(parts: Sequence[list[LayerProfile]]) -> list[LayerProfile]:
    """One profile from ``profile_layers`` runs of the same layers that each measured a share of the
    layers and micro-batch sizes (the ranks of a tuning run): every part's times and peaks; each layer's
    size-independent fields (saved, weight, workspace and I/O bytes, quantization error) from the part
    that measured it at the smallest size."""
    n = len(parts[0])
    for part in parts[1:]:
        if len(part) != n:
            raise ValueError(f"a profile part has {len(part)} layers, the first {n}")
    sizes = {b for part in parts for lp in part for by_size in lp.times.values() for b in by_size}
    merged = []
    for i in range(n):
        held = [part[i] for part in parts if part[i].times]
        layer = copy.deepcopy(min(held, key=lambda lp: min(lp.times["none"]))) if held else None
        for other in held:
            for fmt, by_size in other.times.items():
                layer.times.setdefault(fmt, {}).update(by_size)
            for fmt, by_size in other.peak_bytes.items():
                layer.peak_bytes.setdefault(fmt, {}).update(by_size)
        missing = sizes - set(layer.times["none"] if layer else ())
        if missing:
            raise ValueError(f"layer {i} was measured in no profile part at micro-batch size(s) "
                             f"{sorted(missing)}")
        merged.append(layer)
    return merged


def profile_codecs(
    configs: Sequence[dict], shape: Sequence[int], reps: int = 5, device: torch.device | str = "cpu"
) -> list[CodecOption]:
    """Measure each codec on a boundary-shaped fp32 tensor: wire ratio and seconds per raw byte.

    Args:
        configs: ``CodecConfig`` fields per codec (``{"method": "quant", "bits": 8}``).
        shape: the boundary tensor's shape for one micro-batch.
    """
    from deepspeed_ppq.compress import BoundaryDecoder, BoundaryEncoder, payload_nbytes
    from deepspeed_ppq.config import CodecConfig

    out = []
    x = torch.randn(*shape, device=device)
    raw = x.nbytes
    for c in configs:
        cfg = CodecConfig.model_validate(c)
        if not cfg.enabled:
            out.append(CodecOption.make(cfg.model_dump(include={"method"}), bits=32))
            continue
        enc = BoundaryEncoder(cfg, name="profile")
        dec = BoundaryDecoder(cfg, name="profile")
        dev = torch.device(device)
        payload = enc.encode(x)
        t_enc = _median_time(lambda: enc.encode(x), dev, reps, 1)  # noqa: B023
        t_dec = _median_time(lambda: dec.decode(payload, x.shape, x.dtype), dev, reps, 1)  # noqa: B023
        bits = 8 if cfg.method == "fp8" else cfg.bits if cfg.method == "quant" else 32
        out.append(
            CodecOption.make(
                c,
                wire_ratio=payload_nbytes(cfg, tuple(x.shape), x.dtype) / raw,
                encode_s_per_byte=t_enc / raw,
                decode_s_per_byte=t_dec / raw,
                bits=bits,
            )
        )
    return out


def optimizer_costs(n: int = 1 << 20, reps: int = 5, device: torch.device | str = "cpu",
                    grad_dtype: str = "fp32") -> dict[str, float]:
    """Optimizer step seconds per parameter by kind, on an ``n``-value weight (median of ``reps``).

    Kinds (what ``planner.optimizer_kind_of`` charges each parameter):
      - ``adam``: ``torch.optim.Adam`` with fp32 states, fused (the fastest torch has), as the tuner's
        trials and plans run it;
      - ``adam8bit``: bitsandbytes ``Adam8bit`` (its CPU backend is plain PyTorch ops: ~40x fp32 Adam);
      - ``master_free`` / ``master_free_8bit``: a master-free int8 ``QuantLinear``'s update (dequantize,
        AdamW, stochastic-rounding re-quantize) with fp32 or 8-bit states, its gradient buffer in
        ``grad_dtype`` (``WeightsConfig.grad_dtype``).
    A kind whose package is missing (bitsandbytes) is left out; the planner then charges it as ``adam``.
    """
    from deepspeed_ppq.config import WeightsConfig
    from deepspeed_ppq.quant import QuantLinear
    from deepspeed_ppq.quant.master_free import master_free_step
    from deepspeed_ppq.quant.optim import build_optimizer

    dev = torch.device(device)
    side = int(round(n**0.5))
    n = side * side
    out = {}
    for kind in ("adam", "adam8bit"):
        p = nn.Parameter(torch.randn(side, side, device=dev) * 0.02)
        p.grad = torch.randn_like(p) * 1e-3
        try:
            opt = build_optimizer([p], kind, lr=1e-3, fused=True)
        except ImportError:
            continue
        out[kind] = _median_time(opt.step, dev, reps, 1) / n
    for key, o8 in (("master_free", False), ("master_free_8bit", True)):
        cfg = WeightsConfig(format="int8", master="none", optimizer_8bit=o8, grad_dtype=grad_dtype)
        lin = nn.Linear(side, side, bias=False, device=dev)
        try:
            layer = QuantLinear.from_linear(lin, "int8", cfg)
            layer.weight_grad = (torch.randn(side, side, device=dev) * 1e-3).to(layer.grad_dtype)
            step = lambda: master_free_step([layer], lr=1e-3)  # noqa: E731, B023
            out[key] = _median_time(step, dev, reps, 1) / n
        except ImportError:
            continue
    return out


def measure_link(
    sizes: Sequence[int] = (4096, 1 << 20, 4 << 20), reps: int = 9, peer: int | None = None, group=None
) -> LinkModel:
    """Latency and bandwidth between this rank and ``peer`` (ping-pong; both ranks must call it).

    Rank pairs (0, 1), (2, 3), ... measure each other; the fit ``time = latency + bytes / bandwidth``
    uses the median one-way time of each size. Without ``torch.distributed`` initialised, or alone,
    returns ``DEFAULT_LINK``.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return DEFAULT_LINK
    rank = dist.get_rank(group)
    peer = rank ^ 1 if peer is None else peer
    if peer >= dist.get_world_size(group):
        return DEFAULT_LINK
    points = []
    for n in sizes:
        buf = torch.empty(n, dtype=torch.uint8)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            if rank < peer:
                dist.send(buf, peer, group)
                dist.recv(buf, peer, group)
            else:
                dist.recv(buf, peer, group)
                dist.send(buf, peer, group)
            times.append((time.perf_counter() - t0) / 2)
        points.append((n, statistics.median(times[1:])))
    (n0, t0), (n1, t1) = points[0], points[-1]
    if t1 > t0:  # two-point fit of time = latency + bytes / bandwidth
        bw = (n1 - n0) / (t1 - t0)
        lat = max(t0 - n0 / bw, 0.0)
    else:  # noise swamped the size dependence: charge everything to bandwidth at the largest size
        bw, lat = n1 / t1, 0.0
    return LinkModel(latency_s=lat, bandwidth_Bps=bw)


# ----------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------
# What a cache file holds; bump when that changes (5: a whole ``runner.Profile`` under "profile", with
# peak_bytes per micro-batch size).
PROFILE_FORMAT = 6


def profile_key(layers: Sequence[nn.Module], **settings) -> str:
    """A hash of the layer shapes (and which parameters train), the settings (micro-batch sizes,
    formats, policy, ...), the device and its intra-op threads, the versions and ``PROFILE_FORMAT``; a
    cached profile is used only under the same key."""
    import deepspeed_ppq

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    sig = {
        "layers": [[type(m).__name__, [[list(p.shape), p.requires_grad] for p in m.parameters()]]
                   for m in layers],
        "settings": settings,
        "device": device,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "deepspeed_ppq": deepspeed_ppq.__version__,
        "format": PROFILE_FORMAT,
    }
    return hashlib.sha256(json.dumps(sig, sort_keys=True, default=str).encode()).hexdigest()[:20]


def load_cached(path: str | Path, key: str) -> dict | None:
    """The cached profile at ``path`` if it was written under ``key``; otherwise warn and return None."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        warnings.warn(f"profile cache {p} is corrupted ({e}); measuring again", stacklevel=2)
        return None
    if not isinstance(data, dict):
        warnings.warn(f"profile cache {p} holds no profile object; measuring again", stacklevel=2)
        return None
    if data.get("key") != key:
        warnings.warn(
            f"profile cache {p} was measured for another model, device or version "
            f"(key {data.get('key')} != {key}); measuring again",
            stacklevel=2,
        )
        return None
    return data


def save_cache(
    path: str | Path, key: str, layers: list[LayerProfile], codecs: list[CodecOption], extra: dict
) -> None:
    data = {
        "key": key,
        "layers": [lp.to_dict() for lp in layers],
        "codecs": [
            {
                "config": c.as_dict,
                "wire_ratio": c.wire_ratio,
                "encode_s_per_byte": c.encode_s_per_byte,
                "decode_s_per_byte": c.decode_s_per_byte,
                "bits": c.bits,
            }
            for c in codecs
        ],
        **extra,
    }
    Path(path).write_text(json.dumps(data, indent=1))


def save_profile(path: str | Path, key: str, profile: dict) -> None:
    """Write a ``runner.Profile`` dict under ``key`` (read back by ``load_cached(path, key)["profile"]``);
    written to a temporary file and renamed, so an interrupted run leaves no half-written cache."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps({"key": key, "format": PROFILE_FORMAT, "profile": profile}, indent=1))
    tmp.replace(p)


def layers_from_cache(data: dict) -> tuple[list[LayerProfile], list[CodecOption]]:
    layers = [LayerProfile.from_dict(d) for d in data["layers"]]
    codecs = [CodecOption.make(c.pop("config"), **c) for c in (dict(c) for c in data["codecs"])]
    return layers, codecs
