# zeroplan.core — pure planning: no torch, no I/O.
# The staging arena: where each bucket's staging buffer lies, in one persistent buffer per rank.
"""The staging arena and the layout of each bucket's staging buffer (planned; ``grad_sync`` cuts them).

[Note: staging arena]
Staging buffers are cut from one persistent arena per rank, allocated once with
the optimizer, not allocated per bucket and step. At most
``max_inflight_buckets`` (``k``) consecutive buckets are alive at once (the
schedule retires the oldest before a bucket ``k`` later opens), so a bucket
can only be alive with the ``k - 1`` buckets on either side of it:
:func:`staging_arena` places each, in launch order, at the lowest offset free
of the ``k - 1`` before it. With buckets of one size that is ``k`` buffers,
what the backward's peak held before; with uneven ones (the last bucket of a
space, stage 3's whole blocks) close to the largest ``k`` consecutive.

What it costs: the arena is alive between steps and inside ``step()`` too (as
DeepSpeed's reduction buffers and ``DistributedDataParallel``'s buckets are),
so where the step is the peak (a foreach AdamW's temporaries) it adds to it;
``peak_bytes`` says so. Why: a buffer of tens of MiB allocated afresh every
step is new memory to the operating system on CPU (glibc maps it, and each of
its pages faults and is zeroed at first write): 12 ms per 25 MiB bucket on the
benchmark machine against 1.2 ms to copy into a reused one, most of stage 2's
gap to DDP at world 2. CUDA's caching allocator would have reused the memory;
one code path for both keeps the plan the same on both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from zeroplan.core.buckets import Bucket, Piece
from zeroplan.core.comm import Collective
from zeroplan.core.dtypes import DTYPE_ITEMSIZE, master_dtype
from zeroplan.core.partition import Space
from zeroplan.core.planner import ReductionKind, ZeroPlan
from zeroplan.core.residence import BufferRole
from zeroplan.core.span import Span, round_up
from zeroplan.core.wire import replica_parts, wire_payload_bytes, wire_scale_bytes

__all__ = [
    "STAGING_ALIGNMENT",
    "StagingArena",
    "StagingLayout",
    "WireRooms",
    "arena_bytes",
    "grad_shard_dtype",
    "staging_arena",
    "staging_layout",
]


class StagingLayout(NamedTuple):
    """One rank's staging buffer of one bucket (elements of the bucket's dtype).

    Attributes:
        numel: elements to allocate: the bucket's gradients, then, when
            ``reduced`` or ``received`` lie past them, their room.
        reduced: where the rank's reduced piece lands when it cannot be
            written straight into the gradient shard (an fp32 shard of
            bf16/fp16 gradients): reduced there, summed over replicas, then
            copied (cast) into the shard. ``None``: straight into the shard.
        received: under a point-to-point exchange (the ``GLOO`` policy, see
            [Note: collective policy]), room for the pieces the other ``N - 1``
            ranks send this rank, in their rank order; in deterministic mode
            ([Note: deterministic mode]) for all ``N`` pieces, the rank's own
            included, added there in rank order; ``None`` otherwise.
        gathered: deterministic mode with replicas (MiCS): room for the ``R``
            replicas' sums of the piece, gathered and added there in replica
            order; ``None`` otherwise.
        wire: with a gradient wire format ([Note: wire formats]), the byte
            rooms of the encoded exchange (:class:`WireRooms`); ``None`` otherwise.
    """

    numel: int
    reduced: Span | None
    received: Span | None = None
    gathered: Span | None = None
    wire: WireRooms | None = None


class WireRooms(NamedTuple):
    """Byte spans of a staging buffer under a gradient wire format ([Note: wire formats]).

    After the bucket's gradients: the encoded bucket to send (``send``, its
    scales ``send_scales``), every shard rank's encoded copy of this rank's
    piece (``received``, ``received_scales``), and fp32 room (``sums``) that
    first holds the bucket's values while they are scaled and rounded, then
    one decoded slot per shard rank, added there. With replicas (MiCS) the
    group's sum is encoded again in ``R`` parts (``replica_send``,
    ``replica_send_scales``; :func:`~zeroplan.core.wire.replica_parts`), every
    replica's copy of this rank's part lands in ``replica_received`` (and its
    scales), decoded into ``replica_sums`` and added; the part's sum is then
    encoded into its slot of ``replica_received``, which the replicas' slots
    fill by an all-gather, and decoded into ``replica_sums``. Scale spans are
    empty for unscaled formats; replica spans empty without replicas.
    """

    send: Span
    send_scales: Span
    received: Span
    received_scales: Span
    sums: Span
    replica_send: Span
    replica_send_scales: Span
    replica_received: Span
    replica_received_scales: Span
    replica_sums: Span


class StagingArena(NamedTuple):
    """One rank's persistent staging memory and where each bucket's staging buffer lies in it.

    See [Note: staging arena].

    Attributes:
        nbytes: bytes of the arena.
        offsets: per bucket, the byte offset of its staging buffer (a multiple of
            :data:`STAGING_ALIGNMENT`).
        sizes: per bucket, the bytes of its staging buffer (:func:`staging_layout`).
    """

    nbytes: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def grad_shard_dtype(zp: ZeroPlan, space: Space) -> str:
    """The dtype of a rank's reduced-gradient shard of ``space``.

    Stage 1 with a rank-major layout reduces in place into the rank's region
    of the full gradient buffer (the space's dtype, ``ZeroPlan.reduces_in_place``); otherwise the shard is a
    tensor of its own in the master dtype, so bf16/fp16 gradients are reduced
    straight into fp32 and the step needs no copy.
    """
    if zp.reduces_in_place(space):
        return space.dtype
    return master_dtype(space.dtype)


def lands_apart(zp: ZeroPlan) -> bool:
    """Whether the gradient shard lives apart from the staging arena ([Note: offload, executed]).

    A reduction then sums into room of the staging arena (as for a cast) and the
    sum is copied over the host link into the shard: a collective writes into
    the memory of the device it runs on.
    """
    where = zp.residences.of
    return where(BufferRole.GRAD_SHARD) is not where(BufferRole.STAGING)


def staging_layout(zp: ZeroPlan, bucket: Bucket, shard_rank: int) -> StagingLayout:
    """Shard rank ``shard_rank``'s staging buffer of ``bucket`` (see :class:`StagingLayout`).

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(64,)], dtype="bfloat16"), Topology(world_size=2), alignment=8)
        >>> staging_layout(zp, zp.buckets.buckets[0], 1)   # 64 gradients, then the rank's 32
        StagingLayout(numel=96, reduced=Span(start=64, stop=96), received=None, gathered=None, wire=None)
    """
    return _piece_layout(zp, bucket, bucket.piece_of(shard_rank))


def _piece_layout(zp: ZeroPlan, bucket: Bucket, piece: Piece | None) -> StagingLayout:
    """:func:`staging_layout` of the rank that receives ``piece`` (``None``: a rank without one)."""
    kind = zp.reduction  # [Note: reduction policy]: each kind's rooms
    if kind is ReductionKind.ENCODED:
        return _wire_layout(zp, bucket, piece)
    if piece is None:
        return StagingLayout(bucket.numel, None)
    if kind is ReductionKind.CANONICAL:
        return _deterministic_layout(zp, bucket, piece)
    space = zp.partition.spaces[bucket.space]
    cast = grad_shard_dtype(zp, space) != space.dtype or lands_apart(zp)
    if zp.exchanges(bucket.collective):
        # The rank's own piece is never sent: a sum to be cast lands in it, in place.
        received = Span(bucket.numel, bucket.numel + (zp.topology.shard_size - 1) * piece.shard_span.numel)
        return StagingLayout(received.stop, piece.staging_span if cast else None, received)
    if not cast:
        return StagingLayout(bucket.numel, None)
    if _room_after(zp, bucket):
        tail = Span(bucket.numel, bucket.numel + piece.shard_span.numel)
        return StagingLayout(tail.stop, tail)
    return StagingLayout(bucket.numel, piece.staging_span)


def _deterministic_layout(zp: ZeroPlan, bucket: Bucket, piece: Piece) -> StagingLayout:
    """Rooms for every shard rank's copy of ``piece``, then every replica's sum of it ([Note:
    deterministic mode]); the sum is written (cast) into the gradient shard from there."""
    numel, end = piece.shard_span.numel, bucket.numel
    n, r = zp.topology.shard_size, zp.topology.replica_size
    if numel == 0:
        return StagingLayout(end, None)
    received = Span(end, end + n * numel) if n > 1 else None
    end = received.stop if received is not None else end
    gathered = Span(end, end + r * numel) if r > 1 else None
    end = gathered.stop if gathered is not None else end
    return StagingLayout(end, None, received, gathered)


def _wire_layout(zp: ZeroPlan, bucket: Bucket, piece: Piece | None) -> StagingLayout:
    """The rooms of an encoded exchange ([Note: wire formats]), each at a 16-byte boundary."""
    codec = zp.grad_wire
    assert codec is not None
    space = zp.partition.spaces[bucket.space]
    itemsize = DTYPE_ITEMSIZE[space.dtype]
    n, r = zp.topology.shard_size, zp.topology.replica_size
    mine = 0 if piece is None else piece.shard_span.numel
    at = bucket.numel * itemsize
    spans: list[Span] = []

    def room(nbytes: int) -> None:
        nonlocal at
        start = round_up(at, STAGING_ALIGNMENT)
        spans.append(Span(start, start + nbytes))
        at = start + nbytes

    def payload(numel: int) -> int:
        return wire_payload_bytes(codec, numel, space.dtype)

    def scales(numel: int) -> int:
        return wire_scale_bytes(codec, numel)

    exchanged = n > 1
    room(payload(bucket.numel) if exchanged else 0)
    room(sum(scales(q) for q in bucket.piece_sizes(n)) if exchanged else 0)  # each piece's blocks
    room(n * payload(mine) if exchanged else 0)
    room(n * scales(mine) if exchanged else 0)
    room(4 * max(bucket.numel if exchanged else 0, n * mine))
    replicas = r > 1 and mine > 0
    parts = replica_parts(mine, r)  # equal slots of the largest part for the all-gather
    room(payload(mine) if replicas else 0)
    room(sum(scales(p) for p in parts) if replicas else 0)
    room(r * payload(parts[0]) if replicas else 0)
    room(r * scales(parts[0]) if replicas else 0)
    room(4 * r * parts[0] if replicas else 0)
    return StagingLayout(-(-at // itemsize), None, wire=WireRooms(*spans))


def _room_after(zp: ZeroPlan, bucket: Bucket) -> bool:
    """Whether a piece reduced into a shard of another dtype lands after the bucket's gradients.

    A scattering collective cannot write its output over its own input; a ``reduce`` (or an
    ``all_reduce``, or a group of one) leaves it in place, in the piece's own range.
    """
    scattered = bucket.collective in (Collective.REDUCE_SCATTER, Collective.REDUCE_SCATTER_V)
    return scattered and zp.topology.shard_size > 1


#: Byte alignment of a staging buffer inside the arena: any item size, and 16-byte vector loads.
STAGING_ALIGNMENT = 16


def staging_arena(zp: ZeroPlan, shard_rank: int) -> StagingArena:
    """Shard rank ``shard_rank``'s staging arena (see [Note: staging arena]).

    Two placements, the smaller kept: first fit (buckets in launch order, each
    at the lowest aligned offset that overlaps none of the ``k - 1`` buckets
    before it, the only ones it can be alive with; ``k``:
    ``max_inflight_buckets``), and ``k`` slots (bucket ``b`` in slot ``b % k``,
    each slot as large as its largest bucket). Either is valid; neither is
    always the smaller with uneven buckets.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(256,)] * 3), Topology(world_size=1), alignment=8, bucket_bytes=1024)
        >>> staging_arena(zp, 0)   # three 1 KiB buckets, two in flight at most
        StagingArena(nbytes=2048, offsets=(0, 1024, 0), sizes=(1024, 1024, 1024))
    """
    spaces = zp.partition.spaces
    sizes = tuple(
        staging_layout(zp, b, shard_rank).numel * DTYPE_ITEMSIZE[spaces[b.space].dtype]
        for b in zp.buckets.buckets
    )
    return _place(sizes, zp.max_inflight_buckets)


def arena_bytes(zp: ZeroPlan) -> tuple[int, ...]:
    """Per shard rank, :func:`staging_arena`'s bytes, in one pass over the buckets' pieces.

    A rank's staging sizes differ from a rank without a piece only where it has
    one, and then by its piece's size alone (so it is computed once per size
    and bucket; a bucket of equal pieces, every rank's, is in the base with
    that size): each rank's placement is the base placement (no pieces) redone
    only from its first such bucket until it falls back into step with the base
    or with another rank's (:func:`_nbytes_with`), and ranks with the same
    sizes share it. Asking :func:`staging_arena` rank by rank would place every
    bucket once per rank (llama-70b at world 4096, rank-major: 5,263 buckets
    x 4,096 ranks).
    """
    spaces = zp.partition.spaces
    buckets = zp.buckets.buckets
    base = [b.numel * DTYPE_ITEMSIZE[spaces[b.space].dtype] for b in buckets]
    changed: list[list[tuple[int, int]]] = [[] for _ in range(zp.topology.shard_size)]
    for b in buckets:
        isz = DTYPE_ITEMSIZE[spaces[b.space].dtype]
        if b.collective is Collective.REDUCE_SCATTER:  # an equal piece for every rank: one size for all
            base[b.index] = _piece_layout(zp, b, b.pieces[0]).numel * isz
            continue
        by_size: dict[int, int] = {}  # a staging buffer's size depends on its piece's size alone
        for i, (rank, numel) in enumerate(b.piece_numels()):
            size = by_size.get(numel)
            if size is None:
                size = by_size[numel] = _piece_layout(zp, b, b.pieces[i]).numel * isz
            if size != base[b.index]:
                changed[rank].append((b.index, size))
    placement = _BasePlacement.of(tuple(base), zp.max_inflight_buckets)
    tails: _Tails = {}
    placed: dict[tuple[tuple[int, int], ...], int] = {}
    result = []
    for mine in changed:
        key = tuple(mine)
        if key not in placed:
            placed[key] = _nbytes_with(placement, key, tails)
        result.append(placed[key])
    return tuple(result)


def _fit(size: int, alive: Iterable[tuple[int, int]]) -> int:
    """The lowest aligned offset where ``size`` bytes overlap none of the ``alive`` (start, stop) ranges."""
    at = 0
    for start, stop in sorted(alive):
        if at + size <= start:
            break
        at = max(at, round_up(stop, STAGING_ALIGNMENT))
    return at


def _first_fit(sizes: Sequence[int], k: int) -> list[int]:
    """First-fit offsets: each buffer placed clear of the ``k - 1`` before it."""
    offsets: list[int] = []
    for b, size in enumerate(sizes):
        offsets.append(_fit(size, ((offsets[j], offsets[j] + sizes[j]) for j in range(max(0, b - k + 1), b))))
    return offsets


def _slot_largest(sizes: Sequence[int], k: int) -> list[int]:
    """Per slot ``j < min(k, len(sizes))`` (buffers ``j, j + k, ...``), its largest buffer."""
    return [max(sizes[j::k]) for j in range(min(k, len(sizes)))]


def _slot_starts(largest: Sequence[int]) -> list[int]:
    """Where each slot starts, given the largest buffer of each: slots as large as it, aligned."""
    return [sum(round_up(x, STAGING_ALIGNMENT) for x in largest[:j]) for j in range(len(largest))]


def _place(sizes: tuple[int, ...], k: int) -> StagingArena:
    """The smaller of the first-fit and the ``k``-slot placement of buffers of ``sizes`` bytes."""
    slot_starts = _slot_starts(_slot_largest(sizes, k))
    placements = [
        StagingArena(
            max((o + n for o, n in zip(offsets, sizes, strict=True)), default=0), tuple(offsets), sizes
        )
        for offsets in (_first_fit(sizes, k), [slot_starts[b % k] for b in range(len(sizes))])
    ]
    return min(placements, key=lambda arena: arena.nbytes)  # first fit on a tie


#: Placements of buffers ``b..`` from a window of (offset, size) of the ``k - 1`` before: their largest end.
_Tails = dict[tuple[int, tuple[tuple[int, int], ...]], int]


class _BasePlacement(NamedTuple):
    """First fit of the base sizes, its running maxima and the slots' largest, for :func:`_nbytes_with`."""

    sizes: tuple[int, ...]
    k: int
    offsets: tuple[int, ...]
    before: tuple[int, ...]  # before[i]: the largest end of buffers 0..i-1 (0 for none)
    after: tuple[int, ...]  # after[i]: the largest end of buffers i.. (0 for none)
    largest: tuple[int, ...]  # per slot j < min(k, len(sizes)): its largest buffer

    @classmethod
    def of(cls, sizes: tuple[int, ...], k: int) -> _BasePlacement:
        offsets = _first_fit(sizes, k)
        ends = [o + n for o, n in zip(offsets, sizes, strict=True)]
        before, after = [0], [0]
        for end in ends:
            before.append(max(before[-1], end))
        for end in reversed(ends):
            after.append(max(after[-1], end))
        largest = tuple(_slot_largest(sizes, k))
        return cls(sizes, k, tuple(offsets), tuple(before), tuple(reversed(after)), largest)


