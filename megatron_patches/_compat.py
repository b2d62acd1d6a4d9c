"""Which megatron-core versions the patches were tested with, and the loud failure for the others.

Every patch in this package reaches into megatron-core internals (``P2PCommunicator._communicate``,
the module-global ``schedules.P2PCommunicator``, ``TransformerBlock``'s layer list), which change
between releases. Each patch calls :func:`check_megatron_version` before it installs itself.

Set ``PPQ_MEGATRON_ALLOW_UNTESTED=1`` to run on another version anyway (for the brave: the
gradient-equality tests in ``tests/test_megatron_p2p.py`` are the way to find out whether it works).
"""

from __future__ import annotations

import os

__all__ = ["TESTED_MEGATRON_VERSIONS", "ALLOW_UNTESTED_ENV", "megatron_version", "check_megatron_version"]

TESTED_MEGATRON_VERSIONS: tuple[str, ...] = ("0.16.1",)
ALLOW_UNTESTED_ENV = "PPQ_MEGATRON_ALLOW_UNTESTED"


def megatron_version() -> str:
    """The installed megatron-core version, e.g. ``"0.16.1"``.

    Raises:
        ImportError: if megatron-core is not installed, saying how to install it.
    """
    try:
        from megatron.core import package_info
    except ImportError as e:
        raise ImportError(
            f"megatron_patches needs megatron-core (tested: {', '.join(TESTED_MEGATRON_VERSIONS)}): "
            f"pip install megatron-core=={TESTED_MEGATRON_VERSIONS[-1]} ({e})"
        ) from e
    return package_info.__version__


def check_megatron_version(patch: str, version: str | None = None) -> str:
    """Fail loudly if ``patch`` would be installed on an untested megatron-core version.

    Args:
        patch: the patch's name, for the message (e.g. ``"compressed P2P"``).
        version: the version to check; the installed one when None.

    Returns:
        The checked version.

    Raises:
        RuntimeError: naming the version, the tested ones and the override variable.
    """
    version = version or megatron_version()
    if version in TESTED_MEGATRON_VERSIONS or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return version
    raise RuntimeError(
        f"megatron_patches: the {patch} patch was tested with megatron-core "
        f"{', '.join(TESTED_MEGATRON_VERSIONS)} but megatron-core {version} is installed. Install a tested "
        f"version, or set {ALLOW_UNTESTED_ENV}=1 to try it anyway (then run tests/test_megatron_p2p.py)."
    )
