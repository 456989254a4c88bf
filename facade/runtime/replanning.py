"""Re-planning a live ``ZeroOptimizer``: trainability changes, new param groups, new cohorts.

[Note: re-planning]
A new plan is computed purely from a *new* :class:`ParamRegistry`, agreed on
by every rank (one collective that also carries any rank's validation error),
and only then installed: new flat buffers (parameter values copied in), a new
inner optimizer, and the master weights and optimizer state moved by the
core's reshard plan (``shard_state.move_shards``). Parameters that stay
trainable keep their state; those that become trainable start fresh in a new
cohort (their own ``step``); those that become frozen release theirs. A rank
that rejects the change makes every rank raise, and since the old registry
and installation were never modified, nothing needs undoing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zeroplan.core import ZeroPlan, plan_reshard
from zeroplan.facade.mechanisms.agreement import agree
from zeroplan.facade.mechanisms.collectives import all_gather_objects
from zeroplan.facade.runtime.inputs import collect_params
from zeroplan.facade.runtime.installed import Installed
from zeroplan.facade.runtime.registry import ParamRegistry, PlanSettings
from zeroplan.facade.state.inner import check_hyperparameters, comparable_hyperparameters
from zeroplan.facade.state.parked import ParkedParam, gather_parked, park, unpark
from zeroplan.facade.state.shards import export_state, import_state, move_shards

__all__ = ["add_param_group", "agreed_plan", "refresh_trainable", "replan"]


def agreed_plan(
    make: Callable[[], tuple[ZeroPlan, list[dict[str, Any]]]], world: dist.ProcessGroup, **shared: Any
) -> ZeroPlan:
    """``make()``'s plan once every rank planned the same with the same settings.

    ``make`` returns the plan and the param groups' settings, which every rank
    must share (with ``shared``, e.g. the loss scale). Any exception of any
    rank in ``make`` raises everywhere: the rank itself re-raises it, the
    others raise a ``ConfigError`` naming it, so none waits in a collective.
    """
    zp, settings, problem = None, None, None
    try:
        zp, groups = make()
        settings = {"param_groups": comparable_hyperparameters(groups), **shared}
    except Exception as exc:
        problem = exc
    return agree(zp, world, problem, settings)


def refresh_trainable(
    registry: ParamRegistry,
    settings: PlanSettings,
    current: ZeroPlan,
    hyper: Sequence[dict[str, Any]],
    world: dist.ProcessGroup,
    parked: Collection[int],
) -> tuple[ParamRegistry, ZeroPlan]:
    """The registry and agreed plan after ``requires_grad`` changed (see [Note: re-planning]).

    ``parked``: this rank's parameters with parked state; every rank learns
    all of them (a collective), so that all give them the same cohorts.
    """
    revived = {p for mine in all_gather_objects(sorted(parked), world) for p in mine}
    candidate = registry.with_newly_trainable(current.trainable_indices, revived)
    return candidate, agreed_plan(lambda: (settings.plan(candidate, hyper), list(hyper)), world)


def add_param_group(
    registry: ParamRegistry,
    settings: PlanSettings,
    hyper: Sequence[dict[str, Any]],
    defaults: dict[str, Any],
    param_group: dict[str, Any],
    world: dist.ProcessGroup,
    listed: Sequence[tuple[torch.Tensor, str]],
    first_group: int,
) -> tuple[ParamRegistry, ZeroPlan, dict[str, Any]]:
    """The registry, agreed plan and new group's settings with ``param_group`` appended.

    ``listed``: every parameter of the optimizer (of every domain) and where it is listed, which
    the group may not list again; ``first_group``: the group's index in ``param_groups``.

    Raises:
        ConfigError: on every rank, if any rank's group is invalid.
    """
    added: list[Any] = []

    def make() -> tuple[ZeroPlan, list[dict[str, Any]]]:
        inputs = collect_params(
            [param_group],
            start=len(registry.params),
            seen=listed,
            tensor_mesh=registry.tensor_mesh,
            first_group=first_group,
        )
        group = {**defaults, **inputs.groups[0]}
        check_hyperparameters(settings.optimizer_class, [group])
        candidate = registry.with_group(inputs)
        added[:] = [candidate, group]
        groups = [*hyper, group]
        return settings.plan(candidate, groups), groups

    zp = agreed_plan(make, world)
    candidate, group = added
    return candidate, zp, group


def replan(
    old: Installed,
    zp: ZeroPlan,
    params: Sequence[torch.Tensor],
    install: Callable[[ZeroPlan], Installed],
    parked: Mapping[int, ParkedParam],
) -> tuple[Installed, dict[int, ParkedParam]]:
    """Install the agreed plan ``zp`` and move master weights and optimizer state into it.

    ``old`` must have no step in progress; its hooks are removed and parameters
    that become frozen get storage of their own (they leave the old flat
    buffer) and their state is parked; parameters trainable again get their
    parked state back (see [Note: parked state]). Returns the new installation
    and this rank's parked state.
    """
    groups = old.groups
    frozen = old.zp.trainable_indices - zp.trainable_indices
    newly = zp.trainable_indices - old.zp.trainable_indices
    state = export_state(old.zp, old.inner, old.buffers)
    reshard = plan_reshard(old.zp.partition, zp.partition, allow_trainable_change=True)
    still = {p: v for p, v in parked.items() if p not in newly}
    still.update(park(old.zp, old.buffers, state, frozen, groups.shard_rank))
    revived = gather_parked(parked, newly, groups) if newly else {}
    old.sync.remove_hooks()
    old.residency.finish_param_sync()
    for index in sorted(frozen):
        param = params[index]
        param.data = param.data.clone()
        param.grad = None
    new = install(zp)
    moved, stateful = move_shards(
        old_zp=old.zp,
        old_buffers=old.buffers,
        old_state=state,
        new_zp=zp,
        new_buffers=new.buffers,
        reshard=reshard,
        groups=new.groups,
        device=new.device,
    )
    unpark(zp, new.buffers, moved, stateful, revived, groups.shard_rank, new.device)
    import_state(zp, new.inner, moved, stateful)
    return new, still
