"""End to end: `python -m megatron_patches.run <script> ... --ppq-*` on 2 gloo ranks (TP 1, PP 2).

The script (tests/mcore/pretrain_tiny_gpt.py) is a stand-in for Megatron-LM's pretrain_gpt.py that
knows nothing about ppq and, like it, assumes CUDA (``model_parallel_cuda_manual_seed``, ``.cuda()``,
megatron-core's own schedule without a communicator, as Megatron-LM's train_step calls it): it runs
here only through the launcher's CPU mode. Megatron-LM's real script:
tests/megatron/test_megatron_real_script.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from dist_utils import ROOT, free_port, rank_env, run_ranks

SCRIPT = str(ROOT / "tests" / "mcore" / "pretrain_tiny_gpt.py")
PPQ = ["--ppq-weights-format", "int8", "--ppq-activations-method", "quant", "--ppq-activations-bits", "8",
       "--ppq-gradients-method", "quant", "--ppq-gradients-bits", "8"]


def launch(args: list[str], world_size: int = 2, timeout: float = 400) -> tuple[list[dict], list[str]]:
    """``python -m megatron_patches.run SCRIPT args`` on ``world_size`` gloo ranks: (results, outputs)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ppq-mlm-") as out_dir:
        procs = [subprocess.Popen([sys.executable, "-m", "megatron_patches.run", SCRIPT, *args],
                                  env=rank_env(r, world_size, port, out_dir), cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for r in range(world_size)]
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{outs[r][-4000:]}"
        results = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
    return results, outs


def wire_lines(out: str) -> dict[str, tuple[int, int]]:
    """The launcher's closing report: ``{"activations stage 0->1": (raw, wire)}``."""
    pat = r"bytes on the wire, (\w+ stage \d->\d): ([\d,]+) -> ([\d,]+) bytes \(([\d.]+)x\)"
    return {m[0]: (int(m[1].replace(",", "")), int(m[2].replace(",", "")))
            for m in re.findall(pat, out)}


@pytest.mark.distributed
def test_gpt_pp2_trains_with_int8_weights_and_8bit_activations():
    ranks, outs = launch(["--transformer-impl", "local", "--train-iters", "8", *PPQ])
    first, last = sorted(ranks, key=lambda r: r["rank"])
    for r in ranks:
        assert r["communicator"] == "BoundPPQP2PCommunicator"
        assert r["lowbit_formats"] == ["int8"]
        # 4 layers, first and last kept dense: one int8 block per stage, 4 linears each
        assert r["lowbit_layers"] == 4
        assert r["stage_layers"] == 2  # Megatron's own even split
    losses = last["losses"]
    assert len(losses) == 8
    assert losses[-1] < 0.9 * losses[0], losses
    # 8-bit codes + per-token scales instead of fp32: about a quarter of the bytes
    assert first["wire_bytes"]["activations"] < 0.35 * first["raw_bytes"]["activations"]
    assert last["wire_bytes"]["gradients"] < 0.35 * last["raw_bytes"]["gradients"]
    # the launcher's closing report says the same, one line per boundary the rank sends on
    assert wire_lines(outs[0]) == {"activations stage 0->1": (first["raw_bytes"]["activations"],
                                                              first["wire_bytes"]["activations"])}
    assert wire_lines(outs[1]) == {"gradients stage 1->0": (last["raw_bytes"]["gradients"],
                                                            last["wire_bytes"]["gradients"])}


@pytest.mark.distributed
def test_partition_flags_move_the_stage_boundary():
    ranks, outs = launch(["--transformer-impl", "local", "--train-iters", "2", "--num-layers", "4",
                          "--pipeline-model-parallel-size", "2",
                          "--ppq-partition-method", "explicit", "--ppq-partition-boundaries", "[0, 1, 4]"])
    assert [r["stage_layers"] for r in sorted(ranks, key=lambda r: r["rank"])] == [1, 3]
    assert len(ranks[1]["losses"]) == 2
    # a --ppq-* flag installs the counting communicator even with codec none: raw == wire
    raw, wire = wire_lines(outs[0])["activations stage 0->1"]
    assert raw == wire > 0


@pytest.mark.distributed
def test_launcher_rejects_bad_flags_before_starting():
    with pytest.raises(RuntimeError, match="--ppq-aqsgd-enabled: AQ-SGD keeps per-sample buffers"):
        run_ranks("-m", 1, ["megatron_patches.run", SCRIPT, "--ppq-activations-method", "quant",
                            "--ppq-aqsgd-enabled", "--num-layers-per-virtual-pipeline-stage", "1"],
                  timeout=120)
