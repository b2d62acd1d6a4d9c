"""Rank script: rank ``argv[1]`` stops itself with SIGSTOP before training step 2; the others must stop
on their own with the watchdog's error (``ppq.watchdog_timeout_s`` = ``argv[2]``)."""

from __future__ import annotations

import os
import signal
import sys

import deepspeed
import torch
from deepspeed import comm as dist
from ds_nonfinite import loss_fn, make_layers, micro_batches

import deepspeed_ppq
from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule


def main() -> None:
    stuck, timeout = int(sys.argv[1]), float(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
           "ppq": {"activations": {"method": "quant", "bits": 8}, "watchdog_timeout_s": timeout}}
    module = PPQPipelineModule(make_layers(), num_stages=dist.get_world_size(), boundaries=[0, 3, 7],
                               loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    engine, *_ = deepspeed_ppq.initialize(model=module, optimizer=opt, config=cfg)
    for step in range(4):
        if step == 2 and dist.get_rank() == stuck:
            print("ppq-test: stopping myself", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        engine.train_batch(iter(micro_batches(step, 2, 2)))
        print(f"ppq-test: step {step} done", flush=True)
    print("ppq-test: finished", flush=True)


if __name__ == "__main__":
    main()
