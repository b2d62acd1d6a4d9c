"""The two workloads of the demo and the autotune benchmarks: pipelines whose stages are bound by weight
memory, as an LLM's pipeline stages are.

* ``pretrain``: pre-training a deep, narrow GPT (12 blocks of width 256, 32-token sequences, the
  package's small GPT on stdlib text with a locally trained BPE). Weights, gradients and Adam states
  are most of a stage's memory; the candidates are master-free int8 weights (the codes are the only
  copy) and 8-bit optimizer states. The precision policy keeps the embeddings, the head and the norms
  high precision and lets every block go low-bit: also keeping the first and last block (the package's
  default) cost 13 MiB per stage for the same validation loss (at 92 and 72 MiB per stage the tuned
  plans measured 5.3647 with every block int8 and 5.3732 with the two kept, the baseline's 3 seeds
  5.34-5.40). The low-bit layers keep their inputs for the weight gradient as int8 codes
  (``weights.saved_input``): one stage of micro-batch 8 without recomputation measured 77.4 MiB with
  them, 89.1 without.
* ``finetune``: LoRA fine-tuning of the same GPT, pre-trained once (``examples/pretrain_gpt.py``,
  cached), on other text (stdlib files past the pretraining text). The base is frozen: its weights are
  nearly all of a stage's memory; the candidates are NF4 and int8 storage of the frozen base (QLoRA),
  against the stock baseline of the same LoRA fine-tune on the full-precision (fp32 or bf16) base.

Both run ``examples/train_gpt_pipe.py`` unmodified, on 2 ranks with a global batch of 16, and let the
tuner choose 1 or 2 pipeline stages (the other factor data parallel). ``settings(name, quick)`` gives a
workload's model arguments and ``ppq.autotune`` section; ``ds_config`` writes the DeepSpeed config.

Both sides train in the precision a DeepSpeed user would pick on the machine (``choose_precision``):
fp32, or DeepSpeed's bf16 mode where it trains faster. On a CPU that multiplies bf16 natively (AVX-512
BF16: AMD Zen 4/5; AMX: Intel Sapphire Rapids and later) a stock step of the pre-training workload ran
in about half the fp32 time (one stage, 2 ranks: 119.5 against 231.2 ms on Zen 5), and a baseline left
in fp32 there would not be the best stock configuration.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deepspeed_ppq.integrations.local_ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gpt_pipe.py"
PRETRAIN_SCRIPT = ROOT / "examples" / "pretrain_gpt.py"
GLOBAL_BATCH = 16


@dataclass
class Workload:
    """One workload: the example script's model arguments, the tuner's settings and its budget (MiB)."""

    name: str
    title: str
    model: list[str]
    weights: dict
    autotune: dict
    budget_mb: float
    lr: float
    pretrain_steps: int = 0
    train_steps: int = 20  # the demo's run with the plan


_MODEL = ["--n-layers", "12", "--d-model", "256", "--seq-len", "32"]
_QUICK_MODEL = ["--n-layers", "6", "--d-model", "128", "--seq-len", "32", "--max-bytes", "400000"]
_TUNE = {"trial_steps": 8, "warmup_steps": 2, "seeds": 3, "quality_steps": 60, "val_loss_tolerance": 0.03,
         "stock_trials": 3, "val_batches": 4, "profile_reps": 3, "max_iterations": 3,
         "pipeline_degrees": [1, 2], "ab_repeats": 2, "ladder": True}
_QUICK_TUNE = {"trial_steps": 4, "warmup_steps": 1, "seeds": 1, "stock_trials": 2, "val_batches": 2,
               "profile_reps": 2, "max_iterations": 2, "pipeline_degrees": [2], "ab_repeats": 1,
               "quality_steps": 4, "ladder": True}

WORKLOADS = {
    "pretrain": Workload(
        name="pretrain", title="pre-training a deep, narrow GPT", model=_MODEL,
        weights={"keep_first_blocks": 0, "keep_last_blocks": 0, "saved_input": "int8"},
        autotune={**_TUNE, "formats": ["int8"], "master_free": True, "optimizer_8bit": True},
        # the ladder's budget: in bf16 (Zen 5) the smallest where bf16 stock still fits (p=2, 4 x 4: 78.9
        # MiB), in fp32 one where stock must leave one stage (p=2, 4 x 4: 75.8 MiB; one stage 134 MiB)
        budget_mb=78, lr=1e-3),
    "finetune": Workload(
        name="finetune", title="LoRA fine-tuning of a pretrained GPT on other text", model=_MODEL,
        weights={"keep_first_blocks": 0, "keep_last_blocks": 0},
        # LoRA's validation loss is steady across seeds (a 0.2% spread after 40 steps): 30 quality steps
        # (the demo within 10 minutes on an AVX2 core), a 1% gate
        autotune={**_TUNE, "formats": ["nf4", "int8"], "master_free": False, "optimizer_8bit": True,
                  "quality_steps": 30, "val_loss_tolerance": 0.01},
        budget_mb=32, lr=2e-3, pretrain_steps=200),
}


def settings(name: str, quick: bool = False) -> Workload:
    """The workload ``name``; ``quick``: a smaller model and short trials (the tests)."""
    if name not in WORKLOADS:
        raise SystemExit(f"workload {name!r} is not one of {sorted(WORKLOADS)}")
    w = WORKLOADS[name]
    if not quick:
        return w
    return Workload(name=w.name, title=w.title, model=_QUICK_MODEL, weights=w.weights,
                    autotune={**_QUICK_TUNE, **{k: w.autotune[k] for k in ("formats", "master_free")}},
                    budget_mb=16 if name == "pretrain" else 12, lr=w.lr,
                    pretrain_steps=min(w.pretrain_steps, 20), train_steps=6)


def pretrained(w: Workload, log: Path | None = None) -> Path | None:
    """The workload's pretrained base (``examples/pretrain_gpt.py``), trained once and cached under the
    data cache (``PPQ_CACHE_DIR``); None for a workload trained from scratch."""
    if not w.pretrain_steps:
        return None
    from stdlib_text import cache_dir  # examples/stdlib_text.py (run_demo puts examples/ on sys.path)

    args = [*w.model, "--steps", str(w.pretrain_steps)]
    key = hashlib.sha256(json.dumps(args).encode()).hexdigest()[:12]
    path = cache_dir() / f"pretrained-gpt-{key}.pt"
    if not path.exists():
        print(f"pretraining the base once ({' '.join(args)}; cached as {path})", flush=True)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(log or os.devnull, "w") as f:
            subprocess.run([sys.executable, str(PRETRAIN_SCRIPT), *args, "--out", str(path)], check=True,
                           stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return path


def script_args(w: Workload, log: Path | None = None) -> list[str]:
    """The example script's arguments for the workload (pretraining the fine-tune's base if needed)."""
    base = pretrained(w, log)
    return [*w.model, *(["--finetune", str(base)] if base else [])]


def ds_config(out: Path, w: Workload, budget_mb: float, plan_file: str | None = None,
              autotune: dict | None = None, precision: str = "fp32") -> Path:
    """Write the workload's DeepSpeed config (with its ``ppq.autotune`` section, or the plan file);
    ``precision`` ``"bf16"`` turns on DeepSpeed's bf16 mode (``choose_precision``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not allowed: use one of {PRECISIONS}")
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "steps_per_print": 10,
        # DeepSpeed 0.19.8's pipeline engine clips every stage by stage 0's gradient norm, which would
        # make one stage and two stages train differently: the workloads train without clipping
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": w.lr}},
        "ppq": {"weights": dict(w.weights),
                "autotune": {**w.autotune, **(autotune or {}), "memory_budget": int(budget_mb * 2**20)}},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if plan_file:
        cfg["ppq"]["plan_file"] = plan_file
    suffix = "_bf16" if precision == "bf16" else ""
    path = out / f"{'ds_plan' if plan_file else 'ds_tune'}{suffix}.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


