"""Error-feedback state of one boundary direction (one global buffer per sender, as in the study).

* ``ef``: the sender keeps ``e``; it sends ``C(x + e)`` and sets ``e = (x + e) - D(C(x + e))``.
* ``ef21``: both sides keep ``g`` (zero at start); the sender sends ``C(x - g)``; both add the decoded
  message to ``g``; the receiver's output is ``g``. The two ``g`` stay bit-identical because both add the
  same decoded bytes.
* ``ef_mixed`` (TopK only): like ``ef``, but of the K indices sent per sample, ``ceil(K/2)`` are the
  largest of ``|x|`` and the other ``floor(K/2)`` the largest of ``|e|`` among the rest; the values sent are
  those of ``x + e`` at these indices.

A buffer whose shape no longer matches the message (for example a shorter last micro-batch) restarts
from zero on both sides; this is deterministic, so EF21's two copies stay equal.
"""

from __future__ import annotations

import torch

from deepspeed_ppq.compress import ops

__all__ = ["FeedbackState", "mixed_topk_indices"]


class FeedbackState:
    """One fp32 buffer (``e`` for EF/EF-mixed, ``g`` for EF21) that follows the message shape."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self._saved: tuple[torch.Tensor | None] | None = None

    def begin_step(self) -> None:
        """Remember the buffer as it is, so ``rollback`` can return to it (a skipped optimizer step)."""
        self._saved = (None if self.buf is None else self.buf.clone(),)

    def commit(self) -> None:
        self._saved = None

    def rollback(self) -> None:
        if self._saved is not None:
            self.buf = self._saved[0]
        self._saved = None

    def get(self, shape, device: torch.device | str = "cpu") -> torch.Tensor:
        """The buffer for a message of ``shape`` on ``device`` (zeros when the shape or device changed)."""
        shape = tuple(shape)
        device = torch.device(device)
        if self.buf is None or tuple(self.buf.shape) != shape or self.buf.device != device:
            self.buf = torch.zeros(shape, dtype=torch.float32, device=device)
        return self.buf

    def reset(self) -> None:
        self.buf = None
        self._saved = None


def mixed_topk_indices(x: torch.Tensor, e: torch.Tensor, k: int) -> torch.Tensor:
    """EF-mixed selection on ``[B, L]``: ``ceil(k/2)`` largest ``|x|`` plus ``floor(k/2)`` largest ``|e|``
    among the remaining indices; int64 ``[B, k]`` in ascending order (ties to the lower index).

    Args:
        x: the message ``[B, L]``.
        e: the error-feedback buffer, of ``x``'s shape.
        k: indices per sample, in ``[1, L]``.

    Raises:
        ValueError: ``x`` not 2-D, ``e`` of another shape, or ``k`` outside ``[1, L]``.
    """
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}: mixed_topk_indices takes [B, L]")
    B, L = x.shape
    if tuple(e.shape) != (B, L):
        raise ValueError(f"e has shape {tuple(e.shape)}, it must match x's [B, L]=[{B}, {L}]")
    if not 1 <= k <= L:
        raise ValueError(f"k={k} must lie in [1, L={L}] (indices per sample of {L} elements)")
    k1 = (k + 1) // 2
    k2 = k - k1
    s1 = torch.empty(B, k1, dtype=torch.int64, device=x.device)
    ignored = (torch.empty(B, k1, dtype=x.dtype, device=x.device),
               torch.empty(1, dtype=torch.uint8, device=x.device))
    ops.topk_encode(x.contiguous(), k1, ignored[0], s1, ignored[1])
    if k2 == 0:
        return s1
    key = e.abs().float()
    key.scatter_(1, s1, -1.0)  # already chosen: below every |e|
    s2 = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k2]
    return torch.cat([s1, s2], 1).sort(dim=1).values
