"""``ppq tune script.py``, plan files and the tuner's layering.

* The user's unmodified script (``examples/train_gpt_pipe.py``) runs under the tuner, which writes a
  plan; the same script trains with it through ``"ppq": {"plan_file": ...}``.
* Bad input: a script that never calls ``deepspeed_ppq.initialize``; a truncated, foreign or
  inconsistent plan file; a corrupted profile cache.
* ``deepspeed_ppq.autotune`` imports no engine and no model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest
from dist_utils import ROOT, free_port, rank_env

from deepspeed_ppq.autotune.plan import Plan, PlanError, load_plan
from deepspeed_ppq.autotune.profiler import load_cached

EXAMPLE = ROOT / "examples" / "train_gpt_pipe.py"
MODEL_ARGS = ["--n-layers", "8", "--d-model", "64", "--seq-len", "32", "--vocab-size", "128",
              "--data", "synthetic"]


def _config(tmp_path, **ppq) -> str:
    cfg = json.loads((ROOT / "configs" / "ds_cpu_smoke.json").read_text())
    cfg.pop("csv_monitor", None)
    cfg["steps_per_print"] = 100
    cfg["ppq"].update(ppq)
    path = tmp_path / f"ds{len(list(tmp_path.glob('ds*.json')))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _ppq(*args, timeout=900) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "deepspeed_ppq.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def _two_ranks(script, args, tmp_path, timeout=600, threads=1) -> list[str]:
    """Run ``script`` on 2 ranks as a launcher would; returns each rank's output."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                              env=rank_env(r, 2, port, str(tmp_path), threads=threads))
             for r in range(2)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    from deepspeed_ppq.integrations.shm import release_deepspeed_shm

    release_deepspeed_shm(port, "127.0.0.1")
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    return outs


