"""The one tuner config, ``ppq.autotune``: validated at load, every field reaches the loop, and
``ppq tune``'s flags are generated from it."""

from __future__ import annotations

import argparse

import pytest

from deepspeed_ppq.autotune.costs import DEFAULT_LINK, NO_CODEC, CodecOption, LayerProfile
from deepspeed_ppq.autotune.loop import TuningError, build_problem, default_micro_batch_sizes
from deepspeed_ppq.autotune.runner import Profile
from deepspeed_ppq.config import AutotuneConfig, PPQConfigError, load_ppq_config, parse_bytes


def _profile() -> Profile:
    layer = LayerProfile(name="0", kind="block", param_numels=[4096], quantizable_params=4096,
                         allowed_formats=["none", "int8"], times={"none": {1: [1e-3, 1e-3, 1e-3]},
                                                                  "int8": {1: [1e-3, 1e-3, 1e-3]}},
                         weight_bytes={"none": 16384, "int8": 4160}, saved_bytes={"none": 512, "int8": 512},
                         input_bytes=256, output_bytes=256)
    q6 = CodecOption.make({"method": "quant", "bits": 6}, wire_ratio=0.2, bits=6)
    q2 = CodecOption.make({"method": "quant", "bits": 2}, wire_ratio=0.07, bits=2)
    return Profile(layers=[layer] * 4, codecs=[NO_CODEC, q6, q2], link=DEFAULT_LINK,
                   optimizer_costs={"adam": 1e-9, "adam8bit": 2e-9}, step_transient_bytes_per_param=4.0)


def test_sizes_in_bytes_or_with_units():
    assert parse_bytes("21MiB") == 21 * 2**20 and parse_bytes("1.5 GiB") == int(1.5 * 2**30)
    assert parse_bytes(1000) == 1000 and parse_bytes("2MB") == 2_000_000
    assert load_ppq_config({"autotune": {"memory_budget": "512KiB"}}).autotune.memory_budget == 512 * 1024
    with pytest.raises(PPQConfigError, match=r"ppq.autotune.memory_budget='lots'.*units"):
        load_ppq_config({"autotune": {"memory_budget": "lots"}})
    with pytest.raises(PPQConfigError, match=r"memory_budget=-5.*positive"):
        load_ppq_config({"autotune": {"memory_budget": -5}})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("micro_batch_sizes", [0, -2], r"micro_batch_sizes=\[0, -2\].*positive integers"),
    ("pipeline_degrees", [], r"pipeline_degrees=\[\].*positive integers"),
    ("schedules", ["zigzag"], r"schedules.0='zigzag'.*'1f1b'"),
    ("formats", ["int3"], r"formats.0='int3'"),
    ("seeds", 0, r"seeds=0"),
    ("memory_tolerance", 2, r"memory_tolerance=2"),
])
def test_bad_values_fail_at_load_naming_the_field(field, value, message):
    with pytest.raises(PPQConfigError, match=message):
        load_ppq_config({"autotune": {field: value}})


def test_warmup_must_leave_timed_steps():
    with pytest.raises(PPQConfigError, match=r"warmup_steps=4 must be below trial_steps=4"):
        load_ppq_config({"autotune": {"trial_steps": 4, "warmup_steps": 4}})


def test_settings_reach_the_planning_problem():
    s = AutotuneConfig(memory_budget="3MiB", micro_batch_sizes=[1, 2], pipeline_degrees=[2],
                       allow_recompute=False, optimizer_8bit=False, master_free=False, min_activation_bits=4,
                       master_free_grad_dtype="fp32",
                       activation_codecs=[{"method": "none"}, {"method": "quant", "bits": 6},
                                          {"method": "quant", "bits": 2}])
    prob = build_problem(s, world_size=2, global_batch=8, profile=_profile())
    assert prob.memory_budget == 3 * 2**20 and prob.micro_batch_sizes == [1, 2]
    assert prob.pipeline_degrees == [2] and not prob.allow_recompute
    assert prob.optimizer_8bit == [False] and prob.master_free == [False]
    assert prob.master_free_grad_dtype == "fp32"  # default bf16
    assert [c.label for c in prob.activation_codecs] == ["none", "quant6"]  # 2 bits < min_activation_bits
    assert prob.optimizer_cost_ratio == {"adam8bit": 2.0} and prob.step_transient_bytes_per_param == 4.0
    assert default_micro_batch_sizes(24) == [1, 2, 3, 4, 6, 8, 12]
    strict = s.model_copy(update={"min_activation_bits": 8,
                                  "activation_codecs": [s.activation_codecs[1]]})
    with pytest.raises(TuningError, match=r"activation_codecs: no candidate has at least 8 bits"):
        build_problem(strict, 2, 8, _profile())


def test_gradient_candidates_reach_the_planning_problem():
    """``autotune.min_gradient_bits`` and ``gradient_codecs`` on the planning problem (the gradient side
    of the test above)."""
    s = AutotuneConfig(gradient_codecs=[{"method": "none"}, {"method": "quant", "bits": 6},
                                        {"method": "quant", "bits": 2}], min_gradient_bits=4)
    prob = build_problem(s, world_size=2, global_batch=8, profile=_profile())
    assert [c.label for c in prob.gradient_codecs] == ["none", "quant6"]
    with pytest.raises(TuningError, match=r"gradient_codecs: no candidate has at least 8 bits"):
        strict = s.model_copy(update={"min_gradient_bits": 8, "gradient_codecs": [s.gradient_codecs[2]]})
        build_problem(strict, 2, 8, _profile())


def test_ppq_tune_flags_are_generated_from_the_config():
    from deepspeed_ppq.integrations.tune_cli import flag_overrides, settings_flags

    p = argparse.ArgumentParser()
    names = settings_flags(p)
    flagged = set(names)
    codec_fields = {"activation_codecs", "gradient_codecs"}  # nested objects: set them in the JSON
    assert flagged == set(AutotuneConfig.model_fields) - codec_fields
    ns = p.parse_args(["--micro-batch-sizes", "1,4", "--optimizer-8bit", "false", "--seeds", "5",
                       "--memory-budget", "40MiB", "--formats", "int8,nf4"])
    ns.budget_mb = None
    got = flag_overrides(ns, names)
    cfg = load_ppq_config({"autotune": got}).autotune
    assert cfg.micro_batch_sizes == [1, 4] and cfg.optimizer_8bit is False and cfg.seeds == 5
    assert cfg.memory_budget == 40 * 2**20 and [f.value for f in cfg.formats] == ["int8", "nf4"]
    ns.budget_mb = 12.5
    assert flag_overrides(ns, names)["memory_budget"] == int(12.5 * 2**20)
