"""Re-planning a live ``ZeroOptimizer``: trainability changes, new param groups, new cohorts.

[Note: re-planning]
A new plan is computed purely, agreed on by every rank (one collective that
also carries any rank's validation error), and only then installed: new flat
buffers (parameter values copied in), a new inner optimizer, and the master
weights and optimizer state moved by the core's reshard plan
(``shard_state.move_shards``). Parameters that stay trainable keep their state;
those that become trainable start fresh in a new cohort (their own ``step``);
those that become frozen release theirs. These functions are the optimizer's
own methods, kept in a module of their own; they read its private fields.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroplan.core import ZeroPlan, ZeroplanError, plan_reshard
from zeroplan.facade.agreement import agree
from zeroplan.facade.inner import check_hyperparameters, hyperparameters
from zeroplan.facade.inputs import collect_params
from zeroplan.facade.shard_state import export_state, import_state, move_shards

__all__ = ["add_param_group", "adopt_cohorts", "plan_with_cohorts", "refresh_trainable", "replan"]


def _hyper(opt: Any) -> list[dict[str, Any]]:
    return [hyperparameters(g) for g in opt.param_groups]


def plan_with_cohorts(opt: Any, cohorts: list[int]) -> ZeroPlan:
    """The optimizer's plan with other cohorts (pure: changes nothing)."""
    saved = opt._cohorts
    opt._cohorts = list(cohorts)
    try:
        return opt._plan(_hyper(opt))
    finally:
        opt._cohorts = saved


def adopt_cohorts(opt: Any, zp: ZeroPlan) -> None:
    """Switch to ``zp``, a :func:`plan_with_cohorts` plan every rank derived from the same data."""
    opt._cohorts = [s.cohort for s in zp.specs]
    opt._next_cohort = max(opt._cohorts, default=0) + 1
    replan(opt, zp)


def refresh_trainable(opt: Any) -> None:
    """Re-plan after ``requires_grad`` changed (see [Note: re-planning])."""
    trainable = {s.index for s in opt._zp.specs if s.trainable}
    cohorts = list(opt._cohorts)
    for index, param in enumerate(opt._params):
        if param.requires_grad and index not in trainable:
            opt._cohorts[index] = opt._next_cohort
    zp, problem = None, None
    try:
        zp = opt._plan(_hyper(opt))
    except ZeroplanError as exc:
        problem = exc
    try:
        zp = agree(zp, opt._world, problem)
    except ZeroplanError:
        opt._cohorts = cohorts
        raise
    opt._next_cohort += 1
    replan(opt, zp)


def add_param_group(opt: Any, param_group: dict[str, Any]) -> None:
    """Append a param group with fresh state; a bad group raises everywhere and changes nothing."""
    start, saved = len(opt._params), (list(opt._group_members), opt._next_cohort)
    zp, problem, group = None, None, None
    try:
        inputs = collect_params([param_group], start=start, seen=opt._params)
        group = {**opt.defaults, **inputs.groups[0]}
        check_hyperparameters(opt._optimizer_class, [group])
        opt._params.extend(inputs.params)
        opt._names.extend(inputs.names)
        opt._group_members.append(list(group["params"]))
        opt._cohorts.extend([opt._next_cohort] * len(inputs.params))
        opt._next_cohort += 1
        zp = opt._plan([*_hyper(opt), group])
    except ZeroplanError as exc:
        problem = exc
    try:
        zp = agree(zp, opt._world, problem)
    except ZeroplanError:
        del opt._params[start:], opt._names[start:], opt._cohorts[start:]
        opt._group_members, opt._next_cohort = saved
        raise
    torch.optim.Optimizer.add_param_group(opt, {**group, "params": opt._params[start:]})
    replan(opt, zp)


def replan(opt: Any, zp: ZeroPlan) -> None:
    """Move buffers, master weights and optimizer state to an agreed new plan."""
    if zp.fingerprint() == opt._zp.fingerprint():
        return
    opt._sync.reset()
    opt._release_grads()
    old_zp, old_buffers = opt._zp, opt._buffers
    state = export_state(old_zp, opt._inner, old_buffers)
    reshard = plan_reshard(old_zp.partition, zp.partition, allow_trainable_change=True)
    opt._sync.remove_hooks()
    managed = {index for buf in old_buffers for index in buf.space.params}
    for index in managed:
        if not zp.specs[index].trainable:
            param = opt._params[index]
            param.data = param.data.clone()  # leave the old flat buffer
            param.grad = None
    opt._install(zp)
    moved, stateful = move_shards(
        old_zp=old_zp,
        old_buffers=old_buffers,
        old_state=state,
        new_zp=zp,
        new_buffers=opt._buffers,
        reshard=reshard,
        groups=opt._groups,
    )
    import_state(zp, opt._inner, moved, stateful)
