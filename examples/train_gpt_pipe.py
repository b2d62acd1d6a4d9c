"""Train the small GPT as a DeepSpeed pipeline with compressed stage-to-stage traffic.

Run with the ``deepspeed`` launcher (add ``DS_ACCELERATOR=cpu`` on a machine without GPUs)::

    deepspeed --num_gpus 2 examples/train_gpt_pipe.py --deepspeed_config configs/ds_cpu_smoke.json

The ``"ppq"`` section of the config picks the codecs and the stage boundaries; the script prints the
loss per step (DeepSpeed's ``steps_per_print``) and, at the end, the median step time and the bytes
each boundary carried.

Tune it for your memory budget, then train with the plan::

    ppq tune examples/train_gpt_pipe.py --deepspeed_config configs/ds_cpu_smoke.json --budget-mb 24
    # add "plan_file": "ppq_tune/plan.json" to the config's "ppq" section, then run as above
``--data synthetic`` uses random tokens instead of the stdlib-text corpus (no tokenizer training).

LoRA fine-tuning of a pretrained GPT (``examples/pretrain_gpt.py`` writes one) on other text: the base is
frozen and every block Linear gets a LoRA adapter (built here, as PEFT builds one)::

    deepspeed --num_gpus 2 examples/train_gpt_pipe.py --deepspeed_config ds.json --finetune gpt.pt
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed import comm as dist
from torch import nn

import deepspeed_ppq
from deepspeed_ppq.config import load_ppq_config
from deepspeed_ppq.integrations import WithSampleIds
from deepspeed_ppq.integrations.pipe_module import PPQPipelineModule
from deepspeed_ppq.models.gpt import BlockPipe, GPTConfig, gpt_layers, gpt_loss


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3, help="used when the config has no optimizer section")
    p.add_argument("--data", choices=["text", "synthetic"], default="text")
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="corpus size for --data text")
    p.add_argument("--stats-json", default=None, help="write the per-boundary byte counters here (rank 0)")
    p.add_argument("--finetune", metavar="CKPT", default=None,
                   help="LoRA fine-tuning: load this pretrained GPT state_dict, freeze it, add a LoRA "
                        "adapter to every block Linear and train those on the fine-tuning text")
    p.add_argument("--lora-rank", type=int, default=8)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


class _RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i, :-1], self.tokens[i, 1:]


class LoRALinear(nn.Module):
    """``base(x) + (alpha / rank) * B(A(x))`` over a frozen ``nn.Linear`` (PEFT's LoRA)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = (alpha or 2 * rank) / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


def lora_gpt_layers(cfg: GPTConfig, checkpoint: str, rank: int) -> list[nn.Module]:
    """The GPT's layers with the pretrained weights, all frozen, and a LoRA adapter on every block Linear
    (the same initialisation on every rank)."""
    layers = gpt_layers(cfg)
    nn.Sequential(*layers).load_state_dict(torch.load(checkpoint, weights_only=True))
    torch.manual_seed(0)
    for layer in layers:
        layer.requires_grad_(False)
        if isinstance(layer, BlockPipe):
            for mod in (layer.attn, layer.mlp):
                for name, sub in list(mod.named_children()):
                    if isinstance(sub, nn.Linear):
                        setattr(mod, name, LoRALinear(sub, rank))
    return layers


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    ppq = load_ppq_config(ds_config.get("ppq"))
    cfg = GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                    n_heads=args.n_heads, n_layers=args.n_layers)
    if args.finetune:
        from stdlib_text import build_finetune_datasets

        train, _, _ = build_finetune_datasets(cfg.seq_len, cfg.vocab_size, args.max_bytes)
    elif args.data == "text":
        from stdlib_text import build_token_datasets

        train, _, _ = build_token_datasets(cfg.seq_len, cfg.vocab_size, args.max_bytes)
    else:
        train = _RandomTokens(4096, cfg.seq_len, cfg.vocab_size)
    if ppq.aqsgd.enabled:
        train = WithSampleIds(train)
    # partition and ppq.weights from the config: each stage converts its own Linear layers, keeping the
    # model's first/last blocks dense; initialize() re-quantizes the compute copies after every step
    layers = lora_gpt_layers(cfg, args.finetune, args.lora_rank) if args.finetune else gpt_layers(cfg)
    model = PPQPipelineModule.from_config(layers, args.num_stages, ppq, loss_fn=gpt_loss)
    print(f"rank {dist.get_rank()}: {len(model.ppq_quantized)} low-bit Linear layers", flush=True)
    optimizer = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    engine, _, _, _ = deepspeed_ppq.initialize(args=args, model=model, optimizer=optimizer,
                                               training_data=train)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.train_batch()
        times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0 and len(times) > 2:
        print(f"step time: median {statistics.median(times[2:]) * 1e3:.1f} ms over {len(times) - 2} steps "
              "(after 2 warm-up steps)", flush=True)
    stats = engine.ppq_stats(all_stages=True)
    if dist.get_rank() == 0:
        for (b, d), s in sorted(stats.items()):
            ratio = s["raw_bytes"] / s["wire_bytes"] if s["wire_bytes"] else float("nan")
            print(f"boundary {b} {d}: {int(s['raw_bytes'])} B raw, {int(s['wire_bytes'])} B on the wire "
                  f"({ratio:.2f}x), codec {1e3 * (s['encode_s'] + s['decode_s']):.1f} ms")
        if args.stats_json:
            with open(args.stats_json, "w") as f:
                json.dump({f"{b}.{d}": s for (b, d), s in stats.items()}, f, indent=1)


if __name__ == "__main__":
    main()
