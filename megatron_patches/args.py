"""``--ppq-*`` command-line flags for Megatron, generated from the typed ``PPQConfig``.

The flags are not written by hand: :func:`add_ppq_args` walks ``deepspeed_ppq.config.PPQConfig``,
so the JSON section, the Megatron flags and the CLI cannot drift apart. Nested models become
prefixes (``weights.format`` -> ``--ppq-weights-format``); enums and literals become ``choices``;
booleans get ``--ppq-x`` / ``--no-ppq-x``; lists (``weights.rules``, ``partition.boundaries``) are
JSON strings. ``--ppq-config FILE`` loads a whole ``"ppq"`` section first; flags given on the command
line override it. A flag left out keeps the config's default.

Usage as Megatron-LM's ``extra_args_provider``::

    from megatron_patches import add_ppq_args
    pretrain(..., extra_args_provider=add_ppq_args)

Then ``args_to_ppq_config(args)`` gives back a validated ``PPQConfig``, and
``check_megatron_compatible(cfg, args)`` rejects what Megatron's pipeline cannot carry.
"""

from __future__ import annotations

import argparse
import enum
import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter

from deepspeed_ppq.config import PPQConfig, PPQConfigError, load_ppq_config

__all__ = ["PPQFlag", "ppq_flags", "add_ppq_args", "args_to_ppq_config", "check_megatron_compatible",
           "interleaving_problems", "partition_layout", "PPQ_GROUP_TITLE"]

PPQ_GROUP_TITLE = "ppq (deepspeed_ppq: low-bit weights and compressed pipeline traffic)"


@dataclass(frozen=True)
class PPQFlag:
    """One generated flag: its option string, argparse ``dest`` and the dotted config path."""

    option: str          # "--ppq-weights-format"
    dest: str            # "ppq_weights_format"
    path: tuple[str, ...]  # ("weights", "format")
    kind: str            # "bool" | "choice" | "scalar" | "json"
    type: Any = None     # converter for scalar/choice flags
    choices: tuple | None = None
    help: str = ""


