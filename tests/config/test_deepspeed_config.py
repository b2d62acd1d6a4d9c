"""Configs shipped in configs/, the exported JSON schema, explicit boundaries and codec settings."""

from __future__ import annotations

import json

import pytest
from dist_utils import ROOT

from deepspeed_ppq.config import PPQConfigError, load_ppq_config, ppq_json_schema
from deepspeed_ppq.integrations.deepspeed import check_codecs, codec_settings
from deepspeed_ppq.integrations.pipe_module import check_boundaries

CONFIGS = sorted((ROOT / "configs").glob("ds_*.json"))


def test_schema_file_is_current():
    path = ROOT / "configs" / "ppq.schema.json"
    assert json.loads(path.read_text()) == ppq_json_schema(), \
        "regenerate: python -m deepspeed_ppq.config > configs/ppq.schema.json"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path):
    cfg = json.loads(path.read_text())
    ppq = load_ppq_config(cfg)
    check_codecs(ppq)
    assert ppq.activations.enabled and ppq.partition.method == "explicit"
    b = ppq.partition.boundaries
    check_boundaries(b, b[-1], len(b) - 1)


def test_boundaries_errors_name_the_field():
    assert check_boundaries([0, 3, 10], 10, 2) == [0, 3, 10]
    with pytest.raises(PPQConfigError, match=r"boundaries=\[0, 3, 9\].*end at the number of layers \(10\)"):
        check_boundaries([0, 3, 9], 10, 2)
    with pytest.raises(PPQConfigError, match=r"needs num_stages \+ 1 = 3 entries, got 4"):
        check_boundaries([0, 3, 6, 10], 10, 2)
    with pytest.raises(PPQConfigError, match="strictly increasing"):
        check_boundaries([0, 0, 10], 10, 2)


def test_bad_codec_params_fail_before_any_communication():
    with pytest.raises(PPQConfigError, match=r"ppq.activations.topk_ratio=0.0"):
        load_ppq_config({"activations": {"method": "topk", "topk_ratio": 0.0}})
    with pytest.raises(PPQConfigError, match=r"ppq.gradients: .*ef_mixed.*needs method='topk'"):
        check_codecs(load_ppq_config({"gradients": {"method": "quant", "error_feedback": "ef_mixed"}}))


def test_codec_settings_cover_what_both_sides_must_share():
    a = load_ppq_config({"activations": {"method": "quant", "bits": 4}, "weights": {"format": "int8"}})
    b = load_ppq_config({"activations": {"method": "quant", "bits": 4}})
    assert codec_settings(a) == codec_settings(b)  # weights may differ per stage
    c = load_ppq_config({"activations": {"method": "quant", "bits": 2}})
    assert codec_settings(c) != codec_settings(b)
