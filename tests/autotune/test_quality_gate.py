"""The autotuner's quality gate (``deepspeed_ppq.autotune.gate``): its statistics, its refusals, and a
real training run showing that it rejects a damaging compression plan and accepts a harmless one.

The training test trains the package's small GPT in one process with ``compressed_boundary`` at the 3
boundaries of a 4-stage pipeline (the single-process reference the engines must match), over 3 seeds
uncompressed (the baseline), then once each with 8-bit activations/8-bit gradients (harmless) and
8-bit activations/2-bit gradients (damaging). Seeds change the initialisation and the data order.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from deepspeed_ppq.autotune.gate import MIN_SEEDS, GateVerdict, QualityGate

# --- statistics ---------------------------------------------------------------------------------


def test_mean_spread_limit_and_verdicts():
    gate = QualityGate([3.0, 3.02, 3.04], tolerance=0.02)
    assert gate.mean == pytest.approx(3.02)
    assert gate.spread == pytest.approx(0.04)  # max - min
    assert gate.std == pytest.approx(0.02)
    assert gate.slack == pytest.approx(0.0604)
    assert gate.limit == pytest.approx(3.0804)

    ok = gate.check(3.08)
    assert isinstance(ok, GateVerdict) and ok.accepted and bool(ok)
    assert ok.margin == pytest.approx(0.0004)
    assert ok.reason.startswith("accepted: val loss 3.0800")
    assert "spread 0.0400" in ok.reason and "limit 3.0804" in ok.reason

    bad = gate.check(3.081)
    assert not bad.accepted and not bad
    assert bad.margin == pytest.approx(-0.0006)
    assert bad.reason.startswith("rejected:")

    better = gate.check(2.5)  # one-sided: lower loss is always fine
    assert better.accepted and better.margin == pytest.approx(0.5804)


def test_candidate_seeds_are_averaged():
    gate = QualityGate([3.0, 3.02, 3.04], tolerance=0.02)
    v = gate.check([3.0, 3.2])  # mean 3.1 > 3.0804 although one seed passes
    assert not v.accepted
    assert v.candidate == pytest.approx(3.1)
    assert v.candidate_losses == (3.0, 3.2)
    assert "mean of 2" in v.reason
    assert gate.check([3.0, 3.1]).accepted  # mean 3.05


def test_non_finite_candidate_is_rejected_not_raised():
    gate = QualityGate([3.0, 3.02, 3.04], tolerance=0.02)
    for bad in (float("nan"), float("inf"), [3.0, float("nan")]):
        v = gate.check(bad)
        assert not v.accepted and math.isnan(v.margin)
        assert "not finite" in v.reason


def test_to_dict_round_trips_figures():
    gate = QualityGate([2.0, 2.01, 2.02, 2.03], tolerance=0.05)
    d = gate.to_dict()
    assert d["seeds"] == 4 and d["losses"] == [2.0, 2.01, 2.02, 2.03]
    assert d["spread"] == pytest.approx(0.03) and d["spread_kind"] == "max - min"
    assert d["limit"] == pytest.approx(2.015 * 1.05)
    v = gate.check(2.2).to_dict()
    assert v["accepted"] is False and v["candidate_losses"] == [2.2]
    assert set(v) == {"accepted", "candidate", "candidate_losses", "baseline_mean", "spread", "limit",
                      "margin", "reason"}


# --- refusals -----------------------------------------------------------------------------------


def test_tolerance_below_spread_is_refused():
    # spread 0.1 (3.3% of 3.0) against 1% of slack: seed noise would decide
    with pytest.raises(ValueError, match=r"cannot tell a plan from seed noise: baseline spread 0\.1 .* "
                                         r"tolerance 0\.03 .*train longer or use more seeds"):
        QualityGate([2.95, 3.05, 3.0], tolerance=0.01)
    with pytest.raises(ValueError, match="seed noise"):  # equal is not enough either
        QualityGate([1.0, 1.0, 1.5], tolerance=0.5 / (3.5 / 3))
    with pytest.raises(ValueError, match="seed noise"):
        QualityGate([1.0, 1.0, 1.0], tolerance=0.0)


def test_too_few_seeds_and_bad_values():
    assert MIN_SEEDS == 3
    with pytest.raises(ValueError, match=r"baseline_losses has 2 seed\(s\): the gate needs at least 3"):
        QualityGate([3.0, 3.01], tolerance=0.05)
    with pytest.raises(ValueError, match="baseline_losses has 1 seed"):
        QualityGate(3.0, tolerance=0.05)
    with pytest.raises(ValueError, match="non-finite"):
        QualityGate([3.0, float("nan"), 3.01], tolerance=0.05)
    with pytest.raises(ValueError, match=r"tolerance=-0\.01: must be a finite fraction >= 0"):
        QualityGate([3.0, 3.0, 3.01], tolerance=-0.01)
    with pytest.raises(ValueError, match="mean .* <= 0"):
        QualityGate([0.0, 0.0, 0.0], tolerance=0.05)
    with pytest.raises(TypeError, match=r"baseline_losses\[1\]='x' is not a number"):
        QualityGate([3.0, "x", 3.0], tolerance=0.05)
    with pytest.raises(TypeError, match="must be a float or a list of floats"):
        QualityGate("3.0", tolerance=0.05)
    gate = QualityGate([3.0, 3.0, 3.01], tolerance=0.05)
    with pytest.raises(ValueError, match="candidate_losses is empty"):
        gate.check([])


def test_gate_imports_no_engine_or_model():
    src = Path(__file__).resolve().parents[2] / "deepspeed_ppq" / "autotune" / "gate.py"
    mods = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module.split(".")[0])
    assert not mods & {"deepspeed", "megatron", "deepspeed_ppq"}, mods


# --- real training ------------------------------------------------------------------------------

STEPS, BATCH, SEQ, LR, VAL = 240, 16, 32, 2e-3, 256
TOLERANCE = 0.01  # the autotuner's default val_loss_tolerance


@pytest.fixture(scope="module")
def gpt_data():
    from stdlib_text import build_token_datasets

    train, val, _ = build_token_datasets(seq_len=SEQ, vocab_size=300, max_bytes=200_000)
    n = min(VAL, len(val))
    vx = torch.stack([val[i][0] for i in range(n)])
    vy = torch.stack([val[i][1] for i in range(n)])
    return train, vx, vy


class _Boundary(nn.Module):
    """One pipeline boundary in one process: activations coded forward, gradients backward; evaluation
    codes the activation when the codec says so (``compress_eval``: on at <= 4 bits)."""

    def __init__(self, act: dict, grad: dict):
        from deepspeed_ppq.compress import BoundaryChannel
        from deepspeed_ppq.config import load_ppq_config

        super().__init__()
        self.train_channel = BoundaryChannel(load_ppq_config({"activations": act, "gradients": grad}))
        self.eval_channel = BoundaryChannel(load_ppq_config({"activations": act}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_ppq.compress import compressed_boundary

        if self.training:
            return compressed_boundary(x, self.train_channel)
        return compressed_boundary(x, self.eval_channel, training=False)


def _train(data, seed: int, act: dict, grad: dict) -> tuple[float, int]:
    """Validation loss after STEPS of AdamW (warm-up, cosine) and the gradient bytes sent at boundaries."""
    from deepspeed_ppq.models.gpt import GPTConfig, gpt_layers, gpt_loss

    train, vx, vy = data
    cfg = GPTConfig(vocab_size=300, seq_len=SEQ, d_model=64, n_heads=2, n_layers=4)
    layers, bounds = [], []
    for i, layer in enumerate(gpt_layers(cfg, seed)):  # [embed, 4 blocks, head]: cut after blocks 1, 2, 3
        layers.append(layer)
        if i in (1, 2, 3):
            bounds.append(_Boundary(act, grad))
            layers.append(bounds[-1])
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / STEPS)))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    assert STEPS * BATCH <= len(train)
    for step in range(STEPS):
        idx = order[step * BATCH:(step + 1) * BATCH].tolist()
        x = torch.stack([train[i][0] for i in idx])
        y = torch.stack([train[i][1] for i in idx])
        opt.zero_grad(set_to_none=True)
        gpt_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    with torch.no_grad():
        loss = gpt_loss(model(vx), vy).item()
    return loss, sum(b.train_channel.stats["gradients"]["wire_bytes"] for b in bounds)


@pytest.mark.slow
def test_gate_rejects_2bit_gradients_and_accepts_8bit_in_real_training(gpt_data, one_thread):
    none: dict = {}
    baseline = [_train(gpt_data, seed, none, none)[0] for seed in range(3)]
    gate = QualityGate(baseline, tolerance=TOLERANCE)  # raises if the seeds' spread were >= 1%
    print(f"baseline {baseline}: {gate}")

    def q(bits: int) -> dict:
        return {"method": "quant", "bits": bits, "granularity": "token"}

    harmless, g8_bytes = _train(gpt_data, 0, q(8), q(8))
    damaging, g2_bytes = _train(gpt_data, 0, q(8), q(2))
    assert g2_bytes < g8_bytes / 2  # the 2-bit gradients really went through the codec
    ok, bad = gate.check(harmless), gate.check(damaging)
    print(f"a8/g8: {ok}\na8/g2: {bad}")
    assert all(v not in baseline for v in (harmless, damaging))  # the codecs changed the training
    assert ok.accepted, ok.reason
    assert not bad.accepted, bad.reason
    assert gate.spread < gate.slack
