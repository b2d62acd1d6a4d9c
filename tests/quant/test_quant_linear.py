"""QuantLinear: gradients against a dense linear on the dequantized weight, the re-quantize hook with a
plain optimizer, a bitsandbytes 8-bit optimizer and a real DeepSpeed engine, frozen mode with LoRA,
conversion and checkpoints.

The DeepSpeed part runs this file as a script in a fresh process (``run_ranks(__file__, 1)``), so the
test process never holds a process group.
"""

from __future__ import annotations

import copy
import gc
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from deepspeed_ppq.config import WeightsConfig
from deepspeed_ppq.formats import WEIGHT_FORMATS
from deepspeed_ppq.models.gpt import GPT, GPTConfig, gpt_layers, gpt_loss, layer_kinds
from deepspeed_ppq.quant import (
    QuantLinear,
    build_optimizer,
    convert_model,
    lora_parameters,
    measure_storage,
    quantize_weight,
    requantize_after_step,
)
from deepspeed_ppq.quant.ledger import ledger_from_model

FORMATS = list(WEIGHT_FORMATS)


def _layer(fmt, mode="train", in_f=70, out_f=45, bias=True, **cfg):
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias)  # 70*45 = 3150 values: the last 64-block is partial
    return QuantLinear.from_linear(lin, fmt, WeightsConfig(format=fmt, mode=mode, **cfg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gradients_match_dense_linear_on_dequantized_weight(fmt, dtype):
    layer = _layer(fmt)
    torch.manual_seed(1)
    x = torch.randn(3, 5, 70, dtype=dtype, requires_grad=True)
    gy = torch.randn(3, 5, 45, dtype=dtype)
    y = layer(x)
    y.backward(gy)

    w = layer.dequantized_weight(dtype).requires_grad_()
    b = layer.bias.detach().to(dtype).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    yr = F.linear(xr, w, b)
    yr.backward(gy)

    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    assert y.dtype == dtype
    torch.testing.assert_close(y, yr, **tol)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    assert layer.weight.grad.dtype == torch.float32  # the master's gradient
    torch.testing.assert_close(layer.weight.grad, w.grad.float(), **tol)
    torch.testing.assert_close(layer.bias.grad, b.grad.float(), **tol)


@settings(max_examples=20, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    in_f=st.integers(1, 80),
    out_f=st.integers(1, 40),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    bias=st.booleans(),
    block=st.sampled_from([16, 64, 256]),
)
def test_gradients_match_for_odd_shapes(fmt, in_f, out_f, lead, bias, block):
    layer = _layer(fmt, in_f=in_f, out_f=out_f, bias=bias, block_size=block)
    x = torch.randn(*lead, in_f, requires_grad=True)
    gy = torch.randn(*lead, out_f)
    layer(x).backward(gy)
    w = layer.dequantized_weight().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    F.linear(xr, w, layer.bias).backward(gy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, w.grad, rtol=1e-5, atol=1e-5)


def test_backward_saves_only_the_input_not_a_dense_weight():
    layer = _layer("int4")
    x = torch.randn(4, 70, requires_grad=True)
    y = layer(x)
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert [tuple(t.shape) for t in saved] == [(4, 70)]
    # with a frozen weight (input grad only) nothing the size of the input is needed either
    frozen = _layer("int4", mode="frozen")
    y2 = frozen(x)
    assert all(t is None for t in y2.grad_fn.next_functions[0][0].saved_tensors)


@pytest.mark.parametrize("master", ["fp32", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_saved_input_keeps_codes_and_makes_the_weight_gradient_from_them(dtype, master):
    from deepspeed_ppq.quant.ops import weight_dequantize, weight_quantize

    fmt = "int8"
    dense, int8 = (_layer(fmt, master=master, saved_input=s, block_size=32) for s in ("dense", "int8"))
    torch.manual_seed(1)
    x = torch.randn(3, 5, 70, dtype=dtype, requires_grad=True)
    gy = torch.randn(3, 5, 45, dtype=dtype)
    y = int8(x)
    # what the backward keeps of the input: 1-byte codes and one fp32 scale per 32 values, not x
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.int8, 1050), (torch.float32, 33)]
    y.backward(gy)
    xr = x.detach().clone().requires_grad_()
    dense(xr).backward(gy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)  # the input gradient needs no input

    def weight_grad(layer):
        return layer.weight_grad if master == "none" else layer.weight.grad

    # the weight gradient is exactly grad_y^T x' with x' the input's int8 round trip ...
    xq = weight_dequantize(*weight_quantize(x.detach(), "int8", 32), "int8", 32, x.shape, dtype)
    want = gy.reshape(-1, 45).t().mm(xq.reshape(-1, 70)).float()
    torch.testing.assert_close(weight_grad(int8), want, rtol=1e-5, atol=1e-5)
    # ... which is within int8's rounding of the dense layer's
    err = (weight_grad(int8) - weight_grad(dense)).norm() / weight_grad(dense).norm()
    assert 0 < err < 0.02


def test_int8_saved_input_shrinks_what_a_gpt_block_keeps_for_backward():
    from deepspeed_ppq.autotune.profiler import _saved_bytes

    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=256, n_heads=4, n_layers=1)
    x = torch.randn(8, 32, 256, requires_grad=True)
    saved = {}
    for mode in ("dense", "int8"):
        block = nn.Sequential(gpt_layers(cfg)[1])
        convert_model(block, WeightsConfig(format="int8", master="none", saved_input=mode,
                                           keep_first_blocks=0, keep_last_blocks=0))
        saved[mode] = _saved_bytes(block, x)
    # three of the four linear inputs (both LayerNorm outputs, the GELU output) have no other owner
    assert saved["int8"] < 0.8 * saved["dense"]


def test_int8_saved_input_passes_a_non_finite_input_on_to_the_weight_gradient():
    layer = _layer("int8", saved_input="int8")
    x = torch.randn(4, 70)
    x[2, 5] = float("inf")
    layer(x).sum().backward()
    assert not layer.weight.grad.isfinite().all()  # as the dense path's: the step's check sees it


def test_int8_saved_input_takes_an_empty_batch_and_a_strided_input():
    dense, int8 = (_layer("int8", saved_input=s) for s in ("dense", "int8"))
    for x in (torch.randn(0, 70), torch.randn(70, 5).t()):  # no tokens (an idle expert), a transpose
        for layer in (dense, int8):
            layer.zero_grad()
            layer(x.clone().requires_grad_()).sum().backward()
        err = (int8.weight.grad - dense.weight.grad).norm() / dense.weight.grad.norm().clamp_min(1e-30)
        assert float(err) < 0.02


def test_int8_saved_input_is_a_train_mode_option():
    with pytest.raises(ValueError, match="saved_input='int8' is a train-mode option"):
        WeightsConfig(format="nf4", mode="frozen", saved_input="int8")
    with pytest.raises(ValueError, match="saved_input"):
        WeightsConfig(format="int8", saved_input="int4")
    lin = nn.Linear(8, 8)
    lin.weight.requires_grad_(False)  # a weight the model froze keeps nothing for a weight gradient
    layer = QuantLinear.from_linear(lin, "int8", WeightsConfig(format="int8", saved_input="int8"))
    assert layer.saved_input == "dense"


def test_requantize_between_forward_and_backward_is_an_error():
    layer = _layer("int8")
    y = layer(torch.randn(2, 70))
    layer.requantize_()
    with pytest.raises(RuntimeError, match="re-quantized between forward and backward"):
        y.sum().backward()


@pytest.mark.parametrize("master", ["fp32", "none"])
def test_a_dropped_model_is_freed_while_its_loss_holds_the_graph(master):
    """A training engine keeps the last loss (and with it the graph) and the model, and the model reaches
    the engine again (hooks, a master-free layer's update): the graph must not hold the layer, or the
    garbage collector, which does not see the graph's C++ edges, never frees the cycle."""
    layer = _layer("int8", master=master)
    holder = nn.Module()
    holder.layer = layer
    holder.loss = layer(torch.randn(2, 70)).sum()  # the graph, kept as an engine keeps its loss
    layer.owner = holder  # the cycle back
    alive = weakref.ref(layer)
    del layer, holder
    gc.collect()
    assert alive() is None


def test_backward_after_the_layer_is_freed_is_an_error():
    layer = _layer("int8")
    y = layer(torch.randn(2, 70))
    del layer
    with pytest.raises(RuntimeError, match="freed between forward and backward"):
        y.sum().backward()


@pytest.mark.parametrize("kind", ["adam", "adam8bit"])
def test_step_hook_requantizes_from_the_master(kind):
    layer = _layer("int8", in_f=128, out_f=64)  # 8192 values: bnb keeps 8-bit states from 4096
    opt = build_optimizer(layer.parameters(), kind, lr=1e-2)
    before = layer.dequantized_weight().clone()
    handle = requantize_after_step(opt, layer)
    layer(torch.randn(8, 128)).square().mean().backward()
    opt.step()
    after = layer.dequantized_weight()
    expected = quantize_weight(layer.weight.detach(), "int8").dequantize()
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, expected, rtol=0, atol=0)
    if kind == "adam8bit":
        assert opt.state[layer.weight]["state1"].dtype == torch.uint8
    # detached: the master moves on, the compute copy stays where it was
    handle.remove()
    layer(torch.randn(8, 128)).square().mean().backward()
    opt.step()
    torch.testing.assert_close(layer.dequantized_weight(), after, rtol=0, atol=0)


