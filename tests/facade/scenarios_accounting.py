"""Measured bytes per rank and traffic per step against the planner's report."""

from __future__ import annotations

from typing import Any

import torch
from factory import OPTIMIZERS, make_optimizer
from models import DTYPES, batch, loss_of, make_model


def measured_vs_planned(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """After two steps: measured memory and last-step traffic next to the plan's numbers."""
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    model = make_model(dtype=dtype)
    model.pos.weight.requires_grad_(False)  # a frozen parameter is counted too
    optimizer = cfg.get("optimizer", "adamw")
    opt = make_optimizer(
        model,
        optimizer=optimizer,
        hyper={**OPTIMIZERS[optimizer].plain, "lr": 1e-3},  # SGD with momentum: it has state to count
        stage=cfg.get("stage", 2),
        shard=cfg.get("shard"),
        bucket_bytes=cfg.get("bucket_bytes", 1024),
        alignment=8,
        strategy=cfg.get("strategy", "auto"),
        loss_scale="dynamic" if dtype == torch.float16 else None,
        collectives=cfg.get("collectives", "auto"),
        deterministic=cfg.get("deterministic", False),
    )
    clip = cfg.get("clip", False)
    for step in range(2):
        opt.backward(loss_of(model, *batch(step, rank)))
        if clip:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    report = opt.memory_report(clipping=clip).ranks[opt.process_groups.rank]
    measured = opt.measured_memory()
    planned = (
        report.params_bytes,
        report.grads_bytes,
        report.master_bytes,
        report.optimizer_state_bytes,
        report.buffer_bytes,
    )
    return {
        "measured": tuple(measured),
        "planned": planned,
        "comm": sorted(
            (c.group, c.collective.value, c.link.value, c.calls, c.bytes) for c in opt.last_step_comm()
        ),
        "planned_comm": sorted(
            (c.group, c.collective.value, c.link.value, c.calls, c.bytes) for c in report.comm
        ),
        "state_bytes": measured.optimizer_state_bytes,
    }
