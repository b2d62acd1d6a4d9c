"""No ``"ppq"`` setting is accepted and ignored: every field of ``PPQConfig`` (nested sections and list
items included) and every ``--ppq-*`` Megatron flag generated from it has an entry in a table here that
says how its effect is shown, and the table is complete (a new field or flag without an entry fails).

An entry is one of:

* ``Run(case, base, differs, same)``: two real engines on 2 gloo ranks (tests/dist/ds_fields.py) that
  differ in this setting; what a user can see (losses, traffic, low-bit layers, ...) ``differs`` between
  them and, where that pins the setting down, other things stay the ``same``;
* ``Tune(check, what)``: one real ``deepspeed_ppq.autotune`` run on 2 ranks with non-default settings
  (``TUNE``); ``check`` reads what the setting steers out of its result;
* ``Shown(test, what)``: another test shows it (the test must exist);
* ``Refused(value, match)``: a value that would have no effect is refused when the config loads
  (DeepSpeed JSON) or when the Megatron launcher reads the flags, naming the field;
* ``Bound(check, what)``: for the tuner's loop limits, which act only when the loop would go on; the
  tune run checks the limit holds.
"""

from __future__ import annotations

import argparse
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dist_utils import ROOT, run_ranks
from pydantic import BaseModel

from deepspeed_ppq.config import PPQConfig, PPQConfigError, load_ppq_config

SCRIPT = ROOT / "tests" / "dist" / "ds_fields.py"


@dataclass(frozen=True)
class Run:
    case: str
    base: str
    differs: tuple[str, ...] = ()
    same: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tune:
    check: Callable[[dict], bool]
    what: str


@dataclass(frozen=True)
class Bound:
    check: Callable[[dict], bool]
    what: str


@dataclass(frozen=True)
class Shown:
    test: str
    what: str


@dataclass(frozen=True)
class Refused:
    value: Any
    match: str


# -- the engine cases (tests/dist/ds_fields.py "engines") ------------------------------------------
W0 = {"format": "int8", "keep_first_blocks": 0, "keep_last_blocks": 0}
FP8 = {"format": "fp8_e4m3", "keep_first_blocks": 0, "keep_last_blocks": 0}
FROZEN = {**W0, "mode": "frozen"}
RULES = [  # layer names: "0", "1.0" ... "4.0" (the blocks' Linear), "5"
    {"pattern": "2.*", "module_type": "Conv2d", "format": "fp8_e4m3"},  # matches 2.0 by name, not by type
    {"pattern": "1.*", "format": "int4"},
    {"pattern": r"^3\.", "match": "regex", "format": "nf4"},  # no glob matches "^3\."
]


def q(bits: int = 8, **kw) -> dict:
    return {"method": "quant", "bits": bits, **kw}


def both(act: dict, grad: dict, **extra) -> dict:
    return {"activations": act, "gradients": grad, **extra}


