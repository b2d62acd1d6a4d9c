"""Rank script (world size 2, data parallel 2): low-bit compute copies follow the optimizer.

Neither bitsandbytes' 8-bit optimizers nor megatron-core's bf16 optimizer move a parameter's autograd
version counter, so without the step hooks the low-bit copy would stay at the initial weights.
Reports, per case, whether every QuantParallelLinear's compute copy equals a fresh quantization of
its master after one step (and that the master really moved), and whether the next forward
re-quantized again (it should not: the step already did). Every case but the DistributedOptimizer
one does the same on both ranks (gradients all-reduced over data parallel 2).

argv[1]: "fixed" (the package as shipped) or "unfixed" (the optimizer-step hooks left out, to show
that the checks fail without them).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from dist_utils import write_result

FMT, BLOCK = "int8", 32
POLICY = {"format": FMT, "block_size": BLOCK, "keep_first_blocks": 0, "keep_last_blocks": 0}


def build_gpt(bf16: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_patches.cpu_shim import seed_cpu_rng_tracker

    seed_cpu_rng_tracker(3)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16,
                            pipeline_dtype=torch.bfloat16 if bf16 else torch.float32)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16, share_embeddings_and_output_weights=False)


def batch():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return ids, torch.arange(16).expand(2, 16)


def quant_layers(model):
    from megatron_patches.layers import QuantParallelLinear

    return [m for m in model.modules() if isinstance(m, QuantParallelLinear)]


def copies_match(layers, masters) -> bool:
    from deepspeed_ppq.quant.formats import quantize_weight

    return all(torch.equal(quantize_weight(w.detach().float(), FMT, BLOCK).dequantize(torch.float32),
                           m.dequantized_weight()) for m, w in zip(layers, masters))


def case_bnb(fixed: bool) -> dict:
    """bitsandbytes Adam8bit straight on the converted model's parameters."""
    import bitsandbytes as bnb

    from deepspeed_ppq.quant.optim import requantize_after_step
    from megatron_patches.cpu_shim import cpu_shim
    from megatron_patches.layers import convert_megatron_model

    model = build_gpt(bf16=False)
    convert_megatron_model(model, POLICY)
    layers = quant_layers(model)
    before = [m.weight.detach().clone() for m in layers]
    opt = bnb.optim.Adam8bit(model.parameters(), lr=1e-2, min_8bit_size=64)
    if fixed:
        requantize_after_step(opt, model)
    ids, pos = batch()
    with cpu_shim():
        model(ids, pos, attention_mask=None, labels=ids).float().mean().backward()
    versions = [m.weight._version for m in layers]
    opt.step()
    out = {"layers": len(layers),
           "master_moved": all(not torch.equal(b, m.weight) for b, m in zip(before, layers)),
           "version_moved": any(m.weight._version != v for m, v in zip(layers, versions)),
           "copy_matches_master": copies_match(layers, [m.weight for m in layers])}
    seen = [m.quant_version for m in layers]
    with cpu_shim():
        model(ids, pos, attention_mask=None, labels=ids)
    out["forward_requantized_again"] = any(m.quant_version != s for m, s in zip(layers, seen))
    out["copy_matches_after_forward"] = copies_match(layers, [m.weight for m in layers])
    return out


