import json

import pytest

from deepspeed_ppq.config import PPQConfig, PPQConfigError, WeightFormat, load_ppq_config, ppq_json_schema


def test_defaults_are_safe():
    cfg = load_ppq_config(None)
    assert cfg.weights.format is WeightFormat.none
    assert not cfg.activations.enabled and not cfg.gradients.enabled
    assert cfg.nonfinite == "error"


def test_whole_deepspeed_config_is_unwrapped(tmp_path):
    ds = {"train_batch_size": 8, "ppq": {"weights": {"format": "nf4"}, "activations": {"method": "topk"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    cfg = load_ppq_config(str(path))
    assert cfg.weights.format is WeightFormat.nf4 and cfg.weights.format.bits == 4
    assert cfg.activations.eval_compressed  # on by default for TopK


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"activations": {"bitz": 4}}, r"ppq\.activations\.bitz: unknown key; did you mean 'bits'\?"),
        ({"weihgts": {}}, r"ppq\.weihgts: unknown key; did you mean 'weights'\?"),
        ({"activations": {"method": "topk", "topk_ratio": 0}}, r"topk_ratio=0.* outside \(0, 1\]"),
        ({"activations": {"bits": 3}}, r"ppq\.activations\.bits=3"),
        ({"weights": {"block_size": 100}}, r"block_size=100 is not allowed: use a power of two"),
        ({"weights": {"format": "int3"}}, r"ppq\.weights\.format='int3'.*'int8'"),
        ({"gradients": {"method": "topk"}}, r"reuse_indices=true needs activations\.method='topk'"),
        ({"aqsgd": {"enabled": True}}, r"aqsgd\.enabled=true needs a compressing activations\.method"),
        ({"partition": {"method": "explicit", "boundaries": [0, 5, 3]}}, r"strictly increasing"),
        ({"partition": {"method": "profile"}}, r"'profile' is not a partition method"),
        ({"nonfinite": "ignore"}, r"ppq\.nonfinite='ignore'"),
        ({"activations": {"method": "quant", "error_feedback": "ef_mixed"}},
         r"ef_mixed.*needs method='topk'"),
        ({"gradients": {"error_feedback": "ef"}}, r"error_feedback='ef' needs a compressing method"),
        ({"weights": {"format": "nf4", "master": "none"}}, r"master='none' needs 8-bit codes .* got 'nf4'"),
        ({"weights": {"format": "int8", "master": "none", "mode": "frozen"}},
         r"master='none' is a train-mode"),
    ],
)
def test_bad_config_names_field_value_and_fix(bad, message):
    with pytest.raises(PPQConfigError, match=message):
        load_ppq_config(bad)


def test_compress_eval_rules():
    assert load_ppq_config({"activations": {"method": "quant", "bits": 4}}).activations.eval_compressed
    assert not load_ppq_config({"activations": {"method": "quant", "bits": 8}}).activations.eval_compressed
    cfg = load_ppq_config({"activations": {"method": "quant", "bits": 8, "compress_eval": True}})
    assert cfg.activations.eval_compressed


def test_schema_round_trip():
    schema = ppq_json_schema()
    assert set(schema["properties"]) == set(PPQConfig.model_fields)
    assert schema["$defs"]["CodecConfig"]["additionalProperties"] is False
