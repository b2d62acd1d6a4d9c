"""Every file in configs/ is usable: each JSON loads (its "ppq" section through ``load_ppq_config``,
DeepSpeed configs through DeepSpeed's own ``DeepSpeedConfig``), every shell/sbatch script passes
``bash -n``, and each SLURM script's node/GPU count matches the data-parallel degree its config implies.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deepspeed_ppq.config import PPQConfigError, load_ppq_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
JSONS = sorted(CONFIGS.rglob("*.json"))
SCRIPTS = sorted({*CONFIGS.rglob("*.sh"), *CONFIGS.rglob("*.sbatch")})
# Keys that make a JSON file a DeepSpeed config (as opposed to a plan, a schema or a bare "ppq" section).
_DS_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}


def _rel(p: Path) -> str:
    return str(p.relative_to(CONFIGS))


def test_configs_folder_has_files():
    assert JSONS, f"no JSON files under {CONFIGS}"
    assert any(p.parent.name == "slurm" for p in SCRIPTS), "configs/slurm has no sbatch script"


@pytest.mark.parametrize("path", JSONS, ids=_rel)
def test_json_config_loads(path: Path):
    data = json.loads(path.read_text())
    if path.name.endswith(".schema.json"):
        assert data.get("title") == "PPQConfig", f"{_rel(path)} is not the ppq JSON Schema"
        return
    if not isinstance(data, dict):
        pytest.fail(f"{_rel(path)}: top level must be a JSON object")
    if "ppq" in data:
        load_ppq_config(data)  # raises PPQConfigError naming the field
    if _DS_KEYS & data.keys():
        _check_deepspeed_config(path, data)


def _check_deepspeed_config(path: Path, data: dict) -> None:
    """Validate with DeepSpeed's own parser.

    Without a process group DeepSpeedConfig assumes one data-parallel rank, so a config written for
    a cluster is checked with its batch arithmetic reduced to one replica (the implied data-parallel
    degree must be a whole number); everything else goes through DeepSpeed unchanged.
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = dict(data)
    tb, mb, ga = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                       "gradient_accumulation_steps"))
    if tb is not None and mb is not None and ga is not None:
        dp, rest = divmod(tb, mb * ga)
        assert rest == 0 and dp >= 1, (
            f"{_rel(path)}: train_batch_size={tb} is not a multiple of micro batch {mb} x accumulation {ga}")
        cfg["train_batch_size"] = mb * ga
    ds = DeepSpeedConfig(cfg)
    assert ds.zero_optimization_stage < 2, (
        f"{_rel(path)}: DeepSpeed's PipelineEngine needs ZeRO stage 0 or 1, "
        f"got {ds.zero_optimization_stage}")


@pytest.mark.parametrize("path", SCRIPTS, ids=_rel)
def test_script_parses(path: Path):
    bash = shutil.which("bash")
    assert bash, "bash is needed to check the scripts"
    res = subprocess.run([bash, "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, f"bash -n {_rel(path)}:\n{res.stderr}"


def _default(script: str, var: str) -> str:
    m = re.search(rf"^{var}=\$\{{{var}:-(.*)\}}$", script, re.M)
    assert m, f"no default for {var}"
    return m.group(1)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("slurm/*.sbatch")), ids=_rel)
def test_sbatch_matches_its_config(path: Path):
    """nodes x GPUs per node == pipeline stages x the data-parallel degree of the default config."""
    text = path.read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    gpus = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.M).group(1))
    config = CONFIGS.parent / _default(text, "CONFIG")
    assert config.exists(), f"{_rel(path)}: default CONFIG {config} is missing"
    script = CONFIGS.parent / _default(text, "SCRIPT")
    assert script.exists(), f"{_rel(path)}: default SCRIPT {script} is missing"
    stages = int(re.search(r"--num-stages (\d+)", _default(text, "SCRIPT_ARGS")).group(1))
    ds = json.loads(config.read_text())
    dp = ds["train_batch_size"] // (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"])
    assert nodes * gpus == stages * dp, (
        f"{_rel(path)}: {nodes} nodes x {gpus} GPUs != {stages} stages x {dp} data-parallel replicas "
        f"implied by {config.name}")
    load_ppq_config(ds)


def test_bad_ppq_section_is_reported_by_field():
    with pytest.raises(PPQConfigError, match=r"ppq\.activations\.bits=3"):
        load_ppq_config({"ppq": {"activations": {"method": "quant", "bits": 3}}})
