"""Carry a tuned plan out in the user's own run: ``"ppq": {"plan_file": "plan.json"}`` or
``deepspeed_ppq.initialize(..., plan=...)``.

The plan fixes what the tuner measured: stage boundaries, each Linear's weight format (exact rules),
recomputation per stage, micro-batch size and count, the optimizer kind (fp32 or 8-bit Adam states,
master-free weights) and the codecs. ``apply_plan`` checks that the plan was made for this model
(fingerprint) and this world size, rebuilds the pipeline module at the plan's boundaries, rebuilds the
optimizer with the user's hyper-parameters in the plan's kind, and rewrites the DeepSpeed config's
batch sizes and ``"ppq"`` section; everything else in the user's config stays.
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist
from deepspeed.pipe import PipelineModule

from deepspeed_ppq.autotune.plan import Plan, PlanError, load_plan
from deepspeed_ppq.config import PPQConfigError
from deepspeed_ppq.integrations.model_layers import (
    checkpointable_names,
    model_fingerprint,
    recompute_layer_flags,
)

__all__ = ["apply_plan", "plan_module"]


def plan_module(plan: Plan, specs: list, loss_fn, weights: dict | None = None, block_layers=None,
                rank: int | None = None, **kwargs):
    """The ``PPQPipelineModule`` of this rank's stage under ``plan``: the plan's boundaries and
    topology, its per-Linear formats (exact rules over ``weights``' other settings), and recomputation
    (DeepSpeed's ``activation_checkpoint_interval`` on this stage, every layer but the embedding ones
    checkpointed, as the cost model assumes; a stage that keeps its last layers' activations checkpoints
    the others one by one). The tuner's trials and the user's run build it alike.

    Args:
        weights: ``ppq.weights`` fields to keep (block size, scale dtype, ...); format and rules come
            from the plan.
        kwargs: more ``PipelineModule`` arguments (``seed_layers``, ``base_seed``, ...).
    """
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule
    from deepspeed_ppq.integrations.stage import infer_block_layers

    if block_layers is None:
        block_layers = infer_block_layers(specs)
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    stage = rank // plan.data_parallel
    w = {k: v for k, v in (weights or {}).items() if k not in ("format", "rules")}
    w.update(plan.ppq_section()["weights"])
    sp = plan.stages[stage]
    if sp.recompute and sp.keep_last:  # partial: the recomputed layers one by one
        rc = {"activation_checkpoint_interval": 0, "recompute_layers": recompute_layer_flags(
            specs, block_layers, [i for i in range(*sp.layers) if sp.recomputes(i)])}
    else:
        rc = {"activation_checkpoint_interval": 1 if sp.recompute else 0}
    module = PPQPipelineModule(
        specs, topology=PipeDataParallelTopology(num_pp=plan.pipeline_degree, num_dp=plan.data_parallel),
        boundaries=plan.boundaries, loss_fn=loss_fn, weights=w, block_layers=block_layers,
        checkpointable_layers=checkpointable_names(specs, block_layers), **rc, **kwargs)
    module.ppq_plan = plan
    return module


def _hyper(optimizer, ds_config: dict) -> tuple[str, dict]:
    """The optimizer family (``adam``/``adamw``) and its hyper-parameters, from the optimizer given or
    the config's ``"optimizer"`` section."""
    if optimizer is not None:
        d = optimizer.defaults
        kind = "adamw" if "adamw" in type(optimizer).__name__.lower() else "adam"
        return kind, {k: d[k] for k in ("lr", "betas", "eps", "weight_decay") if k in d}
    sec = ds_config.get("optimizer") or {}
    kind = "adamw" if "adamw" in str(sec.get("type", "adam")).lower() else "adam"
    hp = dict(sec.get("params") or {})
    out = {k: hp[k] for k in ("lr", "eps", "weight_decay") if k in hp}
    if "betas" in hp:
        out["betas"] = tuple(hp["betas"])
    return kind, out


def _match_threads(plan: Plan, source: str) -> None:
    """On CPU, compute with the intra-op threads per rank the plan's times were measured with: launchers
    leave each rank PyTorch's default (every core), which oversubscribes the cores as soon as two ranks
    share a machine, and the plan's measured step time would not hold."""
    import torch

    want = plan.threads_per_rank
    if not want or torch.cuda.is_available() or torch.get_num_threads() == want:
        return
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"ppq: {source} was measured with {want} intra-op thread(s) per rank; using "
              f"torch.set_num_threads({want}) (was {torch.get_num_threads()})", flush=True)
    torch.set_num_threads(want)


