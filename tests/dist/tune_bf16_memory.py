"""Rank script: a trial of DeepSpeed's bf16 mode measures what its BF16_Optimizer holds (2 ranks, one
stage with 2 data-parallel replicas).

The wrapper allocates its fp32 master weights and fp32 gradient buffer when the engine is built, before
the memory tracker starts; the runner hands them to the tracker (``_wrapper_tensors``). Each rank writes
the stage's measured peak by category and the stage's parameter count, for the fp32 run and the bf16 run
of the same stock plan (fp32 Adam), with what the memory model predicted (the profile measured in the
run's dtype; ``PlanningProblem.bf16_mode``).
"""

from __future__ import annotations

import dataclasses

import deepspeed
import torch
from dist_utils import write_result
from tune_same_validation import CFG as SAME_CFG
from tune_same_validation import Tokens

from deepspeed_ppq.autotune.loop import build_problem
from deepspeed_ppq.autotune.memory import coarse
from deepspeed_ppq.autotune.planner import stock_plan
from deepspeed_ppq.config import load_ppq_config
from deepspeed_ppq.integrations.autotune import DeepSpeedRunner
from deepspeed_ppq.models.gpt import gpt_layers, gpt_loss

# the data of tune_same_validation.py (its Tokens: that script's vocabulary and sequence length), a wider model
CFG = dataclasses.replace(SAME_CFG, d_model=64)


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    out = {"params": sum(p.numel() for layer in gpt_layers(CFG) for p in layer.parameters())}
    for precision in ("fp32", "bf16"):
        ds_config = {"train_batch_size": 8, "steps_per_print": 10**6, "gradient_clipping": 0.0,
                     "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                     "ppq": {"autotune": {"trial_steps": 2, "warmup_steps": 1, "val_batches": 2,
                                          "profile_reps": 1, "micro_batch_sizes": [4]}}}
        if precision == "bf16":
            ds_config["bf16"] = {"enabled": True}
        settings = load_ppq_config(ds_config["ppq"]).autotune
        runner = DeepSpeedRunner(gpt_layers(CFG), gpt_loss, Tokens(32, 0), Tokens(16, 1), ds_config)
        problem = build_problem(settings, 2, 8, runner.profile(settings))
        plan = stock_plan(problem, [0, 6], 4, False, False, "p1")
        trial = runner.run_trial(plan, settings)
        out[precision] = {"memory": trial.stages[0].memory, "val_loss": trial.val_loss,
                          "predicted": coarse(plan.stages[0].memory), "bf16_mode": problem.bf16_mode,
                          "predicted_total": plan.stages[0].peak_memory}
    write_result(out)


if __name__ == "__main__":
    main()
