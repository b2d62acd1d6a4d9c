"""Low-bit weights in megatron-core layers: the project's quantized linear (CPU) and TE FP8 (GPU)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import ROOT, run_ranks

from deepspeed_ppq.config import WeightsConfig
from megatron_patches.layers import te_available, te_fp8_settings

MCORE = ROOT / "tests" / "mcore"  # the rank scripts


@pytest.fixture(scope="module")
def layers_result():
    return run_ranks(MCORE / "layers_rank.py", 1, timeout=300)[0]


@pytest.mark.distributed
def test_policy_keeps_first_last_blocks_and_output_layer(layers_result):
    d = layers_result["decisions"]
    assert d["output_layer"] == "none"
    for name, fmt in d.items():
        if name.startswith(("decoder.layers.1.", "decoder.layers.2.")):
            assert fmt == "int8", name
        else:
            assert fmt == "none", name


@pytest.mark.distributed
def test_policy_uses_global_layer_numbers(layers_result):
    # local layers 0..3 of the second half of an 8-layer model: global 4..7; only global 7 is "last"
    d = layers_result["decisions_second_half"]
    assert {n.split(".")[2] for n in d if n.startswith("decoder")} == {"4", "5", "6", "7"}
    assert all(f == "nf4" for n, f in d.items() if n.startswith(("decoder.layers.4.", "decoder.layers.6.")))
    assert all(f == "none" for n, f in d.items() if n.startswith("decoder.layers.7."))


@pytest.mark.distributed
def test_quantized_gpt_matches_dense_model_on_dequantized_weights(layers_result):
    r = layers_result
    assert r["quant_error"] > 0  # int8 really changed the weights
    assert r["loss_diff"] <= 1e-6
    assert r["grad_rel_diff"] <= 1e-5
    assert r["skip_bias_add"] is True


@pytest.mark.distributed
def test_requantized_from_master_after_optimizer_step(layers_result):
    assert layers_result["requantized"] is True
    assert layers_result["requant_matches_master"] is True


def test_te_fp8_settings_map_the_policy():
    s = te_fp8_settings(WeightsConfig(format="fp8_e4m3", keep_first_blocks=2, keep_last_blocks=1,
                                      fp8_scale="tensor"))
    assert s == {"fp8": "e4m3", "fp8_recipe": "tensorwise", "fp8_param": True, "first_last_layers_bf16": True,
                 "num_layers_at_start_in_bf16": 2, "num_layers_at_end_in_bf16": 1}
    s = te_fp8_settings(WeightsConfig(format="fp8_e4m3", keep_first_blocks=0, keep_last_blocks=0))
    assert s["fp8_recipe"] == "blockwise" and s["first_last_layers_bf16"] is False


def test_te_fp8_settings_refuse_what_te_cannot_hold():
    with pytest.raises(ValueError, match="weights.format='int8'.*fp8_e4m3.*--transformer-impl local"):
        te_fp8_settings(WeightsConfig(format="int8"))
    with pytest.raises(ValueError, match="weights.rules cannot be expressed"):
        te_fp8_settings(WeightsConfig(format="fp8_e4m3", rules=[{"pattern": "*fc1*", "format": "none"}]))


@pytest.mark.gpu
def test_te_fp8_primary_weights_in_gpt_model():
    """FP8 primary weights through Transformer Engine, with the first/last layers kept in bf16."""
    ok, why = te_available()
    if not ok:
        pytest.skip(why)
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from transformer_engine.pytorch.tensor import QuantizedTensor

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    fp8 = te_fp8_settings(WeightsConfig(format="fp8_e4m3", fp8_scale="tensor"))
    cfg = TransformerConfig(num_layers=4, hidden_size=128, num_attention_heads=4, bf16=True,
                            params_dtype=torch.bfloat16, **fp8)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=256, max_sequence_length=64).cuda()
    kinds = {}
    for name, p in model.named_parameters():
        if ".layers." in name and name.endswith("fc1.weight"):
            kinds[int(name.split(".layers.")[1].split(".")[0])] = isinstance(p, QuantizedTensor)
    assert kinds == {0: False, 1: True, 2: True, 3: False}
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda").expand(2, 64)
    loss = model(ids, pos, attention_mask=None, labels=ids).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    parallel_state.destroy_model_parallel()
