# zeroplan.core — pure planning: no torch, no I/O.
# The offloaded step in units, one per bucket: what the CPU steps and what goes back to the device.
"""The step of a plan whose masters live in host memory, bucket by bucket: :func:`step_units`.

[Note: offload, executed]
With ``offload="optimizer"`` or ``"all"`` ([Note: offload, planned]) the
facade runs the step like this, on CPU and CUDA alike (on the CPU host memory
is the device's, and every copy below is a copy within it):

1. Backward. Each bucket is reduced in the device's staging arena, into room
   of its own (``arena.lands_apart``: a collective writes the memory of its
   device), and when it completes (on the side stream) its sum is copied into
   the host gradient shard, asynchronously into pinned memory.
2. ``step()``. The host waits once for the last of those copies (the plan's
   one host synchronisation per step; clipping reads the norm on the host as
   well), checks overflow, clips, and then steps the inner optimizer unit by
   unit (:func:`step_units`): a unit is the inner tensors whose gradients
   the same bucket completed, in the order the buckets landed (the plan
   cuts elementwise windows where buckets start, ``ZeroPlan.inner_tensors``).
   Each unit's updated values go back to the device at once, asynchronously,
   while the CPU steps the next unit: bf16/fp16 parameters are cast on the
   host into the unit's own gradient elements (consumed by then, so no room
   is added; half their bytes hold the cast), fp32 ones go as they are.
3. The gathers (stages 1-2) start as the units arrive: a gather block's
   collective is launched once every rank has stepped (and sent back) every
   element of it, which the plan says by bucket (:func:`gather_release`), the
   same on every rank, so every rank launches the gathers in one order; the
   others once the last unit is back. At stage 3 each block's gather reads
   the shard where it lives (``all``: host memory, copied to the device just
   before the gather).

Each unit steps by one call of the inner optimizer with the other tensors'
gradients unset, which ``torch.optim`` skips; an elementwise optimizer's
result is the same as one call over all tensors, bit for bit.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from zeroplan.core.dtypes import master_dtype
from zeroplan.core.errors import PlanInvariantError
from zeroplan.core.planner import InnerTensor, Stage, ZeroPlan
from zeroplan.core.residence import BufferRole
from zeroplan.core.span import Span

__all__ = [
    "StepUnit",
    "UpCopy",
    "gather_release",
    "kept_tensors",
    "kept_unit",
    "publishes_via_host_cast",
    "step_units",
]

#: Ranks with a piece in a gather block beyond which :func:`gather_release` does not look (the block
#: then waits for the last unit): a rank-major chunk has one, an interleaved block is its bucket.
_RELEASE_RANKS = 64


@dataclass(frozen=True, slots=True)
class UpCopy:
    """Elements of the rank's master that go back to the parameters after a unit is stepped.

    Attributes:
        space: the dtype space.
        shard_span: the elements, in the rank's shard (and master).
        target_span: where they land: in the full parameter buffer (stages 1-2),
            or in the parameter shard (stage 3, equal to ``shard_span``).
    """

    space: int
    shard_span: Span
    target_span: Span


@dataclass(frozen=True, slots=True)
class StepUnit:
    """Inner tensors stepped together once a bucket's gradients landed in host memory.

    Attributes:
        bucket: the bucket (launch order) whose landing completes the unit's gradients.
        tensors: indices into ``ZeroPlan.inner_tensors(shard_rank)``.
        copies: what goes back to the parameters after the unit is stepped.
    """

    bucket: int
    tensors: tuple[int, ...]
    copies: tuple[UpCopy, ...]


def step_units(
    zp: ZeroPlan, shard_rank: int, tensors: Sequence[InnerTensor] | None = None, *, with_copies: bool = True
) -> tuple[StepUnit, ...]:
    """The units shard rank ``shard_rank`` of ``zp`` steps, in the order their buckets land.

    A tensor belongs to the unit of the last bucket (in launch order) that
    holds any of its elements. Empty unless the plan steps in host memory
    (``ZeroPlan.steps_on_host``); a partial offload's kept tensors
    (:func:`kept_tensors`) are in no unit: the device steps them.

    ``tensors``: ``zp.inner_tensors(shard_rank)`` when the caller has them; ``with_copies=False``
    leaves each unit's ``copies`` empty (a report needs only the units).

    Raises:
        PlanInvariantError: an inner tensor no bucket covers.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(64,), (64,)], dtype="bf16"), Topology(world_size=2),
        ...     alignment=8, bucket_bytes=128, offload="optimizer")
        >>> [(u.bucket, u.tensors) for u in step_units(zp, 0)]
        [(0, (1,)), (1, (0,))]
    """
    if not zp.steps_on_host:
        return ()
    tensors = zp.inner_tensors(shard_rank) if tensors is None else tensors
    pieces = {s.index: zp.bucket_pieces(s.index, shard_rank) for s in zp.partition.spaces}
    starts = {space: [start for start, _, _ in held] for space, held in pieces.items()}
    kept = {s.index: zp.kept_numel(s.index, shard_rank) for s in zp.partition.spaces}
    members: dict[int, list[int]] = {}
    for t, tensor in enumerate(tensors):
        span, held = tensor.shard_span, pieces.get(tensor.space, [])
        if span.stop <= kept[tensor.space]:
            continue  # stepped on the device ([Note: kept on the device])
        k = max(bisect_right(starts.get(tensor.space, []), span.start) - 1, 0)
        last = None
        while k < len(held) and held[k][0] < span.stop:
            if held[k][1] > span.start:
                last = held[k][2] if last is None else max(last, held[k][2])
            k += 1
        if last is None:
            raise PlanInvariantError(f"inner tensor {t} ({span} of space {tensor.space}) is in no bucket")
        members.setdefault(last, []).append(t)
    units = []
    held_pieces: dict[int, list[tuple[int, Span, int]]] = {}  # per space: (start, shard span, shift)
    for b, ts in sorted(members.items()):
        copies = []
        if with_copies:
            for t in ts:
                copies += _up_copies(zp, shard_rank, tensors[t].space, tensors[t].shard_span, held_pieces)
        units.append(StepUnit(b, tuple(ts), tuple(copies)))
    return tuple(units)


def kept_tensors(
    zp: ZeroPlan, shard_rank: int, tensors: Sequence[InnerTensor] | None = None
) -> tuple[int, ...]:
    """The inner tensors (indices into ``tensors``, ``zp.inner_tensors(shard_rank)`` by default) a
    partial offload steps on the device ([Note: kept on the device]): those in the rank's kept
    prefix of their space. Empty unless ``zp.residences.partial``.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(64,), (64,)], dtype="bf16"), Topology(world_size=2),
        ...     alignment=8, bucket_bytes=128, offload="optimizer", offload_fraction=0.5)
        >>> kept_tensors(zp, 0), [(u.bucket, u.tensors) for u in step_units(zp, 0)]
        ((0,), [(0, (1,))])
    """
    if not zp.residences.partial:
        return ()
    tensors = zp.inner_tensors(shard_rank) if tensors is None else tensors
    kept = {s.index: zp.kept_numel(s.index, shard_rank) for s in zp.partition.spaces}
    return tuple(t for t, tensor in enumerate(tensors) if tensor.shard_span.stop <= kept[tensor.space])


def kept_unit(zp: ZeroPlan, shard_rank: int, tensors: Sequence[InnerTensor] | None = None) -> StepUnit | None:
    """The part a partial offload steps on the device ([Note: kept on the device]) as one unit,
    stepped before the others (``bucket`` -1): its tensors (:func:`kept_tensors`) and where their
    values go, on the device. ``None`` without a kept part.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(64,), (64,)], dtype="bf16"), Topology(world_size=2),
        ...     alignment=8, bucket_bytes=128, offload="optimizer", offload_fraction=0.5)
        >>> unit = kept_unit(zp, 0)
        >>> unit.bucket, unit.tensors, [(c.shard_span, c.target_span) for c in unit.copies]
        (-1, (0,), [(Span(start=0, stop=32), Span(start=0, stop=32))])
    """
    tensors = zp.inner_tensors(shard_rank) if tensors is None else tensors
    kept = kept_tensors(zp, shard_rank, tensors)
    if not kept:
        return None
    held: dict[int, list[tuple[int, Span, int]]] = {}
    copies = [
        c for t in kept for c in _up_copies(zp, shard_rank, tensors[t].space, tensors[t].shard_span, held)
    ]
    return StepUnit(-1, kept, tuple(copies))


def _up_copies(
    zp: ZeroPlan, shard_rank: int, space: int, span: Span, held: dict[int, list[tuple[int, Span, int]]]
) -> list[UpCopy]:
    """``span`` of the rank's shard of ``space`` as copies into where the parameters live (``held``:
    each space's pieces of the rank, listed on first use)."""
    if zp.stage is Stage.PARAMETERS:
        return [UpCopy(space, span, span)]
    pieces = held.get(space)
    if pieces is None:
        pieces = held[space] = [
            (p.shard_span.start, p.shard_span, p.buffer_span.start - p.shard_span.start)
            for p in zp.partition.spaces[space].pieces_of(shard_rank)
        ]
    copies = []
    k = max(bisect_right(pieces, span.start, key=lambda piece: piece[0]) - 1, 0)
    while k < len(pieces) and pieces[k][0] < span.stop:
        part = pieces[k][1].intersect(span)
        if part is not None:
            copies.append(UpCopy(space, part, part.shift(pieces[k][2])))
        k += 1
    return copies


