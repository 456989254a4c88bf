"""The model and task of ``zeroplan demo``: a small GPT that learns to sort.

[Note: demo task]
Each sequence is ``x_1 .. x_L, SEP, sorted(x)``: ``L`` random digits, a
separator, then the same digits in ascending order. The model is trained on
next-token prediction, scored only where the answer is determined (the
separator and the sorted half; the random half is masked out), so the loss
starts at ``ln(vocab)`` and falls steadily as the model learns to count and
sort. Batches are a pure function of ``(seed, step, rank)``: the sharded run
and the single-process reference see exactly the same data.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["IGNORE", "DemoGPT", "GPTConfig", "SortTask", "build_model", "loss_of"]

IGNORE = -100  # cross_entropy's ignore_index: positions whose target is random


class GPTConfig(NamedTuple):
    """Sizes of :class:`DemoGPT` (the defaults are the demo's model).

    ``ffn`` is the MLP width (0: four times ``width``); ``qkv_bias`` adds a bias to
    the attention projection (the demo leaves it out: the key bias has no true
    gradient, and Adam would turn rounding noise into updates). The benchmarks
    and the multi-process tests build their models from this class too.
    """

    vocab: int = 32
    width: int = 96
    layers: int = 2
    heads: int = 4
    context: int = 24
    ffn: int = 0
    qkv_bias: bool = False


class DemoBlock(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        width, ffn = config.width, config.ffn or 4 * config.width
        self.heads = config.heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=config.qkv_bias)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, ffn)
        self.out = nn.Linear(ffn, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(c, -1)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class DemoGPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and an untied head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.width)
        self.pos = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(DemoBlock(config) for _ in range(config.layers))
        self.ln = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        for name, param in self.named_parameters():  # GPT-2 style: scaled residual projections
            if name.endswith(("proj.weight", "out.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.layers))
            elif param.dim() == 2:
                nn.init.normal_(param, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model(
    config: GPTConfig = GPTConfig(),  # noqa: B008  (an immutable NamedTuple)
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> DemoGPT:
    """The same initial model on every call with the same ``seed`` (every rank builds it alike)."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = DemoGPT(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.to(device=device, dtype=dtype)


class SortTask(NamedTuple):
    """Sequences ``digits, SEP, sorted(digits)`` (see [Note: demo task]).

    Example:
        >>> task = SortTask(length=4, vocab=10)
        >>> task.sequences(step=0, index=0, size=1).shape
        torch.Size([1, 9])
        >>> tokens, targets = task.batch(step=0, rank=0, size=1)
        >>> tokens.shape, targets.shape, int((targets >= 0).sum())
        (torch.Size([1, 8]), torch.Size([1, 8]), 5)
    """

    length: int = 12
    vocab: int = 32
    seed: int = 0

    @property
    def context(self) -> int:
        """Tokens per input sequence (a whole sequence is one longer)."""
        return 2 * self.length

    def sequences(self, *, step: int, index: int, size: int) -> torch.Tensor:
        """``size`` whole sequences, a pure function of ``(seed, step, index)``."""
        generator = torch.Generator().manual_seed(((self.seed * 1_000_003) + step) * 4099 + index)
        digits = torch.randint(1, self.vocab, (size, self.length), generator=generator)
        separator = torch.zeros(size, 1, dtype=torch.long)  # token 0 never occurs among the digits
        return torch.cat([digits, separator, digits.sort(dim=1).values], dim=1)

    def split(self, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of whole sequences; targets are ignored where random."""
        targets = sequences[:, 1:].clone()
        targets[:, : self.length - 1] = IGNORE
        return sequences[:, :-1], targets

    def batch(self, *, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``size`` sequences for ``(step, rank)``, split into inputs and targets."""
        return self.split(self.sequences(step=step, index=rank, size=size))


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the scored positions, computed in fp32."""
    logits = model(tokens)
    return nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE
    )
