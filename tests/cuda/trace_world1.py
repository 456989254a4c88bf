"""One GPU, NCCL, world 1: the whole step planned with activations traced under fake CUDA tensors,
against ``torch.cuda.max_memory_allocated`` over a real step ([Note: one timeline]).

    python tests/cuda/trace_world1.py PORT        # prints one JSON line

The demo GPT in bf16 (SDPA on the GPU), stages 1-3, micro-batches 2 and 8. cuBLAS's workspaces are
allocated once per thread and stream by a warm-up forward and backward before the baseline (they are
the framework's, not the step's). Measured: the third step's ``max_memory_allocated`` above what was
allocated before the model was built.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

from zeroplan.core.sizing.trace import traced_step_peak
from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.cli.demo.model import DemoGPT, GPTConfig
from zeroplan.facade.diagnostics.activation_trace import trace_activations

CONFIG = GPTConfig(vocab=8192, width=512, layers=6, heads=8, context=512, qkv_bias=True)


def _build() -> torch.nn.Module:
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return DemoGPT(CONFIG)
    finally:
        torch.set_default_dtype(default)


def _loss_of(model: torch.nn.Module, batch: int) -> torch.Tensor:
    tokens = torch.randint(0, CONFIG.vocab, (batch, CONFIG.context), device="cuda")
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, CONFIG.vocab), tokens.reshape(-1))


def _warm_up() -> None:
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (a @ a).float().sum().backward()
    torch.cuda.synchronize()


def case(stage: int, batch: int) -> dict[str, Any]:
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = _build()
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-4, fused=True)
    opt.attach(model)
    trace = trace_activations(_build, lambda m: _loss_of(m, batch), device="cuda", plan=opt.plan)
    traced = traced_step_peak(opt.plan, trace)[0]
    peaks = []
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = _loss_of(model, batch)
        opt.backward(loss)
        del loss
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
    del opt, model
    return {
        "stage": stage,
        "batch": batch,
        "measured": peaks[-1],
        "traced": traced.peak_bytes,
        "ratio": peaks[-1] / traced.peak_bytes,
        "exact": traced.exact,
        "activations": trace.peak_bytes,
    }


def main(port: int) -> list[dict[str, Any]]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}", device_id=device
    )
    _warm_up()
    try:
        return [case(stage, batch) for stage in (2, 1, 3) for batch in (2, 8)]
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
