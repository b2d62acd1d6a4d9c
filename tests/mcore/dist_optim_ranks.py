"""Rank script (world size 2, data parallel 2): megatron-core's DistributedOptimizer and low-bit weights.

Each rank updates only its shard of the main params; the param all-gather brings the rest, either
at the end of the step or, with ``overlap_param_gather``, during the next forward. The compute
copies must follow the gathered params in both cases: re-quantized at the step without overlap,
marked stale and re-quantized in the next forward with it (re-quantizing at the step there would
read the other rank's half before it arrived: checked by hand, ``copy_matches_after_forward`` is
then False).
"""

from __future__ import annotations

import torch.distributed as dist
from dist_utils import write_result
from optim_rank import POLICY, batch, build_gpt, copies_match, quant_layers


def run(overlap: bool) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_patches.cpu_shim import cpu_shim
    from megatron_patches.layers import convert_megatron_model

    model = build_gpt(bf16=True)
    convert_megatron_model(model, POLICY)
    layers = quant_layers(model)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=overlap,
                                            overlap_grad_reduce=overlap)
    with cpu_shim():
        ddp = DistributedDataParallel(model.config, ddp_cfg, Float16Module(model.config, model))
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True,
                                                     use_distributed_optimizer=True), [ddp])
        ids, pos = batch()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(ids, pos, attention_mask=None, labels=ids).float().mean().backward()
        ddp.finish_grad_sync()
        seen = [m.quant_version for m in layers]
        success, _, _ = opt.step()
        out = {"inner": type(opt.chained_optimizers[0]).__name__, "success": bool(success),
               "layers": len(layers),
               "requantized_at_step": all(m.quant_version == s + 1 for m, s in zip(layers, seen)),
               "marked_stale": all(m._stale for m in layers)}
        # Megatron-LM's loop: zero_grad starts the first deferred all-gather, the forward waits on it
        opt.zero_grad()
        ddp.zero_grad_buffer()
        ddp(ids, pos, attention_mask=None, labels=ids)
    out["copy_matches_after_forward"] = copies_match(layers, [m.weight for m in layers])
    return out


def main() -> None:
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)  # 2 ranks: data parallel 2
    write_result({"sync_gather": run(False), "overlap_gather": run(True)})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
