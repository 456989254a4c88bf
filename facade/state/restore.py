"""Loading validated optimizer state into a live ``ZeroOptimizer``.

Shared by ``load_state_dict`` and ``zeroplan.facade.checkpoint.load``: first
everything is read and validated into a :class:`LoadedState` (nothing is
modified; a bad input raises here), then every rank agrees
(:func:`agreed_state`), then ``ZeroOptimizer.restore`` adopts its plan and
:func:`commit_state` copies, which cannot fail for a user reason.

[Note: load agreement]
Reading is local and may fail on one rank only (its own sharded dict, a shard
file only it reads); installing is collective (a re-plan moves state between
ranks). So :func:`agreed_state` turns any exception of the read into a
``ZeroplanError`` and exchanges every rank's verdict and facts (the plan the
state is laid out for, a digest of its hyper-parameters and scaler, the
source's digest) before anything changes: if any rank failed, or ranks read
state for different plans or with different hyper-parameters, every rank
raises and no rank installs anything.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from zeroplan.core import ConfigError, IncompatiblePlanError, ScalerState, ZeroPlan, ZeroplanError
from zeroplan.facade.mechanisms.agreement import as_zeroplan_error, first_differing, verdicts
from zeroplan.facade.params.buffers import SpaceBuffers
from zeroplan.facade.state.dicts import (
    Shards,
    check_plain,
    cohorts_of_plain,
    current_masters,
    holds_pieces,
    is_sharded,
    params_follow_masters,
    parked_from_plain,
    shard_state_from_plain,
    shard_state_from_sharded,
    tensor_slices,
)
from zeroplan.facade.state.inner import Inner, sync_hyperparameters
from zeroplan.facade.state.shards import ShardState, import_state
from zeroplan.facade.state.tree import ParkedParam, decode_parked, tree_clone

__all__ = ["LoadedState", "agreed_state", "commit_state", "copy_param_values", "read_state_dict"]


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
        source: a digest of what was read that every rank must share (a
            checkpoint's manifest digest), or ``None``.
    """

    target: ZeroPlan
    state: ShardState
    stateful: set[tuple[int, int]]
    masters: dict[str, torch.Tensor] | None
    param_groups: list[dict[str, Any]]
    scaler: dict[str, Any] | None
    param_values: list[list[torch.Tensor]] | None = None
    parked: dict[int, ParkedParam] | None = None
    source: str | None = None


def read_state_dict(
    state_dict: dict[str, Any], sh: Shards, plan_with_cohorts: Callable[[Iterable[int]], ZeroPlan]
) -> LoadedState:
    """Validate a sharded dict (same plan) or a plain torch dict (any plan); change nothing.

    Raises:
        ConfigError, IncompatiblePlanError: the dict does not fit this optimizer.
    """
    if is_sharded(state_dict):
        state, stateful, masters = shard_state_from_sharded(state_dict, sh)
        parked = tree_clone(decode_parked(state_dict["parked"]), sh.device)
        return LoadedState(
            sh.zp, state, stateful, masters, state_dict["param_groups"], state_dict["scaler"], parked=parked
        )
    state_dict = tensor_slices(state_dict, sh)  # whole global tensors of a tp optimizer: its slice
    check_plain(state_dict, sh)
    target = plan_with_cohorts(cohorts_of_plain(state_dict, sh.zp))
    state, stateful, masters = shard_state_from_plain(state_dict, target, sh)
    parked = parked_from_plain(state_dict, target, sh)
    if not masters and (holds_pieces(state_dict) or params_follow_masters(sh)):
        # This optimizer's own pieces (DCP filled them), or whole tensors while the parameters are
        # still the masters' cast: the masters stay; the model's dict brings them
        # (``checkpoint.interchange``, which publishes the parameters from them).
        masters = current_masters(sh)
    # Whole tensors after the parameters were written (``model.load_state_dict``): start the masters
    # from the parameters.
    return LoadedState(
        target, state, stateful, masters or None, state_dict["param_groups"], None, parked=parked
    )