def engine_cases(work: Path) -> dict[str, dict]:
    aq = {"activations": q(4), "aqsgd": {"enabled": True}}
    disk = {"enabled": True, "storage": "disk"}
    return {
        "plain": {},
        "int8": {"weights": W0},
        "int8_b16_bf16": {"weights": {**W0, "block_size": 16, "scale_dtype": "bf16"}},
        "int8_dq_keep": {"weights": {**W0, "double_quant": True, "keep_first_blocks": 1,
                                     "keep_last_blocks": 1}},
        "fp8": {"weights": FP8},
        "fp8_tensor_mf": {"weights": {**FP8, "fp8_scale": "tensor", "master": "none"}},
        "fp8_tensor_mf_bf16": {"weights": {**FP8, "fp8_scale": "tensor", "master": "none",
                                           "grad_dtype": "bf16"}},
        "int8_saved": {"weights": {**W0, "saved_input": "int8"}},
        "frozen": {"weights": FROZEN},
        "frozen_rank2": {"weights": {**FROZEN, "lora_rank": 2}},
        "frozen_alpha": {"weights": {**FROZEN, "lora_alpha": 64.0}},
        "rules": {"weights": {**W0, "rules": RULES}},
        "opt8_uniform": {"weights": {"optimizer_8bit": True}, "partition": {"method": "uniform"}},
        "explicit_2": {"partition": {"method": "explicit", "boundaries": [0, 2, 6]}},
        "explicit_4": {"partition": {"method": "explicit", "boundaries": [0, 4, 6]}},
        "q8": both(q(8), q(8)),
        "q4_sample": both(q(4), q(8, granularity="sample")),
        "sample_q4": both(q(8, granularity="sample"), q(4)),
        "group16": both(q(8, granularity="group"), q(8, granularity="group")),
        "group8": both(q(8, granularity="group", group_size=8), q(8, granularity="group", group_size=8)),
        "fp8c": both({"method": "fp8"}, {"method": "fp8"}),
        "fp8c_act": both({"method": "fp8", "fp8_format": "e5m2"}, {"method": "fp8"}),
        "fp8c_grad": both({"method": "fp8"}, {"method": "fp8", "fp8_format": "e5m2"}),
        "topk25": both({"method": "topk", "topk_ratio": 0.25},
                       {"method": "topk", "topk_ratio": 0.25, "reuse_indices": False}),
        "topk50": both({"method": "topk", "topk_ratio": 0.5},
                       {"method": "topk", "topk_ratio": 0.5, "reuse_indices": False}),
        "topk25_reuse": both({"method": "topk", "topk_ratio": 0.25}, {"method": "topk", "topk_ratio": 0.25}),
        "q4": both(q(4), q(4)),
        "q4_ef_act": both(q(4, error_feedback="ef"), q(4)),
        "q4_ef_grad": both(q(4), q(4, error_feedback="ef21")),
        "q8_eval": both(q(8, compress_eval=True), q(8)),
        "q8_warm": both(q(8), q(8), warmup_steps=1),
        "q8_nan": {**both(q(8), q(8)), "nan_step": 1},
        "q8_nan_skip": {**both(q(8), q(8), nonfinite="skip"), "nan_step": 1},
        "q4a": {"activations": q(4)},
        "aq": aq,
        "aq_warm": {**aq, "aqsgd": {"enabled": True, "warmup_steps": 1}},
        "aq_disk_a": {**aq, "aqsgd": {**disk, "path": str(work / "aq_a"), "num_samples": 8}},
        "aq_disk_b": {**aq, "aqsgd": {**disk, "path": str(work / "aq_b"), "num_samples": 16}},
    }


# -- the tune (tests/dist/ds_fields.py "tune") ------------------------------------------------------
TUNE = {"seeds": 2, "quality_steps": 2, "max_iterations": 1, "trial_steps": 3, "warmup_steps": 1,
        "val_batches": 1, "val_samples": 8, "profile_reps": 1, "stock_trials": 1, "stock_margin": 0.0,
        "ab_repeats": 0,
        "pipeline_degrees": [2], "micro_batch_sizes": [2], "global_batch": 8, "formats": ["nf4"],
        "master_free": False, "profile_cache": "profile.json", "val_loss_tolerance": 0.5,
        "out_dir": "tuned_here"}


def _gate_limit(r: dict) -> bool:
    mean = sum(r["seed_losses"]) / len(r["seed_losses"])
    return abs(r["gate_limit"] - mean * (1 + TUNE["val_loss_tolerance"])) < 1e-9 * abs(mean)


# -- the table: every field of PPQConfig ------------------------------------------------------------
CODEC_RUNS = {  # field -> (case, base, observable), per direction ("act"/"grad" in the traffic key)
    "method": ("q8", "plain", "wire_bytes"),
    "bits": ("q4_sample", "q8", "wire_bytes"),  # activations: bits 4
    "granularity": ("sample_q4", "q8", "wire_bytes"),  # activations: per sample
    "group_size": ("group8", "group16", "wire_bytes"),
    "topk_ratio": ("topk50", "topk25", "wire_bytes"),
}
GRADIENT_CANDIDATES = ("tests/autotune/test_autotune_config.py::"
                       "test_gradient_candidates_reach_the_planning_problem")
