"""Run an unmodified Megatron-LM training script with deepspeed_ppq::

    python -m megatron_patches.run [--cpu] pretrain_gpt.py <Megatron args> --ppq-activations-method quant ...
    torchrun --nproc-per-node 8 -m megatron_patches.run pretrain_gpt.py ...

What it does, in order:

0. CPU mode (``--cpu``, or automatic when PyTorch sees no GPU): makes the process look to Megatron-LM
   like one CUDA device that is the CPU (``megatron_patches.cpu_shim.enter_cpu_mode``: CUDA checks,
   ``Tensor.cuda()``, streams, fused-kernel build, RNG tracker, memory statistics) and adds
   ``--distributed-backend gloo``, ``--no-persist-layer-norm`` and ``--no-gradient-accumulation-fusion``
   unless given. On a GPU nothing of this happens: the launcher only
   patches.

1. Reads the ``--ppq-*`` flags (and ``--ppq-config``) and the few Megatron flags they interact with,
   validates them (``args_to_ppq_config`` + ``check_megatron_compatible``): bad input stops here,
   before any process group exists, with the flag to change.
2. ``--ppq-plan-file plan.json`` (written by ``ppq tune``): turns the plan into Megatron flags
   (``--pipeline-model-parallel-size``, ``--pipeline-model-parallel-layout``, ``--micro-batch-size``,
   ``--global-batch-size``, recomputation) and per-layer precision rules on Megatron's global layer
   names; a flag the user also gave with another value is an error.
3. ``--ppq-partition-method explicit --ppq-partition-boundaries '[0, 1, 4]'`` becomes
   ``--pipeline-model-parallel-layout Et|tttL`` (``uniform`` is Megatron's own split; ``parameters`` and
   ``type:`` are refused: they split a DeepSpeed layer list).
4. With ``--transformer-impl transformer_engine`` and ``--ppq-weights-format fp8_e4m3``: adds
   megatron-core's own FP8 flags (``--fp8-format``, ``--fp8-recipe``, ``--fp8-param-gather``,
   ``--first-last-layers-bf16`` and the two counts).
5. Installs the patches (compressed P2P, low-bit layers), removes the ``--ppq-*`` flags from
   ``sys.argv`` (the script's parser does not know them) and runs the script with ``runpy`` as
   ``__main__``, with the script's folder first on ``sys.path`` (as ``python script.py`` has it, so
   ``import gpt_builders`` works from anywhere). A script that registers ``add_ppq_args`` itself and
   calls ``apply`` gets the same config through ``PPQ_MEGATRON_CONFIG``. With any ``--ppq-*`` flag the
   compressed-P2P communicator is installed (codec ``none`` sends the tensors themselves) so that:
6. At the end each pipeline rank prints the bytes it sent across its boundaries (raw -> wire, ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path

from deepspeed_ppq.config import PPQConfigError, WeightFormat

from . import CONFIG_ENV, apply, check_honoured_on_megatron
from .args import add_ppq_args, args_to_ppq_config, check_megatron_compatible, partition_layout

__all__ = ["prepare", "plan_to_megatron", "cpu_defaults", "flag_values", "main"]


def _megatron_view(argv: list[str]) -> argparse.Namespace:
    """The Megatron flags the ppq settings interact with (defaults as in Megatron-LM)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--transformer-impl", default="transformer_engine")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    p.add_argument("--use-ring-exchange-p2p", action="store_true")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--pipeline-model-parallel-layout", default=None)
    return p.parse_known_args(argv)[0]


def flag_values(argv: list[str]) -> dict[str, str | None]:
    """The flags of a Megatron command line, as the launcher reads them (``prepare``, ``cpu_defaults``).

    Args:
        argv: the arguments, e.g. ``["--num-layers", "8", "--fp8-param-gather", "--lr=1e-4"]``.

    Returns:
        ``{flag: value}``: the value that follows ``--flag`` or ``--flag=value``; None for a flag followed
        by another flag or by nothing. A flag given twice keeps its last value.
    """
    out: dict[str, str | None] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            if eq:
                out[name] = val
            else:
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                out[name] = nxt if nxt is not None and not nxt.startswith("--") else None
    return out


