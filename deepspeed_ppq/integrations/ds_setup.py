"""``deepspeed_ppq.initialize`` and its set-up helpers: config resolution, model preparation (weights,
recomputation), the 8-bit optimizer of ``ppq.weights.optimizer_8bit``, start-up checks and the
re-quantization hook. The engine it builds for a ``PipelineModule`` is ``integrations.deepspeed``'s
``PPQPipelineEngine``."""

from __future__ import annotations

import functools
import os
import warnings

import torch
from deepspeed.runtime.pipe.module import PipelineModule

from deepspeed_ppq.config import PPQConfig, PPQConfigError, load_ppq_config
from deepspeed_ppq.integrations.shm import release_at_exit

__all__ = ["initialize", "check_codecs", "check_partition", "configured_parts"]


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = 29500, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None, *,
               sample_ids: bool | None = None, block_layers=None, recompute_stages=None,
               recompute_layers=None, requantize: bool = True, overlap_sends: bool = True, plan=None):
    """Drop-in for ``deepspeed.initialize`` that honours the config's top-level ``"ppq"`` section.

    Before DeepSpeed sees the model: ``ppq.weights`` converts its ``nn.Linear`` layers (skipped when the
    model already holds ``QuantLinear`` layers, e.g. a ``PPQPipelineModule`` built with ``weights=``),
    deciding "first/last N blocks" with global layer indices; the listed stages recompute their block
    layers. After: train-mode ``QuantLinear`` compute copies are re-quantized after every optimizer step
    (``quant.requantize_after_step`` on the engine; its handle is ``engine.ppq_requantize_handle``), and
    master-free layers (``weights.master="none"``) are updated by ``quant.attach_master_free`` on every
    rank (``engine.ppq_master_free_handle``).

    Args:
        (as ``deepspeed.initialize``), plus
        sample_ids: the data iterator yields ``(inputs, labels, sample_ids)`` (AQ-SGD needs it when no
            ``training_data`` with 3-tuple items is given).
        block_layers: global indices of the transformer blocks (default: the module's, or inferred).
        recompute_stages: ``True``, one bool per stage, or stage indices; default: the DeepSpeed config's
            ``pipeline.recompute_stages`` (stage indices, as the autotuner writes them), which then also
            turns DeepSpeed's ``activation_checkpoint_interval`` off (it is one value for all stages).
        recompute_layers: one bool per global layer instead.
        requantize: wire the re-quantization hook (set False if you call ``requantize_after_step`` yourself).
        overlap_sends: compressed payloads go out with a non-blocking send (``PPQPipelineEngine``).
        plan: a tuned ``Plan`` (or plan file path) to carry out, as the config's ``ppq.plan_file``
            (``integrations.plan_apply``): the model is rebuilt at its boundaries and formats, the
            optimizer in its kind, the batch sizes and codecs set from it.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` as ``deepspeed.initialize``; for a
        ``PipelineModule`` the engine is a ``PPQPipelineEngine``.

    Raises:
        PPQConfigError: a bad ``"ppq"`` section, a ``ppq.partition`` the module was not cut by
            (``check_partition``), AQ-SGD without sample indices, or an optimizer built before
            ``ppq.weights`` replaced layers.
    """
    from deepspeed_ppq.integrations.capture import capture_initialize

    capture_initialize(dict(args=args, model=model, optimizer=optimizer, training_data=training_data,
                            config=config, config_params=config_params))  # under `ppq tune`: stop here
    release_at_exit()  # DeepSpeed's CPU backend never unlinks its /dev/shm all-reduce buffers

    import deepspeed

    ds_config = _resolve_ds_config(args, config, config_params)
    ppq = load_ppq_config(ds_config.get("ppq"))
    if plan is not None and ppq.plan_file and str(plan) != ppq.plan_file:
        raise PPQConfigError(f"plan={plan if isinstance(plan, (str, os.PathLike)) else type(plan).__name__} "
                             f"and ppq.plan_file={ppq.plan_file!r} were both given: pass one plan (drop "
                             "ppq.plan_file from the config, or the plan argument)")
    if plan is not None or ppq.plan_file:
        from deepspeed_ppq.integrations.plan_apply import apply_plan

        model, optimizer, ds_config, args = apply_plan(plan if plan is not None else ppq.plan_file, model,
                                                       optimizer, ds_config, args)
        config = ds_config
        ppq = load_ppq_config(ds_config.get("ppq"))
    if model is not None:
        _prepare_model(model, ppq, ds_config, optimizer, model_parameters, block_layers, recompute_stages,
                       recompute_layers)
        if ppq.weights.optimizer_8bit:
            optimizer, ds_config = _optimizer_8bit(model, optimizer, ds_config)
            config = ds_config
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        config = None  # deepspeed.initialize reads it from args again
    else:
        config = ds_config
    common = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                  dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                  mesh_param=mesh_param)
    if not isinstance(model, PipelineModule):
        if ppq.activations.enabled or ppq.gradients.enabled:
            warnings.warn("ppq.activations/gradients compression applies to pipeline stages only; "
                          "the model is not a PipelineModule", stacklevel=2)
        out = deepspeed.initialize(mpu=mpu, **common)
        if requantize:
            _wire_requantize(out[0])
        return out
    check_partition(model, ppq)
    if ppq.aqsgd.enabled:
        _check_sample_ids(training_data, sample_ids)
    check_codecs(ppq)
    from deepspeed_ppq.integrations.deepspeed import PPQPipelineEngine

    engine_cls = functools.partial(PPQPipelineEngine, ppq_config=ppq, ppq_sample_ids=sample_ids,
                                   ppq_overlap_sends=overlap_sends)
    saved = deepspeed.PipelineEngine
    deepspeed.PipelineEngine = engine_cls  # deepspeed.initialize looks the class up in its module globals
    try:
        out = deepspeed.initialize(mpu=mpu, **common)
    finally:
        deepspeed.PipelineEngine = saved
    if requantize:
        _wire_requantize(out[0])
    return out



