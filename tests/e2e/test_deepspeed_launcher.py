"""The ``deepspeed`` launcher runs the example end to end on CPU (DS_ACCELERATOR=cpu, gloo)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import ROOT, free_port

STEPS, GAS = 3, 4


@pytest.mark.distributed
def test_deepspeed_launcher_runs_cpu_example(tmp_path):
    launcher = Path(sys.executable).with_name("deepspeed")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [str(launcher), "--num_gpus", "2", "--master_port", str(free_port()),
           str(ROOT / "examples" / "train_gpt_pipe.py"),
           "--deepspeed_config", str(ROOT / "configs" / "ds_cpu_smoke.json"), "--steps", str(STEPS),
           "--data", "synthetic", "--d-model", "64", "--seq-len", "32",
           "--stats-json", str(tmp_path / "s.json")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"steps: {STEPS} loss:" in proc.stdout
    # ppq.weights int8 on 8 blocks, first and last kept dense: 6 blocks x 4 Linear layers over both stages
    counts = {int(r): int(n) for r, n in re.findall(r"rank (\d+): (\d+) low-bit Linear layers", proc.stdout)}
    assert sorted(counts) == [0, 1] and sum(counts.values()) == 6 * 4, proc.stdout[-2000:]
    stats = json.loads((tmp_path / "s.json").read_text())
    for key in ("0.act", "0.grad"):
        assert stats[key]["messages"] == STEPS * GAS
        assert 0 < stats[key]["wire_bytes"] < stats[key]["raw_bytes"] / 3  # 4- and 8-bit codes
    # The engine's counters reach DeepSpeed's monitor (csv_monitor in the config), one row per step.
    with open(tmp_path / "runs" / "ds_cpu_smoke" / "PPQ_boundary0_act_wire_bytes.csv") as f:
        rows = list(csv.reader(f))[1:]
    assert len(rows) == STEPS and float(rows[-1][1]) == stats["0.act"]["wire_bytes"]
