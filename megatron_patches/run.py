"""Run an unmodified Megatron-LM training script with deepspeed_ppq::

    python -m megatron_patches.run pretrain_gpt.py <Megatron args> --ppq-activations-method quant ...
    torchrun --nproc-per-node 8 -m megatron_patches.run pretrain_gpt.py ...

What it does, in order:

1. Reads the ``--ppq-*`` flags (and ``--ppq-config``) and the few Megatron flags they interact with,
   validates them (``args_to_ppq_config`` + ``check_megatron_compatible``): bad input stops here,
   before any process group exists, with the flag to change.
2. ``--ppq-plan-file plan.json`` (written by ``ppq tune``): turns the plan into Megatron flags
   (``--pipeline-model-parallel-size``, ``--pipeline-model-parallel-layout``, ``--micro-batch-size``,
   ``--global-batch-size``, recomputation) and per-layer precision rules on Megatron's global layer
   names; a flag the user also gave with another value is an error.
3. With ``--transformer-impl transformer_engine`` and ``--ppq-weights-format fp8_e4m3``: adds
   megatron-core's own FP8 flags (``--fp8-format``, ``--fp8-recipe``, ``--fp8-param-gather``,
   ``--first-last-layers-bf16`` and the two counts).
4. Installs the patches (compressed P2P, low-bit layers), removes the ``--ppq-*`` flags from
   ``sys.argv`` (the script's parser does not know them) and runs the script with ``runpy`` as
   ``__main__``. A script that registers ``add_ppq_args`` itself and calls ``apply`` gets the same
   config through ``PPQ_MEGATRON_CONFIG``.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

from deepspeed_ppq.config import PPQConfigError, WeightFormat

from . import CONFIG_ENV, apply
from .args import add_ppq_args, args_to_ppq_config, check_megatron_compatible

__all__ = ["prepare", "plan_to_megatron", "main"]


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
    return p.parse_known_args(argv)[0]


def _flag_values(argv: list[str]) -> dict[str, str | None]:
    """``--flag value`` / ``--flag`` occurrences in a Megatron command line (last one wins)."""
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
    """
    from deepspeed_ppq.autotune.plan import load_plan

    plan = load_plan(plan_path)
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
    given = _flag_values(argv)
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


def prepare(argv: list[str]) -> tuple[list[str], dict]:
    """Validate the ppq flags of a Megatron command line and compute what to run.

    Args:
        argv: the script's arguments (without the script path).

    Returns:
        (the script's arguments without ``--ppq-*`` and with the added Megatron flags, the validated
        ppq section as a JSON-able dict).

    Raises:
        PPQConfigError: bad or conflicting settings, naming the flag to change.
    """
    parser = add_ppq_args(argparse.ArgumentParser(prog="megatron_patches.run", add_help=False,
                                                  allow_abbrev=False))
    ppq_args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if a.startswith("--ppq")]
    if bad:
        raise PPQConfigError(f"unknown ppq flag(s) {bad}; see `python -m megatron_patches.run --help-ppq`")
    cfg = args_to_ppq_config(ppq_args)
    if cfg.plan_file:
        flags, overrides = plan_to_megatron(cfg.plan_file)
        rest = _merge(rest, flags, f"--ppq-plan-file {cfg.plan_file}")
        section = cfg.model_dump(mode="json")
        section.update(overrides)
        from deepspeed_ppq.config import load_ppq_config

        cfg = load_ppq_config(section, root="ppq (with the plan)")
    view = _megatron_view(rest)
    check_megatron_compatible(cfg, view)
    if view.transformer_impl == "transformer_engine" and cfg.weights.format == WeightFormat.fp8_e4m3:
        from .layers import te_fp8_settings

        te = te_fp8_settings(cfg.weights)
        flags = ["--fp8-format", te["fp8"], "--fp8-recipe", te["fp8_recipe"], "--fp8-param-gather"]
        if te["first_last_layers_bf16"]:
            flags += ["--first-last-layers-bf16",
                      "--num-layers-at-start-in-bf16", str(te["num_layers_at_start_in_bf16"]),
                      "--num-layers-at-end-in-bf16", str(te["num_layers_at_end_in_bf16"])]
        rest = _merge(rest, flags, "--ppq-weights-format fp8_e4m3")
    return rest, cfg.model_dump(mode="json")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "--help-ppq"):
        parser = add_ppq_args(argparse.ArgumentParser(
            prog="python -m megatron_patches.run", usage="%(prog)s SCRIPT [Megatron args] [--ppq-* flags]",
            description=__doc__.split("\n\n")[0]))
        parser.print_help()
        raise SystemExit(0 if argv else 2)
    script, script_args = argv[0], argv[1:]
    try:
        rest, section = prepare(script_args)
    except PPQConfigError as e:
        raise SystemExit(f"megatron_patches.run: {e}") from None
    os.environ[CONFIG_ENV] = json.dumps(section)
    apply(_megatron_view(rest), cfg=section)
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
