"""The autotuner: profile, plan pipeline and low-bit settings together, carry the plan out, check it.

* ``costs``: what the planner knows (``LayerProfile``, ``CodecOption``, ``LinkModel``).
* ``profiler``: measures those with the real kernels (``profile_layers``, ``profile_codecs``,
  ``measure_link``), cached as JSON.
* ``planner``: ``plan_pipeline`` (exact DP over partitions, search over the other knobs) and
  ``baseline_plan`` (what a DeepSpeed user would configure).
* ``plan``: the versioned plan schema (``Plan``, ``load_plan``).
* ``loop``: ``run_tuning`` inside each rank; ``report``: the markdown report.
* ``autotune(spec, nproc)``: the whole loop on local ranks from Python (``ppq tune`` on the command line).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from deepspeed_ppq.autotune.costs import CodecOption, LayerProfile, LinkModel
from deepspeed_ppq.autotune.plan import PLAN_SCHEMA_VERSION, Plan, PlanError, StagePlan, load_plan
from deepspeed_ppq.autotune.planner import (
    InfeasibleBudgetError,
    PlanningProblem,
    baseline_plan,
    plan_pipeline,
)

__all__ = [
    "autotune",
    "Plan",
    "StagePlan",
    "PlanError",
    "PLAN_SCHEMA_VERSION",
    "load_plan",
    "PlanningProblem",
    "plan_pipeline",
    "baseline_plan",
    "InfeasibleBudgetError",
    "LayerProfile",
    "CodecOption",
    "LinkModel",
]


def autotune(spec=None, nproc: int = 2, config=None, **fields) -> dict:
    """Run the tuning loop on ``nproc`` local gloo ranks and return its result (``tune.json``).

    Args:
        spec: a ``TuneSpec`` or dict of its fields; it overrides ``config``, ``fields`` override both.
        nproc: ranks to start (the world size the plan is for).
        config: a ``"ppq"`` config (``PPQConfig``, dict, JSON path or whole DeepSpeed config) whose
            ``autotune`` section and ``weights`` policy set the spec (as ``ppq tune --config``).

    Raises:
        RuntimeError: a rank failed (its output went to this process's stdout/stderr).
    """
    from deepspeed_ppq.autotune.cli import spawn_local, spec_fields_from_config
    from deepspeed_ppq.autotune.loop import TuneSpec

    d = spec_fields_from_config(config) if config is not None else {}
    d.update(asdict(spec) if isinstance(spec, TuneSpec) else dict(spec or {}))
    d.update(fields)
    TuneSpec(**d)  # validate field names here, before starting processes
    with tempfile.TemporaryDirectory(prefix="ppq-tune-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(d))
        code = spawn_local(["tune", "--spec", str(path)], nproc)
    if code:
        raise RuntimeError(f"ppq tune failed with exit code {code}")
    out = Path(d.get("out_dir", TuneSpec().out_dir))
    return json.loads((out / "tune.json").read_text())
