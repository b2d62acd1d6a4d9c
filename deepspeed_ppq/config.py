"""The typed ``"ppq"`` section of a DeepSpeed JSON config.

One model serves every front end: the DeepSpeed JSON section (``deepspeed_ppq.initialize``), the
Megatron ``--ppq-*`` flags (``megatron_patches.add_ppq_args`` walks these fields), the ``ppq`` CLI
and the JSON Schema in ``configs/ppq.schema.json`` (``python -m deepspeed_ppq.config > ...``).

Example::

    "ppq": {
      "weights":     {"format": "int8", "block_size": 64, "keep_first_blocks": 1},
      "activations": {"method": "quant", "bits": 8, "granularity": "token"},
      "gradients":   {"method": "quant", "bits": 8},
      "partition":   {"method": "explicit", "boundaries": [0, 5, 10]}
    }

Defaults are safe: no low-bit weights and no compression unless asked for. Every error names the
dotted field, the bad value, what is allowed and, for a misspelt key, the closest valid one.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import sys
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deepspeed_ppq.formats import FORMATS, MASTER_FREE_FORMATS, format_spec

__all__ = [
    "WeightFormat",
    "PrecisionRule",
    "WeightsConfig",
    "CodecConfig",
    "AQSGDConfig",
    "PartitionConfig",
    "AutotuneConfig",
    "parse_bytes",
    "PPQConfig",
    "PPQConfigError",
    "load_ppq_config",
    "ppq_json_schema",
    "add_schema_parser",
]


class PPQConfigError(ValueError):
    """A ``"ppq"`` config that cannot be used; the message says which field and how to fix it."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=False)


def _finite(v: float, field: str, hint: str) -> float:
    """``v`` unless it is infinite or NaN (a float field's bounds let ``inf`` through)."""
    if not math.isfinite(v):
        raise ValueError(f"{field}={v} is not allowed: give a finite number ({hint})")
    return v


class WeightFormat(str, Enum):
    """Storage formats for weights (``none`` keeps the training dtype)."""

    # none, then one member per row of the format table (deepspeed_ppq.formats.FORMATS), named as the row
    _ignore_ = ["_spec"]
    none = "none"
    for _spec in FORMATS:
        vars()[_spec.name] = _spec.name

    @property
    def bits(self) -> int:
        """Bits per stored value (32 for ``none``: the training dtype counted as fp32)."""
        return 32 if self.value == "none" else format_spec(self.value).bits


class PrecisionRule(_Model):
    """One rule of the precision policy; the first rule that matches a module wins.

    ``pattern`` matches the module's dotted name (``glob`` by default, or ``regex``);
    ``module_type`` (a class name such as ``"Linear"``), when given, must match as well.
    """

    pattern: str = "*"
    match: Literal["glob", "regex"] = "glob"
    module_type: str | None = None
    format: WeightFormat

    @model_validator(mode="after")
    def _regex_compiles(self) -> PrecisionRule:
        if self.match == "regex":
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ValueError(f"pattern={self.pattern!r} is not a regular expression ({err}); fix the "
                                 "pattern or use match='glob'") from None
        return self


