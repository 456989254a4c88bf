# zeroplan.core — pure planning: no torch, no I/O.
# Bytes a step moves between host memory and the device, each way, read off the plan's placement.
"""Bytes over the host link per step: :class:`HostLink`, :func:`host_link`, :func:`host_links`.

What a rank of a plan with roles in host memory ([Note: offload, planned])
copies each step:

* device→host: each bucket's reduced gradient shard, when ``GRAD_SHARD`` lives
  in host memory (the reduction runs in the device's staging arena; one copy
  per bucket that has a piece on the rank, in the gradient shard's dtype);
* host→device: the updated parameters (the rank's piece of each bucket, in the
  parameter dtype, as the step finishes it) when ``MASTER`` lives in host memory and the
  parameters on the device; at stage 3 with ``PARAM_SHARD`` in host memory,
  the shard of each block before its gather instead: before the forward, and
  again before the backward when the plan reshards after the forward.

The pieces a partial offload keeps on the device ([Note: kept on the device])
go neither way.
"""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.core.arena import grad_shard_dtype
from zeroplan.core.dtypes import DTYPE_ITEMSIZE
from zeroplan.core.planner import Stage, ZeroPlan
from zeroplan.core.residence import BufferRole, Residence

__all__ = ["HostLink", "host_link", "host_links"]


class HostLink(NamedTuple):
    """Bytes and copies over the host link per step, each way, of one shard rank."""

    to_host: int = 0
    to_device: int = 0
    to_host_copies: int = 0
    to_device_copies: int = 0


def host_link(zp: ZeroPlan, shard_rank: int) -> HostLink:
    """What shard rank ``shard_rank`` of ``zp`` copies between host and device per step.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> specs = specs_from_shapes([(64,)], dtype="bf16")
        >>> zp = plan(specs, Topology(world_size=2), alignment=8, offload="optimizer")
        >>> host_link(zp, 0)   # 32 fp32 gradients down, 32 bf16 parameters up
        HostLink(to_host=128, to_device=64, to_host_copies=1, to_device_copies=1)
    """
    if zp.stage is Stage.DDP or zp.residences.all_on_device:
        return HostLink()
    host = {role for role in BufferRole if zp.residences.of(role) is Residence.HOST}
    to_host = to_device = down = up = 0
    spaces = zp.partition.spaces
    params = BufferRole.PARAM_SHARD if zp.stage is Stage.PARAMETERS else BufferRole.FULL_PARAMS
    moves_up = BufferRole.MASTER in host and params not in host  # bucket by bucket, as each is stepped
    # The rank's bucket pieces beyond the kept prefix ([Note: kept on the device]), per space.
    moved = []
    for s in spaces if BufferRole.GRAD_SHARD in host or moves_up else ():
        kept = zp.kept_numel(s.index, shard_rank)
        moved.append(
            [stop - start for start, stop, _ in zp.bucket_pieces(s.index, shard_rank) if start >= kept]
        )
    if BufferRole.GRAD_SHARD in host:
        for space, numels in zip(spaces, moved, strict=True):
            to_host += sum(numels) * DTYPE_ITEMSIZE[grad_shard_dtype(zp, space)]
            down += len(numels)
    if zp.stage is Stage.PARAMETERS and params in host and BufferRole.BLOCK not in host:
        times = 2 if zp.options.reshard_after_forward else 1
        for space in spaces:
            for block in zp.gather_blocks(space):  # [Note: gather blocks]
                numel = block.pieces[shard_rank]
                if numel:
                    to_device += times * numel * DTYPE_ITEMSIZE[space.dtype]
                    up += times
    elif moves_up:
        for space, numels in zip(spaces, moved, strict=True):
            to_device += sum(numels) * DTYPE_ITEMSIZE[space.dtype]
            up += len(numels)
    return HostLink(to_host, to_device, down, up)


def host_links(zp: ZeroPlan) -> tuple[HostLink, ...]:
    """:func:`host_link` of every shard rank of ``zp``, computed once where every rank's is the same.

    They are where every rank's pieces are alike in every space (``ZeroPlan.pieces_alike``) and its
    kept prefix, if any, is theirs too: an elementwise optimizer's depends on the pieces alone (a
    whole-parameter one's on where the rank's parameters start).

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(64,)] * 4, dtype="bf16"), Topology(world_size=2),
        ...     alignment=8, stage=3, offload="optimizer")
        >>> host_links(zp)[1] == host_link(zp, 1)
        True
    """
    n = zp.topology.shard_size
    alike = (
        zp.stage is not Stage.DDP
        and (zp.elementwise or not zp.residences.partial)
        and all(zp.pieces_alike(space.index) for space in zp.partition.spaces)
    )
    if alike:
        return (host_link(zp, 0),) * n
    return tuple(host_link(zp, s) for s in range(n))
