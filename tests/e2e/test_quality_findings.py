"""The quality study's verdicts (benchmarks/e2e/bench_quality.py): each finding judged against the
baseline's seed noise, on loss for the GPT settings and on accuracy for the CNN setting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "e2e"))


def test_quality_findings_judged_against_seed_noise():
    from bench_quality import findings, seed_noise

    def row(name, group, compressed, plain=None):
        return {"name": name, "group": group, "val_loss_compressed": compressed,
                "val_loss_plain": compressed if plain is None else plain}

    rows = [row("uncompressed", "baseline", 4.00), row("uncompressed seed+1", "seed noise", 4.02),
            row("uncompressed seed+2", "seed noise", 3.99), row("a4/g8", "bits", 4.01),
            row("a8/g4", "bits", 4.20), row("top10% reuse", "topk", 4.05, plain=4.06)]
    assert seed_noise(rows) == pytest.approx(0.02)
    text = "\n".join(findings(rows))
    assert "gradients more sensitive" in text and "holds (gap +0.1900 > seed noise 0.0200)" in text
    assert "same direction, within seed noise (gap +0.0100 <= 0.0200)" in text  # TopK at evaluation
    assert "TopK10% without index reuse worse" in text and "not measured" in text


def test_quality_findings_on_accuracy_flip_the_sign_and_cnn_setting_is_sound():
    """On the CNN setting a finding is judged on test accuracy (higher is better); the generated images
    are deterministic and balanced; codec 'none' leaves the staged ResNet identical to the plain one."""
    from bench_quality import check_findings, seed_noise
    from quality_cnn import CNN_DEFAULTS, check_cnn_reference, make_images

    def row(name, group, acc, plain=None):
        return {"name": name, "group": group, "acc_compressed": acc,
                "acc_plain": acc if plain is None else plain, "val_loss_compressed": 1.0,
                "val_loss_plain": 1.0}

    rows = [row("uncompressed", "baseline", 90.0), row("uncompressed seed+1", "seed noise", 89.5),
            row("a4/g8 per-sample", "granularity", 89.0), row("a8/g4 per-sample", "granularity", 80.0),
            row("a2/g8", "bits", 70.0, plain=40.0)]
    assert seed_noise(rows, "acc") == pytest.approx(0.5)
    got = {k: (text, v) for k, text, v in check_findings(rows, "acc", "per-channel")}
    text, v = got["gradients more sensitive than activations (4 bits, per-sample scales, swapped)"]
    assert v == "holds" and "Δ acc a8/g4 per-sample = -10.00 pts" in text and "gap +9.00 pts" in text
    assert got["2-bit activations need compression at evaluation"][1] == "holds"  # 40% plain < 70% with it
    assert got["TopK10% without index reuse worse"][1] == "not measured"

    x, y = make_images(400, seed=3)
    x2, y2 = make_images(400, seed=3)
    assert x.shape == (400, 3, 16, 16) and torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(make_images(400, seed=4)[0], x)
    assert torch.bincount(y, minlength=10).min() > 20  # every class present
    with pytest.raises(ValueError, match="n=0"):
        make_images(0, seed=0)
    check_cnn_reference({**CNN_DEFAULTS, "seed": 0})  # raises SystemExit on a mismatch
