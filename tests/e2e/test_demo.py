"""The main job, shortened: ``examples/demo/run_demo.py --quick`` tunes the example script with
``ppq tune`` under a budget on 2 gloo ranks (measuring the ladder), then trains it with the plan under
the ``deepspeed`` launcher, and writes the report and the ladder plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "demo" / "run_demo.py"), "--quick", "--out",
                          str(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    result = json.loads((tmp_path / "tune" / "tune.json").read_text())
    report = (tmp_path / "tune" / "report.md").read_text()
    head = report.split("## Stock search")[0]  # the verdict opens the report
    assert sum(h in head for h in ("**Result:", "**No gain over stock", "**No plan passed")) == 1
    budget = result["settings"]["memory_budget"]
    base = result["baseline"]["run"]
    assert all(st["measured_memory"]["total"] <= budget * 1.05 for st in base["stages"])
    if result["outcome"] == "tuned" and result["ladder"]:  # the ladder opens the report and is plotted
        assert "## The ladder" in report and (tmp_path / "ladder.png").exists()
        assert result["ladder"][0]["rung"] == "best stock configuration"
    train_log = (tmp_path / "train.log").read_text()
    assert "step time: median" in train_log
    plan = json.loads((tmp_path / "tune" / "plan.json").read_text())
    a, b = plan["derived"]["boundaries"][:2]
    assert f"stage=0 layers={b - a} [{a}, {b})" in train_log  # the training run holds the plan
