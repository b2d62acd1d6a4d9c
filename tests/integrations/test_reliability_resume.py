"""Exact resume on 2 real gloo ranks (tests/dist/ds_resume.py): for every codec, N steps + save + resume
+ M steps gives bit-identical losses and parameters to N+M steps (EF/EF21/EF-mixed buffers, AQ-SGD
buffers in memory and on disk with their sample ids, counters: ``integrations.codec_state``); the state
files load with ``weights_only=True``; checkpoints written at resume formats 1 and 2
(tests/golden/resume_v1, resume_v2) still resume bit for bit; resuming into a different partition, codec,
precision policy (block size, scale dtype, double quantization, kept blocks, rules: the per-Linear formats
in force) or optimizer stops naming what differs and how to convert; the same low-bit set-up resumes bit
for bit."""

from __future__ import annotations

import json

import pytest
from dist_utils import ROOT, run_ranks
from ds_resume import GOLDEN_PPQ, GOLDEN_STEPS  # the settings tests/golden/resume_v* were written with
from test_reliability_nonfinite import CODECS

from deepspeed_ppq.integrations.codec_state import FORMAT

SCRIPT = ROOT / "tests" / "dist" / "ds_resume.py"
RESUME = {name: {**ppq, "warmup_steps": 1} for name, ppq in CODECS.items()}
RESUME["none"] = {}
RESUME["aqsgd_disk"] = {**CODECS["aqsgd"], "aqsgd": {"enabled": True, "warmup_steps": 1, "storage": "disk",
                                                      "num_samples": 8}}