BACK_OFF = "tests/autotune/test_autotune_planner.py::test_back_off_removes_most_sensitive_format_then_codecs"
FIELDS: dict[str, Any] = {
    "weights.format": Run("int8", "plain", differs=("low_bit.format", "losses")),
    "weights.block_size": Run("int8_b16_bf16", "int8", differs=("low_bit.block_size", "losses")),
    "weights.scale_dtype": Run("int8_b16_bf16", "int8", differs=("low_bit.scale_dtype",)),
    "weights.double_quant": Run("int8_dq_keep", "int8", differs=("low_bit.double_quant",)),
    "weights.fp8_scale": Run("fp8_tensor_mf", "fp8", differs=("low_bit.fp8_scale", "losses")),
    "weights.mode": Run("frozen", "int8", differs=("low_bit.mode", "trainable", "losses")),
    "weights.master": Run("fp8_tensor_mf", "fp8", differs=("low_bit.master_free", "trainable")),
    "weights.grad_dtype": Run("fp8_tensor_mf_bf16", "fp8_tensor_mf",
                              differs=("low_bit.grad_bytes", "losses.1"), same=("losses.0",)),
    # the first step's loss comes before any update: only the weight gradients differ
    "weights.saved_input": Run("int8_saved", "int8", differs=("low_bit.saved_input", "losses.1"),
                               same=("losses.0",)),
    "weights.lora_rank": Run("frozen_rank2", "frozen", differs=("low_bit.lora_rank", "trainable")),
    # B starts at zero, so the scale shows from the second step on
    "weights.lora_alpha": Run("frozen_alpha", "frozen", differs=("losses.1",),
                              same=("losses.0", "trainable")),
    "weights.keep_first_blocks": Run("int8_dq_keep", "int8", differs=("format_of:1.0",),
                                     same=("format_of:2.0",)),
    "weights.keep_last_blocks": Run("int8_dq_keep", "int8", differs=("format_of:4.0",),
                                    same=("format_of:3.0",)),
    "weights.rules": Run("rules", "int8", differs=("format_of:1.0", "losses")),
    "weights.rules[].pattern": Run("rules", "int8", differs=("format_of:1.0",), same=("format_of:4.0",)),
    "weights.rules[].match": Run("rules", "int8", differs=("format_of:3.0",)),
    # the first rule matches 2.0 by name; its module_type keeps it off
    "weights.rules[].module_type": Run("rules", "int8", same=("format_of:2.0",)),
    "weights.rules[].format": Run("rules", "int8", differs=("format_of:1.0", "format_of:3.0")),
    "weights.optimizer_8bit": Run("opt8_uniform", "plain", differs=("optimizer", "state_dtypes", "losses")),
    **{f"{d}.{f}": Run(c, b, differs=(f"traffic.0.{s}.{o}",))
       for d, s in (("activations", "act"), ("gradients", "grad")) for f, (c, b, o) in CODEC_RUNS.items()
       if not (d == "gradients" and f in ("bits", "granularity"))},
    "gradients.bits": Run("sample_q4", "q8", differs=("traffic.0.grad.wire_bytes",)),
    "gradients.granularity": Run("q4_sample", "q8", differs=("traffic.0.grad.wire_bytes",)),
    # the first step's loss depends on the activations only, later ones on the gradients too
    "activations.fp8_format": Run("fp8c_act", "fp8c", differs=("losses.0",)),
    "gradients.fp8_format": Run("fp8c_grad", "fp8c", differs=("losses.1",), same=("losses.0",)),
    "activations.error_feedback": Run("q4_ef_act", "q4", differs=("losses.0",)),
    "gradients.error_feedback": Run("q4_ef_grad", "q4", differs=("losses.1",), same=("losses.0",)),
    "gradients.reuse_indices": Run("topk25_reuse", "topk25", differs=("traffic.0.grad.wire_bytes",),
                                   same=("traffic.0.act.wire_bytes",)),
    "activations.reuse_indices": Refused({"activations": {"method": "topk", "reuse_indices": False}},
                                         r"ppq\.activations: reuse_indices=false has no effect"),
    "activations.compress_eval": Run("q8_eval", "q8", differs=("traffic.0.act.wire_bytes", "eval_loss"),
                                     same=("losses", "traffic.0.grad.wire_bytes")),
    "gradients.compress_eval": Refused({"gradients": {"method": "quant", "compress_eval": True}},
                                       r"ppq\.gradients: compress_eval=True has no effect on gradients"),
    "aqsgd.enabled": Run("aq", "q4a", differs=("traffic.0.act.side_bytes", "losses")),
    "aqsgd.warmup_steps": Run("aq_warm", "aq", differs=("traffic.0.act.wire_bytes", "losses")),
    "aqsgd.storage": Run("aq_disk_a", "aq", differs=("files.dir",), same=("losses",)),
    "aqsgd.path": Run("aq_disk_b", "aq_disk_a", differs=("files.dir",), same=("losses",)),
    "aqsgd.num_samples": Run("aq_disk_b", "aq_disk_a", differs=("files.size",)),
    "warmup_steps": Run("q8_warm", "q8", differs=("traffic.0.grad.wire_bytes", "traffic.0.act.wire_bytes")),
    "nonfinite": Run("q8_nan_skip", "q8_nan", differs=("error", "skipped")),
    "watchdog_timeout_s": Shown("tests/integrations/test_reliability_watchdog.py::"
                                "test_stopped_stage_stops_the_other",
                                "a 3 s limit stops the waiting rank, naming ppq.watchdog_timeout_s=3"),
    "partition.method": Run("opt8_uniform", "plain", differs=("parts",)),
    "partition.boundaries": Run("explicit_2", "explicit_4", differs=("parts",)),
    "plan_file": Shown("tests/cli/test_autotune_cli.py::test_tune_the_example_script_then_train_with_the_"
                       "plan", "the script trains at the plan's stage boundaries and thread count"),
    # the tuner: one real tune with TUNE's settings
    "autotune.seeds": Tune(lambda r: len(r["seed_losses"]) == 2, "2 baseline quality runs (default 3)"),
    "autotune.quality_steps": Shown(
        "tests/cli/test_autotune_cli.py::test_tune_the_example_script_then_train_with_the_plan",
        "quality runs train quality_steps steps (autotune/loop.py _Tuning.quality)"),
    "autotune.trial_steps": Tune(lambda r: r["trial_steps"] == [3], "each trial times 3 steps (default 10)"),
    "autotune.warmup_steps": Tune(lambda r: r["trial_warmup"] == [1], "trials leave 1 step out (default 2)"),
    "autotune.val_batches": Tune(lambda r: r["val_batches"] == [1, 2] and len(set(r["val_by_batches"])) == 2
                                 and r["timing_only"] == {"val_is_nan": True, "steps": 3, "memory": 0},
                                 "the same trial evaluated over 1 and 2 batches gives two losses; a "
                                 "timing-only trial (the A/B's repeats) evaluates none"),
    "autotune.val_samples": Tune(lambda r: "ppq.autotune.val_samples=64: the training data has only 24"
                                 in r["val_samples_default_error"] and r["stock_measured"] >= 1,
                                 "8 of the 24 samples are held out for validation; the default 64 cannot be"),
    "autotune.global_batch": Tune(lambda r: r["global_batch"] == 8 and r["plan_global_batch"] == 8,
                                  "8 samples per step (the DeepSpeed config says 4)"),
    "autotune.formats": Tune(lambda r: r["profile_formats"] == ["nf4", "none"],
                             "the profile measures nf4 (default int8)"),
    "autotune.profile_cache": Tune(lambda r: r["profile_cache_bytes"] > 0, "the profile is kept in the file"),
    "autotune.profile_reps": Shown("tests/config/test_reliability_fields.py::test_profile_reps_is_the_"
                                   "number_of_timed_runs",
                                   "each layer timing is the median of profile_reps runs"),
    "autotune.out_dir": Tune(lambda r: {"plan.json", "report.md", "tune.json"} <= set(r["files"]),
                             "plan, report and result land in out_dir"),
    "autotune.val_loss_tolerance": Tune(_gate_limit, "the gate's limit is the seeds' mean x 1.5"),
    "autotune.stock_trials": Tune(lambda r: r["stock_measured"] == 1 and r["stock_fitting"] > 1,
                                  "1 stock configuration measured though more fit (default 3)"),
    "autotune.stock_margin": Tune(lambda r: "stopped: stock_margin=0: 1 that fit measured, no more"
                                  in r["stock_search"], "no search past stock_trials (default: while the "
                                  "next is predicted within 15% of the best measured)"),
    "autotune.memory_tolerance": Tune(lambda r: r["over_with_tolerance"] == [False, True],
                                      "a measured peak 10% over the budget fits with 0.2, not with 0.05"),
    "autotune.max_iterations": Bound(lambda r: r["iterations"] <= 1, "at most 1 plan tried"),
    "autotune.ab_repeats": Bound(lambda r: r["ab_runs"] <= 1, "no alternating A/B runs"),
    "autotune.ladder": Shown("tests/e2e/test_demo.py::test_quick_demo_end_to_end",
                             "the demo tunes with ladder=true: rungs measured and plotted when tuned"),
    "autotune.schedules": Refused({"autotune": {"schedules": ["zigzag"]}}, r"ppq\.autotune\.schedules\.0="),
    **{f"autotune.{f}": Shown("tests/autotune/test_autotune_config.py::test_settings_reach_the_planning_"
                              "problem",
                              "reaches the planning problem; tests/autotune/test_autotune_planner.py plans "
                              "with it")
       for f in ("memory_budget", "micro_batch_sizes", "pipeline_degrees", "allow_recompute",
                 "optimizer_8bit", "master_free", "master_free_grad_dtype", "min_activation_bits",
                 "activation_codecs")},
    "autotune.min_gradient_bits": Shown(GRADIENT_CANDIDATES, "candidates below it are dropped"),
    "autotune.gradient_codecs": Shown(GRADIENT_CANDIDATES, "the candidates the planner chooses from"),
    # a candidate codec becomes the plan's ppq.activations / ppq.gradients: the fields above
    "autotune.activation_codecs[].*": Shown(BACK_OFF, "as activations.*, once chosen"),
    "autotune.gradient_codecs[].*": Shown(BACK_OFF, "as gradients.*, once chosen"),
}

