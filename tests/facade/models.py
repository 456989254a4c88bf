"""Small models and a single-process reference for multi-process tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zeroplan.facade.cli.demo.model import DemoGPT, GPTConfig, build_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The parameter dtypes scenarios are configured with, by short name."""


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, *, width: int = 24) -> DemoGPT:
    """A tiny GPT with odd sizes (an MLP of ``3 * width + 1``) that exercise padding."""
    config = GPTConfig(vocab=37, width=width, layers=2, heads=2, context=8, ffn=3 * width + 1, qkv_bias=True)
    return build_model(config, seed=seed, dtype=dtype)


def batch(
    step: int, rank: int, *, size: int = 4, ctx: int = 8, vocab: int = 37
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic tokens for (step, rank): next-token targets of a learnable pattern."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    seq = (start + torch.arange(ctx + 1) * 3) % vocab
    return seq[:, :-1], seq[:, 1:]


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def averaged_grads(model: nn.Module, world: int, step: int, **kw: int) -> list[torch.Tensor]:
    """Per-parameter gradients averaged over ``world`` ranks' batches (fp32), as DDP would give."""
    total = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    for r in range(world):
        model.zero_grad(set_to_none=True)
        loss_of(model, *batch(step, r, **kw)).backward()
        for acc, p in zip(total, model.parameters(), strict=True):
            if p.grad is not None:
                acc += p.grad.float()
    model.zero_grad(set_to_none=True)
    return [t / world for t in total]


class Reference:
    """One process running ``optimizer_class`` on fp32 master copies of ``model``'s parameters.

    Forward/backward run on ``model`` (any dtype); the averaged gradients step
    the fp32 masters, which are then rounded into ``model``: exactly what a
    mixed-precision data-parallel job computes, without sharding.
    """

    def __init__(self, model: nn.Module, optimizer_class: type, **kw: object) -> None:
        self.model = model
        self.master = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in model.parameters()]
        self.optimizer = optimizer_class(self.master, **kw)

    def step(
        self,
        world: int,
        step: int,
        clip: float | None = None,
        norm_type: float = 2.0,
        grad_fn: Callable[[nn.Module, int, int], list[torch.Tensor]] | None = None,
    ) -> torch.Tensor | None:
        grads = (grad_fn or averaged_grads)(self.model, world, step)
        for m, g, p in zip(self.master, grads, self.model.parameters(), strict=True):
            m.grad = g.clone() if p.requires_grad else None
        norm = None
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                [m for m in self.master if m.grad is not None], clip, norm_type
            )
        self.optimizer.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.model.parameters(), strict=True):
                p.copy_(m)
        return norm


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max-norm relative difference of two tensors (compared in fp32)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0
