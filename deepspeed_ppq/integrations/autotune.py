"""Tuning the user's own DeepSpeed pipeline model: the DeepSpeed runner and the public entry points.

* ``DeepSpeedRunner``: the ``autotune.TuningRunner`` for DeepSpeed's pipeline engine. It takes the
  user's ``PipelineModule`` (or its list of layers / ``LayerSpec`` / ``TiedLayerSpec``), loss, data and
  DeepSpeed config; profiles the layers; says how DeepSpeed's own partition methods cut them; and runs a
  trial plan as a fresh ``PPQPipelineModule`` + ``PPQPipelineEngine`` (the plan's boundaries, weight
  formats, recomputation, micro-batches, optimizer and codecs) for a few real steps, measuring time per
  step and instruction, each stage's peak memory by category (``autotune.memory.StageMemTracker``)
  and validation loss.
* ``autotune(model, loss_fn, train_data, val_data, config)``: the whole loop on every rank of the
  running job (``deepspeed_ppq.autotune(...)`` calls it); returns the accepted ``Plan``.

The model as a list of layers is ``integrations.model_layers``; ``ppq tune script.py`` is
``integrations.tune_cli``.

Each trial starts from the same initial weights: ``LayerSpec`` layers are built with DeepSpeed's
per-layer seeds (``seed_layers``, ``base_seed`` + the seed of the trial), modules given as objects are
copied from a pristine copy.
"""

from __future__ import annotations

import copy
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from deepspeed_ppq.autotune import profiler
from deepspeed_ppq.autotune.loop import codec_dict, tune
from deepspeed_ppq.autotune.memory import CATEGORIES, StageMemTracker
from deepspeed_ppq.autotune.plan import Plan
from deepspeed_ppq.autotune.report import write_outputs
from deepspeed_ppq.autotune.runner import Profile, StageMeasurement, TrialResult
from deepspeed_ppq.config import PPQConfigError, WeightsConfig, load_ppq_config
from deepspeed_ppq.integrations.model_layers import (
    build_layers,
    deepspeed_partitions,
    layer_kinds,
    layer_name,
    layer_specs,
    model_fingerprint,
)
from deepspeed_ppq.integrations.stage import infer_block_layers

__all__ = ["DeepSpeedRunner", "autotune"]

# the engine instructions of the step phase (memory is measured per phase)
_STEP_INSTRUCTIONS = ("ReduceGrads", "ReduceTiedGrads", "OptimizerStep")

# DeepSpeed's engine flattens the gradients into one buffer for its data-parallel reduce (even with
# one replica): about one fp32 gradient per parameter. A prior; the loop refits what the engine holds
# beyond it from measurements. In bf16 mode the gradients are already one flat fp32 buffer
# (BF16_Optimizer's, in the static bytes) and a step measured no transient beside it.
_DS_STEP_TRANSIENT = {False: 4.0, True: 0.0}  # by bf16 mode


def _bf16_mode(ds_config: dict) -> bool:
    """Whether ``ds_config`` turns on DeepSpeed's bf16 mode (bf16 weights and compute, BF16_Optimizer):
    its ``bf16`` section, or the older name ``bfloat16``."""
    return any((ds_config.get(k) or {}).get("enabled") for k in ("bf16", "bfloat16"))


def _grads_freed_after_step(ds_config: dict) -> bool:
    """Whether DeepSpeed's engine frees the parameter gradients after its step: in fp32 without ZeRO it
    sets every ``.grad`` to None (``DeepSpeedEngine.zero_grad``); the bf16/fp16 and ZeRO optimizers keep
    gradient buffers of their own."""
    mixed = _bf16_mode(ds_config) or (ds_config.get("fp16") or {}).get("enabled")
    return not mixed and not (ds_config.get("zero_optimization") or {}).get("stage", 0)


def _master_free_updates_in_backward(ds_config: dict) -> bool:
    """Whether the engine a plan of one micro-batch per step builds from ``ds_config`` updates its
    master-free weights in their backward (``quant.master_free.updates_in_backward``)."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from deepspeed_ppq.quant.master_free import updates_in_backward

    clip = ds_config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    return updates_in_backward(1, float(clip or 0.0), bool((ds_config.get("fp16") or {}).get("enabled")))


# ----------------------------------------------------------------------------------------------
# The runner
# ----------------------------------------------------------------------------------------------
def _stack(items: list):
    """Collate dataset items (tuples of tensors) into one batch."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(items)
    if isinstance(first, (tuple, list)):
        return tuple(_stack([it[k] for it in items]) for k in range(len(first)))
    return torch.as_tensor(items)


