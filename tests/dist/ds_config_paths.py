"""Rank script (1 rank): config paths of the DeepSpeed integration.

* a stock DeepSpeed JSON without ``"ppq"`` given to ``PPQPipelineModule.from_config`` (dict and file);
* ``ppq.weights.optimizer_8bit`` with the config's AdamW section: the engine's optimizer is bitsandbytes'
  8-bit AdamW and its states after a step are uint8; with a plain AdamW given, a clear error.
"""

from __future__ import annotations

import json
import os
import sys

import deepspeed
import torch
from dist_utils import write_result
from torch import nn

import deepspeed_ppq
from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule

STOCK = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6}


def layers():
    torch.manual_seed(0)
    return [nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64)]


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    path = os.path.join(sys.argv[1], "stock.json")
    with open(path, "w") as f:
        json.dump(STOCK, f)
    for src in (STOCK, path):
        m = PPQPipelineModule.from_config(layers(), 1, src, loss_fn=nn.functional.mse_loss)
        out.setdefault("stock_parts", []).append([int(p) for p in m.parts])
    cfg = {**STOCK, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "ppq": {"weights": {"optimizer_8bit": True}}}
    m = PPQPipelineModule(layers(), num_stages=1, loss_fn=nn.functional.mse_loss)
    engine, opt, *_ = deepspeed_ppq.initialize(model=m, config=cfg)
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    engine.train_batch(iter([(x, y)]))
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    out["optimizer"] = type(inner).__name__
    out["state_dtypes"] = sorted({str(v.dtype) for st in inner.state.values() for v in st.values()
                                  if isinstance(v, torch.Tensor)})
    m = PPQPipelineModule(layers(), num_stages=1, loss_fn=nn.functional.mse_loss)
    try:
        deepspeed_ppq.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters()), config=cfg)
    except Exception as e:  # noqa: BLE001 - the error is the result
        out["plain_error"] = f"{type(e).__name__}: {e}"
    write_result(out)


if __name__ == "__main__":
    main()
