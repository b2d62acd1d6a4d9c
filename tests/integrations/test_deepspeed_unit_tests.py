"""DeepSpeed's own pipeline unit tests pass the same with ``PPQPipelineEngine`` substituted.

Needs a DeepSpeed checkout (``DEEPSPEED_SRC=/path/to/DeepSpeed make test``; skipped without it). Its
``tests/`` folder is copied into a temporary directory (DeepSpeed's ``tests/conftest.py`` puts the
checkout's root on ``sys.path``; without its ``deepspeed/`` beside it, the installed DeepSpeed is the one
tested) and ``tests/unit/runtime/pipe`` runs twice on CPU (``DS_ACCELERATOR=cpu``, gloo,
``LOCAL_SIZE=4`` so that DeepSpeed's launcher starts the 2- and 4-process tests instead of skipping them
for want of devices): once as it is, once with ``-p ppq_substitute`` (tests/deepspeed_unit/), which
replaces ``deepspeed.PipelineEngine`` with ``PPQPipelineEngine`` in every worker. Every test must end the
same way in both runs, and the substituted run must really have built ``PPQPipelineEngine``s.
benchmarks/results/deepspeed_pipe_unit_tests.md records a run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from dist_utils import ROOT

DEEPSPEED_SRC = os.environ.get("DEEPSPEED_SRC")
SUITE = "unit/runtime/pipe"
pytestmark = [
    pytest.mark.slow, pytest.mark.distributed,
    pytest.mark.skipif(not DEEPSPEED_SRC, reason="set DEEPSPEED_SRC=<DeepSpeed checkout at the installed "
                                                 "version's tag> to run DeepSpeed's own pipeline unit tests "
                                                 "with PPQPipelineEngine substituted"),
]


def _outcomes(xml: Path) -> dict[str, str]:
    """``{test id: passed | failed | skipped}`` from a JUnit XML report."""
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        out[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return out


def _run(tests: Path, out: Path, substitute: bool) -> tuple[dict[str, str], int]:
    marks = out / "marks"
    marks.mkdir(parents=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "4", "PPQ_SUBSTITUTE_MARKS": str(marks),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "deepspeed_unit")])}
    cmd = [sys.executable, "-m", "pytest", SUITE, "-q", "-p", "no:cacheprovider",
           f"--junitxml={out / 'r.xml'}"]
    if substitute:
        cmd += ["-p", "ppq_substitute"]
    proc = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True, timeout=3600)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    assert (out / "r.xml").is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return _outcomes(out / "r.xml"), len(list(marks.iterdir()))


def test_deepspeed_pipe_unit_tests_same_with_ppq_engine(tmp_path):
    src = Path(DEEPSPEED_SRC) / "tests"
    assert (src / SUITE).is_dir(), f"DEEPSPEED_SRC={DEEPSPEED_SRC} has no tests/{SUITE}"
    tests = tmp_path / "checkout" / "tests"
    shutil.copytree(src, tests)
    stock, stock_engines = _run(tests, tmp_path / "stock", substitute=False)
    ppq, ppq_engines = _run(tests, tmp_path / "ppq", substitute=True)
    assert stock and stock == ppq, {k: (stock.get(k), ppq.get(k)) for k in set(stock) | set(ppq)
                                    if stock.get(k) != ppq.get(k)}
    assert stock_engines == 0 and ppq_engines > 0, (stock_engines, ppq_engines)
    assert sum(v == "passed" for v in stock.values()) > 0
