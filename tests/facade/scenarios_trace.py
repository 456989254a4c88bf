"""A real step measured by torch's ``MemTracker`` against the plan with traced activations ([Note: one
timeline]): the activations are traced under fake tensors in the worker, the step runs for real."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

from zeroplan.core import memory_report
from zeroplan.core.sizing.trace import traced_step_peak
from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.cli.demo.model import DemoGPT, GPTConfig
from zeroplan.facade.diagnostics.meter import step_peaks
from zeroplan.facade.diagnostics.trace import trace_activations

CONFIG = GPTConfig(vocab=512, width=128, layers=3, heads=4, context=128, qkv_bias=True)


class Checkpointed(DemoGPT):
    """The demo GPT with each block recomputed in backward (``torch.utils.checkpoint``)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln(x))


def _build(dtype: torch.dtype, recompute: bool = False) -> torch.nn.Module:
    """The model made in ``dtype`` (``.to(dtype)`` cannot convert fake parameters: torch swaps them)."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return (Checkpointed if recompute else DemoGPT)(CONFIG)
    finally:
        torch.set_default_dtype(default)


def _loss_of(model: torch.nn.Module, rank: int, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, CONFIG.vocab, (batch, CONFIG.context), generator=g)
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, CONFIG.vocab), tokens.reshape(-1))


def whole_step(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.get("dtype", "fp32")]
    batch = cfg.get("batch", 4)
    recompute = cfg.get("recompute", False)
    trace = trace_activations(lambda: _build(dtype, recompute), lambda m: _loss_of(m, rank, batch))
    tracker = MemTracker()
    with tracker:
        model = _build(dtype, recompute)
        opt = ZeroOptimizer(
            model.parameters(), torch.optim.AdamW, stage=cfg["stage"], bucket_bytes=65_536, lr=1e-3
        )
        opt.attach(model)

    def step() -> None:
        loss = _loss_of(model, rank, batch)
        opt.backward(loss)
        del loss
        opt.step()
        opt.zero_grad()

    measured = step_peaks(tracker, step, 3)
    traced = traced_step_peak(opt.plan, trace)[rank]
    return {
        "measured": measured[-1],
        "traced": traced.peak_bytes,
        "phase": traced.phase,
        "exact": traced.exact,
        "activations": trace.peak_bytes,
        "plan_only": memory_report(opt.plan).ranks[rank].peak_bytes,
    }
