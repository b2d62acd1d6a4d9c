"""What the tuning loop asks of an engine: the runner protocol and the measurements it returns.

The loop (``loop.tune``) plans, calibrates and decides; a runner carries the work out on a real engine
with the user's own model, data and loss:

* ``profile`` measures every layer, codec, the link and the optimizer kinds (``Profile``);
* ``stock_partitions`` says how the stock engine would cut the layers into ``p`` stages by each of
  its own partition methods (the baseline search uses exactly those);
* ``run_trial`` trains a ``Plan`` for a few steps and measures step time, per-instruction time, each
  stage's peak memory by category (``memory.CATEGORIES``) and validation loss (``TrialResult``);
* ``share`` gives every rank rank 0's object, so every rank takes the same decisions.

Every rank of the job runs the same loop over its own runner; a runner returns the same ``Profile``
and ``TrialResult`` on every rank (it gathers them), so the loop itself needs no communication.
``deepspeed_ppq.integrations.autotune.DeepSpeedRunner`` is the runner for DeepSpeed's pipeline
engine; this module imports no engine.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from deepspeed_ppq.autotune.costs import CodecOption, LayerProfile
from deepspeed_ppq.autotune.plan import Plan
from deepspeed_ppq.schedule import LinkModel

__all__ = ["Profile", "StageMeasurement", "TrialResult", "TuningRunner"]


@dataclass
class Profile:
    """What the planner needs to know about the model on this machine.

    Attributes:
        layers: per-layer profiles in pipeline order.
        codecs: every candidate codec, measured.
        link: the stage-to-stage link (latency + bandwidth).
        optimizer_costs: optimizer step seconds per parameter by kind (``profiler.optimizer_costs``).
        step_transient_bytes_per_param: the engine's transient bytes per trainable parameter around the
            optimizer step (e.g. a flattened gradient buffer for the data-parallel reduce); a prior the
            loop refits from measured trials.
        threads_per_rank: intra-op threads each rank computes with (CPU); the plans record it, since
            their measured times hold for it.
        grads_freed_after_step: the engine frees parameter gradients after its optimizer step
            (``PlanningProblem.grads_freed_after_step``).
        master_free_update_in_backward: the engine updates master-free weights in their backward at
            one micro-batch per step (``PlanningProblem.master_free_update_in_backward``).
        bf16_mode: the engine trains in DeepSpeed's bf16 mode; the layers were profiled in bf16
            (``PlanningProblem.bf16_mode``).
    """

    layers: list[LayerProfile]
    codecs: list[CodecOption]
    link: LinkModel
    optimizer_costs: dict[str, float]
    step_transient_bytes_per_param: float = 0.0
    threads_per_rank: int | None = None
    grads_freed_after_step: bool = False
    master_free_update_in_backward: bool = False
    bf16_mode: bool = False

    def to_dict(self) -> dict:
        return {
            "layers": [lp.to_dict() for lp in self.layers],
            "codecs": [{**asdict(c), "config": c.as_dict} for c in self.codecs],
            "link": {"latency_s": self.link.latency_s, "bandwidth_Bps": self.link.bandwidth_Bps},
            "optimizer_costs": dict(self.optimizer_costs),
            "step_transient_bytes_per_param": self.step_transient_bytes_per_param,
            "threads_per_rank": self.threads_per_rank,
            "grads_freed_after_step": self.grads_freed_after_step,
            "master_free_update_in_backward": self.master_free_update_in_backward,
            "bf16_mode": self.bf16_mode,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        codecs = [CodecOption.make(c["config"], **{k: v for k, v in c.items() if k != "config"})
                  for c in d["codecs"]]
        return cls(
            layers=[LayerProfile.from_dict(x) for x in d["layers"]],
            codecs=codecs,
            link=LinkModel(**d["link"]),
            optimizer_costs=dict(d["optimizer_costs"]),
            step_transient_bytes_per_param=float(d.get("step_transient_bytes_per_param", 0.0)),
            threads_per_rank=d.get("threads_per_rank"),
            grads_freed_after_step=bool(d.get("grads_freed_after_step", False)),
            master_free_update_in_backward=bool(d.get("master_free_update_in_backward", False)),
            bf16_mode=bool(d.get("bf16_mode", False)),
        )


@dataclass
class StageMeasurement:
    """One stage of a trial (the largest over its data-parallel replicas).

    Attributes:
        stage: stage index.
        instructions: seconds per step spent in each engine instruction (``ForwardPass``, ...).
        memory: peak bytes by ``memory.CATEGORIES`` plus ``"total"`` (the budget's measure).
        device_max_allocated: the device allocator's peak (CUDA), where there is one.
    """

    stage: int
    instructions: dict[str, float]
    memory: dict[str, int]
    device_max_allocated: int | None = None


@dataclass
class TrialResult:
    """A plan trained for a few steps on the real engine.

    Attributes:
        step_times: seconds per step (the slowest rank; the steps run back to back, as in training),
            warm-up steps included.
        warmup_steps: how many of ``step_times`` are warm-up.
        val_loss: mean validation loss after the trial's steps.
        stages: per-stage measurements.
        wire: bytes on the wire per boundary and direction, as the engine counted them.
    """

    step_times: list[float]
    warmup_steps: int
    val_loss: float
    stages: list[StageMeasurement]
    wire: dict[str, Any] = field(default_factory=dict)

    @property
    def step_time(self) -> float:
        """Median step time after the warm-up."""
        return statistics.median(self.step_times[self.warmup_steps :] or self.step_times)

    @property
    def peak_memory(self) -> int:
        return max(s.memory["total"] for s in self.stages)

    def to_dict(self) -> dict:
        return {**asdict(self), "step_time": self.step_time, "peak_memory": self.peak_memory}


@runtime_checkable
class TuningRunner(Protocol):
    """An engine the tuning loop can drive (see the module docstring)."""

    world_size: int

    def fingerprint(self) -> dict:
        """What identifies the model (layer count, classes, parameter shapes); plans record it."""

    def profile(self, settings) -> Profile:
        """Measure the model under ``settings`` (an ``AutotuneConfig``)."""

    def stock_partitions(self, pipeline_degree: int) -> dict[str, list[int]]:
        """Stage boundaries ``[0, ..., L]`` by each stock partition method (``"parameters"``, ...)."""

    def run_trial(self, plan: Plan, settings, seed: int = 0, steps: int | None = None,
                  timing_only: bool = False) -> TrialResult:
        """Train ``plan`` for ``settings.trial_steps`` steps and measure time and memory; with ``steps``,
        a quality run: that many steps, then the validation loss (memory not measured); with
        ``timing_only``, the step and instruction times alone (memory not measured, ``val_loss`` NaN):
        the repeats of a comparison."""

    def share(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    def log(self, message: str) -> None:
        """Print a progress line (once per job)."""
