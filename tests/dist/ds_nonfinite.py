"""Rank script: NaN/Inf injected at every phase of training, for every codec, on 2 real gloo ranks.

Usage (through tests/dist_utils.run_ranks): ``ds_nonfinite.py <cases.json>``. The pipeline is
``[Linear, Tanh, ActPoison | GradPoison, Linear, Tanh, Linear]`` cut after ``ActPoison``: ``ActPoison``
(last layer of stage 0) puts an Inf into the activation of the first micro-batch once armed;
``GradPoison`` (first layer of stage 1) puts a NaN into the gradient sent back to stage 0 once armed
(stage 1's own parameter gradients stay finite, so only the all-reduced flag makes it skip).

One engine per case runs a list of ``events``: ``"clean"`` (a training step), ``"act"``/``"grad"``
(a training step with that injection), ``"eval"``/``"eval_act"`` (an evaluation, clean or injected).
Per event it reports: the error (``nonfinite="error"``), whether the step was skipped, whether the
parameters, the optimizer state and the codec state (EF/EF21 buffers, AQ-SGD buffers) are bit-identical to
before the event, whether every codec buffer is finite, and which codec path the step took.
"""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
from deepspeed import comm as dist
from dist_utils import write_result
from torch import nn

import deepspeed_ppq
from deepspeed_ppq.integrations import WithSampleIds
from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule

D_IN, D, D_OUT, T, N = 8, 16, 4, 4, 8
ARMED: dict[str, bool] = {"act": False, "grad": False}


class ActPoison(nn.Module):
    def forward(self, x):
        if ARMED["act"]:
            ARMED["act"] = False
            x = x.clone()
            x[0, 0, 0] = float("inf")
        return x


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ARMED["grad"]:
            ARMED["grad"] = False
            g = g.clone()
            g[0, 0, 0] = float("nan")
        return g


class GradPoison(nn.Module):
    def forward(self, x):
        return _NaNGrad.apply(x)


def make_layers():
    torch.manual_seed(0)
    return [nn.Linear(D_IN, D), nn.Tanh(), ActPoison(), GradPoison(), nn.Linear(D, D), nn.Tanh(),
            nn.Linear(D, D_OUT)]


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def micro_batches(step: int, mb: int, gas: int):
    """Step s uses samples [s*mb*gas, ...) mod N: samples come back, so AQ-SGD's buffers are exercised."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, T, D_IN, generator=g), torch.randn(N, T, D_OUT, generator=g)
    data = WithSampleIds(list(zip(x, y)))
    out = []
    for m in range(gas):
        items = [data[(step * mb * gas + m * mb + j) % N] for j in range(mb)]
        out.append(tuple(torch.stack([it[k] for it in items]) for k in range(3)))
    return out


def codec_state(engine) -> list[torch.Tensor]:
    """Every EF/EF21 buffer and AQ-SGD per-sample buffer this rank holds, in a fixed order."""
    out = []
    for _, ch in sorted(engine.ppq_channels.items()):
        for _, st in sorted(ch.state_dict()["sides"].items()):
            out += [st[k] for k in ("feedback", "aqsgd_ids", "aqsgd_rows") if k in st]
    return out


def snapshot(engine, opt) -> list[torch.Tensor]:
    params = [p.detach().clone() for p in engine.module.parameters()]
    state = [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return params + state + codec_state(engine)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def run_case(case: dict, world: int) -> dict:
    mb, gas = case.get("mb", 2), case.get("gas", 2)
    ds_config = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas,
                 "steps_per_print": 10**6, "ppq": case["ppq"]}
    module = PPQPipelineModule(make_layers(), num_stages=world, boundaries=[0, 3, 7], loss_fn=loss_fn)
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    engine, *_ = deepspeed_ppq.initialize(model=module, optimizer=opt, config=ds_config, sample_ids=True)
    events, step = [], 0
    for ev in case["events"]:
        before, skipped = snapshot(engine, opt), engine.skipped_steps
        gs = engine.global_steps
        engine.module.train(not ev.startswith("eval"))  # the codec path this event takes
        ch = engine.ppq_channels[0]
        mode = ch.mode("activations", training=engine.module.training, step=engine.global_steps)
        phase = "raw" if mode is None else ("codec-raw" if mode.uncompressed else "compressed")
        ARMED["act"] = ev in ("act", "eval_act")
        ARMED["grad"] = ev == "grad"
        rec = {"event": ev, "global_step": gs, "act_path": phase}
        print(f"ppq-test: {case['name']} {ev} step {gs} ({phase})", flush=True)
        try:
            if ev.startswith("eval"):
                rec["loss"] = engine.eval_batch(iter(micro_batches(step, mb, gas))).item()
            else:
                rec["loss"] = engine.train_batch(iter(micro_batches(step, mb, gas))).item()
                step += 1
        except Exception as e:  # noqa: BLE001 - the error itself is the result
            rec["error"] = f"{type(e).__name__}: {e}"
            print(f"ppq-test: error {rec['error']}", flush=True)
            engine.zero_grad()
            ARMED.update(act=False, grad=False)
        rec["skipped"] = engine.skipped_steps - skipped
        rec["unchanged"] = same(before, snapshot(engine, opt))
        rec["state_finite"] = all(bool(torch.isfinite(t).all()) for t in codec_state(engine))
        rec["params_finite"] = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
        events.append(rec)
    return {"events": events}


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    write_result({c["name"]: run_case(c, world) for c in cases})


if __name__ == "__main__":
    main()
