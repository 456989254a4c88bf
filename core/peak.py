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
shards are gathered into the parameter buffer in place), so they add no phase,
except under a parameter wire: every block's encoded gather holds a room from
``step()`` until the block is decoded, and the step phase holds the larger of the
optimizer's temporaries and all the rooms (:func:`gather_rooms`), next to
stage 1's copies (freed when ``step()`` returns).
At stage 3 the backward also holds gathered blocks (see :func:`gathered_bytes`).
Activations, the loss and the batch are the user's and are not planned. Stage
0 describes ``DistributedDataParallel``: its peak is an estimate (see
:func:`step_peak`).

"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from itertools import pairwise
from typing import NamedTuple

from zeroplan.core.arena import arena_bytes
from zeroplan.core.dtypes import DTYPE_ITEMSIZE, LOW_PRECISION, master_dtype
from zeroplan.core.errors import check_config
from zeroplan.core.host_step import kept_tensors, step_units
from zeroplan.core.planner import InnerTensor, Stage, ZeroPlan
from zeroplan.core.schedule import ActionKind, staging_schedule

__all__ = [
    "BackwardPeak",
    "GradsAlive",
    "grads_alive",
    "PeakPhase",
    "StepPeak",
    "backward_peak",
    "GatherRooms",
    "gather_rooms",
    "gathered_bytes",
    "kept_temporaries",
    "step_peak",
    "step_transient",
]


class PeakPhase(str, Enum):
    """The part of a step where a rank's memory peaks."""

    BACKWARD = "backward"
    STEP = "step"


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


class GradsAlive(NamedTuple):
    """Autograd's gradients alive around one arrival (bytes; see :func:`grads_alive`).

    Attributes:
        param: the parameter whose gradient arrived.
        at_arrival: alive as it arrives (its own gradient included).
        after: alive once the hook has staged what it could (until the next arrival).
    """

    param: int
    at_arrival: int
    after: int


def grads_alive(zp: ZeroPlan, *, arrivals: Sequence[int] | None = None) -> tuple[GradsAlive, ...]:
    """Per arrival, the bytes of autograd gradients alive: the facade's schedule, replayed.

    Drives :func:`~zeroplan.core.schedule.staging_schedule` with gradients
    arriving in ``arrivals`` order (default: decreasing parameter order): a
    gradient is alive from its arrival until the schedule releases it (frees
    it, or at stage 1 moves it into the gradient buffer). Rank-independent.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(256,)] * 2), Topology(world_size=2), alignment=8, bucket_bytes=1024)
        >>> [(g.param, g.at_arrival, g.after) for g in grads_alive(zp)]   # staged at once, in order
        [(1, 1024, 0), (0, 1024, 0)]
    """
    nbytes = [s.numel * DTYPE_ITEMSIZE[s.dtype] for s in zp.specs]
    schedule = staging_schedule(zp)
    next(schedule)
    order = sorted(zp.trainable_indices, reverse=True) if arrivals is None else _checked(zp, arrivals)
    grads = 0
    out = []
    for index in order:
        grads += nbytes[index]
        at_arrival = grads
        actions = schedule.send(index)
        grads -= sum(nbytes[a.param] for a in actions if a.kind is ActionKind.RELEASE)
        out.append(GradsAlive(index, at_arrival, grads))
    return tuple(out)


def _most_grads_alive(zp: ZeroPlan, arrivals: Sequence[int] | None) -> int:
    """The most bytes of autograd gradients alive at once (:func:`grads_alive`'s largest)."""
    return max((g.at_arrival for g in grads_alive(zp, arrivals=arrivals)), default=0)


def _checked(zp: ZeroPlan, arrivals: Sequence[int]) -> Sequence[int]:
    trainable = zp.trainable_indices
    check_config(
        len(set(arrivals)) == len(arrivals) and all(i in trainable for i in arrivals),
        f"arrivals must name trainable parameters of the plan, each at most once, got {list(arrivals)!r}",
    )
    return arrivals


def backward_peak(zp: ZeroPlan, *, arrivals: Sequence[int] | None = None) -> tuple[BackwardPeak, ...]:
    """Per shard rank, the staging arena and the most gradients alive in backward ([Note: the step's peak]).

    Args:
        zp: a stage 1 or 2 plan (stage 0 and 3: see :func:`step_peak`); its
            ``options.overlap_grad_reduce`` decides when buckets are staged.
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
    grads = _most_grads_alive(zp, arrivals)
    arenas = arena_bytes(zp)
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
            if space.dtype in LOW_PRECISION and zp.reduces_in_place(space):
                copies += space.extent(shard_rank) * DTYPE_ITEMSIZE[master_dtype(space.dtype)]
    return copies


def _temporaries_bytes(zp: ZeroPlan, shard_rank: int, tensors: Sequence[InnerTensor] | None) -> int:
    """The inner optimizer's temporaries of the rank's largest param group (stage 0: rank-independent).

    A step in host memory calls the inner optimizer once per unit ([Note: offload, executed]): the
    largest group of the largest unit (a partial offload's kept part is stepped on the device
    apart: :func:`kept_temporaries`).
    """
    if zp.stage is Stage.DDP:
        groups: dict[int, dict[str, list[tuple[int, ...]]]] = {}  # group -> dtype -> shapes, in step order
        for spec in zp.specs:
            if spec.trainable:
                groups.setdefault(spec.group, {}).setdefault(master_dtype(spec.dtype), []).append(spec.shape)
        return _largest_group(zp, groups)
    listed = zp.inner_tensors(shard_rank) if tensors is None else tensors
    if zp.steps_on_host:
        units = step_units(zp, shard_rank, listed, with_copies=False)
        seen: dict[tuple[object, ...], int] = {}  # units alike (windows of a bucket) are computed once
        most = 0
        for unit in units:
            members = [listed[i] for i in unit.tensors]
            key = tuple((t.group, t.space, t.shape) for t in members)
            known = seen.get(key)
            if known is None:
                known = seen[key] = _group_temporaries(zp, members)
            most = max(most, known)
        return most
    return _group_temporaries(zp, listed)


def kept_temporaries(zp: ZeroPlan, shard_rank: int, tensors: Sequence[InnerTensor] | None = None) -> int:
    """The device's temporaries of stepping a partial offload's kept part ([Note: kept on the
    device]): one call of the inner optimizer over the kept tensors (0 without a kept part)."""
    listed = zp.inner_tensors(shard_rank) if tensors is None else tensors
    return _group_temporaries(zp, [listed[i] for i in kept_tensors(zp, shard_rank, listed)])


def _group_temporaries(zp: ZeroPlan, tensors: Sequence[InnerTensor]) -> int:
    """The temporaries of one call of the inner optimizer over ``tensors``: its largest group's."""
    groups: dict[int, dict[str, list[tuple[int, ...]]]] = {}
    for tensor in tensors:
        dtype = master_dtype(zp.partition.spaces[tensor.space].dtype)
        groups.setdefault(tensor.group, {}).setdefault(dtype, []).append(tensor.shape)
    return _largest_group(zp, groups)


