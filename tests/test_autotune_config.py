"""``ppq tune --config`` and ``autotune(config=...)``: every ``ppq.autotune`` field reaches the spec."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import pytest

from deepspeed_ppq.autotune.cli import CONFIG_TO_SPEC, spec_fields_from_config, spec_from_args
from deepspeed_ppq.autotune.costs import NO_CODEC, CodecOption
from deepspeed_ppq.autotune.loop import TuneSpec, _problem, master_free_supported
from deepspeed_ppq.config import AutotuneConfig

# a value different from both AutotuneConfig's and TuneSpec's default for every field
NON_DEFAULT = {
    "memory_budget_gb": 0.5,
    "val_loss_tolerance": 0.02,
    "max_iterations": 5,
    "trial_steps": 7,
    "micro_batch_sizes": [2, 8],
    "schedules": ["1f1b"],  # the only schedule the engine runs; checked separately below
    "allow_recompute": False,
    "min_gradient_bits": 4,
    "min_activation_bits": 6,
    "profile_cache": "/tmp/profile.json",
    "formats": ["int8", "fp8_e4m3"],
    "master_free": master_free_supported(),  # True once quant has master-free layers
    "activation_codecs": [{"method": "none"}, {"method": "quant", "bits": 6}],
    "gradient_codecs": [{"method": "none"}, {"method": "fp8", "granularity": "sample"}],
    "pipeline_degrees": [2],
    "optimizer_8bit": False,
    "global_batch": 24,
}
EXPECTED = {
    "memory_budget": 2**29,
    "activation_codecs": [{"method": "none"}, {"method": "quant", "bits": 6}],
    "gradient_codecs": [{"method": "none"}, {"method": "fp8", "granularity": "sample"}],
}


def test_every_autotune_field_is_mapped():
    assert set(CONFIG_TO_SPEC) == set(AutotuneConfig.model_fields), "map new AutotuneConfig fields"
    assert set(NON_DEFAULT) == set(AutotuneConfig.model_fields)
    spec_fields = {f for f in TuneSpec.__dataclass_fields__}
    assert {target for target, _ in CONFIG_TO_SPEC.values()} <= spec_fields


def _args(tmp_path, cfg, **flags):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    ns = dict(config=str(path), spec=None, global_batch=None, out_dir=None, budget_mb=None, formats=None,
              model=None)
    ns.update(flags)
    return argparse.Namespace(**ns)


def test_config_fields_reach_the_spec(tmp_path):
    cfg = {"train_batch_size": 8, "ppq": {"weights": {"keep_first_blocks": 2}, "autotune": NON_DEFAULT}}
    spec = spec_from_args(_args(tmp_path, cfg))
    d = asdict(spec)
    for name, (target, _) in CONFIG_TO_SPEC.items():
        want = EXPECTED.get(target, NON_DEFAULT[name])
        assert d[target] == want, name
        if name not in ("schedules", "master_free"):
            assert want != asdict(TuneSpec())[target], f"{name}: pick a non-default test value"
    assert d["weights"]["keep_first_blocks"] == 2 and "format" not in d["weights"]
    # flags and --spec override the config
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"trial_steps": 3}))
    spec = spec_from_args(_args(tmp_path, cfg, spec=str(spec_file), global_batch=12, budget_mb=64))
    assert (spec.trial_steps, spec.global_batch, spec.memory_budget) == (3, 12, 64 * 2**20)
    # fields left at None in the config keep the spec's defaults
    spec = spec_from_args(_args(tmp_path, {"ppq": {}}))
    assert spec.memory_budget is None and spec.global_batch == TuneSpec().global_batch


def test_config_codecs_are_the_planners_candidates():
    """The codec dicts the config gives are found among the profiled options and filtered by bits."""
    d = spec_fields_from_config({"autotune": NON_DEFAULT})
    spec = TuneSpec(**d)
    profiled = [
        CodecOption.make({"method": "none"}, bits=32),
        CodecOption.make({"method": "quant", "bits": 6}, bits=6),
        CodecOption.make({"method": "fp8", "granularity": "sample"}, bits=8),
    ]
    prob = _problem(spec, 2, [], profiled, None, {"adam": 0.0})
    assert [c.label for c in prob.activation_codecs] == ["none", "quant6"]
    assert [c.label for c in prob.gradient_codecs] == ["none", "fp8"]
    assert prob.optimizer_8bit == [False] and prob.pipeline_degrees == [2] and prob.schedules == ["1f1b"]
    assert prob.global_batch == 24 and prob.micro_batch_sizes == [2, 8] and not prob.allow_recompute
    only6 = [{"method": "quant", "bits": 6}]
    strict = TuneSpec(**{**d, "min_activation_bits": 8, "activation_codecs": only6})
    with pytest.raises(ValueError, match="at least 8 bits"):
        _problem(strict, 2, [], profiled, None, {"adam": 0.0})
    assert NO_CODEC.label == "none"


def test_autotune_validates_config_fields_before_starting_ranks():
    from deepspeed_ppq.autotune import autotune

    with pytest.raises(ValueError, match="schedules=.*gpipe"):
        autotune(config={"autotune": {"schedules": ["gpipe"]}})
    with pytest.raises(TypeError, match="no_such_field"):
        autotune(config={"autotune": NON_DEFAULT}, no_such_field=1)


@pytest.mark.skipif(master_free_supported(), reason="quant has master-free layers")
def test_master_free_refused_clearly_until_quant_supports_it(tmp_path):
    with pytest.raises(ValueError, match="master_free=True.*fp32 master"):
        spec_from_args(_args(tmp_path, {"ppq": {"autotune": {"master_free": True}}}))


def test_spec_refuses_schedules_the_engine_cannot_run():
    with pytest.raises(ValueError, match="schedules=.*gpipe.*only '1f1b'"):
        TuneSpec(schedules=["1f1b", "gpipe"])
    with pytest.raises(ValueError, match="activation_codecs=\\[\\]"):
        TuneSpec(activation_codecs=[])