# -- the table: every --ppq-* flag of the Megatron launcher -----------------------------------------
P2P = "tests/megatron/test_megatron_p2p.py::test_gradients_match_single_process_reference"
CHANNEL = ("megatron-core's schedules send through the same BoundaryChannel as the DeepSpeed engine, "
           "against the single-process reference")
LAYERS = "tests/megatron/test_megatron_layers.py::test_policy_keeps_first_last_blocks_and_output_layer"
SHARED_LINEAR = ("QuantParallelLinear is a QuantLinear built from the same WeightsConfig (the DeepSpeed "
                 "run above shows the field); ")
MEGATRON_RUN, MEGATRON_ARGS = "tests/megatron/test_megatron_run.py", "tests/megatron/test_megatron_args.py"
DEEPSPEED_ONLY = r"ppq settings that only the DeepSpeed path carries out:\n  {}"
FLAGS: dict[str, Any] = {
    "--ppq-weights-format": Shown(f"{MEGATRON_RUN}::test_gpt_pp2_trains_with_int8_weights_and_8bit_"
                                  "activations",
                                  "int8 layers on both ranks"),
    "--ppq-weights-block-size": Shown(LAYERS, SHARED_LINEAR + "block 32 there"),
    "--ppq-weights-scale-dtype": Shown(LAYERS, SHARED_LINEAR + "scale dtype"),
    "--ppq-weights-double-quant": Shown(LAYERS, SHARED_LINEAR + "scale codes"),
    "--ppq-weights-fp8-scale": Shown(f"{MEGATRON_ARGS}::test_prepare_strips_ppq_flags_and_adds_te_fp8_flags",
                                     "--fp8-recipe tensorwise with Transformer Engine"),
    "--ppq-weights-mode": Shown(LAYERS, SHARED_LINEAR + "frozen: LoRA adapters beside the codes"),
    "--ppq-weights-master": Refused(["--ppq-weights-format", "int8", "--ppq-weights-master", "none"],
                                    DEEPSPEED_ONLY.format("--ppq-weights-master none")),
    # bf16 gradient buffers are for master-free weights only, which Megatron refuses (above)
    "--ppq-weights-grad-dtype": Refused(["--ppq-weights-format", "int8", "--ppq-weights-master", "none",
                                         "--ppq-weights-grad-dtype", "bf16"],
                                        DEEPSPEED_ONLY.format("--ppq-weights-master none")),
    "--ppq-weights-saved-input": Shown(
        "tests/quant/test_quant_linear.py::test_int8_saved_input_keeps_codes_and_makes_the_weight_gradient_"
        "from_them",
        SHARED_LINEAR + "its forward is QuantLinear's DequantLinearFunction, which keeps the codes"),
    "--ppq-weights-lora-rank": Shown(LAYERS, SHARED_LINEAR + "adapter rank"),
    "--ppq-weights-lora-alpha": Shown(LAYERS, SHARED_LINEAR + "adapter scale"),
    "--ppq-weights-keep-first-blocks": Shown(LAYERS, "global layer numbers across stages"),
    "--ppq-weights-keep-last-blocks": Shown(LAYERS, "global layer numbers across stages"),
    "--ppq-weights-rules": Shown(f"{MEGATRON_ARGS}::test_plan_file_becomes_megatron_flags",
                                 "per-layer rules on decoder.layers.<i>"),
    "--ppq-weights-optimizer-8bit": Refused(["--ppq-weights-optimizer-8bit"],
                                            DEEPSPEED_ONLY.format("--ppq-weights-optimizer-8bit")),
    **{f"--ppq-{d}-{f.replace('_', '-')}": Shown(P2P, CHANNEL)
       for d in ("activations", "gradients")
       for f in ("method", "bits", "granularity", "group_size", "fp8_format", "topk_ratio",
                 "error_feedback")},
    "--ppq-gradients-reuse-indices": Shown(P2P, CHANNEL + " (topk-ef_mixed_topk-reuse-indices)"),
    "--ppq-activations-reuse-indices": Refused(
        ["--ppq-activations-method", "topk", "--no-ppq-activations-reuse-indices"],
        r"activations: reuse_indices=false has no effect"),
    "--ppq-activations-compress-eval": Shown(
        "tests/megatron/test_megatron_p2p.py::test_aqsgd_outside_a_wrapped_schedule_names_the_way_in",
        "Megatron's BoundaryCodecs asks the channel's codec_mode, as DeepSpeed does: an evaluation sends "
        "4-bit activations as a payload"),
    "--ppq-gradients-compress-eval": Refused(
        ["--ppq-gradients-method", "quant", "--ppq-gradients-compress-eval"],
        r"gradients: compress_eval=True has no effect"),
    "--ppq-aqsgd-enabled": Shown(P2P, CHANNEL + " (aqsgd-* cases)"),
    "--ppq-aqsgd-warmup-steps": Shown(P2P, CHANNEL + " (aqsgd-topk-reuse-dict-explicit-unbatched)"),
    "--ppq-aqsgd-storage": Shown(P2P, CHANNEL + "; the storage is the channel's (DeepSpeed run above)"),
    "--ppq-aqsgd-path": Shown(P2P, CHANNEL + "; the storage is the channel's (DeepSpeed run above)"),
    "--ppq-aqsgd-num-samples": Shown(P2P, CHANNEL + "; the storage is the channel's (DeepSpeed run above)"),
    "--ppq-warmup-steps": Shown(P2P, CHANNEL + " (quant2-sample_quant6-group-warmup)"),
    "--ppq-nonfinite": Shown(P2P, "the channel flags non-finite payloads; error stops the sender after its "
                             "send (p2p.py raise_if_flagged), skip hands megatron-core the NaN"),
    "--ppq-watchdog-timeout-s": Refused(["--ppq-watchdog-timeout-s", "60"],
                                        DEEPSPEED_ONLY.format("--ppq-watchdog-timeout-s")),
    "--ppq-partition-method": Shown(f"{MEGATRON_RUN}::test_partition_flags_move_the_stage_boundary",
                                    "explicit boundaries become the layout"),
    "--ppq-partition-boundaries": Shown(f"{MEGATRON_RUN}::test_partition_flags_move_the_stage_boundary",
                                        "the first stage holds the given layers"),
    "--ppq-plan-file": Shown(f"{MEGATRON_ARGS}::test_plan_file_becomes_megatron_flags",
                             "the plan's layout, batch sizes and per-layer formats"),
    "--ppq-autotune-*": Refused(["--ppq-autotune-seeds", "5"], DEEPSPEED_ONLY.format(r"--ppq-autotune-\*")),
}


