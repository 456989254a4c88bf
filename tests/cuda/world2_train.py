"""World 2 on one device over gloo: ``ZeroOptimizer`` against ``AdamW`` on the whole model.

Run by ``world2.py`` on each rank. As the CPU equivalence tests
(``tests/facade/test_equivalence.py``) do, every step checks two things on
rank 0, against a single-process reference on the same device:

* the gradients the step applies (``averaged_gradients()``) equal the exact
  average of both ranks' gradients, computed by the reference in fp32;
* given those gradients, the sharded step equals ``torch.optim.AdamW`` on fp32
  master copies of the whole model, rounded into the model's dtype.

Comparing parameters of two runs that summed gradients in different orders
would test the summation order (Adam's normalised update magnifies a last-bit
difference where gradients nearly cancel), not the sharding.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.cli.demo.model import GPTConfig, build_model, loss_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Odd sizes (an MLP of 3 * width + 1, vocabulary 37) exercise the padding of shards and buckets.
CONFIG = GPTConfig(vocab=37, width=48, layers=2, heads=2, context=16, ffn=145, qkv_bias=True)
HYPER = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "fused": True}
STEPS = 4
BATCH = 4


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic tokens for (step, rank): next-token targets of a learnable pattern."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, CONFIG.vocab, (BATCH, 1), generator=g)
    seq = (start + torch.arange(CONFIG.context + 1) * 3) % CONFIG.vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max-norm relative difference of two tensors (compared in fp32)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


def averaged_grads(model: nn.Module, world: int, step: int, device: torch.device) -> list[torch.Tensor]:
    """Every rank's gradient of ``step``, averaged in fp32, as data-parallel training would apply."""
    total = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    for r in range(world):
        model.zero_grad(set_to_none=True)
        loss_of(model, *batch(step, r, device)).backward()
        for acc, p in zip(total, model.parameters(), strict=True):
            acc += p.grad.float()
    model.zero_grad(set_to_none=True)
    return [t / world for t in total]


def digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal on two ranks iff the parameters are bit-identical."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(rank: int, world: int, device: torch.device, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train for ``STEPS`` with ``ZeroOptimizer(collectives="gloo")``; rank 0 compares every step."""
    dtype = DTYPES[cfg["dtype"]]
    model = build_model(CONFIG, seed=0, dtype=dtype, device=device)
    opt = ZeroOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        stage=cfg["stage"],
        collectives="gloo",
        layout="rank_major",  # all-reduce and broadcasts: gloo carries them for CUDA tensors
        bucket_bytes=2048,  # several buckets, so several all-reduces per step
        alignment=16,
        **HYPER,
    )
    reference = build_model(CONFIG, seed=0, dtype=dtype, device=device) if rank == 0 else None
    masters = [p.detach().float().clone() for p in reference.parameters()] if reference else []
    ref_opt = torch.optim.AdamW(masters, **HYPER) if reference else None
    errors, grad_errors, losses, collectives = [], [], [], set()
    for step in range(STEPS):
        loss = loss_of(model, *batch(step, rank, device))
        opt.backward(loss)
        reduced = opt.averaged_gradients()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        collectives.update(c.collective.value for c in opt.last_step_comm())
        if reference is None:
            continue
        expected = averaged_grads(reference, world, step, device)
        grad_errors.append(max(rel_err(a, b) for a, b in zip(reduced, expected, strict=True)))
        for master, g in zip(masters, reduced, strict=True):
            master.grad = g.clone()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, reference.parameters(), strict=True):
                p.copy_(master)
        errors.append(
            max(rel_err(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
        )
    return {
        "device": str(opt.buffers[0].params.device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "buckets": len(opt.plan.buckets.buckets),
        "collectives": sorted(collectives),
        "losses": losses,
        "errors": errors,
        "grad_errors": grad_errors,
        "params_sha256": digest(model),
    }
