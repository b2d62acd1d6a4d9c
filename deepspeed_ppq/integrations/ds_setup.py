"""Set-up helpers of ``deepspeed_ppq.initialize``: config resolution, model preparation (weights,
recomputation), the 8-bit optimizer of ``ppq.weights.optimizer_8bit``, start-up checks and the
re-quantization hook."""

from __future__ import annotations

import torch
from deepspeed.runtime.pipe.module import PipelineModule

from deepspeed_ppq.config import PPQConfig, PPQConfigError

__all__ = ["check_codecs"]


def check_codecs(cfg: PPQConfig) -> None:
    """Build each direction's encoder and decoder once, so codec settings the codecs reject fail at
    start-up on every rank instead of at the first send on one.

    Raises:
        PPQConfigError: naming the direction and the codec's complaint.
    """
    from deepspeed_ppq.compress import BoundaryDecoder, BoundaryEncoder

    for field, direction in (("activations", "activations"), ("gradients", "gradients")):
        codec = getattr(cfg, field)
        aq = cfg.aqsgd if field == "activations" and cfg.aqsgd.enabled else None
        try:
            BoundaryEncoder(codec, name=f"ppq.{field}", aqsgd=aq, direction=direction, nonfinite="skip")
            BoundaryDecoder(codec, name=f"ppq.{field}", aqsgd=aq, direction=direction)
        except ValueError as err:
            settings = codec.model_dump(mode="json")
            raise PPQConfigError(f"ppq.{field}={settings} is not usable: {err}") from None


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
    from deepspeed_ppq.integrations.stage import (
        apply_recompute,
        apply_weights,
        infer_block_layers,
        recompute_flags,
    )
    from deepspeed_ppq.quant import QuantLinear, convert_model

    is_pipe = isinstance(model, PipelineModule)
    if is_pipe and block_layers is None:
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
        recompute_stages = (ds_config.get("pipeline") or {}).get("recompute_stages")
        if recompute_stages is not None and is_pipe:
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
