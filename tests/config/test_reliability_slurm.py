"""The sbatch scripts in configs/ as SLURM runs them: under a fake ``sbatch``/``srun``/``scontrol``
(tests/fake_slurm/fake_slurm.py) that spools a copy of the script and runs ``srun``'s command once per
task with that task's SLURM environment, on 2 nodes with 2 GPUs each. Each test asserts the exact
command line (and rank environment) each node runs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from dist_utils import ROOT
from fake_slurm.fake_slurm import install

SLURM_ARGS = "--num-stages 4 --n-layers 32 --d-model 2048 --n-heads 16 --seq-len 2048 --steps 1000"
DATA = {"DATA_PATH": "/shared/gpt2_text_document", "VOCAB": "/shared/vocab.json",
        "MERGES": "/shared/merges.txt"}
TORCHRUN_ARGS = "--num-stages 8 --n-layers 48 --d-model 2048 --n-heads 16 --seq-len 2048 --steps 1000"


def _submit(tmp_path: Path, script: str, cwd: Path, sbatch_opts=(), **env_extra) -> tuple[int, str, list]:
    env = install(tmp_path / "bin", tmp_path / "state")
    env.update(TMPDIR=str(tmp_path), **env_extra)
    for k in ("LAUNCHER", "CONFIG", "SCRIPT", "SCRIPT_ARGS", "GPUS_PER_NODE", "MASTER_PORT",
              "PPQ_MEGATRON_DIR", "DATA_PATH", "VOCAB", "MERGES", "CKPT"):
        if k not in env_extra:
            env.pop(k, None)
    proc = subprocess.run(["sbatch", *sbatch_opts, str(ROOT / script)], cwd=cwd, env=env, capture_output=True,
                          text=True)
    calls_file = tmp_path / "state" / "calls.jsonl"
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()] if calls_file.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, calls


def test_megatron_sbatch_runs_one_torchrun_per_node_with_all_flags(tmp_path):
    megatron = tmp_path / "Megatron-LM"  # submitted from a Megatron-LM checkout, not from this repository
    megatron.mkdir()
    rc, out, calls = _submit(tmp_path, "configs/megatron/pretrain_gpt_ppq.sbatch", megatron, **DATA)
    assert rc == 0, out
    args = subprocess.run(["bash", "-c", 'source "$1"; printf "%s\\0" "${ARGS[@]}"', "sh",
                           str(ROOT / "configs" / "megatron" / "pretrain_gpt_ppq.sh")],
                          capture_output=True, text=True, check=True, cwd=megatron,
                          env={"PATH": os.environ["PATH"], **DATA}).stdout.split("\0")[:-1]
    assert "--ppq-weights-format" in args and "--num-layers" in args
    assert args[args.index("--data-path") + 1] == DATA["DATA_PATH"]
    assert args[args.index("--save") + 1] == str(megatron / "checkpoints" / "gpt-ppq")  # not /checkpoints
    assert [c["tool"] for c in calls] == ["torchrun", "torchrun"], calls
    for node, call in enumerate(calls):
        assert call["env"]["SLURM_NODEID"] == str(node)
        assert call["argv"] == ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29500",
                                "-m", "megatron_patches.run", "pretrain_gpt.py", *args,
                                "--global-batch-size", "512"], call


@pytest.mark.parametrize("unset", ["DATA_PATH", "VOCAB", "MERGES"])
def test_megatron_sbatch_without_data_names_the_variable(tmp_path, unset):
    """No default path to one machine's data: an unset variable stops the job before srun."""
    megatron = tmp_path / "Megatron-LM"
    megatron.mkdir()
    rc, out, calls = _submit(tmp_path, "configs/megatron/pretrain_gpt_ppq.sbatch", megatron,
                             **{k: v for k, v in DATA.items() if k != unset})
    assert rc != 0 and f"{unset}: set {unset} to" in out and calls == [], out


def test_megatron_sbatch_without_companion_names_the_fix(tmp_path):
    rc, out, calls = _submit(tmp_path, "configs/megatron/pretrain_gpt_ppq.sbatch", tmp_path,
                             PPQ_MEGATRON_DIR=str(tmp_path))
    assert rc == 2 and "set PPQ_MEGATRON_DIR" in out and calls == [], out


def test_torchrun_sbatch_runs_one_torchrun_per_node(tmp_path):
    rc, out, calls = _submit(tmp_path, "configs/slurm/torchrun_multinode.sbatch", ROOT)
    assert rc == 0, out
    assert [c["env"]["SLURM_NODEID"] for c in calls] == ["0", "1"], calls
    for call in calls:
        assert call["tool"] == "torchrun"
        assert call["argv"] == ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-id", "4242",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29500",
                                "examples/train_gpt_pipe.py", "--deepspeed_config",
                                "configs/slurm/torchrun_2x8gpu_ppq.json", *TORCHRUN_ARGS.split()], call


def test_deepspeed_sbatch_pdsh_runs_the_launcher_once(tmp_path):
    rc, out, calls = _submit(tmp_path, "configs/slurm/deepspeed_multinode.sbatch", ROOT)
    assert rc == 0, out
    hostfile = tmp_path / "ppq-hostfile-4242"
    assert hostfile.read_text() == "node1 slots=2\nnode2 slots=2\n"
    assert [(c["tool"], c["argv"]) for c in calls] == [("deepspeed", [
        "--hostfile", str(hostfile), "--launcher", "pdsh", "--master_addr", "node1", "--master_port", "29500",
        "examples/train_gpt_pipe.py", "--deepspeed_config", "configs/slurm/ds_2x8gpu_ppq.json",
        *SLURM_ARGS.split()])]


def test_deepspeed_sbatch_slurm_launcher_starts_one_task_per_gpu(tmp_path):
    rc, out, calls = _submit(tmp_path, "configs/slurm/deepspeed_multinode.sbatch", ROOT,
                             sbatch_opts=["--ntasks-per-node=2"], LAUNCHER="slurm")
    assert rc == 0, out
    assert len(calls) == 4, calls
    for rank, call in enumerate(calls):
        assert call["tool"] == "python"
        local = rank % 2
        assert call["env"] == {"SLURM_NODEID": str(rank // 2), "SLURM_PROCID": str(rank),
                               "SLURM_LOCALID": str(local), "RANK": str(rank), "LOCAL_RANK": str(local),
                               "WORLD_SIZE": "4", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}, call
        assert call["argv"] == ["-u", "examples/train_gpt_pipe.py", "--deepspeed_config",
                                "configs/slurm/ds_2x8gpu_ppq.json", "--local_rank", str(local),
                                *SLURM_ARGS.split()], call


@pytest.mark.parametrize("opts", [[], ["--ntasks-per-node=1"]])
def test_deepspeed_sbatch_slurm_launcher_refuses_one_task_per_node(tmp_path, opts):
    rc, out, calls = _submit(tmp_path, "configs/slurm/deepspeed_multinode.sbatch", ROOT, sbatch_opts=opts,
                             LAUNCHER="slurm")
    assert rc == 2 and "--ntasks-per-node=2" in out and calls == [], out
