"""A start that fails after ``deepspeed.init_distributed`` but before ``deepspeed_ppq.initialize`` leaves
no DeepSpeed /dev/shm buffer behind (2 real gloo ranks, no clean-up by the harness)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from dist_utils import ROOT, free_port, rank_env

from deepspeed_ppq.integrations.shm import release_deepspeed_shm


@pytest.mark.distributed
def test_failed_start_releases_shm():
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ppq-shm-") as out:
        procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "dist" / "ds_failed_start.py")],
                                  env=rank_env(r, 2, port, out), cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        created = [json.loads((Path(out) / f"buffers{r}.json").read_text()) for r in range(2)]
    left = [p for paths in created for p in paths if Path(p).exists()]
    release_deepspeed_shm(port, "127.0.0.1")  # whatever the outcome, leave nothing behind
    assert all(p.returncode != 0 for p in procs), outputs
    assert all("failed start" in o for o in outputs), outputs
    if not any(created):
        pytest.skip("this DeepSpeed build created no shm all-reduce buffer")
    assert left == [], left
