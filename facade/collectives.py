"""Collectives that execute a plan, each logged with the core cost model.

Free functions in the style of FSDP2's ``foreach_all_gather``: the optimizer
decides *when*, these decide *how*. Every call is recorded in a :class:`CommLog`
with the bytes :func:`zeroplan.core.send_elements` assigns to it, computed from
the sizes of the tensors actually passed, so measured traffic can be compared
with the plan's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core import Bucket, Collective, CommCost, Space, send_elements
from zeroplan.facade.groups import ProcessGroups

__all__ = [
    "CommLog",
    "Pending",
    "all_reduce_replica",
    "all_gather_objects",
    "all_reduce_shard",
    "gather_space",
    "reduce_bucket",
]


def all_gather_objects(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``obj`` (picklable, small: verdicts and metadata), in group rank order.

    Not logged: control traffic is not part of a step's planned bytes.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


class CommLog:
    """Collective calls since the last :meth:`clear`, aggregated per (group, collective)."""

    def __init__(self) -> None:
        self._totals: dict[tuple[str, Collective], list[int]] = {}

    def record(
        self, group: str, collective: Collective, pieces: Sequence[int], position: int, itemsize: int
    ) -> None:
        """Log one call in which this rank sat at ``position`` of a group with ``pieces``."""
        entry = self._totals.setdefault((group, collective), [0, 0])
        entry[0] += 1
        entry[1] += send_elements(collective, pieces, position) * itemsize

    def summary(self) -> tuple[CommCost, ...]:
        """Calls and bytes sent per (group, collective), sorted by group then collective."""
        return tuple(
            CommCost(group=group, collective=collective, calls=calls, bytes=nbytes)
            for (group, collective), (calls, nbytes) in sorted(
                self._totals.items(), key=lambda item: (item[0][0], item[0][1].value)
            )
        )

    def clear(self) -> None:
        """Forget every call."""
        self._totals.clear()


class Pending(NamedTuple):
    """An asynchronous collective and what to do once it completed."""

    work: dist.Work | None
    after: Callable[[], None] | None = None

    def wait(self) -> None:
        """Block until the collective completed, then run ``after``."""
        if self.work is not None:
            self.work.wait()
        if self.after is not None:
            self.after()


def reduce_bucket(
    staging: torch.Tensor, output: torch.Tensor | None, bucket: Bucket, groups: ProcessGroups, log: CommLog
) -> Pending:
    """Launch the reduction of one bucket's ``staging`` buffer into this rank's ``output`` piece.

    ``staging`` holds the bucket's gradients laid out piece after piece, in rank
    order (see [Note: buckets] in ``zeroplan.core.buckets``); it is scratch
    space afterwards. ``output`` is ``None`` when this rank owns no piece.
    """
    n = groups.topology.shard_size
    s = groups.shard_rank
    itemsize = staging.element_size()
    if bucket.collective is Collective.ALL_REDUCE:  # GLOO policy: sum over the world, keep the piece
        world = groups.topology.world_size
        piece = bucket.piece_of(s)
        keep = None if output is None or piece is None else staging[piece.staging_span.as_slice()]
        after = None if keep is None else (lambda: output.copy_(keep))  # type: ignore[union-attr]
        if world == 1:
            return Pending(None, after)
        log.record("world", Collective.ALL_REDUCE, [staging.numel()] * world, groups.rank, itemsize)
        return Pending(dist.all_reduce(staging, group=groups.world, async_op=True), after)
    if n == 1:
        if output is not None:
            output.copy_(staging)
        return Pending(None)
    if bucket.collective is Collective.REDUCE_SCATTER:
        if output is None:
            raise RuntimeError(f"bucket {bucket.index} is reduce-scattered but rank {s} has no piece of it")
        log.record("shard", bucket.collective, [staging.numel() // n] * n, s, itemsize)
        work = dist.reduce_scatter_single(output, staging, group=groups.shard, async_op=True)
        return Pending(work)
    if bucket.collective is Collective.REDUCE:
        owner = bucket.pieces[0].rank
        sizes = [staging.numel() if q == owner else 0 for q in range(n)]
        log.record("shard", bucket.collective, sizes, s, itemsize)
        work = dist.reduce(staging, group_dst=owner, group=groups.shard, async_op=True)
        if output is None:
            return Pending(work)
        return Pending(work, lambda: output.copy_(staging))
    inputs = list(staging.split(list(bucket.piece_sizes(n))))
    log.record("shard", bucket.collective, [t.numel() for t in inputs], s, itemsize)
    target = output if output is not None else staging.new_empty(0)
    return Pending(dist.reduce_scatter(target, inputs, group=groups.shard, async_op=True))


def all_reduce_replica(piece: torch.Tensor, groups: ProcessGroups, log: CommLog) -> Pending:
    """Sum a reduced shard piece over the replica group (MiCS); nothing without replicas."""
    if groups.replica is None or piece.numel() == 0:
        return Pending(None)
    r = groups.topology.replica_size
    log.record(
        "replica", Collective.ALL_REDUCE, [piece.numel()] * r, groups.replica_rank, piece.element_size()
    )
    return Pending(dist.all_reduce(piece, group=groups.replica, async_op=True))


def all_reduce_shard(value: torch.Tensor, op: dist.ReduceOp, groups: ProcessGroups, log: CommLog) -> None:
    """Blocking all-reduce of a small control tensor over the shard group (norms, overflow flags)."""
    n = groups.topology.shard_size
    if n == 1:
        return
    log.record("shard", Collective.ALL_REDUCE, [value.numel()] * n, groups.shard_rank, value.element_size())
    dist.all_reduce(value, op=op, group=groups.shard)


def gather_space(
    full: torch.Tensor, space: Space, collective: Collective, groups: ProcessGroups, log: CommLog
) -> list[Pending]:
    """Launch the gather (``all_gather`` or one ``broadcast`` per owner) that rebuilds ``full``.

    ``full`` is a space's rank-major buffer and this rank's region already holds its values.
    """
    n = groups.topology.shard_size
    if n == 1:
        return []
    s = groups.shard_rank
    itemsize = full.element_size()
    if collective is Collective.ALL_GATHER:
        mine = full[space.region(s).as_slice()]
        log.record("shard", Collective.ALL_GATHER, [mine.numel()] * n, s, itemsize)
        return [Pending(dist.all_gather_single(full, mine, group=groups.shard, async_op=True))]
    pending = []
    for q in range(n):
        region = full[space.region(q).as_slice()]
        if region.numel() == 0:
            continue
        sizes = [region.numel() if p == q else 0 for p in range(n)]
        log.record("shard", Collective.BROADCAST, sizes, s, itemsize)
        pending.append(Pending(dist.broadcast(region, group_src=q, group=groups.shard, async_op=True)))
    return pending
