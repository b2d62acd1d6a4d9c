"""Master-free low-bit training (``WeightsConfig.master="none"``): only the 8-bit codes are kept.

A master-free ``QuantLinear`` has no fp32 master and no weight ``nn.Parameter``. Per weight value it
holds the codes (1 B) + block scales, a gradient buffer (4 B fp32, or 2 B with
``WeightsConfig.grad_dtype="bf16"``) and AdamW states (8 B fp32, or 2 B + absmax with 8-bit states):
13 B (7 B; 5 B with a bf16 gradient) against 16 B for a dense fp32 weight with Adam (10 B with 8-bit
Adam). Each
update is dequantize -> AdamW in fp32 (a transient dense copy, one layer at a time) -> re-quantize
with stochastic rounding (``quant.sr_ops``), so updates smaller than a code step survive in
expectation (torchao's INT8 quantized training; Zamirai et al., "Revisiting BFloat16 Training").

How it plugs into a training loop, plain or DeepSpeed (DeepSpeed steps only ``nn.Parameter``s):

* Gradient: the layer's autograd Function adds ``grad_y^T x`` into ``layer.weight_grad`` ([out, in],
  allocated at the first backward), so micro-batches accumulate there as DeepSpeed's gradient
  accumulation does for parameters (DeepSpeed already scales the loss by 1/GAS). The buffer is fp32,
  or bf16 with ``grad_dtype="bf16"``: each micro-batch's product is computed in fp32 and added with
  one rounding to bf16 (as Megatron's bf16 gradient accumulation without
  ``--accumulate-allreduce-grads-in-fp32``); the update widens it back to fp32 exactly.
* Step: ``attach_master_free(optimizer_or_engine, model)`` hooks the end of the main optimizer's
  ``step`` (the same hook points as ``requantize_after_step``: a step post-hook on the torch
  optimizer, or a wrapped ``step`` on a DeepSpeed bf16/ZeRO wrapper). The hook reads ``lr``,
  ``betas``, ``eps`` and ``weight_decay`` from the main optimizer's first param group at that moment,
  so LR schedulers apply; AdamW semantics (decoupled weight decay) whatever the main optimizer is.
* Data parallel: before updating, the gradient buffers are averaged over the engine's data-parallel
  group (``dp_group``) when it has more than one rank, as DeepSpeed averages parameter gradients. The
  codes stay identical on every replica: same gradients, same states, same SR seeds. The buffers of
  the attached layers are views of one flat buffer per dtype (``GradBucket``, allocated at the first
  backward), reduced by one all-reduce as DeepSpeed buckets its own: one call per layer had cost a
  data-parallel step ~6% in gloo's per-call latency and polling.
* Update in backward (``attach_master_free(update_in_backward=...)``): where a step has one
  micro-batch, no clipping and no loss scaling that may skip it, nothing needs a layer's gradient after
  its own backward: the layer's autograd Function computes it (in the shared workspaces) and, with one
  replica, updates the codes there. With data parallelism the gradients wait in a bucket of at most
  ``bucket_values`` (``IN_BACKWARD_BUCKET``: 2^21, 4 MiB of bf16) that is averaged over the replicas
  in one all-reduce when the next gradient would not fit (and at the step), and its layers are updated
  then: an all-reduce per layer had cost the pre-training workload's step ~40% (gloo takes ~2 ms per
  call on a 2-core machine: 0.5 MiB in 2.3 ms, 18 MiB in 16.6). The all-reduce runs in the background
  while the backward fills a second bucket (as DDP overlaps its buckets), and the layers are updated
  when it is waited for, at the next bucket's launch or the step (``in_backward_bucket_values``: two
  buckets where one does not hold a stage's gradients). Waited for at once, each bucket's all-reduce
  was a point where a replica waited for the slower: the pre-training workload's one-stage step (int8
  weights, 2 replicas, bf16) measured 126.7-126.8 ms so, 117.8-122.6 overlapped, and 116.8-119.5 with
  one bucket holding every gradient (9.4M values: 2.25x the two buckets' memory). No whole gradient
  buffer exists: with a bf16 one and 8-bit states a weight holds 3 B per value instead of 5, plus the
  buckets. The result is the buffered path's bit for bit (the same products, sums and update). A
  DeepSpeed engine gets it where its config allows (``updates_in_backward``); a layer that gets no
  gradient in a step is not stepped (the buffered path steps it with a zero gradient once its buffer
  exists).
* Clipping: DeepSpeed's clip norm does not see these buffers, and the main step has already run when
  the hook fires, so one global norm over both is not possible without patching DeepSpeed. The
  buffers are clipped SEPARATELY to ``max_grad_norm`` (from the engine's ``gradient_clipping`` by
  default) by their own global norm over every pipeline stage (squared norms all-reduced over the
  world, divided by the data-parallel size: exact without knowing the pipeline group).
* Zeroing: the hook zeroes the buffers after using them (``optimizer.zero_grad()`` does not see
  them; ``zero_master_free_grads(model)`` does it by hand, e.g. after a skipped step).
* Checkpoints: codes, scales, SR seed, step count and optimizer states travel in the layer's
  ``state_dict`` extra state, so ``torch.save(model.state_dict())`` and DeepSpeed's
  ``save_checkpoint``/``load_checkpoint`` (module state) carry them with no extra file.
* Randomness: the SR draw of a layer at step ``t`` is ``(layer.sr_seed, t * numel)``; ``convert_model``
  seeds each layer with the CRC-32 of its name, so replicas and pipeline splits agree.
* The update itself is one op, ``ppq::master_free_adamw_step_`` (dequantize, AdamW with fp32 or 8-bit
  moments, SR re-quantize; ``csrc/cpu/master_free.cpp`` does it in one pass over the layer through an
  L1-sized buffer, allocating nothing). Its reference is the three steps in plain PyTorch, the AdamW
  written as ``quant.adam8bit``'s (bitsandbytes' CUDA form, square root correctly rounded); layers with
  a per-tensor fp8 scale take the three ops (the scale needs the whole updated tensor first).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from deepspeed_ppq.ops import define_op, registered_ops
from deepspeed_ppq.quant import ops as _wops
from deepspeed_ppq.quant.adam8bit import _check_hyper, _sqrt, _step_ref, adam8bit_step
from deepspeed_ppq.quant.linear import QuantLinear, _workspace
from deepspeed_ppq.quant.optim import after_each_step, underlying_optimizer
from deepspeed_ppq.quant.sr_ops import _quantize_sr_out_ref, weight_quantize_sr_out

__all__ = [
    "master_free_layers",
    "master_free_step",
    "attach_master_free",
    "zero_master_free_grads",
    "master_free_grad_norm",
    "shared_code_maps",
    "GradBucket",
    "updates_in_backward",
    "IN_BACKWARD_BUCKET",
    "in_backward_bucket_values",
]

# Values of the bucket in which gradients made in the backward wait for their data-parallel average
# (see the module docstring).
IN_BACKWARD_BUCKET = 1 << 21

_QMAPS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def in_backward_bucket_values(values, capacity: int = IN_BACKWARD_BUCKET):
    """Values of the buckets in which ``values`` gradient values made in the backward wait for their
    data-parallel average (``attach_master_free``'s ``update_in_backward``): all of them in one bucket
    where they fit ``capacity``, else two buckets of ``capacity`` (one filling while the other's all-reduce
    runs). ``values`` may be an integer array (elementwise)."""
    return values + (values > capacity) * (2 * capacity - values)


def _adamw_fp32_ref(w, g, m, v, beta1, beta2, eps, step, lr, weight_decay, grad_scale):
    """AdamW with fp32 moments, as ``quant.adam8bit``'s reference writes it (in place on w, m, v)."""
    g = g * grad_scale
    m.copy_(m * beta1 + g * (1.0 - beta1))
    v.copy_(v * beta2 + g * g * (1.0 - beta2))
    if weight_decay > 0.0:
        w.copy_(w * (1.0 - lr * weight_decay))
    c1, c2 = 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)
    w.copy_(w + (-lr * c2 / c1) * (m / (_sqrt(v) + eps * c2)))