def test_hook_refuses_an_optimizer_that_does_not_own_the_masters():
    layer = _layer("int8")
    other = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="none of the 1 QuantLinear master weights is a parameter of SGD"):
        requantize_after_step(torch.optim.SGD(other.parameters(), lr=0.1), layer)


def test_frozen_mode_lora():
    layer = _layer("nf4", mode="frozen", lora_rank=4, lora_alpha=8.0)
    assert layer.weight is None and not layer.bias.requires_grad
    assert [tuple(p.shape) for p in lora_parameters(layer)] == [(4, 70), (45, 4)]
    x = torch.randn(6, 70)
    # B starts at zero: the output is the dequantized base
    torch.testing.assert_close(layer(x), F.linear(x, layer.dequantized_weight(), layer.bias))
    with torch.no_grad():
        layer.lora_B.normal_()
    y = layer(x)
    w = layer.dequantized_weight()
    a, b = layer.lora_A.detach().requires_grad_(), layer.lora_B.detach().requires_grad_()
    yr = F.linear(x, w, layer.bias) + (x @ a.t() @ b.t()) * (8.0 / 4)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    yr.square().sum().backward()
    torch.testing.assert_close(layer.lora_A.grad, a.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.lora_B.grad, b.grad, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="frozen layer has no master"):
        layer.requantize_()


