"""Rank script: the PPQ pipeline engine against stock DeepSpeed and a single-process reference.

Usage (through tests/dist_utils.run_ranks): ``ds_pipe.py <cases.json>``. Each case builds a small
pipeline of Linear layers on ``[B, T, d]`` activations (optionally with a tuple activation at the first
boundary), trains a few steps with SGD and evaluates once. Every rank also runs the whole model in one
process with ``compressed_boundary`` at the same boundaries and reports, per case: the losses of both,
the largest gradient difference over the parameters of its own stage, and the engine's byte counters.
A case with ``"expect_error"`` reports the error message instead.

A case with ``"partition_method"`` builds a stock ``PipelineModule`` cut by that method instead (and
``"from_config"`` a ``PPQPipelineModule.from_config`` from the case's ``"ppq"``); ``"wide"`` widens the
first hidden layer so that DeepSpeed's partition methods cut the layers differently. After training, each
rank reports the SHA-256 of its stage's parameters (bytes, in order), to compare runs bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import sys

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.pipe import PipelineModule
from dist_utils import write_result
from torch import nn

import deepspeed_ppq
from deepspeed_ppq.config import load_ppq_config
from deepspeed_ppq.integrations import WithSampleIds
from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule

MB, GAS, T, D_IN, D, D_OUT, N = 2, 2, 4, 8, 16, 4, 8
WIDE = 64  # "wide": parameters [576, 0, 1040, 0, 272, 0, 68]: uniform [0, 4, 7], parameters [0, 2, 7]


class Fork(nn.Module):
    """Turns one activation into a tuple: two floating tensors and an integer one."""

    def forward(self, x):
        return x, 0.5 * x + 1.0, torch.arange(x.shape[0], dtype=torch.int64)


class Join(nn.Module):
    def forward(self, xs):
        a, b, c = xs
        return a * b + c.to(a.dtype)[:, None, None] * 0.0


def make_layers(tuple_act: bool, wide: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    h = WIDE if wide else D
    # "wide": the first Linear inside a container, as in a block: ppq.weights converts it in place
    layers = [nn.Sequential(nn.Linear(D_IN, h)) if wide else nn.Linear(D_IN, h), nn.Tanh()]
    if tuple_act:
        layers += [Fork(), Join()]
    layers += [nn.Linear(h, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D_OUT)]
    return layers


def boundaries(num_stages: int, tuple_act: bool) -> list[int]:
    if tuple_act:  # 9 layers; the first cut is right after Fork
        return {2: [0, 3, 9], 4: [0, 3, 5, 7, 9]}[num_stages]
    return {2: [0, 4, 7], 4: [0, 2, 4, 6, 7]}[num_stages]


def make_data(nan_step: int | None):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, T, D_IN, generator=g)
    y = torch.randn(N, T, D_OUT, generator=g)
    data = WithSampleIds(list(zip(x, y)))
    return data


def micro_batches(data, steps: int, nan_step: int | None = None):
    """Step s uses samples [4s, 4s+4) mod N: samples come back, so AQ-SGD's buffers are exercised."""
    out = []
    for s in range(steps):
        for m in range(GAS):
            idx = [(s * MB * GAS + m * MB + j) % N for j in range(MB)]
            items = [data[i] for i in idx]
            x = torch.stack([it[0] for it in items])
            if nan_step == s and m == 0:
                x = x.clone()
                x[0, 0, 0] = float("nan")
            out.append((x, torch.stack([it[1] for it in items]), torch.stack([it[2] for it in items])))
    return out


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


class Reference:
    """The whole model in one process with ``compressed_boundary`` at every stage boundary (one channel
    each, the tuple's floating tensors in its slots)."""

    def __init__(self, ppq, tuple_act: bool, cuts: list[int], wide: bool = False):
        from deepspeed_ppq.compress import BoundaryChannel

        self.cuts = set(cuts[1:-1])
        self.model = nn.Sequential(*make_layers(tuple_act, wide))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.channels = {b: BoundaryChannel(ppq, label=f"ref {b}") for b in sorted(self.cuts)}

    def forward(self, x, ids, step: int, training: bool):
        from deepspeed_ppq.compress import compressed_boundary

        h = x
        for i, layer in enumerate(self.model):
            h = layer(h)
            if i + 1 in self.cuts:
                hs = (h,) if isinstance(h, torch.Tensor) else h
                out, fi = [], 0
                for t in hs:
                    if t.is_floating_point():
                        t = compressed_boundary(t, self.channels[i + 1], slot=fi, sample_ids=ids,
                                                training=training, step=step)
                        fi += 1
                    out.append(t)
                h = out[0] if isinstance(h, torch.Tensor) else tuple(out)
        return h

    def train_step(self, mbs, step: int):
        self.opt.zero_grad()
        losses = []
        for x, y, ids in mbs:
            loss = loss_fn(self.forward(x, ids, step, True), y)
            (loss / GAS).backward()
            losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        if all(torch.isfinite(g).all() for g in grads.values()):
            self.opt.step()
        return sum(losses) / len(losses), grads

    @torch.no_grad()
    def eval_loss(self, mbs, step: int):
        self.model.eval()
        losses = [loss_fn(self.forward(x, ids, step, False), y).item() for x, y, ids in mbs]
        self.model.train()
        return sum(losses) / len(losses)


