"""Low-bit weights in megatron-core's transformer layers.

Two back ends, chosen by the weight format and the layer implementation:

- **The project's quantized linear** (int8, int4, NF4, FP8 blockwise; any device): megatron-core's
  ``ColumnParallelLinear``/``RowParallelLinear`` (the ``--transformer-impl local`` layer spec) are
  replaced by :class:`QuantParallelLinear`, a ``deepspeed_ppq.quant.QuantLinear`` that speaks the
  Megatron linear interface (``forward(x) -> (output, bias)``, ``skip_bias_add``). Tensor parallel
  size 1 only. Parameter names stay ``linear_fc1.weight`` / ``.bias``, so checkpoints keep their
  keys. The master weight is the parameter Megatron's optimizer updates; the low-bit compute copy is
  re-quantized after every successful optimizer step (``megatron_patches.optim`` wraps megatron-core's
  optimizer ``step``; ``deepspeed_ppq.quant.optim.requantize_after_step`` does it for plain torch and
  bitsandbytes optimizers). Neither megatron-core's mixed-precision optimizers (they copy the fp32
  main params into the model params through ``.data``) nor bitsandbytes' 8-bit optimizers move the
  parameter's autograd version counter, so the counter is only a safety net: a forward also
  re-quantizes when it moved (a checkpoint load, an in-place edit by hand).
  The precision policy (``WeightsConfig``: rules, ``keep_first_blocks``/``keep_last_blocks``, norms,
  embeddings and the output layer dense) is applied with the **global** layer number of each
  ``TransformerLayer``, so keeping "the last block" means the model's last one on every stage.
- **Transformer Engine FP8 primary weights** (``fp8_e4m3`` with ``--transformer-impl
  transformer_engine``, GPU): :func:`te_fp8_settings` maps the policy onto megatron-core's own
  fields (``fp8``, ``fp8_recipe``, ``fp8_param``, ``first_last_layers_bf16``,
  ``num_layers_at_start_in_bf16``, ``num_layers_at_end_in_bf16``); TE then keeps only the FP8
  copy in the module. Per-module rules cannot be expressed there and are refused.

``install_lowbit_layers(cfg)`` converts every ``TransformerBlock`` as it is built (Megatron-LM's
``model_provider`` path); ``convert_megatron_model(model, cfg)`` converts a model you already have.
Both install the optimizer-step re-quantization (``megatron_patches.optim``).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from deepspeed_ppq.config import WeightFormat, WeightsConfig
from deepspeed_ppq.quant.linear import DequantLinearFunction, QuantLinear
from deepspeed_ppq.quant.policy import LayerDecision, PrecisionPolicy

from .compat import check_megatron_version

__all__ = [
    "QuantParallelLinear",
    "convert_megatron_model",
    "install_lowbit_layers",
    "uninstall_lowbit_layers",
    "te_fp8_settings",
    "te_available",
    "live_quant_layers",
]

# Every QuantParallelLinear alive in this process (the optimizer-step patch looks its layers up here).
_LIVE: weakref.WeakSet = weakref.WeakSet()


def live_quant_layers() -> list:
    """The :class:`QuantParallelLinear` layers alive in this process."""
    return list(_LIVE)


def te_available() -> tuple[bool, str]:
    """Whether Transformer Engine is usable here, and why not (a broken install raises RuntimeError)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, RuntimeError, OSError) as e:
        return False, f"Transformer Engine is not usable: {type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return False, "Transformer Engine needs a CUDA GPU"
    return True, ""


