"""``ppq::adam8bit_blockwise_step_``: one Adam/AdamW step with blockwise 8-bit states, fused.

The state layout is bitsandbytes' (``Adam8bit``/``AdamW8bit``, ``optimizer_update_8bit_blockwise``):
per parameter two ``uint8`` codes into 256-entry maps (``qmap1``: the signed dynamic map for the first
moment, ``qmap2``: the unsigned one for the second) and per block of 256 values two fp32 ``absmax``.
A checkpoint written by one is read by the other. bitsandbytes' CPU backend runs the update as a dozen
whole-tensor PyTorch ops plus a binary-search quantizer; ``csrc/cpu/adam8bit.cpp`` does one pass per
block (``benchmarks/quant/bench_adam8bit.py`` times both against torch's fused fp32 Adam).

The math (fp32; ``g`` is the gradient, ``t`` the step, per block ``a1``/``a2`` the stored absmax;
``c1 = 1 - beta1^t`` and ``c2 = sqrt(1 - beta2^t)`` in float64, rounded to fp32 where they meet a tensor):

    m = qmap1[state1] * a1;  v = qmap2[state2] * a2;  g = g * gnorm_scale
    m = m * beta1 + g * (1 - beta1);  v = v * beta2 + g * g * (1 - beta2)
    p = p * (1 - lr * weight_decay)                          (only when weight_decay > 0: decoupled)
    p = p + (-lr * c2 / c1) * (m / (sqrt(v) + eps * c2))
    a1 = max |m| over the block;  a2 = max v over the block
    state1 = nearest code of m * (1 / a1) in qmap1;  state2 = nearest code of v * (1 / a2) in qmap2

The update is bitsandbytes' CUDA form (the bias corrections folded into the step size and eps: one
division per value; its CPU backend divides ``sqrt(v)`` by ``c2`` first, which differs in the last
bit), and the states are normalised by the block's reciprocal, as its CUDA kernel does.
"Nearest" is the number of code midpoints ``(qmap[i] + qmap[i + 1]) / 2`` (in fp32) below the value, so
a tie goes to the lower code; an all-zero block divides by 1. Against bitsandbytes' own CPU kernel the
parameters agree to ~1e-5 of a step and a few percent of the codes differ, by one step of the map
where a value lies within rounding of a midpoint (near zero, where the steps are ~1e-6 of the absmax,
by up to three) (``tests/quant/test_adam8bit.py``). The C++ kernel follows the reference's operations in the
same order (the square root correctly rounded: ``_sqrt``): the two agree bit for bit.

``optimizer_class("adam8bit" | "adamw8bit")`` gives bitsandbytes' optimizers (same state, ``state_dict``
and hyper-parameters) whose CPU step runs this op on fp32 parameters; other devices and bf16/fp16
parameters keep bitsandbytes' kernels.
"""

from __future__ import annotations

import functools
import math

import torch

from deepspeed_ppq.ops import define_op

__all__ = ["BNB_BLOCK_SIZE", "MIN_8BIT_SIZE", "adam8bit_step", "optimizer_class"]

BNB_BLOCK_SIZE = 256  # values per absmax, as bitsandbytes' blockwise optimizers (Optimizer2State)
MIN_8BIT_SIZE = 4096  # bitsandbytes' default, and build_optimizer's: smaller tensors keep fp32 states

# torch's Adam ranges; the gradient's multiplier (a clipping coefficient) must be positive
_AT_LEAST_0 = (lambda v: v >= 0, ">= 0")
_BETA = (lambda v: 0 <= v < 1, "in [0, 1)")
_ABOVE_0 = (lambda v: v > 0, "> 0")