def _largest_group(zp: ZeroPlan, groups: dict[int, dict[str, list[tuple[int, ...]]]]) -> int:
    """The temporaries of the param group whose step allocates the most."""
    per_group = (
        sum(
            zp.optimizers[g].step_temporary_bytes_of_shapes(shapes, DTYPE_ITEMSIZE[d])
            for d, shapes in by_dtype.items()
        )
        for g, by_dtype in groups.items()
    )
    return max(per_group, default=0)


class GatherRooms(NamedTuple):
    """Stages 1-2 under a parameter wire: the bytes the encoded gathers hold ([Note: wire formats]).

    Attributes:
        started: inside ``step()``, next to stage 1's copies: every block's room, each started
            in buffer order after this rank encoded its own piece through a scratch.
        decoding: the first read after ``step()``: every room, and the scratch its block is
            decoded through.
    """

    started: int
    decoding: int


def gather_rooms(zp: ZeroPlan, shard_rank: int) -> GatherRooms:
    """What shard rank ``shard_rank``'s encoded gathers hold at stages 1-2 (zeros without a wire)."""
    total = started = scratch = 0
    for space in zp.partition.spaces:
        for block in zp.gather_blocks(space):
            room = zp.gather_room(space, block)
            if room is None:
                continue
            total += room.nbytes
            scratch = max(scratch, room.scratch_bytes)
            if block.pieces[shard_rank]:  # this rank encodes its piece once its room exists
                started = max(started, total + room.scratch_bytes)
    return GatherRooms(max(started, total), total + scratch if total else 0)


def gathered_bytes(zp: ZeroPlan) -> int:
    """Stage 3: bytes of gathered blocks alive at once in backward ([Note: stage 3] in the facade).

    With ``zp.options.reshard_after_forward`` a block is gathered while its gradients
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
        # A parameter wire: the block being prefetched also holds its encoded gather's room.
        # A parameter wire: the block being gathered also holds its room, and a scratch while it is
        # decoded in backward; without resharding, backward gathers nothing and the forward's last
        # room is what stays (measured: tests/facade/test_peak.py).
        held = [zp.gather_room(space, b) for b in space.blocks]
        rooms = [0 if room is None else room.nbytes + room.scratch_bytes for room in held]
        if not zp.options.reshard_after_forward:
            total += sum(sizes) + max((0 if room is None else room.nbytes for room in held), default=0)
        else:
            pairs = zip(pairwise(sizes), pairwise(rooms), strict=True)
            total += max((a + b + max(ra, rb) for (a, b), (ra, rb) in pairs), default=sum(sizes) + sum(rooms))
    return total


def step_peak(
    zp: ZeroPlan,
    *,
    backward: Sequence[BackwardPeak] | None = None,
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
        peaks = backward_peak(zp) if backward is None else backward
        gathered = gathered_bytes(zp) if zp.stage is Stage.PARAMETERS else 0
        transient = [p.total - p.staging + gathered for p in peaks]
        tensors = zp.inner_tensors_by_rank() if tensors is None else tensors
        known: dict[int, int] = {}  # id of a rank's tuple of tensors -> its temporaries
        temporaries = []
        for r in range(n):
            bytes_ = known.get(id(tensors[r]))
            if bytes_ is None:
                bytes_ = known[id(tensors[r])] = _temporaries_bytes(zp, r, tensors[r])
            temporaries.append(bytes_)
    return tuple(StepPeak(transient[r], _step_bytes(zp, r, temporaries[r])) for r in range(n))


def _step_bytes(zp: ZeroPlan, shard_rank: int, temporaries: int) -> int:
    """The step phase: stage 1's copies with the inner optimizer's temporaries, or (after those are
    gone, before the copies are) a parameter wire's rooms, or its first decode."""
    copies = _copies_bytes(zp, shard_rank)
    if zp.param_wire is None or zp.stage not in (Stage.OPTIMIZER, Stage.GRADIENTS):
        return copies + temporaries
    rooms = gather_rooms(zp, shard_rank)
    return max(copies + max(temporaries, rooms.started), rooms.decoding)
