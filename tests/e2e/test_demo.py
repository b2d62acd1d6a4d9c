"""The main job, shortened: ``examples/demo/run_demo.py --quick`` tunes the example script with
``ppq tune`` under a budget on 2 gloo ranks (measuring the ladder), then trains it with the plan under
the ``deepspeed`` launcher, and writes the report and the ladder plot."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
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
        for why in result["ladder_left_out"]:  # a rung left out is named in the report, with why
            assert f"Left out: {why}." in report
        for rec in result["ladder"]:  # every rung timed 1 + ab_repeats times, the rungs alternating
            times = rec["run"]["repeat_step_times"]
            assert len(times) == 2 and rec["run"]["measured_step_time"] == statistics.median(times)
    train_log = (tmp_path / "train.log").read_text()
    assert "step time: median" in train_log
    plan = json.loads((tmp_path / "tune" / "plan.json").read_text())
    a, b = plan["derived"]["boundaries"][:2]
    assert f"stage=0 layers={b - a} [{a}, {b})" in train_log  # the training run holds the plan


@pytest.mark.distributed
@pytest.mark.slow
def test_budget_below_every_stock_configuration(tmp_path):
    """At 5.9 MiB per stage (6.2 with the tolerance) no stock configuration of the quick workload in fp32 fits
    (the smallest, micro-batch 1 with recomputation and 8-bit Adam, measures ~6.5 MiB) while its
    low-bit plan does (~5.8 MiB): the tuner says stock DeepSpeed cannot train there,
    gates the plan against the smallest stock configuration run over the budget, and the user's run
    trains with the plan."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "demo" / "run_demo.py"), "--quick",
                          "--budget-mb", "5.9", "--precision", "fp32", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    result = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert result["outcome"] == "stock_does_not_fit" and not result["stock_fits"]
    limit = result["settings"]["memory_budget"] * (1 + result["settings"]["memory_tolerance"])
    assert all(not m["fits"] for m in result["stock"]["measured"])
    assert result["baseline"]["run"]["peak_memory"] > limit  # the quality reference ran over the budget
    plan = result["plan"]
    assert {f for st in plan["stages"] for f in st["formats"]} - {"none"}  # low-bit weights make it fit
    assert all(m["total"] <= limit for m in plan["measured_memory"])
    assert result["ladder"] == [] and result["ab_step_times"]["baseline"] == []  # nothing to compare with
    report = (tmp_path / "tune" / "report.md").read_text()
    assert "**Stock DeepSpeed cannot train at this budget**" in report.split("## Stock search")[0]
    assert "step time: median" in (tmp_path / "train.log").read_text()


def _workloads():
    sys.path[:0] = [str(ROOT / "examples" / "demo"), str(ROOT / "examples")]
    try:
        import workloads
    finally:
        del sys.path[:2]
    return workloads


def _processes_with(text: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile, or not a process
            continue
        if text in cmd:
            found.append(int(p.name))
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:  # clean up after a failure
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.distributed
def test_a_timing_run_stopped_at_its_timeout_takes_its_ranks_with_it(tmp_path):
    """``choose_precision(stop_slower=True)`` stops the slower precision's run: the launcher and both
    rank processes must go (a run of a million steps here: it never ends by itself), or the call would
    wait on their output and they would hold the cores through the rest of the demo."""
    workloads = _workloads()
    w = workloads.settings("pretrain", quick=True)  # no pre-trained base to build
    cfg = workloads.ds_config(tmp_path, w, 1 << 20)
    result = []
    call = threading.Thread(target=lambda: result.append(
        workloads.timed_run(cfg, list(w.model), steps=10**6, timeout=4.0)), daemon=True)
    call.start()
    call.join(timeout=300)
    left = _processes_with(str(cfg))
    _kill_all(left)
    assert result == [None] and left == []


@pytest.mark.distributed
def test_an_interrupted_timing_run_takes_its_ranks_with_it(tmp_path):
    """The timing run's processes have a session of their own (so a timeout can stop them all), which
    the terminal's Ctrl-C no longer reaches: an interrupt of the demo must stop them too."""
    code = "\n".join([
        "import sys", "from pathlib import Path", "sys.path[:0] = sys.argv[1:3]", "import workloads",
        "w = workloads.settings('pretrain', quick=True)",
        "cfg = workloads.ds_config(Path(sys.argv[3]), w, 1 << 20)",
        "workloads.timed_run(cfg, list(w.model), steps=10**6)"])
    cfg = str(tmp_path / "ds_tune.json")
    paths = [str(ROOT / "examples" / "demo"), str(ROOT / "examples"), str(tmp_path)]
    demo = subprocess.Popen([sys.executable, "-c", code, *paths], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            cwd=ROOT)
    for _ in range(3000):  # until the launcher has started its ranks (a loaded machine: minutes)
        if len(_processes_with(cfg)) >= 3:
            break
        time.sleep(0.1)
    else:
        demo.kill()
        _kill_all(_processes_with(cfg))
        pytest.fail("the timing run's ranks did not start within 300 s")
    demo.send_signal(signal.SIGINT)
    demo.wait(timeout=120)
    left = _processes_with(cfg)
    _kill_all(left)
    assert left == []
