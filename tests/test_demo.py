"""The main job, shortened: ``python -m deepspeed_ppq.demo --quick`` runs baseline and tuned pipelines
under the real ``deepspeed`` launcher (2 gloo ranks) and writes the report, the trace and the plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepspeed_ppq.demo import _policy_linear_formats, demo_settings, main
from deepspeed_ppq.plots import chrome_trace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "e2e"))


def test_settings_scale_and_bad_input():
    base, big = demo_settings(), demo_settings(scale=4)
    assert big["train_steps"] == 4 * base["train_steps"]
    assert big["model"]["d_model"] > base["model"]["d_model"]
    with pytest.raises(ValueError, match="scale=0 must be >= 1"):
        demo_settings(scale=0)
    with pytest.raises(SystemExit):
        main(["--budget-mb", "-1"])


def test_chrome_trace_has_one_track_per_stage():
    ranks = [{"stage": s, "events": [["ForwardPass", 0.0, 0.01], ["SendActivation", 0.01, 0.012]]}
             for s in range(2)]
    tr = chrome_trace({"baseline": ranks})
    spans = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1}
    assert {e["cat"] for e in spans} == {"compute", "comm"}
    assert spans[0]["dur"] == pytest.approx(1e4)


def test_policy_linear_formats_follow_the_plan_and_the_policy():
    """Only layers the plan puts in int8 get rules, and inside them only what the policy quantizes:
    the default policy keeps the first and last block (and the embedding and head) in full precision."""
    from deepspeed_ppq.config import WeightsConfig
    from deepspeed_ppq.models import GPTConfig, gpt_layers, layer_kinds
    from deepspeed_ppq.quant import convert_model

    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=2, n_layers=5)
    layers, kinds = gpt_layers(cfg, 0), layer_kinds(cfg)  # 0 embed, 1-5 blocks 0-4, 6 head
    plan = SimpleNamespace(layer_formats=["int8", "int8", "int8", "none", "int8", "int8", "int8"])
    got = _policy_linear_formats(layers, kinds, WeightsConfig(), plan)
    # embed, first block (1), last block (5), head: kept by the policy; layer 3: fp32 in the plan
    assert {n.split(".")[0] for n in got} == {"2", "4"}
    assert set(got.values()) == {"int8"} and len(got) == 8  # qkv, attn proj, fc, mlp proj in each
    # The rules the plan renders from them convert exactly those Linear layers of the pipeline's names.
    model = torch.nn.Sequential(*layers)
    rules = [{"pattern": n, "format": f} for n, f in got.items()] + [{"pattern": "*", "format": "none"}]
    convert_model(model, {"format": "int8", "keep_first_blocks": 0, "keep_last_blocks": 0, "rules": rules})
    assert {n for n, m in model.named_modules() if type(m).__name__ == "QuantLinear"} == set(got)


def test_quality_findings_judged_against_seed_noise():
    from bench_quality import findings, seed_noise

    def row(name, group, compressed, plain=None):
        return {"name": name, "group": group, "val_loss_compressed": compressed,
                "val_loss_plain": compressed if plain is None else plain}

    rows = [row("uncompressed", "baseline", 4.00), row("uncompressed seed+1", "seed noise", 4.02),
            row("uncompressed seed+2", "seed noise", 3.99), row("a4/g8", "bits", 4.01),
            row("a8/g4", "bits", 4.20), row("top10% reuse", "topk", 4.05, plain=4.06)]
    assert seed_noise(rows) == pytest.approx(0.02)
    text = "\n".join(findings(rows))
    assert "gradients more sensitive" in text and "holds (gap +0.1900 > seed noise 0.0200)" in text
    assert "same direction, within seed noise (gap +0.0100 <= 0.0200)" in text  # TopK at evaluation
    assert "TopK10% without index reuse worse" in text and "not measured" in text


def test_quality_findings_on_accuracy_flip_the_sign_and_cnn_setting_is_sound():
    """On the CNN setting a finding is judged on test accuracy (higher is better); the generated images
    are deterministic and balanced; codec 'none' leaves the staged ResNet identical to the plain one."""
    from bench_quality import check_findings, seed_noise
    from quality_cnn import CNN_DEFAULTS, check_cnn_reference, make_images

    def row(name, group, acc, plain=None):
        return {"name": name, "group": group, "acc_compressed": acc,
                "acc_plain": acc if plain is None else plain, "val_loss_compressed": 1.0,
                "val_loss_plain": 1.0}

    rows = [row("uncompressed", "baseline", 90.0), row("uncompressed seed+1", "seed noise", 89.5),
            row("a4/g8 per-sample", "granularity", 89.0), row("a8/g4 per-sample", "granularity", 80.0),
            row("a2/g8", "bits", 70.0, plain=40.0)]
    assert seed_noise(rows, "acc") == pytest.approx(0.5)
    got = {k: (text, v) for k, text, v in check_findings(rows, "acc", "per-channel")}
    text, v = got["gradients more sensitive than activations (4 bits, per-sample scales, swapped)"]
    assert v == "holds" and "Δ acc a8/g4 per-sample = -10.00 pts" in text and "gap +9.00 pts" in text
    assert got["2-bit activations need compression at evaluation"][1] == "holds"  # 40% plain < 70% with it
    assert got["TopK10% without index reuse worse"][1] == "not measured"

    x, y = make_images(400, seed=3)
    x2, y2 = make_images(400, seed=3)
    assert x.shape == (400, 3, 16, 16) and torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(make_images(400, seed=4)[0], x)
    assert torch.bincount(y, minlength=10).min() > 20  # every class present
    with pytest.raises(ValueError, match="n=0"):
        make_images(0, seed=0)
    check_cnn_reference({**CNN_DEFAULTS, "seed": 0})  # raises SystemExit on a mismatch


@pytest.mark.distributed
@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "deepspeed_ppq.demo", "--quick", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert str(tmp_path) in res.stdout  # the output folder is printed
    for f in ("report.md", "trace.json", "loss.png", "timeline.png", "memory.png", "plan_tuned.json",
              "plan_baseline.json", "summary.json"):
        assert (tmp_path / f).stat().st_size > 0, f
    summary = json.loads((tmp_path / "summary.json").read_text())
    s = demo_settings(quick=True)
    for name in ("baseline", "tuned"):
        run = summary["runs"][name]
        assert run["global_batch"] == s["global_batch"]
        assert run["samples_per_s"] > 0 and 0 <= run["bubble_measured"] < 1
        assert run["bubble_measured"] <= run["non_compute_measured"] < 1  # send/recv is not compute
        assert 0 < run["val_loss"] < 7  # below log(512) + a margin: it trained and evaluated
        assert len(run["stages"]) == 2
    # The baseline is stock DeepSpeed: fp32, no codecs, 8-bit optimizer off.
    base = summary["runs"]["baseline"]
    assert base["weight_formats"] == ["none"] and base["activation_codec"] == {"method": "none"}
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert "| samples/s (measured) |" in (tmp_path / "report.md").read_text()


def test_e2e_check_run_catches_a_run_that_left_its_plan():
    from bench_e2e import check_run

    plan = SimpleNamespace(boundaries=[0, 3, 6], micro_batch_size=2, layer_formats=["none"] * 6)
    settings = {"global_batch": 8}
    ranks = [{"parts": [0, 3, 6], "weight_formats": [], "losses": [6.0, 5.5, 5.2, 5.0]}] * 2
    summary = {"global_batch": 8, "micro_batch": 2}
    check_run("ok", plan, ranks, summary, settings)  # no error
    with pytest.raises(SystemExit, match=r"moved: ran partition \[0, 4, 6\], planned \[0, 3, 6\]"):
        check_run("moved", plan, [{**ranks[0], "parts": [0, 4, 6]}] * 2, summary, settings)
    with pytest.raises(SystemExit, match="int8: QuantLinear layers"):
        check_run("int8", SimpleNamespace(**{**vars(plan), "layer_formats": ["int8"] * 6}), ranks, summary,
                  settings)
    with pytest.raises(SystemExit, match="flat: training did not lower the loss"):
        check_run("flat", plan, [{**ranks[0], "losses": [5.0, 5.1, 5.2, 5.3]}] * 2, summary, settings)


@pytest.mark.distributed
@pytest.mark.slow
def test_worker_master_free_int8_with_per_stage_recompute(tmp_path):
    """A training run of the demo (deepspeed launcher, 2 gloo ranks) from a config with master-free int8
    rules and recomputation on stage 0 only: the layers convert on the stage that owns them, no fp32
    master is stored, only stage 0 recomputes, and the loss goes down."""
    from deepspeed_ppq.demo import launch_run

    s = {**demo_settings(quick=True), "train_steps": 4}
    rules = [{"pattern": f"{i}.{n}", "format": "int8"} for i in (2, 3)
             for n in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    weights = {"format": "int8", "master": "none", "keep_first_blocks": 0, "keep_last_blocks": 0,
               "rules": [*rules, {"pattern": "*", "format": "none"}], "optimizer_8bit": True}
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "steps_per_print": 10**6,
          "pipeline": {"activation_checkpoint_interval": 1, "recompute_stages": [0]},  # as plans write it
          "ppq": {"weights": weights, "partition": {"method": "explicit", "boundaries": [0, 3, 6]}}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    with open(tmp_path / "log.txt", "w") as log:
        ranks = launch_run({**s, "name": "mf", "ds_config": str(tmp_path / "ds.json")}, tmp_path, log)
    by_stage = {r["stage"]: r for r in ranks}
    assert all(r["parts"] == [0, 3, 6] for r in ranks)
    assert [by_stage[i]["master_free_layers"] for i in (0, 1)] == [4, 4]  # layer 2 on stage 0, 3 on 1
    for r in ranks:
        assert "master_weights" not in r["memory"]["ledger"]["groups"]
    assert by_stage[0]["recomputed_layers"] == [1, 2] and by_stage[1]["recomputed_layers"] == []
    losses = by_stage[1]["losses"]
    assert losses[-1] < losses[0]
