"""Memory ledger: exact bytes of a stage's weights, gradients, masters and optimizer states.

Two ways to the same shape of answer, a ``MemoryLedger`` (category -> bytes):

* analytic, without allocating anything: ``ledger_from_model`` (a model and a policy/config; the
  model may be on the ``meta`` device) and ``ledger_from_shapes`` (a list of
  ``(name, shape, format)`` for a model that is never built; the autotuner and simulator use it);
* measured: ``measure_storage(model, optimizer)`` walks a live model and optimizer and adds up the
  storage bytes of every tensor they hold (each storage counted once).

Categories (dotted below the categories of ``deepspeed_ppq.memory_categories``, the vocabulary the planner,
the simulator and the measured tracker share; ``MemoryLedger.groups()`` sums by category, ``coarse()`` into
the coarse categories a measurement is compared in):

=================================  ============================================================
``weights.dense.<dtype>``          parameters kept in the training dtype (norms, embeddings, LM
                                   head, biases, layers the policy keeps, LoRA adapters)
``weights.<fmt>.codes``            low-bit codes of the compute copy (int8: 1 B, int4/nf4: 1/2 B)
``weights.<fmt>.scales``           their block scales (fp32 or bf16; double-quant extras included)
``master_weights``                 fp32 master of each "train"-mode low-bit layer (its
                                   ``nn.Parameter``; the optimizer updates it)
``gradients``                      one gradient per trainable parameter, in its dtype
``optimizer.state``                full-precision moments (fp32 Adam: 8 B/param)
``optimizer.state_8bit``           8-bit moments (2 B/param) ...
``optimizer.absmax``               ... and their fp32 block absmax (2 x 4 B per 256 values)
``optimizer.qmap``                 the two shared 8-bit code maps (2 KiB per optimizer)
``optimizer.step``                 torch Adam's 0-dim fp32 ``step`` per tensor
``buffers``                        module buffers (masks, running stats)
``optimizer.wrapper``              measured only: the flat fp32 masters, gradient buffers and the
                                   like that a DeepSpeed bf16/fp16/ZeRO optimizer wrapper holds
``workspace``                      the dense dequantization buffer ``QuantLinear`` shares: one per
                                   compute dtype and device, as large as the largest low-bit weight
=================================  ============================================================

Master-free layers (``WeightsConfig.master="none"``, ``quant.master_free``): codes + scales, no
``master_weights``; their gradient buffer is under ``gradients`` (4 B/value fp32, 2 B with
``grad_dtype="bf16"``; kept allocated between steps) and their AdamW moments under the
``optimizer.*`` categories: fp32 (8 B/value) or, with ``optimizer_8bit`` and at least 4096 values,
8-bit (2 B/value + ``absmax``), plus one pair of shared code maps (``optimizer.qmap``) per device.
The step count is a Python int (no ``optimizer.step`` bytes). Per value with int8, block 64, fp32
scales: 1.0625 + 4 + 8 = 13.06 B (fp32 moments) or 7.09 B (8-bit moments; 5.09 B with a bf16
gradient), against 16 B for a dense fp32 layer with Adam (10 B with 8-bit Adam).
Per layer, for the planner: ``ledger_from_shapes([ParamSpec(name, shape, "int8", master="none")],
WeightsConfig(master="none", optimizer_8bit=...), optimizer=...)``.

Accounting of a "train"-mode low-bit layer with fp32 Adam, per weight element: master 4 B +
gradient 4 B + Adam 8 B + codes (1 B int8, 0.5 B int4) + scales; the dense fp32 layer has 16 B.
The low-bit compute copy pays off with 8-bit states (-6 B), in "frozen" mode (codes + scales
only: no master, gradient or state) and for the bytes the forward pass reads.

Scope: the model's parameters are what the optimizer updates (plain torch training, DeepSpeed fp32
without ZeRO). DeepSpeed's bf16/fp16 and ZeRO wrappers keep extra fp32 flat copies: ``measure_storage``
counts them as ``optimizer.wrapper`` (given the engine), the prediction does not model them. ZeRO also
flattens the bf16 parameters into one buffer, so the first parameter that reaches it carries its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from deepspeed_ppq.config import WeightFormat, WeightsConfig
from deepspeed_ppq.formats import GRAD_DTYPE_BYTES, MASTER_FREE_FORMATS, format_spec
from deepspeed_ppq.memory_categories import category, coarse
from deepspeed_ppq.quant.formats import weight_storage_bytes
from deepspeed_ppq.quant.linear import QuantLinear, workspace_tensors
from deepspeed_ppq.quant.master_free import shared_code_maps
from deepspeed_ppq.quant.optim import (
    MIN_8BIT_SIZE,
    optimizer_shared_bytes,
    optimizer_state_bytes,
    underlying_optimizer,
)
from deepspeed_ppq.quant.policy import as_policy, plan

__all__ = [
    "MemoryLedger",
    "ParamSpec",
    "ledger_from_shapes",
    "ledger_from_model",
    "measure_storage",
    "low_bit_tensors",
]

@dataclass
class MemoryLedger:
    """Bytes by category (see the module docstring); add ledgers to sum stages."""

    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, nbytes: int) -> None:
        """Add ``nbytes`` under ``key``, a category or a dotted key below one (``ValueError`` otherwise)."""
        category(key, legacy={})
        if nbytes:
            self.bytes[key] = self.bytes.get(key, 0) + int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def groups(self) -> dict[str, int]:
        """Bytes by category (weights, master_weights, gradients, optimizer, buffers, workspace)."""
        out: dict[str, int] = {}
        for k, v in self.bytes.items():
            top = category(k)
            out[top] = out.get(top, 0) + v
        return out

    def coarse(self) -> dict[str, int]:
        """Bytes by coarse category (parameters, gradients, ...): what a measurement is compared in."""
        return coarse(self.bytes)

    def __getitem__(self, category: str) -> int:
        """Bytes of a category or of every category under a dotted prefix (``ledger["weights"]``)."""
        return sum(v for k, v in self.bytes.items() if k == category or k.startswith(category + "."))

    def __add__(self, other: MemoryLedger) -> MemoryLedger:
        out = MemoryLedger(dict(self.bytes))
        for k, v in other.bytes.items():
            out.add(k, v)
        return out

    def to_dict(self) -> dict:
        return {"bytes": dict(sorted(self.bytes.items())), "groups": self.groups(), "total": self.total}

    def table(self, title: str = "memory ledger") -> str:
        """A fixed-width table: category, bytes, MiB, share of the total."""
        tot = self.total or 1
        rows = [(k, v) for k, v in sorted(self.bytes.items())]
        w = max([len(k) for k, _ in rows] + [8])
        lines = [title, f"{'category'.ljust(w)}  {'bytes':>14}  {'MiB':>9}  {'share':>6}"]
        lines += [f"{k.ljust(w)}  {v:>14,}  {v / 2**20:>9.3f}  {100 * v / tot:>5.1f}%" for k, v in rows]
        lines.append(f"{'total'.ljust(w)}  {self.total:>14,}  {self.total / 2**20:>9.3f}  100.0%")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of a model description.

    ``format`` is the low-bit storage of a weight (``none``: dense); ``mode`` is ``"train"``
    (trained) or ``"frozen"`` (low-bit base only; add ``lora`` adapters); a low-bit weight with
    ``trainable=False`` was frozen by the model itself and keeps its codes only; ``master`` is ``"fp32"``
    (an fp32 master weight) or ``"none"`` (master-free: codes updated in place), train mode only.
    None takes the ``WeightsConfig``'s.
    """

    name: str
    shape: tuple[int, ...]
    format: WeightFormat = WeightFormat.none
    dtype: torch.dtype = torch.float32
    trainable: bool = True
    mode: str = "train"
    master: str | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "format", WeightFormat(self.format or "none"))
        except ValueError:
            allowed = ", ".join(f.value for f in WeightFormat)
            raise ValueError(
                f"ledger entry {self.name!r}: format={self.format!r} is not a weight format; "
                f"allowed: {allowed}"
            ) from None
        if self.mode not in ("train", "frozen"):
            raise ValueError(f"ledger entry {self.name!r}: mode={self.mode!r}; use 'train' or 'frozen'")
        if self.master not in (None, "fp32", "none"):
            raise ValueError(f"ledger entry {self.name!r}: master={self.master!r}; use 'fp32' or 'none'")
        if self.master == "none" and (self.mode != "train" or self.format == WeightFormat.none
                                      or not format_spec(self.format).master_free):
            raise ValueError(
                f"ledger entry {self.name!r}: master='none' needs mode='train' and an 8-bit format "
                f"({', '.join(MASTER_FREE_FORMATS)}), got mode={self.mode!r}, format={self.format.value!r}"
            )
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))


