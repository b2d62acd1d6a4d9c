"""A ``PipelineModule`` with explicit stage boundaries, low-bit weights and per-stage recomputation.

DeepSpeed 0.19.8 partitions layers by ``uniform``, ``parameters`` or ``type:<regex>`` only; the
planner (and users) want exact cuts such as ``[0, 3, 10]``. ``PipelineModule.__init__`` calls
``self._partition_layers(method)`` before it builds the local layers, so overriding that one method
is enough: set ``self.parts`` and the stage's bounds, exactly as the stock methods do.

API (what the demo and the autotuner call)::

    module = PPQPipelineModule(
        layers, num_stages=2, boundaries=[0, 3, 6], loss_fn=loss,
        weights=WeightsConfig(format="int8"),   # ppq.weights, applied to this stage's Linear layers
        block_layers=[1, 2, 3, 4],               # GLOBAL indices of the transformer blocks (inferred:
                                                 #   the most frequent layer type, see stage.py)
        recompute_stages=[True, False],          # or True, or stage indices [0], or
        # recompute_layers=[False, True, ...],   # one flag per global layer
    )
    # or, from a whole DeepSpeed config / "ppq" section (partition + weights):
    module = PPQPipelineModule.from_config(layers, 2, ds_config, loss_fn=loss, recompute_stages=[0])

``module.ppq_quantized`` lists this stage's layers that became ``QuantLinear`` (global names such as
``"3.mlp.fc"``: "first/last N blocks" count over the whole model), ``module.ppq_recomputed`` the
global indices of this stage's layers run under activation checkpointing. Build the optimizer after
the module (conversion replaces the Linear parameters); ``deepspeed_ppq.initialize`` re-quantizes the
compute copies after every optimizer step by itself.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence

import numpy as np
import torch
from deepspeed.pipe import PipelineModule

from deepspeed_ppq.config import PPQConfig, PPQConfigError, WeightsConfig, load_ppq_config
from deepspeed_ppq.integrations.capture import is_capturing
from deepspeed_ppq.integrations.stage import (
    apply_recompute,
    apply_weights,
    check_block_layers,
    infer_block_layers,
    recompute_flags,
)

__all__ = ["PPQPipelineModule", "check_boundaries", "seed_layer"]


def check_boundaries(boundaries: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate explicit stage boundaries ``[0, b1, ..., num_layers]``.

    Returns:
        The boundaries as a list of ints.

    Raises:
        PPQConfigError: naming ``partition.boundaries``, the value and what is allowed.
    """
    items = None if isinstance(boundaries, (str, bytes)) else list(boundaries)
    if items is None or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in items):
        raise PPQConfigError(f"ppq.partition.boundaries={boundaries!r}: must be a list of integer layer "
                             f"indices, e.g. {_example(num_layers, num_stages)}")
    b = [int(x) for x in items]
    problems = []
    if len(b) != num_stages + 1:
        problems.append(f"needs num_stages + 1 = {num_stages + 1} entries, got {len(b)}")
    if not b or b[0] != 0:
        problems.append("must start at 0")
    if b and b[-1] != num_layers:
        problems.append(f"must end at the number of layers ({num_layers})")
    if any(x >= y for x, y in zip(b, b[1:])):
        problems.append("must be strictly increasing (every stage needs at least one layer)")
    if problems:
        raise PPQConfigError(
            f"ppq.partition.boundaries={b}: " + "; ".join(problems)
            + f", e.g. {_example(num_layers, num_stages)}"
        )
    return b


def _example(num_layers: int, num_stages: int) -> list[int]:
    return [round(i * num_layers / num_stages) for i in range(num_stages + 1)]


def seed_layer(seed: int) -> None:
    """DeepSpeed's per-layer seeding (``deepspeed.runtime.utils.set_random_seed``: Python's, NumPy's and
    torch's generators to ``seed``), with torch's generators seeded directly: the CPU one, and CUDA's and
    XPU's once initialised. ``torch.manual_seed`` also queues the seed for every device backend not
    initialised yet (CUDA, XPU, MTIA) and formats the caller's stack for each: 0.3-1.2 ms a call on a
    machine without a GPU, and a ``PipelineModule`` with ``seed_layers`` seeds every layer of every
    micro-batch, recomputed ones again (20,000 calls in one tuning run). The default ``seed_fn`` of
    ``PPQPipelineModule``.

    ``seed`` may be any integer type: with ``partition_method="parameters"`` (DeepSpeed's default) the
    stage's first layer index is a NumPy integer, which ``random.seed`` refuses (DeepSpeed 0.19.8's own
    ``PipelineModule`` with ``seed_layers`` fails there on Python >= 3.11)."""
    seed = operator.index(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    seed %= 2**63
    for device in (torch.cuda, torch.xpu):
        if device.is_initialized():
            device.manual_seed_all(seed)
    torch.default_generator.manual_seed(seed)


def _inputs_needing_grad(checkpoint_func):
    """DeepSpeed's activation checkpoint is reentrant: a segment none of whose inputs needs a gradient
    (the blocks behind a frozen embedding, in a LoRA fine-tune) returns outputs that need none either,
    and the trainable parameters inside it silently get no gradient. Floating-point inputs are made to
    need one (as PEFT's ``enable_input_require_grads`` does); their gradient is computed and dropped."""
    if getattr(checkpoint_func, "ppq_inputs_need_grad", False):
        return checkpoint_func

    def run(function, *args):
        args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                     and not a.requires_grad else a for a in args)
        return checkpoint_func(function, *args)

    run.ppq_inputs_need_grad = True
    return run