def test_convert_model_gpt_and_state_dict_roundtrip():
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
    blocks = [i for i, k in enumerate(layer_kinds(cfg)) if k == "block"]
    model = convert_model(GPT(cfg), WeightsConfig(format="nf4"), block_layers=blocks)
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear))}
    assert kinds["1.attn.qkv"] == "Linear" and kinds["4.mlp.fc"] == "Linear"  # first and last block
    assert kinds["2.attn.qkv"] == kinds["3.mlp.proj"] == "QuantLinear"
    assert kinds["5.lm_head"] == "Linear"
    sd = copy.deepcopy(model.state_dict())
    other = convert_model(GPT(cfg, seed=1), WeightsConfig(format="nf4"), block_layers=blocks)
    other.load_state_dict(sd)  # masters load, compute copies are re-quantized from them
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)


def test_frozen_state_dict_carries_the_codes():
    a = _layer("int4", mode="frozen")
    b = _layer("int4", mode="frozen", in_f=70, out_f=45)
    with torch.no_grad():
        b.qweight.requantize_(torch.randn(45, 70))
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.qweight.qdata, a.qweight.qdata) and torch.equal(b.qweight.scale, a.qweight.scale)
    with pytest.raises(ValueError, match="checkpoint holds format 'int4', this layer is 'int8'"):
        _layer("int8", mode="frozen").load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "fmt,saved,expected,match",
    [
        ("nf4", {}, {"double_quant": True}, "holds double_quant=False, this layer has double_quant=True"),
        ("nf4", {"double_quant": True}, {}, "holds double_quant=True, this layer has double_quant=False"),
        ("int8", {"block_size": 256}, {}, "holds block_size=256, this layer has block_size=64"),
        ("int8", {"scale_dtype": "bf16"}, {},
         r"scale is a torch.bfloat16 tensor of shape \(50,\); this layer needs a torch.float32 tensor"),
        ("fp8_e4m3", {"fp8_scale": "tensor"}, {}, r"scale is a torch.float32 tensor of shape \(1,\)"),
    ],
)
def test_a_checkpoint_of_another_layout_is_refused_before_anything_is_written(fmt, saved, expected, match):
    """A frozen layer's codes and scales load only into a layer of the same layout: a double-quantized,
    re-blocked, re-typed or per-tensor-scaled checkpoint is named and refused (``copy_`` had broadcast and
    converted it into garbage weights), and the layer keeps what it had."""
    src = _layer(fmt, mode="frozen", **saved)
    dst = _layer(fmt, mode="frozen", in_f=70, out_f=45, **expected)
    with torch.no_grad():
        dst.qweight.requantize_(torch.randn(45, 70))
    before = {k: v.clone() for k, v in dst.qweight.storage_tensors().items()}
    with pytest.raises(ValueError, match=match):
        dst.load_state_dict(src.state_dict())
    assert all(torch.equal(v.view(torch.uint8), before[k].view(torch.uint8))
               for k, v in dst.qweight.storage_tensors().items())


