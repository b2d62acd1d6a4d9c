"""A small GPT trained with int8 and NF4 weight storage ends within 2% of the fp32 model's validation
loss on the same data, steps and seed (stdlib text, locally trained BPE: ``deepspeed_ppq.data``).

Every transformer block is low-bit here (``keep_first_blocks = keep_last_blocks = 0``); the
embeddings, norms and the LM head stay fp32 as the policy's defaults say. The compute copies are
refreshed after every step by ``requantize_after_step``.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepspeed_ppq.config import WeightsConfig
from deepspeed_ppq.data import build_token_datasets
from deepspeed_ppq.models.gpt import GPT, GPTConfig, gpt_loss, layer_kinds
from deepspeed_ppq.quant import QuantLinear, build_optimizer, convert_model, requantize_after_step

STEPS, BATCH, SEQ, LR = 150, 16, 32, 2e-3


@pytest.fixture(scope="module")
def data():
    train, val, _ = build_token_datasets(seq_len=SEQ, vocab_size=300, max_bytes=200_000)
    xs = torch.stack([train[i][0] for i in range(STEPS * BATCH)]).view(STEPS, BATCH, SEQ)
    ys = torch.stack([train[i][1] for i in range(STEPS * BATCH)]).view(STEPS, BATCH, SEQ)
    vx = torch.stack([val[i][0] for i in range(128)])
    vy = torch.stack([val[i][1] for i in range(128)])
    return xs, ys, vx, vy


@pytest.fixture
def one_thread():
    # tiny matmuls on a shared 2-core machine: a second OpenMP thread only waits for a busy core
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run(data, fmt: str | None, optimizer: str = "adam") -> tuple[float, float, int]:
    xs, ys, vx, vy = data
    cfg = GPTConfig(vocab_size=300, seq_len=SEQ, d_model=64, n_heads=2, n_layers=4)
    model = GPT(cfg, seed=0)
    if fmt is not None:
        blocks = [i for i, k in enumerate(layer_kinds(cfg)) if k == "block"]
        wcfg = WeightsConfig(format=fmt, keep_first_blocks=0, keep_last_blocks=0)
        convert_model(model, wcfg, block_layers=blocks)
    n_quant = sum(isinstance(m, QuantLinear) for m in model.modules())
    opt = build_optimizer(model.parameters(), optimizer, lr=LR)
    # warm-up then cosine decay: every run ends at a settled point, not mid-oscillation
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / len(xs))))
    )
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
    for fmt, opt in (("int8", "adam"), ("nf4", "adam"), ("nf4", "adam8bit")):
        _, loss, n = _run(data, fmt, opt)
        assert n == 16  # 4 blocks x (qkv, proj, fc, proj)
        print(f"{fmt}/{opt}: val loss {loss:.4f}, fp32 {ref:.4f}, start {start:.4f}")
        rel = abs(loss - ref) / ref
        assert rel < 0.02, f"{fmt}/{opt}: val loss {loss:.4f} vs fp32 {ref:.4f} ({100 * rel:.2f}% off)"
        assert loss != ref  # the low-bit run really differs
