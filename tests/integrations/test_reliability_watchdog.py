"""The watchdog on 2 real gloo ranks: one rank SIGSTOPs itself before step 2; the other stops by itself
with an error naming its stage, the stage it waits on and what for (instead of gloo's 30-minute wait),
and the stopped rank, once continued, fails too (its peer is gone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from dist_utils import ROOT, free_port, rank_env

from deepspeed_ppq.integrations.shm import deepspeed_shm_paths, release_deepspeed_shm
from deepspeed_ppq.integrations.watchdog import EXIT_CODE

SCRIPT = ROOT / "tests" / "dist" / "ds_watchdog.py"
TIMEOUT_S = 3  # the watchdog's limit in this test (the default is 300 s)


@pytest.mark.distributed
@pytest.mark.parametrize("stuck", [0, 1])
def test_stopped_stage_stops_the_other(stuck):
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ppq-watchdog-") as out:
        logs = [open(Path(out) / f"rank{r}.log", "w+") for r in range(2)]
        procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(stuck), str(TIMEOUT_S)],
                                  env=rank_env(r, 2, port, out), stdout=logs[r], stderr=subprocess.STDOUT,
                                  cwd=ROOT) for r in range(2)]
        other = 1 - stuck
        try:
            rc = procs[other].wait(timeout=300)  # a harness limit only: the watchdog must end it
        finally:
            os.kill(procs[stuck].pid, signal.SIGCONT)
            try:
                stuck_rc = procs[stuck].wait(timeout=300)
            except subprocess.TimeoutExpired:
                procs[stuck].kill()
                stuck_rc = None
            for p in procs:
                if p.poll() is None:
                    p.kill()
        text = [(Path(out) / f"rank{r}.log").read_text() for r in range(2)]
        for f in logs:
            f.close()
    assert rc == EXIT_CODE, text[other][-3000:]
    assert "ppq-test: stopping myself" in text[stuck]
    want = "activations from stage 0" if other == 1 else "gradients from stage 1"
    msg = next(line for line in text[other].splitlines() if line.startswith("ppq watchdog:"))
    assert f"stage {other} (rank {other}) made no progress" in msg and want in msg, msg
    assert "ppq.watchdog_timeout_s=3" in msg, msg
    assert stuck_rc not in (None, 0), text[stuck][-3000:]  # its peer is gone: it fails, it does not hang
    assert "ppq-test: finished" not in text[stuck]
    left = deepspeed_shm_paths(port, "127.0.0.1", ranks=[other])
    release_deepspeed_shm(port, "127.0.0.1")
    assert not left  # the watchdog released its rank's buffer before ending the process
