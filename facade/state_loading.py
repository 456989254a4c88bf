"""Loading validated optimizer state into a live ``ZeroOptimizer``.

Shared by ``load_state_dict`` and ``zeroplan.facade.checkpoint.load``: first
everything is read and validated into a :class:`LoadedState` (nothing is
modified; a bad input raises here), then ``ZeroOptimizer.restore`` adopts its
plan and :func:`commit_state` copies, which cannot fail for a user reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from zeroplan.core import ZeroPlan
from zeroplan.facade.inner import sync_hyperparameters
from zeroplan.facade.installed import Installed
from zeroplan.facade.shard_state import ShardState, import_state
from zeroplan.facade.state_dicts import (
    Shards,
    check_plain,
    cohorts_of_plain,
    is_sharded,
    parked_from_plain,
    shard_state_from_plain,
    shard_state_from_sharded,
)
from zeroplan.facade.state_tree import ParkedParam, decode_parked, tree_clone

__all__ = ["LoadedState", "commit_state", "copy_param_values", "read_state_dict"]


class LoadedState(NamedTuple):
    """Validated state, laid out for plan ``target``, ready to install.

    Attributes:
        target: the plan the state is in (the running plan, or the same
            parameters in other cohorts).
        state: this rank's optimizer state in ``target``'s shard coordinates.
        stateful: the (group, cohort) pairs that carry state; others start fresh.
        masters: per dtype space, this rank's fp32 masters; ``None``: start them
            from the parameters.
        param_groups: hyper-parameters to install, per param group.
        scaler: the dynamic loss scaler's fields, or ``None`` to keep it.
        param_values: per parameter, its saved values as consecutive flat parts
            (checkpoints), or ``None`` to keep the parameters.
        parked: this rank's parked state of frozen parameters (see [Note: parked state]).
    """

    target: ZeroPlan
    state: ShardState
    stateful: set[tuple[int, int]]
    masters: dict[str, torch.Tensor] | None
    param_groups: list[dict[str, Any]]
    scaler: dict[str, Any] | None
    param_values: list[list[torch.Tensor]] | None = None
    parked: dict[int, ParkedParam] | None = None


def read_state_dict(
    state_dict: dict[str, Any], sh: Shards, plan_with_cohorts: Callable[[Iterable[int]], ZeroPlan]
) -> LoadedState:
    """Validate a sharded dict (same plan) or a plain torch dict (any plan); change nothing.

    Raises:
        ConfigError, IncompatiblePlanError: the dict does not fit this optimizer.
    """
    if is_sharded(state_dict):
        state, stateful, masters = shard_state_from_sharded(state_dict, sh)
        parked = tree_clone(
            decode_parked(state_dict["parked"]), sh.buffers[0].params.device if sh.buffers else None
        )
        return LoadedState(
            sh.zp, state, stateful, masters, state_dict["param_groups"], state_dict["scaler"], parked=parked
        )
    check_plain(state_dict, sh)
    target = plan_with_cohorts(cohorts_of_plain(state_dict, sh.zp))
    state, stateful, masters = shard_state_from_plain(state_dict, target, sh)
    parked = parked_from_plain(state_dict, target, sh)
    # A dict without fp32 masters: start them from the parameters.
    return LoadedState(
        target, state, stateful, masters or None, state_dict["param_groups"], None, parked=parked
    )


@torch.no_grad()
def copy_param_values(params: Sequence[torch.Tensor], values: Sequence[Sequence[torch.Tensor]]) -> None:
    """Copy each parameter's saved flat parts into it, in place (any memory layout)."""
    for param, parts in zip(params, values, strict=True):
        if len(parts) == 1:  # any layout (frozen parameters keep their own storage)
            param.data.copy_(parts[0].view(param.shape))
            continue
        # A split parameter is a view of its flat buffer: copy each fragment into place,
        # with no intermediate concatenation.
        flat, offset = param.data.view(-1), 0
        for part in parts:
            flat[offset : offset + part.numel()].copy_(part)
            offset += part.numel()


@torch.no_grad()
def commit_state(installed: Installed, loaded: LoadedState, param_groups: Sequence[dict[str, Any]]) -> None:
    """Install ``loaded`` (already in ``installed``'s plan): masters, inner state, hyper-parameters."""
    shard_rank = installed.groups.shard_rank
    for buf in installed.buffers:
        if not buf.separate_master:
            continue
        if loaded.masters is None:
            buf.master[: buf.owned].copy_(buf.region(shard_rank).float())
        elif buf.space.dtype in loaded.masters:
            buf.master[: buf.owned].copy_(loaded.masters[buf.space.dtype])
    installed.inner.optimizer.state.clear()
    import_state(installed.zp, installed.inner, loaded.state, loaded.stateful)
    sync_hyperparameters(loaded.param_groups, param_groups)
