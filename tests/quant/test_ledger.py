"""Memory ledger: the analytic prediction equals the storage a live model and optimizer hold, per category."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from deepspeed_ppq.config import WeightsConfig
from deepspeed_ppq.formats import WEIGHT_FORMATS
from deepspeed_ppq.models.gpt import GPT, GPTConfig, gpt_loss, layer_kinds
from deepspeed_ppq.quant import (
    ParamSpec,
    build_optimizer,
    clear_workspace,
    convert_model,
    ledger_from_model,
    ledger_from_shapes,
    lora_parameters,
    measure_storage,
    optimizer_kind,
    quantize_weight,
    weight_storage_bytes,
)

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_heads=2, n_layers=4)
BLOCKS = [i for i, k in enumerate(layer_kinds(CFG)) if k == "block"]


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_weight_storage_bytes_equal_the_format_storage(fmt):
    shapes = [(7,), (33, 65), (64, 64), (3, 1000)]
    for shape, bs, sd, dq in itertools.product(shapes, [16, 64, 4096], ["fp32", "bf16"], [False, True]):
        qw = quantize_weight(torch.randn(shape), fmt, bs, sd, dq)
        got = weight_storage_bytes(shape, fmt, bs, sd, dq)
        real = {k: t.numel() * t.element_size() for k, t in qw.storage_tensors().items()}
        assert got["codes"] == real.pop("qdata"), (shape, bs, sd, dq)
        assert got["scales"] == sum(real.values()), (shape, bs, sd, dq)
    if fmt.startswith("fp8"):
        for dq in (False, True):
            qw = quantize_weight(torch.randn(33, 65), fmt, 64, "fp32", dq, fp8_scale="tensor")
            assert sum(weight_storage_bytes((33, 65), fmt, 64, "fp32", dq, "tensor").values()) == qw.nbytes


def _train(model, opt, steps=1):
    torch.manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    for _ in range(steps):  # leave the last gradients in place: weights + grads + states all alive
        opt.zero_grad(set_to_none=True)
        gpt_loss(model(x), x).backward()
        opt.step()


@pytest.mark.parametrize(
    "fmt,kind,mode,extra",
    [
        ("int8", "adam", "train", {}),
        ("nf4", "adam8bit", "train", {"double_quant": True}),
        ("int4", "adamw8bit", "train", {"scale_dtype": "bf16", "block_size": 128}),
        ("fp8_e4m3", "sgd", "train", {"fp8_scale": "tensor"}),
        ("nf4", "adamw", "frozen", {"lora_rank": 4}),
        ("int8", "adam8bit", "frozen", {"lora_rank": 64}),  # adapters of >= 4096 values get 8-bit states
    ],
)
def test_ledger_equals_measured_storage(fmt, kind, mode, extra):
    wcfg = WeightsConfig(format=fmt, mode=mode, **extra)
    predicted = ledger_from_model(GPT(CFG), wcfg, optimizer=kind, block_layers=BLOCKS)
    model = convert_model(GPT(CFG), wcfg, block_layers=BLOCKS)
    if mode == "frozen":
        for p in model.parameters():
            p.requires_grad_(False)
        for p in lora_parameters(model):
            p.requires_grad_(True)
        # the ledger follows requires_grad: predict again for the frozen-except-LoRA model
        frozen = GPT(CFG).requires_grad_(False)
        predicted = ledger_from_model(frozen, wcfg, optimizer=kind, block_layers=BLOCKS)
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], kind, lr=1e-3)
    clear_workspace()  # buffers of other tests' shapes/dtypes must not be counted
    _train(model, opt)
    measured = measure_storage(model, opt)
    assert measured.bytes == predicted.bytes, (
        f"\n{predicted.table('predicted')}\n{measured.table('measured')}"
    )
    # the converted model predicts the same as the plan did
    assert ledger_from_model(model, None, optimizer=kind).bytes == predicted.bytes
    assert measured.total == sum(measured.bytes.values())
    # one fp32 dequantization buffer, as large as the largest low-bit weight (mlp.fc, mlp.proj)
    assert measured["workspace"] == 4 * 256 * 64
    if kind.endswith("8bit"):
        assert measured["optimizer.state_8bit"] > 0 and measured["optimizer.qmap"] == 2048


def test_fp32_adam_costs_8_bytes_per_param_and_meta_models_allocate_nothing():
    with torch.device("meta"):
        big = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 4096, bias=False))
    n = 2 * 4096 * 4096
    led = ledger_from_model(big, None, optimizer="adam")
    assert led.bytes == {
        "weights.dense.float32": 4 * n,
        "gradients": 4 * n,
        "optimizer.state": 8 * n,
        "optimizer.step": 8,
    }
    led8 = ledger_from_model(
        big, WeightsConfig(format="int4", keep_first_blocks=0, keep_last_blocks=0), optimizer="adam8bit"
    )
    blocks64 = n // 64
    assert led8["weights.int4"] == n // 2 + blocks64 * 4
    assert led8["master_weights"] == 4 * n and led8["gradients"] == 4 * n
    assert led8["optimizer"] == 2 * n + 2 * (n // 256) * 4 + 2048
    assert led8.groups()["optimizer"] == led8["optimizer"]


def test_ledger_from_shapes_matches_the_model_description():
    wcfg = WeightsConfig(format="int8", keep_first_blocks=0, keep_last_blocks=0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 64, bias=False))
    entries = [
        ("0.weight", (256, 64), "int8"),
        ("0.bias", (256,), None),
        ("1.weight", (256,), "none"),
        ("1.bias", (256,), "none"),
        ParamSpec("2.weight", (64, 256), "int8"),
    ]
    for kind in ("adam", "adam8bit", "sgd"):
        a = ledger_from_shapes(entries, wcfg, optimizer=kind)
        b = ledger_from_model(model, wcfg, optimizer=kind)
        assert a.bytes == b.bytes, kind
    assert ledger_from_shapes(entries, wcfg, optimizer="sgd", momentum=0.9)["optimizer.state"] == 4 * (
        256 * 64 + 256 + 256 + 256 + 64 * 256
    )
    total = ledger_from_shapes(entries, wcfg) + ledger_from_shapes(entries, wcfg)
    assert total.total == 2 * ledger_from_shapes(entries, wcfg).total
    assert "total" in total.table() and total.to_dict()["total"] == total.total


def test_bf16_dense_params_and_buffers():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(torch.bfloat16)
    led = ledger_from_model(model, None, optimizer="adam")
    opt = build_optimizer(model.parameters(), "adam")
    model.train()
    model(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    assert measure_storage(model, opt).bytes == led.bytes
    assert led["weights.dense.bfloat16"] == 2 * (64 + 8 + 8 + 8)
    assert led["buffers"] == 2 * 8 + 2 * 8 + 8  # running mean/var (bf16) + num_batches_tracked (int64)


def test_bad_inputs():
    with pytest.raises(ValueError, match="optimizer='lamb' is not supported; use one of adam"):
        ledger_from_shapes([("w", (4, 4), "int8")], optimizer="lamb")
    with pytest.raises(ValueError, match="ledger entry 'w': format='int5' is not a weight format"):
        ledger_from_shapes([("w", (4, 4), "int5")])
    with pytest.raises(TypeError, match="expected ParamSpec or"):
        ledger_from_shapes(["w"])
    assert math.prod(()) == 1  # a 0-dim parameter counts one value
    assert ledger_from_shapes([("s", (), None)], optimizer=None).bytes == {
        "weights.dense.float32": 4,
        "gradients": 4,
    }


def test_optimizer_kind_follows_the_config():
    assert optimizer_kind(WeightsConfig()) == "adamw"
    assert optimizer_kind(WeightsConfig(optimizer_8bit=True)) == "adamw8bit"
    assert optimizer_kind(WeightsConfig(optimizer_8bit=True), "adam") == "adam8bit"
    with pytest.raises(ValueError, match="optimizer_8bit=true needs an Adam-type optimizer"):
        optimizer_kind(WeightsConfig(optimizer_8bit=True), "sgd")


class _UserLoRA(nn.Module):
    """A LoRA adapter as a fine-tuning script writes it (PEFT-style): the base layer frozen inside."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + (x @ self.A.t()) @ self.B.t()


