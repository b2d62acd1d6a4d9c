"""megatron-core's optimizer step, wrapped: skip a step NaN/Inf crossed a stage boundary in, and
re-quantize low-bit compute weights after every successful one.

:func:`install_step_hooks` wraps ``step`` on every megatron-core optimizer class that defines one
(class level, so the optimizer Megatron-LM builds inside ``pretrain`` is covered). Before the step:
with ``ppq.nonfinite="skip"`` and compressed P2P, ``p2p_state.settle_step`` takes the flag "NaN/Inf
crossed a boundary in this step" over every rank; when it is set, every rank skips the step, as
megatron-core skips one with inf/nan gradients (``(False, None, None)``: Megatron-LM counts it as a
skipped iteration and leaves the learning-rate schedule where it is), and the codec state returns to
where the step found it. Without this, ``FP32Optimizer`` (which never checks) or a bf16 run without a
loss scale would apply the NaN gradients.

A :class:`~megatron_patches.layers.QuantParallelLinear` computes with a low-bit copy of its master
weight. The copy has to follow the master after each update, and megatron-core's optimizers do not
say when they change it in a way a module can see: ``Float16OptimizerWithFloat16Params`` and
``DistributedOptimizer`` copy the fp32 main params into the model params through ``.data`` (read
in 0.16.1: ``_copy_main_params_to_model_params``), which leaves the parameter's autograd version
counter where it was. So the wrapped ``step`` (``MixedPrecisionOptimizer``, ``FP32Optimizer``,
``ChainedOptimizer``, ``LayerWiseDistributedOptimizer``, ...), after a step that reports success (no
inf/nan skip), re-quantizes the layers whose master the optimizer updates:

- ``Float16OptimizerWithFloat16Params`` (bf16/fp16 model params): from the fp32 main param the
  wrapper keeps, the more precise copy of the same values;
- ``FP32Optimizer``: from the parameter itself;
- ``DistributedOptimizer``: from the model parameter after the all-gather; when that all-gather is
  deferred to the next forward (``overlap_param_gather``), the layers are marked stale instead and
  re-quantize in their next forward, after the gather has landed;
- ``ChainedOptimizer``: each of its optimizers, as above.

Nested ``step`` calls (a subclass calling ``super().step()``) settle and re-quantize once, at the outermost.
For plain torch and bitsandbytes optimizers use ``deepspeed_ppq.quant.optim.requantize_after_step``.
"""

from __future__ import annotations

import functools
import threading

import torch

from .compat import check_megatron_version
from .p2p_state import settle_step

__all__ = ["install_step_hooks", "uninstall_step_hooks", "requantize_for_optimizer"]

_SAVED: dict[type, object] = {}
_DEPTH = threading.local()


def _step_classes() -> list[type]:
    """megatron-core optimizer classes that define a concrete ``step`` of their own."""
    import megatron.core.optimizer  # noqa: F401  (imports every optimizer module)
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    seen, todo, out = set(), [MegatronOptimizer], []
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        step = cls.__dict__.get("step")
        if step is not None and not getattr(step, "__isabstractmethod__", False):
            out.append(cls)
    return out


def _sources(opt, out: dict[int, tuple[torch.Tensor, torch.Tensor | None]]) -> bool:
    """Fill ``out`` with id(model param) -> (model param, source to quantize from or None = itself).

    Returns whether the model params are only complete after a deferred all-gather.
    """
    deferred = False
    chained = getattr(opt, "chained_optimizers", None)
    if chained is not None:
        for o in chained:
            deferred |= _sources(o, out)
        return deferred
    if getattr(opt, "is_stub_optimizer", False) or getattr(opt, "optimizer", None) is None:
        return False
    if hasattr(opt, "fp32_from_float16_groups") and hasattr(opt, "float16_groups"):
        # Float16OptimizerWithFloat16Params: fp32 main params beside the bf16/fp16 model params.
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            for p, main in zip(model_group, main_group):
                out[id(p)] = (p, main)
        for group in opt.fp32_from_fp32_groups:
            for p in group:
                out[id(p)] = (p, None)
    elif hasattr(opt, "model_float16_groups"):
        # DistributedOptimizer: this rank keeps main-param shards of some params only
        # (model_float16_groups lists those), but the param all-gather brings every updated model
        # param of its model chunks to every rank; it is deferred to the next forward with
        # overlap_param_gather.
        for chunk in opt.model_chunks:
            for p in chunk.parameters():
                if p.requires_grad:
                    out[id(p)] = (p, None)
        ddp = getattr(opt, "ddp_config", None)
        deferred = bool(getattr(ddp, "overlap_param_gather", False)) or bool(
            getattr(ddp, "use_megatron_fsdp", False))
    else:
        # FP32Optimizer and any wrapper whose torch optimizer holds the model params themselves.
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                out[id(p)] = (p, None)
    return deferred


def requantize_for_optimizer(opt) -> int:
    """Re-quantize (or mark stale) the live low-bit layers whose master ``opt`` updates; returns how many."""
    from .layers import live_quant_layers

    layers = [m for m in live_quant_layers() if m.mode == "train"]
    if not layers:
        return 0
    sources: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    deferred = _sources(opt, sources)
    n = 0
    with torch.no_grad():
        for m in layers:
            hit = sources.get(id(m.weight))
            if hit is None:
                continue
            if deferred:
                m.mark_stale()
            else:
                m.requantize_(hit[1])
            n += 1
    return n


def _succeeded(result) -> bool:
    # megatron-core's step returns (update_successful, grad_norm, num_zeros_in_grad).
    if isinstance(result, tuple) and result:
        return bool(result[0])
    return result is None or bool(result)


def _wrap(original):
    @functools.wraps(original)
    def step(self, *args, **kwargs):
        depth = getattr(_DEPTH, "n", 0)
        if depth == 0 and settle_step() is not None:
            return False, None, None  # NaN/Inf crossed a stage boundary: every rank skips this step
        _DEPTH.n = depth + 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            _DEPTH.n = depth
        if depth == 0 and _succeeded(result):
            requantize_for_optimizer(self)
        return result

    step._ppq_original = original
    return step


def install_step_hooks() -> list[str]:
    """Wrap ``step`` of every megatron-core optimizer class (idempotent); returns the class names.

    Installed by the low-bit layers and by the compressed P2P (``megatron_patches.p2p``).

    Raises:
        RuntimeError: an untested megatron-core version (see ``compat``).
    """
    check_megatron_version("optimizer step hooks")
    names = []
    for cls in _step_classes():
        if cls not in _SAVED:
            _SAVED[cls] = cls.__dict__["step"]
            cls.step = _wrap(cls.__dict__["step"])
        names.append(cls.__name__)
    return sorted(names)


def uninstall_step_hooks() -> None:
    """Restore every wrapped ``step``."""
    for cls, original in list(_SAVED.items()):
        cls.step = original
        del _SAVED[cls]
