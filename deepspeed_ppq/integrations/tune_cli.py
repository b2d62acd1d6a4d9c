"""``ppq tune [tuner flags] script.py [script args and tuner flags]``: tune an unmodified training script.

The script runs on local ranks (``--nproc``, or the job's ranks under a launcher) until it calls
``deepspeed_ppq.initialize``; that call hands the model, data and config to the tuner instead of
training (``integrations.capture``), and ``integrations.autotune.autotune`` tunes them. Every
``ppq.autotune`` field but the codec lists (``activation_codecs``, ``gradient_codecs``: set them in the
JSON config) is also a flag, generated from the config model. Tuner flags mean the same before and after
the script (after it, one given twice wins); they are checked before any rank starts.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import runpy
import sys
from pathlib import Path
from typing import Literal, get_args, get_origin

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


def _kind(annotation) -> str:
    """How a ``ppq.autotune`` field is given on the command line: codec (no flag), list, bool, scalar."""
    ann = str(annotation)
    if "CodecConfig" in ann:
        return "codec"
    if ann.startswith("list") or "list[" in ann:
        return "list"
    return "bool" if "bool" in ann else "scalar"


def _setting_value(name: str, text: str):
    """The ``ppq.autotune`` value of ``--<name> TEXT``, checked against that field alone (a check that
    involves other fields, such as warmup_steps < trial_steps, waits for the whole config).

    Raises:
        argparse.ArgumentTypeError: naming the value and what the field allows.
    """
    from pydantic import ValidationError

    from deepspeed_ppq.config import AutotuneConfig

    ann = AutotuneConfig.model_fields[name].annotation
    kind = _kind(ann)
    value: object = text
    if kind == "list":
        value = [x.strip() for x in text.split(",")]
    elif kind == "bool":
        value = text == "true"
    elif get_origin(ann) is Literal and isinstance(get_args(ann)[0], int) and text.strip().isdecimal():
        value = int(text)  # min_gradient_bits: the literal 4, not the string "4"
    try:
        AutotuneConfig.model_validate({name: value})
    except ValidationError as e:
        problems = [(f"item {err['loc'][1] + 1}: " if len(err["loc"]) > 1 else "")
                    + err["msg"].removeprefix("Value error, ")
                    for err in e.errors() if err["loc"][:1] == (name,)]
        if problems:
            raise argparse.ArgumentTypeError(f"{text!r}: {'; '.join(problems)}") from None
    except OverflowError:  # int(inf) in a size
        raise argparse.ArgumentTypeError(f"{text!r} is not finite: give a size such as '512MiB'") from None
    return value


def _checked(name: str):
    """argparse ``type`` of ``--<name>``: the text itself, once ``_setting_value`` accepts it."""
    def check(text: str) -> str:
        _setting_value(name, text)
        return text
    return check


def _budget_mb(text: str) -> float:
    try:
        mib = float(text)
    except ValueError:
        mib = math.nan
    if not (math.isfinite(mib) and mib * 2**20 >= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not a budget: give a finite number of MiB of at least "
                                         "one byte (2**-20 MiB), e.g. 512")
    return mib


def _nproc(text: str) -> int:
    if not text.strip().isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of ranks: give a positive integer, "
                                         "e.g. 2")
    return int(text)


def settings_flags(p: argparse.ArgumentParser) -> list[str]:
    """``--<field>`` for every scalar or list field of ``ppq.autotune`` (generated from the config).

    Each flag's value is checked as it is parsed (``_setting_value``); the codec lists have no flag.

    Returns:
        The names of the fields that got a flag (``dest`` is ``set_<name>``).
    """
    from deepspeed_ppq.config import AutotuneConfig

    names = []
    for name, f in AutotuneConfig.model_fields.items():
        kind = _kind(f.annotation)
        flag = "--" + name.replace("_", "-")
        if kind == "codec":
            continue
        if kind == "list":
            p.add_argument(flag, dest=f"set_{name}", type=_checked(name),
                           help=f"{f.description or name} (comma-separated)")
        elif kind == "bool":
            p.add_argument(flag, dest=f"set_{name}", choices=["true", "false"], help=f.description)
        else:
            p.add_argument(flag, dest=f"set_{name}", type=_checked(name), help=f.description)
        names.append(name)
    return names


def flag_overrides(ns, names: list[str]) -> dict:
    """The ``ppq.autotune`` settings the flags in ``ns`` give (``--budget-mb`` as ``memory_budget``)."""
    out = {name: _setting_value(name, getattr(ns, f"set_{name}")) for name in names
           if getattr(ns, f"set_{name}", None) is not None}
    if getattr(ns, "budget_mb", None) is not None:
        out["memory_budget"] = int(float(ns.budget_mb) * 2**20)
    return out


def _tuner_flags(p) -> list[str]:
    """Add the tuner's flags to ``p``; returns the ``ppq.autotune`` fields among them."""
    p.add_argument("--budget-mb", dest="budget_mb", type=_budget_mb, help="per-stage memory budget in MiB")
    p.add_argument("--nproc", type=_nproc, default=2, help="local ranks when not under a launcher")
    p.add_argument("--out", dest="out_dir", help="output folder (plan.json, report.md, tune.json)")
    return settings_flags(p)


def _tuner_args(ns) -> tuple[argparse.Namespace, list[str]]:
    """The tuner flags given before SCRIPT (parsed into ``ns``) and after it (in ``ns.rest``), and the
    script's own arguments. After SCRIPT a tuner flag wins over the same flag before it; it is matched
    whole (a script's ``--seed`` is not the tuner's ``--seeds``)."""
    after = argparse.ArgumentParser(prog="ppq tune", add_help=False, allow_abbrev=False)
    _tuner_flags(after)
    return after.parse_known_args(ns.rest, namespace=argparse.Namespace(**vars(ns)))


def _as_flags(ns, names: list[str]) -> list[str]:
    """The tuner flags set in ``ns`` as arguments (``--seeds=5``), for the ranks to parse again."""
    flags = {"budget_mb": "--budget-mb", "nproc": "--nproc", "out_dir": "--out",
             **{f"set_{n}": "--" + n.replace("_", "-") for n in names}}
    return [f"{flag}={getattr(ns, dest)}" for dest, flag in flags.items()
            if getattr(ns, dest, None) is not None]


def _run(ns) -> int:
    if not Path(ns.script).is_file():  # before any rank starts
        raise SystemExit(f"ppq tune: script {ns.script} does not exist")
    names = ns.setting_names
    mine, script_args = _tuner_args(ns)  # every flag is checked here, before any rank starts
    if "RANK" not in os.environ:
        return spawn_local(["tune", *_as_flags(mine, names), ns.script, *script_args], mine.nproc)
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
        "tune", allow_abbrev=False,
        help="tune your training script's pipeline: profile, plan, measure, check (the autotuner)",
        description="Run SCRIPT (your DeepSpeed training script, unmodified) under the tuner: its call to "
        "deepspeed_ppq.initialize hands the model, data and config (with its ppq.autotune section) to the "
        "tuner, which writes plan.json and report.md. Apply the plan with \"ppq\": {\"plan_file\": ...}. "
        "Tuner flags may stand before or after SCRIPT (after it, those spelled as below are the tuner's, "
        "the others go to the script). activation_codecs and gradient_codecs have no flag: set them in "
        "the JSON config's ppq.autotune section.")
    p.add_argument("script", help="your training script (it must call deepspeed_ppq.initialize)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the script's arguments and the tuner's flags")
    names = _tuner_flags(p.add_argument_group("tuner flags (override ppq.autotune)"))
    p.set_defaults(func=_run, setting_names=names)
