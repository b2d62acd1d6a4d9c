"""The autotuner's output: a plan, pure data with a versioned JSON schema.

A plan says how to run one model on one world size: pipeline degree and stage boundaries, micro-batch
size and count, the schedule, each layer's weight format, the codecs on the stage boundaries,
activation recomputation per stage, and what the planner predicts (step time, bubble, memory per
stage by category). It renders itself as the ``"ppq"`` + DeepSpeed settings that carry it out and as
the equivalent Megatron flags. Carrying it out is ``loop.py``'s job; this file only describes.

A plan records the fingerprint of the model it was made for (``model_fingerprint``: layer count, layer
classes, parameter shapes), the intra-op threads per rank its times were measured with
(``threads_per_rank``) and, once a trial ran it, its measured step time and per-stage peak memory;
``check_model`` refuses a plan for another model.

Schema versions: ``PLAN_SCHEMA_VERSION`` changes whenever a field changes meaning or is removed;
``Plan.from_dict`` refuses any other version with a message that names both (2: the model
fingerprint and the measured step time and memory).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deepspeed_ppq.formats import FORMATS
from deepspeed_ppq.memory_categories import PLAN_LEGACY_NAMES, canonical

__all__ = ["PLAN_SCHEMA_VERSION", "PlanError", "StagePlan", "Plan", "load_plan", "recomputes"]

PLAN_SCHEMA_VERSION = 2


def recomputes(last: int, recompute: bool, keep_last: int, i: int) -> bool:
    """Whether layer ``i`` of a stage ending at ``last`` is recomputed: the stage recomputes and ``i``
    is not among its last ``keep_last`` layers (the one rule for the planner, the plan and the runtime)."""
    return recompute and i < last - keep_last


class PlanError(ValueError):
    """A plan file that cannot be used (wrong schema version, missing or inconsistent fields)."""


_FORMATS = frozenset({"none"} | {spec.name for spec in FORMATS})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_stage(i: int, s: StagePlan) -> None:
    """Raise ``PlanError`` naming ``stages[i].<field>`` if a stage's fields have the wrong type or range."""
    if len(s.layers) != 2 or not all(_is_int(x) for x in s.layers):
        raise PlanError(f"stages[{i}].layers={list(s.layers)} must be [first, last) as two integers")
    n = s.layers[1] - s.layers[0]
    if not isinstance(s.formats, list) or not all(isinstance(f, str) for f in s.formats):
        raise PlanError(f"stages[{i}].formats={s.formats!r} must be a list of weight format names")
    if len(s.formats) != n:
        raise PlanError(f"stages[{i}].formats: {len(s.formats)} formats for the {n} layers {list(s.layers)}")
    bad = sorted(set(s.formats) - _FORMATS)
    if bad:
        raise PlanError(f"stages[{i}].formats: unknown weight format(s) {bad}; allowed: {sorted(_FORMATS)}")
    if not isinstance(s.recompute, bool):
        raise PlanError(f"stages[{i}].recompute={s.recompute!r} must be true or false")
    if not _is_int(s.keep_last) or not 0 <= s.keep_last <= n:
        raise PlanError(f"stages[{i}].keep_last={s.keep_last!r} must be an integer from 0 to the stage's "
                        f"{n} layers")


