"""Optimizers for low-bit training: builders, their exact state sizes, and the re-quantize hook.

Supported kinds (``OPTIMIZER_KINDS``):

* ``adam`` / ``adamw``: ``torch.optim.Adam``/``AdamW``. State per parameter tensor: ``exp_avg`` and
  ``exp_avg_sq`` shaped and typed like the parameter (8 B/param for fp32) plus a 0-dim fp32 ``step``.
* ``adam8bit`` / ``adamw8bit``: bitsandbytes ``Adam8bit``/``AdamW8bit`` (block-wise dynamic 8-bit
  states), whose CPU step on fp32 parameters is our fused kernel (``quant.adam8bit``: bitsandbytes'
  CPU backend is ~40x slower than fp32 Adam; bf16/fp16 parameters keep its step). A tensor with at
  least ``min_8bit_size`` (4096) elements gets two uint8 states (2 B/param) plus two fp32 ``absmax``
  per block of 256; smaller tensors keep two fp32 states (8 B/param). Two 256-entry fp32 code maps
  (``qmap1``, ``qmap2``) are shared by all tensors of one optimizer. ``step`` is a Python int (no
  tensor).
* ``sgd``: ``torch.optim.SGD``; a ``momentum_buffer`` like the gradient when ``momentum > 0``, else none.

``requantize_after_step(optimizer, model)`` refreshes every ``QuantLinear`` compute copy from its
master weight after each step: a step post-hook on the torch optimizer when it updates the model's
parameters (a plain loop; a DeepSpeed fp32 engine calls the same ``basic_optimizer.step``), or a
wrapped ``step`` on DeepSpeed's bf16/fp16/ZeRO-1/2 optimizer wrapper, which copies its fp32 result
into the model's parameters at the end of its own ``step``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from deepspeed_ppq.quant import adam8bit
from deepspeed_ppq.quant.adam8bit import BNB_BLOCK_SIZE, MIN_8BIT_SIZE
from deepspeed_ppq.quant.linear import QuantLinear

__all__ = [
    "OPTIMIZER_KINDS",
    "MIN_8BIT_SIZE",
    "build_optimizer",
    "optimizer_kind",
    "optimizer_state_bytes",
    "optimizer_shared_bytes",
    "underlying_optimizer",
    "after_each_step",
    "requantize_after_step",
]

OPTIMIZER_KINDS = ("adam", "adamw", "adam8bit", "adamw8bit", "sgd")
_BNB_QMAP_BYTES = 256 * 4  # one 256-entry fp32 code map


def _check_kind(kind: str) -> str:
    if kind not in OPTIMIZER_KINDS:
        raise ValueError(f"optimizer={kind!r} is not supported; use one of {', '.join(OPTIMIZER_KINDS)}")
    return kind


def optimizer_kind(weights_cfg, base: str = "adamw") -> str:
    """The optimizer kind a ``WeightsConfig`` asks for: ``base`` with 8-bit states when
    ``optimizer_8bit`` is set (``adam`` -> ``adam8bit``, ``adamw`` -> ``adamw8bit``)."""
    _check_kind(base)
    if not weights_cfg.optimizer_8bit or base.endswith("8bit"):
        return base
    if base == "sgd":
        raise ValueError("weights.optimizer_8bit=true needs an Adam-type optimizer (adam, adamw), got 'sgd'")
    return base + "8bit"


def build_optimizer(
    params: Iterable[nn.Parameter] | Iterable[dict],
    kind: str = "adam",
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    momentum: float = 0.0,
    min_8bit_size: int = MIN_8BIT_SIZE,
    fused: bool = False,
) -> torch.optim.Optimizer:
    """A torch or bitsandbytes optimizer of ``kind`` (see the module docstring).

    Args:
        params: parameters or parameter groups (only those with ``requires_grad``).
        kind: one of ``OPTIMIZER_KINDS``.
        min_8bit_size: 8-bit kinds only: smaller tensors keep fp32 states.
        fused: ``adam``/``adamw`` only: torch's fused implementation, the fastest it has (on CPU and
            CUDA floating-point parameters; the tuner compares against it). Ignored where it does not
            apply.
    """
    _check_kind(kind)
    if kind in ("adam", "adamw"):
        cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
        params = list(params)
        if fused and _fused_ok(params):
            return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    cls = adam8bit.optimizer_class(kind)
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, min_8bit_size=min_8bit_size)


def _fused_ok(params: list) -> bool:
    tensors = [p for x in params for p in (x["params"] if isinstance(x, dict) else [x])]
    return bool(tensors) and all(
        t.is_floating_point() and t.device.type in ("cpu", "cuda") and t.dtype != torch.float64
        for t in tensors)


def optimizer_state_bytes(
    numel: int,
    dtype: torch.dtype = torch.float32,
    kind: str = "adam",
    momentum: float = 0.0,
    min_8bit_size: int = MIN_8BIT_SIZE,
) -> dict[str, int]:
    """Exact optimizer-state bytes for one trainable parameter tensor, by ledger category.

    Categories: ``optimizer.state`` (full-precision moments), ``optimizer.state_8bit`` (uint8 codes),
    ``optimizer.absmax`` (8-bit block scales), ``optimizer.step`` (torch's 0-dim step tensor).
    The shared code maps of 8-bit optimizers are in ``optimizer_shared_bytes``.
    """
    _check_kind(kind)
    size = torch.empty((), dtype=dtype).element_size()
    if kind in ("adam", "adamw"):
        return {"optimizer.state": 2 * numel * size, "optimizer.step": 4}
    if kind == "sgd":
        return {"optimizer.state": numel * size} if momentum > 0 else {}
    if numel < min_8bit_size:
        return {"optimizer.state": 2 * numel * 4}
    blocks = math.ceil(numel / BNB_BLOCK_SIZE)
    return {"optimizer.state_8bit": 2 * numel, "optimizer.absmax": 2 * blocks * 4}


def optimizer_shared_bytes(kind: str, numels: Iterable[int],
                           min_8bit_size: int = MIN_8BIT_SIZE) -> dict[str, int]:
    """State shared by all tensors of one optimizer: the two 8-bit code maps, when any tensor is 8-bit."""
    _check_kind(kind)
    if kind in ("adam8bit", "adamw8bit") and any(n >= min_8bit_size for n in numels):
        return {"optimizer.qmap": 2 * _BNB_QMAP_BYTES}
    return {}


def underlying_optimizer(opt) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` that updates the parameters: itself, or a DeepSpeed engine's
    ``basic_optimizer``, or a wrapper's ``.optimizer``."""
    seen = 0
    while not isinstance(opt, torch.optim.Optimizer):
        nxt = getattr(opt, "basic_optimizer", None) or getattr(opt, "optimizer", None)
        if nxt is None or seen > 4:
            raise TypeError(f"cannot find a torch.optim.Optimizer inside {type(opt).__name__}")
        opt, seen = nxt, seen + 1
    return opt


class _StepWrapHandle:
    """Undoes the ``step`` wrapping of ``after_each_step`` on a DeepSpeed optimizer wrapper."""

    def __init__(self, obj, orig):
        self._obj, self._orig = obj, orig

    def remove(self) -> None:
        if self._obj is not None:
            self._obj.step = self._orig
            self._obj = None


def after_each_step(optimizer, fn, *, updates_model: bool, error: str):
    """Call ``fn()`` after every ``optimizer.step()``, where the model's parameters hold its result.

    Args:
        optimizer: a torch/bitsandbytes optimizer or a DeepSpeed engine.
        fn: called with no arguments, under whatever grad mode the step leaves.
        updates_model: the torch optimizer (``underlying_optimizer``) steps the model's own parameters
            (plain loops; DeepSpeed fp32 without ZeRO): a step post-hook on it. Otherwise it steps flat
            fp32 copies (a DeepSpeed bf16/fp16 or ZeRO 1/2 wrapper, which copies the result back into
            the model's parameters at the end of its ``step``): the wrapper's ``step`` is wrapped on the
            instance, so ``fn`` runs after that copy.
        error: the ``ValueError`` message when neither applies (no wrapper whose ``step`` to follow).

    Returns:
        A handle; ``handle.remove()`` detaches it.
    """
    opt = underlying_optimizer(optimizer)
    if updates_model:
        return opt.register_step_post_hook(lambda *_args: fn())
    wrapper = getattr(optimizer, "optimizer", None) if hasattr(optimizer, "basic_optimizer") else optimizer
    if (
        wrapper is None
        or isinstance(wrapper, torch.optim.Optimizer)
        or not callable(getattr(wrapper, "step", None))
    ):
        raise ValueError(error)
    orig = wrapper.step

    def step(*args, **kwargs):
        out = orig(*args, **kwargs)
        fn()
        return out

    wrapper.step = step
    return _StepWrapHandle(wrapper, orig)


def requantize_after_step(optimizer, model: nn.Module):
    """Re-quantize every train-mode ``QuantLinear`` of ``model`` after each ``optimizer.step()``.

    Args:
        optimizer: a torch optimizer, a bitsandbytes optimizer, or a DeepSpeed engine.
        model: the module holding the ``QuantLinear`` layers (``engine.module`` for an engine).

    How (``after_each_step``): when the torch optimizer updates the layers' own parameters a step
    post-hook re-quantizes those; when it updates flat fp32 copies (a DeepSpeed bf16/fp16 or ZeRO 1/2
    wrapper) the wrapper's ``step`` is followed, and every layer re-quantizes from its parameter after
    the wrapper copied its result in. In that case the master the layer keeps is the bf16/fp16
    parameter and the fp32 master lives in the wrapper.

    Returns:
        A handle; ``handle.remove()`` detaches it.

    Raises:
        ValueError: the optimizer updates none of the layers' master weights and is not a wrapper
            whose ``step`` could be followed.
    """
    # master-free layers (weights.master="none") have no master: quant.master_free.attach_master_free
    layers = [
        m for m in model.modules() if isinstance(m, QuantLinear) and m.mode == "train" and not m.master_free
    ]
    opt = underlying_optimizer(optimizer)
    owned = {id(p) for g in opt.param_groups for p in g["params"]}
    hooked = [m for m in layers if id(m.weight) in owned]
    targets = hooked if hooked or not layers else layers

    def _requantize():
        with torch.no_grad():
            for m in targets:
                m.requantize_()

    return after_each_step(
        optimizer, _requantize, updates_model=bool(hooked) or not layers,
        error=f"requantize_after_step: none of the {len(layers)} QuantLinear master weights is a parameter "
        f"of {type(opt).__name__}; pass the optimizer (or DeepSpeed engine) that trains this model",
    )