def configured_parts(model: PipelineModule, cfg: PPQConfig) -> list[int]:
    """The stage boundaries ``cfg.partition`` gives ``model``'s layers on its number of stages: the explicit
    boundaries, or DeepSpeed's own method (``PipelineModule._partition_layers``: ``uniform``, ``parameters``
    -- balanced trainable parameter counts -- or ``type:<regex>`` -- balanced counts of the matching layers).

    Parameters are counted as DeepSpeed counted them when it cut the module: a layer given as a
    ``LayerSpec`` is built on the meta device (nothing allocated), and a ``QuantLinear`` that ``ppq.weights``
    made out of an ``nn.Linear`` after the cut counts as that ``nn.Linear``.

    Raises:
        PPQConfigError: a ``type:`` pattern that matches no layer.
    """
    from deepspeed.runtime import utils as ds_utils

    part, specs, n = cfg.partition, model._layer_specs, model.num_stages
    method = part.method.lower()
    if method == "explicit":
        return [int(b) for b in part.boundaries]
    if method == "uniform":
        parts = ds_utils.partition_uniform(num_items=len(specs), num_parts=n)
    elif method == "parameters":
        parts = ds_utils.partition_balanced(weights=[_trainable_count(s) for s in specs], num_parts=n)
    else:  # type:<regex>, read as DeepSpeed reads it (lower-cased, up to a second ':')
        try:
            matches = set(model._find_layer_type(method.split(":")[1]))
        except RuntimeError:
            names = sorted({_layer_class(s) for s in specs})
            raise PPQConfigError(f"ppq.partition.method={part.method!r} matches none of this model's layers "
                                 f"(classes {names}): give a pattern that matches the blocks, e.g. "
                                 f"'type:{names[0] if names else 'Block'}'") from None
        parts = ds_utils.partition_balanced(weights=[int(i in matches) for i in range(len(specs))],
                                            num_parts=n)
    return [int(b) for b in parts]


def check_partition(model: PipelineModule, cfg: PPQConfig) -> None:
    """When the config sets ``ppq.partition``, ``model`` must be cut that way: a ``PipelineModule`` splits its
    layers when it is built, so a partition set only in the config would be silently ignored.

    A config without a ``partition`` section leaves the module's own split as it is.

    Raises:
        PPQConfigError: naming the field, the split it gives this model, the module's split and the fix.
    """
    if "partition" not in cfg.model_fields_set:
        return
    want, have = configured_parts(model, cfg), [int(p) for p in model.parts]
    if want == have:
        return
    part = cfg.partition
    if part.method == "explicit":
        field, build = f"ppq.partition.boundaries={part.boundaries}", f"boundaries={want}"
    else:
        field = f"ppq.partition.method={part.method!r}"
        build = f"partition_method={part.method!r}"
    raise PPQConfigError(
        f"{field} cuts this model's {len(model._layer_specs)} layers into {model.num_stages} stages as "
        f"{want}, but the {type(model).__name__} given was built as {have}: build it from the config with "
        f"PPQPipelineModule.from_config(layers, num_stages, config), or pass {build} when building it "
        "(or drop ppq.partition to keep the module's own split)")


