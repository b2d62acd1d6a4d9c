"""Rank script: the autotuner on models the package does not ship, then the plan in a fresh run.

Usage (through tests/dist_utils.run_ranks, 2 ranks): ``tune_user_model.py <model> <out dir>`` with
``<model>`` one of

* ``gpt_tied``: a GPT-like ``PipelineModule`` written here: a tied token embedding (``TiedLayerSpec``:
  the same module embeds the tokens and, through ``forward_fn``, computes the logits), learned
  positions, six pre-norm transformer blocks, a final norm. It is tuned twice: once without a budget,
  then with a budget below the best stock configuration's measured peak, which that configuration
  cannot meet;
* ``cnn``: a CNN of uneven conv blocks (channels 8 -> 16 -> 32 -> 64, strides 1 and 2), a pooling
  layer and a classifier, on generated images; tuned with a budget, plus the error cases: a budget below
  every plan, a one-layer model.

After each tuning, the plan is applied in a fresh ``PipelineModule`` built with DeepSpeed's own
``uniform`` partition (``deepspeed_ppq.initialize(..., plan=...)``), which trains 4 steps; the last
two run under the memory tracker. Each rank writes the plan, the tuning result's summary and the fresh
run's measured peak, boundaries and losses.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.engine import DeepSpeedEngine
from dist_utils import write_result
from torch import nn

import deepspeed_ppq
from deepspeed_ppq.autotune.memory import StageMemTracker
from deepspeed_ppq.autotune.planner import InfeasibleBudgetError
from deepspeed_ppq.config import PPQConfigError

V, T, D = 96, 32, 64


class TokenEmbedding(nn.Embedding):
    def __init__(self):
        super().__init__(V, D)


class AddPosition(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(T, D) * 0.02)

    def forward(self, x):
        return x + self.pos


def tied_logits(embedding: TokenEmbedding, h):
    return h @ embedding.weight.t()


class Block(nn.Module):
    def __init__(self, heads: int = 4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


class Tokens(torch.utils.data.Dataset):
    """Sequences with a rule to learn: each token is the previous one plus a per-sequence step."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, V, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.seq = (start + step * torch.arange(T + 1)) % V

    def __len__(self):
        return len(self.seq)

    def __getitem__(self, i):
        return self.seq[i, :-1], self.seq[i, 1:]


def gpt_tied_specs():
    return [TiedLayerSpec("embed", TokenEmbedding), LayerSpec(AddPosition),
            *[LayerSpec(Block) for _ in range(6)], LayerSpec(nn.LayerNorm, D),
            TiedLayerSpec("embed", TokenEmbedding, forward_fn=tied_logits)]


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
        self.norm = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.norm(self.conv(x)))


class Pool(nn.Module):
    def forward(self, x):
        return x.mean(dim=(2, 3))