class WeightsConfig(_Model):
    """Low-bit weight storage for the stage's Linear layers, under a precision policy."""

    format: WeightFormat = WeightFormat.none
    block_size: int = Field(64, description="values per scale; a power of two in [16, 4096]")
    scale_dtype: Literal["fp32", "bf16"] = "fp32"
    double_quant: bool = Field(False, description="quantize the block scales to int8 as well")
    fp8_scale: Literal["block", "tensor"] = "block"
    mode: Literal["train", "frozen"] = Field(
        "train", description="train: low-bit compute copy + fp32 master; frozen: low-bit base + LoRA"
    )
    master: Literal["fp32", "none"] = Field(
        "fp32",
        description="train mode: 'fp32' keeps an fp32 master weight; 'none' keeps only the low-bit codes and "
        "updates them with stochastic rounding (int8 and fp8 formats)",
    )
    grad_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="master='none' only: the dtype the weight gradient accumulates in over micro-batches "
        "(bf16: 2 B per value instead of 4; each micro-batch's product is rounded into it once)",
    )
    saved_input: Literal["dense", "int8"] = Field(
        "dense",
        description="train mode: how a low-bit layer keeps its input for the weight gradient between "
        "forward and backward; int8: blockwise int8 codes (1 B per value plus a scale per block_size), "
        "as FP8 training keeps its inputs in FP8",
    )
    lora_rank: int = Field(8, ge=1)
    lora_alpha: float = Field(16.0, gt=0)
    keep_first_blocks: int = Field(1, ge=0, description="first N transformer blocks stay high precision")
    keep_last_blocks: int = Field(1, ge=0, description="last N transformer blocks stay high precision")
    rules: list[PrecisionRule] = Field(default_factory=list, description="checked before the defaults")
    optimizer_8bit: bool = Field(False, description="bitsandbytes 8-bit Adam/AdamW states")

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, v: int) -> int:
        if v < 16 or v > 4096 or v & (v - 1):
            raise ValueError(f"block_size={v} is not allowed: use a power of two in [16, 4096]")
        return v

    @field_validator("lora_alpha")
    @classmethod
    def _lora_alpha(cls, v: float) -> float:
        return _finite(v, "lora_alpha", "the adapters' output is scaled by lora_alpha / lora_rank")

    @model_validator(mode="after")
    def _master_free_needs_8bit(self) -> WeightsConfig:
        if self.grad_dtype != "fp32" and self.master != "none":
            raise ValueError(
                f"grad_dtype={self.grad_dtype!r} is for master-free weights (master='none'); with "
                f"master={self.master!r} the gradient is the parameter's own: use grad_dtype='fp32'"
            )
        if self.saved_input != "dense" and self.mode != "train":
            raise ValueError(
                f"saved_input={self.saved_input!r} is a train-mode option (got mode={self.mode!r}): a frozen "
                "base computes no weight gradient and keeps no input for one"
            )
        if self.master == "none":
            if self.mode != "train":
                raise ValueError(f"master='none' is a train-mode option (got mode={self.mode!r})")
            bad = [f for f in [self.format, *(r.format for r in self.rules)]
                   if f != WeightFormat.none and not format_spec(f).master_free]
            if bad:
                allowed = ", ".join(MASTER_FREE_FORMATS)
                raise ValueError(
                    f"master='none' needs 8-bit codes ({allowed}), got {bad[0].value!r}: "
                    "a 4-bit grid loses most updates even with stochastic rounding; use master='fp32'"
                )
        return self


# The CodecConfig fields each method reads besides ``method``; it ignores the others.
_CODEC_FIELDS = {
    "none": (),
    "quant": ("bits", "granularity", "group_size", "error_feedback", "compress_eval"),
    "fp8": ("granularity", "group_size", "fp8_format", "error_feedback", "compress_eval"),
    "topk": ("topk_ratio", "reuse_indices", "error_feedback", "compress_eval"),
}


