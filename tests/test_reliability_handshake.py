"""Start-up agreement and drop-in batches on 2 real gloo ranks (tests/dist/ds_pipe.py).

* Ranks built with different stage boundaries stop at start-up, both naming ``pipeline.parts`` and
  each side's value (before: block 0 computed twice, no error).
* Codec "none" (and a compressing codec without AQ-SGD) takes any batch stock DeepSpeed takes: a third
  element that is not a sample id (a string) is left alone, and codec "none" gives the same losses as
  stock DeepSpeed bit for bit.
"""

from __future__ import annotations

import json

import pytest
from dist_utils import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "dist" / "ds_pipe.py"
Q8 = {"activations": {"method": "quant", "bits": 8}, "gradients": {"method": "quant", "bits": 8}}
CASES = [
    {"name": "parts_mismatch", "expect_error": True, "boundaries_by_rank": [[0, 4, 7], [0, 3, 7]], "ppq": Q8},
    {"name": "parts_mismatch_none", "expect_error": True, "boundaries_by_rank": [[0, 4, 7], [0, 3, 7]]},
    {"name": "str_none", "third": "tag", "ppq": {}},
    {"name": "str_stock", "third": "tag", "stock": True},
    {"name": "str_q8", "third": "tag", "ppq": Q8},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("handshake") / "cases.json"
    path.write_text(json.dumps(CASES))
    return run_ranks(SCRIPT, 2, [path])


@pytest.mark.distributed
def test_partition_mismatch_stops_both_ranks(results):
    for rank, res in enumerate(results):
        for name in ("parts_mismatch", "parts_mismatch_none"):
            err = res[name]["error"]
            assert err.startswith("CodecMismatchError") and "boundary 0 (stage 0 -> 1)" in err, (rank, err)
            mine, theirs = ([0, 4, 7], [0, 3, 7]) if rank == 0 else ([0, 3, 7], [0, 4, 7])
            assert f"pipeline.parts: stage {rank} has {mine}, stage {1 - rank} has {theirs}" in err, err


@pytest.mark.distributed
def test_non_id_third_element_is_left_alone(results):
    for res in results:
        assert res["str_none"]["losses"] == res["str_stock"]["losses"]
        assert res["str_none"]["eval_loss"] == res["str_stock"]["eval_loss"]
        r = res["str_q8"]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], r["ref_losses"])), r
