"""``QuantLinear``: a linear layer whose compute weight is stored low-bit, for training and fine-tuning.

Two modes (``WeightsConfig.mode``):

* ``"train"``: the layer holds an fp32 master weight (``self.weight``, an ``nn.Parameter`` that the
  optimizer updates) and a low-bit compute copy (``self.qweight``, a ``QuantizedWeight``). Forward
  and backward dequantize the compute copy on the fly inside ``DequantLinearFunction`` (a
  ``torch.autograd.Function``); the dequantized weight is never saved for backward, it is rebuilt
  there. The master's gradient is straight-through, ``grad_W = grad_y^T x``. After every optimizer
  step the compute copy must be refreshed from the master: ``requantize_after_step(optimizer,
  model)`` (``quant.optim``) does it with a step post-hook, for a plain optimizer and a DeepSpeed
  engine alike.
* ``"train"`` with ``WeightsConfig.master="none"`` (int8/fp8): no master at all. ``self.weight`` is
  None; the weight gradient accumulates into ``self.weight_grad`` (fp32, allocated at the first
  backward) and ``quant.master_free.attach_master_free`` updates the codes after each optimizer step
  (dequantize -> AdamW -> stochastic-rounding re-quantize). Optimizer states live on the layer
  (``optim_state``, ``optim_step``) and travel in its ``state_dict``.
* ``"train"`` with ``WeightsConfig.saved_input="int8"``: the input kept for the weight gradient is
  stored as blockwise int8 codes and scales (``ppq::weight_quantize``) and dequantized in backward, as
  FP8 training keeps its inputs in FP8; the input gradient does not need it.
* ``"frozen"``: only the low-bit base is kept (no master, no weight gradient), plus trainable LoRA
  adapters ``y = x W^T + b + (alpha / r) (x A^T) B^T`` with ``A`` [r, in] (Kaiming init) and ``B``
  [out, r] (zeros). The bias is frozen too.
* A weight the model itself froze (``requires_grad=False``, as a LoRA fine-tune built with its own
  adapters freezes its base layers) stays frozen whatever the mode: ``from_linear`` keeps only its
  low-bit codes, with no master, no gradient and no adapters of its own (``lora_A`` is None).

Memory (see ``quant.ledger``): "train" keeps master (4 B/value) + codes + scales + the master's
gradient and optimizer state; "frozen" keeps codes + scales and the small adapters. The dequantized
weight lives only for the duration of one matmul, in a buffer shared by all low-bit layers of the same
dtype and device (``_workspace``) -- the forward and backward of different layers never overlap. So a
process keeps one dense buffer per compute dtype and device, as large as its largest low-bit weight
(the ledger's ``workspace`` category; ``clear_workspace()`` frees them).

``convert_model(model, policy)`` swaps the ``nn.Linear`` layers the precision policy selects.
"""

from __future__ import annotations

import math
import numbers
import weakref
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from deepspeed_ppq.config import WeightFormat, WeightsConfig
from deepspeed_ppq.formats import MASTER_FREE_FORMATS, format_spec
from deepspeed_ppq.quant.adam8bit import BNB_BLOCK_SIZE, MIN_8BIT_SIZE
from deepspeed_ppq.quant.formats import QuantizedWeight, quantize_weight
from deepspeed_ppq.quant.ops import weight_dequantize, weight_quantize
from deepspeed_ppq.quant.policy import as_policy, plan

__all__ = [
    "QuantLinear",
    "DequantLinearFunction",
    "convert_model",
    "requantize_model",
    "lora_parameters",
    "workspace_tensors",
    "clear_workspace",
]

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
_WORKSPACE: dict[tuple, torch.Tensor] = {}