class CodecConfig(_Model):
    """How one direction of stage-to-stage traffic is compressed.

    ``method``: ``none``; ``quant`` (k-bit min-max, densely packed); ``fp8`` (per-``granularity``
    scale); ``topk`` (per sample, ``topk_ratio`` of each sample's elements).
    """

    method: Literal["none", "quant", "fp8", "topk"] = "none"
    bits: Literal[2, 4, 6, 8] = 8
    granularity: Literal["sample", "token", "group"] = Field(
        "token", description="one scale per sample, per token (row) or per group of channels"
    )
    group_size: int = Field(128, ge=8)
    fp8_format: Literal["e4m3", "e5m2"] = "e4m3"
    topk_ratio: float = Field(0.3, description="fraction of each sample's elements kept, in (0, 1]")
    reuse_indices: bool = Field(True, description="gradients only: reuse the activation's TopK indices")
    error_feedback: Literal["none", "ef", "ef21", "ef_mixed"] = "none"
    compress_eval: bool | None = Field(None, description="None: on for topk and for <= 4 bits")

    @field_validator("topk_ratio")
    @classmethod
    def _ratio(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"topk_ratio={v} is outside (0, 1]: give the fraction of elements to keep")
        return v

    @model_validator(mode="after")
    def _feedback_fits_method(self) -> CodecConfig:
        if self.error_feedback == "ef_mixed" and self.method != "topk":
            raise ValueError(
                f"error_feedback='ef_mixed' needs method='topk' (got method={self.method!r}): it splits "
                f"TopK's K between the input and the error buffer; use 'ef' or 'ef21' with {self.method!r}"
            )
        if self.error_feedback != "none" and self.method == "none":
            raise ValueError(
                f"error_feedback={self.error_feedback!r} needs a compressing method (got method='none')"
            )
        return self

    def direction_problem(self, direction: str) -> str | None:
        """What of this codec the ``direction`` it is used for would ignore, or None.

        Only a gradient reuses the activation's TopK indices, and an evaluation sends no gradients, so
        ``reuse_indices=false`` on activations and any ``compress_eval`` on gradients would be accepted and
        ignored; both are refused instead."""
        if direction == "activations" and not self.reuse_indices:
            return ("reuse_indices=false has no effect on activations: only a gradient reuses the "
                    "activation's TopK indices; drop it (gradients.reuse_indices decides)")
        if direction == "gradients" and self.compress_eval is not None:
            return (f"compress_eval={self.compress_eval} has no effect on gradients: an evaluation sends no "
                    "gradients; drop it (activations.compress_eval decides what an evaluation sends)")
        return None

    @model_validator(mode="after")
    def _method_reads_every_field(self) -> CodecConfig:
        """Refuse a field set to other than its default that the method does not read (``bits`` with
        ``fp8``, ``fp8_format`` with ``quant``, ...), or ``group_size`` without ``granularity='group'``.
        A field at its default is fine, left out or written (a full ``model_dump`` writes every field)."""
        reads = _CODEC_FIELDS[self.method]
        fields = type(self).model_fields
        ignored = [f for f, field in fields.items()
                   if f != "method" and f not in reads and getattr(self, f) != field.default]
        if ignored:
            shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in ignored)
            uses = f"it reads only {', '.join(reads)}" if reads else "it sends tensors as they are"
            them = "it" if len(ignored) == 1 else "them"
            raise ValueError(f"method={self.method!r} ignores {shown}: {uses}; drop {them} or change the "
                             "method")
        if self.group_size != fields["group_size"].default and self.granularity != "group":
            raise ValueError(f"group_size={self.group_size} has no effect with "
                             f"granularity={self.granularity!r}: only granularity='group' uses it; drop it "
                             "or set granularity='group'")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def eval_compressed(self) -> bool:
        if self.compress_eval is not None:
            return self.compress_eval and self.enabled
        return self.method == "topk" or (self.method == "quant" and self.bits <= 4)


class AQSGDConfig(_Model):
    """AQ-SGD for activations: per-sample buffers keyed by the sample's index in the dataset."""

    enabled: bool = False
    storage: Literal["memory", "disk"] = "memory"
    path: str | None = Field(None, description="directory for the memory-mapped buffers (storage=disk)")
    num_samples: int | None = Field(None, ge=1, description="dataset size; needed for storage=disk")
    warmup_steps: int = Field(
        0, ge=0,
        description="steps whose activations go through uncompressed while the per-sample buffers fill "
        "(activations only: gradients stay compressed; ppq.warmup_steps turns off both)",
    )


class PartitionConfig(_Model):
    """Stage boundaries. ``explicit`` takes ``boundaries`` = [0, b1, ..., num_layers]."""

    method: str = Field("parameters", description="parameters | uniform | type:<regex> | explicit")
    boundaries: list[int] | None = None

    @model_validator(mode="after")
    def _check(self) -> PartitionConfig:
        m = self.method
        if m not in ("parameters", "uniform", "explicit") and not m.startswith("type:"):
            raise ValueError(
                f"method={m!r} is not a partition method: use parameters, uniform, type:<regex> or explicit"
            )
        if m.startswith("type:"):
            try:
                re.compile(m[len("type:"):])
            except re.error as err:
                raise ValueError(f"method={m!r}: {m[len('type:'):]!r} is not a regular expression ({err}); "
                                 "give a class-name pattern such as 'type:Block|Layer'") from None
        if m == "explicit":
            b = self.boundaries
            if not b or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
                raise ValueError(
                    f"boundaries={b} must be strictly increasing and start at 0, e.g. [0, 5, 10] "
                    "for 10 layers on 2 stages"
                )
        elif self.boundaries is not None:
            raise ValueError(f"boundaries are only used with method='explicit' (method={m!r})")
        return self


