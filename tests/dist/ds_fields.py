"""Rank script (2 ranks): what each ``"ppq"`` setting does to a real DeepSpeed pipeline, one engine per case.

Usage (through tests/dist_utils.run_ranks): ``ds_fields.py engines <cases.json> <work dir>`` or
``ds_fields.py tune <cases.json> <work dir>``.

``engines``: each case is ``{"name", "ppq", "nan_step"?}``. The model is ``[Linear, Block x 4, Linear]``
(a block: ``Linear + Tanh``) built with ``PPQPipelineModule.from_config`` (partition, weights) and handed
to ``deepspeed_ppq.initialize`` with an AdamW section in the config; it trains 3 steps of 2 micro-batches
(items carry their sample ids) and evaluates once. Each rank reports per case what a user could see:
losses, evaluation loss, stage boundaries, this stage's low-bit layers (format, block size, scale dtype
and kind, mode, master-free, LoRA rank), trainable parameters, optimizer class, skipped steps, both
stages' traffic counters per boundary and direction, the files under the case's AQ-SGD ``path``, or the
error a case stopped with.

``tune``: each case is ``{"name", "autotune"}``; ``deepspeed_ppq.autotune`` tunes a small model of the
same shape under those settings and each rank reports the parts of the result the settings steer.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed import comm as dist
from dist_utils import write_result
from torch import nn

import deepspeed_ppq
from deepspeed_ppq.integrations import WithSampleIds
from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule

D_IN, D, D_OUT, T, N = 8, 16, 512, 4, 8  # the head is large enough for 8-bit Adam states
MB, GAS, STEPS = 2, 2, 3


class Block(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(D, D), nn.Tanh())


def make_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(D_IN, D), Block(), Block(), Block(), Block(), nn.Linear(D, D_OUT)]


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def make_data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, T, D_IN, generator=g), torch.randn(N, T, D_OUT, generator=g)
    return WithSampleIds(list(zip(x, y)))


def batches(data, step: int, nan: bool = False) -> list:
    out = []
    for m in range(GAS):
        items = [data[(step * MB * GAS + m * MB + j) % N] for j in range(MB)]
        x = torch.stack([it[0] for it in items])
        if nan and m == 0:
            x = x.clone()
            x[0, 0, 0] = float("nan")
        out.append((x, torch.stack([it[1] for it in items]), torch.stack([it[2] for it in items])))
    return out


def low_bit_layers(module) -> list:
    from deepspeed_ppq.quant import QuantLinear

    out = []
    for name, m in module.named_modules():
        if isinstance(m, QuantLinear):
            q = m.qweight
            out.append({"name": name, "format": m.format.value, "block_size": q.block_size,
                        "scale_dtype": str(q.scale.dtype), "double_quant": q.scale_scale is not None,
                        "fp8_scale": q.fp8_scale, "mode": m.mode, "master_free": m.master_free,
                        "grad_bytes": None if m.weight_grad is None else m.weight_grad.nbytes,
                        "saved_input": m.saved_input,
                        "lora_rank": None if m.lora_A is None else m.lora_A.shape[0]})
    return out


def files_under(path: str | None) -> list:
    if not path or not Path(path).exists():
        return []
    return sorted(({"dir": str(p.parent), "size": p.stat().st_size} for p in Path(path).rglob("*")
                   if p.is_file()), key=lambda f: (f["dir"], f["size"]))


def run_case(case: dict) -> dict:
    ppq = case.get("ppq", {})
    ds_config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS,
                 "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "ppq": ppq}
    module = PPQPipelineModule.from_config(make_layers(), 2, ds_config, loss_fn=loss_fn)
    data = make_data()
    res: dict = {"parts": [int(p) for p in module.parts]}
    try:
        engine, *_ = deepspeed_ppq.initialize(model=module, config=ds_config, sample_ids=True)
        res["losses"] = [engine.train_batch(iter(batches(data, s, nan=s == case.get("nan_step")))).item()
                         for s in range(STEPS)]
        res["eval_loss"] = engine.eval_batch(iter(batches(data, 0))).item()
    except Exception as e:  # noqa: BLE001 - the error is what this case shows
        res["error"] = f"{type(e).__name__}: {e}"
        return res
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    res.update(
        skipped=engine.skipped_steps,
        low_bit=low_bit_layers(engine.module),
        trainable=sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
        optimizer=type(inner).__name__,
        state_dtypes=sorted({str(v.dtype) for st in inner.state.values() for v in st.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0}),
        traffic={f"{b}.{d}": {k: v[k] for k in ("raw_bytes", "wire_bytes", "side_bytes", "messages")}
                 for (b, d), v in engine.ppq_stats(all_stages=True).items()},
        files=files_under((ppq.get("aqsgd") or {}).get("path")),
    )
    res["losses_finite"] = all(math.isfinite(v) for v in res["losses"])
    return res


# -- tune ---------------------------------------------------------------------------------------
class Items(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, T, D_IN, generator=g), torch.randn(n, T, D_OUT, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def tune_case(case: dict, work: Path) -> dict:
    from deepspeed_ppq.autotune.loop import over_budget
    from deepspeed_ppq.config import PPQConfigError, load_ppq_config
    from deepspeed_ppq.integrations.autotune import DeepSpeedRunner

    settings = {**case["autotune"], "out_dir": str(work / case["autotune"]["out_dir"]),
                "profile_cache": str(work / case["autotune"]["profile_cache"])}
    ds_config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "ppq": {"autotune": settings}}
    train = Items(24, 2)
    default_split = {**ds_config,
                     "ppq": {"autotune": {k: v for k, v in settings.items() if k != "val_samples"}}}
    try:  # the default val_samples (64) cannot be held out of 24 samples
        deepspeed_ppq.autotune(make_layers(), loss_fn, train, None, default_split)
        split_error = ""
    except PPQConfigError as e:
        split_error = str(e)
    plan = deepspeed_ppq.autotune(make_layers(), loss_fn, train, None, ds_config)
    out = Path(settings["out_dir"])
    result = json.loads((out / "tune.json").read_text())
    block = result["profile"]["layers"][2]["times"]  # a block the policy lets go low-bit
    measured = result["stock"]["measured"]
    # the same plan's trial, as the loop runs it, under two validation lengths
    tune = load_ppq_config(ds_config["ppq"]).autotune
    runner = DeepSpeedRunner(make_layers(), loss_fn, torch.utils.data.Subset(train, range(8)),
                             torch.utils.data.Subset(train, range(8, 24)), ds_config)  # 2 batches of 8
    trials = [runner.run_trial(plan, tune.model_copy(update={"val_batches": n})) for n in (1, 2)]
    timed = runner.run_trial(plan, tune, timing_only=True)  # the comparisons' repeats: no validation
    run = measured[0]["run"]
    peak = run["peak_memory"]

    def over(tolerance: float) -> bool:
        return bool(over_budget(tune.model_copy(update={"memory_budget": int(peak / 1.1),
                                                         "memory_tolerance": tolerance}), run))

    return {
        "files": sorted(p.name for p in out.iterdir()),
        "profile_cache_bytes": Path(settings["profile_cache"]).stat().st_size
        if Path(settings["profile_cache"]).is_file() else 0,
        "profile_formats": sorted(block),
        "global_batch": result["global_batch"],
        "plan_global_batch": plan.global_batch,
        "stock_measured": len(measured),
        "stock_search": next((x for x in result["log"] if x.startswith("stock search:")), ""),
        "stock_fitting": sum(c["fits"] for c in result["stock"]["candidates"]),
        "seed_losses": result["gate"]["losses"],
        "gate_limit": result["gate"]["limit"],
        "trial_steps": sorted({len(m["run"]["step_times"]) for m in measured}),
        "trial_warmup": sorted({t.warmup_steps for t in trials}),
        "val_batches": [1, 2],
        "val_by_batches": [t.val_loss for t in trials],
        "timing_only": {"val_is_nan": math.isnan(timed.val_loss), "steps": len(timed.step_times),
                        "memory": max(st.memory["total"] for st in timed.stages)},
        "val_samples_default_error": split_error,
        "iterations": len(result["iterations"]),
        "ab_runs": len(result["ab_step_times"]["baseline"]),
        "over_with_tolerance": [over(0.2), over(0.05)],
    }


def main() -> None:
    mode, cases_path, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    with open(cases_path) as f:
        cases = json.load(f)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    out = {}
    for case in cases:
        out[case["name"]] = run_case(case) if mode == "engines" else tune_case(case, work)
        dist.barrier()
    write_result(out)


if __name__ == "__main__":
    main()