RESUME["aqsgd"] = {**CODECS["aqsgd"], "aqsgd": {"enabled": True, "warmup_steps": 1}}
INT4 = {"activations": {"method": "quant", "bits": 4}, "gradients": {"method": "quant", "bits": 8}}
# low-bit weights on ds_nonfinite.make_layers (Linear 0 on stage 0; Linear 4 and 6 on stage 1; the policy
# takes the Linear layers, the most frequent kind, as the blocks): every Linear int8 at first
W8 = {"format": "int8", "keep_first_blocks": 0, "keep_last_blocks": 0}
RESUME["int8_weights"] = {**RESUME["int8"], "weights": {**W8, "double_quant": True, "scale_dtype": "bf16"}}
LOW_BIT = {**RESUME["int8"], "weights": W8}
MISMATCH = [
    {"name": "other_codec", "ppq": RESUME["int8"], "resume_ppq": INT4, "n": 1, "m": 0},
    {"name": "other_parts", "ppq": RESUME["int8"], "resume_boundaries": [0, 4, 7], "n": 1, "m": 0},
    {"name": "other_optimizer", "ppq": RESUME["int8"], "resume_optimizer": "sgd", "n": 1, "m": 0},
    {"name": "other_block_size", "ppq": LOW_BIT, "n": 1, "m": 0,
     "resume_ppq": {**LOW_BIT, "weights": {**W8, "block_size": 32}}},
    {"name": "other_scale_dtype", "ppq": LOW_BIT, "n": 1, "m": 0,
     "resume_ppq": {**LOW_BIT, "weights": {**W8, "scale_dtype": "bf16"}}},
    {"name": "other_double_quant", "ppq": LOW_BIT, "n": 1, "m": 0,
     "resume_ppq": {**LOW_BIT, "weights": {**W8, "double_quant": True}}},
    {"name": "other_kept_blocks", "ppq": LOW_BIT, "n": 1, "m": 0,
     "resume_ppq": {**LOW_BIT, "weights": {**W8, "keep_last_blocks": 1}}},
    {"name": "other_rules", "ppq": LOW_BIT, "n": 1, "m": 0,
     "resume_ppq": {**LOW_BIT, "weights": {**W8, "rules": [{"pattern": "4", "format": "nf4"}]}}},
    {"name": "dense_into_int8", "ppq": RESUME["int8"], "resume_ppq": LOW_BIT, "n": 1, "m": 0},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("resume")
    cases = [{"name": name, "ppq": ppq} for name, ppq in RESUME.items()] + MISMATCH
    for version in (1, 2):
        cases.append({"name": f"golden_v{version}", "ppq": GOLDEN_PPQ, "n": GOLDEN_STEPS, "m": 3,
                      "golden": str(ROOT / "tests" / "golden" / f"resume_v{version}")})
    (work / "cases.json").write_text(json.dumps(cases))
    return run_ranks(SCRIPT, 2, [work / "cases.json", work])


@pytest.mark.distributed
@pytest.mark.parametrize("codec", list(RESUME))
def test_resume_is_bit_identical(results, codec):
    for rank, res in enumerate(results):
        r = res[codec]
        assert r["resumed"] == r["full"], (rank, codec, r)
        assert r["params_equal"] and r["global_steps"] == 6, (rank, codec, r)
        assert r["state_files"] == 2 and r["weights_only"] and r["formats"] == [FORMAT], (rank, codec, r)


@pytest.mark.distributed
@pytest.mark.parametrize("version", [1, 2])
def test_older_format_checkpoint_resumes_bit_identically(results, version):
    assert FORMAT == 3
    for rank, res in enumerate(results):
        r = res[f"golden_v{version}"]
        assert r["formats"] == [version], r  # the golden files are the old format ...
        assert r["resumed"] == r["full"] and r["params_equal"], (rank, r)  # ... and resume exactly


@pytest.mark.distributed
def test_resume_into_other_setup_names_the_difference(results):
    for res in results:
        err = res["other_codec"]["error"]
        assert err.startswith("PPQConfigError"), err
        assert "ppq.activations.bits: checkpoint has 8, this run has 4" in err, err
        assert "load_module_only=True" in err, err
        err = res["other_parts"]["error"]
        assert "pipeline.parts: checkpoint has [0, 3, 7], this run has [0, 4, 7]" in err, err
        err = res["other_optimizer"]["error"]
        assert "optimizer.class: checkpoint has 'Adam', this run has 'SGD'" in err, err
        assert "load_optimizer_states=False" in err, err


@pytest.mark.distributed
@pytest.mark.parametrize("case,lines", [
    ("other_block_size", ["weights.block_size: checkpoint has 64, this run has 32"]),
    ("other_scale_dtype", ["weights.scale_dtype: checkpoint has 'fp32', this run has 'bf16'"]),
    ("other_double_quant", ["weights.double_quant: checkpoint has False, this run has True"]),
    # the last Linear (layer 6, on stage 1) stays dense now
    ("other_kept_blocks", ["weights.keep_last_blocks: checkpoint has 0, this run has 1",
                           "linear_formats.6: checkpoint has 'int8', this run has 'none'"]),
    # layer 4 (stage 1) becomes NF4
    ("other_rules", ["weights.rules: checkpoint has [], this run has [{",
                     "linear_formats.4: checkpoint has 'int8', this run has 'nf4'"]),
    ("dense_into_int8", ["weights.format: checkpoint has 'none', this run has 'int8'",
                         "linear_formats.0: checkpoint has 'none', this run has 'int8'",
                         "linear_formats.4: checkpoint has 'none', this run has 'int8'"]),
])
def test_resume_into_other_precision_policy_names_the_difference(results, case, lines):
    for rank, res in enumerate(results):
        err = res[case]["error"]
        assert err.startswith("PPQConfigError: cannot resume from ") and "set up differently" in err, err
        for line in lines:
            layer = line.partition("linear_formats.")[2].partition(":")[0]
            if layer and (int(layer) < 3) != (rank == 0):  # each rank checks its own stage's layers
                assert f"linear_formats.{layer}:" not in err, (rank, err)
                continue
            assert line in err, (rank, err)
        assert "to convert:\n  weights: start with the saved ppq.weights" in err, (rank, err)


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "other format", "not a dict"])
def test_unreadable_or_foreign_state_file_names_the_file(tmp_path, damage):
    """A damaged ``ppq_state_rank<R>.pt`` stops naming the file and the way out, not a raw traceback."""
    import torch

    from deepspeed_ppq.config import PPQConfigError
    from deepspeed_ppq.integrations.codec_state import read_state

    good = ROOT / "tests" / "golden" / "resume_v1" / "golden" / "ppq_state_rank0.pt"
    assert read_state(str(good))["format"] == 1  # the undamaged file reads
    path = tmp_path / "ppq_state_rank0.pt"
    if damage == "truncated":
        path.write_bytes(good.read_bytes()[:200])
    elif damage == "random bytes":
        path.write_bytes(bytes(range(256)) * 4)
    else:
        torch.save({"format": 7} if damage == "other format" else [1, 2], path)
    want = "ppq checkpoint state format" if damage in ("other format", "not a dict") else \
        "not a readable ppq checkpoint state file"
    with pytest.raises(PPQConfigError, match=rf"(?s){path}: {want}.*load_module_only=True"):
        read_state(str(path))