def _as_spec(entry) -> ParamSpec:
    if isinstance(entry, ParamSpec):
        return entry
    if not isinstance(entry, (tuple, list)) or len(entry) < 2:
        raise TypeError(f"ledger entry {entry!r}: expected ParamSpec or (name, shape, format[, dtype])")
    name, shape, *rest = entry
    fmt = rest[0] if rest else WeightFormat.none
    dtype = rest[1] if len(rest) > 1 else torch.float32
    return ParamSpec(str(name), tuple(shape), fmt, dtype)


def ledger_from_shapes(
    entries: Iterable,
    weights_cfg: WeightsConfig | None = None,
    optimizer: str | None = "adam",
    gradients: bool = True,
    momentum: float = 0.0,
    min_8bit_size: int = MIN_8BIT_SIZE,
    buffers_bytes: int = 0,
    compute_dtype: torch.dtype | None = torch.float32,
) -> MemoryLedger:
    """Predict a stage's bytes from parameter shapes alone; nothing is allocated.

    Args:
        entries: ``ParamSpec``s or ``(name, shape, format[, dtype])`` tuples, one per parameter
            tensor (a weight and its bias are two entries; biases are always dense).
        weights_cfg: block size, scale dtype, double quantization, FP8 scale, mode and LoRA rank of
            the low-bit entries (defaults of ``WeightsConfig`` when None). ``mode="frozen"`` adds
            two LoRA adapters (``rank x in``, ``out x rank``, dense fp32, trainable) per low-bit 2-D weight.
        optimizer: one of ``OPTIMIZER_KINDS``, or None for no optimizer states.
        gradients: count a gradient per trainable parameter (as after ``backward``).
        buffers_bytes: bytes of module buffers to include as ``buffers``.
        compute_dtype: dtype of the activations, hence of the dequantization ``workspace`` (one
            buffer as large as the largest low-bit weight); None leaves the workspace out.

    Returns:
        The ``MemoryLedger``.
    """
    cfg = weights_cfg or WeightsConfig()
    led = MemoryLedger()
    trained: list[tuple[int, torch.dtype]] = []
    master_free: list[int] = []
    low_bit_shapes: set[tuple[int, ...]] = set()
    for e in entries:
        s = _as_spec(e)
        n = math.prod(s.shape)
        if s.format != WeightFormat.none:
            low_bit_shapes.add(s.shape)
        if s.format == WeightFormat.none:
            led.add(f"weights.dense.{_dtype_name(s.dtype)}", n * s.dtype.itemsize)
            if s.trainable:
                trained.append((n, s.dtype))
            continue
        for part, b in weight_storage_bytes(
            s.shape, s.format, cfg.block_size, cfg.scale_dtype, cfg.double_quant, cfg.fp8_scale
        ).items():
            led.add(f"weights.{s.format.value}.{part}", b)
        mode = s.mode if isinstance(e, ParamSpec) else cfg.mode
        master = (s.master if isinstance(e, ParamSpec) else None) or cfg.master
        if not s.trainable:  # frozen by the model itself: the codes are all it keeps
            continue
        if mode == "train" and master == "none":
            master_free.append(n)
        elif mode == "train":
            led.add("master_weights", n * 4)
            trained.append((n, torch.float32))
        else:
            out_f, in_f = s.shape[0], math.prod(s.shape[1:])
            for lora_n in (cfg.lora_rank * in_f, out_f * cfg.lora_rank):
                led.add("weights.dense.float32", lora_n * 4)
                trained.append((lora_n, torch.float32))
    if gradients:
        led.add("gradients", sum(n * dt.itemsize for n, dt in trained)
                + GRAD_DTYPE_BYTES[cfg.grad_dtype] * sum(master_free))
    if optimizer is not None and master_free:
        mf_kind = "adamw8bit" if cfg.optimizer_8bit else "adamw"
        for n in master_free:
            for k, b in optimizer_state_bytes(n, torch.float32, mf_kind, 0.0, MIN_8BIT_SIZE).items():
                if k != "optimizer.step":  # a Python int on the layer
                    led.add(k, b)
        for k, b in optimizer_shared_bytes(mf_kind, master_free, MIN_8BIT_SIZE).items():
            led.add(k, b)
    if optimizer is not None:
        for n, dt in trained:
            for k, b in optimizer_state_bytes(n, dt, optimizer, momentum, min_8bit_size).items():
                led.add(k, b)
        for k, b in optimizer_shared_bytes(optimizer, [n for n, _ in trained], min_8bit_size).items():
            led.add(k, b)
    led.add("buffers", buffers_bytes)
    if compute_dtype is not None:
        led.add("workspace", max((math.prod(shape) for shape in low_bit_shapes), default=0)
                * compute_dtype.itemsize)
    return led


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _model_specs(model: nn.Module, weights_cfg, **policy_kwargs) -> tuple[list[ParamSpec], WeightsConfig]:
    """Parameter specs of a model: converted ``QuantLinear`` layers as they are, plain ``nn.Linear``
    layers as the policy would convert them, everything else dense."""
    decisions = {}
    cfg = WeightsConfig()
    if weights_cfg is not None:
        pol = as_policy(weights_cfg, **policy_kwargs)
        cfg = pol.weights
        decisions = {d.name: d for d in plan(model, pol) if d.quantized}
    specs: list[ParamSpec] = []
    seen: set[int] = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            shape = (mod.out_features, mod.in_features)
            master = "none" if mod.master_free else "fp32" if mod.mode == "train" else None
            specs.append(  # a weight the model froze: codes only (no master, no adapters)
                ParamSpec(f"{mname}.weight", shape, mod.format, torch.float32, mod.lora_A is not None
                          or mod.mode == "train", mod.mode, master)
            )
            if mod.mode == "frozen":
                # the adapters are added by ledger_from_shapes from the base shape and lora_rank
                seen.update((id(mod.lora_A), id(mod.lora_B)))
            if mod.mode == "train":
                seen.add(id(mod.weight))
            if mod.bias is not None:
                seen.add(id(mod.bias))
                specs.append(
                    ParamSpec(
                        f"{mname}.bias",
                        tuple(mod.bias.shape),
                        WeightFormat.none,
                        mod.bias.dtype,
                        mod.bias.requires_grad,
                    )
                )
            cfg = mod.weights_cfg if weights_cfg is None else cfg
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            d = decisions.get(mname) if pname == "weight" else None
            if d is not None:
                specs.append(ParamSpec(f"{mname}.weight", tuple(p.shape), d.format, torch.float32,
                                       p.requires_grad or cfg.mode == "frozen",
                                       cfg.mode if p.requires_grad else "frozen"))
            else:
                trainable = p.requires_grad and not (
                    cfg.mode == "frozen" and decisions.get(mname) is not None
                )
                specs.append(
                    ParamSpec(f"{mname}.{pname}", tuple(p.shape), WeightFormat.none, p.dtype, trainable)
                )
    return specs, cfg


