"""The benchmarks' model — zeroplan's demo GPT at 7M to 42M parameters — and a synthetic batch."""

from __future__ import annotations

import torch
from torch import nn

from zeroplan.facade.cli.demo.model import DemoGPT as GPT
from zeroplan.facade.cli.demo.model import GPTConfig

__all__ = ["GPT", "GPT_7M", "GPT_34M", "GPT_42M", "GPT_TINY", "GPTConfig", "lm_loss", "make_batch"]

#: 7,370,240 parameters: vocab 8192, width 256, 4 layers, 4 heads, context 64.
GPT_7M = GPTConfig(vocab=8192, width=256, layers=4, heads=4, context=64, qkv_bias=True)
#: 33,641,472 parameters: width 512, 8 layers, 8 heads (checkpoint throughput at a larger size).
GPT_34M = GPTConfig(vocab=8192, width=512, layers=8, heads=8, context=64, qkv_bias=True)
#: 42,030,080 parameters: GPT_34M with vocab 16384 (issue 13's stage-3 benchmark).
GPT_42M = GPTConfig(vocab=16384, width=512, layers=8, heads=8, context=64, qkv_bias=True)
#: For smoke runs.
GPT_TINY = GPTConfig(vocab=256, width=32, layers=1, heads=2, context=16, qkv_bias=True)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(cfg: GPTConfig, batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic batch per rank: next-token targets of a learnable pattern."""
    g = torch.Generator().manual_seed(1234 + rank)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
    step = torch.randint(1, 17, (batch, 1), generator=g)
    seq = (start + torch.arange(cfg.context + 1) * step) % cfg.vocab
    return seq[:, :-1], seq[:, 1:]
