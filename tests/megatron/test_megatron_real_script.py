"""Megatron-LM's own, unmodified ``pretrain_gpt.py`` through ``python -m megatron_patches.run`` on CPU.

Needs a Megatron-LM checkout at a tag matching a supported megatron-core (``core_v0.16.1``):
``MEGATRON_LM=/path/to/Megatron-LM make test``; skipped without it. The setup installs what
Megatron-LM itself needs beyond megatron-core (six, pyyaml, regex, triton, pybind11) into
``$MEGATRON_LM_DEPS`` (default: a folder in the temp dir) unless importable already, and builds
``megatron/core/datasets/helpers_cpp`` for this Python in the checkout, as its Makefile would.

Three runs of 2 gloo ranks, PP=2, 5 iterations on Megatron's mock data (docs/megatron.md has the
command line): the launcher with no ``--ppq-*`` flag (CPU mode only, megatron-core's own communicator:
the unpatched run), codec ``none`` (the ppq communicator sending the tensors themselves), and 4-bit
activations. Codec none must match the unpatched run bit for bit (the logged losses and every
parameter of the saved checkpoints); 4-bit activations must send under a sixth of the bytes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
import torch
from dist_utils import free_port, rank_env

MEGATRON_LM = os.environ.get("MEGATRON_LM")
ITERS = 5
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", str(ITERS), "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
         "--eval-interval", "1000", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--transformer-impl", "local", "--tensor-model-parallel-size", "1",
         "--pipeline-model-parallel-size", "2", "--seed", "1234", "--ckpt-format", "torch",
         "--save-interval", str(ITERS)]
RUNS = {
    "unpatched": [],
    "none": ["--ppq-activations-method", "none", "--ppq-gradients-method", "none"],
    "quant4": ["--ppq-activations-method", "quant", "--ppq-activations-bits", "4"],
}
_DEPS = {"six": "six", "yaml": "pyyaml", "regex": "regex", "triton": "triton", "pybind11": "pybind11"}

pytestmark = [
    pytest.mark.slow, pytest.mark.distributed,
    pytest.mark.skipif(not MEGATRON_LM, reason="set MEGATRON_LM=<Megatron-LM checkout at tag core_v0.16.1> "
                                               "to run Megatron-LM's own pretrain_gpt.py"),
]


def _deps_dir() -> str | None:
    """Megatron-LM's own needs: importable here, or installed once into a folder put on PYTHONPATH."""
    missing = [pkg for mod, pkg in _DEPS.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        return None
    target = Path(os.environ.get("MEGATRON_LM_DEPS",
                                 Path(tempfile.gettempdir()) / f"ppq-megatron-lm-deps-py{sys.version_info[0]}"
                                 f"{sys.version_info[1]}"))
    stamp = target / ".ppq-ready"
    if not stamp.exists():
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
                              *_DEPS.values()], capture_output=True, text=True)
        if pip.returncode != 0:
            pytest.skip(f"could not install Megatron-LM's needs {missing} (registry unreachable?): "
                        f"{pip.stderr.strip().splitlines()[-1:]}")
        stamp.touch()
    return str(target)


def _build_helpers(checkout: Path, deps: str | None) -> None:
    """megatron/core/datasets/helpers_cpp for this Python (its Makefile asks python3-config, which may
    name another Python)."""
    folder = checkout / "megatron" / "core" / "datasets"
    out = folder / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    if out.exists():
        return
    env = {**os.environ, "PYTHONPATH": deps or ""}
    includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], env=env, check=True,
                              capture_output=True, text=True).stdout.split()
    subprocess.run(["c++", "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC", *includes,
                    str(folder / "helpers.cpp"), "-o", str(out)], check=True)


def _run(checkout: Path, deps: str | None, name: str, workdir: Path) -> dict:
    """One 2-rank run; returns its losses, grad norms, byte report and checkpoint folder."""
    port, save = free_port(), workdir / name
    argv = [sys.executable, "-m", "megatron_patches.run", str(checkout / "pretrain_gpt.py"), *MODEL,
            "--save", str(save), *RUNS[name]]
    procs = []
    for r in range(2):
        env = rank_env(r, 2, port, str(workdir))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env["PYTHONPATH"], deps) if p)
        procs.append(subprocess.Popen(argv, env=env, cwd=workdir, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"{name}: rank {r} exited {p.returncode}:\n{outs[r][-5000:]}"
    text = "\n".join(outs)
    logged = re.findall(r"iteration +(\d+)/ +\d+ \|.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+)", text)
    wire = {m[0]: (int(m[1].replace(",", "")), int(m[2].replace(",", "")))
            for m in re.findall(r"bytes on the wire, (\w+ stage \d->\d): ([\d,]+) -> ([\d,]+) bytes", text)}
    return {"iterations": [int(i) for i, _, _ in logged], "losses": [loss for _, loss, _ in logged],
            "grad_norms": [g for _, _, g in logged], "wire": wire, "save": save}


def _params(save: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(save.glob(f"iter_{ITERS:07d}/mp_rank_*/model_optim_rng.pt")):
        state = torch.load(f, map_location="cpu", weights_only=False)["model"]
        out.update({f"{f.parent.name}/{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def test_real_pretrain_gpt_codec_none_is_bit_identical_and_quant4_compresses():
    checkout = Path(MEGATRON_LM).resolve()
    if not (checkout / "pretrain_gpt.py").is_file():
        pytest.fail(f"MEGATRON_LM={MEGATRON_LM} has no pretrain_gpt.py: give a Megatron-LM checkout")
    deps = _deps_dir()
    _build_helpers(checkout, deps)
    with tempfile.TemporaryDirectory(prefix="ppq-mlm-real-") as tmp:
        runs = {name: _run(checkout, deps, name, Path(tmp)) for name in RUNS}
        base, none, q4 = runs["unpatched"], runs["none"], runs["quant4"]
        for name, r in runs.items():
            assert r["iterations"] == list(range(1, ITERS + 1)), (name, r["iterations"])
        # codec none == megatron-core's own communicator, bit for bit
        assert none["losses"] == base["losses"] and none["grad_norms"] == base["grad_norms"]
        p_base, p_none = _params(base["save"]), _params(none["save"])
        assert p_base and p_base.keys() == p_none.keys()
        assert all(torch.equal(p_base[k], p_none[k]) for k in p_base)
        assert base["wire"] == {}  # no ppq flag: nothing installed, nothing reported
        act_raw, act_wire = none["wire"]["activations stage 0->1"]
        assert act_raw == act_wire > 0 and none["wire"]["gradients stage 1->0"][0] == act_raw
        # 4-bit activations: same raw bytes, under a sixth on the wire; gradients uncompressed
        q_raw, q_wire = q4["wire"]["activations stage 0->1"]
        assert q_raw == act_raw and 6 * q_wire < q_raw
        assert q4["wire"]["gradients stage 1->0"] == none["wire"]["gradients stage 1->0"]
        assert all(abs(float(a) - float(b)) < 0.01 for a, b in zip(q4["losses"], none["losses"]))
        summary = {name: {k: v for k, v in r.items() if k != "save"} for name, r in runs.items()}
        print("megatron real-script result:", json.dumps(summary))