def test_a_checkpoint_without_its_block_size_still_loads_by_its_shapes():
    a, b = _layer("int8", mode="frozen"), _layer("int8", mode="frozen")
    with torch.no_grad():
        b.qweight.requantize_(torch.randn(45, 70))
    sd = a.state_dict()
    del sd["_extra_state"]["block_size"]  # as written before the block size was saved
    b.load_state_dict(sd)
    assert torch.equal(b.qweight.qdata, a.qweight.qdata) and torch.equal(b.qweight.scale, a.qweight.scale)
    sd["_extra_state"]["qdata"] = a.qweight.qdata[:64]
    with pytest.raises(ValueError, match=r"checkpoint's qdata is a torch.int8 tensor of shape \(64,\); this "
                       r"layer needs a torch.int8 tensor of shape \(3150,\)"):
        b.load_state_dict(sd)
    del sd["_extra_state"]["qdata"]
    with pytest.raises(ValueError, match="checkpoint's qdata is missing"):
        b.load_state_dict(sd)


def test_bad_inputs():
    with pytest.raises(ValueError, match="fmt='none' means keep nn.Linear"):
        QuantLinear(4, 4, fmt="none")
    for seed in (-1, 2**32, 1.5):
        with pytest.raises(ValueError, match=rf"sr_seed={seed!r} is not allowed: use an int in \[0, 2\^32\)"):
            QuantLinear(4, 4, fmt="int8", sr_seed=seed)
    assert QuantLinear(4, 4, fmt="int8", sr_seed=2**32 - 1).sr_seed == 2**32 - 1
    with pytest.raises(ValueError, match="weight has shape"):
        QuantLinear(4, 4, fmt="int8", weight=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="wrap a lone nn.Linear"):
        convert_model(nn.Linear(4, 4), "int8")
    with pytest.raises(TypeError, match="input dtype torch.float16 is not supported"):
        _layer("int8")(torch.randn(2, 70, dtype=torch.float16))


# --- DeepSpeed engine (run as a script in a fresh process) --------------------------------------


