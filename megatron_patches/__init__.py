"""Opt-in patches that bring deepspeed_ppq into Megatron-LM / megatron-core (megatron-core 0.16.1 and 0.19.2).

Three pieces, each checking the installed megatron-core version before it installs itself
(``PPQ_MEGATRON_ALLOW_UNTESTED=1`` to override, see ``compat``):

- ``args``: the ``--ppq-*`` flags, generated from ``deepspeed_ppq.config.PPQConfig``
  (``add_ppq_args`` is an ``extra_args_provider``);
- ``p2p``: compressed activations and gradients between pipeline stages inside megatron-core's own
  schedules (``PPQP2PCommunicator``);
- ``layers``: low-bit weights in megatron-core's parallel linear layers, or FP8 primary weights
  through Transformer Engine;
- ``optim``: re-quantizes those low-bit weights after every successful megatron-core optimizer step
  (installed with ``layers``).

In a training script::

    from megatron_patches import add_ppq_args, apply
    pretrain(..., extra_args_provider=add_ppq_args)    # and, once args are parsed:
    apply(get_args())                                   # before the model is built

Without touching the script: ``python -m megatron_patches.run pretrain_gpt.py <args> --ppq-...``.
"""

from __future__ import annotations

import argparse
import json
import os

from deepspeed_ppq.config import PPQConfig, PPQConfigError, load_ppq_config

from .args import add_ppq_args, args_to_ppq_config, check_megatron_compatible, ppq_flags
from .compat import ALLOW_UNTESTED_ENV, TESTED_MEGATRON_VERSIONS, check_megatron_version

__all__ = [
    "add_ppq_args",
    "args_to_ppq_config",
    "check_megatron_compatible",
    "check_honoured_on_megatron",
    "apply",
    "remove",
    "TESTED_MEGATRON_VERSIONS",
    "ALLOW_UNTESTED_ENV",
    "CONFIG_ENV",
    "check_megatron_version",
]

# megatron_patches.run hands the validated section to an ``apply`` inside the script through this.
CONFIG_ENV = "PPQ_MEGATRON_CONFIG"


def check_honoured_on_megatron(cfg: PPQConfig) -> None:
    """Refuse the settings only the DeepSpeed path carries out, so none is accepted and ignored here.

    Raises:
        PPQConfigError: naming each flag and what to use on Megatron instead.
    """
    problems = []
    if cfg.weights.optimizer_8bit:
        problems.append(
            "--ppq-weights-optimizer-8bit: bitsandbytes 8-bit Adam is built by deepspeed_ppq.initialize; "
            "Megatron builds its own optimizer: drop the flag (megatron-core keeps lower-precision Adam "
            "states with --use-precision-aware-optimizer --exp-avg-dtype/--exp-avg-sq-dtype)")
    if cfg.weights.master == "none" and (cfg.weights.format.value != "none" or cfg.weights.rules):
        problems.append(
            "--ppq-weights-master none: master-free low-bit weights are updated by the DeepSpeed engine's "
            "own step; megatron-core's optimizer updates a master weight: use --ppq-weights-master fp32")
    if "watchdog_timeout_s" in cfg.model_fields_set:
        problems.append(
            "--ppq-watchdog-timeout-s: the watchdog runs inside the DeepSpeed pipeline engine; on Megatron "
            "a stuck rank is ended by the process group's timeout: --distributed-timeout-minutes N")
    if "autotune" in cfg.model_fields_set:
        problems.append(
            "--ppq-autotune-*: these settings steer `ppq tune`, which tunes DeepSpeed scripts; on Megatron "
            "train with a tuned plan: --ppq-plan-file plan.json")
    if problems:
        raise PPQConfigError("ppq settings that only the DeepSpeed path carries out:\n  "
                             + "\n  ".join(problems))


def _given(args: argparse.Namespace) -> bool:
    return getattr(args, "ppq_config", None) is not None or any(
        getattr(args, f.dest, None) is not None for f in ppq_flags())


def apply(args: argparse.Namespace | None = None, cfg: PPQConfig | dict | None = None) -> PPQConfig:
    """Validate the ppq settings against Megatron's arguments and install the patches they need.

    Args:
        args: Megatron's parsed arguments (with the ``--ppq-*`` flags from ``add_ppq_args``). Also used
            for the compatibility checks (interleaving, tensor parallel size, transformer impl).
        cfg: a config to use instead of the flags (a ``PPQConfig``, dict or JSON path).

    Returns:
        The validated ``PPQConfig`` that was installed.

    Raises:
        PPQConfigError: invalid settings or settings Megatron cannot carry, naming the flag to change.
        RuntimeError: an untested megatron-core version.
    """
    if cfg is not None:
        cfg = load_ppq_config(cfg)
    elif args is not None and _given(args):
        cfg = args_to_ppq_config(args)
    elif os.environ.get(CONFIG_ENV):
        cfg = load_ppq_config(json.loads(os.environ[CONFIG_ENV]))
    else:
        cfg = PPQConfig()
    check_megatron_compatible(cfg, args)
    check_honoured_on_megatron(cfg)
    check_megatron_version("ppq")
    if cfg.activations.enabled or cfg.gradients.enabled:
        from .p2p import install_compressed_p2p

        install_compressed_p2p(cfg)
    if cfg.weights.format.value != "none" or cfg.weights.rules:
        impl = getattr(args, "transformer_impl", "local") if args is not None else "local"
        if impl != "transformer_engine":
            from .layers import install_lowbit_layers

            install_lowbit_layers(cfg.weights)
        # With Transformer Engine, FP8 weights are megatron-core's own flags (see run.py / layers.py).
    return cfg


def remove() -> None:
    """Undo every installed patch."""
    from .layers import uninstall_lowbit_layers
    from .p2p import uninstall_compressed_p2p

    uninstall_compressed_p2p()
    uninstall_lowbit_layers()