def _layer_class(spec) -> str:
    typename = getattr(spec, "typename", None)  # LayerSpec
    if typename is not None:
        return typename.__name__
    return type(spec).__name__ if isinstance(spec, torch.nn.Module) else getattr(spec, "__name__", "fn")


def _trainable_count(spec) -> int:
    """Trainable parameters of one layer as ``PipelineModule._count_layer_params`` counts them."""
    from deepspeed.pipe import LayerSpec

    if isinstance(spec, LayerSpec):
        try:
            with torch.device("meta"):
                layer = spec.build()
        except Exception:  # noqa: BLE001 - a layer that cannot be built on meta: as DeepSpeed does
            layer = spec.build()
        return _linear_as_built(layer)
    return _linear_as_built(spec) if isinstance(spec, torch.nn.Module) else 0


def _linear_as_built(module: torch.nn.Module) -> int:
    from deepspeed_ppq.quant import QuantLinear

    if isinstance(module, QuantLinear):  # was an nn.Linear when DeepSpeed cut the layers
        return module.in_features * module.out_features + (module.out_features if module.bias is not None
                                                            else 0)
    own = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
    return own + sum(_linear_as_built(c) for c in module.children())


def check_codecs(cfg: PPQConfig) -> None:
    """Build a boundary's channel once, so codec settings the codecs reject fail at start-up on every rank
    instead of at the first send on one.

    Raises:
        PPQConfigError: naming the direction, its settings and the codec's complaint.
    """
    from deepspeed_ppq.compress import BoundaryChannel

    try:
        BoundaryChannel(cfg, label="ppq")
    except ValueError as err:
        raise PPQConfigError(str(err)) from None


def _check_sample_ids(training_data, declared: bool | None) -> None:
    """AQ-SGD needs each sample's dataset index on every stage: fail at start-up if none will come."""
    if training_data is not None:
        item = training_data[0]
        if isinstance(item, (tuple, list)) and len(item) == 3:
            return
        raise PPQConfigError(
            "ppq.aqsgd.enabled=true needs the dataset index of every sample: training_data items must be "
            f"(inputs, labels, sample_id), got {type(item).__name__} of length "
            f"{len(item) if hasattr(item, '__len__') else '?'} "
            "(wrap the dataset: deepspeed_ppq.integrations.WithSampleIds)")
    if not declared:
        raise PPQConfigError(
            "ppq.aqsgd.enabled=true needs the dataset index of every sample, and no training_data was given: "
            "pass sample_ids=True to deepspeed_ppq.initialize and make the data iterator yield "
            "(inputs, labels, sample_ids) batches, or set ppq.aqsgd.enabled=false")


def _resolve_ds_config(args, config, config_params) -> dict:
    if config is None and config_params is not None:
        config = config_params
    if config is None and getattr(args, "deepspeed_config", None) is not None:
        config = args.deepspeed_config
    if config is None:
        raise ValueError("DeepSpeed requires a config: pass config=... or args.deepspeed_config")
    if isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(config)


def _prepare_model(model, ppq: PPQConfig, ds_config: dict, optimizer, model_parameters, block_layers,
                   recompute_stages, recompute_layers) -> None:
    """Apply ``ppq.weights`` (unless the model already holds ``QuantLinear`` layers) and per-stage
    recomputation to ``model`` before DeepSpeed sees its parameters."""
    from deepspeed_ppq.integrations.model_layers import recompute_layer_flags
    from deepspeed_ppq.integrations.stage import (
        apply_recompute,
        apply_weights,
        check_block_layers,
        infer_block_layers,
        recompute_flags,
    )
    from deepspeed_ppq.quant import QuantLinear, convert_model

    is_pipe = isinstance(model, PipelineModule)
    if is_pipe:
        block_layers = check_block_layers(block_layers, len(model._layer_specs))  # None stays None
        if block_layers is None:
            block_layers = getattr(model, "block_layers", None) or infer_block_layers(model._layer_specs)
    already = any(isinstance(m, QuantLinear) for m in model.modules())
    w = ppq.weights
    if not already and (w.format.value != "none" or w.rules):
        if is_pipe:
            apply_weights(model, w, block_layers)
        else:
            convert_model(model, w, **({} if block_layers is None else {"block_layers": block_layers}))
        _check_params_live(model, optimizer, model_parameters, w.format.value)
    if recompute_stages is None and recompute_layers is None:
        pipe_cfg = ds_config.get("pipeline") or {}
        recompute_stages = pipe_cfg.get("recompute_stages")
        if pipe_cfg.get("recompute_layers") is not None and is_pipe:
            if recompute_stages is not None:
                raise PPQConfigError("pipeline.recompute_stages and pipeline.recompute_layers were both "
                                     "given; use one")
            recompute_layers = recompute_layer_flags(model._layer_specs, block_layers,
                                                     pipe_cfg["recompute_layers"])
        if (recompute_stages is not None or recompute_layers is not None) and is_pipe:
            # the config's per-stage choice replaces its activation_checkpoint_interval, which the module
            # may have been built with (the engine turns the config's value off the same way)
            model.activation_checkpoint_interval = 0
    if recompute_stages is not None or recompute_layers is not None:
        if not is_pipe:
            raise PPQConfigError("recompute_stages/recompute_layers apply to a PipelineModule's stages; "
                                 f"the model is a {type(model).__name__}")
        flags = recompute_flags(len(model._layer_specs), model.parts, recompute_stages=recompute_stages,
                                recompute_layers=recompute_layers, block_layers=block_layers)
        done = set(getattr(model, "ppq_recomputed", [])) | set(apply_recompute(model, flags))
        model.ppq_recomputed = sorted(done)