@dataclass
class StagePlan:
    """One pipeline stage of a plan.

    Attributes:
        layers: ``[first, last)`` layer indices the stage holds.
        formats: weight format of each of those layers (``"none"`` keeps the training dtype).
        recompute: activation recomputation (checkpoint every layer of the stage but the last
            ``keep_last``).
        keep_last: with ``recompute``, the stage's last ``keep_last`` layers keep their activations
            (partial recomputation, Megatron's ``--recompute-method block``); 0: every layer recomputes.
        time_per_microbatch: predicted forward + backward (+ recompute, codec, sends) seconds.
        memory: predicted peak bytes by memory category (``deepspeed_ppq.memory_categories``: weights,
            master_weights, gradients, optimizer, activations, comm_buffers, temporaries); a plan file's
            older names (master, buffers) are read as these.
    """

    layers: tuple[int, int]
    formats: list[str]
    recompute: bool = False
    time_per_microbatch: float = 0.0
    memory: dict[str, int] = field(default_factory=dict)
    keep_last: int = 0

    def __post_init__(self) -> None:
        self.memory = canonical(self.memory, PLAN_LEGACY_NAMES)

    def recomputes(self, i: int) -> bool:
        """Whether global layer ``i`` of this stage is recomputed (if the layer can be)."""
        return recomputes(self.layers[1], self.recompute, self.keep_last, i)

    @property
    def recompute_label(self) -> str:
        """``off``, ``on`` or ``on, last N kept`` (for reports)."""
        return "off" if not self.recompute else f"on, last {self.keep_last} kept" if self.keep_last else "on"

    @property
    def peak_memory(self) -> int:
        return sum(self.memory.values())


