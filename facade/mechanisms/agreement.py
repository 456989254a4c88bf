"""Ranks agree before anything changes: one collective carries every rank's verdict.

Used at construction, before every re-plan, before a state dict or checkpoint
is installed and at each phase of a checkpoint save: each rank validates
locally, then all exchange their verdicts (:func:`verdicts`): an error, if any,
and facts that must be equal on every rank (a plan fingerprint, a digest). If
any rank failed, every rank raises, so none is left waiting in a collective the
others never enter, and nothing was modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from zeroplan.core import (
    CheckpointError,
    ConfigError,
    IncompatiblePlanError,
    PlanInvariantError,
    StepOrderError,
    ZeroPlan,
    ZeroplanError,
)
from zeroplan.facade.mechanisms.collectives import all_gather_objects

__all__ = ["agree", "as_zeroplan_error", "first_differing", "verdicts", "verdicts_across"]

#: Error classes a rank re-creates from another rank's verdict, by name.
_ERRORS: dict[str, type[ZeroplanError]] = {
    cls.__name__: cls
    for cls in (
        ZeroplanError,
        ConfigError,
        StepOrderError,
        PlanInvariantError,
        IncompatiblePlanError,
        CheckpointError,
    )
}


def as_zeroplan_error(exc: Exception, wrap: type[ZeroplanError], context: str) -> ZeroplanError:
    """``exc`` itself if it is a zeroplan error, else a ``wrap`` that names it (and chains it).

    Example:
        >>> str(as_zeroplan_error(KeyError("step"), CheckpointError, "cannot read ckpt"))
        "cannot read ckpt: KeyError: 'step'"
    """
    if isinstance(exc, ZeroplanError):
        return exc
    error = wrap(f"{context}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def verdicts(
    problem: Exception | None,
    world: dist.ProcessGroup,
    *,
    failed: str,
    facts: Any = None,
    error: type[ZeroplanError] | None = None,
) -> list[Any]:
    """Exchange every rank's verdict in one collective; raise on every rank if any rank failed.

    Args:
        problem: this rank's error, or ``None``.
        world: the ranks that must agree (all of them call this).
        failed: what a failing rank failed to do, for the others' message
            ("could not load the checkpoint").
        facts: small picklable data the caller compares across ranks.
        error: the class the other ranks raise; ``None``: the failing rank's class.

    Returns:
        Every rank's ``facts``, in rank order (only when no rank failed).

    Raises:
        ZeroplanError: ``problem`` on its own rank; on the others, an error
            naming the first failing rank and its message.
    """
    mine = None if problem is None else (type(problem).__name__, str(problem))
    rows = all_gather_objects((mine, facts), world)
    if problem is not None:
        raise problem
    for rank, (theirs, _) in enumerate(rows):
        if theirs is not None:
            name, message = theirs
            cls = error or _ERRORS.get(name, ZeroplanError)
            raise cls(f"rank {rank} {failed}: {name}: {message}")
    return [row_facts for _, row_facts in rows]


def verdicts_across(
    problem: Exception | None,
    groups: Sequence[dist.ProcessGroup | None],
    *,
    failed: str,
    error: type[ZeroplanError] | None = None,
) -> None:
    """:func:`verdicts` over each of ``groups`` in turn, then raise on every rank if any rank failed.

    [Note: agreement over a grid]
    One exchange reaches the ranks of one group. A job of several mesh
    dimensions (data-parallel x tensor x pipeline) spreads a verdict over
    its whole grid by exchanging over one dimension's group after another:
    after the tp exchange every rank of a tp group knows, after the pp
    exchange every rank of that data-parallel row, after the dp exchange
    every rank. Every rank takes part in every exchange (an error is kept,
    not raised, in between), so none waits in a collective another left.

    Args:
        problem: this rank's error, or ``None``.
        groups: one group per mesh dimension, in the order every rank uses; ``None`` entries
            (a dimension the job does not have) are skipped.
        failed: what a failing rank failed to do, for the others' message.
        error: the class the other ranks raise; ``None``: the failing rank's class.

    Raises:
        ZeroplanError: ``problem`` on its own rank; on the others, the error a group's exchange
            brought them.
    """
    for group in groups:
        if group is None:
            continue
        try:
            verdicts(problem, group, failed=failed, error=error)
        except Exception as exc:  # kept until every exchange ran
            problem = exc
    if problem is not None:
        raise problem


def first_differing(facts: list[Any]) -> int | None:
    """The first rank whose facts differ from rank 0's, or ``None`` if all are equal.

    Example:
        >>> first_differing(["a", "a", "b"]), first_differing(["a", "a"])
        (2, None)
    """
    return next((rank for rank, row in enumerate(facts) if row != facts[0]), None)


#: What it means when a rank's parameter digest, or its plan fingerprint, differs from rank 0's.
_PLAN_MISMATCH = (
    "describes different parameters than rank 0 (their order, shapes, dtypes, groups or requires_grad "
    "differ); build the same model on every rank and pass its parameters in the same order",
    "planned differently from rank 0 with the same parameters: pass the same stage, shard_group_size, "
    "strategy, bucket_bytes, alignment and optimizer settings on every rank",
)


def agree(
    zp: ZeroPlan | None,
    world: dist.ProcessGroup,
    problem: Exception | None,
    settings: dict[str, Any] | None = None,
) -> ZeroPlan:
    """Collective check that every rank validated and planned the same thing.

    All ranks exchange (error, parameter digest, the plan's settings, plan
    fingerprint, settings); if any rank failed or differs, every rank raises, so
    none is left waiting in a collective the others never enter. The plan's own
    settings (``ZeroPlan.settings``: stage, wire formats, options, ...) are
    compared by name, so a difference is reported as the field and each rank's
    value. ``settings`` holds what the plan does not describe but every rank must
    share (hyper-parameters such as ``lr``, the loss scale), as plain comparable values.
    """
    facts = None if zp is None else (zp.specs_fingerprint(), zp.settings(), zp.fingerprint(), settings)
    rows = verdicts(problem, world, failed="rejected the optimizer settings", facts=facts, error=ConfigError)
    rank = first_differing([row[0] for row in rows])
    if rank is not None:
        raise IncompatiblePlanError(f"rank {rank} {_PLAN_MISMATCH[0]}")
    field = _differing_field([row[1] for row in rows])
    if field is not None:
        values = _values_by_rank([row[1].get(field) for row in rows])
        raise IncompatiblePlanError(
            f"ranks were given different {field}: {values}; pass the same {field} on every rank"
        )
    rank = first_differing([row[2] for row in rows])
    if rank is not None:
        raise IncompatiblePlanError(f"rank {rank} {_PLAN_MISMATCH[1]}")
    rank = first_differing([row[3] for row in rows])
    if rank is not None:
        raise ConfigError(
            f"rank {rank} was given different optimizer settings than rank 0 "
            f"({_first_difference(rows[0][3], rows[rank][3], rank)}); pass the same hyper-parameters, "
            "loss_scale and ranks_per_node on every rank"
        )
    if zp is None:  # unreachable: a rank without a plan reported a problem
        raise RuntimeError("no plan and no error")
    return zp


def _differing_field(settings: list[dict[str, Any]]) -> str | None:
    """The first field (in the plan's order) on which some rank's settings differ from rank 0's (a field
    only some ranks' plans name, such as ``offload_fraction``, counts as ``None`` where absent)."""
    keys = dict.fromkeys(key for s in settings for key in s)
    return next((key for key in keys if any(s.get(key) != settings[0].get(key) for s in settings)), None)


def _values_by_rank(values: list[Any]) -> str:
    """Each distinct value with the ranks that hold it: ``'bf16' on ranks [0, 2], 'int8' on rank 1``.

    Example:
        >>> _values_by_rank(["bf16", "int8", "bf16"])
        "'bf16' on ranks [0, 2], 'int8' on rank 1"
    """
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(repr(value), []).append(rank)
    return ", ".join(
        f"{value} on rank {held[0]}" if len(held) == 1 else f"{value} on ranks {held}"
        for value, held in ranks.items()
    )


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
