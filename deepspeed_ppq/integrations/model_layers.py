"""The user's pipeline model as a list of layers: what the tuner, the plans and the partition methods
see of it, without building a pipeline.

* ``layer_specs(model)``: the layer list of a ``PipelineModule`` (or the list itself: modules,
  ``LayerSpec``s, ``TiedLayerSpec``s, callables);
* ``build_layers(specs, device)``: every layer built in one process (tied specs share their module), on
  the meta device for shapes only;
* ``model_fingerprint(model)``: layer count, classes and parameter shapes, and their digest (a plan
  records it and refuses another model);
* ``layer_kinds`` / ``checkpointable_names``: embedding, block, head per layer, and the class names
  DeepSpeed may checkpoint;
* ``deepspeed_partitions``: how DeepSpeed's own partition methods cut the layers.
"""

from __future__ import annotations

import copy
import hashlib
import json

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from deepspeed_ppq.config import PPQConfigError

__all__ = ["layer_specs", "build_layers", "layer_name", "model_fingerprint", "layer_kinds",
           "checkpointable_names", "recompute_layer_flags", "deepspeed_partitions"]


def layer_specs(model) -> list:
    """The layer list of a ``PipelineModule`` (its ``_layer_specs``) or the list itself."""
    if isinstance(model, PipelineModule):
        return list(model._layer_specs)
    if isinstance(model, (list, tuple)):
        return list(model)
    raise TypeError(f"model must be a deepspeed PipelineModule or a list of layers/LayerSpecs, got "
                    f"{type(model).__name__}")


class _Call(nn.Module):
    """A tied layer's module called through its ``forward_fn``, or a plain function, as a layer."""

    def __init__(self, module: nn.Module | None, fn):
        super().__init__()
        self.inner = module
        self.fn = fn

    def forward(self, x):
        return self.fn(self.inner, x) if self.inner is not None else self.fn(x)


def build_layers(specs: list, device: str | None = None) -> list[nn.Module]:
    """Every layer built in one process (tied specs share their module), for profiling."""
    tied: dict[str, nn.Module] = {}
    out = []
    ctx = torch.device(device) if device else torch.device("cpu")
    with ctx:
        for spec in specs:
            if isinstance(spec, TiedLayerSpec):
                mod = tied.get(spec.key) or tied.setdefault(spec.key, spec.build())
                out.append(_Call(mod, spec.forward_fn) if spec.forward_fn is not None else mod)
            elif isinstance(spec, LayerSpec):
                out.append(spec.build())
            elif isinstance(spec, nn.Module):
                out.append(spec if device == "meta" else copy.deepcopy(spec))
            elif callable(spec):
                out.append(_Call(None, spec))
            else:
                raise TypeError(f"layer {len(out)} is a {type(spec).__name__}: use an nn.Module, a LayerSpec "
                                "or a callable")
    return out


def layer_name(spec) -> str:
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__ + (f"[tied:{spec.key}]" if isinstance(spec, TiedLayerSpec) else "")
    return type(spec).__name__ if isinstance(spec, nn.Module) else getattr(spec, "__name__", "fn")


def model_fingerprint(model) -> dict:
    """Layer count, each layer's class and parameter shapes, and a digest of them (built on the meta
    device: nothing is allocated)."""
    specs = layer_specs(model)
    layers = []
    for spec, mod in zip(specs, build_layers(specs, device="meta")):
        layers.append([layer_name(spec), [list(p.shape) for p in mod.parameters()]])
    digest = hashlib.sha256(json.dumps(layers).encode()).hexdigest()[:16]
    return {"num_layers": len(specs), "layers": [f"{n} {s}" for n, s in layers], "digest": digest}


def layer_kinds(specs: list, block_layers: list[int] | None) -> list[str]:
    """``embed`` / ``block`` / ``head`` / ``other`` per layer, for the precision policy and recompute.

    Layers before the first block are ``embed`` (their input may be token ids: never checkpointed), as
    is any later layer of an ``embed`` layer's class (a tied embedding used as the head: DeepSpeed's
    ``checkpointable_layers`` goes by class name)."""
    blocks = set(block_layers or [])
    first, last = (min(blocks), max(blocks)) if blocks else (0, len(specs) - 1)
    kinds = ["block" if i in blocks else "embed" if i < first else "head" if i > last else "other"
             for i in range(len(specs))]
    embed_names = {layer_name(s).split("[")[0] for s, k in zip(specs, kinds) if k == "embed"}
    return ["embed" if layer_name(s).split("[")[0] in embed_names else k for s, k in zip(specs, kinds)]


def checkpointable_names(specs: list, block_layers: list[int] | None) -> list[str]:
    """Class names DeepSpeed may checkpoint when a stage recomputes: every layer but the ``embed`` ones."""
    kinds = layer_kinds(specs, block_layers)
    return sorted({layer_name(s).split("[")[0] for s, k in zip(specs, kinds) if k != "embed"})


def recompute_layer_flags(specs: list, block_layers: list[int] | None, layers) -> list[bool]:
    """One flag per layer from the global indices ``layers`` to recompute (``pipeline.recompute_layers``,
    as a plan with partial recomputation writes it), the ``embed`` layers left out as a recomputing
    stage leaves them (``checkpointable_names``).

    Raises:
        PPQConfigError: an entry that is not a layer index.
    """
    chosen = list(layers)
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(specs) for i in chosen):
        raise PPQConfigError(f"pipeline.recompute_layers={chosen!r}: needs global layer indices in "
                             f"[0, {len(specs)})")
    kinds, chosen = layer_kinds(specs, block_layers), set(chosen)
    return [i in chosen and kinds[i] != "embed" for i in range(len(specs))]


def deepspeed_partitions(param_counts: list[int], pipeline_degree: int, block_layers: list[int] | None = None,
                         block_class: str | None = None) -> dict[str, list[int]]:
    """How DeepSpeed's ``PipelineModule`` cuts layers into ``pipeline_degree`` stages by each of its
    partition methods: ``uniform``, ``parameters`` (balanced parameter counts) and, with the blocks
    given, ``type:<block_class>`` (balanced block counts); cuts that leave a stage empty are dropped."""
    from deepspeed.runtime import utils as ds_utils

    L, p = len(param_counts), pipeline_degree
    out = {"uniform": ds_utils.partition_uniform(L, p),
           "parameters": ds_utils.partition_balanced(list(param_counts), p)}
    if block_layers:
        blocks = set(block_layers)
        out[f"type:{block_class}"] = ds_utils.partition_balanced([int(i in blocks) for i in range(L)], p)
    out = {k: [int(x) for x in v] for k, v in out.items()}
    return {k: v for k, v in out.items() if all(a < b for a, b in zip(v, v[1:]))}