def plan_to_megatron(plan_path: str) -> tuple[list[str], dict]:
    """Megatron flags and ppq settings that carry out an autotuner plan.

    Returns:
        (flags, ppq overrides): flags such as ``--pipeline-model-parallel-layout Et|tL``; overrides for
        the ppq section (per-layer ``weights.rules`` on ``decoder.layers.<i>.*`` and the codecs).

    Raises:
        PlanError: an unreadable plan or another schema version.
        PPQConfigError: a plan with 8-bit Adam states or master-free weights (DeepSpeed only).
    """
    from deepspeed_ppq.autotune.plan import load_plan

    plan = load_plan(plan_path)
    chosen = {"8-bit Adam states (autotune.optimizer_8bit=false tunes without)": plan.optimizer_8bit,
              "master-free low-bit weights (autotune.master_free=false tunes without)": plan.master_free}
    deepspeed_only = [what for what, used in chosen.items() if used]
    if deepspeed_only:
        raise PPQConfigError(f"--ppq-plan-file {plan_path}: the plan uses {' and '.join(deepspeed_only)}, "
                             "which only the DeepSpeed path carries out; its memory figures would not hold "
                             "on Megatron: tune again without")
    flags = [tok for f in plan.megatron_flags() for tok in f.split()]
    section = plan.ppq_section()
    # The plan's layers are [embedding, block 0, ..., block n-1, head]: block b is Megatron's
    # decoder.layers.b (global numbering), plan layer b + 1.
    formats = plan.layer_formats[1:-1]
    rules = [{"pattern": f"*decoder.layers.{b}.*", "format": f} for b, f in enumerate(formats)]
    weights = {**section["weights"], "rules": rules, "keep_first_blocks": 0, "keep_last_blocks": 0}
    return flags, {"weights": weights, "activations": section["activations"],
                   "gradients": section["gradients"]}


def _merge(argv: list[str], extra: list[str], source: str) -> list[str]:
    """Append ``extra`` flags, refusing ones the user gave with a different value."""
    given = flag_values(argv)
    out, i = list(argv), 0
    while i < len(extra):
        name = extra[i]
        val = extra[i + 1] if i + 1 < len(extra) and not extra[i + 1].startswith("--") else None
        i += 2 if val is not None else 1
        if name in given:
            if given[name] != val:
                raise PPQConfigError(f"{name} {given[name]} on the command line conflicts with {name} {val} "
                                     f"from {source}; drop one of them")
            continue
        out += [name] + ([val] if val is not None else [])
    return out


def _plan_conflicts(given: dict, planned: dict, path: tuple[str, ...]) -> list[str]:
    """The settings in ``given`` (from ``--ppq-*`` flags or ``--ppq-config``) that the plan replaced."""
    out = []
    for key, value in given.items():
        here = (*path, key)
        if isinstance(value, dict) and isinstance(planned.get(key), dict):
            out += _plan_conflicts(value, planned[key], here)
        elif planned.get(key) != value:
            flag = "--ppq-" + "-".join(p.replace("_", "-") for p in here)
            planned_value = json.dumps(planned.get(key))
            out.append(f"{flag} {json.dumps(value)} was given and the plan has {planned_value}")
    return out


