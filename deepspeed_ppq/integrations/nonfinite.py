"""Skipping a step that carried NaN/Inf across a stage boundary (a mixin of ``PPQPipelineEngine``).

Each ``compress.BoundaryChannel`` checks every message (compressed ones carry the sender's flag; those on
DeepSpeed's own path, ``ppq.warmup_steps`` and raw evaluation, are checked on both sides) and, with
``ppq.nonfinite="error"``, stops both sides naming stage, boundary and step. With ``"skip"`` every rank
all-reduces a flag before the optimizer step and skips it together; the codec state (EF/EF21/AQ-SGD)
returns to where the step found it.
"""

from __future__ import annotations

import warnings

import torch
from deepspeed import comm as dist

from deepspeed_ppq.compress import NonFiniteStepError

__all__ = ["NonFiniteStepError", "NonFiniteMixin"]


class NonFiniteMixin:
    """The optimizer step of ``PPQPipelineEngine``: skipped on every rank when any rank saw NaN/Inf."""

    def _flagged(self) -> list[str]:
        return [where for ch in self._channels.values() for where in ch.flagged]

    def _exec_optimizer_step(self, lr_kwargs=None):
        if self._compressing and self.ppq.nonfinite == "skip":
            flag = torch.tensor([float(bool(self._flagged()))], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                self._skip_step()
                return
        super()._exec_optimizer_step(lr_kwargs)

    def _skip_step(self) -> None:
        where = "; ".join(self._flagged()) or "another stage"
        for ch in self._channels.values():
            ch.rollback()  # EF/EF21/AQ-SGD state as if this step's batch had never been seen
            ch.clear_flags()
        warnings.warn(f"ppq: skipping optimizer step {self.global_steps}: NaN/Inf crossed a stage boundary "
                      f"(seen at {where})", RuntimeWarning, stacklevel=2)
        if self.bfloat16_enabled() or self.zero_optimization() or self.fp16_enabled():
            self.optimizer.zero_grad()
        else:
            self.zero_grad()
        self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
