"""Scenarios of the hierarchical (two-hop) parameter gather on simulated nodes (issue 13, part 2).

Run on every rank of a worker pool (see dist_worker.py); each returns plain data.
"""

from __future__ import annotations

from typing import Any

import torch
from factory import make_optimizer
from models import DTYPES, batch, loss_of, make_model

from zeroplan.core import ZeroplanError


def _rows(costs: Any) -> list[tuple[str, str, str, int, int]]:
    return sorted((c.group, c.collective.value, c.link.value, c.calls, c.bytes) for c in costs)


def two_hops_against_one(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Two identical models trained side by side, one with ``ranks_per_node``, one without.

    Returns whether parameters and losses are bit-identical after every step,
    the last step's measured traffic next to the plan's, and whether the
    optimizer made node groups.
    """
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    models = [make_model(dtype=dtype) for _ in range(2)]
    settings = {
        "stage": cfg.get("stage", 2),
        "shard": cfg.get("shard"),
        "collectives": cfg.get("collectives", "min_bytes"),
        "bucket_bytes": cfg.get("bucket_bytes", 2048),
        "overlap_param_gather": cfg.get("overlap", True),
        "strategy": cfg.get("strategy", "auto"),
        "layout": cfg.get("layout", "auto"),
    }
    nodes = make_optimizer(models[0], ranks_per_node=cfg["per_node"], **settings)
    flat = make_optimizer(models[1], **settings)
    equal, losses_equal = [], []
    clip = cfg.get("clip", False)
    for step in range(cfg.get("steps", 3)):
        tokens, targets = batch(step, rank)
        losses = []
        for model, opt in ((models[0], nodes), (models[1], flat)):
            loss = loss_of(model, tokens, targets)
            losses.append(float(loss))
            opt.backward(loss)
            if clip:
                opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        losses_equal.append(losses[0] == losses[1])
        equal.append(
            all(
                torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True)
            )
        )
    report = nodes.memory_report(clipping=clip).ranks[nodes.process_groups.rank]
    flat_report = flat.memory_report(clipping=clip).ranks[flat.process_groups.rank]
    groups = nodes.process_groups
    return {
        "equal": equal,
        "losses_equal": losses_equal,
        "comm": _rows(nodes.last_step_comm()),
        "planned_comm": _rows(report.comm),
        "flat_comm": _rows(flat.last_step_comm()),
        "flat_planned_comm": _rows(flat_report.comm),
        "sent": (report.comm_bytes_per_step, flat_report.comm_bytes_per_step),
        "hierarchical": nodes.plan.topology.hierarchical,
        "node_groups": (groups.node is not None, groups.cross_node is not None),
        "fingerprints_equal": nodes.plan.fingerprint() == flat.plan.fingerprint(),
    }


def disagreeing_ranks_per_node(rank: int, world: int) -> str | None:
    """Rank 0 says 2 ranks per node, the others nothing: every rank raises before any group is made."""
    try:
        make_optimizer(make_model(), ranks_per_node=2 if rank == 0 else None)
    except ZeroplanError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
