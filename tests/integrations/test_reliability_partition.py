"""``ppq.partition`` is honoured or refused, never ignored (2 real gloo ranks, tests/dist/ds_pipe.py).

A ``PipelineModule`` cuts its layers when it is built; ``deepspeed_ppq.initialize`` then gets the config.
When the config sets ``ppq.partition``, the split it gives this model (DeepSpeed's own method on the
module's layers, or the explicit boundaries) must be the module's, or both ranks stop naming the field,
both splits and the fix. Before, the module's own split won silently.

The model (``"wide"``) has 7 layers (the first a ``Sequential`` holding a ``Linear``) whose parameter
counts are [576, 0, 1040, 0, 272, 0, 68]: ``uniform`` cuts it as [0, 4, 7], ``parameters`` as [0, 2, 7]
and ``type:Tanh`` as [0, 5, 7].
"""

from __future__ import annotations

import json

import pytest
from dist_utils import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "dist" / "ds_pipe.py"
# layer 0's Linear(8, 64) (576 parameters) only becomes frozen int8 with rank-2 adapters (144 trainable): its
# trainable count after the cut would split the layers as [0, 3, 7]; DeepSpeed counted 576 when it cut them
FROZEN_L0 = {"format": "int8", "keep_first_blocks": 0, "keep_last_blocks": 0, "mode": "frozen",
             "lora_rank": 2, "rules": [{"pattern": "0.0", "format": "int8"},
                                       {"pattern": "*", "format": "none"}]}
UNIFORM, PARAMETERS, TYPE_TANH = [0, 4, 7], [0, 2, 7], [0, 5, 7]
CASES = [
    # refused: the config's partition is not the module's
    {"name": "parameters_vs_uniform", "expect_error": True, "wide": True, "partition_method": "uniform",
     "ppq": {"partition": {"method": "parameters"}}},
    {"name": "type_vs_uniform", "expect_error": True, "wide": True, "partition_method": "uniform",
     "ppq": {"partition": {"method": "type:Tanh"}}},
    {"name": "explicit_vs_uniform", "expect_error": True, "wide": True, "partition_method": "uniform",
     "ppq": {"partition": {"method": "explicit", "boundaries": [0, 2, 7]}}},
    {"name": "type_matches_nothing", "expect_error": True, "wide": True, "partition_method": "uniform",
     "ppq": {"partition": {"method": "type:Conv"}}},
    # honoured: the module was cut the way the config says
    {"name": "parameters_ok", "wide": True, "partition_method": "parameters",
     "ppq": {"partition": {"method": "parameters"}}},
    {"name": "type_ok", "wide": True, "partition_method": "type:tanh",
     "ppq": {"partition": {"method": "type:Tanh"}}},
    {"name": "uniform_ok", "wide": True, "partition_method": "uniform",
     "ppq": {"partition": {"method": "uniform"}}},
    # no partition in the config: the module's own split stays
    {"name": "unset", "wide": True, "partition_method": "uniform", "ppq": {}},
    # built by from_config with a frozen low-bit layer: its trainable count changed after the cut (the weight
    # became a buffer), the check still counts it as DeepSpeed did
    {"name": "from_config_frozen", "wide": True, "from_config": True,
     "ppq": {"partition": {"method": "parameters"}, "weights": FROZEN_L0}},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("partition") / "cases.json"
    path.write_text(json.dumps(CASES))
    return run_ranks(SCRIPT, 2, [path])


@pytest.mark.distributed
@pytest.mark.parametrize("name,field,want,fix", [
    ("parameters_vs_uniform", "ppq.partition.method='parameters'", PARAMETERS,
     "partition_method='parameters'"),
    ("type_vs_uniform", "ppq.partition.method='type:Tanh'", TYPE_TANH, "partition_method='type:Tanh'"),
    ("explicit_vs_uniform", "ppq.partition.boundaries=[0, 2, 7]", PARAMETERS, "boundaries=[0, 2, 7]"),
])
def test_partition_the_module_was_not_cut_by_stops_every_rank(results, name, field, want, fix):
    for rank, res in enumerate(results):
        err = res[name]["error"]
        assert err.startswith("PPQConfigError"), (rank, err)
        assert f"{field} cuts this model's 7 layers into 2 stages as {want}" in err, (rank, err)
        assert f"the PipelineModule given was built as {UNIFORM}" in err, (rank, err)
        assert "PPQPipelineModule.from_config(layers, num_stages, config)" in err and fix in err, (rank, err)


@pytest.mark.distributed
def test_type_pattern_matching_no_layer_is_named(results):
    for res in results:
        err = res["type_matches_nothing"]["error"]
        assert "ppq.partition.method='type:Conv' matches none of this model's layers" in err, err
        assert "['Linear', 'Sequential', 'Tanh']" in err, err


@pytest.mark.distributed
@pytest.mark.parametrize("name,parts", [("parameters_ok", PARAMETERS), ("type_ok", TYPE_TANH),
                                        ("uniform_ok", UNIFORM), ("unset", UNIFORM),
                                        ("from_config_frozen", PARAMETERS)])
def test_partition_the_module_was_cut_by_trains(results, name, parts):
    for rank, res in enumerate(results):
        r = res[name]
        assert "error" not in r, (rank, r)
        assert r["parts"] == parts and len(r["losses"]) == 3, (rank, r)
        if name != "from_config_frozen":  # dense layers: the single-process reference holds
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], r["ref_losses"])), (rank, r)
