"""Rank script (2 gloo ranks, PP=2): ``ppq.nonfinite`` inside megatron-core's real 1F1B schedule, with
megatron-core's ``FP32Optimizer`` (Adam) stepping each stage's parameters.

argv[1]: a JSON list of cases ``{"name", "ppq", "route": "install"|"explicit", "nan_steps": [...],
"steps": [...]}``. ``steps`` are the batches trained, in order (a run "that never saw" batch 1 trains
[0, 2]); in ``nan_steps`` the first micro-batch's input holds a NaN (on the first stage). After every
step each rank reports the SHA-256 of its stage's parameters (bytes, in order), whether the optimizer
step succeeded, whether the parameters are finite and the RuntimeWarnings seen; a case that stops
reports its error instead.

``FP32Optimizer`` never checks the gradients for inf/nan itself: whatever the schedule leaves in them is
applied, so a skipped step shows only through ``ppq.nonfinite="skip"``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from dist_utils import write_result

sys.path.insert(0, str(Path(__file__).parent))
from p2p_ranks import LAYERS_PER_CHUNK, MB, NUM_MB, SEQ, Chunk, batches, forward_step, full_layers  # noqa: E402


def digest(module: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()


def run_case(case: dict, rank: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from megatron_patches import p2p
    from megatron_patches.cpu_shim import cpu_shim

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2)
    config = TransformerConfig(num_layers=2 * LAYERS_PER_CHUNK, hidden_size=16, num_attention_heads=1,
                               pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                               batch_p2p_comm=True, deallocate_pipeline_outputs=True)
    layers = full_layers(2 * LAYERS_PER_CHUNK)
    model = Chunk(config, layers[rank * LAYERS_PER_CHUNK:(rank + 1) * LAYERS_PER_CHUNK], first=rank == 0)
    with cpu_shim():
        opt = FP32Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                            OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), None)
    if case["route"] == "install":
        p2p.install_compressed_p2p(case["ppq"])
        fb, extra = get_forward_backward_func(), {}
    else:
        comm = p2p.PPQP2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config,
                                      ppq=case["ppq"])
        fb = p2p.ppq_forward_backward_func()
        extra = {"p2p_communicator": comm, "pg_collection": ProcessGroupCollection.use_mpu_process_groups()}
    out: dict = {"name": case["name"], "initial": digest(model), "steps": []}
    try:
        for step in case["steps"]:
            data = [(x, y) for x, y, _ in batches(step)]
            if step in case.get("nan_steps", []):
                data[0] = (data[0][0].clone(), data[0][1])
                data[0][0][0, 0, 0] = float("nan")
            opt.zero_grad()
            with warnings.catch_warnings(record=True) as seen, cpu_shim():
                warnings.simplefilter("always")
                fb(forward_step_func=forward_step, data_iterator=iter(data), model=model,
                   num_microbatches=NUM_MB, seq_length=SEQ, micro_batch_size=MB, forward_only=False, **extra)
                success, _, _ = opt.step()
            out["steps"].append({"batch": step, "success": bool(success), "params": digest(model),
                                 "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                                 "warnings": [str(w.message) for w in seen
                                              if issubclass(w.category, RuntimeWarning)]})
    except Exception as e:  # noqa: BLE001 - the error is what the case shows
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if case["route"] == "install":
            p2p.uninstall_compressed_p2p()
    return out


def main() -> None:
    cases = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    results = {}
    for case in cases:
        results[case["name"]] = run_case(case, rank)
        dist.barrier()
    write_result({"rank": rank, "cases": results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
