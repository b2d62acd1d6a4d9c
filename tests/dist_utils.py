"""Run a script on N real gloo processes, the way ``torchrun``/the ``deepspeed`` launcher would.

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, DS_ACCELERATOR=cpu and one thread;
a rank reports back by calling ``write_result(obj)``, which ``run_ranks`` returns per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from deepspeed_ppq.integrations.local_ranks import free_port

ROOT = Path(__file__).resolve().parent.parent


def rank_env(rank: int, world_size: int, port: int, out_dir: str, threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS=str(threads),
        PPQ_TEST_OUT=out_dir,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]),
    )
    return env


def run_ranks(script: str | Path, world_size: int, args: list[str] | tuple = (), timeout: float = 600,
              threads: int = 1) -> list[dict]:
    """Start ``world_size`` processes of ``script`` and return each rank's ``write_result`` object.

    Raises:
        RuntimeError: if any rank fails or times out, with the tail of every rank's output.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ppq-dist-") as out_dir:
        procs = []
        for r in range(world_size):
            log = open(Path(out_dir) / f"rank{r}.log", "w")
            procs.append((subprocess.Popen([sys.executable, str(script), *map(str, args)],
                                           env=rank_env(r, world_size, port, out_dir, threads),
                                           stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
        failed = False
        for p, log in procs:
            try:
                failed |= p.wait(timeout=timeout) != 0
            except subprocess.TimeoutExpired:
                failed = True
            log.close()
        if failed:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
            from deepspeed_ppq.integrations.shm import release_deepspeed_shm

            release_deepspeed_shm(port, "127.0.0.1")
            tails = []
            for r in range(world_size):
                text = (Path(out_dir) / f"rank{r}.log").read_text()
                tails.append(f"--- rank {r} (exit {procs[r][0].returncode}) ---\n{text[-4000:]}")
            raise RuntimeError(f"{script} failed on {world_size} ranks:\n" + "\n".join(tails))
        # DeepSpeed's CPU backend leaves a /dev/shm buffer per rank behind; drop this run's.
        from deepspeed_ppq.integrations.shm import release_deepspeed_shm

        release_deepspeed_shm(port, "127.0.0.1")
        results = []
        for r in range(world_size):
            path = Path(out_dir) / f"rank{r}.json"
            results.append(json.loads(path.read_text()) if path.exists() else {})
        return results


def write_result(obj) -> None:
    """Called inside a rank: hand ``obj`` (JSON-able) back to ``run_ranks``."""
    out = os.environ.get("PPQ_TEST_OUT")
    if out:
        Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(obj))
