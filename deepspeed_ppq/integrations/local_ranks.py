"""Local ranks on this machine: a free master port, and the ``ppq`` command on N gloo ranks (what
``ppq tune`` does when no launcher started it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from deepspeed_ppq.integrations.shm import release_deepspeed_shm

__all__ = ["free_port", "spawn_local"]


def free_port() -> int:
    """A free TCP port on the loopback interface (the master port of local ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(argv: list[str], nproc: int, timeout: float = 3600) -> int:
    """Run ``python -m deepspeed_ppq.cli <argv>`` on ``nproc`` local gloo ranks; returns the exit code."""
    port = free_port()
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("DS_ACCELERATOR", "cpu")
        procs.append(subprocess.Popen([sys.executable, "-m", "deepspeed_ppq.cli", *argv], env=env))
    codes = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(124)
        if codes[-1]:  # one rank failed: the others would wait for it forever
            for q in procs:
                if q.poll() is None:
                    q.kill()
    release_deepspeed_shm(port, "127.0.0.1")
    return max(codes, key=abs)
