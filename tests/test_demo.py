"""The main job, shortened: ``python -m deepspeed_ppq.demo --quick`` runs baseline and tuned pipelines
under the real ``deepspeed`` launcher (2 gloo ranks) and writes the report, the trace and the plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepspeed_ppq.demo import demo_settings, main
from deepspeed_ppq.plots import chrome_trace

ROOT = Path(__file__).resolve().parent.parent


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
        assert 0 < run["val_loss"] < 7  # below log(512) + a margin: it trained and evaluated
        assert len(run["stages"]) == 2
    # The baseline is stock DeepSpeed: fp32, no codecs, 8-bit optimizer off.
    base = summary["runs"]["baseline"]
    assert base["weight_formats"] == ["none"] and base["activation_codec"] == {"method": "none"}
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert "| samples/s (measured) |" in (tmp_path / "report.md").read_text()