class PPQPipelineModule(PipelineModule):
    """``PipelineModule`` with ``partition_method="explicit"`` and ``boundaries=[0, b1, ..., L]``.

    Args:
        layers: the layer list (modules or ``LayerSpec``), as for ``PipelineModule``.
        num_stages: number of pipeline stages.
        boundaries: explicit cuts; stage ``s`` owns layers ``[boundaries[s], boundaries[s+1])``.
            When given, ``partition_method`` defaults to ``"explicit"``.
        weights: ``ppq.weights`` (``WeightsConfig`` or dict): low-bit storage of this stage's Linear layers
            under the precision policy, decided with global layer indices.
        block_layers: global indices of the transformer blocks (default: ``infer_block_layers``).
        recompute_stages: ``True``, one bool per stage, or stage indices: those stages run their block
            layers under activation checkpointing.
        recompute_layers: one bool per global layer instead.
        **kwargs: everything else ``PipelineModule`` takes (``loss_fn``, ``topology``, ...); with
            ``seed_layers`` and no ``seed_fn``, the layers are seeded by ``seed_layer``.
    """

    def __init__(self, layers, num_stages: int | None = None, *, boundaries: Sequence[int] | None = None,
                 partition_method: str | None = None, weights: WeightsConfig | dict | None = None,
                 block_layers: Sequence[int] | None = None, recompute_stages=None, recompute_layers=None,
                 **kwargs):
        if partition_method is None:
            partition_method = "explicit" if boundaries is not None else "parameters"
        if partition_method.lower() == "explicit" and boundaries is None:
            raise PPQConfigError("partition_method='explicit' needs boundaries=[0, b1, ..., num_layers]")
        if boundaries is not None and partition_method.lower() != "explicit":
            raise PPQConfigError(
                f"boundaries={list(boundaries)} are only used with partition_method='explicit' "
                f"(got {partition_method!r})"
            )
        self._ppq_boundaries = boundaries
        weights = _weights_config(weights)
        if kwargs.get("seed_layers") and kwargs.get("seed_fn") is None:
            kwargs["seed_fn"] = seed_layer
        super().__init__(layers, num_stages=num_stages, partition_method=partition_method, **kwargs)
        self.activation_checkpoint_func = _inputs_needing_grad(self.activation_checkpoint_func)
        self.block_layers = check_block_layers(block_layers, len(self._layer_specs)) \
            if block_layers is not None else infer_block_layers(self._layer_specs)
        self.ppq_weights = weights
        # under `ppq tune` the layers stay as given: the tuner decides their formats
        self.ppq_quantized = [] if is_capturing() else apply_weights(self, weights, self.block_layers)
        flags = recompute_flags(len(self._layer_specs), self.parts, recompute_stages=recompute_stages,
                                recompute_layers=recompute_layers, block_layers=self.block_layers)
        self.ppq_recomputed = apply_recompute(self, flags)

    @classmethod
    def from_config(cls, layers, num_stages: int, config: PPQConfig | dict | str | None, **kwargs):
        """Build with the partition and weights of a ``"ppq"`` config (or a whole DeepSpeed config
        containing one); ``kwargs`` as ``__init__`` (``block_layers``, ``recompute_stages``, ...)."""
        cfg = load_ppq_config(_ppq_section(config))
        if cfg.plan_file and not is_capturing():  # build this stage as the tuned plan says
            from deepspeed_ppq.autotune.plan import load_plan
            from deepspeed_ppq.integrations.model_layers import model_fingerprint
            from deepspeed_ppq.integrations.plan_apply import plan_module

            plan = load_plan(cfg.plan_file)
            plan.check_model(model_fingerprint(list(layers)), f"plan file {cfg.plan_file}")
            for key in ("recompute_stages", "recompute_layers"):  # the plan decides recomputation
                kwargs.pop(key, None)
            return plan_module(plan, list(layers), kwargs.pop("loss_fn", None),
                               cfg.weights.model_dump(mode="json"), kwargs.pop("block_layers", None),
                               **kwargs)
        part = cfg.partition
        kwargs.setdefault("weights", cfg.weights)
        return cls(layers, num_stages, boundaries=part.boundaries, partition_method=part.method, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        if method.lower() != "explicit":
            return super()._partition_layers(method)
        num_stages = self.num_stages
        self.parts = check_boundaries(self._ppq_boundaries, len(self._layer_specs), num_stages)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        if self.global_rank == 0:
            for s in range(num_stages):
                print(f"stage={s} layers={self.parts[s + 1] - self.parts[s]} "
                      f"[{self.parts[s]}, {self.parts[s + 1]})")
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


def _weights_config(weights) -> WeightsConfig | None:
    """``weights=`` as a ``WeightsConfig``: a dict is validated as ``ppq.weights`` (errors name the field)."""
    if weights is None or isinstance(weights, WeightsConfig):
        return weights
    if isinstance(weights, dict):
        return load_ppq_config({"weights": weights}).weights
    raise PPQConfigError(f"weights={weights!r}: must be a ppq.weights dict or WeightsConfig, e.g. "
                         f"{{'format': 'int8'}}; got a {type(weights).__name__}")


def _ppq_section(config):
    """The ``"ppq"`` section of ``config``: a whole DeepSpeed config (dict or JSON path) without one -- a
    stock DeepSpeed config -- gives the defaults; a dict of ``"ppq"`` fields is the section itself."""
    import json

    from deepspeed_ppq.config import PPQConfig

    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    if isinstance(config, dict) and "ppq" not in config and config and \
            not set(config) & set(PPQConfig.model_fields):
        return {}
    return config
