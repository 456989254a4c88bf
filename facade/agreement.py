"""Ranks agree before anything changes: one collective carries every rank's verdict.

Used at construction and before every re-plan or load: each rank validates
and plans locally, then all exchange (error, parameter digest, plan
fingerprint). If any rank failed or differs, every rank raises, so none is
left waiting in a collective the others never enter, and nothing was modified.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zeroplan.core import ConfigError, IncompatiblePlanError, ZeroPlan, ZeroplanError
from zeroplan.facade.collectives import all_gather_objects

__all__ = ["agree"]


def agree(
    zp: ZeroPlan | None,
    world: dist.ProcessGroup,
    problem: ZeroplanError | None,
    settings: dict[str, Any] | None = None,
) -> ZeroPlan:
    """Collective check that every rank validated and planned the same thing.

    All ranks exchange (error, parameter digest, plan fingerprint, settings);
    if any rank failed or differs, every rank raises, so none is left waiting
    in a collective the others never enter. ``settings`` holds what the plan
    does not fingerprint but every rank must share (hyper-parameters such as
    ``lr``, the loss scale), as plain comparable values.
    """
    mine = (
        None if problem is None else f"{type(problem).__name__}: {problem}",
        None if zp is None else zp.specs_fingerprint(),
        None if zp is None else zp.fingerprint(),
        settings,
    )
    rows = all_gather_objects(mine, world)
    if problem is not None:
        raise problem
    for rank, (error, specs, fingerprint, theirs) in enumerate(rows):
        if error is not None:
            raise ConfigError(f"rank {rank} rejected the optimizer settings: {error}")
        if specs != rows[0][1]:
            raise IncompatiblePlanError(
                f"rank {rank} describes different parameters than rank 0 (their order, shapes, dtypes, "
                "groups or requires_grad differ); build the same model on every rank and pass its "
                "parameters in the same order"
            )
        if fingerprint != rows[0][2]:
            raise IncompatiblePlanError(
                f"rank {rank} planned differently from rank 0 with the same parameters: pass the same "
                "stage, shard_group_size, strategy, bucket_bytes, alignment and optimizer settings "
                "on every rank"
            )
        if theirs != rows[0][3]:
            raise ConfigError(
                f"rank {rank} was given different optimizer settings than rank 0 "
                f"({_first_difference(rows[0][3], theirs, rank)}); pass the same hyper-parameters and "
                "loss_scale on every rank"
            )
    if zp is None:  # unreachable: a rank without a plan reported a problem
        raise RuntimeError("no plan and no error")
    return zp


def _first_difference(a: Any, b: Any, rank: int, where: str = "") -> str:
    """Where two nested settings values first differ, e.g. ``param_groups[0]['lr']: 0.1 vs 0.2``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if a.get(key) != b.get(key):
                return _first_difference(
                    a.get(key), b.get(key), rank, f"{where}[{key!r}]" if where else str(key)
                )
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, rank, f"{where}[{i}]")
    return f"{where or 'settings'}: {a!r} on rank 0, {b!r} on rank {rank}"
