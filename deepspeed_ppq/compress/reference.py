"""The single-process reference of one compressed stage boundary: :func:`compressed_boundary`.

A model with ``compressed_boundary`` at every stage cut, each with its own ``BoundaryChannel(cfg)``, is
what the distributed engines must compute: forward, the activation crosses the channel (sent and
received in one process); backward, its gradient does, under the same rule, state and index reuse.
"""

from __future__ import annotations

import itertools

import torch

from deepspeed_ppq.compress.channel import BoundaryChannel

__all__ = ["compressed_boundary"]

_MICRO_BATCHES = itertools.count()  # one key per forward pass: its backward pass reuses its TopK indices


class _CompressedBoundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, channel, slot, sample_ids, training, step):
        key = next(_MICRO_BATCHES)
        ctx.args = (channel, slot, key, training, step)
        wire = channel.send("activations", x, slot=slot, micro_batch=key, sample_ids=sample_ids,
                            training=training, step=step)
        y = channel.recv("activations", wire, x.shape, x.dtype, slot=slot, micro_batch=key,
                         sample_ids=sample_ids, training=training, step=step)
        if not ctx.needs_input_grad[0]:
            channel.forget(key)  # no backward pass will come for this micro-batch
        return x.clone() if y is x else y

    @staticmethod
    def backward(ctx, gy):
        channel, slot, key, training, step = ctx.args
        if not training:  # an evaluation boundary: gradients are not its business
            return gy, None, None, None, None, None
        gy = gy.contiguous()
        wire = channel.send("gradients", gy, slot=slot, micro_batch=key, step=step)
        gx = channel.recv("gradients", wire, gy.shape, gy.dtype, slot=slot, micro_batch=key, step=step)
        return gx, None, None, None, None, None


def compressed_boundary(x: torch.Tensor, channel: BoundaryChannel, *, slot: int = 0, sample_ids=None,
                        training: bool = True, step: int | None = None) -> torch.Tensor:
    """Single-process reference of one compressed stage boundary.

    Forward sends ``x`` through ``channel``'s activation codec and receives it back; backward does the same
    with the incoming gradient (values only at the activation's TopK indices when the gradient reuses
    them). Whether each direction is compressed follows ``channel.mode``: ``ppq.warmup_steps`` and AQ-SGD's
    warm-up by ``step``, evaluation by ``eval_compressed``.

    Args:
        x: the boundary activation (a floating tensor).
        channel: a ``BoundaryChannel`` with ``side="both"`` (one per boundary; its state persists).
        slot: the tensor's index when the boundary carries a tuple.
        sample_ids: dataset indices of the samples in ``x`` (AQ-SGD), along ``channel.sample_dim``.
        training: a training step; evaluation is compressed only when ``eval_compressed`` and never
            sends gradients.
        step: the optimizer step (0-based) for the warm-ups; ``None`` is past them.

    Returns:
        The reconstructed activation (differentiable w.r.t. ``x``).
    """
    if not isinstance(channel, BoundaryChannel) or channel.side != "both":
        raise ValueError("compressed_boundary needs a BoundaryChannel(cfg) with side='both' (it sends and "
                         f"receives in one process), got {channel!r}")
    return _CompressedBoundary.apply(x, channel, slot, sample_ids, training, step)
