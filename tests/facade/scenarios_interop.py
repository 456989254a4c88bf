"""What replacing DDP needs besides the optimizer: gradient norms to log, and module buffers.

``grad_norm`` compares ``opt.grad_norm()`` with ``torch.nn.utils.clip_grad_norm_``
on the unsharded model; ``buffers`` trains a BatchNorm model next to DDP
(``broadcast_buffers=True``) and compares the running statistics.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from factory import make_optimizer
from models import averaged_grads, batch, loss_of, make_model, rel_err
from torch import nn

from zeroplan.core import StepOrderError
from zeroplan.facade import ZeroOptimizer, broadcast_buffers

NORM_TYPES = (2.0, 1.0, math.inf)


def _refused(call: Any) -> str | None:
    try:
        call()
    except StepOrderError as exc:
        return str(exc)
    return None


def grad_norm(rank: int, world: int, stage: int) -> dict[str, Any]:
    """``opt.grad_norm()`` against the unsharded model's ``clip_grad_norm_(params, inf)``, step by step."""
    model, ref = make_model(), make_model()
    # Rank-major: an interleaved shard sums |g| in another order than torch's per-tensor norms, which
    # moves the fp32 L1 norm by ~1.5e-6 relative, beyond this test's 1e-6.
    opt = make_optimizer(model, stage=stage, hyper={"lr": 1e-2}, layout="rank_major")
    refs = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    keys = ("norms", "ref_norms", "repeat_equal", "clip_equal", "grad_is_none", "not_logged")
    out: dict[str, Any] = {key: [] for key in keys}
    out["before_backward"] = _refused(opt.grad_norm)
    for step in range(3):
        if step == 1:  # accumulation: grad_norm sees the sum, as after DDP's no_sync
            with opt.no_sync():
                opt.backward(loss_of(model, *batch(10 + step, rank)) / 2)
            opt.backward(loss_of(model, *batch(step, rank)) / 2)
        else:
            opt.backward(loss_of(model, *batch(step, rank)))
        out["grad_is_none"].append(all(p.grad is None for p in model.parameters()))
        norms = [opt.grad_norm(norm_type) for norm_type in NORM_TYPES]
        out["norms"].append([float(n) for n in norms])
        out["repeat_equal"].append(
            all(torch.equal(opt.grad_norm(t), n) for t, n in zip(NORM_TYPES, norms, strict=True))
        )
        # clip_grad_norm_ returns the same norm; afterwards grad_norm is that of the clipped gradients.
        max_norm = 0.01 if step == 2 else 1e30
        out["clip_equal"].append(torch.equal(opt.clip_grad_norm_(max_norm), norms[0]))
        comm_before = opt.lifecycle.log.summary()
        out["after_clip"] = float(opt.grad_norm())
        out["not_logged"].append(opt.lifecycle.log.summary() == comm_before)
        opt.step()
        opt.zero_grad()
        # The unsharded reference: gradients averaged over the ranks' batches, as DDP has them.
        if step == 1:
            parts = [averaged_grads(ref, world, 10 + step), averaged_grads(ref, world, step)]
            grads = [(a + b) / 2 for a, b in zip(*parts, strict=True)]
        else:
            grads = averaged_grads(ref, world, step)
        for p, g in zip(ref.parameters(), grads, strict=True):
            p.grad = g
        out["ref_norms"].append(
            [float(torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf, t)) for t in NORM_TYPES]
        )
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        refs.step()
        refs.zero_grad()
    out["after_step"] = _refused(opt.grad_norm)
    out["param_error"] = max(rel_err(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    return out


class BatchNormNet(nn.Module):
    """An MLP with BatchNorm (float and int64 buffers) and a bool buffer, odd sizes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 11), nn.BatchNorm1d(11), nn.ReLU(), nn.Linear(11, 3))
        self.register_buffer("flag", torch.zeros(2, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 5, generator=g) * (1 + rank) + rank, torch.randn(6, 3, generator=g)


def buffers(rank: int, world: int, stage: int) -> dict[str, Any]:
    """DDP (broadcast_buffers=True) + AdamW next to ZeroOptimizer + broadcast_buffers before each forward."""
    ddp_model, zero_model, drifting = BatchNormNet(), BatchNormNet(), BatchNormNet()
    ddp = nn.parallel.DistributedDataParallel(ddp_model, broadcast_buffers=True)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-2)
    zero_opt = ZeroOptimizer(zero_model.parameters(), torch.optim.AdamW, lr=1e-2, stage=stage)
    drift_opt = ZeroOptimizer(drifting.parameters(), torch.optim.AdamW, lr=1e-2, stage=stage)
    for model in (ddp_model, zero_model, drifting):
        model.flag.fill_(rank == 0)
    for step in range(4):
        x, y = _data(step, rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
        broadcast_buffers(zero_model)  # where DDP broadcasts: at the start of each forward
        nn.functional.mse_loss(zero_model(x), y).backward()
        zero_opt.step()
        zero_opt.zero_grad()
        nn.functional.mse_loss(drifting(x), y).backward()
        drift_opt.step()
        drift_opt.zero_grad()
    as_ddp = all(torch.equal(a, b) for a, b in zip(zero_model.buffers(), ddp_model.buffers(), strict=True))
    params_as_ddp = all(
        torch.equal(a, b) for a, b in zip(zero_model.parameters(), ddp_model.parameters(), strict=True)
    )
    broadcast_buffers(zero_model)  # before evaluating or saving: every rank holds rank 0's statistics
    return {
        "as_ddp": as_ddp,
        "params_as_ddp": params_as_ddp,
        "buffers": {n: b.clone() for n, b in zero_model.named_buffers()},
        "drifting": {n: b.clone() for n, b in drifting.named_buffers()},
    }