def _check_hyper(lr, betas, eps, weight_decay, scale, beta_names=("beta1", "beta2"),
                 scale_name="gnorm_scale") -> None:
    """Raise a ValueError naming the first hyper-parameter that is not a finite number in its range
    (lr, eps, weight_decay >= 0; each beta in [0, 1); the gradient's multiplier ``scale`` > 0)."""
    named = [("lr", lr, _AT_LEAST_0), ("eps", eps, _AT_LEAST_0), ("weight_decay", weight_decay, _AT_LEAST_0),
             *((n, b, _BETA) for n, b in zip(beta_names, betas, strict=True)), (scale_name, scale, _ABOVE_0)]
    for name, value, (ok, allowed) in named:
        if not (math.isfinite(value) and ok(value)):
            raise ValueError(f"{name}={value!r} is not allowed: use a finite number {allowed}")


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root rounded correctly: taken in fp64 and rounded once. torch's own fp32 ``sqrt`` on
    CPU is off by one ulp for ~20% of inputs (a vector-math library, not the IEEE instruction the
    kernels use); an fp64 root within 0.51 ulp rounds to the correct fp32 one, since the exact root of
    an fp32 value lies at least 2^-52 (relative) away from every midpoint between fp32 values."""
    return x.double().sqrt().to(x.dtype)


def _nearest(y: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    mids = (qmap[:-1] + qmap[1:]) / 2
    return torch.bucketize(y, mids, right=False).to(torch.uint8)


def _step_ref(p, g, state1, state2, absmax1, absmax2, qmap1, qmap2, beta1, beta2, eps, step, lr,
              weight_decay, gnorm_scale):
    n = p.numel()
    nb = absmax1.numel()
    pad = nb * BNB_BLOCK_SIZE - n

    def blocks(x):
        return torch.nn.functional.pad(x.reshape(-1), (0, pad)).view(nb, BNB_BLOCK_SIZE)

    m = blocks(qmap1[state1.reshape(-1).long()]) * absmax1.view(-1, 1)
    v = blocks(qmap2[state2.reshape(-1).long()]) * absmax2.view(-1, 1)
    gb = blocks(g.float()) * gnorm_scale
    m = m * beta1 + gb * (1.0 - beta1)
    v = v * beta2 + gb * gb * (1.0 - beta2)
    w = blocks(p)
    if weight_decay > 0.0:
        w = w * (1.0 - lr * weight_decay)
    c1, c2 = 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)
    w = w + (-lr * c2 / c1) * (m / (_sqrt(v) + eps * c2))
    if pad:  # the padding must not count towards the last block's absmax
        valid = torch.arange(nb * BNB_BLOCK_SIZE, device=p.device).view(nb, BNB_BLOCK_SIZE) < n
        m, v = m.masked_fill(~valid, 0.0), v.masked_fill(~valid, 0.0)
    a1, a2 = m.abs().amax(dim=1), v.amax(dim=1)
    q1 = _nearest(m * (1.0 / torch.where(a1 > 0, a1, 1.0)).view(-1, 1), qmap1)
    q2 = _nearest(v * (1.0 / torch.where(a2 > 0, a2, 1.0)).view(-1, 1), qmap2)
    p.copy_(w.reshape(-1)[:n].view_as(p))
    state1.copy_(q1.reshape(-1)[:n].view_as(state1))
    state2.copy_(q2.reshape(-1)[:n].view_as(state2))
    absmax1.copy_(a1)
    absmax2.copy_(a2)


def _step_fake(p, g, state1, state2, absmax1, absmax2, qmap1, qmap2, beta1, beta2, eps, step, lr,
               weight_decay, gnorm_scale):
    return None


_step_op = define_op(
    "adam8bit_blockwise_step_(Tensor(a!) p, Tensor g, Tensor(b!) state1, Tensor(c!) state2, "
    "Tensor(d!) absmax1, Tensor(e!) absmax2, Tensor qmap1, Tensor qmap2, float beta1, float beta2, "
    "float eps, int step, float lr, float weight_decay, float gnorm_scale) -> ()",
    _step_ref,
    _step_fake,
)


def adam8bit_step(p: torch.Tensor, g: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
                  absmax1: torch.Tensor, absmax2: torch.Tensor, qmap1: torch.Tensor, qmap2: torch.Tensor,
                  *, beta1: float, beta2: float, eps: float, step: int, lr: float, weight_decay: float = 0.0,
                  gnorm_scale: float = 1.0) -> None:
    """One fused Adam/AdamW step in place on ``p`` and its 8-bit states (see the module docstring).

    Args:
        p, g: fp32 parameter and gradient, same number of values (contiguous).
        state1, state2: uint8 codes, one per value; absmax1, absmax2: fp32, one per block of 256.
        qmap1, qmap2: the 256-entry fp32 code maps (bitsandbytes' signed and unsigned dynamic maps).
        step: the step number after this update (1 for the first).

    Raises:
        ValueError: a tensor of the wrong dtype, device or size, or a hyper-parameter out of range.
    """
    n = p.numel()
    nb = -(-n // BNB_BLOCK_SIZE)
    for name, t, dt, size in (
        ("p", p, torch.float32, n), ("g", g, torch.float32, n), ("state1", state1, torch.uint8, n),
        ("state2", state2, torch.uint8, n), ("absmax1", absmax1, torch.float32, nb),
        ("absmax2", absmax2, torch.float32, nb), ("qmap1", qmap1, torch.float32, 256),
        ("qmap2", qmap2, torch.float32, 256),
    ):  # fmt: skip
        if t.dtype != dt or t.numel() != size or not t.is_contiguous() or t.device != p.device:
            raise ValueError(
                f"{name} is a {t.dtype} tensor of {t.numel()} values on {t.device} (contiguous: "
                f"{t.is_contiguous()}); needs a contiguous {dt} tensor of {size} values on {p.device}"
            )
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step={step!r} must be an int >= 1")
    _check_hyper(lr, (beta1, beta2), eps, weight_decay, gnorm_scale)
    _step_op(p, g, state1, state2, absmax1, absmax2, qmap1, qmap2, float(beta1), float(beta2), float(eps),
             step, float(lr), float(weight_decay), float(gnorm_scale))


def _fused_cpu_step(opt, group, p, gindex, pindex) -> bool:
    """The CPU 8-bit branch of bitsandbytes' ``Optimizer2State.update_step`` through our op. Returns
    False (nothing done) where bitsandbytes' own kernel should run: another device, a bf16/fp16
    parameter, 32-bit states, or an option the op does not implement. The step count advances only
    once the op accepted its inputs."""
    state = opt.state[p]
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return False
    if "state1" not in state or state["state1"].dtype != torch.uint8:
        return False
    config = opt.get_config(gindex, pindex, group)
    betas = config["betas"]
    if config.get("max_unorm", 0.0) > 0.0 or config.get("skip_zeros") or len(betas) > 2 and betas[2]:
        return False
    p.data = p.data.contiguous()
    step = int(state["step"]) + 1
    adam8bit_step(
        p.data, p.grad.contiguous(), state["state1"], state["state2"], state["absmax1"], state["absmax2"],
        state["qmap1"], state["qmap2"], beta1=betas[0], beta2=betas[1], eps=config["eps"],
        step=step, lr=config["lr"], weight_decay=config["weight_decay"],
    )  # fmt: skip
    state["step"] = step
    return True


@functools.cache
def optimizer_class(kind: str) -> type:
    """``"adam8bit"`` / ``"adamw8bit"``: bitsandbytes' ``Adam8bit`` / ``AdamW8bit`` whose CPU step is the
    fused ``ppq::adam8bit_blockwise_step_`` (same state, ``state_dict`` and hyper-parameters; other
    devices keep bitsandbytes' kernels). bitsandbytes is imported only here."""
    import bitsandbytes as bnb

    bases = {"adam8bit": bnb.optim.Adam8bit, "adamw8bit": bnb.optim.AdamW8bit}
    if kind not in bases:
        raise ValueError(f"kind={kind!r} is not an 8-bit Adam: use 'adam8bit' or 'adamw8bit'")

    def update_step(self, group, p, gindex, pindex):
        if not _fused_cpu_step(self, group, p, gindex, pindex):
            bases[kind].update_step(self, group, p, gindex, pindex)

    name = bases[kind].__name__
    doc = f"bitsandbytes' ``{name}`` whose CPU step is the fused ``ppq::adam8bit_blockwise_step_``."
    return type(name, (bases[kind],), {"update_step": update_step, "__doc__": doc, "__module__": __name__})
