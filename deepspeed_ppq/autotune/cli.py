"""``ppq tune``: profile, plan, run and check a pipeline on local ranks (or under a launcher).

Under ``torchrun``/``deepspeed`` (``RANK`` set) every rank runs the loop; otherwise ``--nproc`` local
gloo processes are started (one thread each, ``DS_ACCELERATOR=cpu`` unless CUDA is usable)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path

__all__ = ["add_parser", "spec_from_args", "spec_fields_from_config", "spawn_local", "CONFIG_TO_SPEC"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(argv: list[str], nproc: int, timeout: float = 3600) -> int:
    """Run ``python -m deepspeed_ppq.cli <argv>`` on ``nproc`` local ranks; returns the exit code."""
    port = _free_port()
    procs = []
    for r in range(nproc):
        env = dict(os.environ)
        env.update(
            RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        )
        env.setdefault("DS_ACCELERATOR", "cpu")
        procs.append(subprocess.Popen([sys.executable, "-m", "deepspeed_ppq.cli", *argv], env=env))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(124)
    if any(codes):
        for p in procs:
            if p.poll() is None:
                p.kill()
    return max(codes, key=abs)


def _codec_dict(c) -> dict:
    """A ``CodecConfig`` as the short dict the planner keys codecs by: ``method`` plus non-defaults."""
    return {"method": c.method, **c.model_dump(mode="json", exclude_defaults=True)}


# every ``AutotuneConfig`` field -> (``TuneSpec`` field, conversion); ``None`` values are left unset
CONFIG_TO_SPEC = {
    "memory_budget_gb": ("memory_budget", lambda v: int(v * 2**30)),
    "val_loss_tolerance": ("val_loss_tolerance", None),
    "max_iterations": ("max_iterations", None),
    "trial_steps": ("trial_steps", None),
    "micro_batch_sizes": ("micro_batch_sizes", list),
    "schedules": ("schedules", list),
    "allow_recompute": ("allow_recompute", None),
    "min_gradient_bits": ("min_gradient_bits", None),
    "min_activation_bits": ("min_activation_bits", None),
    "profile_cache": ("profile_cache", None),
    "formats": ("formats", lambda v: [getattr(f, "value", f) for f in v]),
    "master_free": ("master_free", None),
    "activation_codecs": ("activation_codecs", lambda v: [_codec_dict(c) for c in v]),
    "gradient_codecs": ("gradient_codecs", lambda v: [_codec_dict(c) for c in v]),
    "pipeline_degrees": ("pipeline_degrees", list),
    "optimizer_8bit": ("optimizer_8bit", None),
    "global_batch": ("global_batch", None),
}


def spec_fields_from_config(config) -> dict:
    """``TuneSpec`` fields from a ``"ppq"`` config (a ``PPQConfig``, dict, JSON path or whole DeepSpeed
    config): every ``ppq.autotune`` field (``CONFIG_TO_SPEC``) plus ``ppq.weights`` as the precision
    policy (its ``format`` is left out: the candidates are ``autotune.formats``)."""
    from deepspeed_ppq.config import load_ppq_config

    ppq = load_ppq_config(config)
    d = {"weights": ppq.weights.model_dump(mode="json", exclude={"format"})}
    for name, (target, conv) in CONFIG_TO_SPEC.items():
        v = getattr(ppq.autotune, name)
        if v is not None:
            d[target] = conv(v) if conv else v
    return d


def spec_from_args(args):
    """A ``TuneSpec`` from a ``"ppq"`` config's ``autotune`` section, then ``--spec`` (JSON file) over
    it, then flags over both."""
    from deepspeed_ppq.autotune.loop import TuneSpec

    d: dict = {}
    if args.config:
        d.update(spec_fields_from_config(args.config))
    if args.spec:
        d.update(json.loads(Path(args.spec).read_text()))
    for name in ("global_batch", "out_dir"):
        v = getattr(args, name, None)
        if v is not None:
            d[name] = v
    if args.budget_mb is not None:
        d["memory_budget"] = int(args.budget_mb * 2**20)
    if args.formats:
        d["formats"] = args.formats.split(",")
    if args.model:
        model = dict(d.get("model", TuneSpec().model))
        for kv in args.model:
            k, _, v = kv.partition("=")
            model[k] = int(v)
        d["model"] = model
    known = {f.name for f in fields(TuneSpec)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise SystemExit(f"ppq tune: unknown spec field(s) {unknown}; allowed: {sorted(known)}")
    return TuneSpec(**d)


def _run(args) -> int:
    if "RANK" not in os.environ:
        argv = [a for a in sys.argv[1:]] if args.argv is None else args.argv
        return spawn_local(argv, args.nproc)
    import deepspeed
    import torch

    from deepspeed_ppq.autotune.loop import run_tuning

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    spec = spec_from_args(args)
    result = run_tuning(spec)
    if result is not None:
        print(f"[ppq tune] wrote {spec.out_dir}/plan.json and {spec.out_dir}/report.md", flush=True)
        print(json.dumps({"spec": asdict(spec)["out_dir"], "accepted": result["accepted"]}))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="profile, plan, run and check a pipeline plan (the autotuner)")
    p.add_argument("--config", help="DeepSpeed/ppq JSON config whose ppq.autotune section sets the limits")
    p.add_argument("--spec", help="JSON file of TuneSpec fields (model, budget, candidates, ...)")
    p.add_argument(
        "--model", nargs="*", metavar="KEY=INT", help="GPTConfig fields, e.g. n_layers=4 d_model=128"
    )
    p.add_argument("--global-batch", dest="global_batch", type=int)
    p.add_argument("--budget-mb", dest="budget_mb", type=float, help="per-stage memory budget in MiB")
    p.add_argument("--formats", help="comma-separated low-bit weight formats, e.g. int8,nf4")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to start when not under a launcher")
    p.add_argument("--out", dest="out_dir", help="output folder (plan.json, report.md, tune.json)")
    p.set_defaults(func=_run, argv=None)
