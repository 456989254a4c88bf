"""A plan made real on this rank: flat buffers, the inner optimizer and the gradient sync.

``install`` is the one place where a plan meets live tensors: parameters
become views of the plan's flat buffers (see [Note: flat buffers]), the inner
optimizer is built over this rank's master shard and the gradient hooks are
registered. Re-planning installs a new plan and moves state into it
(``replanning.replan``); nothing else builds an :class:`Installed`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core import BufferRole, ConfigError, Stage, ZeroPlan
from zeroplan.facade.mechanisms.collectives import CommLog, broadcast
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.mechanisms.policies import reduction_for
from zeroplan.facade.mechanisms.reduction import Reduction
from zeroplan.facade.params.blocks import BlockTable
from zeroplan.facade.params.buffers import SpaceBuffers, build_block_buffers, build_flat_buffers
from zeroplan.facade.params.gather import ParamGather
from zeroplan.facade.params.residency import Residency
from zeroplan.facade.params.sharded import Peers, ShardedParams
from zeroplan.facade.runtime.grad_sync import GradSync
from zeroplan.facade.runtime.registry import ParamRegistry
from zeroplan.facade.state.inner import Inner, build_inner
from zeroplan.facade.state.stepping import Stepping, stepping_for

__all__ = ["Installed", "broadcast_from_rank_zero", "broadcast_values", "install"]

#: What a step moves between host memory and an accelerator ([Note: offload, executed]): the roles of
#: the offload modes. A collective's buffers (staging, full parameters and gradients, blocks, rooms)
#: live where it runs.
_HOST_ROLES = frozenset(
    (BufferRole.PARAM_SHARD, BufferRole.GRAD_SHARD, BufferRole.MASTER, BufferRole.OPTIMIZER_STATE)
)
_HOST_BESIDE_DEVICE = (
    "the plan places {roles} in host memory beside parameters on {device}, but the collectives that "
    "use those buffers run on the device: place only the roles offload places in host memory "
    "(param_shard, grad_shard, master, optimizer_state), e.g. ZeroOptimizer(..., offload='optimizer')"
)

_GRADS_APART = (
    "the plan places the gradient shard on the {grads} and the masters apart from it, beside parameters "
    "on {device}: the inner optimizer reads its gradients beside the masters it steps; place both in "
    "host memory or neither (offload='optimizer' places both)"
)


class Installed(NamedTuple):
    """What one plan is executed with on this rank (see [Note: optimizer parts]).

    Attributes:
        zp: the plan.
        groups: world, shard and replica process groups.
        buffers: one set of flat buffers per dtype space of the plan.
        inner: the ``torch.optim`` optimizer over this rank's master shard.
        sync: the bucketed gradient reduction, hooked to the parameters.
        reduction: how gradients are summed, and what that asks of backward, the norm and the
            step agreement ([Note: reduction policy]).
        residency: where the parameters' values live ([Note: residency]): replicated and
            gathered after each step (stages 1-2), or sharded (stage 3).
        links: per trainable parameter, its index and the data pointer of its
            view of the flat buffer (see :meth:`detached`).
        device: the device of the parameters: every control tensor of this plan lives
            there (also when no parameter is trainable: a frozen domain's step agreement
            still runs on NCCL, which takes no CPU tensor), and so does each buffer the
            plan places on the device; the others in host memory
            ([Note: residences], ``mechanisms.buffer_devices``).
        stepping: where the inner optimizer steps: on the device, or on the host bucket by
            bucket ([Note: offload, executed]); chosen once, here.
    """

    zp: ZeroPlan
    groups: ProcessGroups
    buffers: tuple[SpaceBuffers, ...]
    inner: Inner
    sync: GradSync
    reduction: Reduction
    residency: Residency
    links: tuple[tuple[int, int], ...]
    device: torch.device
    stepping: Stepping

    def detached(self, params: Sequence[torch.Tensor]) -> int | None:
        """The first trainable parameter whose ``.data`` no longer lives where this plan put it.

        Such a parameter (e.g. after ``model.to(...)`` copied it) would never
        see an update again; the step refuses to run (see [Note: step lifecycle]).
        """
        return self.residency.detached(params, self.links)


def install(
    zp: ZeroPlan,
    registry: ParamRegistry,
    groups: ProcessGroups,
    optimizer_class: type[torch.optim.Optimizer],
    param_groups: Sequence[dict[str, Any]],
    *,
    admit: Callable[[str], bool],
    log: CommLog,
    from_rank_zero: bool = False,
    peers: Peers | None = None,
    optimizer_kwargs: Mapping[str, Any] | None = None,
) -> Installed:
    """Allocate ``zp``'s buffers (parameters become views), build the inner optimizer, hook gradients.

    How they execute (overlap, stage 3's resharding) is the plan's ``options``.

    Args:
        admit: called by each gradient hook with the parameter's name; see
            ``StepLifecycle.admit_gradient``.
        log: where the step's collectives are counted.
        from_rank_zero: stage 3 takes rank 0's values block by block as it builds (the other stages
            in :func:`broadcast_from_rank_zero`, which must follow either way).
        peers: the sharded residencies of the optimizer's other domains ([Note: several sharded
            domains]); the residency is chosen here, and only here ([Note: residency]).

    Raises:
        ConfigError: the plan places a buffer a collective uses in host memory beside parameters
            on an accelerator ([Note: offload, executed]).
    """
    params, shard_rank, device = registry.params, groups.shard_rank, registry.device
    where = zp.residences.of
    apart = [role for role in zp.residences.host if role not in _HOST_ROLES]
    if device.type not in ("cpu", "meta") and apart:
        roles = ", ".join(role.value for role in apart)
        raise ConfigError(_HOST_BESIDE_DEVICE.format(roles=roles, device=device))
    if device.type not in ("cpu", "meta") and where(BufferRole.GRAD_SHARD) is not where(BufferRole.MASTER):
        raise ConfigError(_GRADS_APART.format(grads=where(BufferRole.GRAD_SHARD).value, device=device))
    if zp.stage is Stage.PARAMETERS:
        settle = None
        if from_rank_zero and groups.topology.world_size > 1:
            settle = partial(broadcast, src=0, group=groups.world)
        blocks = build_block_buffers(zp, params, shard_rank, device, settle)
        buffers: tuple[SpaceBuffers, ...] = blocks
    else:
        flat = build_flat_buffers(zp, params, shard_rank, device)
        buffers = flat
    inner = build_inner(zp, buffers, shard_rank, optimizer_class, param_groups, device, optimizer_kwargs)
    reduction = reduction_for(zp, groups, log)  # [Note: policies chosen once]
    sync = GradSync(
        zp=zp,
        params=params,
        names=registry.names,
        buffers=buffers,
        groups=groups,
        reduction=reduction,
        admit=admit,
        device=device,
        user_params=registry.user_params,
    )
    links = tuple((index, params[index].data_ptr()) for index in sorted(zp.trainable_indices))
    residency: Residency
    if zp.stage is Stage.PARAMETERS:
        residency = ShardedParams(
            zp=zp,
            params=params,
            blocks=BlockTable(
                zp=zp, params=params, buffers=blocks, groups=groups, log=log, owners=registry.user_params
            ),
            buffers=blocks,
            shard_rank=shard_rank,
            peers=peers,
            owners=registry.user_params,
        )
    else:
        owners = registry.user_params
        residency = ParamGather(zp=zp, params=params, buffers=flat, groups=groups, owners=owners)
    return Installed(
        zp=zp,
        groups=groups,
        buffers=buffers,
        inner=inner,
        sync=sync,
        reduction=reduction,
        residency=residency,
        links=links,
        device=registry.device,
        stepping=stepping_for(zp, buffers, shard_rank, device),
    )


@torch.no_grad()
def broadcast_from_rank_zero(installed: Installed, params: Sequence[torch.Tensor]) -> None:
    """Start every rank from rank 0's parameter values, as ``DistributedDataParallel`` does."""
    groups = installed.groups
    if groups.topology.world_size == 1:
        return
    for buf in installed.buffers:
        buf.settle_from_rank_zero(partial(broadcast, src=0, group=groups.world))
    managed = installed.zp.trainable_indices
    broadcast_values([p for i, p in enumerate(params) if i not in managed], groups.world)


@torch.no_grad()
def broadcast_values(params: Sequence[torch.Tensor], world: dist.ProcessGroup) -> None:
    """Give ``params`` rank 0's values on every rank of ``world`` (any memory layout)."""
    if dist.get_world_size(world) == 1:
        return
    for param in params:
        values = param.data.contiguous()
        broadcast(values, 0, world)
        if values.data_ptr() != param.data.data_ptr():
            param.data.copy_(values)