class QuantParallelLinear(QuantLinear):
    """A megatron-core parallel linear (TP=1) whose compute weight is stored low-bit.

    Built with :meth:`from_parallel_linear`; returns ``(output, bias)`` like Megatron's layers
    (``bias`` is returned separately when ``skip_bias_add``, and added otherwise).
    """

    @classmethod
    def from_parallel_linear(cls, layer: torch.nn.Module, fmt: WeightFormat,
                             weights_cfg: WeightsConfig) -> QuantParallelLinear:
        weight = layer.weight
        q = cls(layer.input_size, layer.output_size, bias=False, fmt=fmt, weights_cfg=weights_cfg,
                weight=weight.detach(), dtype=weight.dtype)
        bias = getattr(layer, "bias", None)
        q.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=q.mode == "train") \
            if bias is not None else None
        q.input_size, q.output_size = layer.input_size, layer.output_size
        q.skip_bias_add = layer.skip_bias_add
        q.config = layer.config
        q.parallel_kind = type(layer).__name__
        q._seen_version = q.weight._version if q.weight is not None else None
        q._stale = False
        _LIVE.add(q)
        return q

    @torch.no_grad()
    def requantize_(self, source: torch.Tensor | None = None) -> None:
        """Refresh the low-bit compute copy from the master weight, or from ``source``.

        ``source`` is a more precise copy of the same values (the fp32 main param a bf16 optimizer
        wrapper keeps for this bf16 parameter), of the weight's shape.
        """
        if source is None:
            super().requantize_()
        else:
            if self.mode != "train":
                raise RuntimeError("QuantParallelLinear.requantize_: a frozen layer has no master weight")
            self.qweight.requantize_(source.detach())
            self.quant_version += 1
        self._seen_version = self.weight._version
        self._stale = False

    def mark_stale(self) -> None:
        """Re-quantize at the next forward (the master is updated later, e.g. by a deferred all-gather)."""
        self._stale = True

    @property
    def stale(self) -> bool:
        """Whether the compute copy waits for the next training forward to re-quantize (``mark_stale``)."""
        return self._stale

    def _refresh(self) -> None:
        """Re-quantize when marked stale or when the master's version counter moved (safety net)."""
        if self.mode == "train" and (self._stale or self.weight._version != self._seen_version):
            self.requantize_()

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        if weight is not None:
            raise ValueError(f"{self.parallel_kind} with ppq low-bit weights keeps its own weight; "
                             "skip_weight_param_allocation (an external weight) is not supported")
        self._refresh()
        bias = self.bias if (self.bias is not None and not self.skip_bias_add) else None
        # QuantLinear's own autograd function, called directly to return Megatron's (output, bias)
        # pair with skip_bias_add, which QuantLinear.forward cannot
        y = DequantLinearFunction.apply(input_, self.weight, bias, self)
        if self.mode == "frozen":
            y = y + F.linear(F.linear(input_, self.lora_A.to(input_.dtype)),
                             self.lora_B.to(input_.dtype)) * self.lora_scaling
        return y, (self.bias if self.skip_bias_add else None)