def _master_free_step_ref(codes, scales, fmt, block_size, g, state1, state2, absmax1, absmax2, qmap1, qmap2,
                          beta1, beta2, eps, step, lr, weight_decay, grad_scale, seed, offset):
    if g.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"master-free update: g has dtype {g.dtype}; allowed: float32 or bfloat16")
    g = g.float()  # a bf16 gradient buffer widens exactly
    w = torch.empty(g.numel(), dtype=torch.float32, device=g.device)
    registered_ops()["weight_dequantize_out"](codes.reshape(-1), scales, fmt, block_size, w)
    hyper = (beta1, beta2, eps, step, lr, weight_decay, grad_scale)
    if state1.dtype == torch.uint8:
        _step_ref(w, g.reshape(-1), state1.view(-1), state2.view(-1), absmax1, absmax2, qmap1, qmap2, *hyper)
    else:
        _adamw_fp32_ref(w, g.reshape(-1), state1.view(-1), state2.view(-1), *hyper)
    _quantize_sr_out_ref(w, fmt, block_size, seed, offset, codes.view(-1), scales)


def _master_free_step_fake(codes, scales, fmt, block_size, g, state1, state2, absmax1, absmax2, qmap1, qmap2,
                           beta1, beta2, eps, step, lr, weight_decay, grad_scale, seed, offset):
    return None


