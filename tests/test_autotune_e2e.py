"""End to end on 2 gloo ranks: ``ppq tune`` profiles a small GPT, plans under a per-stage budget, runs
the baseline and the plan on the real DeepSpeed pipeline engine and reports predicted vs measured."""

from __future__ import annotations

import json

import pytest

from deepspeed_ppq.autotune import autotune, load_plan


@pytest.mark.distributed
@pytest.mark.slow
def test_ppq_tune_two_ranks(tmp_path):
    spec = {
        "model": {"vocab_size": 512, "seq_len": 64, "d_model": 128, "n_layers": 4, "n_heads": 4},
        "global_batch": 8,
        "micro_batch_sizes": [1, 2, 4],
        "pipeline_degrees": [2],
        "formats": ["int8"],
        "activation_codecs": [{"method": "none"}, {"method": "quant", "bits": 8}],
        "gradient_codecs": [{"method": "none"}, {"method": "quant", "bits": 8}],
        "weights": {"keep_first_blocks": 0, "keep_last_blocks": 0},
        "memory_budget": 14 * 2**20,
        "trial_steps": 4,
        "warmup_steps": 1,
        "val_batches": 2,
        "profile_reps": 3,
        "corpus_bytes": 300_000,
        "profile_cache": str(tmp_path / "profile.json"),
        "out_dir": str(tmp_path / "out"),
    }
    result = autotune(spec, nproc=2)
    out = tmp_path / "out"
    report = (out / "report.md").read_text()
    assert "predicted" in report and "measured" in report and "--pipeline-model-parallel-layout" in report
    assert (tmp_path / "profile.json").exists()
    base = result["baseline"]["run"]
    last = result["iterations"][-1]
    plan = load_plan(out / "plan.json") if result["accepted"] else None
    for run, plan_dict in ((base, result["baseline"]["plan"]), (last["run"], last["plan"])):
        bounds = plan_dict["derived"]["boundaries"]
        for st in run["stages"]:
            # the engine ran the planned partition, and the memory it held matches the prediction
            assert st["layers"] == [bounds[st["stage"]], bounds[st["stage"] + 1]]
            pred = sum(st["predicted_memory"].values())
            meas = sum(v for k, v in st["measured_memory"].items() if k != "cuda_max_allocated")
            assert meas == pytest.approx(pred, rel=0.10), st
            # static categories are exact (same storage accounting as the ledger)
            for cat in ("weights", "master", "gradients", "optimizer"):
                assert st["measured_memory"][cat] == pytest.approx(st["predicted_memory"][cat], rel=0.01), cat
        assert run["measured_step_time"] > 0 and run["predicted_step_time"] > 0
    # the planned configuration fits the budget the baseline had to shrink its micro-batch for
    for st in last["run"]["stages"]:
        assert sum(st["predicted_memory"].values()) <= spec["memory_budget"]
    if plan is not None:
        assert plan.global_batch == 8 and plan.memory_budget == spec["memory_budget"]
        if plan.activation_codec["method"] != "none":  # bytes on the wire went through the codec
            wire = [w for r in last["run"]["wire"] for w in r.values()]
            assert any(x.get("wire_bytes", 0) < x.get("raw_bytes", 0) for x in wire)
    json.dumps(result)  # the whole record is JSON


def test_autotune_rejects_unknown_spec_field():
    with pytest.raises(TypeError, match="no_such_field"):
        autotune({"no_such_field": 1})


@pytest.mark.distributed
@pytest.mark.slow
def test_ppq_tune_master_free_two_ranks(tmp_path):
    """Under a budget where fp32 masters do not fit (recomputation off: with it, recomputing is cheaper
    than the master-free update, which costs about twice an fp32 Adam step), the planner keeps only int8
    codes (weights.master='none'); the engine runs that plan with no master and the static memory the
    planner predicted."""
    from deepspeed_ppq.autotune.loop import master_free_supported

    if not master_free_supported():
        pytest.skip("deepspeed_ppq.quant has no master-free QuantLinear")
    spec = {
        "model": {"vocab_size": 512, "seq_len": 64, "d_model": 128, "n_layers": 4, "n_heads": 4},
        "global_batch": 8,
        "micro_batch_sizes": [1, 2, 4, 8],
        "pipeline_degrees": [2],
        "formats": ["int8"],
        "master_free": True,
        "optimizer_8bit": False,
        "allow_recompute": False,
        "weights": {"keep_first_blocks": 0, "keep_last_blocks": 0},
        "memory_budget": int(8.5 * 2**20),
        "trial_steps": 3,
        "warmup_steps": 1,
        "val_batches": 1,
        "profile_reps": 3,
        "corpus_bytes": 300_000,
        "out_dir": str(tmp_path / "out"),
    }
    result = autotune(spec, nproc=2)
    first = result["iterations"][0]
    assert first["plan"]["master_free"], first["plan"]
    assert first["plan"]["derived"]["deepspeed"]["ppq"]["weights"]["master"] == "none"
    assert any(f == "int8" for s in first["plan"]["stages"] for f in s["formats"])
    for st in first["run"]["stages"]:
        assert st["measured_memory"]["master"] == 0
        for cat in ("weights", "gradients", "optimizer"):
            assert st["measured_memory"][cat] == pytest.approx(st["predicted_memory"][cat], rel=0.01), cat
