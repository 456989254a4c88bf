# zeroplan.core — pure planning: no torch, no I/O.
# What is alive at the step's peak: staging arena, autograd gradients, the step's temporaries.
"""The transient memory of one training step, read off a :class:`ZeroPlan`.

[Note: the step's peak]
Between steps a rank holds its persistent buffers (parameters, gradient
buffers, fp32 masters, optimizer state and the staging arena: ``memory_report``'s
categories, the staging arena included). During a step it also holds, at the most:

* **backward** — the gradients autograd allocated that are not staged yet.
  The facade's gradient hook follows the schedule :func:`backward_peak`
  replays (the same :func:`~zeroplan.core.schedule.staging_schedule`,
  [Note: staging schedule]):

  - a gradient is copied into the staging buffer of each of its buckets as
    soon as it arrives, if that bucket is among the ``max_inflight_buckets``
    next to launch; otherwise it waits (its ``.grad`` stays alive) until the
    window reaches the bucket;
  - opening a staging buffer first completes the oldest reduction in flight
    while the buffers alive would span more than ``max_inflight_buckets``
    buckets, so at most that many consecutive buckets are ever alive;
  - a bucket is launched, in plan order, once all its gradients are copied;
  - at stage 2 a ``.grad`` is freed once all its buckets are staged; at stage
    1 the hook moves it into the full gradient buffer at once.

  By default gradients are assumed to arrive in decreasing parameter order
  (autograd's order for a model whose parameters are registered in the order
  the forward uses them; the bucket order assumes the same), every trainable
  parameter getting one. ``arrivals`` replays another order, in which
  parameters left out get no gradient; ``ZeroOptimizer.memory_report()``
  passes the order its last step saw. A model whose gradients arrive out of
  bucket order keeps them alive until the window reaches their bucket, and a
  bucket waiting for a parameter that gets no gradient (an unused head, an
  expert no token chose) holds up every later one until ``step()``. With
  ``overlap_grad_reduce=False`` nothing is staged before the backward ends.
* **step** — at stage 1 with bf16/fp16 parameters, the fp32 copy of the
  reduced gradient shard; and the inner optimizer's temporaries, which depend on
  its implementation (:meth:`OptimizerSpec.step_temporary_bytes`). Parameter
  groups are stepped one after the other, so the largest group counts.

Clipping, the overflow check and the parameter gather allocate nothing
beyond scalars at stages 1 and 2 (norms are reduced to one number; updated
shards are gathered into the parameter buffer in place), so they add no phase.
At stage 3 the backward also holds gathered blocks (see :func:`gathered_bytes`).
Activations, the loss and the batch are the user's and are not planned. Stage
0 describes ``DistributedDataParallel``: its peak is an estimate (see
:func:`step_peak`).

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
from enum import Enum
from itertools import pairwise
from typing import NamedTuple

from zeroplan.core.buckets import Bucket, Piece
from zeroplan.core.comm import Collective
from zeroplan.core.dtypes import DTYPE_ITEMSIZE, LOW_PRECISION, master_dtype
from zeroplan.core.errors import check_config
from zeroplan.core.partition import Space
from zeroplan.core.planner import InnerTensor, Stage, ZeroPlan
from zeroplan.core.schedule import ActionKind, staging_schedule
from zeroplan.core.span import Span, round_up

__all__ = [
    "BackwardPeak",
    "PeakPhase",
    "StagingLayout",
    "STAGING_ALIGNMENT",
    "StagingArena",
    "StepPeak",
    "backward_peak",
    "grad_shard_dtype",
    "staging_layout",
    "staging_arena",
    "step_peak",
    "step_transient",
]


class PeakPhase(str, Enum):
    """The part of a step where a rank's memory peaks."""

    BACKWARD = "backward"
    STEP = "step"


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
            ranks send this rank, in their rank order; ``None`` otherwise.
    """

    numel: int
    reduced: Span | None
    received: Span | None = None


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


class BackwardPeak(NamedTuple):
    """The most bytes of one rank's staging and gradients during backward (see [Note: the step's peak]).

    Attributes:
        staging: the staging arena (persistent, [Note: staging arena]).
        total: the staging arena and the most autograd gradients alive at once.
    """

    staging: int
    total: int


class StepPeak(NamedTuple):
    """Transient bytes of one rank by phase, and the largest."""

    backward: int
    step: int

    @property
    def phase(self) -> PeakPhase:
        """Where the peak happens (backward on a tie)."""
        return PeakPhase.STEP if self.step > self.backward else PeakPhase.BACKWARD

    @property
    def bytes(self) -> int:
        """Transient bytes at the peak."""
        return max(self.backward, self.step)


def grad_shard_dtype(zp: ZeroPlan, space: Space) -> str:
    """The dtype of a rank's reduced-gradient shard of ``space``.

    Stage 1 with a rank-major layout reduces in place into the rank's region
    of the full gradient buffer (the space's dtype); otherwise the shard is a
    tensor of its own in the master dtype, so bf16/fp16 gradients are reduced
    straight into fp32 and the step needs no copy.
    """
    if zp.stage is Stage.OPTIMIZER and space.shard_is_region:
        return space.dtype
    return master_dtype(space.dtype)


def staging_layout(zp: ZeroPlan, bucket: Bucket, shard_rank: int) -> StagingLayout:
    """Shard rank ``shard_rank``'s staging buffer of ``bucket`` (see :class:`StagingLayout`).

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(64,)], dtype="bfloat16"), Topology(world_size=2), alignment=8)
        >>> staging_layout(zp, zp.buckets.buckets[0], 1)   # 64 gradients, then the rank's 32
        StagingLayout(numel=96, reduced=Span(start=64, stop=96), received=None)
    """
    return _piece_layout(zp, bucket, bucket.piece_of(shard_rank))


def _piece_layout(zp: ZeroPlan, bucket: Bucket, piece: Piece | None) -> StagingLayout:
    """:func:`staging_layout` of the rank that receives ``piece`` (``None``: a rank without one)."""
    if piece is None:
        return StagingLayout(bucket.numel, None)
    space = zp.partition.spaces[bucket.space]
    cast = grad_shard_dtype(zp, space) != space.dtype
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


def _arena_bytes(zp: ZeroPlan) -> tuple[int, ...]:
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


def _most_grads_alive(zp: ZeroPlan, overlap: bool, arrivals: Sequence[int] | None) -> int:
    """The most bytes of autograd gradients alive at once: the facade's schedule, replayed.

    Drives :func:`~zeroplan.core.schedule.staging_schedule` with gradients
    arriving in ``arrivals`` order (default: decreasing parameter order): a
    gradient is alive from its arrival until the schedule releases it (stage 1's
    hook moves it into the gradient buffer at once). Rank-independent.
    """
    nbytes = [s.numel * DTYPE_ITEMSIZE[s.dtype] for s in zp.specs]
    moved_at_once = zp.stage is Stage.OPTIMIZER
    schedule = staging_schedule(zp, overlap=overlap)
    next(schedule)
    order = sorted(zp.trainable_indices, reverse=True) if arrivals is None else _checked(zp, arrivals)
    grads = most = 0
    for index in order:
        grads += nbytes[index]
        most = max(most, grads)
        if moved_at_once:
            grads -= nbytes[index]
        actions = schedule.send(index)
        grads -= sum(nbytes[a.param] for a in actions if a.kind is ActionKind.RELEASE)
    return most


def _checked(zp: ZeroPlan, arrivals: Sequence[int]) -> Sequence[int]:
    trainable = zp.trainable_indices
    check_config(
        len(set(arrivals)) == len(arrivals) and all(i in trainable for i in arrivals),
        f"arrivals must name trainable parameters of the plan, each at most once, got {list(arrivals)!r}",
    )
    return arrivals


def backward_peak(
    zp: ZeroPlan, *, overlap: bool = True, arrivals: Sequence[int] | None = None
) -> tuple[BackwardPeak, ...]:
    """Per shard rank, the staging arena and the most gradients alive in backward ([Note: the step's peak]).

    Args:
        zp: a stage 1 or 2 plan (stage 0 and 3: see :func:`step_peak`).
        overlap: ``ZeroOptimizer``'s ``overlap_grad_reduce``.
        arrivals: the order in which gradients arrive, as parameter indices
            (``ZeroOptimizer`` records it in each step); parameters left out
            get none (they are staged as zeros at the end). Default: every
            trainable parameter, in decreasing index order.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(256,)] * 4), Topology(world_size=2), alignment=8, bucket_bytes=1024)
        >>> backward_peak(zp)[0]   # a 2 KiB staging arena (two 1 KiB buckets), one 1 KiB gradient arriving
        BackwardPeak(staging=2048, total=3072)
    """
    grads = _most_grads_alive(zp, overlap, arrivals)
    arenas = _arena_bytes(zp)
    return tuple(BackwardPeak(staging, staging + grads) for staging in arenas)


def step_transient(zp: ZeroPlan, shard_rank: int, tensors: Sequence[InnerTensor] | None = None) -> int:
    """Transient bytes of shard rank ``shard_rank`` inside ``step()``.

    The fp32 copies of reduced bf16/fp16 gradients (stage 1 with a rank-major
    layout only: otherwise they are reduced into fp32) and the inner optimizer's temporaries of its
    largest param group (stage 0: over every trainable parameter). ``tensors``:
    ``zp.inner_tensors(shard_rank)`` when the caller has them.
    """
    return _copies_bytes(zp, shard_rank) + _temporaries_bytes(zp, shard_rank, tensors)


def _copies_bytes(zp: ZeroPlan, shard_rank: int) -> int:
    """Stage 1, rank-major bf16/fp16 spaces: the fp32 copy of the rank's reduced gradients."""
    copies = 0
    if zp.stage is Stage.OPTIMIZER:
        for space in zp.partition.spaces:
            if space.dtype in LOW_PRECISION and space.shard_is_region:
                copies += space.extent(shard_rank) * DTYPE_ITEMSIZE[master_dtype(space.dtype)]
    return copies


