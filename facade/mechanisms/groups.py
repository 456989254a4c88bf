"""Process groups of a sharded optimizer, created from the core ``Topology``.

See [Note: shard and replica groups] in ``zeroplan.core.topology``: the shard
group splits one copy of the optimizer state, the replica group holds the same
shard in every shard group. On a hierarchical topology (shard groups spanning
whole nodes, see [Note: nodes and links]) the shard group is also split into
node groups and cross-node groups, for the two-hop parameter gather. Groups are
passed around explicitly; nothing here is global.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core import ConfigError, Link, Topology

__all__ = [
    "ProcessGroups",
    "background_group",
    "data_parallel_group",
    "group_timeout",
    "make_groups",
    "new_groups",
]


class ProcessGroups(NamedTuple):
    """The groups one rank communicates on.

    Attributes:
        world: the data-parallel group the optimizer was given.
        shard: this rank's shard group (``world`` itself for plain ZeRO).
        replica: this rank's replica group, ``None`` when it has one rank.
        topology: sizes of the grid.
        rank: this rank's position in ``world``.
        node: this rank's node group (its shard group's ranks on its node),
            ``None`` unless the topology is hierarchical.
        cross_node: this rank's cross-node group (one rank per node of its
            shard group, at its position), ``None`` unless hierarchical.
    """

    world: dist.ProcessGroup
    shard: dist.ProcessGroup
    replica: dist.ProcessGroup | None
    topology: Topology
    rank: int
    node: dist.ProcessGroup | None = None
    cross_node: dist.ProcessGroup | None = None

    @property
    def shard_rank(self) -> int:
        """Position in the shard group (the plan's rank)."""
        return self.topology.shard_rank(self.rank)

    @property
    def replica_rank(self) -> int:
        """Position in the replica group."""
        return self.topology.replica_rank(self.rank)

    @property
    def shard_link(self) -> Link:
        """The link of this rank's shard group (what its traffic is logged under)."""
        return self.topology.shard_link(self.rank)

    @property
    def replica_link(self) -> Link:
        """The link of this rank's replica group."""
        return self.topology.replica_link(self.rank)


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


def _live(made: tuple[dist.ProcessGroup, dist.ProcessGroup] | None) -> dist.ProcessGroup | None:
    """The group of a cache entry (the job's default group when it was made, the group), if it was
    made in this job and is still registered with ``torch.distributed`` (not destroyed)."""
    if made is None or made[0] is not dist.group.WORLD:
        return None
    try:
        dist.get_backend(made[1])
    except (ValueError, RuntimeError):
        return None
    return made[1]


#: Per ranks: the job's default group when it was made (a new job's groups are new), and the group.
_BACKGROUND: dict[tuple[int, ...], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def background_group(world: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group of ``world``'s ranks for work off the main thread (background saves); made once.

    Collectives of one group must be issued in the same order on every rank; a
    thread that agrees on a save's outcome while the main thread trains would
    interleave with the step's collectives, so it gets a group of its own. The
    first call is collective over the job (``new_group``), with ``world``'s timeout;
    over ``world``'s ranks alone where ``world`` is part of the job (a pipeline
    stage's data-parallel group: the other stages save their own optimizers, with
    other ranks), whose ranks name the group.
    """
    ranks = tuple(dist.get_process_group_ranks(world))
    group = _live(_BACKGROUND.get(ranks))
    if group is None:
        local = len(ranks) < dist.get_world_size()
        group = dist.new_group(
            list(ranks), backend="gloo", timeout=group_timeout(world), use_local_synchronization=local
        )
        _BACKGROUND[ranks] = (dist.group.WORLD, group)
    return group


#: Per partition of the job's ranks and timeout: the job's default group when it was made, and this
#: rank's group of the partition ([Note: groups made once per job]).
_MADE: dict[
    tuple[tuple[tuple[int, ...], ...], timedelta | None], tuple[dist.ProcessGroup, dist.ProcessGroup]
] = {}


def new_groups(groups: Sequence[Sequence[int]], timeout: timedelta | None) -> dist.ProcessGroup:
    """A group for each list of global ranks, made in order by every rank of the job (``new_group`` is
    collective over it); the one holding this rank. Made once per job: a second call with the same
    partition and timeout returns the first call's group.

    [Note: groups made once per job]
    torch keeps every group until the process ends or it is destroyed, and a gloo group keeps
    threads polling its sockets (150 idle groups of 4 ranks kept 0.8 of a core busy). A process that
    builds optimizers repeatedly over part of its world (MiCS, two-hop gathers, expert groups,
    pipeline stages; a sweep, a notebook, a test pool) would make new groups each time, so the
    groups are kept here per partition and timeout, for as long as the job's default group is the
    one they were made in and they were not destroyed. Every rank makes the same calls in the same
    order, so every rank finds or makes them alike. Destroy a group on every rank or on none: a
    rank that destroys one alone would make the next construction's groups alone, and wait for
    the others there until the timeout.

    Raises:
        RuntimeError: this rank is in none of them.
    """
    key = (tuple(tuple(int(r) for r in ranks) for ranks in groups), timeout)
    kept = _live(_MADE.get(key))
    if kept is not None:
        return kept
    me, mine = dist.get_rank(), None
    for ranks in key[0]:
        group = dist.new_group(list(ranks), timeout=timeout)
        if me in ranks:
            mine = group
    if mine is None:
        raise RuntimeError(f"rank {me} is in none of the groups {list(groups)[:8]}")
    job = dist.group.WORLD
    for stale in [k for k, (j, _) in _MADE.items() if j is not job]:
        del _MADE[stale]
    _MADE[key] = (job, mine)
    return mine


def make_groups(
    world: dist.ProcessGroup, topology: Topology, siblings: Sequence[Sequence[int]] | None = None
) -> ProcessGroups:
    """Create the shard, replica and (hierarchical topologies) node groups of ``topology`` in ``world``.

    Every rank of ``world`` must call this with the same topology: each call
    of ``new_group`` is collective, and all groups are created in the same
    order on every rank: shard groups, replica groups, node groups, cross-node
    groups. They get ``world``'s timeout: ``new_group`` would otherwise give
    them torch's default (30 minutes on gloo, 10 on NCCL), whatever the job
    passed to ``init_process_group``.

    ``new_group`` is collective over the whole job, so where the job holds
    several data-parallel groups (pipeline stages of a device mesh), every rank
    creates every one's groups: ``siblings`` lists each data-parallel group's
    global ranks, in one order on every rank (``world``'s among them).
    """
    rank = dist.get_rank(world)
    if topology.shard_size == topology.world_size and not topology.hierarchical:
        return ProcessGroups(world=world, shard=world, replica=None, topology=topology, rank=rank)
    global_rank = [dist.get_global_rank(world, r) for r in range(topology.world_size)]
    timeout = group_timeout(world)

    everyone = [list(g) for g in siblings] if siblings is not None else [global_rank]
    if global_rank not in everyone:
        raise RuntimeError(f"the data-parallel group {global_rank} is not among {everyone}")

    def create(partition: tuple[tuple[int, ...], ...]) -> dist.ProcessGroup:
        """One group per tuple of ranks of every data-parallel group (collective); this rank's."""
        groups = [tuple(members[r] for r in ranks) for members in everyone for ranks in partition]
        return new_groups(groups, timeout)

    shard, replica, node, cross_node = world, None, None, None
    if topology.shard_size < topology.world_size:
        shard = create(topology.shard_groups())
        replica = create(topology.replica_groups())
    if topology.hierarchical:
        node = create(topology.node_groups())
        cross_node = create(topology.cross_node_groups())
    return ProcessGroups(
        world=world,
        shard=shard,
        replica=replica,
        topology=topology,
        rank=rank,
        node=node,
        cross_node=cross_node,
    )
