"""Gradient wire formats: one reduction at world W against the exact average, traffic and memory."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from factory import make_optimizer
from models import DTYPES, batch, loss_of, make_model


def reduced_error(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The averaged gradients of one step with ``cfg["wire"]``: their largest error against the fp64
    average of every rank's own gradients, the largest gradient of any rank, and the accounting."""
    dtype = DTYPES[cfg.get("dtype", "bf16")]
    model = make_model(dtype=dtype)
    opt = make_optimizer(
        model,
        hyper={"lr": 1e-3},
        stage=cfg.get("stage", 2),
        shard=cfg.get("shard"),
        alignment=cfg.get("alignment", 16),
        bucket_bytes=cfg.get("bucket_bytes", 2048),
        reduce_dtype=cfg.get("wire"),
        wire_block=cfg.get("block", 16),
        **({"layout": cfg["layout"]} if "layout" in cfg else {}),
    )
    opt.attach(model)
    reference = make_model(dtype=dtype)
    tokens = batch(0, rank)
    own = torch.autograd.grad(loss_of(reference, *tokens), list(reference.parameters()))
    exact = torch.cat([g.double().reshape(-1) for g in own])
    largest = exact.abs().max().reshape(1)
    dist.all_reduce(exact)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    opt.backward(loss_of(model, *tokens))
    got = torch.cat([g.double().reshape(-1) for g in opt.averaged_gradients()])
    error = (got - exact / world).abs().max().item()
    opt.step()
    opt.zero_grad()
    report = opt.memory_report().ranks[opt.process_groups.rank]
    measured = opt.measured_memory()
    return {
        "error": error,
        "largest": largest.item(),
        "comm": sorted(
            (c.group, c.collective.value, c.link.value, c.calls, c.bytes) for c in opt.last_step_comm()
        ),
        "planned_comm": sorted(
            (c.group, c.collective.value, c.link.value, c.calls, c.bytes) for c in report.comm
        ),
        "measured": (
            measured.params_bytes,
            measured.grads_bytes,
            measured.master_bytes,
            measured.buffer_bytes,
        ),
        "planned": (report.params_bytes, report.grads_bytes, report.master_bytes, report.buffer_bytes),
    }


def with_wire(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """Construct with ``cfg``'s settings (which may differ per rank): for the refusals."""
    settings = cfg["per_rank"][rank] if "per_rank" in cfg else cfg
    make_optimizer(make_model(), hyper={"lr": 1e-3}, alignment=16, **settings)