_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(value: int | float | str, field: str = "memory_budget") -> int:
    """Bytes from an int (bytes) or a string with a unit (``"512MiB"``, ``"24 GiB"``, ``"1e6"``).

    Raises:
        ValueError: naming ``field``, the value and the units allowed.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field}={value!r}: give bytes (an int) or a size such as '512MiB'")
    if isinstance(value, (int, float)):
        n = value  # an int stays exact: float() of a huge one overflows
    else:
        text = str(value).strip().lower().replace(" ", "")
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if text.endswith(u)), "")
        try:
            n = float(text[: len(text) - len(unit)]) * _UNITS.get(unit, 1)
        except ValueError:
            n = -1.0
        if n < 0 or not text:
            raise ValueError(
                f"{field}={value!r} is not a size: give bytes or a number with one of the units "
                f"{', '.join(('B', 'KiB', 'MiB', 'GiB', 'KB', 'MB', 'GB'))}, e.g. '512MiB'"
            )
    if isinstance(n, float) and not math.isfinite(n):
        raise ValueError(f"{field}={value!r} is not a finite size: give bytes or a size such as '512MiB'")
    if not n >= 1:  # int() would make a fraction of a byte 0
        raise ValueError(f"{field}={value!r} must be positive and at least 1 byte (got {n} bytes)")
    return int(n)


class AutotuneConfig(_Model):
    """The autotuner's settings: what it may change, the limits it must respect, how long it measures.

    One config for every entry point: the ``"ppq"."autotune"`` section of a DeepSpeed JSON,
    ``deepspeed_ppq.autotune(..., config)`` and ``ppq tune`` (whose flags are generated from these
    fields). Memory is in bytes (a string with a unit, ``"512MiB"``, is accepted); reports print MiB.
    """

    memory_budget: int | None = Field(
        None, description="per-stage memory budget in bytes (or a size such as '512MiB'); it binds on "
        "each stage's measured peak; None: unlimited")
    memory_tolerance: float = Field(
        0.05, ge=0, le=1, description="a plan's measured per-stage peak may exceed the budget by this "
        "fraction (the same for the baseline and the tuned plan)")
    val_loss_tolerance: float = Field(
        0.01, ge=0, description="relative validation-loss slack of a plan over the baseline's mean")
    seeds: int = Field(3, ge=1, description="baseline runs (seeds) that measure validation-loss noise")
    quality_steps: int = Field(
        40, ge=1, description="optimizer steps of each quality run (the baseline's seeds and each plan's "
        "check): long enough that the seeds' spread of validation loss is below the tolerance")
    max_iterations: int = Field(3, ge=1, description="plans tried after the baseline before giving up")
    trial_steps: int = Field(10, ge=2, description="optimizer steps per trial run")
    warmup_steps: int = Field(2, ge=1, description="trial steps left out of the timing")
    val_batches: int = Field(4, ge=1, description="validation steps (of the plan's global batch) per trial")
    val_samples: int = Field(
        64, ge=1, description="samples held out of the training data for validation when none is given")
    micro_batch_sizes: list[int] | None = Field(
        None, description="candidate micro-batch sizes; None: every divisor of the global batch up to 16")
    schedules: list[Literal["1f1b"]] = Field(
        default_factory=lambda: ["1f1b"], description="schedules the engine can run (DeepSpeed: 1f1b)")
    allow_recompute: bool = True
    min_gradient_bits: Literal[2, 4, 6, 8] = 8
    min_activation_bits: Literal[2, 4, 6, 8] = 4
    profile_cache: str | None = Field(None, description="JSON file to keep the profile in between runs")
    profile_reps: int = Field(5, ge=1, description="timed repetitions per layer in the profile")
    formats: list[WeightFormat] = Field(
        default_factory=lambda: [WeightFormat.int8],
        description="low-bit weight formats the planner may use where the precision policy allows",
    )
    master_free: bool = Field(
        True, description="the planner may choose weights.master='none' for 8-bit formats (low-bit "
        "weights with an fp32 master hold more, not less, than training-dtype weights)")
    master_free_grad_dtype: Literal["fp32", "bf16"] = Field(
        "bf16", description="weights.grad_dtype of the master-free plans the planner makes: the dtype "
        "their weight gradients accumulate in (bf16: 2 B per value instead of 4); the quality gate "
        "checks the plan as it runs")
    activation_codecs: list[CodecConfig] = Field(
        default_factory=lambda: [CodecConfig()],
        description="candidate activation codecs (bits >= the minimum)",
    )
    gradient_codecs: list[CodecConfig] = Field(
        default_factory=lambda: [CodecConfig()],
        description="candidate gradient codecs (bits >= the minimum)",
    )
    pipeline_degrees: list[int] | None = Field(
        None, description="candidate stage counts; None: every divisor of the world size"
    )
    optimizer_8bit: bool = Field(True, description="the planner may choose 8-bit Adam states")
    global_batch: int | None = Field(
        None, ge=1, description="samples per optimizer step; None: the DeepSpeed config's train_batch_size"
    )
    stock_trials: int = Field(
        3, ge=1, description="stock DeepSpeed configurations measured at least (best predicted first, the "
        "models refitted after each)")
    stock_margin: float = Field(
        0.15, ge=0.0, description="after stock_trials that fit, keep measuring stock configurations while "
        "the next is predicted within this fraction of the best measured (at most 4 x stock_trials; 0: "
        "exactly stock_trials)")
    ab_repeats: int = Field(
        2, ge=0, description="alternating baseline/plan runs after acceptance; the speedup is the ratio of "
        "their medians (0: the first measurements, taken at different times). The stock configurations "
        "measured within stock_margin of the fastest are timed as many more times, alternating, before the "
        "fastest median becomes the baseline")
    ladder: bool = Field(
        False, description="after acceptance, measure the rungs from the stock configuration to the plan "
        "one feature at a time (low-bit weights, fill, re-balanced boundaries, codecs)")
    out_dir: str = Field("ppq_tune", description="where plan.json, report.md and tune.json go")

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _bytes(cls, v):
        return None if v is None else parse_bytes(v)

    @field_validator("val_loss_tolerance", "stock_margin")
    @classmethod
    def _finite_fraction(cls, v: float, info) -> float:
        return _finite(v, info.field_name, "a fraction, e.g. 0.05 for 5%")

    @field_validator("micro_batch_sizes", "pipeline_degrees")
    @classmethod
    def _positive_list(cls, v):
        if v is not None and (not v or any(x < 1 for x in v)):
            raise ValueError(f"{v} must be a non-empty list of positive integers, e.g. [1, 2, 4]")
        return v

    @field_validator("activation_codecs", "gradient_codecs")
    @classmethod
    def _codecs_fit_direction(cls, codecs: list[CodecConfig], info) -> list[CodecConfig]:
        direction = "activations" if info.field_name == "activation_codecs" else "gradients"
        for i, codec in enumerate(codecs):
            problem = codec.direction_problem(direction)
            if problem:
                raise ValueError(f"candidate {i}: {problem}")
        return codecs

    @model_validator(mode="after")
    def _steps(self) -> AutotuneConfig:
        if self.warmup_steps >= self.trial_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must be below trial_steps={self.trial_steps}: "
                "the steps after the warm-up are the ones timed")
        return self


class PPQConfig(_Model):
    """The whole ``"ppq"`` section."""

    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    activations: CodecConfig = Field(default_factory=CodecConfig)
    gradients: CodecConfig = Field(default_factory=CodecConfig)
    aqsgd: AQSGDConfig = Field(default_factory=AQSGDConfig)
    warmup_steps: int = Field(0, ge=0, description="uncompressed steps before compression starts")
    nonfinite: Literal["error", "skip"] = Field(
        "error", description="NaN/Inf in a tensor to compress: stop with an error, or skip the step"
    )
    watchdog_timeout_s: float = Field(
        300.0, ge=0, description="a pipeline stage that makes no progress for this long (or 20x its "
        "longest step, if more) stops with an error naming the stage it waits on; 0: off")
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    autotune: AutotuneConfig = Field(default_factory=AutotuneConfig)
    plan_file: str | None = None

    @field_validator("watchdog_timeout_s")
    @classmethod
    def _finite_timeout(cls, v: float) -> float:
        return _finite(v, "watchdog_timeout_s", "seconds; 0 turns the watchdog off")

    @field_validator("activations", "gradients")
    @classmethod
    def _codec_fits_direction(cls, codec: CodecConfig, info) -> CodecConfig:
        problem = codec.direction_problem(info.field_name)
        if problem:
            raise ValueError(problem)
        return codec

    @model_validator(mode="after")
    def _cross_checks(self) -> PPQConfig:
        a, g = self.activations, self.gradients
        if g.method == "topk" and g.reuse_indices and a.method != "topk":
            raise ValueError(
                "gradients.reuse_indices=true needs activations.method='topk' "
                f"(got activations.method={a.method!r}); set gradients.reuse_indices=false"
            )
        if self.aqsgd.enabled and a.method == "none":
            raise ValueError("aqsgd.enabled=true needs a compressing activations.method (quant, fp8 or topk)")
        if self.aqsgd.enabled and a.error_feedback != "none":
            raise ValueError(
                f"aqsgd.enabled=true replaces error feedback: set activations.error_feedback='none' "
                f"(got {a.error_feedback!r})"
            )
        if self.aqsgd.storage == "disk" and self.aqsgd.enabled and not (
            self.aqsgd.path and self.aqsgd.num_samples
        ):
            raise ValueError("aqsgd.storage='disk' needs aqsgd.path and aqsgd.num_samples")
        return self


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The valid field names of the sub-model that ``loc`` (minus its last part) points into."""
    cur: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(cur, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        cands = [ann, *args]
        cur = next((c for c in cands if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if cur is None:
            return []
    return list(getattr(cur, "model_fields", {}))


def _format_error(err: ValidationError, root: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        dotted = ".".join([root, *(str(p) for p in loc)])
        if e["type"] == "extra_forbidden":
            allowed = _fields_at(PPQConfig, loc)
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"{dotted}: unknown key{hint} (allowed: {', '.join(allowed)})")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            value = e.get("input")
            # A model-level check already names its fields and values in the message.
            lines.append(f"{dotted}: {msg}" if isinstance(value, dict) else f"{dotted}={value!r}: {msg}")
    return "invalid ppq config:\n  " + "\n  ".join(lines)


def load_ppq_config(source: PPQConfig | dict | str | None, root: str = "ppq") -> PPQConfig:
    """Build a ``PPQConfig`` from a dict, a JSON file path, a whole DeepSpeed config or ``None``.

    A dict with a top-level ``"ppq"`` key (a whole DeepSpeed config) is unwrapped.

    Raises:
        PPQConfigError: naming each bad field, its value and what is allowed.
    """
    if isinstance(source, PPQConfig):
        return source
    if source is None:
        return PPQConfig()
    if isinstance(source, str):
        with open(source) as f:
            source = json.load(f)
    if not isinstance(source, dict):
        raise PPQConfigError(f"{root}: expected a JSON object, got {type(source).__name__}")
    if "ppq" in source and isinstance(source["ppq"], dict):
        source = source["ppq"]
    try:
        return PPQConfig.model_validate(source)
    except ValidationError as err:
        raise PPQConfigError(_format_error(err, root)) from None


def ppq_json_schema() -> dict:
    """The JSON Schema of the ``"ppq"`` section (exported to ``configs/ppq.schema.json``)."""
    return PPQConfig.model_json_schema()


def add_schema_parser(sub) -> None:
    """``ppq schema``: print ``ppq_json_schema()`` (``sub``: the ``ppq`` command's subparsers)."""
    p = sub.add_parser("schema", help="print the JSON Schema of the \"ppq\" config section")
    p.set_defaults(func=lambda a: print(json.dumps(ppq_json_schema(), indent=2)) or 0)


if __name__ == "__main__":
    json.dump(ppq_json_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")
