"""Rank script: a LoRA fine-tune built the way a user builds one (frozen base, the user's own adapters)
through ``PPQPipelineModule`` on 2 gloo ranks, against the single-process model.

The base (embedding, blocks, head) is frozen; every block Linear sits inside a user LoRA adapter; the
block Linears are stored in NF4 (frozen: codes only). Both stages recompute with DeepSpeed's own
(reentrant) activation checkpoint, as a tuned plan runs it: stage 0's blocks sit behind the frozen
embedding, so their inputs need no gradient, and the adapters inside must still get theirs.
"""

from __future__ import annotations

import os

import deepspeed
import torch
from dist_utils import write_result
from torch import nn

import deepspeed_ppq
from deepspeed_ppq.config import WeightsConfig
from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule
from deepspeed_ppq.models.gpt import GPTConfig, gpt_layers, gpt_loss, layer_kinds
from deepspeed_ppq.quant import QuantLinear, build_optimizer, convert_model

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4)
BLOCKS = [i for i, k in enumerate(layer_kinds(CFG)) if k == "block"]
MB, GAS, STEPS, LR = 2, 2, 3, 1e-2
DS = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
      "gradient_clipping": 0.0}
NF4 = WeightsConfig(format="nf4", keep_first_blocks=0, keep_last_blocks=0)


class UserLoRA(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.B = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.A.t()) @ self.B.t()


def lora_layers() -> list[nn.Module]:
    layers = gpt_layers(CFG)
    torch.manual_seed(5)
    for layer in layers:
        layer.requires_grad_(False)
    for i in BLOCKS:
        for mod in (layers[i].attn, layers[i].mlp):
            for name, sub in list(mod.named_children()):
                if isinstance(sub, nn.Linear):
                    setattr(mod, name, UserLoRA(sub))
    return layers


def batches():
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, CFG.vocab_size, (MB, CFG.seq_len), generator=g) for _ in range(GAS)]
            for _ in range(STEPS)]


def reference() -> list[float]:
    model = convert_model(nn.Sequential(*lora_layers()), NF4, block_layers=BLOCKS, num_blocks=len(BLOCKS))
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], "adam", lr=LR)
    losses = []
    for mbs in batches():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for b in mbs:
            loss = gpt_loss(model(b), b)
            (loss / GAS).backward()
            total += loss.item()
        opt.step()
        losses.append(total / GAS)
    return losses


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    module = PPQPipelineModule(lora_layers(), 2, boundaries=[0, 3, 6], loss_fn=gpt_loss, weights=NF4,
                               block_layers=BLOCKS, activation_checkpoint_interval=1,
                               checkpointable_layers=["BlockPipe", "HeadPipe"])
    adapters = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    opt = build_optimizer([p for p in module.parameters() if p.requires_grad], "adam", lr=LR)
    engine, *_ = deepspeed_ppq.initialize(model=module, optimizer=opt, config=DS)
    losses = [float(engine.train_batch(iter([(b, b) for b in mbs]))) for mbs in batches()]
    trained = {n: p for n, p in module.named_parameters() if p.requires_grad}
    write_result({
        "rank": int(os.environ["RANK"]),
        "losses": losses,
        "reference": reference(),
        "frozen_low_bit": sorted(n for n, m in module.named_modules()
                                 if isinstance(m, QuantLinear) and m.mode == "frozen" and m.lora_A is None),
        "adapters": sorted(adapters),
        "adapters_moved": sorted(n for n in adapters if not torch.equal(adapters[n], trained[n])),
    })


if __name__ == "__main__":
    main()
