"""Failure paths of the PPQ pipeline engine on 2 real gloo ranks: both sides stop, with a message
that names the stage, the boundary and the setting."""

from __future__ import annotations

import json
import math

import pytest
from dist_utils import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "dist" / "ds_pipe.py"
Q8 = {"activations": {"method": "quant", "bits": 8}, "gradients": {"method": "quant", "bits": 8}}
CASES = [
    {"name": "mismatch", "expect_error": True,
     "ppq_by_rank": [Q8, {**Q8, "activations": {"method": "quant", "bits": 4}}]},
    {"name": "bad_codec", "expect_error": True,
     "ppq": {"activations": {"method": "quant", "error_feedback": "ef_mixed"}}},
    {"name": "aqsgd_no_ids", "expect_error": True, "sample_ids": False,
     "ppq": {"activations": {"method": "quant", "bits": 4}, "aqsgd": {"enabled": True}}},
    {"name": "nan_skip", "nan_step": 1, "ppq": {**Q8, "nonfinite": "skip"}},
    {"name": "nan_error", "expect_error": True, "nan_step": 1, "ppq": {**Q8, "nonfinite": "error"}},
]


@pytest.mark.distributed
def test_failures_stop_both_stages(tmp_path):
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(CASES))
    results = run_ranks(SCRIPT, 2, [cases])
    for rank, res in enumerate(results):
        err = res["mismatch"]["error"]
        assert err.startswith("CodecMismatchError") and "boundary 0 (stage 0 -> 1)" in err
        assert "ppq.activations.bits: stage" in err and ("has 8" in err and "has 4" in err), err

        err = res["bad_codec"]["error"]
        assert err.startswith("PPQConfigError") and "ppq.activations" in err and "ef_mixed" in err, err

        err = res["aqsgd_no_ids"]["error"]
        assert err.startswith("PPQConfigError") and "sample_ids=True" in err, err

        # skip: step 1 is skipped on every rank, the others train normally and match the reference.
        r = res["nan_skip"]
        assert r["skipped"] == 1, (rank, r)
        assert math.isnan(r["losses"][1]) and math.isfinite(r["losses"][2])
        for s in (0, 2):
            assert math.isclose(r["losses"][s], r["ref_losses"][s], rel_tol=1e-5), (rank, r)

        # error: the sender raises after flagging the payload, so the receiver stops too (no hang).
        err = res["nan_error"]["error"]
        assert err.startswith("NonFiniteStepError") and "boundary 0 (stage 0 -> 1) activations[0]" in err
        assert f"stage {rank}" in err and "step 1" in err, err
