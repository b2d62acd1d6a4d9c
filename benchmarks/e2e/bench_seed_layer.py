"""Per-layer seeding in a DeepSpeed pipeline: ``seed_layer`` against DeepSpeed's ``set_random_seed``.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/e2e/bench_seed_layer.py [--steps 9] [--calls 2000]

A ``PipelineModule`` with ``seed_layers=True`` (what the tuner's trials build) seeds every layer before each
forward, recomputed ones again. DeepSpeed's ``set_random_seed`` calls ``torch.manual_seed``, which also queues
the seed for every device backend not initialised yet and formats the caller's stack for each; ``seed_layer``
(``deepspeed_ppq.integrations.pipe_module``, ``PPQPipelineModule``'s default ``seed_fn``) sets the same
Python, NumPy and torch states without it (tests/integrations/test_seed_layer.py holds them equal).

Two measurements, each alternating the two seed functions in one run (benchmarks/_harness.py):
  1. one call: ``--calls`` calls of each per timing, medians over ``--reps`` alternating timings;
  2. a training step of a real DeepSpeed pipeline engine (one process, one stage, gloo): the pre-training
     workload's GPT (12 blocks of width 256, sequences of 32), global batch 16 as 8 micro-batches of 2, every
     block recomputed, ``seed_layers=True``; two engines that differ only in ``seed_fn``, their steps
     alternating; the seed calls per step are counted.
Results: benchmarks/results/bench_seed_layer.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import machine, time_against, write_results  # noqa: E402

from deepspeed_ppq.integrations.local_ranks import free_port  # noqa: E402
from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule, seed_layer  # noqa: E402
from deepspeed_ppq.models.gpt import GPTConfig, gpt_layers, gpt_loss  # noqa: E402


def bench_call(calls: int, reps: int) -> dict:
    from deepspeed.runtime.utils import set_random_seed

    def many(fn):
        return lambda: [fn(1234 + i) for i in range(calls)]

    t = time_against(many(seed_layer), many(set_random_seed), reps)
    return {"what": "one call", "deepspeed_ms": t.base / calls * 1e3, "seed_layer_ms": t.op / calls * 1e3,
            "ratio": t.base / t.op, "detail": f"{calls} calls per timing, medians of {reps}"}


def bench_step(steps: int) -> dict:
    import deepspeed
    from deepspeed.runtime.utils import set_random_seed

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(vocab_size=512, seq_len=32, d_model=256, n_heads=4, n_layers=12)
    # one micro-batch of 2 token rows, fed to every step from an iterator, as the tuner feeds its trials
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    counts = {"deepspeed": 0, "seed_layer": 0}

    def counted(name, fn):
        def seed_fn(seed):
            counts[name] += 1
            fn(seed)
        return seed_fn

    engines = {}
    for name, fn in (("deepspeed", set_random_seed), ("seed_layer", seed_layer)):
        layers = gpt_layers(cfg)
        module = PPQPipelineModule(layers, 1, boundaries=[0, len(layers)], loss_fn=gpt_loss, seed_layers=True,
                                   base_seed=1234, seed_fn=counted(name, fn), recompute_stages=True)
        engine, _, _, _ = deepspeed.initialize(
            model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
            config={"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                    "gradient_accumulation_steps": 8, "steps_per_print": 10**9,
                    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}})
        engines[name] = engine
    times = {name: [] for name in engines}
    for step in range(steps + 1):  # the first step of each is a warm-up
        for name, engine in engines.items():
            before = counts[name]
            t0 = time.perf_counter()
            engine.train_batch(itertools.repeat(batch))
            if step:
                times[name].append(time.perf_counter() - t0)
            per_step = counts[name] - before  # the same for both engines
    ds, ours = statistics.median(times["deepspeed"]), statistics.median(times["seed_layer"])
    return {"what": "a pipeline training step", "deepspeed_ms": ds * 1e3, "seed_layer_ms": ours * 1e3,
            "ratio": ds / ours,
            "detail": f"{per_step} seed calls per step; medians of {steps} alternating steps"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the trials' per rank)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    m = machine()
    rows = [bench_call(args.calls, args.reps), bench_step(args.steps)]
    for r in rows:
        print(f"{r['what']}: DeepSpeed's set_random_seed {r['deepspeed_ms']:.3f} ms, seed_layer "
              f"{r['seed_layer_ms']:.3f} ms ({r['ratio']:.2f}x; {r['detail']})", flush=True)
    notes = [
        "Command: `DS_ACCELERATOR=cpu .venv/bin/python benchmarks/e2e/bench_seed_layer.py "
        + " ".join(argv if argv is not None else sys.argv[1:]) + "`",
        "ratio = DeepSpeed's time / seed_layer's (higher: seed_layer faster). Both seed the same Python, "
        "NumPy and torch states. The step: one process, one stage, the pre-training GPT (12 x 256, seq 32), "
        "8 micro-batches of 2, every block recomputed, seed_layers=True, torch's Adam.",
    ]
    print(write_results("bench_seed_layer", rows, title="Per-layer seeding: seed_layer against DeepSpeed's",
                        notes=notes, columns=["what", "deepspeed_ms", "seed_layer_ms", "ratio", "detail"],
                        machine_=m))


if __name__ == "__main__":
    main()
