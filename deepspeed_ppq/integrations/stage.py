"""Per-stage options of a DeepSpeed ``PipelineModule``: low-bit weights and activation recomputation.

Both act on one stage's local layers but decide with GLOBAL layer indices, so a policy such as "keep
the first and last transformer block dense" means the model's first and last block whichever stage
holds them, and a stage-by-stage plan (the autotuner's) is carried out as planned.

* ``apply_weights(module, weights, block_layers)``: ``quant.convert_model`` with the precision policy
  of ``ppq.weights`` on this stage's layers. ``PipelineModule`` registers layer ``i`` of the whole list
  as submodule ``"i"``, so module names (``"3.mlp.fc"``) already carry global indices, and
  ``block_layers`` (global indices of the transformer blocks) with ``num_blocks=len(block_layers)``
  lets the policy find the first/last blocks of the whole model.
* ``apply_recompute(module, flags)``: wrap each chosen local layer in a non-reentrant
  ``torch.utils.checkpoint``: its inner activations are dropped after forward and recomputed in
  backward; only the layer's input stays. DeepSpeed's ``activation_checkpoint_interval`` is one value
  for every stage; this picks layers (hence stages) one by one.
* ``recompute_flags(...)``: turns ``recompute_stages`` (a flag per stage, or the stage indices the
  autotuner writes to the DeepSpeed config's ``pipeline.recompute_stages``) or ``recompute_layers``
  (a flag per global layer) into one flag per global layer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepspeed_ppq.config import PPQConfigError, WeightFormat, WeightsConfig

__all__ = ["infer_block_layers", "check_block_layers", "apply_weights", "apply_recompute", "recompute_flags",
           "RecomputedLayer"]


def _type_name(layer) -> str:
    typename = getattr(layer, "typename", None)  # LayerSpec
    if typename is not None:
        return typename.__name__
    return type(layer).__name__


def _has_params(layer) -> bool:
    if isinstance(layer, nn.Module):
        return any(True for _ in layer.parameters())
    return getattr(layer, "typename", None) is not None  # a LayerSpec builds a module: assume it has some


def infer_block_layers(layers: Sequence) -> list[int] | None:
    """Global indices of the transformer blocks: the layers of the most frequent type (by class name,
    at least twice) among layers holding parameters; None when no type repeats.

    ``[Embedding, Block, Block, Block, Head]`` -> ``[1, 2, 3]``. Pass ``block_layers`` explicitly when
    the model is laid out differently.
    """
    kinds = [_type_name(x) if _has_params(x) else None for x in layers]
    counts = Counter(k for k in kinds if k is not None)
    if not counts:
        return None
    kind, n = counts.most_common(1)[0]
    if n < 2:
        return None
    return [i for i, k in enumerate(kinds) if k == kind]


def check_block_layers(block_layers: Sequence[int] | None, num_layers: int) -> list[int] | None:
    """``block_layers`` as a list, if every entry is a global layer index of the model.

    Raises:
        PPQConfigError: naming ``block_layers``, the bad entries and the allowed range.
    """
    if block_layers is None:
        return None
    items = [block_layers] if isinstance(block_layers, (str, bytes)) else list(block_layers)
    bad = [i for i in items if isinstance(i, bool) or not isinstance(i, (int, np.integer))
           or not 0 <= i < num_layers]
    if bad:
        raise PPQConfigError(f"block_layers={block_layers!r}: {bad} are not layer indices of this model; "
                             f"give a list of global layer indices in [0, {num_layers})")
    return [int(i) for i in items]


def _resync_forward_funcs(module) -> None:
    """``convert_model`` may replace a whole layer (a bare ``nn.Linear``); point ``forward_funcs`` at the
    registered modules again, and mark new parameters as DeepSpeed's ``_build`` does."""
    for name, i in module.fwd_map.items():
        sub = module._modules.get(name)
        if sub is None:
            continue
        if isinstance(module.forward_funcs[i], RecomputedLayer):
            module.forward_funcs[i].layer = sub
        else:
            module.forward_funcs[i] = sub
    for p in module.parameters():
        p.ds_pipe_replicated = False


def apply_weights(module, weights: WeightsConfig | dict | None,
                  block_layers: Sequence[int] | None) -> list[str]:
    """Convert this stage's ``nn.Linear`` layers per ``weights`` (the ``ppq.weights`` section).

    Args:
        module: a built ``PipelineModule`` (any stage).
        weights: ``WeightsConfig`` (or its dict); ``None`` or ``format="none"`` converts nothing.
        block_layers: global indices of the transformer blocks in the whole layer list (see
            ``infer_block_layers``); needed for ``keep_first_blocks``/``keep_last_blocks``.

    Returns:
        Names of the layers that became ``QuantLinear`` (global-index names, e.g. ``"3.mlp.fc"``).

    Raises:
        PPQConfigError: low-bit weights that keep first/last blocks dense, but no block layers known.
    """
    from deepspeed_ppq.quant import QuantLinear, convert_model

    if weights is None:
        return []
    if isinstance(weights, dict):
        weights = WeightsConfig.model_validate(weights)
    if weights.format == WeightFormat.none and not weights.rules:
        return []
    if block_layers is None and (weights.keep_first_blocks or weights.keep_last_blocks):
        raise PPQConfigError(
            f"ppq.weights.keep_first_blocks={weights.keep_first_blocks}/keep_last_blocks="
            f"{weights.keep_last_blocks} need the global indices of the transformer blocks: pass "
            "block_layers=[...] (no layer type repeats in this model, so they could not be inferred), or set "
            "both to 0")
    before = {n for n, m in module.named_modules() if isinstance(m, QuantLinear)}
    kwargs = {} if block_layers is None else {"block_layers": list(block_layers),
                                              "num_blocks": len(block_layers)}
    convert_model(module, weights, **kwargs)
    _resync_forward_funcs(module)
    return sorted(n for n, m in module.named_modules() if isinstance(m, QuantLinear) and n not in before)