def _optimizer_8bit(model, optimizer, ds_config: dict):
    """``ppq.weights.optimizer_8bit``: build the config's Adam/AdamW as bitsandbytes 8-bit Adam
    (``quant.build_optimizer``) in place of DeepSpeed's; an optimizer given that is not 8-bit is refused."""
    from deepspeed_ppq.integrations.plan_apply import _hyper
    from deepspeed_ppq.quant.optim import build_optimizer

    if optimizer is not None:
        if "8bit" in type(optimizer).__name__.lower():
            return optimizer, ds_config
        raise PPQConfigError(
            f"ppq.weights.optimizer_8bit=true but the optimizer given is {type(optimizer).__name__}: pass "
            "optimizer=None and an Adam/AdamW \"optimizer\" section in the DeepSpeed config (it is built "
            "8-bit), pass deepspeed_ppq.quant.build_optimizer(params, 'adamw8bit'), or set "
            "optimizer_8bit=false")
    sec = ds_config.get("optimizer") or {}
    if str(sec.get("type", "")).lower() not in ("adam", "adamw"):
        raise PPQConfigError(
            f"ppq.weights.optimizer_8bit=true needs an Adam or AdamW optimizer; the DeepSpeed config's "
            f"optimizer.type is {sec.get('type')!r}: set it to 'AdamW' (or 'Adam'), or set "
            "optimizer_8bit=false")
    kind, hp = _hyper(None, ds_config)
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], kind + "8bit", **hp)
    return opt, {k: v for k, v in ds_config.items() if k != "optimizer"}


def _check_params_live(model, optimizer, model_parameters, fmt: str) -> None:
    """The optimizer (or parameter list) given must hold the parameters of the converted model."""
    given = []
    if optimizer is not None and hasattr(optimizer, "param_groups"):
        given = [p for g in optimizer.param_groups for p in g["params"]]
    elif isinstance(model_parameters, (list, tuple)):
        for item in model_parameters:
            given += list(item["params"]) if isinstance(item, dict) else [item]
    live = {id(p) for p in model.parameters()}
    if any(id(p) not in live for p in given):
        raise PPQConfigError(
            f"ppq.weights.format={fmt!r} replaced Linear layers whose parameters the given optimizer/"
            "model_parameters hold: build the optimizer after converting, e.g. PPQPipelineModule(..., "
            "weights=cfg.weights) or quant.convert_model(model, cfg.weights) first, or let DeepSpeed "
            "build it from the config's \"optimizer\" section")


def _wire_requantize(engine) -> None:
    """After each optimizer step: refresh every train-mode ``QuantLinear`` compute copy from its fp32
    master, and update the master-free layers (``weights.master="none"``) in place.

    Whether any stage has master-free layers is agreed over all ranks: their clip norm is a collective,
    so a stage without such layers (say one whose blocks all stay high precision) joins it too."""
    import torch.distributed as dist

    from deepspeed_ppq.quant import QuantLinear, attach_master_free, master_free_layers, requantize_after_step

    module = getattr(engine, "module", None)
    if module is None or engine.optimizer is None:
        return
    if any(isinstance(m, QuantLinear) and m.mode == "train" and not m.master_free for m in module.modules()):
        engine.ppq_requantize_handle = requantize_after_step(engine, module)
    any_master_free = torch.tensor([int(bool(master_free_layers(module)))])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(any_master_free, op=dist.ReduceOp.MAX)
    if any_master_free.item():
        engine.ppq_master_free_handle = attach_master_free(engine, module, allow_empty=True)