def _temporaries_bytes(zp: ZeroPlan, shard_rank: int, tensors: Sequence[InnerTensor] | None) -> int:
    """The inner optimizer's temporaries of the rank's largest param group (stage 0: rank-independent)."""
    groups: dict[int, dict[str, list[tuple[int, ...]]]] = {}  # group -> dtype -> shapes, in step order
    if zp.stage is Stage.DDP:
        for spec in zp.specs:
            if spec.trainable:
                groups.setdefault(spec.group, {}).setdefault(master_dtype(spec.dtype), []).append(spec.shape)
    else:
        for tensor in zp.inner_tensors(shard_rank) if tensors is None else tensors:
            dtype = master_dtype(zp.partition.spaces[tensor.space].dtype)
            groups.setdefault(tensor.group, {}).setdefault(dtype, []).append(tensor.shape)
    per_group = (
        sum(
            zp.optimizers[g].step_temporary_bytes_of_shapes(shapes, DTYPE_ITEMSIZE[d])
            for d, shapes in by_dtype.items()
        )
        for g, by_dtype in groups.items()
    )
    return max(per_group, default=0)


def gathered_bytes(zp: ZeroPlan, reshard_after_forward: bool = True) -> int:
    """Stage 3: bytes of gathered blocks alive at once in backward ([Note: stage 3] in the facade).

    With ``reshard_after_forward`` a block is gathered while its gradients
    arrive and the one before it is prefetched: the largest two neighbouring
    blocks of each space. Without, the forward leaves every block gathered:
    the whole buffer. ``tests/facade/test_peak.py`` checks it with torch's
    ``MemTracker`` on a model whose layers are blocks of their own; a block
    shared by modules that run far apart (a tied embedding and head) stays
    gathered longer than this assumes.
    """
    total = 0
    for space in zp.partition.spaces:
        sizes = [b.numel * DTYPE_ITEMSIZE[space.dtype] for b in space.blocks]
        if not reshard_after_forward:
            total += sum(sizes)
        else:
            total += max((a + b for a, b in pairwise(sizes)), default=sum(sizes))
    return total


