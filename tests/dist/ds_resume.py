"""Rank script: N steps + save + resume + M steps against N+M steps, per codec, on 2 gloo ranks.

Usage (through tests/dist_utils.run_ranks): ``ds_resume.py <cases.json> <workdir>``. Per case: engine A
trains N+M steps; engine B trains N and saves a DeepSpeed checkpoint; engine C (built afresh) loads it and
trains M. Reports A's and C's losses of the last M steps and whether the parameters end bit-identical.
A case with ``"resume_ppq"``/``"resume_boundaries"``/``"resume_optimizer"`` resumes into a different
set-up and reports the error. Also reports whether every ``ppq_state_rank*.pt`` loads with
``weights_only=True``.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import sys

import deepspeed
import torch
from deepspeed import comm as dist
from dist_utils import write_result
from ds_nonfinite import loss_fn, make_layers, micro_batches

import deepspeed_ppq
from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule

MB, GAS = 2, 2
# tests/golden/resume_v<format>: the checkpoints the save-golden mode wrote with these settings, after
# GOLDEN_STEPS steps, when the state files were at format 1 and 2
GOLDEN_PPQ = {"activations": {"method": "quant", "bits": 4},
              "gradients": {"method": "quant", "bits": 8, "error_feedback": "ef"},
              "aqsgd": {"enabled": True, "warmup_steps": 1}}
GOLDEN_STEPS = 3


def build(ppq: dict, boundaries=(0, 3, 7), optimizer: str = "adam"):
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS,
           "steps_per_print": 10**6, "ppq": ppq}
    module = PPQPipelineModule(make_layers(), num_stages=2, boundaries=list(boundaries), loss_fn=loss_fn,
                               weights=ppq.get("weights"))  # converted before the optimizer sees them
    opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(module.parameters(), lr=0.01)
    engine, *_ = deepspeed_ppq.initialize(model=module, optimizer=opt, config=cfg, sample_ids=True)
    return engine


def with_path(ppq: dict, path: str) -> dict:
    ppq = copy.deepcopy(ppq)
    if ppq.get("aqsgd", {}).get("storage") == "disk":
        ppq["aqsgd"]["path"] = path
    return ppq


def train(engine, steps):
    return [engine.train_batch(iter(micro_batches(s, MB, GAS))).item() for s in steps]


def run_case(case: dict, work: str) -> dict:
    n, m = case.get("n", 3), case.get("m", 3)
    root = os.path.join(work, case["name"].replace("/", "_"))
    ckpt = os.path.join(root, "ckpt")
    a = build(with_path(case["ppq"], os.path.join(root, "a")))
    full = train(a, range(n + m))
    if case.get("golden"):  # a checkpoint an earlier version wrote (tests/golden/README.md)
        ckpt = case["golden"]
    else:
        b = build(with_path(case["ppq"], os.path.join(root, "b")))
        train(b, range(n))
        b.save_checkpoint(ckpt)
    dist.barrier()
    c = build(with_path(case.get("resume_ppq", case["ppq"]), os.path.join(root, "c")),
              boundaries=case.get("resume_boundaries", (0, 3, 7)),
              optimizer=case.get("resume_optimizer", "adam"))
    try:
        c.load_checkpoint(ckpt)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"error": f"{type(e).__name__}: {e}"}
    resumed = train(c, range(n, n + m))
    same = all(torch.equal(p, q) for p, q in zip(a.module.parameters(), c.module.parameters()))
    files = glob.glob(os.path.join(ckpt, "*", "ppq_state_rank*.pt"))
    states = [torch.load(f, weights_only=True) for f in files]
    loadable = bool(files) and all(isinstance(d, dict) for d in states)
    return {"full": full[n:], "resumed": resumed, "params_equal": same, "global_steps": c.global_steps,
            "state_files": len(files), "weights_only": loadable,
            "formats": sorted({d["format"] for d in states})}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    if sys.argv[1] == "save-golden":  # tests/golden/resume_v<format> (see tests/golden/README.md)
        engine = build(GOLDEN_PPQ)
        train(engine, range(GOLDEN_STEPS))
        engine.save_checkpoint(sys.argv[2], tag="golden")
        write_result({"saved": sys.argv[2]})
        return
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    write_result({c["name"]: run_case(c, sys.argv[2]) for c in cases})


if __name__ == "__main__":
    main()
