"""End to end: `python -m megatron_patches.run <script> ... --ppq-*` on 2 gloo ranks (TP 1, PP 2).

The script (tests/mcore/pretrain_tiny_gpt.py) is a stand-in for Megatron-LM's pretrain_gpt.py that
knows nothing about ppq; it builds a megatron-core GPTModel per stage and calls megatron-core's own
schedule without a communicator, as Megatron-LM's train_step does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_utils import run_ranks

SCRIPT = str(Path(__file__).parent / "mcore" / "pretrain_tiny_gpt.py")
PPQ = ["--ppq-weights-format", "int8", "--ppq-activations-method", "quant", "--ppq-activations-bits", "8",
       "--ppq-gradients-method", "quant", "--ppq-gradients-bits", "8"]


@pytest.mark.distributed
def test_gpt_pp2_trains_with_int8_weights_and_8bit_activations():
    ranks = run_ranks("-m", 2, ["megatron_patches.run", SCRIPT, "--transformer-impl", "local",
                                "--train-iters", "8", *PPQ], timeout=400)
    first, last = sorted(ranks, key=lambda r: r["rank"])
    for r in ranks:
        assert r["communicator"] == "BoundPPQP2PCommunicator"
        assert r["lowbit_formats"] == ["int8"]
        # 4 layers, first and last kept dense: one int8 block per stage, 4 linears each
        assert r["lowbit_layers"] == 4
    losses = last["losses"]
    assert len(losses) == 8
    assert losses[-1] < 0.9 * losses[0], losses
    # 8-bit codes + per-token scales instead of fp32: about a quarter of the bytes
    assert first["wire_bytes"]["activations"] < 0.35 * first["raw_bytes"]["activations"]
    assert last["wire_bytes"]["gradients"] < 0.35 * last["raw_bytes"]["gradients"]


@pytest.mark.distributed
def test_launcher_rejects_bad_flags_before_starting():
    with pytest.raises(RuntimeError, match="AQ-SGD needs each sample's dataset index"):
        run_ranks("-m", 1, ["megatron_patches.run", SCRIPT, "--ppq-activations-method", "quant",
                            "--ppq-aqsgd-enabled"], timeout=120)
