"""The roofline cost model's LLaMA-style blocks, tensor parallelism and master-free memory
(``deepspeed_ppq.schedule.costs``), checked against hand-computed figures."""

import pytest

from deepspeed_ppq.schedule.costs import (
    ModelShape,
    layer_activation_bytes,
    layer_flops,
    stage_costs_roofline,
    stage_memory,
)
from deepspeed_ppq.schedule.hardware import get_hardware

L70 = ModelShape(80, 8192, 64, 4096, 128256, arch="llama", kv_heads=8, ffn_hidden=28672)


def test_llama_70b_parameter_count_and_flops():
    h, f, kv = 8192, 28672, 1024
    assert L70.kv_dim == kv
    assert L70.layer_params == 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    total = 80 * L70.layer_params + 2 * 128256 * h  # untied embedding and head
    assert total == pytest.approx(70.55e9, rel=1e-3)  # LLaMA-3 70B
    fwd, bi, bw = layer_flops(L70)
    assert bw == 2 * 4096 * L70.layer_matmul_params
    assert fwd == bi == bw + 4 * 4096 ** 2 * h


def test_gpt_default_is_unchanged():
    s = ModelShape(8, 1024, 16, 512, 32000, micro_batch=2)
    assert s.layer_params == 12 * 1024 ** 2 + 13 * 1024
    assert layer_activation_bytes(s) == int(512 * 2 * 1024 * (34 + 5 * 16 * 512 / 1024))


def test_llama_activations_and_tensor_parallel_division():
    sbh = 4096 * 8192
    # attention 2 + 2 + 0.5 + 2, SwiGLU 2 + 3 * 2 * 3.5, norms 4: 33.5 s b h bytes at bf16
    assert layer_activation_bytes(L70) == int(33.5 * sbh)
    tp4 = ModelShape(80, 8192, 64, 4096, 128256, arch="llama", kv_heads=8, ffn_hidden=28672,
                     tensor_parallel=4)
    assert layer_activation_bytes(tp4) == int(33.5 * sbh / 4)
    assert layer_flops(tp4)[0] == pytest.approx(layer_flops(L70)[0] / 4)
    h100 = get_hardware("h100")
    c1, c4 = stage_costs_roofline(L70, 8, h100), stage_costs_roofline(tp4, 8, h100)
    assert c4[3].forward == pytest.approx(c1[3].forward / 4, rel=1e-6)
    assert c4[7].forward > c4[3].forward  # the LM head sits on the last stage


def test_master_free_memory_keeps_master_and_fp32_states_only_for_embedding_and_head():
    tp4 = ModelShape(80, 8192, 64, 4096, 128256, arch="llama", kv_heads=8, ffn_hidden=28672,
                     tensor_parallel=4)
    stock = stage_memory(tp4, 8)
    low = stage_memory(tp4, 8, "fp8_e4m3", "adam8bit", master_free=True, high_precision_optimizer="adam")
    blocks = 10 * tp4.layer_params // 4
    emb = 128256 * 8192 // 4
    assert stock[0].static["weights.bf16"] == (blocks + emb) * 2
    assert stock[0].static["master_weights"] == (blocks + emb) * 4
    assert stock[0].static["optimizer"] == (blocks + emb) * 8
    assert low[0].static["weights.fp8_e4m3"] == blocks + (blocks // 64) * 4
    assert low[0].static["weights.bf16"] == emb * 2
    assert low[0].static["master_weights"] == emb * 4
    assert low[0].static["optimizer"] == blocks * 2 + emb * 8
    assert low[3].static["master_weights"] == 0 and low[3].static["weights.bf16"] == 0
    assert sum(low[3].static.values()) < 0.45 * sum(stock[3].static.values())
    with pytest.raises(ValueError, match="master_free=True needs a low-bit weight_format"):
        stage_memory(tp4, 8, master_free=True)
    with pytest.raises(ValueError, match="high_precision_optimizer='lion' is unknown"):
        stage_memory(tp4, 8, high_precision_optimizer="lion")


def test_shape_errors_name_the_field():
    with pytest.raises(ValueError, match="ModelShape.kv_heads=3 must be >= 1 and divide heads=64"):
        ModelShape(80, 8192, 64, 4096, 128256, arch="llama", kv_heads=3)
    with pytest.raises(ValueError, match="ModelShape.arch='mamba' is unknown"):
        ModelShape(80, 8192, 64, 4096, 128256, arch="mamba")
    with pytest.raises(ValueError, match="ModelShape.tensor_parallel=0 must be >= 1"):
        ModelShape(80, 8192, 64, 4096, 128256, tensor_parallel=0)