# The training precisions a DeepSpeed user sets in the config: fp32, or the bf16 mode (bf16 weights and
# compute, fp32 master weights in DeepSpeed's BF16_Optimizer).
PRECISIONS = ("fp32", "bf16")
PROBE_STEPS = 12  # steps of each precision's timing run (the script's median skips the first 2)
STOP_SLOWER = 1.5  # choose_precision(stop_slower=True) stops a run past this many times the first's


def choose_precision(w: Workload, model: list[str], out: Path,
                     stop_slower: bool = False) -> tuple[str, dict[str, float | None]]:
    """The precision a skilled DeepSpeed user trains the workload in on this machine: the faster of fp32
    and DeepSpeed's bf16 mode, measured. Each runs the example script's fastest stock configuration with
    no budget (one stage, data parallel over the 2 ranks, micro-batch 8, no recomputation: the stock
    search's pick at every precision in the recorded sweeps) for ``PROBE_STEPS`` steps; the median step
    times decide. Where the CPU multiplies bf16 natively (AVX-512 BF16, AMX) bf16 runs about twice as
    fast; elsewhere it is emulated and fp32 wins. Both sides of every comparison then train in it.

    ``stop_slower``: a run still going after ``STOP_SLOWER`` (k = 1.5) times the first one's whole run
    is stopped and loses (the demo's choice: emulated bf16 ran 23x slower than fp32 on an AVX2 CPU, 93 s
    against 23 s). Since both runs start the same way, its steps are then slower than the first's:
    ``k (S + n f) < S + n b`` for a start-up ``S`` and ``n`` steps of ``f`` and ``b`` seconds gives
    ``b > k f + (k - 1) S / n > f``; a start-up up to 50% slower than the first run's still stops only a
    slower run. (At k = 2 the stopped run took 55 of the demo's 579 s on that CPU, the first 29; at 1.5 it
    takes ~44.)

    Returns:
        The precision and each one's median step time in seconds (None: stopped, slower).
    """
    times: dict[str, float | None] = {}
    first_wall = None
    for p in PRECISIONS:
        limit = STOP_SLOWER * first_wall if stop_slower and first_wall is not None else None
        t0 = time.perf_counter()
        times[p] = timed_run(ds_config(out, w, 1 << 20, precision=p), model, ["--num-stages", "1"],
                             timeout=limit)
        first_wall = first_wall or time.perf_counter() - t0
    return min((p for p in times if times[p] is not None), key=times.get), times


