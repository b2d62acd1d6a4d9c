"""A small GPT trained with int8 and NF4 weight storage ends within 2% of the fp32 model's validation
loss on the same data, steps and seed (stdlib text, locally trained BPE: ``examples/stdlib_text.py``).

Every transformer block is low-bit here (``keep_first_blocks = keep_last_blocks = 0``); the
embeddings, norms and the LM head stay fp32 as the policy's defaults say. The compute copies are
refreshed after every step by ``requantize_after_step``.

Master-free runs (``weights.master="none"``: only the 8-bit codes, AdamW in fp32 on the dequantized
weight, stochastic-rounding re-quantization; ``quant.master_free``) must also end within 2%: int8 with
8-bit AdamW states (7.1 B/value instead of 16) and fp8_e4m3 with fp32 states. Their gradients are
clipped separately (their own norm, 1.0), the rest by ``clip_grad_norm_``.
"""

from __future__ import annotations

import math

import pytest
import torch
from stdlib_text import build_token_datasets

from deepspeed_ppq.config import WeightsConfig
from deepspeed_ppq.models.gpt import GPT, GPTConfig, gpt_loss, layer_kinds
from deepspeed_ppq.quant import (
    QuantLinear,
    attach_master_free,
    build_optimizer,
    convert_model,
    requantize_after_step,
)

STEPS, BATCH, SEQ, LR = 150, 16, 32, 2e-3


@pytest.fixture(scope="module")
def data():
    train, val, _ = build_token_datasets(seq_len=SEQ, vocab_size=300, max_bytes=200_000)
    xs = torch.stack([train[i][0] for i in range(STEPS * BATCH)]).view(STEPS, BATCH, SEQ)
    ys = torch.stack([train[i][1] for i in range(STEPS * BATCH)]).view(STEPS, BATCH, SEQ)
    vx = torch.stack([val[i][0] for i in range(128)])
    vy = torch.stack([val[i][1] for i in range(128)])
    return xs, ys, vx, vy


def _run(data, fmt: str | None, optimizer: str = "adam", master: str = "fp32",
         state_8bit: bool = False) -> tuple[float, float, int]:
    xs, ys, vx, vy = data
    cfg = GPTConfig(vocab_size=300, seq_len=SEQ, d_model=64, n_heads=2, n_layers=4)
    model = GPT(cfg, seed=0)
    if fmt is not None:
        blocks = [i for i, k in enumerate(layer_kinds(cfg)) if k == "block"]
        wcfg = WeightsConfig(format=fmt, keep_first_blocks=0, keep_last_blocks=0, master=master,
                             optimizer_8bit=state_8bit)
        convert_model(model, wcfg, block_layers=blocks)
    n_quant = sum(isinstance(m, QuantLinear) for m in model.modules())
    opt = build_optimizer(model.parameters(), optimizer, lr=LR)
    # warm-up then cosine decay: every run ends at a settled point, not mid-oscillation
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / len(xs))))
    )
    if master == "none":
        attach_master_free(opt, model, max_grad_norm=1.0)
    else:
        requantize_after_step(opt, model)
    torch.manual_seed(0)
    with torch.no_grad():
        start = gpt_loss(model(vx), vy).item()
    for x, y in zip(xs, ys):
        opt.zero_grad(set_to_none=True)
        gpt_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    with torch.no_grad():
        return start, gpt_loss(model(vx), vy).item(), n_quant


@pytest.mark.slow
def test_low_bit_training_stays_within_2_percent_of_fp32(data, one_thread):
    start, ref, n0 = _run(data, None)
    assert n0 == 0
    assert ref < 0.8 * start, (
        f"the fp32 model did not learn ({start:.3f} -> {ref:.3f}); the test would be vacuous"
    )
    runs = (
        ("int8", "adam", "fp32", False),
        ("nf4", "adam", "fp32", False),
        ("nf4", "adam8bit", "fp32", False),
        ("int8", "adam", "none", True),  # master-free, 8-bit AdamW states
        ("fp8_e4m3", "adam", "none", False),  # master-free, fp32 AdamW states
    )
    for fmt, opt, master, state_8bit in runs:
        _, loss, n = _run(data, fmt, opt, master, state_8bit)
        assert n == 16  # 4 blocks x (qkv, proj, fc, proj)
        name = f"{fmt}/{opt}/master={master}" + ("/8-bit states" if state_8bit else "")
        print(f"{name}: val loss {loss:.4f}, fp32 {ref:.4f}, start {start:.4f}")
        rel = abs(loss - ref) / ref
        assert rel < 0.02, f"{name}: val loss {loss:.4f} vs fp32 {ref:.4f} ({100 * rel:.2f}% off)"
        assert loss != ref  # the low-bit run really differs