# -- walking the schema -----------------------------------------------------------------------------
def _model_in(ann) -> type[BaseModel] | None:
    for a in (ann, *typing.get_args(ann)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def leaf_fields(model: type[BaseModel] = PPQConfig, prefix: str = "") -> list[str]:
    """Every setting: nested sections by their dotted path, the fields of list items as ``list[].field``."""
    out = []
    for name, field in model.model_fields.items():
        path = prefix + name
        ann = field.annotation
        if typing.get_origin(ann) is list and _model_in(typing.get_args(ann)[0]) is not None:
            out.append(path)
            out += leaf_fields(_model_in(typing.get_args(ann)[0]), path + "[].")
        elif _model_in(ann) is not None:
            out += leaf_fields(_model_in(ann), path + ".")
        else:
            out.append(path)
    return out


def _covers(entry: str, key: str) -> bool:
    return entry == key or (entry.endswith("*") and key.startswith(entry[:-1]))


def _entry(table: dict, key: str):
    """The entry for ``key``: exact, else the longest ``prefix*`` entry that covers it."""
    if key in table:
        return table[key]
    wild = [k for k in table if k.endswith("*") and _covers(k, key)]
    return table[max(wild, key=len)] if wild else None


def _test_exists(ref: str) -> bool:
    path, _, name = ref.partition("::")
    return (ROOT / path).is_file() and f"def {name}(" in (ROOT / path).read_text()


def test_every_field_and_flag_has_an_entry():
    from megatron_patches.args import ppq_flags

    fields = leaf_fields()
    assert "weights.rules[].module_type" in fields and "aqsgd.num_samples" in fields
    missing = [f for f in fields if _entry(FIELDS, f) is None]
    assert not missing, f"ppq fields without an entry in FIELDS (say how their effect is shown): {missing}"
    stale = [k for k in FIELDS if not any(_covers(k, f) for f in fields)]
    assert not stale, f"FIELDS entries for fields that do not exist: {stale}"
    options = [f.option for f in ppq_flags()]
    missing = [o for o in options if _entry(FLAGS, o) is None]
    assert not missing, f"--ppq-* flags without an entry in FLAGS: {missing}"
    stale = [k for k in FLAGS if not any(_covers(k, o) for o in options)]
    assert not stale, f"FLAGS entries for flags that do not exist: {stale}"
    for table in (FIELDS, FLAGS):
        for key, e in table.items():
            if isinstance(e, Shown):
                assert _test_exists(e.test), f"{key}: no test {e.test}"
            if isinstance(e, Run):
                assert e.differs or e.same, key


@pytest.mark.parametrize("field", [k for k, e in FIELDS.items() if isinstance(e, Refused)])
def test_fields_without_effect_are_refused_at_load(field):
    e = FIELDS[field]
    with pytest.raises(PPQConfigError, match=e.match):
        load_ppq_config(e.value)


@pytest.mark.parametrize("flag", [k for k, e in FLAGS.items() if isinstance(e, Refused)])
def test_flags_megatron_does_not_carry_are_refused_by_the_launcher(flag):
    from megatron_patches import apply
    from megatron_patches.run import prepare

    e = FLAGS[flag]
    with pytest.raises(PPQConfigError, match=e.match):
        prepare(["--transformer-impl", "local", *e.value])
    # a script that calls apply() itself is refused the same way
    from megatron_patches.args import add_ppq_args

    args = add_ppq_args(argparse.ArgumentParser()).parse_args(e.value)
    args.transformer_impl = "local"
    with pytest.raises(PPQConfigError, match=e.match):
        apply(args)


def test_plan_with_deepspeed_only_choices_is_refused_on_megatron(tmp_path):
    from deepspeed_ppq.autotune.plan import Plan, StagePlan
    from megatron_patches.run import prepare

    plan = Plan(world_size=2, pipeline_degree=2, micro_batch_size=2, num_microbatches=2, schedule="1f1b",
                stages=[StagePlan((0, 2), ["none", "int8"]), StagePlan((2, 4), ["int8", "none"])],
                layer_names=["embed", "b0", "b1", "head"], optimizer_8bit=True)
    plan.save(tmp_path / "plan.json")
    with pytest.raises(PPQConfigError, match=r"the plan uses 8-bit Adam states .* only the DeepSpeed path"):
        prepare(["--transformer-impl", "local", "--ppq-plan-file", str(tmp_path / "plan.json")])


def test_profile_reps_is_the_number_of_timed_runs():
    """``autotune.profile_reps`` reaches ``profile_layers`` (integrations/autotune.py): every timing of a
    layer runs it that many more times."""
    import torch
    from torch import nn

    from deepspeed_ppq.autotune.profiler import profile_layers

    calls = {"n": 0}
    layers = [nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)]
    layers[1].register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))  # copies share it

    def runs(reps: int) -> int:
        calls["n"] = 0
        profile_layers(layers, ["embed", "block", "head"], lambda b: (torch.randn(b, 4), torch.randn(b, 2)),
                       nn.functional.mse_loss, formats=(), micro_batch_sizes=(2,), reps=reps, warmup=0)
        return calls["n"]

    one, three, five = runs(1), runs(3), runs(5)
    assert three - one == five - three > 0, (one, three, five)  # 2 more runs per timing of the layer


