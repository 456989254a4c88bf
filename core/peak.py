# zeroplan.core — pure planning: no torch, no I/O.
# What is alive at the step's peak: staging, autograd gradients, the step's temporaries.
"""The transient memory of one training step, read off a :class:`ZeroPlan`.

[Note: the step's peak]
Between steps a rank holds its persistent buffers (parameters, gradient
buffers, fp32 masters, optimizer state: ``memory_report``'s categories). During
a step it also holds, at the most:

* **backward** — the gradients autograd allocated that are not staged yet, and
  the staging buffers of the buckets being filled or reduced. The facade's
  gradient hook follows the schedule :func:`backward_peak` simulates
  (the facade's hook carries out the same :func:`~zeroplan.core.schedule.staging_schedule`,
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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from enum import Enum
from itertools import pairwise
from typing import NamedTuple

from zeroplan.core.buckets import Bucket, Piece
from zeroplan.core.comm import Collective
from zeroplan.core.dtypes import DTYPE_ITEMSIZE, LOW_PRECISION, master_dtype
from zeroplan.core.errors import check_config
from zeroplan.core.partition import Space
from zeroplan.core.planner import Stage, ZeroPlan
from zeroplan.core.schedule import Action, ActionKind, staging_schedule
from zeroplan.core.span import Span

__all__ = [
    "BackwardPeak",
    "PeakPhase",
    "StagingLayout",
    "StepPeak",
    "backward_peak",
    "grad_shard_dtype",
    "staging_layout",
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


class BackwardPeak(NamedTuple):
    """The most transient bytes of one rank during backward (see [Note: the step's peak]).

    Attributes:
        staging: staging buffers alive at once.
        total: staging buffers and autograd gradients alive at once.
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


class _Alive(NamedTuple):
    """A moment of the simulated backward: buckets whose staging is alive, and gradient bytes alive."""

    buckets: tuple[int, ...]
    grads: int


def _backward_moments(zp: ZeroPlan, overlap: bool, arrivals: Sequence[int] | None) -> list[_Alive]:
    """The moments at which the backward's transient memory can peak: the facade's schedule, replayed.

    Drives :func:`~zeroplan.core.schedule.staging_schedule` with gradients
    arriving in ``arrivals`` order (default: decreasing parameter order) and
    records what is alive when a gradient arrives and when a staging buffer
    opens. Rank-independent: only the staging sizes differ between ranks.
    """
    nbytes = [s.numel * DTYPE_ITEMSIZE[s.dtype] for s in zp.specs]
    moved_at_once = zp.stage is Stage.OPTIMIZER  # stage 1's hook moves .grad into the buffer
    opened: set[int] = set()
    inflight: deque[int] = deque()
    moments: list[_Alive] = []
    grads = 0

    def carry_out(actions: list[Action]) -> None:
        nonlocal grads
        for action in actions:
            if action.kind is ActionKind.RETIRE:
                inflight.popleft()
            elif action.kind is ActionKind.OPEN:
                opened.add(action.bucket)
                moments.append(_Alive((*inflight, *sorted(opened)), grads))
            elif action.kind is ActionKind.RELEASE:
                grads -= nbytes[action.param]
            elif action.kind is ActionKind.LAUNCH:
                opened.discard(action.bucket)
                inflight.append(action.bucket)

    schedule = staging_schedule(zp, overlap=overlap)
    next(schedule)
    order = sorted(zp.trainable_indices, reverse=True) if arrivals is None else _checked(zp, arrivals)
    for index in order:
        grads += nbytes[index]
        moments.append(_Alive((*inflight, *sorted(opened)), grads))
        if moved_at_once:
            grads -= nbytes[index]
        carry_out(schedule.send(index))
    carry_out(schedule.send(None))
    return moments


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
    """Per shard rank, the most transient bytes during backward (see [Note: the step's peak]).

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
        >>> backward_peak(zp)[0]   # two 1 KiB buckets staged, one 1 KiB gradient arriving
        BackwardPeak(staging=2048, total=3072)
    """
    # Staging bytes depend only on which buckets are alive: keep, per alive set, its most gradient bytes.
    grads_of: dict[tuple[int, ...], int] = {}
    for moment in _backward_moments(zp, overlap, arrivals):
        alive = tuple(sorted(moment.buckets))
        grads_of[alive] = max(grads_of.get(alive, 0), moment.grads)
    moments = [_Alive(alive, grads) for alive, grads in grads_of.items()]
    spaces = zp.partition.spaces
    buckets = zp.buckets.buckets
    isz = [DTYPE_ITEMSIZE[spaces[b.space].dtype] for b in buckets]
    held = [sum(buckets[b].numel * isz[b] for b in m.buckets) for m in moments]
    with_grads = (h + m.grads for h, m in zip(held, moments, strict=True))
    top = BackwardPeak(max(held, default=0), max(with_grads, default=0))
    # Room past the gradients (a reduced bf16/fp16 piece at stage 2, received pieces of an exchange)
    # is the only per-rank part: only the moments holding one of a rank's enlarged buckets can
    # exceed the rank-independent maximum.
    extra: list[dict[int, int]] = [{} for _ in range(zp.topology.shard_size)]
    for b in buckets:
        for piece in b.pieces:
            room = _piece_layout(zp, b, piece).numel - b.numel
            if room:
                extra[piece.rank][b.index] = room * isz[b.index]
    holding: dict[int, list[int]] = {}
    if any(extra):
        for position, moment in enumerate(moments):
            for b in moment.buckets:
                holding.setdefault(b, []).append(position)
    result = []
    for mine in extra:
        staging, total = top
        for position in {m for b in mine for m in holding.get(b, ())}:
            more = sum(mine.get(b, 0) for b in moments[position].buckets)
            staging = max(staging, held[position] + more)
            total = max(total, held[position] + more + moments[position].grads)
        result.append(BackwardPeak(staging, total))
    return tuple(result)


def step_transient(zp: ZeroPlan, shard_rank: int) -> int:
    """Transient bytes of shard rank ``shard_rank`` inside ``step()``.

    The fp32 copies of reduced bf16/fp16 gradients (stage 1 with a rank-major
    layout only: otherwise they are reduced into fp32) and the inner optimizer's temporaries of its
    largest param group (stage 0: over every trainable parameter).
    """
    copies = 0
    if zp.stage is Stage.OPTIMIZER:
        for space in zp.partition.spaces:
            if space.dtype in LOW_PRECISION and space.shard_is_region:
                copies += space.extent(shard_rank) * DTYPE_ITEMSIZE[master_dtype(space.dtype)]
    groups: dict[int, dict[str, list[tuple[int, ...]]]] = {}  # group -> dtype -> shapes, in step order
    if zp.stage is Stage.DDP:
        for spec in zp.specs:
            if spec.trainable:
                groups.setdefault(spec.group, {}).setdefault(master_dtype(spec.dtype), []).append(spec.shape)
    else:
        for tensor in zp.inner_tensors(shard_rank):
            dtype = master_dtype(zp.partition.spaces[tensor.space].dtype)
            groups.setdefault(tensor.group, {}).setdefault(dtype, []).append(tensor.shape)
    per_group = (
        sum(
            zp.optimizers[g].step_temporary_bytes_of_shapes(shapes, DTYPE_ITEMSIZE[d])
            for d, shapes in by_dtype.items()
        )
        for g, by_dtype in groups.items()
    )
    temporaries = max(per_group, default=0)
    return copies + temporaries


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
    ddp_buffer: Sequence[int] = (),
    backward: Sequence[BackwardPeak] | None = None,
    reshard_after_forward: bool = True,
) -> tuple[StepPeak, ...]:
    """Per shard rank, the transient bytes of backward and step (see [Note: the step's peak]).

    Stages 1 and 2 follow the facade's schedule exactly. Stage 0 is an
    estimate of ``DistributedDataParallel``: its flat bucket copy
    (``ddp_buffer[rank]`` bytes) during backward. Stage 3 adds the gathered
    blocks to the stage-2 backward (see :func:`gathered_bytes`).
    ``backward``: :func:`backward_peak`'s result when the caller has it already.
    """
    n = zp.topology.shard_size
    if zp.stage is Stage.DDP:
        transient = [ddp_buffer[r] if r < len(ddp_buffer) else 0 for r in range(n)]
    else:
        peaks = backward_peak(zp, overlap=overlap) if backward is None else backward
        gathered = gathered_bytes(zp, reshard_after_forward) if zp.stage is Stage.PARAMETERS else 0
        transient = [p.total + gathered for p in peaks]
    return tuple(StepPeak(transient[r], step_transient(zp, r)) for r in range(n))
