"""``ppq tune script.py [script args] [--budget-mb N ...]``: tune the user's unmodified training script.

The script runs on local ranks (``--nproc``, or the job's ranks under a launcher) until it calls
``deepspeed_ppq.initialize``; that call hands the model, data and config to the tuner instead of
training (``integrations.capture``), and ``integrations.autotune.autotune`` tunes them. Every
``ppq.autotune`` field is also a flag (generated from the config model).
"""

from __future__ import annotations

import argparse
import copy
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from deepspeed_ppq.config import PPQConfigError, load_ppq_config
from deepspeed_ppq.integrations.autotune import autotune
from deepspeed_ppq.integrations.capture import Captured, capturing
from deepspeed_ppq.integrations.local_ranks import spawn_local

__all__ = ["add_parser", "settings_flags", "flag_overrides"]


def _run_script(script: str, script_args: list[str]) -> dict:
    path = Path(script).resolve()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *script_args]
    sys.path.insert(0, str(path.parent))
    try:
        with capturing():
            runpy.run_path(str(path), run_name="__main__")
    except Captured as c:
        return c.kwargs
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    raise SystemExit(f"ppq tune: {script} finished without calling deepspeed_ppq.initialize(...): the tuner "
                     "takes the model, data and config from that call")


def settings_flags(p: argparse.ArgumentParser) -> list[str]:
    """``--<field>`` for every scalar or list field of ``ppq.autotune`` (generated from the config)."""
    from deepspeed_ppq.config import AutotuneConfig

    names = []
    for name, f in AutotuneConfig.model_fields.items():
        ann = str(f.annotation)
        flag = "--" + name.replace("_", "-")
        if "CodecConfig" in ann:
            continue
        if ann.startswith("list") or "list[" in ann:
            p.add_argument(flag, dest=f"set_{name}", help=f"{f.description or name} (comma-separated)")
        elif "bool" in ann:
            p.add_argument(flag, dest=f"set_{name}", choices=["true", "false"], help=f.description)
        else:
            p.add_argument(flag, dest=f"set_{name}", help=f.description)
        names.append(name)
    return names


def flag_overrides(ns, names: list[str]) -> dict:
    out = {}
    for name in names:
        v = getattr(ns, f"set_{name}", None)
        if v is None:
            continue
        if name in ("micro_batch_sizes", "pipeline_degrees"):
            v = [int(x) for x in v.split(",")]
        elif name in ("formats", "schedules"):
            v = v.split(",")
        elif v in ("true", "false"):
            v = v == "true"
        out[name] = v
    if getattr(ns, "budget_mb", None) is not None:
        out["memory_budget"] = int(float(ns.budget_mb) * 2**20)
    return out


def _run(ns) -> int:
    if not Path(ns.script).is_file():  # before any rank starts
        raise SystemExit(f"ppq tune: script {ns.script} does not exist")
    names = ns.setting_names
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--budget-mb", dest="budget_mb", type=float)
    own.add_argument("--nproc", type=int, default=2)
    own.add_argument("--out", dest="out_dir")
    settings_flags(own)
    mine, script_args = own.parse_known_args(ns.rest)
    for key, value in vars(ns).items():  # tuner flags given before the script
        if value is not None and getattr(mine, key, None) is None:
            setattr(mine, key, value)
    if "RANK" not in os.environ:
        return spawn_local(["tune", ns.script, *ns.rest], mine.nproc)
    import deepspeed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    kw = _run_script(ns.script, script_args)
    from deepspeed_ppq.integrations.ds_setup import _resolve_ds_config

    ds_config = copy.deepcopy(_resolve_ds_config(kw.get("args"), kw.get("config"), kw.get("config_params")))
    ppq = dict(ds_config.get("ppq") or {})
    ppq["autotune"] = {**(ppq.get("autotune") or {}), **flag_overrides(mine, names)}
    if mine.out_dir:
        ppq["autotune"]["out_dir"] = mine.out_dir
    ppq.pop("plan_file", None)
    ds_config["ppq"] = ppq
    model = kw.get("model")
    from deepspeed_ppq.autotune.loop import TuningError
    from deepspeed_ppq.autotune.plan import PlanError
    from deepspeed_ppq.autotune.planner import InfeasibleBudgetError

    try:
        plan = autotune(model, None, kw.get("training_data"), None, ds_config)
    except (PPQConfigError, PlanError, InfeasibleBudgetError, TuningError) as e:
        if dist.get_rank() == 0:
            print(f"ppq tune: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2
    if dist.get_rank() == 0:
        out = load_ppq_config(ppq).autotune.out_dir
        print(f"[ppq tune] wrote {out}/plan.json ({plan.notes[0] if plan.notes else 'plan'}), "
              f"{out}/report.md and {out}/tune.json", flush=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "tune", help="tune your training script's pipeline: profile, plan, measure, check (the autotuner)",
        description="Run SCRIPT (your DeepSpeed training script, unmodified) under the tuner: its call to "
        "deepspeed_ppq.initialize hands the model, data and config (with its ppq.autotune section) to the "
        "tuner, which writes plan.json and report.md. Apply the plan with \"ppq\": {\"plan_file\": ...}. "
        "Tuner flags may stand anywhere after SCRIPT; the others go to the script.")
    p.add_argument("script", help="your training script (it must call deepspeed_ppq.initialize)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the script's arguments and the tuner's flags")
    group = p.add_argument_group("tuner flags (override ppq.autotune)")
    group.add_argument("--budget-mb", dest="budget_mb", type=float, help="per-stage memory budget in MiB")
    group.add_argument("--nproc", type=int, default=2, help="local ranks when not under a launcher")
    group.add_argument("--out", dest="out_dir", help="output folder (plan.json, report.md, tune.json)")
    names = settings_flags(group)
    p.set_defaults(func=_run, setting_names=names)