_master_free_op = define_op(
    "master_free_adamw_step_(Tensor(a!) codes, Tensor(b!) scales, str fmt, int block_size, Tensor g, "
    "Tensor(c!) state1, Tensor(d!) state2, Tensor(e!) absmax1, Tensor(f!) absmax2, Tensor qmap1, "
    "Tensor qmap2, float beta1, float beta2, float eps, int step, float lr, float weight_decay, "
    "float grad_scale, int seed, int offset) -> ()",
    _master_free_step_ref,
    _master_free_step_fake,
)


def _qmaps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' signed/unsigned dynamic 8-bit code maps, one pair per device, shared by all layers."""
    key = str(device)
    if key not in _QMAPS:
        import bitsandbytes.functional as bnbf

        _QMAPS[key] = (
            bnbf.create_dynamic_map(signed=True).to(device),
            bnbf.create_dynamic_map(signed=False).to(device),
        )
    return _QMAPS[key]


def shared_code_maps() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The 8-bit states' code maps made so far: device -> (signed, unsigned) map, one pair per device shared
    by every master-free layer there (for the ledger and the memory tracker)."""
    return dict(_QMAPS)


def master_free_layers(model: nn.Module) -> list:
    """The master-free ``QuantLinear`` layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, QuantLinear) and m.master_free]


class GradBucket:
    """The gradient buffers of a set of master-free layers as views of one flat buffer per (dtype, device),
    allocated together when the first of them needs one (at its first backward): one all-reduce per step
    for all of them. Layers whose buffer existed before are left as they are."""

    def __init__(self, layers: list):
        self.layers = list(layers)
        self.flats: list[torch.Tensor] = []
        self._views: set[int] = set()
        for m in self.layers:
            m.grad_bucket = self

    def allocate(self) -> None:
        """Allocate the flat buffers and give every layer still without a gradient buffer its view."""
        groups: dict[tuple, list] = {}
        for m in self.layers:
            if m.weight_grad is None:
                groups.setdefault((m.grad_dtype, m.qweight.qdata.device), []).append(m)
        for (dtype, device), ms in groups.items():
            flat = torch.zeros(sum(math.prod(m.qweight.shape) for m in ms), dtype=dtype, device=device)
            offset = 0
            for m in ms:
                n = math.prod(m.qweight.shape)
                m.weight_grad = flat[offset : offset + n].view(m.qweight.shape)
                self._views.add(id(m))
                offset += n
            self.flats.append(flat)

    def all_reduce_mean(self, group, world_size: int) -> None:
        """Average every layer's gradient over ``group``: each flat buffer in one call, the layers outside
        them one by one."""
        for flat in self.flats:
            _all_reduce_mean(flat, group, world_size)
        for m in self.layers:
            if m.weight_grad is not None and id(m) not in self._views:
                _all_reduce_mean(m.weight_grad, group, world_size)


def _all_reduce_mean(t: torch.Tensor, group, world_size: int) -> None:
    """Average ``t`` over ``group`` in place."""
    dist.all_reduce(t, group=group)
    t.div_(world_size)


def zero_master_free_grads(model_or_layers) -> None:
    """Zero the gradient buffers (kept allocated: their bytes are part of the steady state)."""
    layers = model_or_layers if isinstance(model_or_layers, list) else master_free_layers(model_or_layers)
    for m in layers:
        if m.weight_grad is not None:
            m.weight_grad.zero_()


def _init_state(layer) -> dict:
    dev = layer.qweight.qdata.device
    layout = layer._optim_layout()
    return {k: torch.zeros(shape, dtype=dtype, device=dev) for k, (shape, dtype) in layout.items()}


