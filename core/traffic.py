# zeroplan.core — pure planning: no torch, no I/O.
# Bytes sent per step by every rank, call by call, with the cost model of core.comm.
"""Traffic per step: every collective of a step, per process group and link, for every rank.

Beside the per-call cost model (:mod:`zeroplan.core.comm`: what one call of a collective sends),
this tallies a whole step of a plan: each bucket's reduction (and the replica all-reduce), each
gather block ([Note: gather blocks] in ``core.planner``; in two hops on a hierarchical topology,
[Note: hierarchical all-gather]), the control all-reduces ([Note: control calls]). The facade's
``CommLog`` records the same calls as they run, so measured traffic equals this.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from zeroplan.core.buckets import Bucket
from zeroplan.core.comm import STEP_AGREEMENT_ELEMENTS, STEP_AGREEMENT_ITEMSIZE, Collective, all_reduce_send
from zeroplan.core.deterministic import EXACT_NORM_ELEMENTS, NORM_LIMBS
from zeroplan.core.dtypes import DTYPE_ITEMSIZE
from zeroplan.core.hierarchy import two_hop_send
from zeroplan.core.planner import Stage, ZeroPlan
from zeroplan.core.topology import Link
from zeroplan.core.wire import WireCodec, replica_parts, wire_scale_bytes

__all__ = ["CommCost", "communication", "step_traffic"]

_FP32 = 4  # a control all-reduce of one fp32 scalar (a norm, an overflow flag)


@dataclass(frozen=True, slots=True, kw_only=True)
class CommCost:
    """Traffic of one kind of collective on one process group and link, per step.

    Attributes:
        group: ``"shard"``, ``"replica"`` or ``"world"``.
        collective: the collective.
        calls: how many calls per step.
        bytes: bytes this rank sends in them (see [Note: cost model]).
        link: the link they use (see [Note: nodes and links]); ``intra`` by
            default, as on one node.
    """

    group: str
    collective: Collective
    calls: int
    bytes: int
    link: Link = Link.INTRA


class _SizedBucket(NamedTuple):
    """A bucket and the bytes per element of its space."""

    bucket: Bucket
    itemsize: int


class _Elements(NamedTuple):
    """``numel`` elements of ``itemsize`` bytes (a piece size, a remainder)."""

    numel: int
    itemsize: int


@dataclass(slots=True)
class _Totals:
    """Running totals of calls and bytes (mutable: an accumulator, never returned)."""

    calls: int = 0
    nbytes: int = 0


class _Tally:
    """Per-rank totals of (group, collective, link) -> calls and bytes, in first-use order."""

    def __init__(self, ranks: int) -> None:
        self.rows: list[dict[tuple[str, Collective, Link], _Totals]] = [{} for _ in range(ranks)]

    def add(
        self, rank: int, group: str, collective: Collective, link: Link, nbytes: int, calls: int = 1
    ) -> None:
        row, key = self.rows[rank], (group, collective, link)
        entry = row.get(key)
        if entry is None:
            entry = row[key] = _Totals()
        entry.calls += calls
        entry.nbytes += nbytes

    def costs(self, rank: int) -> tuple[CommCost, ...]:
        return tuple(
            CommCost(group=grp, collective=coll, link=link, calls=totals.calls, bytes=totals.nbytes)
            for (grp, coll, link), totals in self.rows[rank].items()
        )


def step_traffic(zp: ZeroPlan, clipping: bool) -> _Tally:
    """Traffic of every world rank in one step.

    Sums the per-call cost model of :func:`~zeroplan.core.comm.send_elements`
    over all calls, using its linearity (a reducing call costs ``total - own``,
    a gathering one ``total - successor's``), so thousands of ranks and buckets
    cost ``O(ranks + pieces)``. A test checks it against per-call sums. Links
    come from the topology in O(1) per rank and group ([Note: nodes and links]);
    two-hop gathers send the same on every rank.
    """
    topo = zp.topology
    n, r, world = topo.shard_size, topo.replica_size, topo.world_size
    spaces = zp.partition.spaces
    tally = _Tally(world)
    buckets = zp.buckets.buckets
    sized = [_SizedBucket(b, DTYPE_ITEMSIZE[spaces[b.space].dtype]) for b in buckets]

    if zp.stage is Stage.DDP:
        if world > 1:
            _ddp_traffic(tally, sized, world, topo.world_link)
    else:
        # payload[collective]: calls and bytes of all its calls; unsent[collective][s] (plus
        # unsent_by_all[collective], for equal pieces): the bytes of those that shard rank s does not send.
        payload: dict[Collective, _Totals] = {}
        unsent: dict[Collective, list[int]] = {}
        unsent_by_all: Counter[Collective] = Counter()

        def account(collective: Collective, nbytes: int, calls: int) -> list[int]:
            """Count ``calls`` moving ``nbytes`` in all; the caller adds to the returned unsent row."""
            entry = payload.get(collective)
            if entry is None:
                entry = payload[collective] = _Totals()
            entry.nbytes += nbytes
            entry.calls += calls
            row = unsent.get(collective)
            if row is None:
                row = unsent[collective] = [0] * n
            return row

        hops: dict[Link, _Totals] = {}  # two-hop gathers: what every rank sends on each link

        def two_hops(piece: int, isz: int, times: int) -> None:
            """Count ``times`` gathers of a block of equal pieces in two hops (bytes alike on every rank)."""
            for hop in two_hop_send(piece * isz, topo):
                entry = hops.setdefault(hop.link, _Totals())
                entry.calls += times * hop.calls
                entry.nbytes += times * hop.elements

        world_reduced: list[_SizedBucket] = []  # GLOO policy: buckets all-reduced over the world group
        codec = zp.grad_wire
        for b, isz in sized:
            if zp.deterministic or codec is not None:  # every bucket exchanged, all-to-all
                wire = isz if codec is None else codec.element_size
                row = account(Collective.ALL_TO_ALL, b.numel * wire, 1)
                for rank, numel in b.piece_numels():  # a rank does not send its own piece
                    row[rank] += numel * wire
                if codec is not None and codec.format.blockwise:  # the scales: a second exchange
                    pieces = list(b.piece_numels())  # each piece is scaled in blocks of its own
                    total = sum(wire_scale_bytes(codec, q) for _, q in pieces)
                    row = account(Collective.ALL_TO_ALL, total, 1)
                    for rank, numel in pieces:
                        row[rank] += wire_scale_bytes(codec, numel)
            elif b.collective is Collective.ALL_REDUCE:
                world_reduced.append(_SizedBucket(b, isz))
            elif b.collective is Collective.REDUCE_SCATTER:  # equal pieces: every rank keeps as much
                account(b.collective, b.numel * isz, 1)
                unsent_by_all[b.collective] += b.pieces[0].shard_span.numel * isz
            else:
                row = account(b.collective, b.numel * isz, 1)
                for rank, numel in b.piece_numels():  # a reducing rank does not send its own piece
                    row[rank] += numel * isz
        # Stages 1-2 gather every block once, after the step; stage 3 before the forward and,
        # when it resharded after the forward, again in backward ([Note: stage 3] in the facade).
        times = 2 if zp.stage is Stage.PARAMETERS and zp.options.reshard_after_forward else 1
        for space in spaces:
            isz = DTYPE_ITEMSIZE[space.dtype]
            for block in zp.gather_blocks(space):  # [Note: gather blocks]
                gather = zp.gather_collective(block)
                room = zp.gather_room(space, block)  # encoded: each piece's slot of bytes moves
                sent = block if room is None else room.slots
                unit = isz if room is None else 1
                if zp.gathers_in_two_hops(block):
                    two_hops(sent.pieces[0], unit, times)
                    continue
                calls = 1 if gather is Collective.ALL_GATHER else n - block.pieces.count(0)
                row = account(gather, times * sent.numel * unit, times * calls)
                if block.equal:  # every sender skips a piece of one size
                    unsent_by_all[gather] += times * sent.pieces[0] * unit
                    continue
                for q, piece in sent.nonempty_pieces():  # a sender skips its successor's piece
                    row[(q - 1) % n] += times * piece * unit
        # MiCS: each piece is then all-reduced over the replica group; count pieces by size
        # (every_rank: the pieces of buckets of equal pieces, one per rank).
        piece_sizes: list[Counter[_Elements]] = [Counter() for _ in range(n)]
        every_rank: Counter[_Elements] = Counter()
        if r > 1:
            for b, isz in sized:
                if zp.deterministic or codec is not None:  # each non-empty piece's sum gathered
                    for rank, numel in b.piece_numels():
                        if numel:
                            piece_sizes[rank][_Elements(numel, isz)] += 1
                    continue
                if b.collective is Collective.ALL_REDUCE:
                    continue  # already summed over the replicas too
                if b.collective is Collective.REDUCE_SCATTER:
                    every_rank[_Elements(b.pieces[0].shard_span.numel, isz)] += 1
                    continue
                for rank, numel in b.piece_numels():
                    piece_sizes[rank][_Elements(numel, isz)] += 1
        if world > 1 and world_reduced:
            _ddp_traffic(tally, world_reduced, world, topo.world_link)
        for w in range(world):
            s, g = topo.shard_rank(w), topo.replica_rank(w)
            shard_link = topo.shard_link(w)
            for collective, totals in payload.items():
                if n > 1 and totals.calls:
                    nbytes = totals.nbytes - unsent[collective][s] - unsent_by_all[collective]
                    tally.add(w, "shard", collective, shard_link, nbytes, totals.calls)
            for link, totals in hops.items():
                tally.add(w, "shard", Collective.ALL_GATHER, link, totals.nbytes, totals.calls)
            replica_link = topo.replica_link(w)
            mine = piece_sizes[s] + every_rank if every_rank else piece_sizes[s]
            for (numel, isz), count in mine.items():
                if codec is not None:  # the group's sum in parts: exchanged, then the parts' sums gathered
                    parts = replica_parts(numel, r)
                    calls = count * (2 if codec.format.blockwise else 1)  # elements, then their scales
                    others = sum(_encoded(codec, p) for p in parts) - _encoded(codec, parts[g])
                    tally.add(w, "replica", Collective.ALL_TO_ALL, replica_link, count * others, calls)
                    nbytes = count * (r - 1) * _encoded(codec, parts[0])
                    tally.add(w, "replica", Collective.ALL_GATHER, replica_link, nbytes, calls)
                    continue
                if zp.deterministic:
                    nbytes = count * (r - 1) * numel * isz
                    tally.add(w, "replica", Collective.ALL_GATHER, replica_link, nbytes, count)
                    continue
                nbytes = count * all_reduce_send(numel, r, g) * isz
                tally.add(w, "replica", Collective.ALL_REDUCE, replica_link, nbytes, count)
    controls = int(zp.loss_scaling) + int(clipping)
    if controls:
        for w in range(world):
            if zp.stage is Stage.DDP:
                group, size, position, link = "world", world, w, topo.world_link
            else:
                group, size, position, link = "shard", n, topo.shard_rank(w), topo.shard_link(w)
            if size > 1 and zp.deterministic and clipping:  # the exact norm: a max, then limbs
                nbytes = int(zp.loss_scaling) * all_reduce_send(1, size, position) * _FP32
                nbytes += all_reduce_send(EXACT_NORM_ELEMENTS, size, position) * 8
                nbytes += all_reduce_send(NORM_LIMBS, size, position) * 8
                tally.add(w, group, Collective.ALL_REDUCE, link, nbytes, controls + 1)
            elif size > 1:
                nbytes = controls * all_reduce_send(1, size, position) * _FP32
                tally.add(w, group, Collective.ALL_REDUCE, link, nbytes, controls)
    if zp.stage is not Stage.DDP and world > 1:  # the step agreement ([Note: control calls])
        for w in range(world):
            nbytes = all_reduce_send(STEP_AGREEMENT_ELEMENTS, world, w) * STEP_AGREEMENT_ITEMSIZE
            tally.add(w, "world", Collective.ALL_REDUCE, topo.world_link, nbytes, 1)
    return tally


def _encoded(codec: WireCodec, numel: int) -> int:
    """Bytes of ``numel`` elements on ``codec``'s wire, scales included."""
    return numel * codec.element_size + wire_scale_bytes(codec, numel)


def _ddp_traffic(tally: _Tally, sized: list[_SizedBucket], world: int, link: Link) -> None:
    """Ring all-reduce of every bucket over the world.

    Rank ``w`` sends ``2M - chunk(w) - chunk(w+1)`` per bucket of ``M``
    elements, ``chunk(i) = M // W + (i < M % W)``; summed with one sort.
    """
    total = sum(2 * b.numel * isz for b, isz in sized)
    base = sum(b.numel // world * isz for b, isz in sized)
    extras = sorted(_Elements(b.numel % world, isz) for b, isz in sized)
    keys = [e.numel for e in extras]
    suffix = [0] * (len(extras) + 1)  # suffix[i]: bytes of buckets i.. in remainder order
    for i in range(len(extras) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + extras[i].itemsize

    def chunk_bytes(w: int) -> int:
        return base + suffix[bisect_right(keys, w)]

    for w in range(world):
        nbytes = total - chunk_bytes(w) - chunk_bytes((w + 1) % world)
        tally.add(w, "world", Collective.ALL_REDUCE, link, nbytes, len(sized))


def communication(zp: ZeroPlan, rank: int, *, clipping: bool = False) -> tuple[CommCost, ...]:
    """Bytes world rank ``rank`` sends in one step, per (group, collective, link).

    Args:
        zp: the plan (stage 3 gathers parameters again in backward with its
            ``options.reshard_after_forward``).
        rank: world rank.
        clipping: include the all-reduce of ``ZeroOptimizer.clip_grad_norm_``.
    """
    return step_traffic(zp, clipping).costs(rank)
