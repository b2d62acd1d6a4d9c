"""``--ppq-nonfinite`` on megatron-core: 2 real gloo ranks (PP=2) in megatron-core's own 1F1B schedule,
megatron-core's ``FP32Optimizer`` stepping each stage (tests/mcore/nonfinite_rank.py).

A NaN enters the first micro-batch of batch 1 on the first stage; the codecs carry error feedback, so
the codec state matters as much as the weights.

* ``skip``: every rank skips that optimizer step (``(False, None, None)``, as megatron-core's own
  inf/nan skip), and after batch 2 the parameters equal, bit for bit, those of a run that trained
  batches 0 and 2 only. Before, the flagged micro-batch reached megatron-core as NaN and
  ``FP32Optimizer`` (which never checks) applied it: every weight NaN.
* ``error``: both stages stop at that step naming the boundary.
"""

from __future__ import annotations

import json

import pytest
from dist_utils import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "mcore" / "nonfinite_rank.py"
CODECS = {"activations": {"method": "quant", "bits": 4, "error_feedback": "ef"},
          "gradients": {"method": "quant", "bits": 8, "error_feedback": "ef21"}}
SKIP, ERROR = {**CODECS, "nonfinite": "skip"}, {**CODECS, "nonfinite": "error"}
CASES = [
    {"name": "skip", "ppq": SKIP, "route": "install", "steps": [0, 1, 2], "nan_steps": [1]},
    {"name": "skip_explicit", "ppq": SKIP, "route": "explicit", "steps": [0, 1, 2], "nan_steps": [1]},
    {"name": "never_saw_batch_1", "ppq": SKIP, "route": "install", "steps": [0, 2]},
    {"name": "error", "ppq": ERROR, "route": "install", "steps": [0, 1, 2], "nan_steps": [1]},
    {"name": "error_explicit", "ppq": ERROR, "route": "explicit", "steps": [0, 1, 2], "nan_steps": [1]},
]


@pytest.fixture(scope="module")
def results():
    ranks = run_ranks(SCRIPT, 2, [json.dumps(CASES)], timeout=300)
    return {r["rank"]: r["cases"] for r in ranks}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["skip", "skip_explicit"])
def test_skip_every_rank_skips_the_flagged_step(results, name):
    for rank in (0, 1):
        r, ref = results[rank][name], results[rank]["never_saw_batch_1"]
        assert "error" not in r and "error" not in ref, (rank, r, ref)
        s0, s1, s2 = r["steps"]
        assert [s0["success"], s1["success"], s2["success"]] == [True, False, True], (rank, r)
        assert all(s["finite"] for s in r["steps"]), (rank, r)
        assert s1["params"] == s0["params"] != r["initial"], rank  # the flagged step left them alone
        # weights and codec state as if batch 1 had never been seen: bit for bit
        assert s2["params"] == ref["steps"][1]["params"] != ref["steps"][0]["params"], rank
        assert not s0["warnings"] and not s2["warnings"], (rank, r)
        assert any("ppq: skipping the optimizer step after training step 1: NaN/Inf crossed a stage boundary"
                   in w for w in s1["warnings"]), (rank, s1)
    # each stage names where it saw the NaN: the first sent it, the second received it
    for rank in (0, 1):
        seen = " ".join(results[rank][name]["steps"][1]["warnings"])
        assert f"stage {rank}, boundary 0 (stage 0 -> 1) activations[0]" in seen, (rank, seen)


@pytest.mark.distributed
def test_skip_routes_agree(results):
    for rank in (0, 1):
        assert [s["params"] for s in results[rank]["skip"]["steps"]] == \
            [s["params"] for s in results[rank]["skip_explicit"]["steps"]]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["error", "error_explicit"])
def test_error_stops_both_stages_at_the_flagged_step(results, name):
    for rank, what in ((0, "to send at stage 0"), (1, "received at stage 1")):
        r = results[rank][name]
        assert len(r["steps"]) == 1 and r["steps"][0]["success"], (rank, r)  # batch 0 trained
        err = r["error"]
        assert err.startswith(f"NonFiniteStepError: NaN/Inf {what}, boundary 0 (stage 0 -> 1) activations[0] "
                              "(step 1)"), (rank, err)
        assert "ppq.nonfinite='error'" in err