class Images(torch.utils.data.Dataset):
    """Ten classes of oriented gratings with noise (nothing downloaded)."""

    def __init__(self, n: int, size: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 10, (n,), generator=g)
        yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
        angle = self.y.float()[:, None, None] * 0.314
        wave = torch.sin(0.8 * (xx * torch.cos(angle) + yy * torch.sin(angle)))
        self.x = wave[:, None].repeat(1, 3, 1, 1) + 0.3 * torch.randn(n, 3, size, size, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def cnn_specs():
    return [LayerSpec(ConvBlock, 3, 8, 1), LayerSpec(ConvBlock, 8, 16, 2), LayerSpec(ConvBlock, 16, 32, 1),
            LayerSpec(ConvBlock, 32, 64, 2), LayerSpec(ConvBlock, 64, 64, 1), LayerSpec(Pool),
            LayerSpec(nn.Linear, 64, 10)]


def ds_config(out: str, budget: int | None, **autotune) -> dict:
    return {
        "train_batch_size": 8,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
        "ppq": {
            "weights": {"keep_first_blocks": 1, "keep_last_blocks": 1},
            "autotune": {"memory_budget": budget, "trial_steps": 4, "warmup_steps": 1, "seeds": 1,
                         "stock_trials": 2, "val_batches": 2, "profile_reps": 2, "max_iterations": 2,
                         "pipeline_degrees": [2], "micro_batch_sizes": [1, 2, 4], "formats": ["int8"],
                         "ab_repeats": 0,
                         "quality_steps": 4,
                         "out_dir": out, **autotune},
        },
    }


def fresh_run(specs, loss, data, config: dict, plan_path: str) -> dict:
    """The plan applied to a stock PipelineModule built with DeepSpeed's uniform partition."""
    model = PipelineModule(layers=specs, num_stages=2, loss_fn=loss, partition_method="uniform")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    engine, _, _, _ = deepspeed_ppq.initialize(model=model, optimizer=optimizer, config=config,
                                               plan=plan_path)
    b, m = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    order = list(range(len(data)))

    def batches(k):
        return [tuple(torch.stack(z) for z in zip(*[data[order[(k * b * m + i * b + j) % len(data)]]
                                                    for j in range(b)])) for i in range(m)]

    losses = []
    for k in range(2):
        losses.append(engine.train_batch(iter(batches(k))))
    tracker = StageMemTracker()
    tracker.track_external(engine.module, engine.optimizer)
    with tracker:
        for k in range(2, 4):
            losses.append(engine.train_batch(iter(batches(k))))
    return {"peak": tracker.peak(), "parts": list(engine.module.parts), "micro_batch": b, "micro_batches": m,
            "losses": [float(x) for x in losses if x is not None],
            "optimizer": type(engine.optimizer).__name__}


def summary(result_dir: str) -> dict:
    data = json.loads(open(os.path.join(result_dir, "tune.json")).read())
    return {"baseline_peak": data["baseline"]["run"]["peak_memory"], "outcome": data["outcome"],
            "accepted": data["accepted"], "stock_measured": len(data["stock"]["measured"]),
            "iterations": len(data["iterations"]),
            "memory": [[st["predicted_memory_total"], st["measured_memory"]["total"]]
                       for st in data["baseline"]["run"]["stages"]]}


def _group_count() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


def main() -> None:
    model_name, out = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    result = {}
    if model_name == "gpt_tied":
        specs, loss, data, val = gpt_tied_specs(), lm_loss, Tokens(256), Tokens(64, seed=1)
        free = os.path.join(out, "free")
        model = PipelineModule(layers=specs, num_stages=2, loss_fn=loss, partition_method="parameters")
        deepspeed_ppq.autotune(model, None, data, val, ds_config(free, None))
        result["free"] = summary(free)
        budget = int(result["free"]["baseline_peak"] * 0.9)
        runs = [("tight", budget)]
    else:
        specs, loss, data, val = cnn_specs(), nn.CrossEntropyLoss(), Images(256), Images(64, seed=1)
        runs = [("tight", 3 << 20)]
        # error cases: nothing fits; too few layers for the stages
        try:
            deepspeed_ppq.autotune(PipelineModule(layers=specs, num_stages=2, loss_fn=loss), None, data, val,
                                   ds_config(os.path.join(out, "none"), 1 << 16))
            result["tiny_budget"] = "no error"
        except (InfeasibleBudgetError, RuntimeError) as e:
            result["tiny_budget"] = f"{type(e).__name__}: {e}"
        try:
            deepspeed_ppq.autotune([nn.Linear(4, 4)], nn.MSELoss(), data, val, ds_config(out, None))
            result["one_layer"] = "no error"
        except PPQConfigError as e:
            result["one_layer"] = str(e)
    for name, budget in runs:
        d = os.path.join(out, name)
        config = ds_config(d, budget)
        model = PipelineModule(layers=specs, num_stages=2, loss_fn=loss)
        groups = _group_count()
        plan = deepspeed_ppq.autotune(model, None, data, val, config)
        result[name] = summary(d)
        # what the tuning left behind: its trials' process groups and watchdog threads
        result[name]["groups_added"] = _group_count() - groups
        result[name]["watchdog_threads"] = sum(t.name.startswith("ppq-watchdog") for t in threading.enumerate())
        gc.collect()
        result[name]["engines_alive"] = sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects())
        result[name]["budget"] = budget
        result[name]["plan"] = plan.to_dict()
        result[name]["fresh"] = fresh_run(specs, loss, data, config, os.path.join(d, "plan.json"))
    write_result(result)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
