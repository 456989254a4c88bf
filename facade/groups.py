"""Process groups of a sharded optimizer, created from the core ``Topology``.

See [Note: shard and replica groups] in ``zeroplan.core.topology``: the shard
group splits one copy of the optimizer state, the replica group holds the same
shard in every shard group. Groups are passed around explicitly; nothing here
is global.
"""

from __future__ import annotations

from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core import ConfigError, Topology

__all__ = ["ProcessGroups", "data_parallel_group", "group_timeout", "make_groups"]


class ProcessGroups(NamedTuple):
    """The groups one rank communicates on.

    Attributes:
        world: the data-parallel group the optimizer was given.
        shard: this rank's shard group (``world`` itself for plain ZeRO).
        replica: this rank's replica group, ``None`` when it has one rank.
        topology: sizes of the grid.
        rank: this rank's position in ``world``.
    """

    world: dist.ProcessGroup
    shard: dist.ProcessGroup
    replica: dist.ProcessGroup | None
    topology: Topology
    rank: int

    @property
    def shard_rank(self) -> int:
        """Position in the shard group (the plan's rank)."""
        return self.topology.shard_rank(self.rank)

    @property
    def replica_rank(self) -> int:
        """Position in the replica group."""
        return self.topology.replica_rank(self.rank)


def data_parallel_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``process_group``, or the default group; a clear error if none exists.

    Raises:
        ConfigError: ``torch.distributed`` is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group "
            "(launch with torchrun, or backend='gloo' with world_size=1 for a single process) "
            "before creating a ZeroOptimizer"
        )
    return process_group if process_group is not None else dist.group.WORLD


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The collective timeout ``group`` was created with (``init_process_group(timeout=...)``).

    ``None`` when this torch does not say; ``new_group`` then uses its own default.
    """
    try:
        backend = group._get_backend(torch.device(group._device_types[0]))
        timeout = backend.options._timeout
    except (AttributeError, IndexError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def make_groups(world: dist.ProcessGroup, topology: Topology) -> ProcessGroups:
    """Create the shard and replica groups of ``topology`` inside ``world``.

    Every rank of ``world`` must call this with the same topology: each call
    of ``new_group`` is collective, and all groups are created in the same
    order on every rank. They get ``world``'s timeout: ``new_group`` would
    otherwise give them torch's default (30 minutes on gloo, 10 on NCCL),
    whatever the job passed to ``init_process_group``.
    """
    rank = dist.get_rank(world)
    if topology.shard_size == topology.world_size:
        return ProcessGroups(world=world, shard=world, replica=None, topology=topology, rank=rank)
    global_rank = [dist.get_global_rank(world, r) for r in range(topology.world_size)]
    timeout = group_timeout(world)
    shard = replica = None
    for ranks in topology.shard_groups():
        group = dist.new_group([global_rank[r] for r in ranks], timeout=timeout)
        if rank in ranks:
            shard = group
    if topology.replica_size > 1:
        for ranks in topology.replica_groups():
            group = dist.new_group([global_rank[r] for r in ranks], timeout=timeout)
            if rank in ranks:
                replica = group
    if shard is None:  # cannot happen: the shard groups partition the world
        raise RuntimeError(f"rank {rank} is in no shard group of {topology}")
    return ProcessGroups(world=world, shard=shard, replica=replica, topology=topology, rank=rank)
