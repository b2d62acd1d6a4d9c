"""Start-up agreement and drop-in batches on 2 real gloo ranks (tests/dist/ds_pipe.py).

* Ranks built with different stage boundaries stop at start-up, both naming ``pipeline.parts`` and
  each side's value (before: block 0 computed twice, no error); so do ranks built with another precision
  policy (``weights.*``: format, block size, rules), from different plan files (``plan.fingerprint``) or in
  another precision (``boundary.dtype``).
* Codec "none" (and a compressing codec without AQ-SGD) takes any batch stock DeepSpeed takes: a third
  element that is not a sample id (a string) is left alone, and codec "none" gives the same losses as
  stock DeepSpeed bit for bit.
"""

from __future__ import annotations

import json

import pytest
from dist_utils import ROOT, run_ranks

from deepspeed_ppq.autotune.plan import Plan, StagePlan
from deepspeed_ppq.integrations.handshake import plan_fingerprint

SCRIPT = ROOT / "tests" / "dist" / "ds_pipe.py"
Q8 = {"activations": {"method": "quant", "bits": 8}, "gradients": {"method": "quant", "bits": 8}}
CASES = [
    {"name": "parts_mismatch", "expect_error": True, "boundaries_by_rank": [[0, 4, 7], [0, 3, 7]], "ppq": Q8},
    {"name": "parts_mismatch_none", "expect_error": True, "boundaries_by_rank": [[0, 4, 7], [0, 3, 7]]},
    {"name": "str_none", "third": "tag", "ppq": {}},
    {"name": "str_stock", "third": "tag", "stock": True},
    {"name": "str_q8", "third": "tag", "ppq": Q8},
    # the precision policy differs: the weight format, or only the block size
    {"name": "weights_format", "expect_error": True,
     "ppq_by_rank": [{"weights": {"format": "int8"}}, {"weights": {"format": "nf4"}}]},
    {"name": "weights_block_size", "expect_error": True,
     "ppq_by_rank": [{**Q8, "weights": {"format": "int8"}}, {**Q8, "weights": {"format": "int8",
                                                                              "block_size": 32}}]},
    # the same settings otherwise: a stage in bf16
    {"name": "dtype", "expect_error": True, "bf16_by_rank": [False, True]},
]


def _plan(note: str, recompute_first: bool) -> Plan:
    """A plan for ds_pipe.py's model on 2 ranks at its own boundaries [0, 4, 7]; plans that differ in
    stage 0's recomputation only (nothing else the handshake compares) or in their notes only (the same
    plan, as each rank's planner writes it)."""
    from ds_pipe import make_layers

    from deepspeed_ppq.integrations.model_layers import layer_name, model_fingerprint

    layers = make_layers(False)
    return Plan(world_size=2, pipeline_degree=2, micro_batch_size=2, num_microbatches=2, schedule="1f1b",
                stages=[StagePlan((0, 4), ["none"] * 4, recompute_first), StagePlan((4, 7), ["none"] * 3)],
                layer_names=[layer_name(x) for x in layers], notes=[note],
                model_fingerprint=model_fingerprint(layers))


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    work = tmp_path_factory.mktemp("plans")
    out = []
    for rank in (0, 1):
        plan = _plan(f"tuned on node {rank}", recompute_first=rank == 0)
        plan.save(work / f"plan{rank}.json")
        out.append((str(work / f"plan{rank}.json"), plan_fingerprint(plan)))
    return out


def test_plans_that_differ_in_their_notes_only_run_the_same():
    assert plan_fingerprint(_plan("tuned on node 0", False)) == plan_fingerprint(_plan("node 1", False))
    assert plan_fingerprint(_plan("x", False)) != plan_fingerprint(_plan("x", True))


@pytest.fixture(scope="module")
def results(tmp_path_factory, plans):
    path = tmp_path_factory.mktemp("handshake") / "cases.json"
    plan_case = {"name": "plan", "expect_error": True, "ppq_by_rank": [{"plan_file": f} for f, _ in plans]}
    path.write_text(json.dumps(CASES + [plan_case]))
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
@pytest.mark.parametrize("name,field,values", [
    ("weights_format", "weights.format", ("'int8'", "'nf4'")),
    ("weights_block_size", "weights.block_size", ("64", "32")),
    ("dtype", "boundary.dtype", ("'fp32'", "'bf16'")),
])
def test_ranks_built_differently_stop_naming_the_field(results, name, field, values):
    for rank, res in enumerate(results):
        err = res[name]["error"]
        assert err.startswith("CodecMismatchError") and "boundary 0 (stage 0 -> 1)" in err, (rank, err)
        mine, theirs = values if rank == 0 else values[::-1]
        assert f"{field}: stage {rank} has {mine}, stage {1 - rank} has {theirs}" in err, (rank, err)


@pytest.mark.distributed
def test_ranks_given_other_plan_files_stop_naming_the_fingerprints(results, plans):
    assert plans[0][1] != plans[1][1]
    for rank, res in enumerate(results):
        err = res["plan"]["error"]
        assert err.startswith("CodecMismatchError"), (rank, err)
        lines = [line.strip() for line in err.splitlines()]
        # the plans differ in stage 0's recomputation only: the fingerprint is the one field that tells
        assert f"plan.fingerprint: stage {rank} has {plans[rank][1]!r}, stage {1 - rank} has " \
               f"{plans[1 - rank][1]!r}" in lines, (rank, err)
        assert not [line for line in lines if ": stage " in line and not line.startswith("plan.")], err


@pytest.mark.distributed
def test_non_id_third_element_is_left_alone(results):
    for res in results:
        assert res["str_none"]["losses"] == res["str_stock"]["losses"]
        assert res["str_none"]["eval_loss"] == res["str_stock"]["eval_loss"]
        r = res["str_q8"]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], r["ref_losses"])), r
