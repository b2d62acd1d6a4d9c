"""Rank script (world size 1): low-bit weights in a megatron-core GPTModel (local spec, TP=1).

Reports the policy decisions, forward/gradient agreement with a dense model that holds the
dequantized weights, lazy re-quantization after an optimizer step, and global layer numbering.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_utils import write_result


def build(num_layers=4):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_patches.cpu_shim import seed_cpu_rng_tracker

    seed_cpu_rng_tracker(7)
    cfg = TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16, share_embeddings_and_output_weights=False)


def main() -> None:
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    from megatron_patches.cpu_shim import cpu_shim
    from megatron_patches.layers import QuantParallelLinear, convert_megatron_model

    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    model = build()
    dense = build()  # same seed: the same initial weights
    decisions = convert_megatron_model(model, {"format": "int8", "block_size": 32})
    out["decisions"] = {d.name: d.format.value for d in decisions}
    # the dense twin computes with the dequantized weights
    out["quant_error"] = float((model.decoder.layers[1].mlp.linear_fc1.dequantized_weight()
                                - dense.decoder.layers[1].mlp.linear_fc1.weight).abs().max())
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, QuantParallelLinear):
                dense.get_submodule(name).weight.copy_(mod.dequantized_weight())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).expand(2, 16)
    with cpu_shim():
        lq = model(ids, pos, attention_mask=None, labels=ids).mean()
        ld = dense(ids, pos, attention_mask=None, labels=ids).mean()
    lq.backward()
    ld.backward()
    out["loss_diff"] = abs(float(lq) - float(ld))
    grads = {n: p.grad for n, p in model.named_parameters()}
    out["grad_rel_diff"] = max(float((grads[n] - p.grad).norm() / p.grad.norm())
                               for n, p in dense.named_parameters())
    # optimizer step on the master -> next forward re-quantizes from it
    fc1 = model.decoder.layers[1].mlp.linear_fc1
    v0 = fc1.quant_version
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    with cpu_shim():
        model(ids, pos, attention_mask=None, labels=ids)
    from deepspeed_ppq.quant.formats import quantize_weight

    fresh = quantize_weight(fc1.weight.detach(), "int8", 32).dequantize(torch.float32)
    out["requantized"] = fc1.quant_version == v0 + 1
    out["requant_matches_master"] = bool(torch.equal(fresh, fc1.dequantized_weight()))
    out["skip_bias_add"] = fc1.skip_bias_add
    # global numbering: the same 4 layers as the second half of an 8-layer model
    second = build()
    for i, layer in enumerate(second.decoder.layers):
        layer.layer_number = 5 + i
    ds2 = convert_megatron_model(second, {"format": "nf4"}, num_layers=8)
    out["decisions_second_half"] = {d.name: d.format.value for d in ds2}
    write_result(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
