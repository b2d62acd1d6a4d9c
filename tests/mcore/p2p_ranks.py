"""Rank script: megatron-core's real pipeline schedules with PPQP2PCommunicator, against a reference.

Run by tests/megatron/test_megatron_p2p.py through tests/dist_utils.run_ranks on 2 gloo ranks (PP=2, TP=1).
argv[1] is a JSON list of cases; each case is
    {"name", "ppq": {...ppq section...}, "route": "install"|"explicit", "batch": bool,
     "interleaved": bool, "steps": int, "dict_batches": bool}
For each case, every rank runs the schedule, and also the whole model in one process with
``compressed_boundary`` (the codec's single-process reference) at each stage boundary, and reports
the largest gradient difference of its own layers, plus the bytes its communicator put on the wire.

The micro-batches draw samples from a pool of POOL, so samples come back (within a step and across
steps) and AQ-SGD's per-sample buffers matter. With AQ-SGD on, each batch carries its sample ids:
``(x, y, sample_ids)``, or ``{"x", "y", "sample_ids"}`` with ``dict_batches``.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

import torch
import torch.distributed as dist
from dist_utils import write_result

from deepspeed_ppq.config import load_ppq_config

H, SEQ, MB, NUM_MB, LAYERS_PER_CHUNK, POOL = 16, 4, 2, 4, 2, 6


class Chunk(torch.nn.Module):
    """A pipeline chunk as megatron-core's schedules want it (config, model_type, set_input_tensor)."""

    def __init__(self, config, layers: list[torch.nn.Linear], first: bool):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config, self.model_type, self.first = config, ModelType.encoder_or_decoder, first
        self.layers = torch.nn.ModuleList(layers)
        self.input_tensor = None

    def set_input_tensor(self, t):
        self.input_tensor = t[0] if isinstance(t, list) else t

    def forward(self, x):
        h = x if self.first else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def full_layers(n: int) -> list[torch.nn.Linear]:
    torch.manual_seed(1234)
    return [torch.nn.Linear(H, H) for _ in range(n)]


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(x [SEQ, MB, H], y, sample_ids [MB])`` per micro-batch of ``step``, samples from the pool; each
    sample's inputs drift from step to step (as its activations would while the model trains)."""
    g = torch.Generator().manual_seed(100)
    xs, ys = torch.randn(POOL, SEQ, H, generator=g), torch.randn(POOL, SEQ, H, generator=g)
    xs = xs + 0.2 * step * torch.randn(POOL, SEQ, H, generator=torch.Generator().manual_seed(step))
    out = []
    for m in range(NUM_MB):
        ids = torch.tensor([(step * NUM_MB * MB + m * MB + j) % POOL for j in range(MB)])
        out.append((xs[ids].transpose(0, 1).contiguous(), ys[ids].transpose(0, 1).contiguous(), ids))
    return out


def as_batches(data, case: dict) -> list:
    """What the data iterator yields: ids only where AQ-SGD reads them (as a user would)."""
    if not load_ppq_config(case["ppq"]).aqsgd.enabled:
        return [(x, y) for x, y, _ in data]
    if case.get("dict_batches"):
        return [{"x": x, "y": y, "sample_ids": ids} for x, y, ids in data]
    return data


def loss_func(target, out):
    loss = torch.nn.functional.mse_loss(out, target)
    return loss, {"loss": loss.detach()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    return model(x), partial(loss_func, y)


def reference_grads(ppq, n_chunks: int, steps: int) -> list[list[torch.Tensor]]:
    """Per step, the gradient of every weight of the whole model, a channel at each boundary."""
    from deepspeed_ppq.compress import BoundaryChannel, compressed_boundary

    cfg = load_ppq_config(ppq)
    layers = full_layers(n_chunks * LAYERS_PER_CHUNK)
    channels = [BoundaryChannel(cfg, label=f"ref {b}", sample_dim=1) for b in range(n_chunks - 1)]
    out = []
    for step in range(steps):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        for x, y, ids in batches(step):
            h = x
            for i, layer in enumerate(layers):
                if i and i % LAYERS_PER_CHUNK == 0:
                    h = compressed_boundary(h, channels[i // LAYERS_PER_CHUNK - 1], sample_ids=ids, step=step)
                h = torch.tanh(layer(h))
            (torch.nn.functional.mse_loss(h, y) / NUM_MB).backward()
        out.append([t.grad.clone() for layer in layers for t in (layer.weight, layer.bias)])
    return out


def run_case(case: dict, rank: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from megatron_patches import p2p
    from megatron_patches.cpu_shim import cpu_shim

    vp = 2 if case.get("interleaved") else None
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=vp)
    n_chunks = 2 * (vp or 1)
    config = TransformerConfig(
        num_layers=n_chunks * LAYERS_PER_CHUNK, hidden_size=H, num_attention_heads=1,
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32, batch_p2p_comm=case["batch"],
        overlap_p2p_comm=bool(vp) and not case["batch"], microbatch_group_size_per_vp_stage=2 if vp else None,
        deallocate_pipeline_outputs=True)
    layers = full_layers(n_chunks * LAYERS_PER_CHUNK)
    chunk_ids = [c * 2 + rank for c in range(vp or 1)]  # global chunk index of each local model chunk
    model = [Chunk(config, layers[k * LAYERS_PER_CHUNK:(k + 1) * LAYERS_PER_CHUNK], first=k == 0)
             for k in chunk_ids]

    steps = case.get("steps", 2)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if case["route"] == "install":
        bound = p2p.install_compressed_p2p(case["ppq"])
        fb = get_forward_backward_func()
        extra = {}
    else:
        comm = p2p.PPQP2PCommunicator(pp_group, config, ppq=case["ppq"])
        fb = p2p.ppq_forward_backward_func()
        extra = {"p2p_communicator": comm, "pg_collection": ProcessGroupCollection.use_mpu_process_groups()}
    grads, losses = [], []
    for step in range(steps):
        for m in model:
            m.zero_grad(set_to_none=True)
        data = as_batches(batches(step), case)
        iters = [iter(data) for _ in model] if vp else iter(data)
        with cpu_shim():
            res = fb(forward_step_func=forward_step, data_iterator=iters, model=model if vp else model[0],
                     num_microbatches=NUM_MB, seq_length=SEQ, micro_batch_size=MB, forward_only=False,
                     **extra)
        losses.append([float(r["loss"]) for r in res])
        grads.append([t.grad.clone() for m in model for t in m.parameters()])
    codecs = (next(iter(bound.shared_codecs.values())) if case["route"] == "install" else comm.codecs)
    if case["route"] == "install":
        p2p.uninstall_compressed_p2p()

    ref = reference_grads(case["ppq"], n_chunks, steps)
    ref_plain = reference_grads({}, n_chunks, steps)
    own = [2 * (k * LAYERS_PER_CHUNK + j) + t
           for k in chunk_ids for j in range(LAYERS_PER_CHUNK) for t in (0, 1)]

    def max_diff(a, b):
        return max(float((x - y).abs().max())
                   for s in range(steps) for x, y in zip(a[s], [b[s][i] for i in own]))

    return {"name": case["name"], "max_diff": max_diff(grads, ref),
            "max_diff_uncompressed": max_diff(grads, ref_plain),
            "max_grad": max(float(g.abs().max()) for s in grads for g in s), "losses": losses,
            "raw_bytes": codecs.raw_bytes, "wire_bytes": codecs.wire_bytes, "steps_seen": codecs.steps}


def main() -> None:
    cases = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results = [run_case(c, rank) for c in cases]
    write_result({"rank": rank, "cases": results, "pid": os.getpid()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
