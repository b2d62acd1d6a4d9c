"""Memory categories: one vocabulary for what a pipeline stage holds.

The memory ledger (``quant.ledger``: exact bytes, predicted and measured), the planner's per-stage
prediction (``autotune.planner``), the simulator's per-rank peak (``schedule``) and the measured peak of
PyTorch's memory tracker (``autotune.memory``) all name what they count with these categories. Each maps
onto one coarse category: what a prediction and a measurement are compared in (the tracker tells only
those apart). A key may be dotted below its category (``"weights.int8.codes"``, ``"weights.dense.float32"``,
``"optimizer.state_8bit"``): its category is the first part.

================  ===========  ============================================================================
category          coarse       what
================  ===========  ============================================================================
weights           parameters   stored weights: low-bit codes and scales, or the training dtype
master_weights    parameters   fp32 masters of the low-bit weights that train (none when master-free)
workspace         parameters   the dense buffer low-bit weights are dequantized into for a matmul
buffers           parameters   module buffers (masks, running statistics)
gradients         gradients    weight gradients (a master-free weight's fp32 gradient buffer included)
optimizer         optimizer    optimizer states: moments, 8-bit codes, their absmax and code maps, steps
activations       activations  tensors saved for backward, per micro-batch in flight
comm_buffers      activations  pipeline send/receive buffers (codec payloads included)
feedback_buffers  activations  codec state carried between steps (error feedback, AQ-SGD samples)
temporaries       temporaries  transients of one backward or optimizer step
================  ===========  ============================================================================

The planner counts the dequantization buffer under ``weights`` (both are ``parameters``).

Names files hold from before this vocabulary: ``"master"`` (the planner's masters), ``"optimizer_states"``
(the simulator's), ``"weights:<dtype or format>"`` (the simulator's sub-keys), and, in a plan file's stage
memory, ``"buffers"`` for the pipeline buffers. A reader of a stored file passes what it reads through
``canonical`` (``PLAN_LEGACY_NAMES`` for a plan file's stage memory).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "WEIGHTS",
    "MASTER_WEIGHTS",
    "WORKSPACE",
    "BUFFERS",
    "GRADIENTS",
    "OPTIMIZER",
    "ACTIVATIONS",
    "COMM_BUFFERS",
    "FEEDBACK_BUFFERS",
    "TEMPORARIES",
    "CATEGORIES",
    "COARSE",
    "COARSE_OF",
    "TRACKER_COARSE_OF",
    "LEGACY_NAMES",
    "PLAN_LEGACY_NAMES",
    "category",
    "canonical",
    "coarse",
]

WEIGHTS = "weights"
MASTER_WEIGHTS = "master_weights"
WORKSPACE = "workspace"
BUFFERS = "buffers"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer"
ACTIVATIONS = "activations"
COMM_BUFFERS = "comm_buffers"
FEEDBACK_BUFFERS = "feedback_buffers"
TEMPORARIES = "temporaries"

COARSE: tuple[str, ...] = ("parameters", "gradients", "optimizer", "activations", "temporaries")
"""What a prediction and a measurement are compared in."""

COARSE_OF: dict[str, str] = {
    WEIGHTS: "parameters",
    MASTER_WEIGHTS: "parameters",
    WORKSPACE: "parameters",
    BUFFERS: "parameters",
    GRADIENTS: "gradients",
    OPTIMIZER: "optimizer",
    ACTIVATIONS: "activations",
    COMM_BUFFERS: "activations",
    FEEDBACK_BUFFERS: "activations",
    TEMPORARIES: "temporaries",
}
"""Each category's coarse category."""

CATEGORIES: tuple[str, ...] = tuple(COARSE_OF)
"""Every category, in the table's order."""

TRACKER_COARSE_OF: dict[str, str] = {
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "activations",
}
"""PyTorch's ``MemTracker`` reference types (``_MemRefType`` values) -> coarse category. ``Other`` is what
the tracker cannot place: received pipeline buffers and input batches, held like activations."""

LEGACY_NAMES: dict[str, str] = {"master": MASTER_WEIGHTS, "optimizer_states": OPTIMIZER}
"""Category names older files use -> the category."""

PLAN_LEGACY_NAMES: dict[str, str] = {**LEGACY_NAMES, "buffers": COMM_BUFFERS}
"""The same for a plan file's stage memory, where the planner called its pipeline buffers ``buffers``."""


def _split(key: str, legacy: Mapping[str, str]) -> tuple[str, str]:
    """(category, rest) of a key: ``"weights.int8.codes"`` -> ``("weights", ".int8.codes")``; the old
    ``"weights:int8"`` -> ``("weights", ".int8")``; legacy top-level names mapped."""
    cut = min((i for i in (key.find("."), key.find(":")) if i >= 0), default=len(key))
    top, rest = key[:cut], key[cut:]
    top = legacy.get(top, top)
    if top not in COARSE_OF:
        raise ValueError(f"memory category {key!r} is not one of {', '.join(CATEGORIES)} (or a dotted key "
                         "below one)")
    return top, ("." + rest[1:]) if rest else ""


def category(key: str, legacy: Mapping[str, str] = LEGACY_NAMES) -> str:
    """The category of a key (its first dotted part), with ``legacy`` names mapped.

    Raises:
        ValueError: the key names no category; the message lists them.
    """
    return _split(key, legacy)[0]


def canonical(by_key: Mapping[str, float], legacy: Mapping[str, str] = LEGACY_NAMES) -> dict:
    """``by_key`` with every key in today's names (old category names and ``":"`` sub-keys renamed);
    keys that end up equal are summed. Raises ``ValueError`` for a key that names no category."""
    out: dict = {}
    for k, v in by_key.items():
        top, rest = _split(k, legacy)
        out[top + rest] = out.get(top + rest, 0) + v
    return out


def coarse(by_key: Mapping[str, float], legacy: Mapping[str, str] = LEGACY_NAMES) -> dict[str, int]:
    """Bytes by category (dotted keys and ``legacy`` names allowed) summed into ``COARSE``, each present."""
    out = dict.fromkeys(COARSE, 0)
    for k, v in by_key.items():
        out[COARSE_OF[category(k, legacy)]] += int(v)
    return out