@dataclass
class Plan:
    """A complete pipeline plan (see the module docstring)."""

    world_size: int
    pipeline_degree: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    stages: list[StagePlan]
    layer_names: list[str]
    activation_codec: dict[str, Any] = field(default_factory=lambda: {"method": "none"})
    gradient_codec: dict[str, Any] = field(default_factory=lambda: {"method": "none"})
    optimizer_8bit: bool = False
    master_free: bool = False
    master_free_grad_dtype: str = "fp32"
    block_size: int = 64
    predicted_step_time: float = 0.0
    predicted_bubble_fraction: float = 0.0
    memory_budget: int | None = None
    linear_formats: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    model_fingerprint: dict[str, Any] = field(default_factory=dict)
    measured_step_time: float | None = None
    measured_memory: list[dict[str, int]] = field(default_factory=list)
    threads_per_rank: int | None = None
    schema_version: int = PLAN_SCHEMA_VERSION

    # ----- derived -------------------------------------------------------------------------------
    @property
    def data_parallel(self) -> int:
        return self.world_size // self.pipeline_degree

    @property
    def recompute_label(self) -> str:
        """Each stage's ``recompute_label``, ``/``-separated (for reports and logs)."""
        return "/".join(sp.recompute_label for sp in self.stages)

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.data_parallel

    @property
    def boundaries(self) -> list[int]:
        """``[0, b1, ..., num_layers]``, DeepSpeed's ``parts``."""
        return [s.layers[0] for s in self.stages] + [self.stages[-1].layers[1]]

    @property
    def layer_formats(self) -> list[str]:
        return [f for s in self.stages for f in s.formats]

    @property
    def samples_per_second(self) -> float:
        return self.global_batch / self.predicted_step_time if self.predicted_step_time > 0 else 0.0

    def check(self) -> None:
        """Raise ``PlanError`` if the plan is internally inconsistent."""
        for name in ("world_size", "pipeline_degree", "micro_batch_size", "num_microbatches", "block_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise PlanError(f"{name}={v!r} must be a positive integer")
        threads = self.threads_per_rank
        if threads is not None and (not _is_int(threads) or threads < 1):
            raise PlanError(f"threads_per_rank={threads!r} must be a positive integer or null")
        if self.world_size % self.pipeline_degree:
            raise PlanError(
                f"pipeline_degree={self.pipeline_degree} does not divide world_size={self.world_size}"
            )
        if len(self.stages) != self.pipeline_degree:
            raise PlanError(f"{len(self.stages)} stages for pipeline_degree={self.pipeline_degree}")
        for i, s in enumerate(self.stages):
            _check_stage(i, s)
        b = self.boundaries
        if b[0] != 0 or b[-1] != len(self.layer_names) or any(x >= y for x, y in zip(b, b[1:])):
            raise PlanError(f"boundaries {b} must increase strictly from 0 to {len(self.layer_names)}")
        for i, s in enumerate(self.stages):
            if i and s.layers[0] != self.stages[i - 1].layers[1]:
                raise PlanError(f"stages[{i}].layers={list(s.layers)} must start where stage {i - 1} ends "
                                f"({self.stages[i - 1].layers[1]}): stages hold consecutive layers")
        if not isinstance(self.linear_formats, dict):
            raise PlanError(f"linear_formats={self.linear_formats!r} must map Linear names to formats")
        bad = {n: f for n, f in self.linear_formats.items() if f not in _FORMATS}
        if bad:
            raise PlanError(f"linear_formats={bad}: unknown weight format(s); allowed: {sorted(_FORMATS)}")
        if not isinstance(self.model_fingerprint, dict):
            raise PlanError(f"model_fingerprint={self.model_fingerprint!r} must be an object")

    def check_model(self, fingerprint: dict[str, Any], source: str = "the plan") -> None:
        """Raise ``PlanError`` unless the plan was made for the model with this ``fingerprint``."""
        mine = self.model_fingerprint
        if not mine:
            raise PlanError(f"{source} records no model fingerprint: re-run `ppq tune` to write one")
        if mine.get("digest") == fingerprint.get("digest"):
            return
        diffs = []
        if mine.get("num_layers") != fingerprint.get("num_layers"):
            diffs.append(f"{mine.get('num_layers')} layers in the plan, {fingerprint.get('num_layers')} "
                         "in the model")
        for i, (a, b) in enumerate(zip(mine.get("layers", []), fingerprint.get("layers", []))):
            if a != b:
                diffs.append(f"layer {i} is {a} in the plan, {b} in the model")
                break
        raise PlanError(
            f"{source} was made for another model ({'; '.join(diffs) or 'parameter shapes differ'}): "
            "re-run `ppq tune` on this model")

    # ----- rendering -----------------------------------------------------------------------------
    def precision_rules(self) -> list[dict[str, str]]:
        """``weights.rules`` for the ``"ppq"`` section, in DeepSpeed ``PipelineModule`` names.

        With ``linear_formats`` (filled by the tuning loop from the policy's decisions): one exact
        rule per low-bit Linear, then ``"*" -> none`` so the policy's defaults cannot add others.
        Without: one rule per layer (``"<layer index>.*"``)."""
        if self.linear_formats:
            rules = [{"pattern": n, "format": f} for n, f in sorted(self.linear_formats.items())]
            return rules + [{"pattern": "*", "format": "none"}]
        return [{"pattern": f"{i}.*", "format": f} for i, f in enumerate(self.layer_formats)]

    def ppq_section(self) -> dict[str, Any]:
        """The ``"ppq"`` config section that carries this plan out."""
        fmts = {f for f in self.layer_formats if f != "none"}
        return {
            "weights": {
                "format": sorted(fmts)[0] if fmts else "none",
                "block_size": self.block_size,
                "keep_first_blocks": 0,
                "keep_last_blocks": 0,
                "master": "none" if self.master_free else "fp32",
                "grad_dtype": self.master_free_grad_dtype if self.master_free else "fp32",
                "rules": self.precision_rules(),
                "optimizer_8bit": self.optimizer_8bit,
            },
            "activations": dict(self.activation_codec),
            "gradients": dict(self.gradient_codec),
            "partition": {"method": "explicit", "boundaries": self.boundaries},
        }

    def deepspeed_config(self) -> dict[str, Any]:
        """DeepSpeed settings: batch sizes, activation checkpointing and the ``"ppq"`` section.

        DeepSpeed checkpoints all stages alike (``activation_checkpoint_interval`` is one number for
        the module), so per-stage recomputation is given in ``pipeline.recompute_stages`` for the plugin,
        or, when a stage keeps its last layers' activations, the recomputed layers in
        ``pipeline.recompute_layers`` (global indices; embeddings are never checkpointed)."""
        cfg = {
            "train_batch_size": self.global_batch,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.num_microbatches,
            "pipeline": {"activation_checkpoint_interval": 1 if any(s.recompute for s in self.stages) else 0},
            "ppq": self.ppq_section(),
        }
        if any(s.recompute and s.keep_last for s in self.stages):
            cfg["pipeline"]["recompute_layers"] = [
                i for s in self.stages for i in range(*s.layers) if s.recomputes(i)]
        else:
            cfg["pipeline"]["recompute_stages"] = [i for i, s in enumerate(self.stages) if s.recompute]
        return cfg

    def megatron_flags(self, layer_kinds: list[str] | None = None) -> list[str]:
        """The equivalent Megatron-LM flags.

        Args:
            layer_kinds: ``"embed"``, ``"block"`` or ``"head"`` per layer (default: first is the
                embedding, last the head, the rest blocks). Gives ``--pipeline-model-parallel-layout``
                with ``E`` (embedding), ``t`` (transformer layer) and ``L`` (loss/head) per stage.
        """
        kinds = layer_kinds or (["embed"] + ["block"] * (len(self.layer_names) - 2) + ["head"])
        sym = {"embed": "E", "block": "t", "head": "L"}
        layout = "|".join("".join(sym.get(kinds[i], "t") for i in range(*s.layers)) for s in self.stages)
        flags = [
            f"--pipeline-model-parallel-size {self.pipeline_degree}",
            f"--pipeline-model-parallel-layout {layout}",
            f"--micro-batch-size {self.micro_batch_size}",
            f"--global-batch-size {self.global_batch}",
        ]
        if any(s.recompute and s.keep_last for s in self.stages):
            # block: the first N layers of every stage recompute (one N for all: the most any stage does)
            n = max(sum(s.recomputes(i) for i in range(*s.layers)) for s in self.stages)
            flags.append(f"--recompute-granularity full --recompute-method block --recompute-num-layers {n}")
        elif any(s.recompute for s in self.stages):
            flags.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
        fp8 = sorted({f for f in self.layer_formats if f.startswith("fp8")})
        if fp8:
            flags += ["--fp8-format " + ("e4m3" if fp8 == ["fp8_e4m3"] else "hybrid"), "--fp8-param-gather"]
        return flags

    # ----- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["derived"] = {
            "boundaries": self.boundaries,
            "global_batch": self.global_batch,
            "data_parallel": self.data_parallel,
            "samples_per_second": self.samples_per_second,
            "deepspeed": self.deepspeed_config(),
            "megatron_flags": self.megatron_flags(),
        }
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        version = d.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise PlanError(
                f"plan schema_version={version!r} is not supported: this deepspeed_ppq reads version "
                f"{PLAN_SCHEMA_VERSION}; re-run `ppq tune` to write a current plan"
            )
        d = {k: v for k, v in d.items() if k != "derived"}
        stages = d.pop("stages", None)
        if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages):
            raise PlanError(f"stages={stages!r} must be a list of stage objects")
        for i, s in enumerate(stages):
            if not isinstance(s.get("memory", {}), dict):
                raise PlanError(f"stages[{i}].memory={s['memory']!r} must be an object of bytes by category")
        try:
            stages = [StagePlan(**{**s, "layers": tuple(s["layers"])}) for s in stages]
            plan = cls(stages=stages, **d)
        except (TypeError, KeyError, ValueError) as e:
            raise PlanError(f"plan file does not match schema version {PLAN_SCHEMA_VERSION}: {e}") from None
        plan.check()
        return plan

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def load_plan(path: str | Path) -> Plan:
    """Read a plan JSON file written by ``Plan.save``.

    Raises:
        PlanError: naming the file: it is missing, not JSON, of another schema version, or does not
            match the schema.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise PlanError(f"plan file {p} does not exist: run `ppq tune` to write one") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"plan file {p} is not valid JSON ({e}): it may be truncated; re-run `ppq tune`"
                        ) from None
    if not isinstance(data, dict):
        raise PlanError(f"plan file {p} holds a {type(data).__name__}, not a plan object")
    try:
        return Plan.from_dict(data)
    except PlanError as e:
        raise PlanError(f"plan file {p}: {e}") from None