def ledger_from_model(
    model: nn.Module,
    weights_cfg=None,
    optimizer: str | None = "adam",
    gradients: bool = True,
    momentum: float = 0.0,
    min_8bit_size: int = MIN_8BIT_SIZE,
    compute_dtype: torch.dtype | None = torch.float32,
    **policy_kwargs,
) -> MemoryLedger:
    """Predict the bytes of ``model`` trained under ``weights_cfg``, without allocating.

    Args:
        model: plain or already converted (``convert_model``); may live on the ``meta`` device.
        weights_cfg: a ``WeightsConfig``/``PrecisionPolicy``/dict applied to its plain ``nn.Linear``
            layers; None counts the model as it is (converted layers with their own config).
        optimizer, gradients, momentum, min_8bit_size, compute_dtype: as in ``ledger_from_shapes``.
        **policy_kwargs: ``block_layers``/``num_blocks`` for the policy.

    Returns:
        The ``MemoryLedger`` (``measure_storage`` on the live model after a step gives the same).
    """
    specs, cfg = _model_specs(model, weights_cfg, **policy_kwargs)
    buf = sum(b.numel() * b.element_size() for b in model.buffers())
    return ledger_from_shapes(specs, cfg, optimizer, gradients, momentum, min_8bit_size, buf, compute_dtype)


