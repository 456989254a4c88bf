"""A real step measured by torch's ``MemTracker`` against the plan with traced activations ([Note: one
timeline]): the activations are traced under fake tensors in the worker, the step runs for real."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

from zeroplan.core import memory_report
from zeroplan.core.sizing.trace import traced_step_peak
from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.cli.demo.model import DemoGPT, GPTConfig
from zeroplan.facade.diagnostics.activation_trace import trace_activations
from zeroplan.facade.diagnostics.meter import step_peaks

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
    return _measure_and_trace(
        rank,
        lambda: _build(dtype, recompute),
        lambda m: _loss_of(m, rank, batch),
        cfg["stage"],
        cfg.get("reshard", True),
        cfg.get("wire"),
    )


def _measure_and_trace(
    rank: int,
    build: Callable[[], torch.nn.Module],
    loss_of: Callable[[torch.nn.Module], torch.Tensor],
    stage: int,
    reshard: bool = True,
    wire: str | None = None,
) -> dict[str, Any]:
    """MemTracker over three real steps (the third's peak), and the plan with the activations traced
    twice: alone (gradients added by the plan) and with the plan's schedule keeping the gradients."""
    tracker = MemTracker()
    with tracker:
        model = build()
        extra = {"reshard_after_forward": reshard} if stage == 3 else {}
        wired = {"gather_dtype": wire} if wire else {}
        opt = ZeroOptimizer(
            model.parameters(), torch.optim.AdamW, stage=stage, bucket_bytes=65_536, lr=1e-3, **extra, **wired
        )
        opt.attach(model)
    # The plan carries reshard_after_forward ([Note: plan options]): the trace and the peaks read it there.
    assert opt.plan.options.reshard_after_forward is reshard or stage != 3
    alone = traced_step_peak(opt.plan, trace_activations(build, loss_of))[rank]
    traced = trace_activations(build, loss_of, plan=opt.plan)
    with_plan = traced_step_peak(opt.plan, traced)[rank]

    def step() -> None:
        loss = loss_of(model)
        opt.backward(loss)
        del loss
        opt.step()
        opt.zero_grad()

    measured = step_peaks(tracker, step, 3)
    return {
        "measured": measured[-1],
        "traced": with_plan.peak_bytes,
        "phase": with_plan.phase,
        "exact": with_plan.exact,
        "alone": alone.peak_bytes,
        "alone_exact": alone.exact,
        "plan_only": memory_report(opt.plan).ranks[rank].peak_bytes,
        "gathered": max(p.gathered for p in traced.points),
    }


def hf_config(
    arch: str,
    *,
    width: int = 128,
    mlp: int = 344,
    vocab: int = 512,
    positions: int = 256,
    attn: str = "sdpa",
    layers: int = 2,
) -> Any:
    """A GPT-2 (``arch="gpt2"``; ``mlp`` unused) or Llama config of ``layers`` layers, with 4 heads
    (Llama: 2 of keys and values) and the attention kernel ``attn``."""
    import transformers

    if arch == "gpt2":
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=positions
        )
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=width, intermediate_size=mlp, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=positions,
        )  # fmt: skip
    config._attn_implementation = attn
    return config


def hf_model(config: Any, recompute: bool = False) -> torch.nn.Module:
    """The causal LM of ``config`` in training mode, with gradient checkpointing when ``recompute``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config)
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def hf_whole_step(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """``whole_step`` for a Hugging Face model built from a small config."""
    config = hf_config(cfg["arch"])
    seq, batch = cfg.get("seq", 128), cfg.get("batch", 2)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return hf_model(config, cfg.get("recompute", False))

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        return model(input_ids=ids, labels=ids).loss

    return _measure_and_trace(rank, build, loss_of, cfg["stage"])
