"""The main job: a stock DeepSpeed pipeline against the ppq-tuned one, on the small GPT, end to end.

``python -m deepspeed_ppq.demo`` (``make demo``) runs, on the stdlib text with the local BPE:

1. **baseline**: what a DeepSpeed user would configure for the per-stage memory budget: partition
   method ``parameters``, fp32 weights, no compression, the largest micro-batch that fits
   (activation checkpointing if needed), chosen from the same profile the tuner uses;
2. **tune**: profile, low-bit weights by the precision policy, codecs, a re-planned partition and
   micro-batches (``deepspeed_ppq.autotune``), written as a plan JSON;
3. **train both** with the ``deepspeed`` launcher (2 gloo ranks on CPU, NCCL on GPUs) on the same
   samples in the same order, measuring step time per instruction, bytes between stages, memory by
   category and validation loss;
4. **report**: ``report.md`` (throughput, bubble, per-stage memory predicted and measured, bytes between
   stages, validation loss and perplexity), ``trace.json`` (Perfetto: measured instructions per stage),
   ``loss.png``, ``timeline.png`` and ``memory.png`` in the output folder, whose path is printed.

Options: ``--quick`` (the test: a tiny model, a few steps), ``--scale N`` (N times the samples and a
wider model), ``--out DIR``, ``--budget-mb`` (per-stage memory budget). Each training run is
``python -m deepspeed_ppq.demo worker JOB.json`` under ``deepspeed --num_gpus 2 --module``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main", "demo_settings", "run_worker", "tune", "launch_run", "deepspeed_config_for"]

_COMPUTE = ("ForwardPass", "BackwardPass", "LoadMicroBatch", "OptimizerStep", "ReduceGrads",
            "ReduceTiedGrads")
_COMM = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")


# ------------------------------------------------------------------------------------------------
# Settings
# ------------------------------------------------------------------------------------------------
def demo_settings(quick: bool = False, scale: int = 1) -> dict:
    """Model, data and run sizes. ``quick``: the shortened test run; ``scale``: N x samples, wider model."""
    if scale < 1:
        raise ValueError(f"scale={scale} must be >= 1")
    if quick:
        model = {"vocab_size": 512, "seq_len": 64, "d_model": 128, "n_heads": 4, "n_layers": 4}
        return {"model": model, "stages": 2, "global_batch": 8, "train_steps": 6, "eval_batches": 2,
                "max_bytes": 400_000, "lr": 2e-3, "micro_batch_sizes": [1, 2, 4, 8], "seed": 0}
    d = 256 if scale == 1 else min(1024, 256 * int(round(math.sqrt(scale))))
    model = {"vocab_size": 512, "seq_len": 64, "d_model": d, "n_heads": max(4, d // 64), "n_layers": 8}
    return {"model": model, "stages": 2, "global_batch": 16, "train_steps": 60 * scale,
            "eval_batches": 8, "max_bytes": 2_000_000, "lr": 1e-3, "micro_batch_sizes": [1, 2, 4, 8, 16],
            "seed": 0}


# ------------------------------------------------------------------------------------------------
# Worker: one training run under the deepspeed launcher
# ------------------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed_instruction_map(engine, events: list, recording: list[bool]):
    """Wrap each instruction of the engine's schedule to record (name, start, end) per call."""
    def wrap(fn, name):
        def timed(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **kw)
            finally:
                if recording[0]:
                    events.append((name, t0, time.perf_counter()))
        return timed

    base = type(engine)._INSTRUCTION_MAP
    engine._INSTRUCTION_MAP = {cls: wrap(fn, cls.__name__) for cls, fn in base.items()}


def _micro_batches(dataset, order, micro: int):
    """Micro-batches of ``(input_ids, labels)`` following ``order`` (sample indices), forever."""
    import torch

    i = 0
    while True:
        idx = [int(order[(i + k) % len(order)]) for k in range(micro)]
        xs, ys = zip(*(dataset[j] for j in idx))
        i += micro
        yield torch.stack(xs), torch.stack(ys)