def apply_plan(plan: Plan | str, model, optimizer, ds_config: dict, args=None):
    """Rebuild ``model``, the optimizer and the config to carry ``plan`` out.

    Args:
        plan: a ``Plan`` or the path of a plan file (``str`` or ``os.PathLike``).
        model: the user's ``PipelineModule`` (built with any partition).
        optimizer: the user's optimizer (its hyper-parameters are kept) or None (the config's
            ``"optimizer"`` section gives them, or Adam's defaults).
        ds_config: the DeepSpeed config as a dict.
        args: the launcher's args; a copy without ``deepspeed_config`` is returned, since the config
            now comes as a dict.

    Returns:
        ``(model, optimizer, ds_config, args)``.

    Raises:
        PlanError: the plan is not a ``Plan`` or path, is unreadable, for another model or another
            world size.
    """
    from deepspeed_ppq.quant import build_optimizer

    if isinstance(plan, (str, os.PathLike)):
        source = f"plan file {plan}"
        plan = load_plan(plan)
    elif isinstance(plan, Plan):
        source = "the plan"
        plan.check()  # built or edited in code: not checked by load_plan
    else:
        raise PlanError(f"plan={plan!r} must be a Plan or the path of a plan file (str or os.PathLike), "
                        f"got a {type(plan).__name__}")
    if not isinstance(model, PipelineModule):
        raise PPQConfigError(f"{source} describes pipeline stages: the model must be a PipelineModule, got "
                             f"{type(model).__name__}")
    built = getattr(model, "ppq_plan", None)
    if built is None or built.to_dict() != plan.to_dict():
        # (PPQPipelineModule.from_config checked a module it built from this plan before converting it:
        # layers given as modules are converted in place, and their fingerprint changes with it)
        plan.check_model(model_fingerprint(model), source)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.world_size:
        raise PlanError(f"{source} is for world_size={plan.world_size}; this job has {world} ranks: re-run "
                        "`ppq tune` with this many ranks")
    _match_threads(plan, source)
    weights = dict((ds_config.get("ppq") or {}).get("weights") or {})
    if built is not None and built.to_dict() == plan.to_dict():
        new = model  # PPQPipelineModule.from_config built it from this plan already
    else:
        new = plan_module(plan, list(model._layer_specs), model.loss_fn, weights,
                          getattr(model, "block_layers", None), seed_layers=model.seed_layers,
                          base_seed=model.base_seed, seed_fn=model.seed_fn)
    weights = {**{k: v for k, v in weights.items() if k not in ("format", "rules")},
               **plan.ppq_section()["weights"]}
    kind, hp = _hyper(optimizer, ds_config)
    opt = None
    if optimizer is not None or plan.optimizer_8bit or ds_config.get("optimizer"):
        params = [p for p in new.parameters() if p.requires_grad]
        opt = build_optimizer(params, kind + ("8bit" if plan.optimizer_8bit else ""), fused=True, **hp)
    cfg = {k: v for k, v in ds_config.items() if k not in ("optimizer", "train_batch_size",
                                                           "train_micro_batch_size_per_gpu",
                                                           "gradient_accumulation_steps")}
    cfg.update(train_batch_size=plan.global_batch, train_micro_batch_size_per_gpu=plan.micro_batch_size,
               gradient_accumulation_steps=plan.num_microbatches)
    ppq = {k: v for k, v in (ds_config.get("ppq") or {}).items() if k not in ("plan_file",)}
    section = plan.ppq_section()
    ppq.update(activations=section["activations"], gradients=section["gradients"],
               partition=section["partition"], weights=weights)
    cfg["ppq"] = ppq
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        args = argparse.Namespace(**{**vars(args), "deepspeed_config": None})
    return new, opt, cfg, args