def step_peak(
    zp: ZeroPlan,
    *,
    overlap: bool = True,
    backward: Sequence[BackwardPeak] | None = None,
    reshard_after_forward: bool = True,
    tensors: Sequence[tuple[InnerTensor, ...]] | None = None,
) -> tuple[StepPeak, ...]:
    """Per shard rank, the transient bytes of backward and step (see [Note: the step's peak]).

    Transient means on top of the persistent buffers, the staging arena
    included. Stages 1 and 2 follow the facade's schedule exactly: the backward
    holds autograd's gradients not staged yet. Stage 3 adds the gathered blocks
    (see :func:`gathered_bytes`). Stage 0 is an estimate of
    ``DistributedDataParallel``, whose gradients and bucket copy are persistent:
    only the step's temporaries. ``backward``: :func:`backward_peak`'s result
    when the caller has it already; ``tensors``: ``zp.inner_tensors_by_rank()``'s
    (ranks sharing a tuple of tensors share their temporaries, computed once).
    """
    n = zp.topology.shard_size
    if zp.stage is Stage.DDP:
        transient = [0] * n
        temporaries = [_temporaries_bytes(zp, 0, None)] * n  # every rank steps every parameter
    else:
        peaks = backward_peak(zp, overlap=overlap) if backward is None else backward
        gathered = gathered_bytes(zp, reshard_after_forward) if zp.stage is Stage.PARAMETERS else 0
        transient = [p.total - p.staging + gathered for p in peaks]
        tensors = zp.inner_tensors_by_rank() if tensors is None else tensors
        known: dict[int, int] = {}  # id of a rank's tuple of tensors -> its temporaries
        temporaries = []
        for r in range(n):
            bytes_ = known.get(id(tensors[r]))
            if bytes_ is None:
                bytes_ = known[id(tensors[r])] = _temporaries_bytes(zp, r, tensors[r])
            temporaries.append(bytes_)
    return tuple(StepPeak(transient[r], _copies_bytes(zp, r) + temporaries[r]) for r in range(n))
