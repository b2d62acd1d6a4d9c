"""Low-bit weights for pipeline stages: formats, the quantized linear layer, the precision policy,
the memory ledger and optimizers with 8-bit states.

Modules, bottom to top (each imports only those above it in this list; ``tests/test_import_layers.py``):

* ``ops``, ``sr_ops``, ``adam8bit``: the ``ppq::`` weight ops (quantize, stochastic rounding, 8-bit
  Adam) with their plain-PyTorch references; the formats themselves are rows of ``deepspeed_ppq.formats``.
* ``formats``: ``QuantizedWeight``, ``quantize_weight`` and ``weight_storage_bytes`` (blockwise codes and
  scales, their exact bytes).
* ``policy``: ``PrecisionPolicy``, ``plan``, ``explain`` (which layer gets which format).
* ``linear``: ``QuantLinear`` ("train": low-bit compute copy + fp32 master; "frozen": + LoRA),
  ``convert_model`` (the policy applied).
* ``optim``: ``build_optimizer`` (adam, adamw, adam8bit, adamw8bit, sgd), their state bytes,
  ``requantize_after_step``.
* ``master_free``: ``attach_master_free`` for ``weights.master="none"`` (only 8-bit codes are kept;
  AdamW on the dequantized weight, then stochastic-rounding re-quantization, ``sr_ops``).
* ``ledger``: ``MemoryLedger``, ``ledger_from_model``, ``ledger_from_shapes``, ``measure_storage``: the
  bytes of all of the above, by memory category (``deepspeed_ppq.memory_categories``).

Typical use (a DeepSpeed ``PipelineModule`` whose layers 1..n are transformer blocks)::

    cfg = WeightsConfig(format="nf4", keep_first_blocks=1, keep_last_blocks=1, optimizer_8bit=True)
    print(explain(model, cfg, block_layers=blocks))          # what will be low-bit, bytes saved
    print(ledger_from_model(model, cfg, optimizer="adamw8bit", block_layers=blocks).table())
    convert_model(model, cfg, block_layers=blocks)
    opt = build_optimizer(model.parameters(), optimizer_kind(cfg), lr=3e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    requantize_after_step(engine, engine.module)             # compute copies follow the masters
    ...
    print(measure_storage(engine).table())                   # the same categories, measured

Master-free (``WeightsConfig(format="int8", master="none")``): after ``deepspeed.initialize``, call
``attach_master_free(engine, engine.module)`` instead of ``requantize_after_step``.
"""

from deepspeed_ppq.quant.formats import QuantizedWeight, quantize_weight, weight_storage_bytes
from deepspeed_ppq.quant.ledger import (
    MemoryLedger,
    ParamSpec,
    ledger_from_model,
    ledger_from_shapes,
    measure_storage,
)
from deepspeed_ppq.quant.linear import (
    QuantLinear,
    clear_workspace,
    convert_model,
    lora_parameters,
    requantize_model,
    workspace_tensors,
)
from deepspeed_ppq.quant.master_free import attach_master_free, master_free_layers, zero_master_free_grads
from deepspeed_ppq.quant.optim import OPTIMIZER_KINDS, build_optimizer, optimizer_kind, requantize_after_step
from deepspeed_ppq.quant.policy import LayerDecision, PrecisionPolicy, as_policy, block_index, explain, plan

# the package's API, by module (each module's own __all__ has more)
__all__ = [
    "QuantizedWeight", "quantize_weight", "weight_storage_bytes",
    "QuantLinear", "convert_model", "requantize_model", "lora_parameters",
    "workspace_tensors", "clear_workspace",
    "PrecisionPolicy", "LayerDecision", "as_policy", "block_index", "plan", "explain",
    "MemoryLedger", "ParamSpec", "ledger_from_model", "ledger_from_shapes", "measure_storage",
    "OPTIMIZER_KINDS", "build_optimizer", "optimizer_kind", "requantize_after_step",
    "attach_master_free", "master_free_layers", "zero_master_free_grads",
]  # fmt: skip
