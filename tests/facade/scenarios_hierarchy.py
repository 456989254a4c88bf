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


def _train_two_steps(model: Any, opt: Any, rank: int) -> None:
    for step in range(2):
        tokens, targets = batch(step, rank)
        opt.backward(loss_of(model, tokens, targets))
        opt.step()
        opt.zero_grad()


def groups_made_once(rank: int, world: int) -> dict[str, Any]:
    """Optimizers built again over the same shard and node groups reuse the groups ([Note: groups made
    once per job]); a destroyed group is made again. Returns, per setting, whether the second
    optimizer's groups are the first's, the groups made by the second and third constructions, and
    whether the second (on the kept groups, before one was destroyed) and the third (on the group made
    again) trained their copies of one model alike."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for name, settings in (("mics", {"shard": 2}), ("nodes", {"ranks_per_node": 2})):
        models = [make_model() for _ in range(3)]
        first = make_optimizer(models[0], stage=2, **settings)
        before = dist.get_pg_count()
        second = make_optimizer(models[1], stage=2, **settings)
        made_by_second = dist.get_pg_count() - before
        kept = first.process_groups
        same = [
            getattr(second.process_groups, g) is getattr(kept, g)
            for g in ("shard", "replica", "node", "cross_node")
        ]
        _train_two_steps(models[1], second, rank)
        destroyed = kept.shard if name == "mics" else kept.node
        dist.destroy_process_group(destroyed)  # on every rank
        before = dist.get_pg_count()
        third = make_optimizer(models[2], stage=2, **settings)
        made_by_third = dist.get_pg_count() - before
        renewed = third.process_groups.shard if name == "mics" else third.process_groups.node
        _train_two_steps(models[2], third, rank)
        equal = all(
            torch.equal(a, b) for a, b in zip(models[1].parameters(), models[2].parameters(), strict=True)
        )
        out[name] = {
            "same": same,
            "made_by_second": made_by_second,
            "made_by_third": made_by_third,
            "renewed": renewed is not destroyed and renewed is not None,
            "equal": equal,
        }
    return out