def _workspace(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A view of the one dense buffer of this dtype/device, grown to the largest weight asked for."""
    key, n = (dtype, str(device)), math.prod(shape)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < n:
        buf = _WORKSPACE[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def workspace_tensors() -> dict[tuple, torch.Tensor]:
    """The shared dequantization buffers: ``(dtype, device) -> tensor`` (for the ledger and the
    memory tracker)."""
    return dict(_WORKSPACE)


def clear_workspace() -> None:
    """Free the shared dequantization buffers (they are re-created on the next forward)."""
    _WORKSPACE.clear()


def _check_sr_seed(seed, name: str = "sr_seed") -> int:
    """``seed`` as an int; a ValueError where the stochastic-rounding kernels would refuse it."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:
        raise ValueError(f"{name}={seed!r} is not allowed: use an int in [0, 2^32)")
    return int(seed)


def _dequantized(layer: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
    return layer.qweight.dequantize(out=_workspace(layer.qweight.shape, dtype, layer.qweight.qdata.device))


class DequantLinearFunction(torch.autograd.Function):
    """y = x W^T + b with W dequantized on the fly (forward and again in backward).

    Inputs: x [..., in] (fp32 or bf16), master [out, in] fp32, or None (frozen), or for a master-free
    layer a 0-element leaf that requires grad (it puts the Function in the graph even when x does
    not require grad), bias [out] or None.
    Returns grads for x, the master (``grad_y^T x``, straight-through; master-free: added into
    ``layer.weight_grad``, or handed to ``layer.update_in_backward``, instead, None returned) and the
    bias.
    """

    @staticmethod
    def forward(ctx, x, master, bias, layer):
        w = _dequantized(layer, x.dtype)
        b = bias.to(x.dtype) if bias is not None else None
        y = F.linear(x, w, b)
        # a weak reference: the graph is held from C++, where the garbage collector does not see it, so a
        # strong one made a cycle (layer -> ... -> the loss -> the graph -> ctx -> layer) it never freed:
        # every model built and dropped in one process (the tuner's trials) stayed in memory, engine and all
        ctx.layer = weakref.ref(layer)
        ctx.version = layer.quant_version
        ctx.has_bias = bias is not None
        ctx.x_meta = None
        if master is None or not master.requires_grad:
            ctx.save_for_backward(None)
        elif layer.saved_input == "int8" and x.numel():  # the weight gradient's input, as int8 codes
            ctx.x_meta = (x.shape, x.dtype)
            ctx.save_for_backward(*weight_quantize(x, "int8", layer.qweight.block_size))
        else:
            ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        layer = ctx.layer()
        if layer is None:
            raise RuntimeError("QuantLinear: the layer was freed between forward and backward; keep the "
                               "model alive until its backward has run")
        if layer.quant_version != ctx.version:
            raise RuntimeError(
                "QuantLinear: the compute weight was re-quantized between forward and backward "
                "(optimizer.step() before backward finished?); the gradient would use the wrong weight"
            )
        if ctx.x_meta is None:
            (x,) = ctx.saved_tensors
        else:
            shape, dtype = ctx.x_meta
            x = weight_dequantize(*ctx.saved_tensors, "int8", layer.qweight.block_size, shape, dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_y.matmul(_dequantized(layer, grad_y.dtype))
        if ctx.needs_input_grad[1]:
            g2 = grad_y.reshape(-1, grad_y.shape[-1])  # [N, out]
            x2 = x.reshape(-1, x.shape[-1])  # [N, in]
            if layer.master_free and layer.update_in_backward is not None:
                layer.update_in_backward(layer, g2, x2)  # the gradient goes straight into the update
            elif layer.master_free:
                if layer.weight_grad is None and layer.grad_bucket is not None:
                    layer.grad_bucket.allocate()  # every layer of the bucket: views of one flat buffer
                if layer.weight_grad is None:
                    layer.weight_grad = torch.zeros(
                        layer.qweight.shape, dtype=layer.grad_dtype, device=layer.qweight.qdata.device
                    )
                if g2.dtype == layer.weight_grad.dtype:
                    layer.weight_grad.addmm_(g2.t(), x2)
                elif layer.weight_grad.dtype == torch.float32:  # a bf16 product summed in fp32
                    layer.weight_grad.add_(g2.t().mm(x2))
                else:  # the product in the compute dtype plus the buffer, rounded once into the buffer's
                    # dtype. The sum is made in the dequantization buffer (free once grad_x is computed):
                    # a fresh [out, in] tensor per micro-batch, or an add_ across dtypes (which converts
                    # through temporaries), cost more than the product itself
                    prod = _workspace(layer.qweight.shape, g2.dtype, layer.qweight.qdata.device)
                    torch.mm(g2.t(), x2, out=prod).add_(layer.weight_grad)
                    layer.weight_grad.copy_(prod)
            else:
                grad_w = g2.t().mm(x2).to(layer.weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0).to(layer.bias.dtype)
        return grad_x, grad_w, grad_b, None


class QuantLinear(nn.Module):
    """A linear layer with a low-bit compute weight (see the module docstring).

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        fmt: the low-bit ``WeightFormat`` (not ``none``).
        weights_cfg: block size, scale dtype, double quantization, FP8 scale, mode and LoRA settings.
        weight: initial weight [out, in] (default: ``nn.Linear``'s init).
        sr_seed: master-free only: the stochastic-rounding seed of this layer (``convert_model``
            uses the CRC-32 of the layer's name), in [0, 2^32).
        trainable: False for a weight the model froze: the layer keeps its codes only (mode
            ``"frozen"`` without adapters unless ``weights_cfg.mode`` asks for them).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        fmt: WeightFormat | str = WeightFormat.int8,
        weights_cfg: WeightsConfig | None = None,
        weight: torch.Tensor | None = None,
        device=None,
        dtype: torch.dtype | None = None,
        sr_seed: int = 0,
        trainable: bool = True,
    ):
        super().__init__()
        cfg = weights_cfg or WeightsConfig()
        fmt = WeightFormat(fmt)
        if fmt == WeightFormat.none:
            raise ValueError("QuantLinear needs a low-bit format; fmt='none' means keep nn.Linear")
        self.in_features, self.out_features = in_features, out_features
        self.format, self.weights_cfg = fmt, cfg
        self.mode = cfg.mode if trainable else "frozen"
        self.dense_dtype = dtype or (weight.dtype if weight is not None else torch.float32)
        if weight is None:
            ref = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=torch.float32)
            weight, init_bias = ref.weight.detach(), (ref.bias.detach() if bias else None)
        else:
            if tuple(weight.shape) != (out_features, in_features):
                raise ValueError(
                    f"weight has shape {tuple(weight.shape)}, expected {(out_features, in_features)}"
                )
            init_bias = torch.zeros(out_features, device=weight.device) if bias else None
        master = weight.detach().to(torch.float32)
        self.qweight: QuantizedWeight = quantize_weight(
            master,
            fmt,
            cfg.block_size,
            cfg.scale_dtype,
            cfg.double_quant,
            cfg.fp8_scale if format_spec(fmt).per_tensor_scale else "block",
        )
        self.quant_version = 0
        self.master_free = self.mode == "train" and cfg.master == "none"
        if self.master_free and not format_spec(fmt).master_free:
            allowed = ", ".join(MASTER_FREE_FORMATS)
            raise ValueError(f"master='none' needs an 8-bit format ({allowed}), got fmt={fmt.value!r}")
        self.sr_seed = _check_sr_seed(sr_seed)
        self.weight_grad: torch.Tensor | None = None  # master-free: accumulated weight gradient
        self.grad_bucket = None  # master-free: the flat buffer its gradient is a view of (attach_master_free)
        # master-free: called by backward with (layer, grad_y [N, out], x [N, in]) to update the weight
        # there instead of accumulating its gradient (attach_master_free's update_in_backward)
        self.update_in_backward = None
        self.grad_dtype = torch.bfloat16 if cfg.grad_dtype == "bf16" else torch.float32
        self.saved_input = cfg.saved_input if self.mode == "train" else "dense"
        self.optim_state: dict[str, torch.Tensor] = {}  # master-free: AdamW moments (fp32 or 8-bit)
        self.optim_step = 0
        self._grad_anchor = torch.empty(0, device=master.device, requires_grad=True)
        if self.mode == "train" and not self.master_free:
            self.weight = nn.Parameter(master.clone())
        else:
            self.register_parameter("weight", None)
        if bias:
            self.bias = nn.Parameter(
                init_bias.to(self.dense_dtype).clone(), requires_grad=self.mode == "train"
            )
        else:
            self.register_parameter("bias", None)
        if cfg.mode != "frozen":  # no adapters of its own
            self.register_parameter("lora_A", None)
            self.register_parameter("lora_B", None)
        else:
            r = cfg.lora_rank
            self.lora_scaling = cfg.lora_alpha / r
            self.lora_A = nn.Parameter(torch.empty(r, in_features, device=master.device))
            self.lora_B = nn.Parameter(torch.zeros(out_features, r, device=master.device))
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.register_load_state_dict_post_hook(_requantize_after_load)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt, weights_cfg: WeightsConfig | None = None,
                    sr_seed: int = 0) -> QuantLinear:
        """Build from an ``nn.Linear``: its weight becomes the master (train) or the frozen base; a
        weight the model froze (``requires_grad=False``) stays frozen (codes only, no adapters)."""
        q = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            fmt,
            weights_cfg,
            weight=linear.weight,
            dtype=linear.weight.dtype,
            sr_seed=sr_seed,
            trainable=linear.weight.requires_grad,
        )
        if linear.bias is not None:
            with torch.no_grad():
                q.bias.copy_(linear.bias)
        return q

    @torch.no_grad()
    def requantize_(self) -> None:
        """Refresh the low-bit compute copy from the master weight (train mode)."""
        if self.mode != "train":
            raise RuntimeError("QuantLinear.requantize_: a frozen layer has no master weight to re-quantize")
        if self.master_free:
            raise RuntimeError(
                "QuantLinear.requantize_: a master-free layer (weights.master='none') has no master weight "
                "to re-quantize; its codes are updated by quant.master_free.attach_master_free"
            )
        self.qweight.requantize_(self.weight.detach())
        self.quant_version += 1

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A fresh dense copy of the compute weight (for tests and inspection)."""
        return self.qweight.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _COMPUTE_DTYPES:
            raise TypeError(f"QuantLinear input dtype {x.dtype} is not supported: use float32 or bfloat16")
        master = self._grad_anchor if self.master_free else self.weight
        y = DequantLinearFunction.apply(x, master, self.bias, self)
        if self.lora_A is not None:
            y = (
                y
                + F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.lora_scaling
            )
        return y

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # Codes, gradient buffer and optimizer states are not floats to cast: only follow the device
        # (of the parameters, or of a probe tensor for a bias-free master-free layer).
        params = list(self.parameters())
        dev = params[0].device if params else fn(torch.empty(0)).device
        qw = self.qweight
        for name in ("qdata", "scale", "scale_scale"):
            t = getattr(qw, name)
            if t is not None and t.device != dev:
                setattr(qw, name, t.to(dev))
        if self.weight_grad is not None and self.weight_grad.device != dev:
            self.weight_grad = self.weight_grad.to(dev)
        self.optim_state = {k: v.to(dev) for k, v in self.optim_state.items()}
        if self._grad_anchor.device != dev:
            self._grad_anchor = torch.empty(0, device=dev, requires_grad=True)
        return self

    def _optim_layout(self) -> dict[str, tuple[tuple, torch.dtype]]:
        """Master-free: the AdamW states this layer keeps, name -> (shape, dtype): with
        ``optimizer_8bit`` (and at least ``MIN_8BIT_SIZE`` values) uint8 codes and fp32 absmax per block
        of ``BNB_BLOCK_SIZE``, as bitsandbytes' 8-bit Adam; else two fp32 moments."""
        shape, n = tuple(self.qweight.shape), self.qweight.qdata.numel()
        if self.weights_cfg.optimizer_8bit and n >= MIN_8BIT_SIZE:
            nb = math.ceil(n / BNB_BLOCK_SIZE)
            codes, absmax = (shape, torch.uint8), ((nb,), torch.float32)
            return {"state1": codes, "state2": codes, "absmax1": absmax, "absmax2": absmax}
        return {"exp_avg": (shape, torch.float32), "exp_avg_sq": (shape, torch.float32)}

    def get_extra_state(self):
        if self.mode == "train" and not self.master_free:  # derived from the master weight
            return {"format": self.format.value}
        state = {"format": self.format.value, "block_size": self.qweight.block_size,
                 **self.qweight.storage_tensors()}
        if self.master_free:
            state["sr_seed"] = self.sr_seed
            state["optim_step"] = self.optim_step
            state.update({f"optim.{k}": v for k, v in self.optim_state.items()})
        return state

    def _check_extra_state(self, state) -> None:
        """Raise a ValueError naming the first field of a checkpoint's extra state that does not fit this
        layer (format, block size, double quantization, each tensor's shape and dtype, SR seed, step)."""
        if state.get("format") != self.format.value:
            raise ValueError(
                f"checkpoint holds format {state.get('format')!r}, this layer is {self.format.value!r}"
            )
        if not (self.mode == "frozen" or self.master_free):
            return  # nothing else is loaded: the codes are re-quantized from the master
        qw = self.qweight
        for field, saved, expected in (
            ("block_size", state.get("block_size", qw.block_size), qw.block_size),  # older: shapes tell
            ("double_quant", "scale_scale" in state, qw.double_quant),
        ):
            if saved != expected:
                raise ValueError(f"checkpoint holds {field}={saved!r}, this layer has {field}={expected!r}; "
                                 "build it with the weights config the checkpoint was saved with")
        layout = {k: (tuple(v.shape), v.dtype) for k, v in qw.storage_tensors().items()}
        if self.master_free:
            if "optim_step" not in state:
                raise ValueError(
                    "checkpoint of a master-free QuantLinear lacks 'optim_step' (saved with master='fp32'?)"
                )
            _check_sr_seed(state.get("sr_seed"), "checkpoint's sr_seed")
            step = state["optim_step"]
            if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
                raise ValueError(f"checkpoint's optim_step={step!r} is not allowed: use an int >= 0")
            saved = sorted(k for k in state if k.startswith("optim."))
            optim = {f"optim.{k}": v for k, v in self._optim_layout().items()}
            if saved and saved != sorted(optim):
                raise ValueError(
                    f"checkpoint holds optimizer states {saved}, this layer keeps {sorted(optim)} "
                    f"(weights.optimizer_8bit={self.weights_cfg.optimizer_8bit}, {qw.qdata.numel()} values)"
                )
            layout.update(optim if saved else {})
        for k, (shape, dtype) in layout.items():
            v = state.get(k)
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or v.dtype != dtype:
                got = "missing" if v is None else repr(v)
                if isinstance(v, torch.Tensor):
                    got = f"a {v.dtype} tensor of shape {tuple(v.shape)}"
                raise ValueError(
                    f"checkpoint's {k} is {got}; this layer needs a {dtype} tensor of shape {shape}"
                )

    def set_extra_state(self, state) -> None:
        self._check_extra_state(state)  # all of it, before anything is written
        if self.mode == "frozen" or self.master_free:
            for k, t in self.qweight.storage_tensors().items():
                t.copy_(state[k])
            self.quant_version += 1
        if self.master_free:
            self.sr_seed = int(state["sr_seed"])
            self.optim_step = int(state["optim_step"])
            dev = self.qweight.qdata.device
            self.optim_state = {
                k.removeprefix("optim."): v.to(dev).clone()
                for k, v in state.items()
                if k.startswith("optim.")
            }

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, "
            f"format={self.format.value}, mode={self.mode}, block_size={self.qweight.block_size}"
            + (", master=none" if self.master_free else "")
        )


def _requantize_after_load(module: QuantLinear, _incompatible) -> None:
    if module.mode == "train" and not module.master_free:
        module.requantize_()


def convert_model(model: nn.Module, policy_or_cfg, **policy_kwargs) -> nn.Module:
    """Replace the ``nn.Linear`` layers the precision policy selects by ``QuantLinear`` (in place).

    Args:
        model: any module.
        policy_or_cfg: a ``PrecisionPolicy``, ``WeightsConfig``, dict of its fields or a format name.
        **policy_kwargs: ``block_layers``/``num_blocks`` (see ``quant.policy``).

    Returns:
        ``model`` itself, converted. ``explain(model, policy)`` shows what was chosen.
    """
    pol = as_policy(policy_or_cfg, **policy_kwargs)
    if isinstance(model, nn.Linear):
        raise ValueError(
            "convert_model replaces layers inside a model; wrap a lone nn.Linear in a module first"
        )
    for d in plan(model, pol):
        mod = model.get_submodule(d.name)
        if not d.quantized or isinstance(mod, QuantLinear):
            continue
        # master-free SR seed from the layer's name: the same on data-parallel replicas and whatever
        # the pipeline split (a PipelineModule names its layers by global index, as nn.Sequential)
        new = QuantLinear.from_linear(mod, d.format, pol.weights, sr_seed=zlib.crc32(d.name.encode()))
        parent_name, _, child = d.name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model


def requantize_model(model: nn.Module) -> int:
    """Re-quantize every train-mode ``QuantLinear`` with a master of ``model``; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.mode == "train" and not m.master_free:
            m.requantize_()
            n += 1
    return n


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The LoRA adapter parameters of every frozen-mode ``QuantLinear`` that has its own adapters."""
    return [
        p
        for m in model.modules()
        if isinstance(m, QuantLinear) and m.lora_A is not None
        for p in (m.lora_A, m.lora_B)
    ]
