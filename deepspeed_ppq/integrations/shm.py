"""Release the shared-memory buffers DeepSpeed's CPU communication backend leaves behind.

On CPU, ``deepspeed.init_distributed`` builds its shm all-reduce op, and every rank creates
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (about 66 MiB) that
DeepSpeed 0.19.8 never unlinks: every CPU run leaves one per rank in RAM-backed ``/dev/shm`` until the
machine reboots (a test suite of multi-rank runs fills it by gigabytes). Unlinking the name once every rank
has mapped the buffer (at exit, or after the run) frees the memory when the last mapping goes; the
running processes are not affected.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

__all__ = ["deepspeed_shm_paths", "release_deepspeed_shm", "release_at_exit"]

_SHM_DIR = Path("/dev/shm")
_REGISTERED = False


def deepspeed_shm_paths(port: int | str | None = None, addr: str | None = None,
                        ranks=None) -> list[Path]:
    """The buffer files of the run at ``addr:port`` (default: this process's MASTER_ADDR/PORT)."""
    addr = addr or os.environ.get("MASTER_ADDR", "")
    port = port if port is not None else os.environ.get("MASTER_PORT", "")
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_"
    if not _SHM_DIR.is_dir():
        return []
    paths = [p for p in _SHM_DIR.glob(prefix + "*") if p.name[len(prefix):].isdigit()]
    if ranks is not None:
        wanted = {str(r) for r in ranks}
        paths = [p for p in paths if p.name[len(prefix):] in wanted]
    return sorted(paths)


def release_deepspeed_shm(port: int | str | None = None, addr: str | None = None, ranks=None) -> int:
    """Unlink the run's buffer files; returns how many were removed."""
    removed = 0
    for p in deepspeed_shm_paths(port, addr, ranks):
        try:
            p.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def release_at_exit() -> None:
    """At interpreter exit, unlink this rank's buffer (called by ``deepspeed_ppq.initialize``)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    rank, port, addr = os.environ.get("RANK"), os.environ.get("MASTER_PORT"), os.environ.get("MASTER_ADDR")
    if rank is not None and port and addr:
        atexit.register(release_deepspeed_shm, port, addr, [rank])