def _unwrap_optional(ann: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def _walk(model: type[BaseModel], prefix: tuple[str, ...]) -> Iterator[PPQFlag]:
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        ann = _unwrap_optional(field.annotation)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _walk(ann, path)
            continue
        option = "--ppq-" + "-".join(p.replace("_", "-") for p in path)
        dest = "ppq_" + "_".join(path)
        desc = field.description or ""
        default = field.get_default(call_default_factory=True)
        # The field's own serializer turns enums and nested models (lists of codecs) into JSON.
        shown = TypeAdapter(field.annotation).dump_python(default, mode="json")
        help_ = f"{'.'.join(path)}: {desc + '; ' if desc else ''}default {json.dumps(shown)}"
        if ann is bool:
            yield PPQFlag(option, dest, path, "bool", help=help_)
        elif isinstance(ann, type) and issubclass(ann, enum.Enum):
            yield PPQFlag(option, dest, path, "choice", str, tuple(m.value for m in ann), help_)
        elif typing.get_origin(ann) is Literal:
            values = typing.get_args(ann)
            yield PPQFlag(option, dest, path, "choice", type(values[0]), tuple(values), help_)
        elif typing.get_origin(ann) in (list, dict):
            yield PPQFlag(option, dest, path, "json", help=help_ + " (a JSON string)")
        elif ann in (int, float, str):
            yield PPQFlag(option, dest, path, "scalar", ann, help=help_)
        else:  # a new field type in config.py that this walker does not know yet
            raise TypeError(f"megatron_patches.args: no flag type for ppq field {'.'.join(path)} ({ann!r})")


def ppq_flags() -> list[PPQFlag]:
    """Every ``--ppq-*`` flag generated from ``PPQConfig`` (``--ppq-config`` not included)."""
    return list(_walk(PPQConfig, ()))


def _json_arg(option: str):
    def parse(text: str):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{option} expects a JSON string, got {text!r} ({e.msg})") from e
    return parse


def add_ppq_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--ppq-*`` flags to ``parser``; usable as Megatron-LM's ``extra_args_provider``.

    Args:
        parser: the script's argument parser (Megatron's, or any ``argparse`` parser).

    Returns:
        The same parser (Megatron's ``parse_args`` expects it back).
    """
    group = parser.add_argument_group(title=PPQ_GROUP_TITLE)
    group.add_argument("--ppq-config", dest="ppq_config", default=None, metavar="FILE",
                       help="JSON file with a whole \"ppq\" section (or a DeepSpeed config that has one); "
                            "--ppq-* flags override it")
    for f in ppq_flags():
        if f.kind == "bool":
            group.add_argument(f.option, dest=f.dest, default=None, action=argparse.BooleanOptionalAction,
                               help=f.help)
        elif f.kind == "choice":
            group.add_argument(f.option, dest=f.dest, default=None, type=f.type, choices=f.choices,
                               help=f.help)
        elif f.kind == "json":
            group.add_argument(f.option, dest=f.dest, default=None, type=_json_arg(f.option),
                               metavar="JSON", help=f.help)
        else:
            group.add_argument(f.option, dest=f.dest, default=None, type=f.type, help=f.help)
    return parser


def args_to_ppq_config(args: argparse.Namespace) -> PPQConfig:
    """Build the validated ``PPQConfig`` from parsed arguments.

    Starts from ``--ppq-config`` (or the defaults) and sets every ``--ppq-*`` flag that was given.

    Raises:
        PPQConfigError: naming the flag's config field, the value and what is allowed.
    """
    path = getattr(args, "ppq_config", None)
    section: dict = load_ppq_config(path).model_dump(mode="json", exclude_unset=True) if path else {}
    for f in ppq_flags():
        value = getattr(args, f.dest, None)
        if value is None:
            continue
        node = section
        for part in f.path[:-1]:
            node = node.setdefault(part, {})
        node[f.path[-1]] = value
    return load_ppq_config(section, root="ppq (from --ppq-* flags)")


def partition_layout(cfg: PPQConfig, pp_size: int, num_layers: int | None) -> str | None:
    """The ``--pipeline-model-parallel-layout`` that carries out ``cfg.partition`` on Megatron.

    ``explicit`` boundaries ``[0, b1, ..., L]`` become one stage per interval (``E`` the embedding on
    the first stage, ``t`` a transformer layer, ``L`` the loss on the last): ``[0, 1, 4]`` ->
    ``"Et|tttL"``. ``uniform`` is Megatron's own split (no layout). ``parameters`` and ``type:<regex>``
    split a DeepSpeed ``PipelineModule``'s layer list and have no Megatron meaning.

    Args:
        cfg: the validated config; only a ``partition`` that was given (not the default) is read.
        pp_size: ``--pipeline-model-parallel-size``.
        num_layers: ``--num-layers`` (checked against the last boundary when given).

    Returns:
        The layout string, or None when Megatron's default split applies.

    Raises:
        PPQConfigError: a partition Megatron cannot carry, naming the flag and what to use.
    """
    if "partition" not in cfg.model_fields_set:
        return None
    part = cfg.partition
    if part.method == "uniform":
        return None
    if part.method != "explicit":
        raise PPQConfigError(
            f"--ppq-partition-method {part.method}: on Megatron stage boundaries are whole transformer "
            "layers; use --ppq-partition-method explicit --ppq-partition-boundaries '[0, b1, ..., "
            "num_layers]' (one interval per pipeline stage), uniform, or Megatron's own "
            "--pipeline-model-parallel-layout")
    b = part.boundaries
    if len(b) != pp_size + 1:
        raise PPQConfigError(
            f"--ppq-partition-boundaries {json.dumps(b)} gives {len(b) - 1} stages but "
            f"--pipeline-model-parallel-size is {pp_size}: give {pp_size + 1} boundaries")
    if num_layers is not None and b[-1] != num_layers:
        raise PPQConfigError(f"--ppq-partition-boundaries {json.dumps(b)} ends at {b[-1]} but --num-layers "
                             f"is {num_layers}: the last boundary must be {num_layers}")
    stages = ["t" * (hi - lo) for lo, hi in zip(b, b[1:])]
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return "|".join(stages)


def _interleaved(args: argparse.Namespace) -> bool:
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    per_vp = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    return bool((vp and vp > 1) or per_stage or (per_vp and per_vp > 1))


def interleaving_problems(cfg: PPQConfig) -> list[str]:
    """What the interleaved schedule cannot carry, one message each: error feedback and AQ-SGD keep state
    per pipeline boundary, and TopK index reuse matches each gradient to its activation in forward order;
    the interleaved schedule sends several model chunks' traffic through one communicator in an order the
    communicator cannot see. Stateless codecs are fine."""
    problems = []
    for side in ("activations", "gradients"):
        c = getattr(cfg, side)
        if c.enabled and c.error_feedback != "none":
            problems.append(
                f"--ppq-{side}-error-feedback {c.error_feedback}: error feedback keeps state per "
                "pipeline boundary, which the interleaved schedule does not show the communicator; use "
                f"--ppq-{side}-error-feedback none or drop --num-layers-per-virtual-pipeline-stage")
    if cfg.aqsgd.enabled:
        problems.append(
            "--ppq-aqsgd-enabled: AQ-SGD keeps per-sample buffers per pipeline boundary and reads the "
            "sample ids of one data iterator, which the interleaved schedule does not give the communicator; "
            "drop --ppq-aqsgd-enabled or --num-layers-per-virtual-pipeline-stage")
    g = cfg.gradients
    if g.method == "topk" and g.reuse_indices:
        problems.append(
            "--ppq-gradients-reuse-indices: reusing the activation's TopK indices needs gradients in "
            "forward order, which the interleaved schedule does not keep; use "
            "--no-ppq-gradients-reuse-indices or drop --num-layers-per-virtual-pipeline-stage")
    return problems


def check_megatron_compatible(cfg: PPQConfig, args: argparse.Namespace | None = None) -> None:
    """Reject ppq settings that Megatron's pipeline cannot carry, saying what to change.

    - With interleaving (virtual pipeline stages) only stateless codecs: see :func:`interleaving_problems`.
    - AQ-SGD is carried (``megatron_patches.p2p``): each training batch brings its samples' dataset
      indices, ``(inputs, labels, sample_ids)`` or a dict with ``"sample_ids"``.
    - Low-bit weights: with ``--transformer-impl transformer_engine`` only FP8 (e4m3) primary weights
      through TE; the ppq formats need the local layer spec and tensor parallel size 1.
    - ``use_ring_exchange_p2p`` bypasses ``_communicate``'s send/recv and is not supported with a codec.
    - A given ``partition`` must be carried by ``--pipeline-model-parallel-layout`` (see
      :func:`partition_layout`; the launcher adds it).

    Raises:
        PPQConfigError: with the flag to change.
    """
    problems = []
    compressing = cfg.activations.enabled or cfg.gradients.enabled
    if args is not None and _interleaved(args) and compressing:
        problems += interleaving_problems(cfg)
    if args is not None and "partition" in cfg.model_fields_set:
        pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
        try:
            want = partition_layout(cfg, pp, getattr(args, "num_layers", None))
        except PPQConfigError as e:
            problems.append(str(e))
        else:
            have = getattr(args, "pipeline_model_parallel_layout", None)
            if want is not None and isinstance(have, (str, type(None))) and have != want:
                problems.append(
                    f"--ppq-partition-boundaries {json.dumps(cfg.partition.boundaries)} is the layout "
                    f"{want!r} but --pipeline-model-parallel-layout is {have!r}: launch through "
                    f"megatron_patches.run (it adds the layout) or pass "
                    f"--pipeline-model-parallel-layout '{want}'")
    if args is not None and getattr(args, "use_ring_exchange_p2p", False) and compressing:
        problems.append("--use-ring-exchange-p2p bypasses the compressed send/recv; drop it to use "
                        "--ppq-activations-method/--ppq-gradients-method")
    w = cfg.weights
    if args is not None and (w.format.value != "none" or w.rules):
        impl = getattr(args, "transformer_impl", "local")
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        if impl == "transformer_engine":
            if w.format.value != "fp8_e4m3" or w.rules:
                problems.append(
                    f"--ppq-weights-format {w.format.value}"
                    f"{' with --ppq-weights-rules' if w.rules else ''}: with --transformer-impl "
                    "transformer_engine only fp8_e4m3 (FP8 primary weights through Transformer Engine, no "
                    "per-module rules) is possible; add --transformer-impl local for the ppq formats")
        elif tp != 1:
            problems.append(f"--ppq-weights-format {w.format.value}: low-bit ppq layers need "
                            f"--tensor-model-parallel-size 1 (got {tp})")
    if problems:
        raise PPQConfigError("ppq settings that Megatron cannot carry:\n  " + "\n  ".join(problems))