def measure_storage(model: nn.Module, optimizer=None) -> MemoryLedger:
    """Add up the storage bytes a live model and optimizer hold, by ledger category.

    Every storage is counted once (tied weights, shared code maps), in the first category that
    reaches it. ``workspace`` counts the shared dequantization buffers on this model's devices (they
    exist after the first forward pass). ``model`` may be a DeepSpeed engine (its
    ``module`` and ``basic_optimizer`` are used).

    Args:
        model: the module (or engine).
        optimizer: a torch/bitsandbytes optimizer, a DeepSpeed engine or wrapper, or None.
    """
    wrapper = None
    if hasattr(model, "basic_optimizer") and hasattr(model, "module"):  # a DeepSpeed engine
        if optimizer is None:
            optimizer = model.basic_optimizer
        wrapper = getattr(model, "optimizer", None)
        model = model.module
    led = MemoryLedger()
    seen: set[tuple[str, int]] = set()

    def count(cat: str, t: torch.Tensor | None) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if key in seen or st.nbytes() == 0:
            return
        seen.add(key)
        led.add(cat, st.nbytes())

    params: list[nn.Parameter] = []
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and mod.mode == "train" and not mod.master_free:
            count("master_weights", mod.weight)
        for p in mod.parameters(recurse=False):
            count(f"weights.dense.{_dtype_name(p.dtype)}", p)
            params.append(p)
        for b in mod.buffers(recurse=False):
            count("buffers", b)
    for p in params:
        count("gradients", p.grad)
    for cat, t in low_bit_tensors(model):
        count(cat, t)
    if optimizer is not None:
        opt = underlying_optimizer(optimizer)
        for state in opt.state.values():
            for key, t in state.items():
                if not isinstance(t, torch.Tensor):
                    continue
                if key == "step":
                    cat = "optimizer.step"
                elif key.startswith("qmap"):
                    cat = "optimizer.qmap"
                elif key.startswith("absmax"):
                    cat = "optimizer.absmax"
                elif t.dtype == torch.uint8:
                    cat = "optimizer.state_8bit"
                else:
                    cat = "optimizer.state"
                count(cat, t)
        # fp32 flat copies a mixed-precision/ZeRO wrapper hands the torch optimizer, and their grads
        for g in opt.param_groups:
            for p in g["params"]:
                count("optimizer.wrapper", p)
                count("optimizer.wrapper", p.grad)
    if wrapper is not None and not isinstance(wrapper, torch.optim.Optimizer):
        for t in _tensors_in(wrapper):
            count("optimizer.wrapper", t)
    return led


