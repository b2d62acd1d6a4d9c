"""Per-stage low-bit weights, per-stage recomputation and the re-quantization hook wired by
``deepspeed_ppq.initialize``, on 2 real gloo ranks against the single-process model
(tests/dist/ds_stage.py)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import ROOT, run_ranks

from deepspeed_ppq.config import PPQConfigError
from deepspeed_ppq.integrations.stage import infer_block_layers, recompute_flags

SCRIPT = ROOT / "tests" / "dist" / "ds_stage.py"
NAMES = ("attn.proj", "attn.qkv", "mlp.fc", "mlp.proj")
STEPS, GAS = 3, 2


@pytest.mark.distributed
def test_stage_weights_and_recompute_match_one_process(tmp_path):
    r0, r1 = run_ranks(SCRIPT, 2, [tmp_path], timeout=300)
    # [embed, 4 blocks, head] cut at [0, 3, 6]; blocks are layers 1-4 and "first/last block" are the
    # model's (layers 1 and 4), not each stage's: stage 0 quantizes layer 2 only, stage 1 layer 3 only.
    a0, a1 = r0["module"], r1["module"]
    assert a0["quantized"] == [f"2.{n}" for n in NAMES] and a1["quantized"] == [f"3.{n}" for n in NAMES]
    # recompute_stages=[True, False]: stage 0 checkpoints its blocks (1, 2), each run twice per micro-batch
    assert a0["recomputed"] == [1, 2] and a1["recomputed"] == []
    assert a0["recompute_calls"] == [2 * STEPS * GAS] * 2
    assert a0["requantize_wired"] and a1["requantize_wired"]
    # recomputed layers 1 and 2 keep their DeepSpeed checkpoint files, and a reload restores them
    assert a0["layer_files"] == [f"layer_{i:02d}-model_states.pt" for i in range(3)], a0["layer_files"]
    assert a1["layer_files"] == [f"layer_{i:02d}-model_states.pt" for i in range(3, 6)], a1["layer_files"]
    assert a0["reloaded"] and a1["reloaded"]
    for r in (r0, r1):  # the last stage's loss is broadcast; int8 + recompute equals the one-process model
        torch.testing.assert_close(torch.tensor(r["module"]["losses"]), torch.tensor(a0["reference"]),
                                   rtol=1e-4, atol=1e-5)
    assert a0["losses"][-1] < a0["losses"][0]

    # From the DeepSpeed config: nf4 with keep_last_blocks=0 (uniform cut: layers 0-2 | 3-5), and
    # pipeline.recompute_stages=[1] replacing DeepSpeed's activation_checkpoint_interval=1 on every stage.
    c0, c1 = r0["config"], r1["config"]
    assert c0["quantized"] == [f"2.{n}" for n in NAMES]
    assert c1["quantized"] == [f"{i}.{n}" for i in (3, 4) for n in NAMES]
    assert c0["recomputed"] == [] and c1["recomputed"] == [3, 4]
    assert c1["recompute_calls"] == [2 * STEPS * GAS] * 2
    assert c0["ds_interval"] == 0 and c1["ds_interval"] == 0
    torch.testing.assert_close(torch.tensor(c1["losses"]), torch.tensor(c0["reference"]),
                               rtol=1e-4, atol=1e-5)
    # pipeline.recompute_layers=[0, 3]: the embedding is left out, layer 3 recomputes, layer 4 keeps its
    # activations; the losses are the same model's. A plan's stage keeping its last layer does the same.
    p0, p1 = r0["config_layers"], r1["config_layers"]
    assert p0["recomputed"] == [] and p1["recomputed"] == [3] and p1["ds_interval"] == 0
    assert p1["recompute_calls"] == [2 * STEPS * GAS]
    torch.testing.assert_close(torch.tensor(p1["losses"]), torch.tensor(c0["reference"]),
                               rtol=1e-4, atol=1e-5)
    assert r0["plan_partial"] == [1] and r1["plan_partial"] == []

    for r in (r0, r1):  # a plain (data-parallel) model: global policy, compute copy follows the master
        assert r["plain"]["quantized"] == [f"{i}.{n}" for i in (2, 3) for n in NAMES], r["plain"]
        assert r["plain"]["stepped"] and r["plain"]["follows_master"]
    m0, m1 = r0["master_free"], r1["master_free"]
    assert m0["master_free"] == [] and m1["master_free"] == [f"{i}.{n}" for i in (3, 4) for n in NAMES]
    assert m0["master_free_wired"] and m1["master_free_wired"] and not m1["requantize_wired"]
    torch.testing.assert_close(torch.tensor(m1["losses"]), torch.tensor(m0["reference"]),
                               rtol=1e-4, atol=1e-5)
    assert m1["losses"][-1] < m1["losses"][0]
    assert m1["in_backward"] == [] and r1["in_backward"]["in_backward"] == m1["master_free"]
    assert r1["in_backward"]["master_free"] == m1["master_free"]
    torch.testing.assert_close(torch.tensor(r1["in_backward"]["losses"]),
                               torch.tensor(r0["in_backward"]["reference"]), rtol=1e-4, atol=1e-5)

    for r in (r0, r1):
        assert r["stale"].startswith("PPQConfigError"), r["stale"]
        assert "build the optimizer after converting" in r["stale"]


def test_infer_block_layers_and_recompute_flags():
    from torch import nn

    layers = [nn.Embedding(4, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 4),
              nn.LayerNorm(4)]
    assert infer_block_layers(layers) == [1, 3, 4]
    assert infer_block_layers([nn.Embedding(4, 4), nn.Linear(4, 4)]) is None
    parts = [0, 3, 6]
    assert recompute_flags(6, parts, recompute_stages=[False, True], block_layers=[1, 3, 4]) == \
        [False, False, False, True, True, False]
    assert recompute_flags(6, parts, recompute_stages=[0], block_layers=[1, 3, 4]) == \
        [False, True, False, False, False, False]
    assert recompute_flags(6, parts, recompute_stages=True) == [True] * 6
    assert recompute_flags(6, parts) == [False] * 6
    assert recompute_flags(6, parts, recompute_stages=[]) == [False] * 6  # plan: no stage recomputes
    with pytest.raises(PPQConfigError, match=r"recompute_stages=\[True\]: a flag per stage needs 2"):
        recompute_flags(6, parts, recompute_stages=[True])
    with pytest.raises(PPQConfigError, match=r"recompute_stages=\[5\]: .*stage indices in \[0, 2\)"):
        recompute_flags(6, parts, recompute_stages=[5])
    with pytest.raises(PPQConfigError, match="recompute_layers=.*one bool per layer"):
        recompute_flags(6, parts, recompute_layers=[True])
