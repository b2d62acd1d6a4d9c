"""One vocabulary for memory (deepspeed_ppq.memory_categories): every writer's keys are its categories, the
coarse mapping is the one the planner and the tracker are compared in, and older files still read."""

import pytest
import torch
from torch.distributed._tools.mem_tracker import _MemRefType

from deepspeed_ppq import memory_categories as mc
from deepspeed_ppq.autotune import memory as autotune_memory
from deepspeed_ppq.autotune.costs import LayerProfile
from deepspeed_ppq.autotune.plan import StagePlan
from deepspeed_ppq.autotune.planner import MEMORY_CATEGORIES
from deepspeed_ppq.config import WeightsConfig
from deepspeed_ppq.quant import MemoryLedger, ParamSpec, ledger_from_shapes
from deepspeed_ppq.schedule import StageCost, build_schedule, simulate
from deepspeed_ppq.schedule.costs import ModelShape, stage_memory


def test_every_category_has_one_coarse_category():
    assert set(mc.COARSE_OF) == set(mc.CATEGORIES) and set(mc.COARSE_OF.values()) == set(mc.COARSE)
    assert set(mc.TRACKER_COARSE_OF.values()) <= set(mc.COARSE)
    assert {t.value for t in _MemRefType} <= set(mc.TRACKER_COARSE_OF), "a tracker type is not mapped"
    assert autotune_memory.CATEGORIES == mc.COARSE


def test_ledger_keys_are_categories():
    specs = [ParamSpec("a.weight", (64, 96), "int8"), ParamSpec("a.bias", (64,)),
             ParamSpec("b.weight", (96, 64), "int8", master="none"), ParamSpec("c.weight", (128, 64), "nf4")]
    led = ledger_from_shapes(specs, WeightsConfig(optimizer_8bit=True), optimizer="adamw8bit",
                             min_8bit_size=1024, buffers_bytes=8)
    assert {mc.category(k) for k in led.bytes} == {"weights", "master_weights", "gradients", "optimizer",
                                                    "buffers", "workspace"}
    assert led.coarse() == mc.coarse(led.groups()) and sum(led.coarse().values()) == led.total
    with pytest.raises(ValueError, match=r"memory category 'master' is not one of weights, master_weights"):
        MemoryLedger().add("master", 4)


def test_planner_keys_are_categories():
    assert set(MEMORY_CATEGORIES) <= set(mc.CATEGORIES)
    layer = LayerProfile(name="1", kind="block", param_numels=[4096, 64], quantizable_params=4096,
                         allowed_formats=["int8"], times={}, weight_bytes={"none": 16640, "int8": 4608},
                         saved_bytes={}, input_bytes=0, output_bytes=0)
    for fmt, free in (("none", False), ("int8", False), ("int8", True)):
        assert set(layer.static_bytes(fmt, optimizer_8bit=True, master_free=free)) <= set(MEMORY_CATEGORIES)


def test_simulator_keys_are_categories():
    shape = ModelShape(4, 64, 4, 32, 100)
    mem = stage_memory(shape, 2, "int4", "adam8bit", comm_buffers=5, feedback_buffers=3)
    res = simulate(build_schedule("1f1b", 2, 4), [StageCost(1.0, 1.0)] * 2, memory=mem)
    keys = set(res.per_stage[0].peak_memory)
    assert {mc.category(k) for k in keys} == {"weights", "gradients", "master_weights", "optimizer",
                                              "activations", "comm_buffers", "feedback_buffers"}
    assert "weights.int4" in keys


def test_older_files_read_in_todays_names():
    old = {"weights": 10, "master": 4, "gradients": 4, "optimizer": 8, "activations": 3, "buffers": 2,
           "temporaries": 1}
    sp = StagePlan(layers=(0, 2), formats=["int8", "int8"], memory=old)
    assert sp.memory == {"weights": 10, "master_weights": 4, "gradients": 4, "optimizer": 8, "activations": 3,
                         "comm_buffers": 2, "temporaries": 1}
    assert sp.peak_memory == sum(old.values())
    assert autotune_memory.coarse(old) == autotune_memory.coarse(sp.memory) == {
        "parameters": 14, "gradients": 4, "optimizer": 8, "activations": 5, "temporaries": 1}
    sim = {"weights:bf16": 6, "weights:int4": 2, "master_weights": 4, "optimizer_states": 8}
    assert mc.canonical(sim) == {"weights.bf16": 6, "weights.int4": 2, "master_weights": 4, "optimizer": 8}
    with pytest.raises(ValueError, match="memory category 'optimiser' is not one of"):
        mc.coarse({"optimiser": 1})


def test_ledger_parameters_match_the_tracker_side_of_the_mapping():
    """What the ledger puts under "parameters" is what the tracker sees as parameters and buffers."""
    led = ledger_from_shapes([ParamSpec("w", (32, 32), "int8")], WeightsConfig(), optimizer=None,
                             buffers_bytes=16, compute_dtype=torch.float32)
    groups = led.groups()
    assert led.coarse()["parameters"] == sum(groups[k] for k in ("weights", "master_weights", "buffers",
                                                                 "workspace"))
