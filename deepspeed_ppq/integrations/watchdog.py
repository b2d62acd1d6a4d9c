"""A per-rank watchdog: a stage that makes no progress within a time limit stops with an error.

A rank blocked in a receive from a stage that hangs (stopped, deadlocked, stuck in I/O) would otherwise
wait for gloo's or NCCL's own timeout (30 minutes by default), silently. The engine tells the watchdog
what it is about to wait for (``waiting("activations from stage 0 ...")``) and when it got it
(``progress()``); a daemon thread checks the time since the last progress and, past the limit, prints an
error naming this stage, the stage it waits on and what for, releases this rank's shared-memory buffer and
ends the process (``os._exit``: the main thread is blocked inside the communication library and cannot
be interrupted). Each rank waiting on the stuck stage stops the same way; the stuck rank itself, once it
runs again, finds its peers gone and fails in its next send or receive.

Limit: ``max(ppq.watchdog_timeout_s, 20 x the longest training step seen)``, so slow steps do not trip
it; ``ppq.watchdog_timeout_s=0`` turns it off. Between ``train_batch`` calls (the user's own code,
checkpoints, evaluation outside the engine) the watchdog is idle.
"""

from __future__ import annotations

import os
import sys
import threading
import time

__all__ = ["Watchdog", "STEP_FACTOR", "EXIT_CODE"]

STEP_FACTOR = 20.0
EXIT_CODE = 75


class Watchdog:
    """Watches one rank. ``waiting``/``progress``/``idle`` are called by the engine's thread only."""

    def __init__(self, timeout_s: float, stage: int, rank: int, exit_fn=os._exit):
        self.timeout_s = float(timeout_s)
        self.stage, self.rank = stage, rank
        self._exit = exit_fn
        self._what: str | None = None  # None: idle (outside train_batch)
        self._since = time.monotonic()
        self._longest_step = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ppq-watchdog-stage{stage}", daemon=True)
        self._thread.start()

    def limit(self) -> float:
        return max(self.timeout_s, STEP_FACTOR * self._longest_step)

    def waiting(self, what: str) -> None:
        self._what, self._since = what, time.monotonic()

    def progress(self, what: str = "running its schedule") -> None:
        self.waiting(what)

    def idle(self, step_seconds: float | None = None) -> None:
        if step_seconds is not None:
            self._longest_step = max(self._longest_step, step_seconds)
        self._what = None

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, max(self.limit() / 20, 0.05))):
            what, since = self._what, self._since
            if what is None:
                continue
            waited = time.monotonic() - since
            if waited > self.limit():
                self._fire(what, waited)
                return

    def _fire(self, what: str, waited: float) -> None:
        msg = (f"ppq watchdog: stage {self.stage} (rank {self.rank}) made no progress for {waited:.0f} s "
               f"while waiting for {what}; limit {self.limit():.0f} s (ppq.watchdog_timeout_s="
               f"{self.timeout_s:g}, or "
               f"{STEP_FACTOR:g}x the longest step). The stage it waits on is stuck or gone; stopping this "
               "rank. Raise ppq.watchdog_timeout_s if steps legitimately take longer.")
        print(msg, file=sys.stderr, flush=True)
        from deepspeed_ppq.integrations.shm import release_deepspeed_shm

        rank = os.environ.get("RANK")
        if rank is not None:
            release_deepspeed_shm(ranks=[rank])
        self._exit(EXIT_CODE)