def _deepspeed_rank() -> None:
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from dist_utils import write_result

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
    kinds = layer_kinds(cfg)
    blocks = [i for i, k in enumerate(kinds) if k == "block"]
    wcfg = WeightsConfig(format="int8", keep_first_blocks=1, keep_last_blocks=1)
    ds_config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    out = {}

    # 1. plain DeepSpeedEngine around the GPT
    model = convert_model(GPT(cfg), wcfg, block_layers=blocks)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    requantize_after_step(engine, engine.module)
    layer = engine.module[2].attn.qkv
    before = layer.dequantized_weight().clone()
    x = torch.randint(0, 64, (2, 16))
    loss = gpt_loss(engine(x), x)
    engine.backward(loss)
    engine.step()
    after = layer.dequantized_weight()
    exact = quantize_weight(layer.weight.detach(), "int8").dequantize()
    out["engine_changed"] = not torch.equal(after, before)
    out["engine_matches_master"] = torch.equal(after, exact)
    out["engine_optimizer"] = type(engine.basic_optimizer).__name__
    # DeepSpeed frees the gradients in step(): measure during the next step, after backward,
    # when gradients and optimizer states are both alive (the peak the ledger predicts)
    engine.backward(gpt_loss(engine(x), x))
    led = measure_storage(engine)
    pred = ledger_from_model(engine.module, None, optimizer="adam")
    out["ledger_equal"] = led.bytes == pred.bytes
    out["ledger"] = [led.bytes, pred.bytes]

    # 2. the same with a bitsandbytes 8-bit Adam handed to DeepSpeed as the client optimizer
    model8 = convert_model(GPT(cfg), wcfg, block_layers=blocks)
    opt8 = build_optimizer(model8.parameters(), "adamw8bit", lr=1e-2)
    cfg8 = {k: v for k, v in ds_config.items() if k != "optimizer"}
    engine8, *_ = deepspeed.initialize(model=model8, optimizer=opt8, config=cfg8)
    requantize_after_step(engine8, engine8.module)
    layer = engine8.module[2].mlp.fc
    before = layer.dequantized_weight().clone()
    engine8.backward(gpt_loss(engine8(x), x))
    engine8.step()
    exact = quantize_weight(layer.weight.detach(), "int8").dequantize()
    out["bnb_changed"] = not torch.equal(layer.dequantized_weight(), before)
    out["bnb_matches_master"] = torch.equal(layer.dequantized_weight(), exact)
    engine8.backward(gpt_loss(engine8(x), x))
    out["bnb_ledger"] = [
        measure_storage(engine8).bytes,
        ledger_from_model(engine8.module, None, "adamw8bit").bytes,
    ]

    # 3. bf16 engines: the fp32 masters live in DeepSpeed's wrapper (stage 0) or ZeRO-1 partitions,
    #    which copy the result into the model's bf16 parameters at the end of their step()
    for zero in (0, 1):
        mb = convert_model(GPT(cfg), wcfg, block_layers=blocks)
        cfg_bf16 = {**ds_config, "bf16": {"enabled": True}, "zero_optimization": {"stage": zero}}
        eb, *_ = deepspeed.initialize(model=mb, model_parameters=mb.parameters(), config=cfg_bf16)
        requantize_after_step(eb, eb.module)
        layer = eb.module[3].mlp.proj
        before = layer.dequantized_weight().clone()
        eb.backward(gpt_loss(eb(x), x))
        eb.step()
        exact = quantize_weight(layer.weight.detach(), "int8").dequantize(torch.float32)
        led = measure_storage(eb)
        n_params = sum(p.numel() for p in eb.module.parameters())
        out[f"bf16_zero{zero}_ledger"] = [led.bytes, n_params]
        out[f"bf16_zero{zero}"] = [
            str(layer.weight.dtype),
            type(eb.optimizer).__name__,
            not torch.equal(layer.dequantized_weight(), before),
            torch.equal(layer.dequantized_weight(), exact),
        ]

    # 4. PipelineModule (1 stage): layer-index names "2.attn.qkv"
    pipe = PipelineModule(layers=gpt_layers(cfg), num_stages=1, loss_fn=gpt_loss)
    convert_model(pipe, wcfg, block_layers=blocks)
    out["pipe_quantized"] = sorted(n for n, m in pipe.named_modules() if isinstance(m, QuantLinear))
    pengine, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=ds_config)
    requantize_after_step(pengine, pengine.module)
    q = next(m for m in pengine.module.modules() if isinstance(m, QuantLinear))
    before = q.dequantized_weight().clone()
    data = iter([(x, x)] * 4)
    out["pipe_loss"] = float(pengine.train_batch(data_iter=data))
    exact = quantize_weight(q.weight.detach(), "int8").dequantize()
    out["pipe_changed"] = not torch.equal(q.dequantized_weight(), before)
    out["pipe_matches_master"] = torch.equal(q.dequantized_weight(), exact)
    write_result(out)


