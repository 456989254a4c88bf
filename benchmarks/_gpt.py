"""A small GPT for benchmarks: token + position embedding, pre-norm blocks, LayerNorm, head (fp32)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["GPT", "GPTConfig", "lm_loss", "make_batch"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    ctx: int = 64
    width: int = 256
    layers: int = 4
    heads: int = 4


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.ctx, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(cfg: GPTConfig, batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic batch per rank: next-token targets of a learnable pattern."""
    g = torch.Generator().manual_seed(1234 + rank)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
    step = torch.randint(1, 17, (batch, 1), generator=g)
    seq = (start + torch.arange(cfg.ctx + 1) * step) % cfg.vocab
    return seq[:, :-1], seq[:, 1:]
