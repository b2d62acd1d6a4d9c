"""Rank script: every plan is validated on the same samples, whatever its pipeline degree and
micro-batches (2 ranks: one stage with 2 data-parallel replicas, or two stages).

A small GPT's DeepSpeed runner trains each plan with a learning rate of 0, so the weights stay the
initial ones and the validation losses of the plans must be equal; ``ppq tune`` then compares plans'
quality on equal terms. Each rank writes ``{"losses": {plan: val loss}}``.
"""

from __future__ import annotations

import deepspeed
import torch
from dist_utils import write_result

from deepspeed_ppq.autotune.loop import build_problem
from deepspeed_ppq.autotune.planner import stock_plan
from deepspeed_ppq.config import load_ppq_config
from deepspeed_ppq.integrations.autotune import DeepSpeedRunner
from deepspeed_ppq.models.gpt import GPTConfig, gpt_layers, gpt_loss

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.t = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, i: int):
        return self.t[i, :-1], self.t[i, 1:]


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    ds_config = {"train_batch_size": 8, "steps_per_print": 10**6, "gradient_clipping": 0.0,
                 "optimizer": {"type": "Adam", "params": {"lr": 0.0}},
                 "ppq": {"autotune": {"trial_steps": 2, "warmup_steps": 1, "val_batches": 2,
                                      "profile_reps": 1, "micro_batch_sizes": [1, 2, 4]}}}
    settings = load_ppq_config(ds_config["ppq"]).autotune
    runner = DeepSpeedRunner(gpt_layers(CFG), gpt_loss, Tokens(32, 0), Tokens(16, 1), ds_config)
    problem = build_problem(settings, 2, 8, runner.profile(settings))
    plans = {"p1 2x2": stock_plan(problem, [0, 6], 2, False, False, "p1"),
             "p1 4x1": stock_plan(problem, [0, 6], 4, False, False, "p1"),
             "p2 1x8": stock_plan(problem, [0, 3, 6], 1, False, False, "p2"),
             "p2 4x2 recompute": stock_plan(problem, [0, 2, 6], 4, True, False, "p2")}
    write_result({"losses": {name: runner.run_trial(plan, settings).val_loss
                             for name, plan in plans.items()}})


if __name__ == "__main__":
    main()