@pytest.mark.distributed
def test_requantize_hook_with_a_real_deepspeed_engine():
    from dist_utils import run_ranks

    (res,) = run_ranks(__file__, 1, ["--deepspeed-rank"], timeout=300)
    assert res["engine_optimizer"] in ("Adam", "AdamW")  # torch optimizer inside the engine
    assert res["engine_changed"] and res["engine_matches_master"]
    assert res["ledger_equal"], "\n".join(map(str, res["ledger"]))
    assert res["bnb_changed"] and res["bnb_matches_master"]
    assert res["bf16_zero0"] == ["torch.bfloat16", "FP16_UnfusedOptimizer", True, True]
    assert res["bf16_zero1"] == ["torch.bfloat16", "DeepSpeedZeroOptimizer", True, True]
    for zero in (0, 1):
        led, n = res[f"bf16_zero{zero}_ledger"]
        # the wrapper's fp32 masters (4 B/param) are measured; Adam's moments are fp32 (8 B/param)
        assert led["optimizer.wrapper"] >= 4 * n, (zero, led)
        assert led["optimizer.state"] == 8 * n, (zero, led)
    measured, predicted = res["bnb_ledger"]
    assert measured == predicted and measured["optimizer.state_8bit"] > 0
    # blocks are layers 1..4; the first and last stay dense
    assert res["pipe_quantized"] == [
        f"{i}.{n}" for i in (2, 3) for n in ("attn.proj", "attn.qkv", "mlp.fc", "mlp.proj")
    ]
    assert res["pipe_changed"] and res["pipe_matches_master"]


def _pipeline_rank() -> None:
    """Two pipeline stages, each converting and re-quantizing its own layers; rank 0 also trains the
    same model in one process (same thread count) as the reference."""
    import os

    import deepspeed
    from deepspeed.pipe import PipelineModule
    from dist_utils import write_result

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
    blocks = [i for i, k in enumerate(layer_kinds(cfg)) if k == "block"]
    wcfg = WeightsConfig(format="nf4", keep_first_blocks=0, keep_last_blocks=1)
    # DeepSpeed 0.19.8 clips gradients to norm 1.0 by default (runtime/constants.py); the reference does not
    ds_config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
    }
    torch.manual_seed(0)
    batches = [torch.randint(0, 64, (4, 16)) for _ in range(3)]

    pipe = PipelineModule(layers=gpt_layers(cfg), num_stages=2, loss_fn=gpt_loss, partition_method="uniform")
    convert_model(pipe, wcfg, block_layers=blocks, num_blocks=len(blocks))
    opt = build_optimizer([p for p in pipe.parameters()], "adam", lr=1e-2)
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=opt, config=ds_config)
    requantize_after_step(engine, engine.module)
    mine = sorted(n for n, m in engine.module.named_modules() if isinstance(m, QuantLinear))
    losses = [float(engine.train_batch(data_iter=iter([(b, b)]))) for b in batches]
    out = {"rank": int(os.environ["RANK"]), "quantized": mine, "losses": losses}
    if out["rank"] == 0:
        ref = convert_model(GPT(cfg), wcfg, block_layers=blocks)
        ropt = build_optimizer(ref.parameters(), "adam", lr=1e-2)
        requantize_after_step(ropt, ref)
        out["reference"] = []
        for b in batches:
            ropt.zero_grad(set_to_none=True)
            loss = gpt_loss(ref(b), b)
            loss.backward()
            ropt.step()
            out["reference"].append(loss.item())
    write_result(out)
    # Rank 1 waits for rank 0's reference run and both leave the group together: a rank that exited
    # while its peer still held the gloo connections once aborted in teardown ("terminate called
    # without an active exception", exit -6) after its result was written.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.distributed
def test_two_stage_deepspeed_pipeline_matches_one_process():
    from dist_utils import run_ranks

    r0, r1 = run_ranks(__file__, 2, ["--pipeline-rank"], timeout=300)
    # uniform split of [embed, 4 blocks, head]: stage 0 = layers 0-2, stage 1 = layers 3-5;
    # the last block (layer 4) stays dense, so stage 1 quantizes only layer 3
    assert r0["quantized"] == [
        f"{i}.{n}" for i in (1, 2) for n in ("attn.proj", "attn.qkv", "mlp.fc", "mlp.proj")
    ]
    assert r1["quantized"] == [f"3.{n}" for n in ("attn.proj", "attn.qkv", "mlp.fc", "mlp.proj")]
    assert r1["losses"] == r0["losses"]  # the engine broadcasts the last stage's loss
    torch.testing.assert_close(
        torch.tensor(r0["losses"]), torch.tensor(r0["reference"]), rtol=1e-4, atol=1e-5
    )
    assert r0["losses"][-1] < r0["losses"][0]


if __name__ == "__main__" and "--deepspeed-rank" in sys.argv:
    _deepspeed_rank()
if __name__ == "__main__" and "--pipeline-rank" in sys.argv:
    _pipeline_rank()