def case_megatron(fixed: bool) -> dict:
    """megatron-core's own bf16 optimizer (get_megatron_optimizer -> Float16OptimizerWithFloat16Params)
    on a GPTModel wrapped the way Megatron-LM's get_model wraps it (Float16Module, then DDP)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_patches.cpu_shim import cpu_shim
    from megatron_patches.layers import convert_megatron_model
    from megatron_patches.optim import uninstall_step_hooks

    model = build_gpt(bf16=True)
    convert_megatron_model(model, POLICY)
    if not fixed:
        uninstall_step_hooks()
    layers = quant_layers(model)
    with cpu_shim():
        wrapped = Float16Module(model.config, model)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), wrapped)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, clip_grad=1.0),
                                     [ddp])
        before = [m.weight.detach().clone() for m in layers]
        ids, pos = batch()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(ids, pos, attention_mask=None, labels=ids).float().mean().backward()
        ddp.finish_grad_sync()
        versions = [m.weight._version for m in layers]
        success, _, _ = opt.step()
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    mains = {id(p): main for mg, sg in zip(inner.float16_groups, inner.fp32_from_float16_groups)
             for p, main in zip(mg, sg)}
    out = {"layers": len(layers), "optimizer": type(opt).__name__, "inner": type(inner).__name__,
           "success": bool(success), "weight_dtype": str(layers[0].weight.dtype),
           "master_moved": all(not torch.equal(b, m.weight) for b, m in zip(before, layers)),
           "version_moved": any(m.weight._version != v for m, v in zip(layers, versions)),
           "all_have_main": all(id(m.weight) in mains for m in layers),
           "copy_matches_main": copies_match(layers, [mains.get(id(m.weight), m.weight) for m in layers])}
    seen = [m.quant_version for m in layers]
    with cpu_shim():
        ddp(ids, pos, attention_mask=None, labels=ids)
    out["forward_requantized_again"] = any(m.quant_version != s for m, s in zip(layers, seen))
    return out


def megatron_step(model, opt_cfg, loss_scale_by: float = 1.0):
    """Wrap like Megatron-LM's get_model, build megatron-core's optimizer, run one step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_patches.cpu_shim import cpu_shim

    with cpu_shim():
        wrapped = Float16Module(model.config, model) if model.config.bf16 else model
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), wrapped)
        opt = get_megatron_optimizer(opt_cfg, [ddp])
        ids, pos = batch()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        (ddp(ids, pos, attention_mask=None, labels=ids).float().mean() * loss_scale_by).backward()
        ddp.finish_grad_sync()
        success, _, _ = opt.step()
    return opt, bool(success)


def case_fp32_and_skipped() -> dict:
    """FP32Optimizer re-quantizes from the parameters; a step skipped for inf/nan grads does not."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patches.layers import convert_megatron_model

    out = {}
    model = build_gpt(bf16=False)
    convert_megatron_model(model, POLICY)
    layers = quant_layers(model)
    before = [m.weight.detach().clone() for m in layers]
    opt, success = megatron_step(model, OptimizerConfig(optimizer="adam", lr=1e-2))
    out["fp32"] = {"optimizer": type(getattr(opt, "chained_optimizers", [opt])[0]).__name__,
                   "success": success,
                   "master_moved": all(not torch.equal(b, m.weight) for b, m in zip(before, layers)),
                   "copy_matches_master": copies_match(layers, [m.weight for m in layers])}
    model = build_gpt(bf16=True)
    convert_megatron_model(model, POLICY)
    layers = quant_layers(model)
    seen = [m.quant_version for m in layers]
    before = [m.weight.detach().clone() for m in layers]
    # a constant loss scale makes the bf16 wrapper check for inf/nan; an inf loss gives inf grads
    opt, success = megatron_step(model, OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, loss_scale=1.0),
                                 loss_scale_by=float("inf"))
    out["skipped"] = {"success": success,  # (Float16Module cast the masters to bf16)
                      "master_moved": any(not torch.equal(b.to(m.weight.dtype), m.weight)
                                          for b, m in zip(before, layers)),
                      "requantized": any(m.quant_version != s for m, s in zip(layers, seen))}
    return out


def case_distributed(overlap: bool) -> dict:
    """DistributedOptimizer (data parallel 2): each rank updates its shard of the main params, the param
    all-gather brings the rest at the end of the step, or with ``overlap_param_gather`` during the next
    forward. Re-quantized at the step in the first case, marked stale and re-quantized in the next
    forward in the second (re-quantizing at the step there would read the other rank's half before it
    arrived: checked by hand, ``copy_matches_after_forward`` is then False)."""
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
               "marked_stale": all(m.stale for m in layers)}
        # Megatron-LM's loop: zero_grad starts the first deferred all-gather, the forward waits on it
        opt.zero_grad()
        ddp.zero_grad_buffer()
        ddp(ids, pos, attention_mask=None, labels=ids)
    out["copy_matches_after_forward"] = copies_match(layers, [m.weight for m in layers])
    return out


def main() -> None:
    fixed = sys.argv[1] == "fixed"
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)  # 2 ranks: data parallel 2
    out = {"bnb": case_bnb(fixed), "megatron": case_megatron(fixed)}
    if fixed:
        out.update(case_fp32_and_skipped())
        out["sync_gather"] = case_distributed(False)
        out["overlap_gather"] = case_distributed(True)
    write_result(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
