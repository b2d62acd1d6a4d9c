"""A fake SLURM for testing sbatch scripts: ``sbatch``, ``srun``, ``scontrol`` and the launched tools.

Installed by ``install(bin_dir, nodes, tasks_per_node, gpus_per_node)`` as small executables that call
this file with the tool's name. ``sbatch`` spools a copy of the script (as SLURM does) and runs it with
the job's environment on the first node; ``srun`` runs its command once per task (nodes x tasks per node)
with that task's SLURM_* variables, refusing a task count the allocation does not hold; ``scontrol``
answers ``show hostnames`` and ``show job`` (``Command=`` the path as submitted). ``torchrun``,
``deepspeed`` and ``python`` record their argv and rank environment, one JSON line each, in
``$FAKE_SLURM_DIR/calls.jsonl``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

TOOLS = ("sbatch", "srun", "scontrol", "torchrun", "deepspeed", "python")
RECORDED_ENV = ("SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT")


def install(bin_dir: Path, state: Path, nodes: int = 2, tasks_per_node: int = 2,
            gpus_per_node: int = 2) -> dict:
    bin_dir.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        exe = bin_dir / tool
        exe.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} {tool} \"$@\"\n")
        exe.chmod(0o755)
    env = dict(os.environ)
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_SLURM_DIR=str(state),
               FAKE_SLURM_NODES=str(nodes), FAKE_SLURM_TASKS=str(tasks_per_node),
               FAKE_SLURM_GPUS=str(gpus_per_node))
    return env


def _sbatch(argv: list[str]) -> int:
    opts = {}
    while argv and argv[0].startswith("--"):
        k, _, v = argv.pop(0)[2:].partition("=")
        opts[k] = v
    script = Path(argv.pop(0)).resolve()
    text = script.read_text()
    for k, v in re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M):
        opts.setdefault(k, v)
    state = Path(os.environ["FAKE_SLURM_DIR"])
    spooled = state / "spool" / "slurm_script"
    spooled.parent.mkdir(exist_ok=True)
    shutil.copy(script, spooled)
    (state / "command").write_text(str(script))
    nodes = int(os.environ["FAKE_SLURM_NODES"])
    tasks = int(opts.get("ntasks-per-node", os.environ["FAKE_SLURM_TASKS"]))
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=os.getcwd(), SLURM_JOB_NODELIST="node[1-2]",
               SLURM_NNODES=str(nodes), SLURM_NODEID="0", SLURM_NTASKS_PER_NODE=str(tasks),
               SLURM_NTASKS=str(nodes * tasks), SLURM_GPUS_ON_NODE=os.environ["FAKE_SLURM_GPUS"])
    return subprocess.call(["bash", str(spooled), *argv], env=env, cwd=os.getcwd())


def _srun(argv: list[str]) -> int:
    nodes = int(os.environ["SLURM_NNODES"])
    per_node, total = None, None
    while argv and argv[0].startswith("-"):
        a = argv.pop(0)
        k, _, v = a.partition("=")
        if k in ("-n", "--ntasks"):
            total = int(v or argv.pop(0))
        elif k == "--ntasks-per-node":
            per_node = int(v or argv.pop(0))
        elif k in ("--kill-on-bad-exit", "--nodes", "-N"):
            pass
        else:
            sys.exit(f"fake srun: unknown option {a}")
    allocated = int(os.environ["SLURM_NTASKS_PER_NODE"])
    per_node = per_node or (total // nodes if total else allocated)
    total = total or nodes * per_node
    if total != nodes * per_node or per_node > allocated:
        sys.exit(f"srun: error: {total} tasks with {per_node} per node on {nodes} nodes does not fit the "
                 f"allocation ({allocated} per node)")
    rc = 0
    for node in range(nodes):
        for local in range(per_node):
            env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node * per_node + local),
                       SLURM_LOCALID=str(local), SLURM_NTASKS=str(total), SLURMD_NODENAME=f"node{node + 1}")
            rc |= subprocess.call(argv, env=env)
    return rc


def _print(text: str) -> None:
    """Write ``text`` and a newline in one go, as the real tool does: with unbuffered output ``print`` makes
    two writes, and the second meets a closed pipe once ``| head -n 1`` has its line."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        _print("\n".join(f"node{i + 1}" for i in range(int(os.environ["FAKE_SLURM_NODES"]))))
        return 0
    if argv[:2] == ["show", "job"]:
        command = (Path(os.environ["FAKE_SLURM_DIR"]) / "command").read_text()
        _print(f"JobId={argv[2]} JobName=test\n   WorkDir={os.getcwd()}\n   Command={command}\n   StdErr=x")
        return 0
    sys.exit(f"fake scontrol: unsupported {argv}")


def _record(tool: str, argv: list[str]) -> int:
    call = {"tool": tool, "argv": argv, "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}}
    with open(Path(os.environ["FAKE_SLURM_DIR"]) / "calls.jsonl", "a") as f:
        f.write(json.dumps(call) + "\n")
    return 0


if __name__ == "__main__":
    name, args = sys.argv[1], sys.argv[2:]
    handler = {"sbatch": _sbatch, "srun": _srun, "scontrol": _scontrol}.get(name)
    sys.exit(handler(args) if handler else _record(name, args))