def _user_lora_gpt() -> nn.Module:
    """The small GPT with every block Linear wrapped in a user LoRA adapter, all else frozen."""
    model = GPT(CFG).requires_grad_(False)
    for name, mod in list(model.named_modules()):
        for child, sub in list(mod.named_children()):
            top = name.split(".")[0]
            if isinstance(sub, nn.Linear) and top.isdigit() and int(top) in BLOCKS:
                setattr(mod, child, _UserLoRA(sub))
    return model


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_a_weight_the_model_froze_keeps_only_its_codes(fmt):
    """A LoRA fine-tune's own frozen base layers go low-bit without a master, a gradient or adapters
    of ppq's; the ledger predicts exactly what the trained model holds."""
    wcfg = WeightsConfig(format=fmt, keep_first_blocks=0, keep_last_blocks=0)
    predicted = ledger_from_model(_user_lora_gpt(), wcfg, optimizer="adamw", block_layers=BLOCKS)
    model = convert_model(_user_lora_gpt(), wcfg, block_layers=BLOCKS)
    frozen = [m for m in model.modules() if type(m).__name__ == "QuantLinear"]
    assert len(frozen) == 4 * len(BLOCKS)
    assert all(m.mode == "frozen" and m.weight is None and m.lora_A is None for m in frozen)
    assert lora_parameters(model) == []
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == sum(
        p.numel() for n, p in _user_lora_gpt().named_parameters() if p.requires_grad)
    opt = build_optimizer(trainable, "adamw", lr=1e-3)
    clear_workspace()
    _train(model, opt)
    assert all(m.base.qweight is not None for m in model.modules() if isinstance(m, _UserLoRA))
    measured = measure_storage(model, opt)
    assert measured.bytes == predicted.bytes, (
        f"\n{predicted.table('predicted')}\n{measured.table('measured')}")
    assert "master_weights" not in predicted.bytes