class RecomputedLayer:
    """A ``forward_funcs`` entry that runs ``layer`` under non-reentrant activation checkpointing.

    Not an ``nn.Module``: the layer stays registered under its own name (same parameters, same
    state-dict keys, same checkpoints); only the call goes through ``torch.utils.checkpoint``. Every
    other attribute (``state_dict``, ``load_state_dict``, ``parameters``, ...) is the layer's, so
    DeepSpeed's per-layer checkpoint files (``PipelineModule.save_state_dict``/``load_state_dir``, which
    walk ``forward_funcs``) still hold it. ``calls`` counts forward executions (recomputation included).
    """

    def __init__(self, layer):
        self.layer = layer
        self.calls = 0

    def __getattr__(self, name: str):
        if name == "layer":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.layer, name)

    def _run(self, x):
        self.calls += 1
        return self.layer(x)

    def __call__(self, x):
        if not torch.is_grad_enabled():
            return self._run(x)
        return checkpoint(self._run, x, use_reentrant=False)


def recompute_flags(num_layers: int, parts: Sequence[int], *, recompute_stages=None, recompute_layers=None,
                    block_layers: Sequence[int] | None = None) -> list[bool]:
    """One flag per global layer: whether its activations are recomputed in backward.

    Args:
        num_layers: layers in the whole list.
        parts: stage boundaries ``[0, b1, ..., num_layers]`` (``PipelineModule.parts``).
        recompute_stages: ``bool`` (every stage), a flag per stage (``[True, False]``), or a list of stage
            indices (``[0]``: the form of the DeepSpeed config's ``pipeline.recompute_stages``). A chosen
            stage recomputes its block layers (``block_layers``; all its layers when None).
        recompute_layers: a flag per global layer (exclusive with ``recompute_stages``).
        block_layers: global indices of the transformer blocks.

    Raises:
        PPQConfigError: naming the argument, its value and the allowed forms.
    """
    num_stages = len(parts) - 1
    if recompute_stages is not None and recompute_layers is not None:
        raise PPQConfigError("give recompute_stages or recompute_layers, not both")
    if recompute_layers is not None:
        flags = list(recompute_layers)
        if len(flags) != num_layers or not all(isinstance(f, bool) for f in flags):
            raise PPQConfigError(
                f"recompute_layers={flags!r}: needs one bool per layer ({num_layers} layers)")
        return flags
    if recompute_stages is None or recompute_stages is False:
        return [False] * num_layers
    if recompute_stages is True:
        stages = set(range(num_stages))
    else:
        given = list(recompute_stages)
        if not given:
            stages = set()  # the autotuner's "no stage recomputes"
        elif all(isinstance(s, bool) for s in given):
            if len(given) != num_stages:
                raise PPQConfigError(
                    f"recompute_stages={given!r}: a flag per stage needs {num_stages} entries, or give stage "
                    f"indices such as [0]")
            stages = {s for s, f in enumerate(given) if f}
        elif all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < num_stages for s in given):
            stages = set(given)
        else:
            raise PPQConfigError(
                f"recompute_stages={given!r}: use a bool, one bool per stage ({num_stages} stages), or stage "
                f"indices in [0, {num_stages})")
    blocks = None if block_layers is None else set(block_layers)
    flags = []
    for i in range(num_layers):
        stage = next(s for s in range(num_stages) if parts[s] <= i < parts[s + 1])
        flags.append(stage in stages and (blocks is None or i in blocks))
    return flags


def apply_recompute(module, flags: Sequence[bool]) -> list[int]:
    """Checkpoint this stage's layers whose global flag is set.

    Args:
        module: a built ``PipelineModule``.
        flags: one flag per global layer (``recompute_flags``).

    Returns:
        The global indices of this stage's layers now recomputed.

    Raises:
        PPQConfigError: the module already checkpoints with ``activation_checkpoint_interval`` > 0 (one
            or the other: nesting them recomputes twice).
    """
    chosen = [i for i in range(module._local_start, module._local_stop) if flags[i]]
    if not chosen:
        return []
    if module.activation_checkpoint_interval > 0:
        raise PPQConfigError(
            f"per-stage recompute and activation_checkpoint_interval={module.activation_checkpoint_interval} "
            "were both asked for; use one (set activation_checkpoint_interval=0 with recompute_stages)")
    done = []
    for i in chosen:
        j = module.fwd_map.get(str(i))
        if j is None:
            continue  # a parameter-free function or tied layer: nothing worth recomputing
        f = module.forward_funcs[j]
        if not isinstance(f, RecomputedLayer):
            module.forward_funcs[j] = RecomputedLayer(f)
        done.append(i)
    return done
