"""Roofline costs, hardware table, Perfetto trace, PNG plots and the ``ppq simulate`` command."""

import json
from pathlib import Path

import pytest

from deepspeed_ppq.cli import main as ppq_main
from deepspeed_ppq.schedule import LinkModel, StageCost, StageMemory, build_schedule, simulate
from deepspeed_ppq.schedule.costs import (
    ModelShape,
    layer_flops,
    stage_costs_from_profile,
    stage_costs_roofline,
    stage_memory,
)
from deepspeed_ppq.schedule.hardware import HARDWARE, get_hardware
from deepspeed_ppq.schedule.plots import plot_memory, plot_timeline
from deepspeed_ppq.schedule.trace import chrome_trace

CSV_1F1B = str(Path(__file__).resolve().parents[1] / "golden" / "1f1b_p4_m8.csv")
SHAPE = ModelShape(layers=8, hidden=1024, heads=16, seq_len=512, vocab=32000, micro_batch=2)


def test_hardware_entries_have_sources_and_fractions():
    for key, hw in HARDWARE.items():
        assert hw.source and 0 < hw.achievable_flops <= 1 and 0 < hw.achievable_mem <= 1, key
        assert hw.mem_bw > 0 and hw.link_bw > 0
    assert get_hardware("H200").mem_bw > get_hardware("h100").mem_bw
    with pytest.raises(ValueError, match="hardware='tpu' is unknown: use one of h100, h200, a100, cpu"):
        get_hardware("tpu")


def test_layer_flops_formula():
    f, bi, bw = layer_flops(SHAPE)
    b, s, h = 2, 512, 1024
    assert f == 24 * b * s * h * h + 4 * b * s * s * h
    assert bi == f and bw == 24 * b * s * h * h


def test_roofline_costs_scale_with_layers_and_hardware():
    h100 = stage_costs_roofline(SHAPE, 2, get_hardware("h100"))
    a100 = stage_costs_roofline(SHAPE, 2, get_hardware("a100"))
    assert all(x.forward < y.forward for x, y in zip(h100, a100))
    uneven = stage_costs_roofline(SHAPE, 2, get_hardware("h100"), boundaries=[0, 6, 8])
    assert uneven[0].forward == pytest.approx(h100[0].forward * 6 / 4)
    rec = stage_costs_roofline(SHAPE, 2, get_hardware("h100"), recompute=[True, False])
    assert rec[0].recompute == pytest.approx(rec[0].forward) and rec[1].recompute == 0.0
    with pytest.raises(ValueError, match="stages=9 is more than layers=8"):
        stage_costs_roofline(SHAPE, 9, get_hardware("h100"))
    with pytest.raises(ValueError, match=r"boundaries=\[0, 5, 4, 8\] must be 4 strictly increasing"):
        stage_costs_roofline(SHAPE, 3, get_hardware("h100"), boundaries=[0, 5, 4, 8])


def test_stage_memory_low_bit_weights_and_recompute():
    full = stage_memory(SHAPE, 2, "none")
    int4 = stage_memory(SHAPE, 2, "int4")
    p = 4 * SHAPE.layer_params
    assert full[0].static["weights.bf16"] == p * 2 + SHAPE.vocab * SHAPE.hidden * 2
    assert int4[0].static["weights.int4"] == p // 2 + (p // 64) * 4
    rec = stage_memory(SHAPE, 2, recompute=[True, True])
    assert rec[0].activation_per_microbatch == 4 * 512 * 2 * 1024 * 2
    assert rec[0].activation_per_microbatch < full[0].activation_per_microbatch / 10
    with pytest.raises(ValueError, match="optimizer='lamb' is unknown"):
        stage_memory(SHAPE, 2, optimizer="lamb")
    with pytest.raises(ValueError, match="ModelShape.hidden=100 must be divisible by heads=16"):
        ModelShape(4, 100, 16, 8, 8)


def test_costs_from_profile():
    c = stage_costs_from_profile([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0, 1, 3], backward_weight=[1, 1, 1])
    assert c == [StageCost(1.0, 2.0, 1.0), StageCost(5.0, 10.0, 2.0)]
    with pytest.raises(ValueError, match="profile lists differ in length: forward 2, backward 1"):
        stage_costs_from_profile([1.0, 2.0], [1.0], [0, 2])


def _result():
    return simulate(build_schedule("zbh1", 2, 3), [StageCost(1e-3, 1e-3, 5e-4)] * 2, [(1000, 1000)],
                    LinkModel(1e-4, 1e7), [StageMemory({"weights.int4": 10}, 100, 4, 2, 10)] * 2)