def launch_cmd(cfg: Path, model: list[str], extra: list[str] = (), steps: int = PROBE_STEPS) -> list[str]:
    """The command that trains the example script on 2 ranks under the ``deepspeed`` launcher with
    DeepSpeed config ``cfg`` (a plan file in it sets the partition and batches) for ``steps`` steps."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
            str(free_port()), str(SCRIPT), "--deepspeed_config", str(cfg), *model, *extra,
            "--steps", str(steps)]


def script_env() -> dict[str, str]:
    """The environment the example script and ``ppq tune`` run in (the CPU accelerator unless another is
    set, this checkout on the path)."""
    return dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), PYTHONPATH=str(ROOT))


def timed_run(cfg: Path, model: list[str], extra: list[str] = (), steps: int = PROBE_STEPS,
              timeout: float | None = None) -> float | None:
    """The example script's median step time (seconds) from ``launch_cmd(cfg, model, extra, steps)``;
    None if it ran past ``timeout`` seconds (the launcher and its ranks are then stopped)."""
    # one intra-op thread per rank, as ``ppq tune``'s trials (2 ranks of 2 threads on 2 cores had slowed
    # the fp32 run 2.3x and the bf16 run hardly at all)
    env = script_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    # a session of its own, so that the launcher's rank processes can be stopped with it; the terminal's
    # Ctrl-C then no longer reaches them, so an interrupt stops them here too
    proc = subprocess.Popen(launch_cmd(cfg, model, extra, steps), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as e:  # the timeout, or an interrupt
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            return None
        raise
    found = re.search(r"step time: median ([0-9.]+) ms", stdout)
    if proc.returncode or found is None:
        raise SystemExit(f"the timing run with {cfg} failed (exit {proc.returncode}):\n"
                         + (stdout + stderr)[-3000:])
    return float(found.group(1)) / 1e3
