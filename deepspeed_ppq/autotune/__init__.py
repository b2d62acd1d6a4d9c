"""The autotuner: profile, plan pipeline and low-bit settings together, measure, calibrate, check.

* ``runner``: the protocol an engine implements for the loop (``TuningRunner``: profile, the stock
  partitions, run a trial plan) and the measurements it returns.
* ``loop``: ``tune(runner, settings, global_batch)``, the loop itself (best stock baseline, calibration,
  plan, measure, quality gate, back-off).
* ``costs`` / ``profiler``: what the planner knows per layer, codec, link and optimizer, and how it is
  measured; ``memory``: one vocabulary for predicted and measured memory, and the tracker.
* ``planner``: ``plan_pipeline`` (exact DP over partitions, search over the other knobs) and the stock
  configurations; ``calibrate``: the cost model refitted to measurements.
* ``plan``: the versioned plan file (``Plan``, ``load_plan``); ``report``: the outputs.

This package imports no engine and no model: the DeepSpeed runner lives in
``deepspeed_ppq.integrations.autotune``. ``deepspeed_ppq.autotune(model, loss_fn, train_data,
val_data, config)`` (this package, called) runs the whole loop with that runner.
"""

from __future__ import annotations

import sys
import types

from deepspeed_ppq.autotune.costs import CodecOption, LayerProfile
from deepspeed_ppq.autotune.plan import PLAN_SCHEMA_VERSION, Plan, PlanError, StagePlan, load_plan
from deepspeed_ppq.autotune.planner import (
    InfeasibleBudgetError,
    PlanningProblem,
    plan_pipeline,
    stock_candidates,
    stock_plan,
)
from deepspeed_ppq.schedule import LinkModel

__all__ = [
    "Plan",
    "StagePlan",
    "PlanError",
    "PLAN_SCHEMA_VERSION",
    "load_plan",
    "PlanningProblem",
    "plan_pipeline",
    "stock_plan",
    "stock_candidates",
    "InfeasibleBudgetError",
    "LayerProfile",
    "CodecOption",
    "LinkModel",
]


class _CallableModule(types.ModuleType):
    """``deepspeed_ppq.autotune(...)`` tunes a model; ``deepspeed_ppq.autotune.<module>`` is the package."""

    def __call__(self, model, loss_fn=None, train_data=None, val_data=None, config=None, **kwargs):
        """Tune ``model`` with DeepSpeed's pipeline engine: see
        ``deepspeed_ppq.integrations.autotune.autotune`` (imported here, when called)."""
        from deepspeed_ppq.integrations.autotune import autotune

        return autotune(model, loss_fn, train_data, val_data, config, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