def _check_installable(loaded: LoadedState, sh: Shards) -> None:
    """What ``restore`` would otherwise discover half way: group count and scaler fields.

    Raises:
        IncompatiblePlanError: another number of param groups.
        ConfigError: scaler fields this optimizer's scaler settings reject.
    """
    groups = loaded.param_groups
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise IncompatiblePlanError(f"param_groups must be a list of dicts, got {type(groups).__name__}")
    if len(groups) != len(sh.param_groups):
        raise IncompatiblePlanError(
            f"the state has {len(groups)} param groups, this optimizer has {len(sh.param_groups)}"
        )
    if loaded.scaler is not None and sh.scaler is not None:
        ScalerState(config=sh.scaler.config, **loaded.scaler)


def _digest(value: Any) -> str:
    """A digest of plain data that may hold tensors (hyper-parameters, scaler fields)."""

    def plain(leaf: Any) -> Any:
        return leaf.tolist() if torch.is_tensor(leaf) else repr(leaf)

    return hashlib.sha256(json.dumps(value, sort_keys=True, default=plain).encode()).hexdigest()


def agreed_state(
    read: Callable[[], LoadedState], sh: Shards, *, what: str, wrap: type[ZeroplanError] = ConfigError
) -> LoadedState:
    """``read()``'s state once every rank read it and all read the same (see [Note: load agreement]).

    Collective over the world; nothing is modified.

    Args:
        read: reads and validates this rank's state.
        sh: the optimizer's parts.
        what: the input, for messages ("state dict", "checkpoint").
        wrap: the error class a failure that is no ``ZeroplanError`` becomes.

    Raises:
        ZeroplanError: on every rank if any rank's read failed: the failing
            rank's class (``wrap`` for any other exception).
        IncompatiblePlanError: on every rank if ranks read other sources
            (``LoadedState.source``), or state for other plans,
            hyper-parameters or scaler states.
    """
    loaded, problem = None, None
    try:
        loaded = read()
        _check_installable(loaded, sh)
    except Exception as exc:  # any failure must reach every rank before anything changes
        problem = as_zeroplan_error(exc, wrap, f"cannot read the {what}")
    facts = None
    if loaded is not None and problem is None:
        facts = (loaded.source, loaded.target.fingerprint(), _digest([loaded.param_groups, loaded.scaler]))
    rows = verdicts(problem, sh.groups.world, failed=f"could not read its {what}", facts=facts)
    for column, difference in enumerate(_DIFFERENCES):
        rank = first_differing([row[column] for row in rows])
        if rank is not None:
            raise IncompatiblePlanError(f"rank {rank}'s {what} {difference}: {_SAME_INPUT}")
    if loaded is None:  # unreachable: verdicts raised
        raise RuntimeError(f"{what}: nothing read and no error")
    return loaded


_DIFFERENCES = (
    "is not the one rank 0 read (another path or snapshot)",
    "lays out state for another plan than rank 0's (other step counts, or other parameters with state)",
    "holds other hyper-parameters or loss-scaler state than rank 0's",
)
_SAME_INPUT = (
    "every rank must load the same checkpoint, the same plain torch.optim dict, or its own "
    "state_dict() of one run"
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
def commit_state(
    zp: ZeroPlan,
    buffers: Sequence[SpaceBuffers],
    inner: Inner,
    loaded: LoadedState,
    param_groups: Sequence[dict[str, Any]],
) -> None:
    """Install ``loaded`` (already in ``zp``, the plan of ``buffers`` and ``inner``): masters, inner
    state, hyper-parameters."""
    for buf in buffers:
        if loaded.masters is None or not buf.carries_master:
            buf.load_master()
        elif buf.space.dtype in loaded.masters:
            buf.write_master(loaded.masters[buf.space.dtype])
    inner.optimizer.state.clear()
    import_state(zp, inner, loaded.state, loaded.stateful)
    sync_hyperparameters(loaded.param_groups, param_groups)