# -- the real runs ----------------------------------------------------------------------------------
def _value(rec: dict, key: str):
    """An observable of one rank's record (see tests/dist/ds_fields.py)."""
    if key.startswith("format_of:"):
        name = key.split(":", 1)[1]
        return next((layer["format"] for layer in rec.get("low_bit", []) if layer["name"] == name), "dense")
    if key.startswith("low_bit."):
        return sorted(str(layer[key.split(".", 1)[1]]) for layer in rec.get("low_bit", []))
    if key.startswith("files."):
        part = key.split(".", 1)[1]
        return [f[part] for f in rec.get("files", [])]
    head, *rest = key.split(".")
    v = rec.get(head)
    if head == "traffic":
        return v[".".join(rest[:2])][rest[2]]
    for r in rest:
        v = v[int(r)] if isinstance(v, list) else v[r]
    return v


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    work = tmp_path_factory.mktemp("fields")
    cases = [{"name": name, "ppq": {k: v for k, v in ppq.items() if k != "nan_step"},
              "nan_step": ppq.get("nan_step")} for name, ppq in engine_cases(work).items()]
    (work / "cases.json").write_text(json.dumps(cases))
    return run_ranks(SCRIPT, 2, ["engines", work / "cases.json", work], timeout=900)


@pytest.mark.distributed
def test_engine_cases_ran(engines):
    names = set(engine_cases(Path("/unused")))
    used = {n for e in FIELDS.values() if isinstance(e, Run) for n in (e.case, e.base)}
    assert used <= names and names <= used, (names - used, used - names)  # every case serves an entry
    for rank, res in enumerate(engines):
        for name, rec in res.items():
            want_error = name == "q8_nan"
            assert ("error" in rec) == want_error, (rank, name, rec.get("error"))
            if name == "q8_nan_skip":  # the injected step's loss is NaN and the step is skipped
                assert rec["skipped"] == 1 and rec["losses"][1] != rec["losses"][1], (rank, rec)
                assert rec["losses"][2] == rec["losses"][2], (rank, rec)
            elif not want_error:
                assert rec["losses_finite"], (rank, name, rec)
        assert res["q8_nan"]["error"].startswith("NonFiniteStepError"), res["q8_nan"]["error"]


