"""The study's CNN setting at reduced scale: a small ReLU ResNet on generated oriented-grating images.

The study measured its quantization findings on ResNet-18 / CIFAR-10. The benchmark downloads nothing
(it runs offline), so the images are generated in code (deterministic per seed):

* 10 classes: the orientation of a Gabor patch (a cosine grating under a Gaussian window), at
  ``k * 18`` degrees for class ``k`` with +-5 degrees of jitter;
* nuisances drawn per image: spatial frequency, phase, window position and size, per-channel colour
  and sign, background level, a weaker distractor patch of random orientation, pixel noise.

Random phase makes the task not linearly separable (a grating and its negative belong to the same
class), and the 18-degree spacing with jitter, noise and the distractor keeps it from being trivial.

The model is a 4-stage ReLU ResNet (BasicBlocks with BatchNorm, as ResNet-18 in small), with a
compressed boundary after each of the first three stages, as in the study (pipeline degree 4)::

    stage 0: conv3x3(3->c) BN ReLU, block(c)        -> boundary 0  [N, c, 16, 16]
    stage 1: block(c)                               -> boundary 1  [N, c, 16, 16]
    stage 2: block(c -> 2c, stride 2)               -> boundary 2  [N, 2c, 8, 8]
    stage 3: block(2c), global average pool, linear(2c -> 10)

Boundary activations are block outputs, post-ReLU (non-negative), as between ResNet-18's blocks.
Codec granularity on a 4-D tensor: each boundary views ``[N, C, H, W]`` as ``[N, C, H*W]`` before the
codec, so ``granularity="sample"`` is one min-max scale per sample (the study's per-vector scaling) and
``granularity="token"`` is one scale per channel of each sample ("per-channel"); TopK keeps K% of
each sample's ``C*H*W`` elements either way.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["make_images", "ResNetStages", "run_cnn_case", "check_cnn_reference", "CNN_DEFAULTS"]

N_CLASSES = 10

# Settings chosen before any compressed run (see docs/quality.md); the lead's recorded run uses these.
CNN_DEFAULTS = {
    "cnn_steps": 600,
    "cnn_batch": 64,
    "cnn_width": 16,
    "cnn_lr": 0.05,
    "cnn_train": 8000,
    "cnn_test": 2000,
    "cnn_size": 16,
}


def make_images(n: int, seed: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` generated images ``[n, 3, size, size]`` (float32, roughly zero-mean) and labels ``[n]``.

    Deterministic in ``(n, seed, size)``; the training and test sets use different seeds. A larger
    ``size`` draws the same pictures at a higher resolution (window size and wavelength scale with it).
    """
    if n < 1 or size < 8:
        raise ValueError(f"make_images(n={n}, size={size}): need n >= 1 and size >= 8")
    g = torch.Generator().manual_seed(seed)

    def u(lo: float, hi: float, *shape: int) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, *shape, generator=g)

    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    spacing = math.pi / N_CLASSES
    coords = torch.arange(size, dtype=torch.float32)
    k = size / 16  # scale of the 16x16 design
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")  # [S, S]

    def gabor(theta: torch.Tensor, amp: torch.Tensor) -> torch.Tensor:
        """One Gabor patch per image with the given orientation ``[n]`` and amplitude ``[n]``."""
        freq, phase = u(0.12, 0.30) / k, u(0.0, 2 * math.pi)
        cx, cy, sigma = u(3.0 * k, size - 4.0 * k), u(3.0 * k, size - 4.0 * k), u(2.5, 5.0) * k
        xs, ys = xx[None] - cx[:, None, None], yy[None] - cy[:, None, None]  # [n, S, S]
        along = xs * torch.cos(theta)[:, None, None] + ys * torch.sin(theta)[:, None, None]
        wave = torch.cos(2 * math.pi * freq[:, None, None] * along + phase[:, None, None])
        window = torch.exp(-(xs ** 2 + ys ** 2) / (2 * sigma[:, None, None] ** 2))
        colour = u(0.4, 1.0, 3) * torch.where(torch.rand(n, 3, generator=g) < 0.2, -1.0, 1.0)  # [n, 3]
        return (amp[:, None, None] * wave * window)[:, None] * colour[:, :, None, None]  # [n, 3, S, S]

    theta = y.float() * spacing + u(-5.0, 5.0) * math.pi / 180
    img = gabor(theta, u(0.8, 1.2))
    img += gabor(u(0.0, math.pi), u(0.3, 0.6))  # distractor: random orientation, weaker
    img += u(-0.3, 0.3, 3)[:, :, None, None]  # background level per channel
    img += 0.35 * torch.randn(img.shape, generator=g)
    return img.contiguous(), y