def publishes_via_host_cast(zp: ZeroPlan, space: int) -> bool:
    """Whether a unit's values are cast on the host before they go to parameters elsewhere.

    bf16/fp16 parameters apart from their (fp32, host) masters: cast into the
    unit's gradient elements, then copied ([Note: offload, executed]).
    """
    target = BufferRole.PARAM_SHARD if zp.stage is Stage.PARAMETERS else BufferRole.FULL_PARAMS
    where = zp.residences.of
    s = zp.partition.spaces[space]
    return master_dtype(s.dtype) != s.dtype and where(BufferRole.MASTER) is not where(target)


def gather_release(zp: ZeroPlan, space: int) -> tuple[int | None, ...]:
    """Per gather block of ``space`` (``ZeroPlan.gather_blocks``), the bucket (launch order) after
    whose unit every rank has stepped all of the block: its gather may start then ([Note: offload,
    executed]). ``None``: after the last unit (a block held by more than a few ranks whose bucket is
    not the block itself). ``-1``: before the first unit (a partial offload kept every piece of it on
    the device, which steps first, [Note: kept on the device]). Empty unless the plan steps in host
    memory at stage 1 or 2.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(64,), (64,)], dtype="bf16"), Topology(world_size=2),
        ...     alignment=8, bucket_bytes=128, offload="optimizer")
        >>> gather_release(zp, 0)   # the first block is the last bucket to land
        (1, 0)
    """
    if not zp.steps_on_host or zp.stage not in (Stage.OPTIMIZER, Stage.GRADIENTS):
        return ()
    s = zp.partition.spaces[space]
    buckets = [b for b in zp.buckets.buckets if b.space == space]
    # An interleaved space's buckets are its blocks, in the full buffer's coordinates (rank-major
    # buckets span the space's own coordinate, its gather blocks the buffer's).
    same_span = {(b.span.start, b.span.stop): b.index for b in buckets}
    interleaved = zp.partition.layout != "rank_major"
    partial = zp.residences.partial
    kept: dict[int, int] = {}  # rank -> its kept prefix, looked up on first use
    out: list[int | None] = []
    for block in zp.gather_blocks(s):
        own = same_span.get((block.span.start, block.span.stop))
        if own is not None and interleaved and not partial:
            out.append(own)
            continue
        holders = []
        for rank, _ in block.nonempty_pieces():
            holders.append((rank, block.piece(rank).shard_span))
            if len(holders) > _RELEASE_RANKS:
                break
        if len(holders) > _RELEASE_RANKS:
            out.append(None)
            continue
        last, stepped = -1, False
        for rank, span in holders:
            if partial and rank not in kept:
                kept[rank] = zp.kept_numel(space, rank)
            for b in buckets:
                piece = b.piece_of(rank)
                if piece is not None and piece.shard_span.intersect(span) is not None:
                    stepped = True
                    if piece.shard_span.stop > kept.get(rank, 0):  # else stepped on the device
                        last = max(last, b.index)
        out.append(last if last >= 0 or (partial and stepped) else None)
    return tuple(out)
