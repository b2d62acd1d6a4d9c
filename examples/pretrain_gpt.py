"""Pretrain the small GPT in one process (plain PyTorch) and save its ``state_dict``: the base model that
``examples/train_gpt_pipe.py --finetune`` fine-tunes with LoRA on other text.

    python examples/pretrain_gpt.py --n-layers 12 --d-model 256 --seq-len 32 --steps 400 --out gpt.pt

The text is the stdlib corpus of ``stdlib_text.py`` beside this script (the first ``--max-bytes``);
AdamW with a linear warm-up and cosine decay. Prints the validation loss before and after.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from stdlib_text import build_token_datasets

from deepspeed_ppq.models.gpt import GPT, GPTConfig, gpt_loss


def val_loss(model: torch.nn.Module, val, batches: int = 8, batch: int = 16) -> float:
    model.eval()
    with torch.no_grad():
        losses = []
        for k in range(min(batches, len(val) // batch)):
            x, y = torch.utils.data.default_collate([val[k * batch + j] for j in range(batch)])
            losses.append(float(gpt_loss(model(x), y)))
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--max-bytes", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="where the state_dict goes")
    args = p.parse_args(argv)
    cfg = GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                    n_heads=args.n_heads, n_layers=args.n_layers)
    train, val, _ = build_token_datasets(cfg.seq_len, cfg.vocab_size, args.max_bytes)
    torch.manual_seed(args.seed)
    model = GPT(cfg, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    print(f"pretraining {sum(q.numel() for q in model.parameters()) / 1e6:.1f}M parameters for {args.steps} "
          f"steps of {args.batch} x {cfg.seq_len} tokens; val loss {val_loss(model, val):.4f}", flush=True)
    t0, step = time.perf_counter(), 0
    while step < args.steps:
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            gpt_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step == args.steps:
                break
    print(f"done in {time.perf_counter() - t0:.0f} s; val loss {val_loss(model, val):.4f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