def run_case(case: dict, world: int) -> dict:
    tuple_act = case.get("tuple", False)
    steps = case.get("steps", 3)
    cuts = boundaries(world, tuple_act)
    if case.get("boundaries_by_rank"):
        cuts = case["boundaries_by_rank"][dist.get_rank()]
    ds_config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS,
                 "steps_per_print": 10**6, "ppq": case.get("ppq", {})}
    if isinstance(case.get("ppq_by_rank"), list):
        ds_config["ppq"] = case["ppq_by_rank"][dist.get_rank()]
    if case.get("bf16_by_rank", [False] * world)[dist.get_rank()]:
        ds_config["bf16"] = {"enabled": True}
    layers = make_layers(tuple_act, case.get("wide", False))
    if case.get("partition_method"):
        module = PipelineModule(layers, num_stages=world, partition_method=case["partition_method"],
                                loss_fn=loss_fn)
    elif case.get("from_config"):
        module = PPQPipelineModule.from_config(layers, world, ds_config, loss_fn=loss_fn)
    else:
        module = PPQPipelineModule(layers, num_stages=world, boundaries=cuts, loss_fn=loss_fn,
                                   weights=ds_config["ppq"].get("weights"))  # before the optimizer
    cuts = [int(p) for p in module.parts]
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    grads: list[dict] = []
    opt.register_step_pre_hook(lambda o, a, k: grads.append(
        {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}))
    init = deepspeed.initialize if case.get("stock") else deepspeed_ppq.initialize
    kwargs = {} if case.get("stock") or not case.get("sample_ids", True) else {"sample_ids": True}
    if "overlap" in case:
        kwargs["overlap_sends"] = case["overlap"]
    try:
        engine, *_ = init(model=module, optimizer=opt, config=ds_config, **kwargs)
        data = make_data(case.get("nan_step"))
        mbs = micro_batches(data, steps, case.get("nan_step"))
        if "third" in case:  # a third batch element that is not a sample id (stock DeepSpeed ignores it)
            mbs = [(x, y, case["third"]) for x, y, _ in mbs]
        losses = [engine.train_batch(iter(mbs[s * GAS:(s + 1) * GAS])).item() for s in range(steps)]
        eval_mbs = micro_batches(data, 1)
        eval_loss = engine.eval_batch(iter(eval_mbs)).item()
    except Exception as e:  # noqa: BLE001 - the error itself is the result for these cases
        if not case.get("expect_error"):
            raise
        return {"error": f"{type(e).__name__}: {e}"}
    res = {"losses": losses, "eval_loss": eval_loss, "skipped": engine.skipped_steps, "parts": cuts,
           "params_sha256": hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                                    for p in engine.module.parameters())).hexdigest()}
    if hasattr(engine, "ppq_stats"):
        res["stats"] = {f"{b}.{d}": v for (b, d), v in engine.ppq_stats(all_stages=True).items()}
    if case.get("stock") or case.get("from_config"):  # from_config: low-bit weights, no dense reference
        return res
    ppq = load_ppq_config(ds_config["ppq"])
    ref = Reference(ppq, tuple_act, cuts, case.get("wide", False))
    ref_losses, worst = [], 0.0
    for s in range(steps):
        loss, ref_grads = ref.train_step(mbs[s * GAS:(s + 1) * GAS], s)
        ref_losses.append(loss)
        if s < len(grads) and not case.get("nan_step"):
            for n, g in grads[s].items():
                scale = max(ref_grads[n].abs().max().item(), 1e-12)
                worst = max(worst, (g - ref_grads[n]).abs().max().item() / scale)
    res.update(ref_losses=ref_losses, ref_eval_loss=ref.eval_loss(eval_mbs, steps), grad_rel_err=worst,
               grad_steps=len(grads), stage_params=len(grads[0]) if grads else 0)
    return res


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    torch.set_num_threads(1)
    write_result({c["name"]: run_case(c, world) for c in cases})


if __name__ == "__main__":
    main()
