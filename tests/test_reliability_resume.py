"""Exact resume on 2 real gloo ranks (tests/dist/ds_resume.py): for every codec, N steps + save + resume
+ M steps gives bit-identical losses and parameters to N+M steps (EF/EF21/EF-mixed buffers, AQ-SGD
buffers in memory and on disk with their sample ids, counters: ``integrations.codec_state``); the state
files load with ``weights_only=True``; a checkpoint written at resume format 1 (tests/golden/resume_v1)
still resumes bit for bit; resuming into a different partition, codec or optimizer stops naming what
differs and how to convert."""

from __future__ import annotations

import json

import pytest
from dist_utils import ROOT, run_ranks
from test_reliability_nonfinite import CODECS

from deepspeed_ppq.integrations.codec_state import FORMAT

SCRIPT = ROOT / "tests" / "dist" / "ds_resume.py"
RESUME = {name: {**ppq, "warmup_steps": 1} for name, ppq in CODECS.items()}
RESUME["none"] = {}
RESUME["aqsgd_disk"] = {**CODECS["aqsgd"], "aqsgd": {"enabled": True, "warmup_steps": 1, "storage": "disk",
                                                      "num_samples": 8}}
RESUME["aqsgd"] = {**CODECS["aqsgd"], "aqsgd": {"enabled": True, "warmup_steps": 1}}
# tests/golden/resume_v1: the checkpoint ds_resume.py's save-golden mode wrote after GOLDEN_STEPS steps
# when the state files were at format 1
GOLDEN_PPQ = {"activations": {"method": "quant", "bits": 4},
              "gradients": {"method": "quant", "bits": 8, "error_feedback": "ef"},
              "aqsgd": {"enabled": True, "warmup_steps": 1}}
GOLDEN_STEPS = 3
INT4 = {"activations": {"method": "quant", "bits": 4}, "gradients": {"method": "quant", "bits": 8}}
MISMATCH = [
    {"name": "other_codec", "ppq": RESUME["int8"], "resume_ppq": INT4, "n": 1, "m": 0},
    {"name": "other_parts", "ppq": RESUME["int8"], "resume_boundaries": [0, 4, 7], "n": 1, "m": 0},
    {"name": "other_optimizer", "ppq": RESUME["int8"], "resume_optimizer": "sgd", "n": 1, "m": 0},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("resume")
    cases = [{"name": name, "ppq": ppq} for name, ppq in RESUME.items()] + MISMATCH
    cases.append({"name": "golden_v1", "ppq": GOLDEN_PPQ, "n": GOLDEN_STEPS, "m": 3,
                  "golden": str(ROOT / "tests" / "golden" / "resume_v1")})
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
def test_format_1_checkpoint_resumes_bit_identically(results):
    for rank, res in enumerate(results):
        r = res["golden_v1"]
        assert r["formats"] == [1], r  # the golden files are the old format ...
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