class _Block(nn.Module):
    """ResNet BasicBlock: relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (x if self.short is None else self.short(x)))


class _FlatBoundary(nn.Module):
    """Views ``[N, C, H, W]`` as ``[N, C, H*W]`` around a ``Boundary`` (per-channel rows for the codec)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        return self.inner(x.reshape(n, c, h * w)).reshape(n, c, h, w)


class ResNetStages(nn.Sequential):
    """The 4-stage ReLU ResNet with a module (identity by default) at each of its 3 boundaries."""

    def __init__(self, width: int, seed: int, boundaries: list[nn.Module] | None = None):
        torch.manual_seed(seed)
        c = width
        stages = [
            nn.Sequential(nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(), _Block(c, c)),
            _Block(c, c),
            _Block(c, 2 * c, stride=2),
            nn.Sequential(_Block(2 * c, 2 * c), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(2 * c, N_CLASSES)),
        ]
        mods = []
        for i, s in enumerate(stages):
            mods.append(s)
            if i < 3 and boundaries is not None:
                mods.append(_FlatBoundary(boundaries[i]))
        super().__init__(*mods)


def boundary_shapes(width: int, batch: int, size: int = 16) -> list[tuple[int, int, int]]:
    """The ``[N, C, H*W]`` shape each codec sees (``size`` x ``size`` images)."""
    hw = size * size
    return [(batch, width, hw), (batch, width, hw), (batch, 2 * width, hw // 4)]


def _build(case, args: dict, seed: int):
    from bench_quality import Boundary

    from deepspeed_ppq.config import AQSGDConfig, CodecConfig

    act, grad = CodecConfig(**case.act), CodecConfig(**case.grad)
    aq = AQSGDConfig(enabled=True) if case.aqsgd else None
    bounds = [Boundary(f"b{i}", act, grad, aq) for i in range(3)]
    return ResNetStages(args["cnn_width"], seed, bounds), bounds


@torch.no_grad()
def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> tuple[float, float]:
    """(mean cross-entropy, accuracy in %) over ``x``, in eval mode (BatchNorm running statistics)."""
    model.eval()
    loss, correct = 0.0, 0
    for s in range(0, len(x), batch):
        logits = model(x[s:s + batch])
        loss += F.cross_entropy(logits, y[s:s + batch], reduction="sum").item()
        correct += (logits.argmax(1) == y[s:s + batch]).sum().item()
    model.train()
    return loss / len(x), 100.0 * correct / len(x)


def run_cnn_case(case, args: dict) -> dict:
    """Train one case on the generated images and evaluate on the test set with and without compression.

    SGD with momentum 0.9, weight decay 5e-4, linear warm-up then cosine (a CIFAR ResNet recipe).
    Returns the row ``bench_quality`` tabulates: ``val_loss_*`` is the test cross-entropy, ``acc_*``
    the test accuracy in %.
    """
    from deepspeed_ppq.compress.codecs import payload_nbytes
    from deepspeed_ppq.config import CodecConfig

    torch.set_num_threads(1)
    seed = args["seed"] + (case.seed or 0)
    size = args.get("cnn_size", 16)
    xtr, ytr = make_images(args["cnn_train"], seed=1000 + args["seed"], size=size)
    xte, yte = make_images(args["cnn_test"], seed=2000 + args["seed"], size=size)
    model, bounds = _build(case, args, seed)
    steps, batch = args["cnn_steps"], args["cnn_batch"]
    opt = torch.optim.SGD(model.parameters(), lr=args["cnn_lr"], momentum=0.9, weight_decay=5e-4)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(xtr), generator=gen) for _ in range(steps * batch // len(xtr) + 1)])
    t0 = time.perf_counter()
    losses, correct, nonfinite = [], [], False
    for step in range(steps):
        idx = order[step * batch:(step + 1) * batch]
        for b in bounds:
            b.sample_ids = idx
        logits = model(xtr[idx])
        loss = F.cross_entropy(logits, ytr[idx])
        if not torch.isfinite(loss):
            nonfinite = True
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        correct.append((logits.argmax(1) == ytr[idx]).float().mean().item())
    out = {"name": case.name, "group": case.group, "seed": seed, "act": case.act, "grad": case.grad,
           "aqsgd": case.aqsgd, "train_seconds": round(time.perf_counter() - t0, 2), "nonfinite": nonfinite,
           "train_loss_last10": sum(losses[-10:]) / max(1, len(losses[-10:])),
           "train_acc_last20": 100.0 * sum(correct[-20:]) / max(1, len(correct[-20:])),
           "loss_curve": [round(v, 4) for v in losses[:: max(1, len(losses) // 50)]]}
    if nonfinite:
        out.update(val_loss_compressed=float("nan"), val_loss_plain=float("nan"),
                   acc_compressed=float("nan"), acc_plain=float("nan"))
        return out
    for b in bounds:
        b.compress = True
    out["val_loss_compressed"], out["acc_compressed"] = _evaluate(model, xte, yte, 500)
    for b in bounds:
        b.compress = False
    out["val_loss_plain"], out["acc_plain"] = _evaluate(model, xte, yte, 500)
    act, grad = CodecConfig(**case.act), CodecConfig(**case.grad)
    out["eval_compressed_by_default"] = act.eval_compressed
    shapes = boundary_shapes(args["cnn_width"], batch, size)
    raw = sum(math.prod(s) for s in shapes) * 4
    values_only = grad.method == "topk" and grad.reuse_indices
    out["act_bytes_ratio"] = sum(payload_nbytes(act, s, torch.float32) for s in shapes) / raw
    out["grad_bytes_ratio"] = sum(payload_nbytes(grad, s, torch.float32, values_only=values_only)
                                  for s in shapes) / raw
    return out


def check_cnn_reference(args: dict) -> None:
    """Codec ``none`` at the boundaries leaves the ResNet bit-identical (loss and every gradient) to the
    plain ResNet; 8-bit codecs change the loss only slightly."""
    from bench_quality import Case, _q

    torch.set_num_threads(1)
    x, y = make_images(32, seed=7)
    ref = ResNetStages(args["cnn_width"], args["seed"])
    loss_ref = F.cross_entropy(ref(x), y)
    loss_ref.backward()
    for case, tol in ((Case("none", "check", {"method": "none"}, {"method": "none"}), 0.0),
                      (Case("a8/g8", "check", _q(8, "sample"), _q(8, "sample")), 0.05)):
        model, _ = _build(case, args, args["seed"])
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if abs(loss.item() - loss_ref.item()) > tol:
            raise SystemExit(f"CNN reference check failed for {case.name}: "
                             f"loss {loss.item()} vs {loss_ref.item()}")
        if tol == 0.0:
            g_ref = [p.grad for p in ref.parameters()]
            if any(not torch.equal(a, p.grad) for a, p in zip(g_ref, model.parameters())):
                raise SystemExit("CNN reference check failed: codec 'none' changed a gradient")
    print("CNN reference check: codec 'none' is bit-identical to the plain ResNet; a8/g8 loss within 0.05")
