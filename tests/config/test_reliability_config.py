"""Config fields validated when the config loads, and applied on the DeepSpeed path."""

from __future__ import annotations

import json

import pytest
from dist_utils import ROOT, run_ranks

from deepspeed_ppq.config import CodecConfig, PPQConfigError, load_ppq_config


@pytest.mark.parametrize("section, field, value", [
    ({"autotune": {"micro_batch_sizes": [0, -2]}}, "ppq.autotune.micro_batch_sizes", "[0, -2]"),
    ({"partition": {"method": "type:(Block"}}, "ppq.partition", "type:(Block"),
    ({"autotune": {"schedules": ["zigzag"]}}, "ppq.autotune.schedules", "zigzag"),
])
def test_list_and_pattern_fields_fail_at_load(section, field, value):
    with pytest.raises(PPQConfigError) as info:
        load_ppq_config(section)
    msg = str(info.value)
    assert field in msg and value in msg, msg


@pytest.mark.parametrize("text, message", [
    # JSON as a user writes it: Infinity and 1e400 parse as float("inf")
    ('{"ppq": {"autotune": {"memory_budget": "inf"}}}', r"memory_budget='inf'.* not a finite size"),
    ('{"autotune": {"memory_budget": Infinity}}', r"memory_budget=inf.* not a finite size"),
    ('{"autotune": {"memory_budget": 1e400}}', r"memory_budget=inf.* not a finite size"),
    ('{"autotune": {"memory_budget": "1e400 GiB"}}', r"memory_budget='1e400 GiB'.* not a finite size"),
    ('{"autotune": {"memory_budget": 0.5}}', r"memory_budget=0\.5.* at least 1 byte \(got 0\.5 bytes\)"),
    ('{"autotune": {"memory_budget": "0.5B"}}', r"memory_budget='0\.5B'.* at least 1 byte"),
    ('{"weights": {"format": "int8", "mode": "frozen", "lora_alpha": Infinity}}',
     r"ppq\.weights\.lora_alpha=inf: .*give a finite number"),
    ('{"autotune": {"val_loss_tolerance": Infinity}}', r"ppq\.autotune\.val_loss_tolerance=inf: .*finite"),
    ('{"autotune": {"stock_margin": "inf"}}', r"ppq\.autotune\.stock_margin='inf': .*finite"),
    ('{"watchdog_timeout_s": Infinity}', r"ppq\.watchdog_timeout_s=inf: .*finite.*0 turns the watchdog off"),
])
def test_infinite_or_sub_byte_numbers_fail_at_load(text, message):
    with pytest.raises(PPQConfigError, match=message):
        load_ppq_config(json.loads(text))


def test_sizes_at_the_limits_load_exactly():
    assert load_ppq_config({"autotune": {"memory_budget": "1B"}}).autotune.memory_budget == 1
    huge = 10**400  # a JSON integer this long is exact in Python; float() of it would overflow
    assert load_ppq_config({"autotune": {"memory_budget": huge}}).autotune.memory_budget == huge


@pytest.mark.parametrize("codec, message", [
    ({"method": "fp8", "bits": 4}, r"method='fp8' ignores bits=4: it reads only granularity, group_size"),
    ({"method": "quant", "fp8_format": "e5m2"}, r"method='quant' ignores fp8_format='e5m2'"),
    ({"method": "none", "bits": 4}, r"method='none' ignores bits=4: it sends tensors as they are"),
    ({"method": "topk", "bits": 4, "granularity": "sample"},
     r"method='topk' ignores bits=4, granularity='sample': .*; drop them"),
    ({"method": "none", "compress_eval": False}, r"method='none' ignores compress_eval=False"),
    ({"method": "quant", "group_size": 64}, r"group_size=64 has no effect with granularity='token'.*'group'"),
])
def test_codec_fields_the_method_ignores_fail_at_load(codec, message):
    with pytest.raises(PPQConfigError, match=r"ppq\.activations: " + message):
        load_ppq_config({"activations": codec})


@pytest.mark.parametrize("section, message", [
    ({"gradients": {"method": "quant", "reuse_indices": False}},
     r"ppq\.gradients: method='quant' ignores reuse_indices=False"),
    ({"autotune": {"gradient_codecs": [{"method": "quant"}, {"method": "fp8", "topk_ratio": 0.5}]}},
     r"ppq\.autotune\.gradient_codecs\.1: method='fp8' ignores topk_ratio=0\.5"),
])
def test_gradient_and_candidate_codec_fields_the_method_ignores_fail_at_load(section, message):
    with pytest.raises(PPQConfigError, match=message):
        load_ppq_config(section)


def test_codec_fields_at_their_default_still_load():
    # written out at their defaults (as a full model_dump writes them) the ignored fields are harmless
    cfg = load_ppq_config({"activations": {"method": "fp8", "bits": 8, "topk_ratio": 0.3, "group_size": 128},
                           "gradients": {"method": "quant", "bits": 4, "fp8_format": "e4m3"}})
    assert load_ppq_config(cfg.model_dump(mode="json")) == cfg
    assert load_ppq_config({"activations": {"method": "quant", "granularity": "group", "group_size": 64}})
    with pytest.raises(ValueError, match=r"method='topk' ignores bits=2"):  # built in Python alike
        CodecConfig(method="topk", bits=2, topk_ratio=0.25)


def test_bad_regex_rule_fails_at_load():
    rules = [{"pattern": "^1\\.", "match": "regex", "format": "int4"},
             {"pattern": "blocks.(", "match": "regex", "format": "int8"}]
    with pytest.raises(PPQConfigError, match=r"ppq\.weights\.rules\.1: pattern='blocks\.\(' is not a regular "
                       r"expression \(missing \), unterminated subpattern.*use match='glob'"):
        load_ppq_config({"weights": {"format": "int8", "rules": rules}})
    glob = {"weights": {"format": "int8", "rules": [{"pattern": "blocks.(", "format": "int8"}]}}
    assert load_ppq_config(glob).weights.rules[0].pattern == "blocks.("  # a glob has no syntax to get wrong


@pytest.mark.distributed
def test_stock_json_and_optimizer_8bit(tmp_path):
    (res,) = run_ranks(ROOT / "tests" / "dist" / "ds_config_paths.py", 1, [tmp_path])
    assert res["stock_parts"] == [[0, 3], [0, 3]]
    assert res["optimizer"] == "AdamW8bit", res
    assert "torch.uint8" in res["state_dtypes"], res
    err = res["plain_error"]
    assert err.startswith("PPQConfigError") and "ppq.weights.optimizer_8bit=true" in err and "AdamW" in err
