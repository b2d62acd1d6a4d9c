"""A small GPT written as a flat list of layers, so DeepSpeed's ``PipelineModule`` can cut it anywhere.

Layer list: ``[EmbeddingPipe, BlockPipe * n_layers, HeadPipe]``. The same modules in sequence
(``GPT``) are the single-process reference the distributed tests compare against.

Shapes: ``input_ids [B, T]`` -> hidden ``[B, T, d]`` -> logits ``[B, T, V]``.
Linear layer names inside a block (what precision policies match): ``attn.qkv``, ``attn.proj``,
``mlp.fc``, ``mlp.proj``; the head has ``norm`` and ``lm_head``; the embedding ``tok`` and ``pos``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig",
    "EmbeddingPipe",
    "BlockPipe",
    "HeadPipe",
    "GPT",
    "gpt_layers",
    "gpt_loss",
    "layer_kinds",
]


@dataclass
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 128
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 8
    d_ff: int | None = None  # default 4 * d_model

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model

    def to_dict(self) -> dict:
        return asdict(self)


class EmbeddingPipe(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.01)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)
        return self.tok(input_ids) + self.pos(pos)[None]


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # [B, T, d] -> [B, H, T, d/H]
        q, k, v = (t.view(B, T, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class _MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class BlockPipe(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig, index: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = _MLP(cfg)
        # GPT-2's scaled init of the residual projections keeps the stream's scale steady with depth.
        std = 0.02 / math.sqrt(2 * cfg.n_layers)
        for lin in (self.attn.qkv, self.mlp.fc):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        for lin in (self.attn.proj, self.mlp.proj):
            nn.init.normal_(lin.weight, std=std)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class HeadPipe(nn.Module):
    """Final LayerNorm and the LM head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def gpt_layers(cfg: GPTConfig, seed: int = 0) -> list[nn.Module]:
    """``[EmbeddingPipe, BlockPipe * n_layers, HeadPipe]``, initialised deterministically from ``seed``."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return [EmbeddingPipe(cfg), *(BlockPipe(cfg, i) for i in range(cfg.n_layers)), HeadPipe(cfg)]
    finally:
        torch.random.set_rng_state(gen_state)


def layer_kinds(cfg: GPTConfig) -> list[str]:
    """The kind of each entry of ``gpt_layers(cfg)``: ``"embed"``, ``"block"`` ..., ``"head"``."""
    return ["embed", *(["block"] * cfg.n_layers), "head"]


def gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; ``logits [B, T, V]``, ``labels [B, T]``."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


class GPT(nn.Sequential):
    """The layers of ``gpt_layers`` in sequence: the single-process reference model."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__(*gpt_layers(cfg, seed))
        self.cfg = cfg