def test_chrome_trace_has_processes_tracks_and_counters():
    tr = chrome_trace(_result())
    ev = tr["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "stage 0"), (1, "stage 1")}
    compute = [e for e in ev if e["ph"] == "X" and e["tid"] == 0]
    sends = [e for e in ev if e["ph"] == "X" and e["tid"] == 1]
    assert len(compute) == 2 * 3 * 3 and len(sends) == 2 * 3
    assert all(e["dur"] > 0 for e in compute + sends)
    assert any(e["ph"] == "C" for e in ev)
    json.dumps(tr)


def test_plots_write_pngs(tmp_path):
    r = _result()
    for fn, name in [(plot_timeline, "t.png"), (plot_memory, "m.png")]:
        path = fn(r, tmp_path / name)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no memory model"):
        plot_memory(simulate(build_schedule("1f1b", 2, 2), [StageCost(1, 1)] * 2), tmp_path / "x.png")


def test_ppq_simulate_command(tmp_path, capsys):
    rc = ppq_main(["simulate", "--layers", "8", "--hidden", "512", "--heads", "8", "--seq-len", "256",
                   "--vocab", "1000", "--stages", "2", "--microbatches", "4", "--weights", "int4",
                   "--act-codec", "quant:4", "--grad-codec", "quant:8", "--out-dir", str(tmp_path), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "1f1b" and len(out["per_stage"]) == 2
    # 4-bit activations (per-token scales) are about 1/4 of bf16; 8-bit gradients about 1/2.
    full = 1 * 256 * 512 * 2
    assert full / 5 < out["activation_bytes"] < full / 3 and full / 2.5 < out["gradient_bytes"] < full / 1.5
    assert "weights.int4" in out["per_stage"][0]["peak_by_category"]
    for f in ("trace.json", "timeline.png", "memory.png"):
        assert (tmp_path / f).stat().st_size > 0


@pytest.mark.parametrize("argv, match", [
    (["--schedule", "interleaved", "--virtual-stages", "2", "--layers", "6", "--stages", "2",
      "--microbatches", "4"], "--layers=6 must be divisible by stages x virtual stages = 4"),
    (["--stages", "9", "--layers", "8"], "stages=9 is more than layers=8"),
    (["--microbatches", "0"], "num_microbatches=0 must be a positive integer"),
    (["--act-codec", "zip"], "codec 'zip' is unknown"),
])
def test_ppq_simulate_bad_input(argv, match, tmp_path, capsys):
    with pytest.raises(SystemExit):
        ppq_main(["simulate", "--out-dir", str(tmp_path), *argv])
    assert match in capsys.readouterr().err


_SMALL_MODEL = ["--layers", "8", "--hidden", "512", "--heads", "8", "--seq-len", "256", "--vocab", "1000"]


def _usage_error(argv, capsys) -> str:
    """Run ``ppq simulate argv``; return the one-line error after checking it is argparse's (exit 2)."""
    with pytest.raises(SystemExit) as e:
        ppq_main(["simulate", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, match", [
    (["--latency", "nan"], "argument --latency: 'nan' must be a finite number >= 0"),
    (["--latency", "inf"], "argument --latency: 'inf' must be a finite number >= 0"),
    (["--latency", "-0.5"], "argument --latency: '-0.5' must be a finite number >= 0"),
    (["--codec-seconds", "inf"], "argument --codec-seconds: 'inf' must be a finite number >= 0"),
    (["--codec-seconds", "nan", "--act-codec", "fp8"], "argument --codec-seconds: 'nan' must be a finite"),
    (["--codec-seconds", "-1", "--act-codec", "fp8"], "argument --codec-seconds: '-1' must be a finite"),
    (["--bandwidth", "0"], "argument --bandwidth: '0' must be a finite number > 0"),
    (["--bandwidth", "inf"], "argument --bandwidth: 'inf' must be a finite number > 0"),
    (["--schedule-csv", "/nonexistent.csv"], "--schedule-csv='/nonexistent.csv' cannot be read: No such"),
    (["--recompute", "7"], "--recompute='7' names stage 7, but the stages are 0..3 (4 stages)"),
    (["--recompute", "0,-1"], "--recompute='0,-1' names stage -1, but the stages are 0..3 (4 stages)"),
    (["--recompute", "a"], "--recompute='a' must be comma-separated integers"),
    (["--schedule-csv", CSV_1F1B, "--stages", "2"],
     f"--stages=2 conflicts with --schedule-csv={CSV_1F1B!r}, which has 4"),
    (["--schedule-csv", CSV_1F1B, "--microbatches", "3"], "--microbatches=3 conflicts with --schedule-csv="),
    (["--schedule-csv", CSV_1F1B, "--schedule", "gpipe"], "--schedule=gpipe conflicts with --schedule-csv="),
    (["--schedule-csv", CSV_1F1B, "--virtual-stages", "2"], "--virtual-stages=2 conflicts with"),
    (["--act-codec", "quant:3"],
     "argument --act-codec: codec 'quant:3' is invalid: use none, quant:<2|4|6|8>, fp8 or topk:<ratio in "),
    (["--grad-codec", "topk:2"], "argument --grad-codec: codec 'topk:2' is invalid: use none"),
    (["--grad-codec", "fp8:3"], "argument --grad-codec: codec 'fp8:3' is invalid: use none"),
])
def test_ppq_simulate_usage_errors_name_flag_value_and_allowed(argv, match, tmp_path, capsys):
    line = _usage_error(["--out-dir", str(tmp_path), *argv], capsys)
    assert line.startswith("ppq simulate: error: ") and match in line


def test_ppq_simulate_bad_paths_name_the_flag(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert f"--schedule-csv={str(tmp_path)!r} cannot be read: Is a directory" in _usage_error(
        ["--schedule-csv", str(tmp_path)], capsys)
    assert f"--out-dir={str(a_file)!r} is a file: give a directory" in _usage_error(
        ["--out-dir", str(a_file)], capsys)
    assert f"--out-dir={str(a_file / 'sub')!r} cannot be written: Not a directory" in _usage_error(
        [*_SMALL_MODEL, "--out-dir", str(a_file / "sub")], capsys)


def test_ppq_simulate_accepts_flags_that_agree_with_the_csv(tmp_path, capsys):
    rc = ppq_main(["simulate", *_SMALL_MODEL, "--schedule-csv", CSV_1F1B, "--schedule", "1f1b",
                   "--stages", "4", "--microbatches", "8", "--virtual-stages", "1", "--recompute", "0,3",
                   "--latency", "0", "--bandwidth", "1e9", "--act-codec", "fp8", "--codec-seconds", "0",
                   "--out-dir", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and (out["schedule"], out["stages"], out["microbatches"]) == ("1f1b", 4, 8)
