"""The --ppq-* flags, the launcher's preparation of a Megatron command line, and its errors."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from deepspeed_ppq.config import PPQConfig, PPQConfigError
from megatron_patches import compat
from megatron_patches.args import add_ppq_args, args_to_ppq_config, check_megatron_compatible, ppq_flags
from megatron_patches.run import cpu_defaults, flag_values, prepare


def parse(argv: list[str]) -> argparse.Namespace:
    return add_ppq_args(argparse.ArgumentParser()).parse_args(argv)


def test_every_config_field_has_a_flag():
    def leaves(model, prefix=()):
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                yield from leaves(ann, (*prefix, name))
            else:
                yield (*prefix, name)
    assert {f.path for f in ppq_flags()} == set(leaves(PPQConfig))
    assert "--ppq-activations-bits" in {f.option for f in ppq_flags()}


def test_flags_round_trip_to_config():
    args = parse(["--ppq-activations-method", "quant", "--ppq-activations-bits", "4",
                  "--ppq-weights-format", "int8",
                  "--ppq-gradients-method", "topk", "--no-ppq-gradients-reuse-indices",
                  "--ppq-weights-rules", json.dumps([{"pattern": "*fc2*", "format": "nf4"}]),
                  "--ppq-partition-method", "explicit", "--ppq-partition-boundaries", "[0, 3, 8]"])
    cfg = args_to_ppq_config(args)
    assert cfg.activations.method == "quant" and cfg.activations.bits == 4
    assert cfg.weights.format.value == "int8" and cfg.weights.rules[0].format.value == "nf4"
    assert cfg.gradients.reuse_indices is False
    assert cfg.partition.boundaries == [0, 3, 8]
    assert args_to_ppq_config(parse([])) == PPQConfig()  # nothing given: the defaults


def test_config_file_then_flags_override(tmp_path):
    path = tmp_path / "ppq.json"
    path.write_text(json.dumps({"ppq": {"activations": {"method": "fp8"}, "weights": {"format": "nf4"}}}))
    cfg = args_to_ppq_config(parse(["--ppq-config", str(path), "--ppq-weights-format", "int4"]))
    assert cfg.activations.method == "fp8" and cfg.weights.format.value == "int4"


def test_bad_values_are_parse_errors(capsys):
    with pytest.raises(SystemExit):
        parse(["--ppq-activations-bits", "3"])
    assert "invalid choice: 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--ppq-weights-rules", "[not json"])
    assert "--ppq-weights-rules expects a JSON string" in capsys.readouterr().err
    with pytest.raises(PPQConfigError, match=r"topk_ratio=1.5 is outside \(0, 1\]"):
        args_to_ppq_config(parse(["--ppq-activations-topk-ratio", "1.5"]))


def test_what_megatron_cannot_carry_is_refused():
    aqsgd = args_to_ppq_config(parse(["--ppq-activations-method", "quant", "--ppq-aqsgd-enabled"]))
    check_megatron_compatible(aqsgd, argparse.Namespace(pipeline_model_parallel_size=2))  # carried
    interleaved = argparse.Namespace(num_layers_per_virtual_pipeline_stage=2)
    with pytest.raises(PPQConfigError, match="--ppq-aqsgd-enabled: AQ-SGD keeps per-sample buffers per "
                                             "pipeline boundary"):
        check_megatron_compatible(aqsgd, interleaved)
    with pytest.raises(PPQConfigError, match="--ppq-activations-error-feedback ef21: error feedback"):
        check_megatron_compatible(args_to_ppq_config(parse(
            ["--ppq-activations-method", "quant", "--ppq-activations-error-feedback", "ef21"])), interleaved)
    with pytest.raises(PPQConfigError, match="--no-ppq-gradients-reuse-indices"):
        check_megatron_compatible(args_to_ppq_config(parse(
            ["--ppq-activations-method", "topk", "--ppq-gradients-method", "topk"])), interleaved)
    # stateless codecs are fine with interleaving
    check_megatron_compatible(args_to_ppq_config(parse(["--ppq-activations-method", "quant"])), interleaved)
    te = argparse.Namespace(transformer_impl="transformer_engine")
    with pytest.raises(PPQConfigError, match="add --transformer-impl local"):
        check_megatron_compatible(args_to_ppq_config(parse(["--ppq-weights-format", "int8"])), te)
    tp2 = argparse.Namespace(transformer_impl="local", tensor_model_parallel_size=2)
    with pytest.raises(PPQConfigError, match="--tensor-model-parallel-size 1 \\(got 2\\)"):
        check_megatron_compatible(args_to_ppq_config(parse(["--ppq-weights-format", "int8"])), tp2)


def test_untested_megatron_version_fails_loudly(monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match="tested with megatron-core 0.16.1, 0.19.2 but megatron-core 0.12.0"
                       ):
        compat.check_megatron_version("compressed P2P", "0.12.0")
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    assert compat.check_megatron_version("compressed P2P", "0.12.0") == "0.12.0"
    assert compat.megatron_version() in compat.TESTED_MEGATRON_VERSIONS


def test_missing_patch_point_fails_at_start_up(monkeypatch):
    """Every patch point exists in the installed megatron-core; one taken away is named."""
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    for patch in compat.PATCH_POINTS:
        assert compat.missing_patch_points(patch) == []
        compat.check_megatron_version(patch)
    monkeypatch.delattr(schedules, "forward_backward_pipelining_with_interleaving")
    monkeypatch.delattr(p2p_communication.P2PCommunicator, "_communicate_shapes")
    pp = r"megatron\.core\.pipeline_parallel\."
    want = (rf"the compressed P2P patch needs {pp}p2p_communication\.P2PCommunicator\._communicate_shapes, "
            rf"{pp}schedules\.forward_backward_pipelining_with_interleaving, which megatron-core")
    with pytest.raises(RuntimeError, match=want):
        compat.check_megatron_version("compressed P2P")


def test_prepare_strips_ppq_flags_and_adds_te_fp8_flags():
    rest, section = prepare(["--num-layers", "8", "--ppq-weights-format", "fp8_e4m3",
                             "--ppq-weights-fp8-scale", "tensor", "--ppq-activations-method", "quant"])
    assert not any(a.startswith("--ppq") for a in rest)
    flags = flag_values(rest)
    assert flags["--num-layers"] == "8" and flags["--fp8-format"] == "e4m3"
    assert flags["--fp8-recipe"] == "tensorwise" and "--fp8-param-gather" in flags
    assert flags["--num-layers-at-start-in-bf16"] == "1"
    assert section["activations"]["method"] == "quant"
    rest, _ = prepare(["--transformer-impl", "local", "--ppq-weights-format", "int8"])
    assert "--fp8-format" not in rest


def test_prepare_errors():
    with pytest.raises(PPQConfigError, match="unknown ppq flag"):
        prepare(["--ppq-activation-method", "quant"])
    with pytest.raises(PPQConfigError, match="--fp8-format hybrid on the command line conflicts"):
        prepare(["--fp8-format", "hybrid", "--ppq-weights-format", "fp8_e4m3"])


def test_unreadable_config_and_plan_files_name_the_flag(tmp_path, monkeypatch):
    missing, bad, old = tmp_path / "missing.json", tmp_path / "bad.json", tmp_path / "old.json"
    bad.write_text('{"ppq": ')
    old.write_text(json.dumps({"schema_version": 1}))
    cases = {("--ppq-config", missing): r"--ppq-config .*missing.json: cannot read it \(No such file",
             ("--ppq-config", tmp_path): r"--ppq-config .*: cannot read it \(Is a directory",
             ("--ppq-config", bad): r"--ppq-config .*bad.json is not valid JSON \(Expecting value",
             ("--ppq-plan-file", missing): r"--ppq-plan-file: plan file .*missing.json does not exist",
             ("--ppq-plan-file", bad): r"--ppq-plan-file: plan file .*bad.json is not valid JSON",
             ("--ppq-plan-file", old): r"--ppq-plan-file: plan file .*old.json: .*schema_version=1 is not"}
    for (flag, path), match in cases.items():
        with pytest.raises(PPQConfigError, match=match):
            prepare([flag, str(path)])
    # the launcher: one line and a non-zero exit, before Megatron or any process group
    from megatron_patches.run import main

    script = tmp_path / "pretrain.py"
    script.write_text("raise AssertionError('the script must not run')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit, match=r"^megatron_patches.run: --ppq-config .*missing.json: cannot read"):
        main(["--cpu", str(script), "--ppq-config", str(missing)])


def test_partition_flags_become_the_megatron_layout():
    pp2 = ["--num-layers", "4", "--pipeline-model-parallel-size", "2"]
    part = ["--ppq-partition-method", "explicit", "--ppq-partition-boundaries", "[0, 1, 4]"]
    rest, section = prepare([*pp2, *part])
    assert flag_values(rest)["--pipeline-model-parallel-layout"] == "Et|tttL"
    assert not any(a.startswith("--ppq") for a in rest)
    # the same layout given by hand is fine; another one is a conflict
    rest, _ = prepare([*pp2, "--pipeline-model-parallel-layout", "Et|tttL",
                       "--ppq-partition-method", "explicit", "--ppq-partition-boundaries", "[0, 1, 4]"])
    assert rest.count("--pipeline-model-parallel-layout") == 1
    with pytest.raises(PPQConfigError, match="--pipeline-model-parallel-layout Ett|ttL on the command line "
                                             "conflicts"):
        prepare([*pp2, "--pipeline-model-parallel-layout", "Ett|ttL",
                 "--ppq-partition-method", "explicit", "--ppq-partition-boundaries", "[0, 1, 4]"])
    # uniform is Megatron's own split; nothing given, nothing added
    for extra in (["--ppq-partition-method", "uniform"], []):
        rest, _ = prepare([*pp2, *extra])
        assert "--pipeline-model-parallel-layout" not in rest
    with pytest.raises(PPQConfigError, match="--ppq-partition-method parameters: on Megatron"):
        prepare([*pp2, "--ppq-partition-method", "parameters"])
    with pytest.raises(PPQConfigError, match=r"gives 3 stages but --pipeline-model-parallel-size is 2"):
        prepare([*pp2, "--ppq-partition-method", "explicit", "--ppq-partition-boundaries", "[0, 1, 2, 4]"])
    with pytest.raises(PPQConfigError, match="ends at 6 but --num-layers is 4"):
        prepare([*pp2, "--ppq-partition-method", "explicit", "--ppq-partition-boundaries", "[0, 1, 6]"])
    # a script calling apply() itself without the layout is told how to carry the partition
    args = parse(["--ppq-partition-method", "explicit", "--ppq-partition-boundaries", "[0, 1, 4]"])
    args.pipeline_model_parallel_size, args.num_layers, args.pipeline_model_parallel_layout = 2, 4, None
    with pytest.raises(PPQConfigError, match="pass --pipeline-model-parallel-layout 'Et|tttL'"):
        check_megatron_compatible(args_to_ppq_config(args), args)


def test_cpu_defaults():
    out = cpu_defaults(["--num-layers", "4"])
    assert flag_values(out)["--distributed-backend"] == "gloo"
    assert "--no-persist-layer-norm" in out and "--no-gradient-accumulation-fusion" in out
    assert cpu_defaults(out) == out
    with pytest.raises(PPQConfigError, match="--distributed-backend nccl needs GPUs"):
        cpu_defaults(["--distributed-backend", "nccl"])


def test_plan_file_becomes_megatron_flags(tmp_path):
    from deepspeed_ppq.autotune.plan import Plan, StagePlan

    plan = Plan(world_size=2, pipeline_degree=2, micro_batch_size=2, num_microbatches=8, schedule="1f1b",
                stages=[StagePlan((0, 3), ["none", "none", "int8"]),
                        StagePlan((3, 6), ["int8", "none", "none"])],
                layer_names=["embed", "b0", "b1", "b2", "b3", "head"],
                activation_codec={"method": "quant", "bits": 8})
    path = tmp_path / "plan.json"
    plan.save(path)
    rest, section = prepare(["--transformer-impl", "local", "--ppq-plan-file", str(path)])
    flags = flag_values(rest)
    assert flags["--pipeline-model-parallel-layout"] == "Ett|ttL"
    assert flags["--pipeline-model-parallel-size"] == "2"
    assert flags["--micro-batch-size"] == "2" and flags["--global-batch-size"] == "16"
    rules = {r["pattern"]: r["format"] for r in section["weights"]["rules"]}
    assert rules == {"*decoder.layers.0.*": "none", "*decoder.layers.1.*": "int8",
                     "*decoder.layers.2.*": "int8", "*decoder.layers.3.*": "none"}
    assert section["activations"]["method"] == "quant"
    with pytest.raises(PPQConfigError, match="--micro-batch-size 4 on the command line conflicts"):
        prepare(["--transformer-impl", "local", "--micro-batch-size", "4", "--ppq-plan-file", str(path)])


def test_plan_file_refuses_ppq_settings_it_would_replace(tmp_path):
    from deepspeed_ppq.autotune.plan import Plan, StagePlan

    plan = Plan(world_size=2, pipeline_degree=2, micro_batch_size=2, num_microbatches=8, schedule="1f1b",
                stages=[StagePlan((0, 2), ["none", "int8"]), StagePlan((2, 4), ["int8", "none"])],
                layer_names=["embed", "b0", "b1", "head"], activation_codec={"method": "quant", "bits": 8})
    path = tmp_path / "plan.json"
    plan.save(path)
    base = ["--transformer-impl", "local", "--ppq-plan-file", str(path)]
    for flags, msg in ((["--ppq-gradients-method", "fp8"], '--ppq-gradients-method "fp8" was given and the '
                        'plan has "none"'),
                       (["--ppq-weights-block-size", "32"], "--ppq-weights-block-size 32 was given and the "
                        "plan has 64")):
        with pytest.raises(PPQConfigError, match=f"--ppq-plan-file .*plan.json sets .*{msg}"):
            prepare([*base, *flags])
    _, section = prepare([*base, "--ppq-activations-bits", "8"])  # the plan's own value is fine
    assert section["activations"] == {"method": "quant", "bits": 8}


def test_misspelt_negative_ppq_flag_is_refused():
    with pytest.raises(PPQConfigError, match=r"unknown ppq flag\(s\) \['--no-ppq-activations-enable'\]"):
        prepare(["--no-ppq-activations-enable"])


def test_configs_megatron_command_lines_are_valid():
    """configs/megatron/*: the flags of the shipped command line pass the launcher's checks."""
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs" / "megatron"
    text = (root / "pretrain_gpt_ppq.sh").read_text()
    block = text[text.index("ARGS=(") + len("ARGS=("):text.index("\n)\n")]
    argv = shlex.split(block.replace('"$DATA_PATH"', "d").replace('"$VOCAB"', "v").replace('"$MERGES"', "m")
                       .replace('"$CKPT"', "c"), comments=True)
    rest, section = prepare(argv)
    assert not any(a.startswith("--ppq") for a in rest)
    assert section["weights"]["format"] == "int8" and section["activations"]["error_feedback"] == "ef"
    sbatch = (root / "pretrain_gpt_ppq.sbatch").read_text()
    assert "-m megatron_patches.run pretrain_gpt.py" in sbatch and "pretrain_gpt_ppq.sh" in sbatch