@pytest.mark.distributed
@pytest.mark.parametrize("field", [k for k, e in FIELDS.items() if isinstance(e, Run)])
def test_setting_changes_what_a_real_engine_does(engines, field):
    e = FIELDS[field]
    for key in e.differs:
        got = [_value(res[e.case], key) for res in engines]
        base = [_value(res[e.base], key) for res in engines]
        assert got != base, f"{field}: {key} is {got} in {e.case!r} and in {e.base!r} alike"
    for key in e.same:
        got = [_value(res[e.case], key) for res in engines]
        base = [_value(res[e.base], key) for res in engines]
        assert got == base, f"{field}: {key} is {got} in {e.case!r} but {base} in {e.base!r}"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    work = tmp_path_factory.mktemp("fields_tune")
    (work / "cases.json").write_text(json.dumps([{"name": "tune", "autotune": TUNE}]))
    return run_ranks(SCRIPT, 2, ["tune", work / "cases.json", work], timeout=900)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("field", [k for k, e in FIELDS.items() if isinstance(e, (Tune, Bound))])
def test_tuner_setting_steers_a_real_tune(tuned, field):
    e = FIELDS[field]
    for rank, res in enumerate(tuned):
        assert e.check(res["tune"]), (field, e.what, rank, res["tune"])