def _nbytes_with(base: _BasePlacement, changes: Sequence[tuple[int, int]], tails: _Tails) -> int:
    """``_place(sizes, k).nbytes`` for the base sizes with ``changes`` ((index, size) pairs) applied.

    First fit places a buffer by the ``k - 1`` before it alone, so it is redone
    from the first changed buffer until, past the last change, those ``k - 1``
    sit where the base put them (the rest is the base's) or where an earlier
    call's redone placement had them at the same buffer (the rest is that
    call's, remembered in ``tails``, which calls on one base share: a rank
    whose larger piece shifted every later buffer shifts them like its
    neighbours). The slots' sizes are the base's largest raised by the changed
    sizes. A size that shrinks (never, for a rank's pieces, which only add
    room) is placed anew.
    """
    k, n = base.k, len(base.sizes)
    new = dict(changes)
    if n == 0 or any(s < base.sizes[j] for j, s in new.items()):
        sizes = tuple(new.get(j, x) for j, x in enumerate(base.sizes))
        return _place(sizes, k).nbytes
    largest = list(base.largest)
    for j, s in new.items():
        largest[j % k] = max(largest[j % k], s)
    slotted = max(start + x for start, x in zip(_slot_starts(largest), largest, strict=True))
    if not new:
        return min(base.before[n], slotted)
    first, last = min(new), max(new)
    offsets: dict[int, int] = {}
    ends: dict[int, int] = {}
    path: list[tuple[int, tuple[tuple[int, int], ...]]] = []

    def size(j: int) -> int:
        return new.get(j, base.sizes[j])

    def offset(j: int) -> int:
        return offsets.get(j, base.offsets[j])

    tail, b = 0, first
    while b < n:
        window = tuple((offset(j), size(j)) for j in range(max(0, b - k + 1), b))
        if b > last:
            if all(j > last and offset(j) == base.offsets[j] for j in range(max(0, b - k + 1), b)):
                tail = base.after[b]
                break
            if (b, window) in tails:
                tail = tails[b, window]
                break
            path.append((b, window))
        offsets[b] = _fit(size(b), ((o, o + x) for o, x in window))
        ends[b] = offsets[b] + size(b)
        b += 1
    for at, window in reversed(path):
        tail = tails[at, window] = max(tail, ends[at])
    return min(max(base.before[first], max(ends.values()), tail), slotted)