def low_bit_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(ledger category, tensor)`` of what the low-bit layers of ``model`` hold outside their
    parameters: codes and scales (``weights.<format>.codes|scales``), master-free weights' gradient buffer
    (``gradients``) and AdamW states (``optimizer.*``, with the shared 8-bit code maps of their device),
    and the shared dequantization buffer of each device (``workspace``, once it exists). Tensors a
    parameter-walking measure (``measure_storage``, PyTorch's memory tracker) cannot see by itself."""
    out: list[tuple[str, torch.Tensor]] = []
    devices, qmap_devices = set(), set()
    for mod in model.modules():
        if not isinstance(mod, QuantLinear):
            continue
        devices.add(str(mod.qweight.qdata.device))
        for name, t in mod.qweight.storage_tensors().items():
            out.append((f"weights.{mod.format.value}.{'codes' if name == 'qdata' else 'scales'}", t))
        if mod.master_free:
            if mod.weight_grad is not None:
                out.append(("gradients", mod.weight_grad))
            for key, t in mod.optim_state.items():
                if key.startswith("absmax"):
                    out.append(("optimizer.absmax", t))
                elif t.dtype == torch.uint8:
                    out.append(("optimizer.state_8bit", t))
                    qmap_devices.add(str(t.device))
                else:
                    out.append(("optimizer.state", t))
    code_maps = shared_code_maps()
    for dev in qmap_devices:
        out += [("optimizer.qmap", t) for t in code_maps.get(dev, ())]
    out += [("workspace", t) for (_dtype, dev), t in workspace_tensors().items() if dev in devices]
    return out


def _tensors_in(obj, depth: int = 4, _seen: set | None = None):
    """Tensors reachable from a DeepSpeed optimizer wrapper's attributes (lists, dicts, nested objects)."""
    seen = _seen if _seen is not None else set()
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors_in(v, depth - 1, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth - 1, seen)
    elif not isinstance(
        obj, (nn.Module, torch.optim.Optimizer, str, bytes, int, float, bool, type(None))
    ) and hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from _tensors_in(v, depth - 1, seen)