def run_worker(job_path: str) -> int:
    """One training run (one rank). The job JSON names the DeepSpeed config, sizes and the result file."""
    import deepspeed
    import torch
    import torch.distributed as tdist

    from deepspeed_ppq.config import load_ppq_config
    from deepspeed_ppq.data import build_token_datasets
    from deepspeed_ppq.integrations.deepspeed import initialize
    from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule
    from deepspeed_ppq.models import GPTConfig, gpt_layers, gpt_loss

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu"
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank = tdist.get_rank()
    ds_cfg = json.loads(Path(job["ds_config"]).read_text())
    ppq = load_ppq_config(ds_cfg.get("ppq"))
    cfg = GPTConfig(**job["model"])
    train, val, _ = build_token_datasets(seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                                         max_bytes=job["max_bytes"])
    rss0 = _rss_bytes()
    # The tuned plan recomputes per stage (``pipeline.recompute_stages``, applied by ``initialize``);
    # the stock baseline uses DeepSpeed's own ``activation_checkpoint_interval`` (all stages alike).
    listed = ds_cfg.get("pipeline", {}).get("recompute_stages")  # stage indices, as the plan writes them
    # one flag per stage (initialize reads an empty index list as a malformed flag list)
    recompute = None if listed is None else [s in listed for s in range(job["stages"])]
    pipe = ds_cfg.get("pipeline", {})
    ckpt = 0 if listed is not None else int(pipe.get("activation_checkpoint_interval", 0))
    # from_config applies ppq.weights to this stage's Linear layers (global block indices).
    module = PPQPipelineModule.from_config(gpt_layers(cfg, job["seed"]), job["stages"], ds_cfg,
                                           loss_fn=gpt_loss, activation_checkpoint_interval=ckpt,
                                           checkpointable_layers=["BlockPipe"])  # not the embedding
    from deepspeed_ppq.quant import build_optimizer

    params = [p for p in module.parameters() if p.requires_grad]
    opt = build_optimizer(params, "adamw8bit" if ppq.weights.optimizer_8bit else "adamw", lr=job["lr"])
    # initialize: per-stage recompute from the config, re-quantization after every optimizer step.
    # initialize also attaches the update of master-free low-bit layers (no fp32 copy) on every rank.
    engine, _, _, _ = initialize(model=module, optimizer=opt, config=ds_cfg, recompute_stages=recompute)
    events: list = []
    recording = [False]
    _timed_instruction_map(engine, events, recording)

    mb = engine.train_micro_batch_size_per_gpu()
    gen = torch.Generator().manual_seed(job["seed"])
    order = torch.randperm(len(train), generator=gen)
    data = _micro_batches(train, order, mb)
    steps, losses, step_times = job["train_steps"], [], []
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc=f"train {job['name']}", unit="step", file=sys.stdout)
    t_all = time.perf_counter()
    trace_from = max(1, steps - 3)
    for step in range(steps):
        recording[0] = step >= trace_from
        t0 = time.perf_counter()
        loss = engine.train_batch(data)
        step_times.append(time.perf_counter() - t0)
        if step == trace_from - 1:
            events.clear()
        losses.append(float(loss))
        if bar:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    train_s = time.perf_counter() - t_all
    recording[0] = False
    if bar:
        bar.close()
    stats = engine.ppq_stats(all_stages=True)

    # Validation: the same held-out windows for every run, in micro-batches of the run's size.
    n_val = min(len(val), job["eval_batches"] * job["global_batch"])
    vdata = _micro_batches(val, torch.arange(n_val), mb)
    val_losses = []
    for _ in range(max(1, n_val // (mb * engine.micro_batches))):
        val_losses.append(float(engine.eval_batch(vdata)))
    val_loss = sum(val_losses) / len(val_losses)

    from deepspeed_ppq.quant import measure_storage

    ledger = measure_storage(engine)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stage = engine.stage_id
    measured_after_warmup = step_times[1:] or step_times
    per_instr: dict[str, float] = {}
    n_traced = steps - trace_from
    for name, a, b in events:
        per_instr[name] = per_instr.get(name, 0.0) + (b - a) / max(1, n_traced)
    t_base = events[0][1] if events else 0.0
    result = {
        "name": job["name"], "rank": rank, "stage": stage, "micro_batch": mb,
        "micro_batches": engine.micro_batches, "global_batch": engine.train_batch_size(),
        "parts": [int(x) for x in module.parts], "losses": losses, "step_times": step_times,
        "step_time_median": sorted(measured_after_warmup)[len(measured_after_warmup) // 2],
        "train_seconds": train_s, "val_loss": val_loss,
        "per_instruction_s": per_instr,
        "events": [(n, a - t_base, b - t_base) for n, a, b in events],
        "memory": {"ledger": ledger.to_dict(), "rss_before_model": rss0, "peak_rss": peak_rss},
        "wire": {f"{b}.{d}": v for (b, d), v in stats.items()},
        "recomputed_layers": list(getattr(module, "ppq_recomputed", [])),
        "master_free_layers": sum(bool(getattr(m, "master_free", False)) for m in module.modules()),
        "weight_formats": sorted({type(m).__name__ + ":" + str(getattr(m, "format", "")).split(".")[-1]
                                  for m in module.modules() if type(m).__name__ == "QuantLinear"}),
    }
    out = Path(job["result_dir"]) / f"rank{rank}.json"
    out.write_text(json.dumps(result, default=float))
    tdist.barrier()
    return 0


# ------------------------------------------------------------------------------------------------
# Orchestrator
# ------------------------------------------------------------------------------------------------
def launch_run(job: dict, out: Path, log) -> list[dict]:
    """Run one job under ``deepspeed --num_gpus <stages> --module deepspeed_ppq.demo worker``."""
    job_path = out / f"job_{job['name']}.json"
    res_dir = out / f"result_{job['name']}"
    if res_dir.exists():
        shutil.rmtree(res_dir)
    res_dir.mkdir(parents=True)
    job = {**job, "result_dir": str(res_dir)}
    job_path.write_text(json.dumps(job, indent=1))
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
    port = _free_port()
    cmd = [launcher, "--num_gpus", str(job["stages"]), "--master_port", str(port), "--module",
           "deepspeed_ppq.demo", "worker", str(job_path)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    print(f"$ {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        log.write(line)
        if "train " in line and "step" in line or "Traceback" in line or "Error" in line:
            sys.stdout.write(line.replace("\r", "\n").splitlines()[-1] + "\r" if "%" in line else line)
            sys.stdout.flush()
    code = proc.wait()
    _remove_shm_buffers(port)
    if code != 0:
        raise RuntimeError(f"training run {job['name']!r} failed (exit {proc.returncode}); see {log.name}")
    print()
    return [json.loads((res_dir / f"rank{r}.json").read_text()) for r in range(job["stages"])]


def _remove_shm_buffers(port: int) -> None:
    """Delete the shared-memory all-reduce buffers DeepSpeed's CPU backend leaves in /dev/shm (two of
    ~66 MiB per job, named by the master port; nothing removes them, and on a small machine they fill
    the RAM-backed /dev/shm run after run)."""
    import glob

    for f in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.remove(f)
        except OSError:
            pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# Tune: the autotuner's profiler and planner (baseline and tuned plan from one profile)
# ------------------------------------------------------------------------------------------------
_ACT_CODECS = [{"method": "none"}, {"method": "quant", "bits": 8, "granularity": "token"},
               {"method": "quant", "bits": 4, "granularity": "token"}]  # >= 4 bits: the quality bound
_GRAD_CODECS = [{"method": "none"}, {"method": "quant", "bits": 8, "granularity": "token"}]  # >= 8 bits


def _policy_linear_formats(layers, kinds, weights, plan) -> dict[str, str]:
    """Linear name (``"3.attn.qkv"``) -> format: the precision policy's decision inside every layer
    the plan puts in a low-bit format (the worker converts exactly these)."""
    import copy

    from torch import nn

    from deepspeed_ppq.quant import plan as policy_plan

    shadow = nn.Sequential(*[copy.deepcopy(layer).to("meta") for layer in layers])  # names "0", "1", ...
    blocks = [i for i, k in enumerate(kinds) if k == "block"]
    out = {}
    for fmt in {f for f in plan.layer_formats if f != "none"}:
        cfg = weights.model_copy(update={"format": fmt})
        for d in policy_plan(shadow, cfg, block_layers=blocks, num_blocks=len(blocks)):
            layer = int(d.name.split(".", 1)[0])
            if plan.layer_formats[layer] == fmt and d.format.value != "none":
                out[d.name] = d.format.value
    return out


def tune(settings: dict, budget_mb: float | None, out: Path) -> dict:
    """Profile (``deepspeed_ppq.autotune.profiler``), then plan the baseline and the tuned pipeline
    (``autotune.planner``) under one per-stage budget; writes the plans and the profile to ``out``.

    Every layer is timed at each candidate micro-batch size in each weight format the
    default precision policy allows (int8; the embedding, the head and the outer blocks stay fp32),
    with one thread as each pipeline rank runs; the codecs within the quality bounds (activations
    >= 4 bits, gradients >= 8 bits) are timed on a boundary-shaped tensor.
    """
    import torch

    from deepspeed_ppq.autotune import profiler
    from deepspeed_ppq.autotune.costs import LinkModel
    from deepspeed_ppq.autotune.planner import PlanningProblem, baseline_plan, plan_pipeline
    from deepspeed_ppq.config import WeightsConfig
    from deepspeed_ppq.data import build_token_datasets
    from deepspeed_ppq.models import GPTConfig, gpt_layers, gpt_loss, layer_kinds

    torch.set_num_threads(1)
    cfg = GPTConfig(**settings["model"])
    layers, kinds = gpt_layers(cfg, settings["seed"]), layer_kinds(cfg)
    train, _, _ = build_token_datasets(seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                                       max_bytes=settings["max_bytes"])

    def make_batch(b: int):
        xs, ys = zip(*(train[i] for i in range(b)))
        return torch.stack(xs), torch.stack(ys)

    weights = WeightsConfig()
    mbs = settings["micro_batch_sizes"]
    # every candidate size: per-sample cost is far from linear in the micro-batch on a CPU
    profiles = profiler.profile_layers(layers, kinds, make_batch, gpt_loss, weights, ["int8"], mbs,
                                       reps=3, device="cpu")
    codecs = profiler.profile_codecs(_ACT_CODECS, (mbs[-1], cfg.seq_len, cfg.d_model), reps=3)
    by_cfg = {json.dumps(c.as_dict, sort_keys=True): c for c in codecs}
    grads = [by_cfg[json.dumps(c, sort_keys=True)] for c in _GRAD_CODECS]
    from deepspeed_ppq.autotune.loop import master_free_supported

    # master-free int8 (the codes are the only weight copy) is what frees memory on an fp32 CPU run
    prob = PlanningProblem(layers=profiles, world_size=settings["stages"],
                           global_batch=settings["global_batch"], micro_batch_sizes=mbs,
                           pipeline_degrees=[settings["stages"]], activation_codecs=codecs,
                           gradient_codecs=grads, optimizer_8bit=[False, True],
                           master_free=[False, True] if master_free_supported() else [False],
                           link=LinkModel())
    budget_note = "given with --budget-mb"
    if budget_mb is None:
        free = baseline_plan(prob, "parameters", settings["stages"])
        budget = int(0.75 * max(s.peak_memory for s in free.stages))
        budget_note = ("75% of the largest stage of the unconstrained baseline "
                       f"(micro-batch {free.micro_batch_size}); set it with --budget-mb")
    else:
        budget = int(budget_mb * 2**20)
    prob.memory_budget = budget
    base = baseline_plan(prob, "parameters", settings["stages"])
    tuned = plan_pipeline(prob)
    tuned.linear_formats = _policy_linear_formats(layers, kinds, weights, tuned)
    base.save(out / "plan_baseline.json")
    tuned.save(out / "plan_tuned.json")
    (out / "profile.json").write_text(json.dumps([p.to_dict() for p in profiles], indent=1))
    return {"budget": budget, "budget_note": budget_note, "baseline": base, "tuned": tuned}


def deepspeed_config_for(plan, baseline: bool) -> dict:
    """The DeepSpeed config JSON that runs ``plan`` (``baseline``: stock DeepSpeed partitioning)."""
    cfg = plan.deepspeed_config()
    cfg["steps_per_print"] = 10**6
    if baseline:  # stock DeepSpeed: its own 'parameters' partition and checkpointing, fp32, no codecs
        cfg["ppq"] = {"partition": {"method": "parameters"}}
        cfg["pipeline"].pop("recompute_stages", None)
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    launched = [a for a in argv if not a.startswith("--local_rank")]  # the launcher adds --local_rank=N
    if launched and launched[0] == "worker":
        rest = launched[1:]
        if len(rest) != 1:
            raise SystemExit(f"usage: python -m deepspeed_ppq.demo worker JOB.json (got {argv[1:]})")
        return run_worker(rest[0])
    p = argparse.ArgumentParser(prog="python -m deepspeed_ppq.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, a few steps (the test)")
    p.add_argument("--scale", type=int, default=1, help="N x the samples and a wider model")
    p.add_argument("--out", default=None, help="output folder (default: demo_out/<date-time>)")
    p.add_argument("--budget-mb", type=float, default=None, help="per-stage memory budget in MiB")
    a = p.parse_args(argv)
    if a.scale < 1:
        p.error(f"--scale={a.scale}: must be >= 1")
    if a.budget_mb is not None and a.budget_mb <= 0:
        p.error(f"--budget-mb={a.budget_mb}: must be > 0")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _has_gpu() else "cuda")
    settings = demo_settings(a.quick, a.scale)
    out = Path(a.out or Path("demo_out") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    from tqdm import tqdm

    from deepspeed_ppq.data import build_token_datasets

    with tqdm(total=4, desc="demo", unit="phase", file=sys.stdout) as phases:
        phases.set_postfix_str("data + tokenizer")
        m = settings["model"]
        build_token_datasets(seq_len=m["seq_len"], vocab_size=m["vocab_size"],
                             max_bytes=settings["max_bytes"])
        phases.update(1)
        phases.set_postfix_str("profile + plan (ppq tune)")
        tuned = tune(settings, a.budget_mb, out)
        phases.update(1)
        runs = {}
        with open(out / "train.log", "w") as log:
            for name in ("baseline", "tuned"):
                phases.set_postfix_str(f"train {name}")
                plan = tuned[name]
                ds = deepspeed_config_for(plan, baseline=name == "baseline")
                (out / f"ds_{name}.json").write_text(json.dumps(ds, indent=1))
                job = {"name": name, "ds_config": str(out / f"ds_{name}.json"), **settings}
                runs[name] = launch_run(job, out, log)
                phases.update(1)
    from deepspeed_ppq.plots import write_outputs

    report = write_outputs(out, settings, tuned, runs, time.perf_counter() - t_start)
    print(report)
    print(f"\nppq demo: report, trace and plots in {out}")
    return 0


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


if __name__ == "__main__":
    sys.exit(main())
