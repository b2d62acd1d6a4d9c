"""Which megatron-core versions the patches support, and the loud failures for the others.

Every patch in this package reaches into megatron-core internals (``P2PCommunicator._communicate``,
the module-global ``schedules.P2PCommunicator``, ``TransformerBlock.__init__``, the optimizers'
``step``), which change between releases. Two checks guard them, both run before a patch installs
itself (and the launcher runs them at start-up, before the training script):

- :func:`check_megatron_version`: the installed version must be one the tests ran on
  (``TESTED_MEGATRON_VERSIONS``), unless ``PPQ_MEGATRON_ALLOW_UNTESTED=1``;
- :func:`check_patch_points`: every attribute the patch touches is looked up in the installed
  megatron-core; a missing one stops with its dotted name, also under ``PPQ_MEGATRON_ALLOW_UNTESTED``.

Supported: megatron-core 0.16.1 (Python >= 3.10) and 0.19.2, the newest release (Python >= 3.12; it
installs with the same torch 2.13.0). ``tests/megatron/test_megatron_versions.py`` runs the megatron tests
against an environment with the other version.
"""

from __future__ import annotations

import functools
import importlib
import os

__all__ = ["TESTED_MEGATRON_VERSIONS", "ALLOW_UNTESTED_ENV", "PATCH_POINTS", "megatron_version",
           "check_megatron_version", "missing_patch_points", "check_patch_points"]

TESTED_MEGATRON_VERSIONS: tuple[str, ...] = ("0.16.1", "0.19.2")
ALLOW_UNTESTED_ENV = "PPQ_MEGATRON_ALLOW_UNTESTED"

_P2P = "megatron.core.pipeline_parallel.p2p_communication"
_SCHED = "megatron.core.pipeline_parallel.schedules"
_RANDOM = "megatron.core.tensor_parallel.random"

# patch -> the (module, dotted attribute) it reads or replaces.
PATCH_POINTS: dict[str, tuple[tuple[str, str], ...]] = {
    "compressed P2P": (
        (_P2P, "P2PCommunicator._communicate"),
        (_P2P, "P2PCommunicator._communicate_shapes"),
        (_P2P, "_batched_p2p_ops"),
        (_P2P, "_p2p_ops"),
        (_SCHED, "P2PCommunicator"),
        (_SCHED, "get_forward_backward_func"),
        (_SCHED, "forward_backward_pipelining_without_interleaving"),
        (_SCHED, "forward_backward_pipelining_with_interleaving"),
    ),
    "low-bit layers": (
        ("megatron.core.transformer.transformer_block", "TransformerBlock.__init__"),
        ("megatron.core.transformer.transformer_layer", "TransformerLayer"),
        ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear"),
        ("megatron.core.tensor_parallel.layers", "RowParallelLinear"),
    ),
    "re-quantize after optimizer step": (
        ("megatron.core.optimizer.optimizer", "MegatronOptimizer.step"),
    ),
    "CPU mode": (
        (_RANDOM, "CudaRNGStatesTracker"),
        (_RANDOM, "_MODEL_PARALLEL_RNG_TRACKER_NAME"),
        (_RANDOM, "_DATA_PARALLEL_RNG_TRACKER_NAME"),
        (_RANDOM, "_CUDA_RNG_STATE_TRACKER"),
        ("megatron.core.tensor_parallel", "model_parallel_cuda_manual_seed"),
    ),
}


def megatron_version() -> str:
    """The installed megatron-core version, e.g. ``"0.16.1"``.

    Raises:
        ImportError: if megatron-core is not installed, saying how to install it.
    """
    try:
        from megatron.core import package_info
    except ImportError as e:
        raise ImportError(
            f"megatron_patches needs megatron-core (supported: {', '.join(TESTED_MEGATRON_VERSIONS)}): "
            f"pip install megatron-core=={TESTED_MEGATRON_VERSIONS[0]} ({e})"
        ) from e
    return package_info.__version__


def missing_patch_points(patch: str) -> list[str]:
    """The dotted names ``patch`` needs that the installed megatron-core does not have."""
    missing = []
    for module, attr in PATCH_POINTS[patch]:
        try:
            obj = importlib.import_module(module)
        except ImportError:
            missing.append(f"{module} (module)")
            continue
        try:
            functools.reduce(getattr, attr.split("."), obj)
        except AttributeError:
            missing.append(f"{module}.{attr}")
    return missing


def check_patch_points(patch: str) -> None:
    """Fail before installing ``patch`` if megatron-core lacks anything it touches.

    Raises:
        RuntimeError: naming the missing attributes, the installed and the supported versions.
    """
    missing = missing_patch_points(patch)
    if missing:
        raise RuntimeError(
            f"megatron_patches: the {patch} patch needs {', '.join(missing)}, which megatron-core "
            f"{megatron_version()} does not have. Supported versions: {', '.join(TESTED_MEGATRON_VERSIONS)}; "
            "install one of them."
        )


def check_megatron_version(patch: str, version: str | None = None) -> str:
    """Fail loudly if ``patch`` would be installed on an unsupported megatron-core version.

    Args:
        patch: the patch's name (a key of ``PATCH_POINTS``, or any name for the message).
        version: the version to check; the installed one when None (then the patch points are
            looked up as well).

    Returns:
        The checked version.

    Raises:
        RuntimeError: naming the version, the supported ones and the override variable; or the
            missing patch points.
    """
    installed = version is None
    version = version or megatron_version()
    if version not in TESTED_MEGATRON_VERSIONS and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise RuntimeError(
            f"megatron_patches: the {patch} patch was tested with megatron-core "
            f"{', '.join(TESTED_MEGATRON_VERSIONS)} but megatron-core {version} is installed. Install a "
            f"supported version, or set {ALLOW_UNTESTED_ENV}=1 to try it anyway (then run "
            "tests/megatron/test_megatron_p2p.py)."
        )
    if installed and patch in PATCH_POINTS:
        check_patch_points(patch)
    return version