@torch.no_grad()
def master_free_step(layers, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                     grad_scale: float = 1.0) -> int:
    """One AdamW step on each master-free layer that has a gradient: dequantize, update, re-quantize (SR).

    Args:
        layers: master-free ``QuantLinear`` layers.
        lr, betas, eps, weight_decay: AdamW hyper-parameters (decoupled weight decay).
        grad_scale: multiplies the gradients (clipping coefficient).

    Returns:
        How many layers were updated (a layer without a gradient buffer yet is skipped).

    Raises:
        ValueError: a hyper-parameter that is not finite or out of torch's Adam range (``grad_scale``
            must be > 0), before any layer changes.
    """
    _check_hyper(lr, betas, eps, weight_decay, grad_scale, ("betas[0]", "betas[1]"), "grad_scale")
    b1, b2 = betas
    done = 0
    for m in layers:
        g = m.weight_grad
        if g is None:
            continue
        if not m.optim_state:
            m.optim_state.update(_init_state(m))
        st = m.optim_state
        t = m.optim_step + 1  # counted once the update has run: not where its inputs are refused
        qw = m.qweight
        n = qw.qdata.numel()
        fmt, offset = qw.fmt.value, (t * n) % 2**62
        if qw.scale_scale is None and qw.scale.numel() == _wops.num_blocks(n, qw.block_size):
            if "state1" in st:
                q1, q2 = _qmaps(g.device)
                states = (st["state1"], st["state2"], st["absmax1"], st["absmax2"], q1, q2)
            else:
                none = torch.empty(0, device=g.device)
                states = (st["exp_avg"], st["exp_avg_sq"], none, none, none, none)
            hyper = (float(b1), float(b2), float(eps), t, float(lr), float(weight_decay), float(grad_scale))
            g = g.contiguous()
            _master_free_op(qw.qdata, qw.scale, fmt, qw.block_size, g, *states, *hyper, m.sr_seed, offset)
            m.optim_step = t
            _check_finite_update(qw, fmt)
        else:  # a per-tensor fp8 scale: the three ops (see the module docstring)
            w = qw.dequantize(torch.float32)  # transient fp32 copy of this one layer
            g = g.float()
            if "state1" in st:
                q1, q2 = _qmaps(w.device)
                adam8bit_step(
                    w, g, st["state1"], st["state2"], st["absmax1"], st["absmax2"], q1, q2, beta1=b1,
                    beta2=b2, eps=eps, step=t, lr=lr, weight_decay=weight_decay, gnorm_scale=grad_scale,
                )  # fmt: skip
            else:
                m1, m2 = st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1)
                hyper = (b1, b2, eps, t, lr, weight_decay, grad_scale)
                _adamw_fp32_ref(w.view(-1), g.reshape(-1), m1, m2, *hyper)
            m.optim_step = t
            weight_quantize_sr_out(w, fmt, qw.block_size, m.sr_seed, offset, qw.qdata, qw.scale)
        m.quant_version += 1
        done += 1
    return done


def _check_finite_update(qw, fmt: str) -> None:
    if not bool(torch.isfinite(qw.scale).all()):
        bad = int((~torch.isfinite(qw.scale)).sum())
        raise ValueError(
            f"master-free update of a {fmt} weight of shape {tuple(qw.shape)} produced NaN/Inf in {bad} "
            f"block(s) of {qw.scale.numel()} (a non-finite gradient or state); those blocks' codes are 0"
        )


def master_free_grad_norm(layers, dp_world_size: int = 1) -> float:
    """Global L2 norm of the gradient buffers over every rank (pipeline stages), counted once per replica.

    With a process group: squared norms are summed over the world and divided by ``dp_world_size``
    (replicas hold equal, already averaged buffers). Every rank must call it (collective)."""
    sq = torch.zeros((), dtype=torch.float64)
    for m in layers:
        if m.weight_grad is not None:
            sq += m.weight_grad.double().pow(2).sum().cpu()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
        sq /= dp_world_size
    return float(sq.sqrt())


def updates_in_backward(gradient_accumulation_steps: int, max_grad_norm: float, loss_scaling: bool) -> bool:
    """Whether master-free weights can be updated in the backward (see the module docstring): one
    micro-batch per step, no clipping (its norm needs every gradient first) and no loss scaling (a
    scaler may skip a step after the backward has run)."""
    return gradient_accumulation_steps == 1 and not max_grad_norm and not loss_scaling


def _step_with(opt, layers, grad_scale: float) -> None:
    """``master_free_step`` with the hyper-parameters of ``opt``'s first param group now."""
    g0 = opt.param_groups[0]
    master_free_step(layers, float(g0["lr"]), tuple(g0.get("betas", (0.9, 0.999))),
                     float(g0.get("eps", 1e-8)), float(g0.get("weight_decay", 0.0)), grad_scale)