def _batches(dataset, order: list[int], b: int, start: int, count: int) -> list:
    n = len(order)
    return [_stack([dataset[order[(start + k * b + j) % n]] for j in range(b)]) for k in range(count)]


class DeepSpeedRunner:
    """``TuningRunner`` for DeepSpeed's pipeline engine (see the module docstring).

    Args:
        model: a ``PipelineModule`` or its list of layers / ``LayerSpec``s / ``TiedLayerSpec``s.
        loss_fn: ``loss_fn(output, labels)`` (default: the ``PipelineModule``'s).
        train_data, val_data: map-style datasets of ``(inputs, labels)`` items.
        ds_config: the DeepSpeed config (its ``"optimizer"`` gives learning rate and betas).
        weights: the precision policy (``ppq.weights``) low-bit formats are decided under.
        block_layers: global indices of the repeated blocks (default: inferred).
    """

    def __init__(self, model, loss_fn, train_data, val_data, ds_config: dict, *,
                 weights: WeightsConfig | None = None, block_layers: list[int] | None = None):
        self.specs = layer_specs(model)
        self.loss_fn = loss_fn or getattr(model, "loss_fn", None)
        if self.loss_fn is None:
            raise PPQConfigError("autotune needs a loss: pass loss_fn=... or a PipelineModule built with one")
        self.train_data, self.val_data = train_data, val_data
        self.ds_config = dict(ds_config)
        self.weights = weights or WeightsConfig()
        self.block_layers = list(block_layers) if block_layers is not None else (
            getattr(model, "block_layers", None) or infer_block_layers(self.specs))
        self.kinds = layer_kinds(self.specs, self.block_layers)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        # modules given as objects: trials copy these pristine ones
        self._pristine = [copy.deepcopy(s) if isinstance(s, nn.Module) else s for s in self.specs]
        self._fingerprint = model_fingerprint(self.specs)

    # ----- protocol ------------------------------------------------------------------------------
    def fingerprint(self) -> dict:
        return self._fingerprint

    def share(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[ppq tune] {message}", flush=True)

    def stock_partitions(self, pipeline_degree: int) -> dict[str, list[int]]:
        """DeepSpeed's own ``uniform``, ``parameters`` (trainable parameters, as DeepSpeed counts them)
        and ``type:<block class>`` cuts."""
        counts = [sum(q.numel() for q in m.parameters() if q.requires_grad)
                  for m in build_layers(self.specs, device="meta")]
        block = layer_name(self.specs[self.block_layers[0]]).split("[")[0] if self.block_layers else None
        return deepspeed_partitions(counts, pipeline_degree, self.block_layers, block)

    def profile(self, settings) -> Profile:
        """Profile the layers with the ranks sharing the (layer, micro-batch size) pairs
        (``profile_layers``' ``share``: each rank a mix of small and large sizes; rank 0 merges and adds
        the codecs and optimizer costs), then the link between rank pairs. A profile cached on rank 0 is
        measured by none."""
        fmts = [getattr(f, "value", f) for f in settings.formats]
        gb = settings.global_batch or self.ds_config.get("train_batch_size") or 8
        from deepspeed_ppq.autotune.loop import default_micro_batch_sizes

        mbs = sorted(settings.micro_batch_sizes or default_micro_batch_sizes(gb))
        timed = sorted({mbs[0], mbs[-1]})
        codecs = {json.dumps(codec_dict(c), sort_keys=True): codec_dict(c)
                  for c in [*settings.activation_codecs, *settings.gradient_codecs]}
        payload = None
        bf16 = _bf16_mode(self.ds_config)
        grad_dtype = settings.master_free_grad_dtype
        layers = build_layers(self.specs) if self.rank == 0 else None  # the cache key's
        if self.rank == 0:
            key = profiler.profile_key(layers, mbs=timed, formats=fmts, reps=settings.profile_reps,
                                       weights=self.weights.model_dump(mode="json"), codecs=sorted(codecs),
                                       master_free_grad_dtype=grad_dtype, bf16_mode=bf16)
            cached = profiler.load_cached(settings.profile_cache, key) if settings.profile_cache else None
            if cached is not None:
                try:
                    Profile.from_dict(cached["profile"])
                    payload = cached["profile"]
                except (KeyError, TypeError, ValueError) as e:
                    import warnings

                    warnings.warn(f"profile cache {settings.profile_cache} does not hold a usable profile "
                                  f"({type(e).__name__}: {e}); measuring again", stacklevel=2)
        if self.share(payload is None):  # not cached: every rank measures its share of layers and sizes
            def make_batch(b):
                return _stack([self.train_data[i][:2] for i in range(b)])

            dtype = torch.bfloat16 if bf16 else torch.float32
            if layers is None:
                layers = build_layers(self.specs)
            part = profiler.profile_layers(layers, self.kinds, make_batch, self.loss_fn, self.weights, fmts,
                                           timed, reps=settings.profile_reps, dtype=dtype,
                                           share=(self.rank, self.world_size))
            parts = [None] * self.world_size
            dist.all_gather_object(parts, part)
            if self.rank == 0:
                lprof = profiler.merge_parts(parts)
                boundary = max(lprof[:-1], key=lambda lp: lp.output_bytes) if len(lprof) > 1 else lprof[0]
                shape = (mbs[-1], max(1, boundary.output_bytes // dtype.itemsize))
                prof = Profile(layers=lprof, codecs=profiler.profile_codecs(list(codecs.values()), shape),
                               link=profiler.DEFAULT_LINK,
                               optimizer_costs=profiler.optimizer_costs(grad_dtype=grad_dtype),
                               step_transient_bytes_per_param=_DS_STEP_TRANSIENT[bf16])
                payload = prof.to_dict()
                if settings.profile_cache:
                    profiler.save_profile(settings.profile_cache, key, payload)
        payload = self.share(payload)
        prof = Profile.from_dict(payload)
        link = self.share(profiler.measure_link())
        prof.link = link
        prof.threads_per_rank = torch.get_num_threads()
        prof.grads_freed_after_step = _grads_freed_after_step(self.ds_config)
        prof.master_free_update_in_backward = _master_free_updates_in_backward(self.ds_config)
        prof.bf16_mode = bf16
        return prof

    # ----- a trial ----------------------------------------------------------------------------------
    def _optimizer(self, params, eight_bit: bool):
        from deepspeed_ppq.quant import build_optimizer

        opt = self.ds_config.get("optimizer") or {}
        kind = str(opt.get("type", "adam")).lower()
        kind = "adamw" if "adamw" in kind else "adam"
        hp = dict(opt.get("params") or {})
        kw = {k: hp[k] for k in ("lr", "weight_decay", "eps") if k in hp}
        if "betas" in hp:
            kw["betas"] = tuple(hp["betas"])
        # torch's fused Adam for fp32 states, the fastest a stock user has: baseline and plan alike
        return build_optimizer(params, kind + ("8bit" if eight_bit else ""), fused=True, **kw)

    def _trial_specs(self) -> list:
        return [copy.deepcopy(s) if isinstance(s, nn.Module) else s for s in self._pristine]

    def run_trial(self, plan: Plan, settings, seed: int = 0, steps: int | None = None,
                  timing_only: bool = False) -> TrialResult:
        import deepspeed_ppq
        from deepspeed_ppq.integrations.plan_apply import plan_module

        rank, world = self.rank, self.world_size
        stage, replica = divmod(rank, plan.data_parallel)
        if torch.cuda.is_available():  # the device allocator's peak, per trial
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(1234 + seed)
        groups_before = set(_process_groups())  # the PipelineModule makes its grid's
        module = plan_module(plan, self._trial_specs(), self.loss_fn, self.weights.model_dump(mode="json"),
                             self.block_layers, seed_layers=True, base_seed=1234 + seed)
        optimizer = self._optimizer([p for p in module.parameters() if p.requires_grad], plan.optimizer_8bit)
        section = plan.ppq_section()
        ds_cfg = {k: v for k, v in self.ds_config.items() if k not in ("optimizer", "ppq", "scheduler")}
        ds_cfg.update(train_batch_size=plan.global_batch,
                      train_micro_batch_size_per_gpu=plan.micro_batch_size,
                      gradient_accumulation_steps=plan.num_microbatches, steps_per_print=10**9)
        ds_cfg["ppq"] = {k: v for k, v in section.items() if k != "weights"}
        engine, _, _, _ = deepspeed_ppq.initialize(model=module, optimizer=optimizer, config=ds_cfg)
        instr: dict[str, float] = {}
        timing = [False]
        tracker = StageMemTracker()

        def timed(name, fn):
            phase = "step" if name in _STEP_INSTRUCTIONS else "pipeline"

            def run(self_, *a, **k):
                if tracker._depth:
                    tracker.enter_phase(phase)
                t0 = time.perf_counter()
                try:
                    return fn(self_, *a, **k)
                finally:
                    if timing[0]:
                        instr[name] = instr.get(name, 0.0) + time.perf_counter() - t0
            return run

        # per-instruction times (DeepSpeed's wall_clock_breakdown crashes the PipelineEngine in 0.19.8)
        engine._INSTRUCTION_MAP = {k: timed(k.__name__, v) for k, v in type(engine)._INSTRUCTION_MAP.items()}
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(self.train_data), generator=g).tolist()
        b, m = plan.micro_batch_size, plan.num_microbatches
        times = []

        def step(k: int, sync: bool = True) -> None:
            data = _batches(self.train_data, order, b, (k * plan.data_parallel + replica) * b * m, m)
            if sync:
                dist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(iter(data))
            times.append(time.perf_counter() - t0)

        # timed steps follow each other as in training, with no barrier between them: a barrier before
        # every step had added the pipeline's fill and drain across stages to each one (a two-stage
        # stock configuration of the pre-training workload measured 128.0-128.8 ms a step in the example
        # script, 132.3-139.7 with a barrier before each), which one-stage plans do not pay
        n = steps or settings.trial_steps
        for k in range(n):
            timing[0] = k >= settings.warmup_steps
            step(k, sync=k == 0)
        timing[0] = False
        if steps is None and not timing_only:
            # memory: two more steps under the tracker (it slows every op, so it times nothing), its peak
            # kept apart for the pipeline (forward, backward, sends) and the step (reduce, optimizer)
            tracker.track_external(module, optimizer, *_engine_tensors(engine))
            for category, tensors in _wrapper_tensors(engine.optimizer).items():
                tracker.track_tensors(category, tensors)
            with tracker:
                for k in range(n, n + 2):
                    step(k)
            memory = tracker.peak()
            memory["phases"] = tracker.phase_peaks()
        else:  # a quality run (validation loss after ``steps`` steps) or timing only: memory not measured
            memory = dict.fromkeys((*CATEGORIES, "total"), 0)
        times = times[:n]
        # every plan is evaluated on the same val_batches x global batch samples: each data-parallel
        # replica on its own share (the engine averages the replicas' losses)
        val = torch.tensor(float("nan"))
        if not timing_only:
            val_order = list(range(len(self.val_data)))
            losses = []
            for k in range(settings.val_batches):
                vb = _batches(self.val_data, val_order, b, (k * plan.data_parallel + replica) * b * m, m)
                loss = engine.eval_batch(iter(vb))
                losses.append(float(loss) if loss is not None else 0.0)
            val = torch.tensor(statistics.mean(losses))
            dist.all_reduce(val, op=dist.ReduceOp.MAX)  # the last stage holds the loss, the others 0
        mine = {"stage": stage, "times": times, "instructions": {k: v / (n - settings.warmup_steps)
                                                                 for k, v in instr.items()}, "memory": memory,
                "device_max": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
                "wire": {f"{k[0]}.{k[1]}": v for k, v in engine.ppq_stats().items()}}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        engine = module = optimizer = tracker = None  # free this trial before the next one is built
        gc.collect()
        # and the process groups its engine made (DeepSpeed makes its grid's afresh for every engine): each
        # held its connections and threads (gloo: ~15 threads a trial) for the rest of the tuning run
        for pg in set(_process_groups()) - groups_before:
            dist.destroy_process_group(pg)
        stages = []
        for s in range(plan.pipeline_degree):
            rs = [r for r in gathered if r["stage"] == s]
            mem = dict(max((r["memory"] for r in rs), key=lambda m: m["total"]))
            dmax = [r["device_max"] for r in rs if r["device_max"] is not None]
            stages.append(StageMeasurement(s, rs[0]["instructions"], mem, max(dmax) if dmax else None))
        step_times = [max(r["times"][k] for r in gathered) for k in range(len(times))]
        wire = {}
        for r in gathered:
            wire.update(r["wire"])
        return TrialResult(step_times, settings.warmup_steps, float(val), stages, wire)


def _process_groups() -> list:
    """The process groups this rank holds, the default one aside."""
    from torch.distributed import distributed_c10d as c10d

    return [pg for pg in c10d._world.pg_map if pg is not c10d._world.default_pg]


def _engine_tensors(engine) -> list[torch.Tensor]:
    """The pipe engine's long-lived buffers (allocated on the first step, before the tracker saw them)."""
    out = []
    for name in ("pipe_recv_buf", "grad_layer"):
        t = getattr(engine, name, None)
        for x in t if isinstance(t, (tuple, list)) else (t,):
            if isinstance(x, torch.Tensor):
                out.append(x)
    for key in ("inputs", "outputs"):
        for t in engine.pipe_buffers.get(key, []):
            for x in t if isinstance(t, (tuple, list)) else (t,):
                if isinstance(x, torch.Tensor):
                    out.append(x)
    return out


# DeepSpeed's bf16 mode (``"bf16": {"enabled": true}``) wraps the client optimizer in BF16_Optimizer,
# which allocates, when the engine is built, flat buffers of its own: fp32 master weights (the inner
# optimizer's parameters) and fp32 gradients accumulated over the micro-batches. Attribute -> category.
_BF16_OPTIMIZER_BUFFERS = {"fp32_groups_flat_partition": "parameters",
                           "fp32_groups_gradients_flat": "gradients"}


def _wrapper_tensors(optimizer) -> dict[str, list[torch.Tensor]]:
    """A mixed-precision optimizer wrapper's own long-lived buffers, by memory category (empty for a
    plain optimizer). Handed to nothing, the tracker counts them as activations, and the memory model
    then fits the bf16 mode's masters and gradient buffer as activations per micro-batch."""
    return {cat: [t for t in getattr(optimizer, name, None) or [] if isinstance(t, torch.Tensor)]
            for name, cat in _BF16_OPTIMIZER_BUFFERS.items() if getattr(optimizer, name, None)}


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------
def _split_val(train_data, n: int):
    from torch.utils.data import Subset

    total = len(train_data)
    if total <= n:
        raise PPQConfigError(f"ppq.autotune.val_samples={n}: the training data has only {total} samples; "
                             "pass val_data or lower val_samples")
    return Subset(train_data, range(total - n)), Subset(train_data, range(total - n, total))


def _global_batch(settings, ds_config: dict) -> int:
    if settings.global_batch:
        return settings.global_batch
    if ds_config.get("train_batch_size"):
        return int(ds_config["train_batch_size"])
    mb = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    if mb and gas:
        return int(mb) * int(gas)
    raise PPQConfigError("autotune needs the global batch: set train_batch_size in the DeepSpeed config or "
                         "ppq.autotune.global_batch")


def autotune(model, loss_fn=None, train_data=None, val_data=None, config=None, *, block_layers=None,
             out_dir: str | None = None) -> Plan | None:
    """Tune ``model`` on every rank of the running job (``torch.distributed`` initialised, or it is
    initialised here from the launcher's environment).

    Args:
        model: a DeepSpeed ``PipelineModule`` or its list of layers / ``LayerSpec``s (tied included).
        loss_fn: ``loss_fn(output, labels)``; default: the ``PipelineModule``'s.
        train_data: map-style dataset of ``(inputs, labels)``.
        val_data: the same for validation; default: the last ``ppq.autotune.val_samples`` of
            ``train_data`` are held out.
        config: the DeepSpeed config (dict or JSON path) with its ``"ppq"."autotune"`` section.
        out_dir: where ``plan.json``, ``report.md`` and ``tune.json`` go (default: the section's).

    Returns:
        The plan to train with (on every rank): the tuned plan if it passed the memory and quality
        checks and ran faster than the best stock configuration, else that stock configuration.
    """
    import deepspeed

    from deepspeed_ppq.integrations.ds_setup import _resolve_ds_config

    if train_data is None:
        raise PPQConfigError("autotune needs train_data: a map-style dataset of (inputs, labels)")
    ds_config = _resolve_ds_config(None, config, None)
    ppq = load_ppq_config(ds_config.get("ppq"))
    settings = ppq.autotune
    if out_dir is not None:
        settings = settings.model_copy(update={"out_dir": out_dir})
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if val_data is None:
        train_data, val_data = _split_val(train_data, settings.val_samples)
    runner = DeepSpeedRunner(model, loss_fn, train_data, val_data, ds_config, weights=ppq.weights,
                             block_layers=block_layers)
    if len(runner.specs) < 2:
        raise PPQConfigError(f"the model has {len(runner.specs)} layer(s): a pipeline needs at least 2")
    result = tune(runner, settings, _global_batch(settings, ds_config))
    if dist.get_rank() == 0:
        write_outputs(result, Path(settings.out_dir))
    dist.barrier()
    return Plan.from_dict(result["plan"])
