"""A LoRA fine-tune with the user's own adapters on a frozen low-bit base, on 2 real gloo ranks with
DeepSpeed's reentrant activation checkpoint on both stages, against one process
(tests/dist/ds_frozen_base.py)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "dist" / "ds_frozen_base.py"


@pytest.mark.distributed
def test_lora_on_a_frozen_low_bit_base_matches_one_process():
    r0, r1 = run_ranks(SCRIPT, 2, timeout=300)
    names = ("attn.proj.base", "attn.qkv.base", "mlp.fc.base", "mlp.proj.base")
    # blocks 1-2 on stage 0, 3-4 on stage 1: every base Linear stored NF4, frozen, no adapters of ppq's
    assert r0["frozen_low_bit"] == [f"{i}.{n}" for i in (1, 2) for n in names]
    assert r1["frozen_low_bit"] == [f"{i}.{n}" for i in (3, 4) for n in names]
    for r in (r0, r1):
        # the only trainable parameters are the user's adapters, and every one of them trained: stage 0's
        # sit behind the frozen embedding, inside a reentrant checkpoint
        assert r["adapters"] and all(n.endswith((".A", ".B")) for n in r["adapters"])
        assert r["adapters_moved"] == r["adapters"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["reference"]),
                                   rtol=1e-4, atol=1e-5)
    assert r0["losses"][-1] < r0["losses"][0]