def _gradient(layer, g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """One micro-batch's weight gradient ``g2^T x2`` in the layer's buffer dtype, as the accumulating
    path makes it from a zeroed buffer (``quant.linear``), in the shared workspaces."""
    shape, device = layer.qweight.shape, layer.qweight.qdata.device
    if g2.dtype == layer.grad_dtype:
        return torch.mm(g2.t(), x2, out=_workspace(shape, g2.dtype, device))
    if layer.grad_dtype == torch.float32:  # a bf16 product, widened
        return g2.t().mm(x2).float()
    prod = torch.mm(g2.t(), x2, out=_workspace(shape, g2.dtype, device))
    return _workspace(shape, layer.grad_dtype, device).copy_(prod)  # rounded once into the buffer dtype


class _BackwardBucket:
    """Gradients made in the backward, waiting for their data-parallel average: views of a flat buffer of
    at most ``capacity`` values (allocated at its first gradient). When the next gradient would not fit,
    the bucket's all-reduce starts in the background and a second buffer takes the gradients that follow;
    a bucket's layers are stepped (``step(layers)``) once its all-reduce is waited for: at the next launch
    (so at most one is in flight and the buffers alternate) and at ``flush()``, which launches the last one
    and waits for everything. A gradient larger than a bucket is averaged alone."""

    def __init__(self, capacity: int, group, world_size: int, step):
        self.capacity, self.group, self.world_size, self.step = capacity, group, world_size, step
        self.flats: list[torch.Tensor | None] = [None, None]
        self.current = 0  # the buffer being filled
        self.pending: list[tuple] = []  # its (layer, gradient view)s
        self.used = 0
        self.in_flight: tuple | None = None  # (all-reduce work, the reduced view, its (layer, view)s)

    def add(self, layer, g: torch.Tensor) -> None:
        n = g.numel()
        flat = self.flats[self.current]
        if self.used + n > self.capacity or (flat is not None and flat.dtype != g.dtype):
            self._launch()
        if n > self.capacity:
            self._wait()
            _all_reduce_mean(g, self.group, self.world_size)
            _step_on(self.step, [(layer, g)])
            return
        flat = self.flats[self.current]
        if flat is None or flat.dtype != g.dtype:
            flat = self.flats[self.current] = torch.empty(self.capacity, dtype=g.dtype, device=g.device)
        view = flat[self.used : self.used + n].view(g.shape)
        view.copy_(g)
        self.pending.append((layer, view))
        self.used += n

    def _launch(self) -> None:
        """Start the filling bucket's all-reduce (after waiting for the one in flight) and switch buffers."""
        self._wait()
        if self.pending:
            reduced = self.flats[self.current][: self.used]
            work = dist.all_reduce(reduced, group=self.group, async_op=True)
            self.in_flight = (work, reduced, self.pending)
            self.current ^= 1
        self.pending, self.used = [], 0

    def _wait(self) -> None:
        if self.in_flight is not None:
            work, reduced, items = self.in_flight
            self.in_flight = None
            work.wait()
            reduced.div_(self.world_size)
            _step_on(self.step, items)

    def flush(self) -> None:
        self._launch()
        self._wait()
        self.current = 0  # each step fills the first buffer first: a stage whose gradients fit it needs one


def _step_on(step, items) -> None:
    """``step(layers)`` with each layer's gradient given for the call only: ``items`` of (layer, g)."""
    for layer, g in items:
        layer.weight_grad = g
    try:
        step([layer for layer, _ in items])
    finally:
        for layer, _ in items:
            layer.weight_grad = None


class _Handle:
    """Detaches the step hook and the layers' update in backward."""

    def __init__(self, hook, layers):
        self.hook, self.layers = hook, layers

    def remove(self) -> None:
        self.hook.remove()
        for m in self.layers:
            m.update_in_backward = None


def attach_master_free(optimizer, model: nn.Module, *, max_grad_norm: float | None = None, dp_group=None,
                       dp_world_size: int | None = None, allow_empty: bool = False,
                       update_in_backward: bool | None = None, bucket_values: int = IN_BACKWARD_BUCKET):
    """Update ``model``'s master-free layers at the end of every ``optimizer.step()``.

    Args:
        optimizer: a torch/bitsandbytes optimizer (its first param group gives lr, betas, eps and
            weight decay) or a DeepSpeed engine (then also the clip norm and data-parallel group).
        model: the module holding the layers (``engine.module`` for an engine).
        max_grad_norm: clip the master-free gradients to this norm (see the module docstring);
            None: the engine's ``gradient_clipping()`` for an engine, else no clipping; 0: none.
        dp_group, dp_world_size: average the gradient buffers over this group first; default the
            engine's data-parallel group; nothing for a plain optimizer.
        allow_empty: attach even where ``model`` has no master-free layer. The clip norm is a
            collective over every rank, so in a pipeline whose stages differ (a stage of high-precision
            layers only) every rank must attach: ``deepspeed_ppq.initialize`` does this.
        update_in_backward: update each layer in its backward, with no gradient buffer (see the module
            docstring); the caller runs one backward per step. None: for an engine, where its config
            allows it (``updates_in_backward``: one micro-batch per step, no clipping, no fp16 loss
            scaling); else off.
        bucket_values: with ``update_in_backward`` and data parallelism, the values of the bucket in
            which gradients wait for their all-reduce (at most the layers' total is allocated).

    Returns:
        A handle; ``handle.remove()`` detaches the hook and the layers' update in backward.

    Raises:
        ValueError: ``model`` has no master-free layer, the optimizer has no param group to read
            the learning rate from, or ``update_in_backward`` with clipping.
    """
    layers = master_free_layers(model)
    if not layers and not allow_empty:
        raise ValueError("attach_master_free: the model has no QuantLinear with weights.master='none'")
    engine = optimizer if hasattr(optimizer, "basic_optimizer") and hasattr(optimizer, "module") else None
    opt = underlying_optimizer(optimizer)
    if not opt.param_groups:
        raise ValueError(f"attach_master_free: {type(opt).__name__} has no param group to read lr from")
    if engine is not None:
        if max_grad_norm is None:
            max_grad_norm = float(engine.gradient_clipping() or 0.0)
        if dp_group is None and getattr(engine, "dp_world_size", 1) > 1:
            dp_group = getattr(engine, "seq_data_parallel_group", None) or engine.data_parallel_group
        if dp_world_size is None:
            dp_world_size = int(getattr(engine, "dp_world_size", 1))
    dp_world_size = dp_world_size or (dist.get_world_size(dp_group) if dp_group is not None else 1)
    reduce = dp_group is not None and dp_world_size > 1
    if update_in_backward is None:
        update_in_backward = engine is not None and updates_in_backward(
            int(engine.gradient_accumulation_steps()), max_grad_norm or 0.0, bool(engine.fp16_enabled()))
    if update_in_backward and max_grad_norm:
        raise ValueError(f"attach_master_free: update_in_backward=True with max_grad_norm={max_grad_norm}: "
                         "the clip norm needs every gradient before any update; use one or the other")

    bucket = GradBucket(layers)
    total = sum(m.qweight.qdata.numel() for m in layers)

    def step_now(ls):  # layers updated in the backward: no clipping
        _step_with(opt, ls, 1.0)

    waiting = (_BackwardBucket(min(bucket_values, total), dp_group, dp_world_size, step_now)
               if reduce and update_in_backward else None)

    def _update(*_args):  # with update_in_backward: the bucket's last layers (the others have no buffer)
        with torch.no_grad():
            if waiting is not None:
                waiting.flush()
            if reduce:
                bucket.all_reduce_mean(dp_group, dp_world_size)
            scale = 1.0
            if max_grad_norm:
                norm = master_free_grad_norm(layers, dp_world_size)
                if not math.isfinite(norm):
                    raise ValueError(f"master-free gradient norm is {norm} (a NaN/Inf gradient); "
                                     "no master-free layer was updated")
                scale = min(1.0, max_grad_norm / (norm + 1e-6))
            _step_with(opt, layers, scale)
            zero_master_free_grads(layers)

    def _update_layer(layer, g2, x2):
        with torch.no_grad():
            g = _gradient(layer, g2, x2)
            if waiting is not None:
                waiting.add(layer, g)
            else:
                _step_on(step_now, [(layer, g)])

    for m in layers:
        m.update_in_backward = _update_layer if update_in_backward else None

    owned = {id(p) for g in opt.param_groups for p in g["params"]}
    model_params = [p for p in model.parameters() if p.requires_grad]
    hook = after_each_step(
        optimizer, _update, updates_model=not model_params or any(id(p) in owned for p in model_params),
        error=f"attach_master_free: {type(opt).__name__} updates none of the model's parameters; pass the "
        "optimizer (or DeepSpeed engine) that trains this model",
    )
    return _Handle(hook, layers)
