"""Memory per pipeline stage: one vocabulary for what the planner predicts and what a trial measures.

The planner predicts a stage's peak bytes in the categories of ``PREDICTED`` (``planner.stage_memory``);
a trial measures the stage's peak with PyTorch's category-aware tracker
(``torch.distributed._tools.mem_tracker.MemTracker``), which sees every tensor storage the stage
allocates while it trains and attributes it to parameters, buffers, gradients, optimizer states,
activations (tensors made in forward or recomputation) or temporaries (tensors made in backward).
Both are reported in the coarser ``CATEGORIES`` that the two can agree on. Both vocabularies, and the one
mapping from each onto the coarse one, live in ``deepspeed_ppq.memory_categories``:

============== =============================================== ===========================================
category       predicted (planner)                              measured (tracker)
============== =============================================== ===========================================
parameters     ``weights`` (codes + scales, or training dtype,  parameters + module buffers + low-bit
               + the dequantization buffer) +                   codes, scales and dequantization buffer
               ``master_weights`` (fp32 masters of low-bit
               weights)
gradients      ``gradients``                                    gradients
optimizer      ``optimizer``                                    optimizer states
activations    ``activations`` (saved for backward, per          activations: saved tensors, stage outputs,
               in-flight micro-batch) + ``comm_buffers`` (pipe   received pipe buffers, batches
               buffers)
temporaries    ``temporaries`` (largest backward transient)     temporaries (allocated during backward)
============== =============================================== ===========================================

The budget binds on the measured total at the stage's peak (``StageMemTracker.peak``). RSS is no
measure: it holds the allocator's slack, library state and every other process's shared pages.

On CUDA the tracker is still the per-category measure; ``torch.cuda.max_memory_allocated`` is
recorded beside it by the runner.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY as _TOTAL
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from deepspeed_ppq import memory_categories as mc
from deepspeed_ppq.quant.ledger import low_bit_tensors

_OPT = _MemRefType.OPT

__all__ = ["CATEGORIES", "PREDICTED", "coarse", "StageMemTracker", "measure_peak", "fmt_mib", "MIB"]

MIB = 1 << 20
# what the planner predicts, per stage
PREDICTED = (mc.WEIGHTS, mc.MASTER_WEIGHTS, mc.GRADIENTS, mc.OPTIMIZER, mc.ACTIVATIONS, mc.COMM_BUFFERS,
             mc.TEMPORARIES)
# what prediction and measurement are compared in
CATEGORIES = mc.COARSE


def coarse(predicted: dict[str, float]) -> dict[str, int]:
    """Planner categories (``PREDICTED``; a plan file's older names read too) summed into ``CATEGORIES``."""
    return mc.coarse(predicted, mc.PLAN_LEGACY_NAMES)


def fmt_mib(n: float) -> str:
    return f"{n / MIB:.2f} MiB"


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class StageMemTracker(MemTracker):
    """``MemTracker`` for one pipeline stage that runs its module once per micro-batch.

    The stock tracker keeps per-module statistics and refuses a root module called twice in one
    iteration; a pipeline stage does exactly that. This tracker keeps what the budget needs, the
    device-wide peak by category, and drops the per-module statistics: a module is registered (its
    parameters, buffers and gradient hooks) on its first forward; a forward during backward marks the
    recomputation region (activation checkpointing), whose tensors count as activations, as in the
    stock tracker.

    Usage::

        tracker = StageMemTracker()
        tracker.track_external(module, optimizer)
        with tracker:
            for batch in batches:
                engine.train_batch(batch)
        tracker.peak()   # {"parameters": ..., "gradients": ..., ..., "total": ...}
    """

    def __init__(self) -> None:
        super().__init__()
        self._registered: weakref.WeakSet = weakref.WeakSet()
        self._phase: str | None = None
        self._phase_peaks: dict[str, dict[str, int]] = {}

    def enter_phase(self, name: str) -> None:
        """Close the current phase (its peak is kept, the largest over all its visits) and start
        ``name``: the peak restarts from what is allocated now. The runner marks the pipeline phase
        (forward, backward, sends) and the step phase (gradient reduce, optimizer step), whose peaks
        the memory model predicts separately."""
        if name == self._phase:
            return
        if self._phase is not None:
            done = self._snapshot("peak")
            old = self._phase_peaks.get(self._phase)
            if old is None or done["total"] > old["total"]:
                self._phase_peaks[self._phase] = done
        self._phase = name
        cur = self.get_tracker_snapshot("current")
        self._peak_mem_snap = cur
        self._peak_mem = {dev: snap[_TOTAL] for dev, snap in cur.items()}

    def phase_peaks(self) -> dict[str, dict[str, int]]:
        """Peak by category of each phase (``enter_phase``), the open one included."""
        out = dict(self._phase_peaks)
        if self._phase is not None:
            cur = self._snapshot("peak")
            if self._phase not in out or cur["total"] > out[self._phase]["total"]:
                out[self._phase] = cur
        return out

    def track_external(self, *external) -> None:
        """As ``MemTracker.track_external``; a module's low-bit layers also count what they hold outside
        their parameters (codes and scales, the dequantization buffer: parameters; a master-free weight's
        gradient buffer and AdamW states: gradients and optimizer; ``quant.low_bit_tensors``), and an
        optimizer gets step hooks of its own that mark its step (the global optimizer hooks do not fire for
        every optimizer a wrapper steps)."""
        super().track_external(*external)
        for obj in external:
            if isinstance(obj, torch.nn.Module):
                for cat, t in low_bit_tensors(obj):
                    ref = (_MemRefType.GRAD if cat == "gradients" else _OPT if cat.startswith("optimizer")
                           else _MemRefType.PARAM)
                    self._update_and_maybe_create_winfos(t, ref)
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(lambda *_: setattr(self, "_in_opt", True))
                obj.register_step_post_hook(lambda opt, *_: self._leave_step(opt))

    def track_tensors(self, category: str, tensors) -> None:
        """Count ``tensors`` (made before the tracker started) as ``category`` (``"parameters"``,
        ``"gradients"`` or ``"optimizer"``): a mixed-precision optimizer wrapper's fp32 master weights and
        gradient buffers, which the tracker would otherwise count as "Other" (activations)."""
        refs = {"parameters": _MemRefType.PARAM, "gradients": _MemRefType.GRAD, "optimizer": _OPT}
        if category not in refs:
            raise ValueError(f"category={category!r} is not allowed: use one of {sorted(refs)}")
        for t in tensors:
            self._update_and_maybe_create_winfos(t, refs[category])

    def _leave_step(self, optimizer) -> None:
        if self._depth:
            self._track_optimizer_states(_OPT, optimizer)
        self._in_opt = False

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # torch's tracker hooks every parameter's gradient, and a frozen parameter (a fine-tune's base)
        # refuses a hook: mark those as hooked already (with handles that remove nothing)
        for p in module.parameters():
            if not p.requires_grad:
                self._param_to_grad_hook_handles.setdefault(p, (_NO_HOOK, _NO_HOOK))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module, inputs) -> None:
        if module not in self._registered:
            self._registered.add(module)
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
        elif self._mod_tracker.is_bw and self._ac_mod is None:
            self._ac_mod = weakref.ref(module)
            self._in_ac = True

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod = None
            self._in_ac = False

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass

    def _snapshot(self, kind: str) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for _dev, snap in self.get_tracker_snapshot(kind).items():
            for ref, v in snap.items():
                name = getattr(ref, "value", str(ref))
                if name in mc.TRACKER_COARSE_OF:
                    out[mc.TRACKER_COARSE_OF[name]] += int(v)
        out["total"] = sum(out[c] for c in CATEGORIES)
        return out

    def peak(self) -> dict[str, int]:
        """Bytes by category at the moment of the largest total, plus ``"total"`` (over all phases)."""
        phases = self.phase_peaks()
        if not phases:
            return self._snapshot("peak")
        return dict(max(phases.values(), key=lambda snap: snap["total"]))

    def current(self) -> dict[str, int]:
        return self._snapshot("current")


def measure_peak(fn, *track) -> dict[str, int]:
    """Run ``fn()`` under a fresh ``StageMemTracker`` (tracking ``track``: modules, optimizers) and
    return its peak by category."""
    tracker = StageMemTracker()
    if track:
        tracker.track_external(*track)
    with tracker:
        fn()
    return tracker.peak()