@pytest.mark.distributed
@pytest.mark.slow
def test_tune_the_example_script_then_train_with_the_plan(tmp_path):
    autotune = {"trial_steps": 4, "warmup_steps": 1, "seeds": 1, "stock_trials": 2, "val_batches": 2,
                "profile_reps": 2, "max_iterations": 1, "pipeline_degrees": [2], "ab_repeats": 0,
                "quality_steps": 4}
    cfg = _config(tmp_path, autotune=autotune)
    out = tmp_path / "tuned"
    res = _ppq("tune", EXAMPLE, "--deepspeed_config", cfg, *MODEL_ARGS, "--budget-mb", "64", "--out", out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[ppq tune] wrote" in res.stdout
    plan = load_plan(out / "plan.json")
    assert plan.memory_budget == 64 * 2**20 and plan.measured_step_time > 0
    report = (out / "report.md").read_text()
    assert "Peak memory per stage, MiB (predicted / measured" in report and "## Stock search" in report
    # the user's run with the plan: the script is the same, only the config names the plan. Its ranks
    # start with 2 threads each (a launcher leaves PyTorch's default): the plan was measured with 1.
    assert plan.threads_per_rank == 1
    cfg_plan = _config(tmp_path, plan_file=str(out / "plan.json"))
    outs = _two_ranks(EXAMPLE, ["--deepspeed_config", cfg_plan, "--steps", "5", *MODEL_ARGS], tmp_path,
                      threads=2)
    text = outs[0]
    assert "measured with 1 intra-op thread(s) per rank; using torch.set_num_threads(1) (was 2)" in text
    for s, (a, b) in enumerate(zip(plan.boundaries, plan.boundaries[1:])):
        assert f"stage={s} layers={b - a} [{a}, {b})" in text
    assert "step time: median" in text
    # a plan with low-bit layers on the script's own layer modules (converted in place when the module is
    # built from the plan, which changes their fingerprint): the run holds the plan's formats
    low = Plan.from_dict({**plan.to_dict(), "linear_formats": {"2.mlp.fc": "int8", "5.attn.qkv": "nf4"}})
    low.save(tmp_path / "plan_low.json")
    cfg_low = _config(tmp_path, plan_file=str(tmp_path / "plan_low.json"))
    outs = _two_ranks(EXAMPLE, ["--deepspeed_config", cfg_low, "--steps", "3", *MODEL_ARGS], tmp_path)
    counts = [int(re.search(r"rank \d: (\d+) low-bit Linear layers", o).group(1)) for o in outs]
    assert sum(counts) == 2, outs[0][-2000:]


def test_script_that_never_calls_initialize(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('training without deepspeed_ppq')\n")
    res = _ppq("tune", script, "--nproc", "1", timeout=300)
    assert res.returncode != 0
    assert "finished without calling deepspeed_ppq.initialize" in res.stdout + res.stderr


def test_missing_script(tmp_path):
    res = _ppq("tune", tmp_path / "nope.py", "--nproc", "1", timeout=300)
    assert res.returncode != 0 and "does not exist" in res.stdout + res.stderr


def _plan_dict() -> dict:
    from deepspeed_ppq.autotune.plan import Plan, StagePlan

    plan = Plan(world_size=2, pipeline_degree=2, micro_batch_size=2, num_microbatches=4, schedule="1f1b",
                stages=[StagePlan((0, 2), ["none", "none"]), StagePlan((2, 4), ["none", "int8"])],
                layer_names=["0", "1", "2", "3"], model_fingerprint={"num_layers": 4, "digest": "abc",
                                                                      "layers": ["A []"] * 4})
    return plan.to_dict()


def test_bad_plan_files_name_the_file(tmp_path):
    path = tmp_path / "plan.json"
    with pytest.raises(PlanError, match=r"plan file .*plan.json does not exist"):
        load_plan(path)
    path.write_text(json.dumps(_plan_dict())[:200])
    with pytest.raises(PlanError, match=r"plan file .*plan.json is not valid JSON.*truncated"):
        load_plan(path)
    bad = _plan_dict()
    bad["micro_batch_size"] = -3
    path.write_text(json.dumps(bad))
    with pytest.raises(PlanError, match=r"plan.json: micro_batch_size=-3 must be a positive integer"):
        load_plan(path)
    old = {**_plan_dict(), "schema_version": 1}
    path.write_text(json.dumps(old))
    with pytest.raises(PlanError, match=r"schema_version=1 is not supported"):
        load_plan(path)


def test_plan_for_another_model_is_refused():
    from deepspeed.pipe import LayerSpec
    from torch import nn

    from deepspeed_ppq.autotune.plan import Plan
    from deepspeed_ppq.integrations.model_layers import model_fingerprint

    mine = [LayerSpec(nn.Linear, 8, 8) for _ in range(4)]
    other = [LayerSpec(nn.Linear, 8, 8) for _ in range(3)] + [LayerSpec(nn.Linear, 8, 16)]
    plan = Plan.from_dict({**_plan_dict(), "model_fingerprint": model_fingerprint(mine)})
    plan.check_model(model_fingerprint(mine))
    with pytest.raises(PlanError, match=r"made for another model \(layer 3 is Linear \[\[8, 8\], \[8\]\] "
                                         r"in the plan, Linear \[\[16, 8\], \[16\]\] in the model\)"):
        plan.check_model(model_fingerprint(other), "plan file p.json")
    with pytest.raises(PlanError, match=r"3 layers in the plan, 4 in the model"):
        Plan.from_dict({**_plan_dict(), "model_fingerprint": model_fingerprint(mine[:3])}).check_model(
            model_fingerprint(mine))


def test_corrupted_profile_cache_is_measured_again(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text('{"key": "abc", "profile": {"layers": [')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_cached(path, "abc") is None
    assert any("profile cache" in str(w.message) and "corrupted" in str(w.message) for w in caught)
    path.write_text(json.dumps({"key": "other"}))
    with pytest.warns(UserWarning, match="measured for another model"):
        assert load_cached(path, "abc") is None


def test_autotune_imports_no_engine_and_no_model():
    code = (
        "import importlib, pkgutil, sys\n"
        "import deepspeed_ppq.autotune as a\n"
        "for m in pkgutil.iter_modules(a.__path__):\n"
        "    importlib.import_module('deepspeed_ppq.autotune.' + m.name)\n"
        "top = ('deepspeed', 'megatron', 'megatron_patches')\n"
        "mine = ('deepspeed_ppq.integrations', 'deepspeed_ppq.models')\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in top or k.startswith(mine))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