def _parallel_linear_types() -> tuple[type, ...]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def _global_names(model: torch.nn.Module) -> dict[str, str]:
    """Module name -> the same name with each TransformerLayer's local index made global."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    prefixes = {}
    for name, mod in model.named_modules():
        if isinstance(mod, TransformerLayer):
            head, _, _local = name.rpartition(".")
            prefixes[name] = f"{head}.{mod.layer_number - 1}" if head else str(mod.layer_number - 1)
    out = {}
    for name, _ in model.named_modules():
        best = max((p for p in prefixes if name == p or name.startswith(p + ".")), key=len, default=None)
        out[name] = name if best is None else prefixes[best] + name[len(best):]
    return out


def convert_megatron_model(model: torch.nn.Module, weights: WeightsConfig | dict,
                           num_layers: int | None = None) -> list[LayerDecision]:
    """Replace the parallel linear layers the precision policy selects by :class:`QuantParallelLinear`.

    Args:
        model: a megatron-core module (``GPTModel``, a ``TransformerBlock``, ...), local layer spec.
        weights: the ``"weights"`` section of the ppq config.
        num_layers: transformer layers in the whole model (default: ``config.num_layers``).

    Returns:
        The decision for every parallel linear layer (global layer names), converted or kept.

    Raises:
        ValueError: tensor parallel size above 1.
    """
    weights = WeightsConfig.model_validate(weights) if isinstance(weights, dict) else weights
    if weights.format == WeightFormat.none and not weights.rules:
        return []
    kinds = _parallel_linear_types()
    if num_layers is None:
        num_layers = getattr(getattr(model, "config", None), "num_layers", None)
    policy = PrecisionPolicy.from_config(weights, num_blocks=num_layers)
    names = _global_names(model)
    decisions = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, kinds) or isinstance(mod, QuantParallelLinear):
            continue
        tp = getattr(getattr(mod, "tp_group", None), "size", lambda: 1)()
        if tp != 1:
            raise ValueError(f"ppq low-bit weights in {name} ({type(mod).__name__}): tensor parallel size "
                             f"{tp} is not supported; use --tensor-model-parallel-size 1")
        if getattr(mod, "weight", None) is None:
            continue
        d = policy.decide(names[name], mod, num_layers)
        decisions.append(d)
        if d.quantized:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    QuantParallelLinear.from_parallel_linear(mod, d.format, weights))
    if any(d.quantized for d in decisions):
        from .optim import install_step_hooks

        install_step_hooks()  # idempotent; the compute copies follow megatron-core's steps
    return decisions


_SAVED: dict = {}


def install_lowbit_layers(weights: WeightsConfig | dict, log: list | None = None) -> None:
    """Convert every megatron-core ``TransformerBlock`` right after it is built.

    Megatron-LM builds the model inside the user's ``model_provider``; patching the block's
    ``__init__`` reaches it without touching the script. The optimizer is built afterwards, so it
    sees the master weights; its ``step`` re-quantizes them (``megatron_patches.optim``, installed
    here too). ``log``, when given, collects the decisions.
    """
    check_megatron_version("low-bit layers")
    from .optim import install_step_hooks

    install_step_hooks()
    from megatron.core.transformer.transformer_block import TransformerBlock

    weights = WeightsConfig.model_validate(weights) if isinstance(weights, dict) else weights
    original = _SAVED.setdefault("TransformerBlock.__init__", TransformerBlock.__init__)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        decisions = convert_megatron_model(self, weights, self.config.num_layers)
        if log is not None:
            log.extend(decisions)

    TransformerBlock.__init__ = __init__


def uninstall_lowbit_layers() -> None:
    """Restore ``TransformerBlock.__init__`` and megatron-core's optimizer ``step`` methods (these stay
    wrapped while the compressed P2P with ``ppq.nonfinite="skip"`` is installed)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.transformer_block import TransformerBlock

    from .optim import uninstall_step_hooks

    if "TransformerBlock.__init__" in _SAVED:
        TransformerBlock.__init__ = _SAVED.pop("TransformerBlock.__init__")
    p2p_cfg = getattr(schedules.P2PCommunicator, "ppq_config", None)
    if p2p_cfg is None or p2p_cfg.nonfinite != "skip":  # the compressed P2P still skips flagged steps
        uninstall_step_hooks()


def te_fp8_settings(weights: WeightsConfig) -> dict:
    """megatron-core ``TransformerConfig`` fields that give FP8 primary weights through Transformer Engine.

    ``fp8_e4m3`` -> ``fp8="e4m3"``, ``fp8_param=True``; ``fp8_scale`` ``tensor`` -> recipe
    ``tensorwise``, ``block`` -> ``blockwise`` (Hopper, CUDA >= 12.9); ``keep_first_blocks`` /
    ``keep_last_blocks`` -> ``first_last_layers_bf16`` with the two counts.

    Raises:
        ValueError: a format TE cannot hold as primary weights, or per-module rules.
    """
    if weights.format != WeightFormat.fp8_e4m3:
        raise ValueError(f"weights.format={weights.format.value!r}: Transformer Engine keeps FP8 primary "
                         "weights as e4m3 only; use fp8_e4m3, or --transformer-impl local for ppq formats")
    if weights.rules:
        raise ValueError("weights.rules cannot be expressed with Transformer Engine FP8 weights (only the "
                         "first/last blocks stay dense); drop the rules or use --transformer-impl local")
    keep = weights.keep_first_blocks > 0 or weights.keep_last_blocks > 0
    return {
        "fp8": "e4m3",
        "fp8_recipe": "tensorwise" if weights.fp8_scale == "tensor" else "blockwise",
        "fp8_param": True,
        "first_last_layers_bf16": keep,
        "num_layers_at_start_in_bf16": weights.keep_first_blocks,
        "num_layers_at_end_in_bf16": weights.keep_last_blocks,
    }