def prepare(argv: list[str]) -> tuple[list[str], dict]:
    """Validate the ppq flags of a Megatron command line and compute what to run.

    Args:
        argv: the script's arguments (without the script path).

    Returns:
        (the script's arguments without ``--ppq-*`` and with the added Megatron flags, the validated
        ppq section as a JSON-able dict).

    Raises:
        PPQConfigError: bad or conflicting settings, or a ``--ppq-config`` or ``--ppq-plan-file`` that
            cannot be read, naming the flag to change.
    """
    parser = add_ppq_args(argparse.ArgumentParser(prog="megatron_patches.run", add_help=False,
                                                  allow_abbrev=False))
    ppq_args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if a.startswith(("--ppq", "--no-ppq"))]
    if bad:
        raise PPQConfigError(f"unknown ppq flag(s) {bad}; see `python -m megatron_patches.run --help-ppq`")
    try:
        cfg = args_to_ppq_config(ppq_args)
    except OSError as e:  # only --ppq-config is read here
        raise PPQConfigError(f"--ppq-config {ppq_args.ppq_config}: cannot read it ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PPQConfigError(f"--ppq-config {ppq_args.ppq_config} is not valid JSON ({e})") from None
    if cfg.plan_file:
        from deepspeed_ppq.autotune.plan import PlanError

        try:
            flags, overrides = plan_to_megatron(cfg.plan_file)
        except PlanError as e:  # its message names the file and the fix
            raise PPQConfigError(f"--ppq-plan-file: {e}") from None
        rest = _merge(rest, flags, f"--ppq-plan-file {cfg.plan_file}")
        section = cfg.model_dump(mode="json", exclude_unset=True)
        given = {k: section[k] for k in overrides if k in section}
        section.update(overrides)
        from deepspeed_ppq.config import load_ppq_config

        cfg = load_ppq_config(section, root="ppq (with the plan)")
        conflicts = _plan_conflicts(given, cfg.model_dump(mode="json"), ())
        if conflicts:
            raise PPQConfigError(f"--ppq-plan-file {cfg.plan_file} sets the weights and codecs, but "
                                 + "; ".join(conflicts) + ": drop them or tune again with them")
    view = _megatron_view(rest)
    layout = partition_layout(cfg, view.pipeline_model_parallel_size, view.num_layers)
    if layout is not None:
        rest = _merge(rest, ["--pipeline-model-parallel-layout", layout],
                      f"--ppq-partition-boundaries {json.dumps(cfg.partition.boundaries)}")
        view = _megatron_view(rest)
    check_megatron_compatible(cfg, view)
    check_honoured_on_megatron(cfg)
    if view.transformer_impl == "transformer_engine" and cfg.weights.format == WeightFormat.fp8_e4m3:
        from .layers import te_fp8_settings

        te = te_fp8_settings(cfg.weights)
        flags = ["--fp8-format", te["fp8"], "--fp8-recipe", te["fp8_recipe"], "--fp8-param-gather"]
        if te["first_last_layers_bf16"]:
            flags += ["--first-last-layers-bf16",
                      "--num-layers-at-start-in-bf16", str(te["num_layers_at_start_in_bf16"]),
                      "--num-layers-at-end-in-bf16", str(te["num_layers_at_end_in_bf16"])]
        rest = _merge(rest, flags, "--ppq-weights-format fp8_e4m3")
    # only what was given: apply() re-reads it, and a partition left at its default must stay unset
    return rest, cfg.model_dump(mode="json", exclude_unset=True)


_CPU_OFF = ("--no-persist-layer-norm", "--no-gradient-accumulation-fusion")


def cpu_defaults(argv: list[str]) -> list[str]:
    """The Megatron flags a CPU run needs, added where the user did not give them.

    Raises:
        PPQConfigError: a flag that cannot work on the CPU (``--distributed-backend nccl``).
    """
    given = flag_values(argv)
    backend = given.get("--distributed-backend", "gloo")
    if backend != "gloo":
        raise PPQConfigError(f"--distributed-backend {backend} needs GPUs; CPU mode runs over gloo: "
                             "pass --distributed-backend gloo or drop the flag")
    out = list(argv)
    if "--distributed-backend" not in given:
        out += ["--distributed-backend", "gloo"]
    # Kernels a CPU has no build of (Apex's persistent LayerNorm, the fused weight-gradient GEMM).
    out += [f for f in _CPU_OFF if f not in given]
    return out


def _launcher_flags(argv: list[str]) -> tuple[bool, list[str]]:
    """``--cpu`` before the script path; returns (cpu requested, the rest)."""
    cpu = False
    while argv and argv[0] == "--cpu":
        cpu, argv = True, argv[1:]
    return cpu, argv


def _closing_report() -> None:
    """Per rank: the bytes it sent across each boundary and its low-bit layers (when patched)."""
    rank = os.environ.get("RANK", "0")
    if "megatron_patches.p2p" in sys.modules:
        from .p2p import bytes_on_wire, format_bytes_on_wire

        for line in format_bytes_on_wire(bytes_on_wire()):
            print(f"megatron_patches.run: rank {rank} bytes on the wire, {line}", flush=True)
    if "megatron_patches.layers" in sys.modules:
        from .layers import live_quant_layers

        layers = live_quant_layers()
        formats = ", ".join(sorted({m.format.value for m in layers})) or "-"
        print(f"megatron_patches.run: rank {rank} low-bit layers: {len(layers)} ({formats})", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cpu, argv = _launcher_flags(argv)
    if not argv or argv[0] in ("-h", "--help", "--help-ppq"):
        parser = add_ppq_args(argparse.ArgumentParser(
            prog="python -m megatron_patches.run",
            usage="%(prog)s [--cpu] SCRIPT [Megatron args] [--ppq-* flags]",
            description=__doc__.split("\n\n")[0]))
        parser.print_help()
        raise SystemExit(0 if argv else 2)
    script, script_args = argv[0], argv[1:]
    if not Path(script).is_file():
        raise SystemExit(f"megatron_patches.run: no script {script!r} (give the path to pretrain_gpt.py "
                         "or another Megatron training script)")
    # Before anything imports `megatron`: a Megatron-LM checkout's own megatron/ package (with
    # megatron/training) must win over the pip megatron-core, as it does for `python pretrain_gpt.py`.
    sys.path.insert(0, str(Path(script).resolve().parent))
    import torch

    cpu = cpu or not torch.cuda.is_available()
    try:
        rest, section = prepare(script_args)
        if cpu:
            rest = cpu_defaults(rest)
    except PPQConfigError as e:
        raise SystemExit(f"megatron_patches.run: {e}") from None
    if cpu:
        from .cpu_shim import enter_cpu_mode

        enter_cpu_mode()
    os.environ[CONFIG_ENV] = json.dumps(section)
    cfg = apply(_megatron_view(rest), cfg=section)
    if any(a.startswith(("--ppq", "--no-ppq")) for a in script_args) and not (
            cfg.activations.enabled or cfg.gradients.enabled):
        from .p2p import install_compressed_p2p

        install_compressed_p2p(cfg)  # codec none: the tensors themselves, counted
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")
    _closing_report()


if __name__ == "__main__":
    main()
