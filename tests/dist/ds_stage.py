"""Rank script: per-stage low-bit weights and recomputation through ``deepspeed_ppq`` vs one process.

Usage (through tests/dist_utils.run_ranks, 2 ranks): ``ds_stage.py <checkpoint dir>``. A small GPT
(``[embed, 4 blocks, head]``, cut ``[0, 3, 6]``) trains 3 steps in three ways, each against the
single-process model with the same conversion (``convert_model`` with the same ``block_layers``) and
a plain torch Adam with ``requantize_after_step``:

* ``module``: ``PPQPipelineModule(weights=int8, recompute_stages=[True, False])``, optimizer built after
  it, ``deepspeed_ppq.initialize`` wires the re-quantization itself;
* ``config``: a plain DeepSpeed ``PipelineModule``; ``ppq.weights`` (nf4) and
  ``pipeline.recompute_stages=[1]`` (with ``activation_checkpoint_interval=1``, as the autotuner writes
  it) come from the DeepSpeed config; the optimizer is a callable DeepSpeed builds after the conversion;
* ``config_layers``: ``pipeline.recompute_layers`` (partial recomputation, as a plan writes it), and
  ``plan_module`` building a plan's partially recomputed stage;
* ``master_free``: int8 master-free weights on stage 1 only; ``initialize`` attaches the master-free
  update on both ranks (the clip norm is a collective), losses equal the one-process model's;
* ``in_backward``: the same at one micro-batch per step with no clipping: the engine updates the
  master-free weights in their backward (no gradient buffer), losses equal the buffered one-process run;
* ``stale``: an optimizer built before ``ppq.weights`` replaced the layers is an error.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
from deepspeed.pipe import PipelineModule
from dist_utils import write_result

import deepspeed_ppq
from deepspeed_ppq.autotune.plan import Plan, StagePlan
from deepspeed_ppq.config import WeightsConfig
from deepspeed_ppq.integrations.plan_apply import plan_module
from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule
from deepspeed_ppq.integrations.stage import RecomputedLayer
from deepspeed_ppq.models.gpt import GPT, GPTConfig, gpt_layers, gpt_loss, layer_kinds
from deepspeed_ppq.quant import (
    QuantLinear,
    attach_master_free,
    build_optimizer,
    convert_model,
    quantize_weight,
    requantize_after_step,
)

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
BLOCKS = [i for i, k in enumerate(layer_kinds(CFG)) if k == "block"]
MB, GAS, STEPS, LR = 2, 2, 3, 1e-2
DS = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
      "gradient_clipping": 0.0}  # DeepSpeed clips to 1.0 by default; the reference does not


def batches(mb: int = MB, gas: int = GAS):
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, CFG.vocab_size, (mb, CFG.seq_len), generator=g) for _ in range(gas)]
            for _ in range(STEPS)]


def reference(wcfg: WeightsConfig, clip: float | None = None, mb: int = MB, gas: int = GAS) -> list[float]:
    model = convert_model(GPT(CFG), wcfg, block_layers=BLOCKS, num_blocks=len(BLOCKS))
    opt = build_optimizer(model.parameters(), "adam", lr=LR)
    if wcfg.master == "none":
        attach_master_free(opt, model, max_grad_norm=clip)
    else:
        requantize_after_step(opt, model)
    losses = []
    for mbs in batches(mb, gas):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for b in mbs:
            loss = gpt_loss(model(b), b)
            (loss / gas).backward()
            total += loss.item()
        opt.step()
        losses.append(total / gas)
    return losses


def train(engine, module, mb: int = MB, gas: int = GAS) -> dict:
    losses = [float(engine.train_batch(iter([(b, b) for b in mbs]))) for mbs in batches(mb, gas)]
    recomputed = [f for f in module.forward_funcs if isinstance(f, RecomputedLayer)]
    return {
        "losses": losses,
        "quantized": sorted(n for n, m in module.named_modules() if isinstance(m, QuantLinear)),
        "recomputed": list(getattr(module, "ppq_recomputed", [])),
        "recompute_calls": [f.calls for f in recomputed],
        "ds_interval": module.activation_checkpoint_interval,
        "requantize_wired": hasattr(engine, "ppq_requantize_handle"),
        "master_free_wired": hasattr(engine, "ppq_master_free_handle"),
        "master_free": sorted(n for n, m in module.named_modules()
                              if isinstance(m, QuantLinear) and m.master_free),
        "in_backward": sorted(n for n, m in module.named_modules()
                              if isinstance(m, QuantLinear) and m.update_in_backward is not None),
    }


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    out = {"rank": int(os.environ["RANK"])}

    w8 = WeightsConfig(format="int8", keep_first_blocks=1, keep_last_blocks=1)
    # not a PipelineModule (data parallel over both ranks): the same weights policy and hook. First:
    # a pipeline engine leaves model-parallel state in deepspeed.utils.groups that a later plain
    # engine in the same process trips over.
    gpt = GPT(CFG)
    plain_cfg = {**DS, "gradient_accumulation_steps": 1, "ppq": {"weights": w8.model_dump(mode="json")}}
    engine, *_ = deepspeed_ppq.initialize(model=gpt, config=plain_cfg, block_layers=BLOCKS,
                                          optimizer=lambda params: torch.optim.Adam(params, lr=LR))
    q = engine.module.get_submodule("2.mlp.fc")
    before = q.dequantized_weight()
    b = batches()[0][0]
    engine.backward(gpt_loss(engine(b), b))
    engine.step()
    out["plain"] = {
        "quantized": sorted(n for n, m in gpt.named_modules() if isinstance(m, QuantLinear)),
        "stepped": not torch.equal(q.dequantized_weight(), before),
        "follows_master": torch.equal(q.dequantized_weight(), quantize_weight(q.weight.detach(), "int8")
                                      .dequantize(torch.float32)),
    }

    module = PPQPipelineModule(gpt_layers(CFG), 2, boundaries=[0, 3, 6], loss_fn=gpt_loss, weights=w8,
                               recompute_stages=[True, False])
    opt = build_optimizer(module.parameters(), "adam", lr=LR)
    engine, *_ = deepspeed_ppq.initialize(model=module, optimizer=opt, config=DS)
    out["module"] = train(engine, module)
    out["module"]["reference"] = reference(w8)
    # DeepSpeed's per-layer checkpoint files still hold the recomputed layers, and load back into them
    ckpt = sys.argv[1]
    engine.save_checkpoint(ckpt, tag="t")
    mine = {f"layer_{i:02d}-model_states.pt" for i in range(module._local_start, module._local_stop)}
    out["module"]["layer_files"] = sorted(set(os.listdir(os.path.join(ckpt, "t"))) & mine)
    layer = module.get_submodule("2.mlp.fc") if out["rank"] == 0 else module.get_submodule("3.mlp.fc")
    saved = layer.weight.detach().clone()
    with torch.no_grad():
        layer.weight.zero_()
    engine.load_checkpoint(ckpt, tag="t", load_module_only=True)
    out["module"]["reloaded"] = torch.equal(layer.weight, saved)

    nf4 = WeightsConfig(format="nf4", keep_first_blocks=1, keep_last_blocks=0)
    plain = PipelineModule(gpt_layers(CFG), num_stages=2, loss_fn=gpt_loss, partition_method="uniform")
    cfg = {**DS, "pipeline": {"activation_checkpoint_interval": 1, "recompute_stages": [1]},
           "ppq": {"weights": nf4.model_dump(mode="json")}}
    engine, *_ = deepspeed_ppq.initialize(model=plain, config=cfg,
                                          optimizer=lambda params: torch.optim.Adam(params, lr=LR))
    out["config"] = train(engine, plain)
    out["config"]["reference"] = reference(nf4)

    # partial recomputation from the config, as a plan whose stage keeps its last layers writes it:
    # layer 0 (the embedding: never checkpointed) and layer 3 recompute, layer 4 keeps its activations
    plain = PipelineModule(gpt_layers(CFG), num_stages=2, loss_fn=gpt_loss, partition_method="uniform")
    cfg_layers = {**DS, "pipeline": {"activation_checkpoint_interval": 1, "recompute_layers": [0, 3]},
                  "ppq": cfg["ppq"]}
    engine, *_ = deepspeed_ppq.initialize(model=plain, config=cfg_layers,
                                          optimizer=lambda params: torch.optim.Adam(params, lr=LR))
    out["config_layers"] = train(engine, plain)
    # the tuner's trials build a plan's partial stage alike: stage 0 [0, 3) keeps layer 2
    plan = Plan(world_size=2, pipeline_degree=2, micro_batch_size=MB, num_microbatches=GAS, schedule="1f1b",
                stages=[StagePlan((0, 3), ["none"] * 3, recompute=True, keep_last=1),
                        StagePlan((3, 6), ["none"] * 3)], layer_names=[f"l{i}" for i in range(6)])
    out["plan_partial"] = plan_module(plan, gpt_layers(CFG), gpt_loss).ppq_recomputed

    # Master-free int8 on stage 1 only (blocks 1-2 are the model's first two, kept high precision): the
    # clip norm of the master-free gradients is a collective, so stage 0 must join it without any such
    # layer. A clip far above the norm keeps DeepSpeed's own clipping of the rest a no-op.
    mf = WeightsConfig(format="int8", master="none", keep_first_blocks=2, keep_last_blocks=0)
    module = PPQPipelineModule(gpt_layers(CFG), 2, boundaries=[0, 3, 6], loss_fn=gpt_loss, weights=mf)
    engine, *_ = deepspeed_ppq.initialize(model=module, config={**DS, "gradient_clipping": 1e6},
                                          optimizer=lambda params: torch.optim.Adam(params, lr=LR))
    out["master_free"] = train(engine, module)
    out["master_free"]["reference"] = reference(mf, clip=1e6)
    # one micro-batch of 4 per step and no clipping: the engine updates the master-free weights in their
    # backward, with no gradient buffer; the reference accumulates into its buffer as before
    module = PPQPipelineModule(gpt_layers(CFG), 2, boundaries=[0, 3, 6], loss_fn=gpt_loss, weights=mf)
    one = {**DS, "train_micro_batch_size_per_gpu": 2 * MB, "gradient_accumulation_steps": 1}
    engine, *_ = deepspeed_ppq.initialize(model=module, config=one,
                                          optimizer=lambda params: torch.optim.Adam(params, lr=LR))
    out["in_backward"] = train(engine, module, 2 * MB, 1)
    out["in_backward"]["reference"] = reference(mf, mb=2 * MB, gas=1)

    stale = PipelineModule(gpt_layers(CFG), num_stages=2, loss_fn=gpt_loss, partition_method="uniform")
    early = torch.optim.Adam(stale.parameters(), lr=LR)
    try:
        deepspeed_ppq.initialize(model=stale, optimizer=early, config={**DS, "ppq": cfg["ppq"]})
        out["stale"] = "no error"
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["stale"] = f"{type(e).__name__}: {e}"
    write_result(out)


if __name__ == "__main__":
    main()
