"""A pytest plugin for DeepSpeed's own unit tests: ``deepspeed.PipelineEngine`` becomes ``PPQPipelineEngine``.

``deepspeed.initialize`` builds its pipeline engine from the name ``PipelineEngine`` in the ``deepspeed``
module, which this module replaces when it is imported: with ``-p ppq_substitute`` in pytest's own
process, and -- DeepSpeed's ``DistributedTest`` runs each test in worker processes started by a
``forkserver`` -- in the fork server too (``multiprocessing.set_forkserver_preload``), so every worker
inherits the substitution. The engine runs with the default ``"ppq"`` section (codec ``none``), which
must behave exactly as stock DeepSpeed.

Each engine built records itself as a file in ``$PPQ_SUBSTITUTE_MARKS`` (when set), so a run can show
the substitution took effect rather than silently running stock DeepSpeed (the fork server ignores a
preload module that fails to import).
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import deepspeed

from deepspeed_ppq.integrations.deepspeed import PPQPipelineEngine

MARKS_ENV = "PPQ_SUBSTITUTE_MARKS"


class SubstitutedPipelineEngine(PPQPipelineEngine):
    """``PPQPipelineEngine`` that records each construction in ``$PPQ_SUBSTITUTE_MARKS``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        marks = os.environ.get(MARKS_ENV)
        if marks:
            Path(marks, f"{os.getpid()}-{id(self)}").touch()


deepspeed.PipelineEngine = SubstitutedPipelineEngine


def pytest_configure(config) -> None:
    multiprocessing.set_forkserver_preload([__name__])
