"""Non-finite values at stage boundaries (a mixin of ``PPQPipelineEngine``).

Checked on every path when a codec is configured: compressed messages carry the sender's flag in their
status byte; messages on DeepSpeed's own path (``ppq.warmup_steps``, raw evaluation) are checked on both
sides. ``ppq.nonfinite="error"``: the sender raises after the message went out, the receiver raises on
seeing it, both naming stage, boundary and step. ``"skip"``: every rank all-reduces a flag before the
optimizer step and skips it together; the codec state (EF/EF21/AQ-SGD) returns to where the step found it.
"""

from __future__ import annotations

import types
import warnings

import torch
from deepspeed import comm as dist

__all__ = ["NonFiniteStepError", "NonFiniteMixin"]


class NonFiniteStepError(RuntimeError):
    """A tensor crossing a stage boundary held NaN/Inf and ``ppq.nonfinite`` is ``"error"``."""


class NonFiniteMixin:
    """Non-finite checks and step skipping for ``PPQPipelineEngine``."""

    def _check_raw(self, tensors, direction: str, boundary: int, sender: bool) -> None:
        """Non-finite check of a message that went through DeepSpeed's own (uncompressed) path: warm-up
        steps, raw evaluation. Only when a codec is configured: codec "none" stays stock DeepSpeed."""
        if not self._compressing:
            return
        for idx, t in enumerate(x for x in tensors if x is not None and x.is_floating_point()):
            if not bool(torch.isfinite(t).all()):
                flagged = types.SimpleNamespace(last_nonfinite=True)
                self._check_flag(flagged, direction, boundary, idx, sender=sender)
                if sender:
                    self._raise_if_sender_flagged()
                return

    def _check_flag(self, side, direction: str, boundary: int, idx: int, sender: bool) -> None:
        """``side``: the encoder or decoder that just ran; its ``last_nonfinite`` is the payload's flag."""
        if not side.last_nonfinite:
            return
        where = f"stage {self.stage_id}, {self._name(direction, boundary, idx)}"
        self._nonfinite_where.append(where)
        if self.ppq.nonfinite == "error" and not sender:
            raise NonFiniteStepError(
                f"NaN/Inf received at {where} (step {self.global_steps}); ppq.nonfinite='error' stops "
                "training. Set ppq.nonfinite='skip' to skip such steps instead.")

    def _raise_if_sender_flagged(self) -> None:
        # Raised after the flagged payload went out, so the receiver stops as well instead of hanging.
        if self.ppq.nonfinite == "error" and self._nonfinite_where:
            self._wait_sends()
            raise NonFiniteStepError(
                f"NaN/Inf to send at {self._nonfinite_where[-1]} (step {self.global_steps}); "
                "ppq.nonfinite='error' stops training. Set ppq.nonfinite='skip' to skip such steps instead.")

    def _exec_optimizer_step(self, lr_kwargs=None):
        if self._compressing and self.ppq.nonfinite == "skip":
            flag = torch.tensor([float(bool(self._nonfinite_where))], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                self._skip_step()
                return
        super()._exec_optimizer_step(lr_kwargs)

    def _codec_sides(self):
        return [*self._encoders.values(), *self._decoders.values()]

    def _skip_step(self) -> None:
        where = "; ".join(self._nonfinite_where) or "another stage"
        for side in self._codec_sides():
            side.rollback()  # EF/EF21/AQ-SGD state as if this step's batch had never been seen
        warnings.warn(f"ppq: skipping optimizer step {self.global_steps}: NaN/Inf crossed a stage boundary "
                      f"(seen at {where})", RuntimeWarning, stacklevel=2)
        self._nonfinite_where.clear()
        if self.bfloat16_enabled() or self.zero_optimization() or self.fp16_enabled():
            self.optimizer.zero_grad()
        else:
            self.zero_grad()
        self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
