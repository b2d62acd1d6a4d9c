"""User mistakes in a plan file and in ``PPQPipelineModule``/``apply_plan`` arguments get a clear error
naming the field, the value and what is allowed (before: accepted and carried out wrong, or a raw
``AttributeError``/pydantic ``ValidationError`` from deep inside).

The cases that need a built ``PipelineModule`` run in one fresh 1-rank process (``run_ranks``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from deepspeed_ppq.autotune.plan import Plan, PlanError, StagePlan, load_plan
from deepspeed_ppq.config import PPQConfigError
from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule, check_boundaries
from deepspeed_ppq.integrations.stage import check_block_layers


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
            nn.Linear(16, 4)]


def _plan(world_size: int = 2) -> Plan:
    from deepspeed_ppq.integrations.model_layers import layer_name, model_fingerprint

    layers = _layers()
    if world_size == 1:
        stages = [StagePlan((0, 7), ["none"] * 7)]
    else:
        stages = [StagePlan((0, 4), ["none"] * 4), StagePlan((4, 7), ["none"] * 3)]
    return Plan(world_size=world_size, pipeline_degree=world_size, micro_batch_size=2, num_microbatches=2,
                schedule="1f1b", stages=stages, layer_names=[layer_name(x) for x in layers],
                model_fingerprint=model_fingerprint(layers))


def _stage0(**fields):
    return lambda d: d["stages"][0].update(fields)


BAD_FILES = [
    # stage 0 holds layers 0-4, stage 1 3-6: layer 4's format went to layer 5, and so on
    ("overlap", _stage0(layers=[0, 5], formats=["none"] * 5), r"stages\[1\].layers=\[4, 7\] must start where "
                                                              r"stage 0 ends \(5\)"),
    ("format", _stage0(formats=["int3"] * 4), r"stages\[0\].formats: unknown weight format.*'int3'.*'int8'"),
    ("formats_str", _stage0(formats="none"), r"stages\[0\].formats='none' must be a list"),
    ("recompute_str", _stage0(recompute="false"), r"stages\[0\].recompute='false' must be true or false"),
    ("keep_last", _stage0(recompute=True, keep_last=-1), r"stages\[0\].keep_last=-1 must be an integer"),
    ("layers_float", _stage0(layers=[0, 4.0]), r"stages\[0\].layers=\[0, 4.0\] must be \[first, last\)"),
    ("memory", _stage0(memory="x"), r"stages\[0\].memory='x' must be an object"),
    ("stages", lambda d: d.update(stages=[1, 2]), r"stages=\[1, 2\] must be a list of stage objects"),
    ("fingerprint", lambda d: d.update(model_fingerprint="x"), r"model_fingerprint='x' must be an object"),
    ("linear_formats", lambda d: d.update(linear_formats={"0": "int3"}), r"linear_formats=.*unknown weight"),
    ("threads", lambda d: d.update(threads_per_rank="4"), r"threads_per_rank='4' must be a positive integer"),
    ("block_size", lambda d: d.update(block_size=0), r"block_size=0 must be a positive integer"),
]


@pytest.mark.parametrize("name,damage,message", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_a_corrupted_plan_file_is_refused_naming_the_field(tmp_path, name, damage, message):
    d = json.loads(json.dumps(_plan().to_dict()))
    damage(d)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=message):
        load_plan(path)


def test_a_plan_object_is_checked_and_a_non_plan_is_refused():
    from deepspeed_ppq.integrations.plan_apply import apply_plan

    plan = _plan(1)
    plan.stages[0].formats = ["int3"] * 7
    with pytest.raises(PlanError, match=r"stages\[0\].formats: unknown weight format"):
        apply_plan(plan, None, None, {})
    with pytest.raises(PlanError, match=r"plan=\{'a': 1\} must be a Plan or the path of a plan file.*dict"):
        apply_plan({"a": 1}, None, None, {})


def test_a_plan_argument_and_another_plan_file_in_the_config_are_refused(tmp_path):
    # before: the config's ppq.plan_file was silently ignored
    from deepspeed_ppq.integrations.ds_setup import initialize

    config = {"train_batch_size": 4, "ppq": {"plan_file": str(tmp_path / "a.json")}}
    with pytest.raises(PPQConfigError, match=r"plan=.*b.json and ppq.plan_file=.*a.json' were both given"):
        initialize(model=None, config=config, plan=tmp_path / "b.json")


@pytest.mark.parametrize("bounds", [[0, 3.5, 7], "037", [0, True, 7]])
def test_boundaries_that_are_not_integers_are_refused(bounds):
    # before: int() truncated 3.5 to 3, and the string "037" was read as [0, 3, 7]
    with pytest.raises(PPQConfigError, match=r"ppq.partition.boundaries=.*must be a list of integer layer"):
        check_boundaries(bounds, 7, 2)


def test_block_layers_outside_the_model_are_refused():
    assert check_block_layers((1, 2), 7) == [1, 2]
    with pytest.raises(PPQConfigError, match=r"block_layers=\[1, 9\]: \[9\] are not layer indices.*\[0, 7\)"):
        check_block_layers([1, 9], 7)


@pytest.mark.parametrize("weights,message", [
    ({"format": "int3"}, r"ppq.weights.format='int3'"),
    ("int8", r"weights='int8': must be a ppq.weights dict or WeightsConfig"),
])
def test_bad_weights_argument_names_the_field(weights, message):
    # before: a raw pydantic ValidationError, or (a string) some layers converted anyway
    with pytest.raises(PPQConfigError, match=message):
        PPQPipelineModule(_layers(), num_stages=1, boundaries=[0, 7], weights=weights)


def _one_rank() -> None:
    import deepspeed
    from dist_utils import write_result

    from deepspeed_ppq.integrations.plan_apply import apply_plan

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    try:
        PPQPipelineModule(_layers(), num_stages=1, boundaries=[0, 7], block_layers=[2, 9],
                          weights={"format": "int8"})
    except PPQConfigError as e:
        out["block_layers"] = str(e)
    path = Path(sys.argv[-1]) / "plan.json"
    _plan(1).save(path)
    model = PPQPipelineModule(_layers(), num_stages=1, loss_fn=nn.MSELoss())
    _, _, cfg, _ = apply_plan(path, model, None, {"train_batch_size": 99})  # a pathlib.Path
    out["train_batch_size"] = cfg["train_batch_size"]
    write_result(out)


@pytest.mark.distributed
def test_module_block_layers_and_a_plan_path(tmp_path):
    from dist_utils import run_ranks

    (res,) = run_ranks(__file__, 1, ["--one-rank", str(tmp_path)], timeout=300)
    assert "block_layers=[2, 9]: [9] are not layer indices" in res["block_layers"]
    assert res["train_batch_size"] == 4  # the plan's 2 x 2 x 1, read from a pathlib.Path


if __name__ == "__main__" and "--one-rank" in sys.argv:
    _one_rank()
