"""Installing validated optimizer state into a live ``ZeroOptimizer``.

Shared by ``load_state_dict`` and ``zeroplan.facade.checkpoint.load``:
validation happens first (``state_dicts``, ``checkpoint``), then
:func:`commit_state` copies, which cannot fail for a user reason.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroplan.core import ScalerState
from zeroplan.facade import replanning
from zeroplan.facade.inner import sync_hyperparameters
from zeroplan.facade.shard_state import ShardState, import_state
from zeroplan.facade.state_dicts import (
    check_plain,
    cohorts_of_plain,
    is_sharded,
    shard_state_from_plain,
    shard_state_from_sharded,
)

__all__ = ["commit_state", "load_state_dict"]


def load_state_dict(opt: Any, state_dict: dict[str, Any]) -> None:
    """``ZeroOptimizer.load_state_dict``: a sharded dict (same plan) or a plain torch dict (any plan)."""
    opt._release_grads()
    if is_sharded(state_dict):
        state, stateful, masters = shard_state_from_sharded(state_dict, opt._shards())
        commit_state(opt, state, stateful, masters, state_dict["param_groups"], state_dict["scaler"])
        return
    check_plain(state_dict, opt._shards())
    target = replanning.plan_with_cohorts(opt, cohorts_of_plain(state_dict, opt._zp))
    if target.fingerprint() != opt._zp.fingerprint():
        replanning.adopt_cohorts(opt, target)
    state, stateful, masters = shard_state_from_plain(state_dict, opt._shards())
    if not masters:  # a dict without fp32 masters: start them from the parameters
        shard_rank = opt._groups.shard_rank
        masters = {b.space.dtype: b.region(shard_rank).float() for b in opt._buffers if b.separate_master}
    commit_state(opt, state, stateful, masters, state_dict["param_groups"], None)


@torch.no_grad()
def commit_state(
    opt: Any,
    state: ShardState,
    stateful: set[tuple[int, int]],
    masters: dict[str, torch.Tensor],
    param_groups: list[dict[str, Any]],
    scaler: dict[str, Any] | None,
) -> None:
    """Install validated state: masters, inner optimizer state, hyper-parameters, loss scaler."""
    for buf in opt._buffers:
        if buf.separate_master and buf.space.dtype in masters:
            buf.master[: buf.owned].copy_(masters[buf.space.dtype])
    opt._inner.optimizer.state.clear()
    import_state(opt._zp, opt._inner, state, stateful)
    sync_hyperparameters(param_groups, opt.param_groups)
    if scaler is not None and opt._scaler is not None:
        opt._scaler = ScalerState(config=opt._scaler.config, **scaler)
