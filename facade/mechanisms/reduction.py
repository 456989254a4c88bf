"""Reduction policies: how a bucket's staged gradients become this rank's averaged gradient shard.

[Note: reduction policy]
A plan sums gradients one of three ways (``ZeroPlan.reduction``, a
:class:`~zeroplan.core.ReductionKind`), and each is one policy here, chosen
once by :func:`~zeroplan.facade.mechanisms.policies.reduction_for`:

- :class:`DefaultReduction`: the bucket's own collective (reduce-scatter,
  reduce, all-reduce or exchange, [Note: collective policy]), then an
  all-reduce over the replica group (MiCS);
- :class:`EncodedReduction`: the bucket encoded in the gradient wire format,
  exchanged all-to-all, decoded and added in fp32 in rank order, the replicas'
  sums likewise ([Note: wire formats]);
- :class:`CanonicalReduction`: deterministic mode: backward keeps each
  parameter's micro-batches as a tree (``MicroBatchSums``), the bucket is
  exchanged all-to-all and added as a tree in rank order, the replicas' sums
  all-gathered and added in replica order; the loss is divided by the world in
  backward, the norm is summed exactly and the ranks must agree on their
  count of micro-batches ([Note: deterministic mode]).

What differs between the modes is asked of the policy (:class:`Reduction`),
never of the plan: no other facade module tests ``deterministic`` or a codec.

Takes: a bucket's staging buffer (filled by ``grad_sync``), its
``StagingLayout`` and this rank's piece of the gradient shard (``SpaceBuffers.
grad_shard``). Gives: a :class:`InFlight` whose completion leaves the summed
gradient in that piece; the collectives themselves are ``collectives``'
primitives, the codec's arithmetic ``wire_codec``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import ClassVar, NamedTuple, Protocol

import torch
import torch.distributed as dist

from zeroplan.core import Bucket, Collective, ConfigError, StagingLayout, ZeroPlan
from zeroplan.core.arena import WireRooms
from zeroplan.core.deterministic import tree_steps
from zeroplan.core.wire import WireCodec, replica_parts
from zeroplan.facade.mechanisms.accumulation import MicroBatchSums
from zeroplan.facade.mechanisms.collectives import (
    CommLog,
    Pending,
    all_reduce_shard,
    exchange_replicas,
    gather_replicas,
    room_view,
    start_bucket_reduce,
    start_piece_exchange,
    start_replica_reduce,
)
from zeroplan.facade.mechanisms.exact_norm import exact_norm
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.mechanisms.wire_codec import (
    decode_into,
    decode_slots,
    encode_into,
    encode_pieces,
    wire_dtype,
)

__all__ = [
    "CanonicalReduction",
    "DefaultReduction",
    "EncodedReduction",
    "InFlight",
    "Reduction",
    "finish_norm",
    "local_norm",
    "norm_op",
]


class InFlight(NamedTuple):
    """A bucket's reduction in flight: its staging buffer, the collectives, and (default policy) the
    piece the shard group's sum lands in and the shard piece it ends in (``None``: no piece here)."""

    bucket: Bucket
    staging: torch.Tensor
    pending: Pending
    reduced: torch.Tensor | None
    output: torch.Tensor | None


class Reduction(Protocol):
    """How a plan sums gradients ([Note: reduction policy]); one object per installed plan."""

    counts_micro_batches: ClassVar[bool]
    """Whether ranks must agree on their count of micro-batches (the step agreement's message)."""

    @staticmethod
    def check(zp: ZeroPlan, *, backend: str, devices: set[str], domains: int) -> None:
        """Refuse, at construction, what this policy cannot run (raises ``ConfigError``)."""

    def micro_batch_sums(self) -> MicroBatchSums | None:
        """The tree backward adds micro-batches into, or ``None``: autograd adds into ``.grad``."""

    @property
    def divides_loss_by_world(self) -> bool:
        """Whether backward divides the loss by the world (the step's divisor then leaves it out)."""

    def start(
        self, bucket: Bucket, layout: StagingLayout, staging: torch.Tensor, output: torch.Tensor | None
    ) -> InFlight:
        """Launch the reduction of ``bucket``'s ``staging`` buffer into this rank's piece ``output``."""

    def finish(self, entry: InFlight) -> Pending | None:
        """Complete ``entry``'s shard-group reduction; its replica reduction, if left in flight."""

    def shard_norm(
        self, parts: Sequence[torch.Tensor], norm_type: float, device: torch.device, log: CommLog
    ) -> torch.Tensor:
        """The gradient norm of the shard group's parts ``parts`` (each rank its own), on every rank."""

    def step_digest(self, digest: int, micro_batches: int) -> int:
        """The step agreement's digest of ``digest`` (hyper-parameters) and this step's micro-batches."""


def norm_op(norm_type: float) -> dist.ReduceOp:
    """How ranks combine their parts of a ``norm_type`` norm: ``MAX`` for inf, else ``SUM``."""
    return dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM


def finish_norm(combined: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm from the parts combined over every rank (the root of the sum; the max as it is)."""
    return combined if norm_type == math.inf else combined ** (1.0 / norm_type)


def local_norm(parts: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's part of the gradient norm of ``parts``: the sum of ``|g|^p``, or the max."""
    local = torch.zeros((), dtype=torch.float32, device=device)
    for part in parts:
        if part.numel() == 0:
            continue
        norm = torch.linalg.vector_norm(part, norm_type).float()
        local = torch.maximum(local, norm) if norm_type == math.inf else local + norm**norm_type
    return local


def _transported_by_gloo(backend: str, devices: set[str], sends: bool, what: str) -> None:
    """Refuse an all-to-all of CUDA tensors over gloo, which carries it for CPU tensors only."""
    if sends and backend == "gloo" and devices - {"cpu"}:
        raise ConfigError(
            f"{what} exchanges gradients with all_to_all, which gloo carries for CPU tensors only, and "
            f"the parameters are on {sorted(devices - {'cpu'})}: use backend='nccl' for GPU tensors"
        )


class DefaultReduction:
    """The bucket's own collective, then the replicas' all-reduce ([Note: reduction policy])."""

    counts_micro_batches: ClassVar[bool] = False

    def __init__(self, zp: ZeroPlan, groups: ProcessGroups, log: CommLog) -> None:
        del zp  # the bucket carries its collective
        self._groups = groups
        self._log = log

    @staticmethod
    def check(zp: ZeroPlan, *, backend: str, devices: set[str], domains: int) -> None:
        """Nothing to refuse: the collective policy's own checks apply (``check_transport``)."""
        del zp, backend, devices, domains

    def micro_batch_sums(self) -> MicroBatchSums | None:
        """``None``: autograd adds micro-batches into ``.grad``."""
        return None

    @property
    def divides_loss_by_world(self) -> bool:
        """``False``: the step divides the sum by the world."""
        return False

    def start(
        self, bucket: Bucket, layout: StagingLayout, staging: torch.Tensor, output: torch.Tensor | None
    ) -> InFlight:
        """The bucket's collective, into ``output`` or the staging's room for a sum to be cast."""
        reduced = output if layout.reduced is None else staging[layout.reduced.as_slice()]
        grads = staging[: bucket.numel]
        received = None if layout.received is None else staging[layout.received.as_slice()]
        pending = start_bucket_reduce(grads, reduced, bucket, self._groups, self._log, received)
        return InFlight(bucket, staging, pending, reduced, output)

    def finish(self, entry: InFlight) -> Pending | None:
        """Wait for the shard group's sum, then sum over the replicas: in place, left in flight, or
        (an fp32 shard of bf16/fp16 gradients) in the staging, waited for and cast into the shard."""
        # On the side stream; the compute stream must not wait here (rule 1 of [Note: streams]).
        entry.pending.finish(home_waits=False)
        if entry.reduced is None or entry.output is None:
            return None
        summed = entry.bucket.collective is Collective.ALL_REDUCE  # already over the replicas too
        replica = None if summed else start_replica_reduce(entry.reduced, self._groups, self._log)
        if entry.reduced is entry.output:
            return replica
        if replica is not None:
            replica.finish()
        entry.output.copy_(entry.reduced, non_blocking=True)  # into pinned host memory: async
        return None

    def shard_norm(
        self, parts: Sequence[torch.Tensor], norm_type: float, device: torch.device, log: CommLog
    ) -> torch.Tensor:
        """Each rank's :func:`local_norm`, combined by one scalar all-reduce over the shard group."""
        local = local_norm(parts, norm_type, device)
        all_reduce_shard(local, norm_op(norm_type), self._groups, log)
        return finish_norm(local, norm_type)

    def step_digest(self, digest: int, micro_batches: int) -> int:
        """``digest`` as it is: ranks may run different numbers of micro-batches."""
        del micro_batches
        return digest


class EncodedReduction(DefaultReduction):
    """Gradients exchanged in the plan's gradient wire format ([Note: wire formats])."""

    def __init__(self, zp: ZeroPlan, groups: ProcessGroups, log: CommLog) -> None:
        super().__init__(zp, groups, log)
        codec = zp.grad_wire
        if codec is None:
            raise ValueError("an encoded reduction needs a plan with a gradient wire format")
        self._codec = codec

    @staticmethod
    def check(zp: ZeroPlan, *, backend: str, devices: set[str], domains: int) -> None:
        """Refuse CUDA tensors over gloo: its all-to-all carries CPU tensors only."""
        del domains
        codec = zp.grad_wire
        what = f"reduce_dtype={codec.format.value!r}" if codec is not None else "reduce_dtype"
        _transported_by_gloo(backend, devices, zp.topology.world_size > 1, what)

    def start(
        self, bucket: Bucket, layout: StagingLayout, staging: torch.Tensor, output: torch.Tensor | None
    ) -> InFlight:
        """Encode, exchange, and on completion decode and add (:func:`start_encoded_reduce`)."""
        pending = start_encoded_reduce(staging, output, bucket, layout, self._codec, self._groups, self._log)
        return InFlight(bucket, staging, pending, None, output)

    def finish(self, entry: InFlight) -> Pending | None:
        """Wait for the exchange and add (the replicas' sums included)."""
        entry.pending.finish(home_waits=False)  # rule 1 of [Note: streams]
        return None


class CanonicalReduction(DefaultReduction):
    """Deterministic mode: sums in canonical orders ([Note: deterministic mode] in ``zeroplan.core``)."""

    counts_micro_batches: ClassVar[bool] = True

    def __init__(self, zp: ZeroPlan, groups: ProcessGroups, log: CommLog) -> None:
        super().__init__(zp, groups, log)
        self._divides = zp.loss_scaling

    @staticmethod
    def check(zp: ZeroPlan, *, backend: str, devices: set[str], domains: int) -> None:
        """Refuse expert groups (no canonical order) and CUDA tensors over gloo (its all-to-all)."""
        if domains > 1:
            raise ConfigError(_EXPERT_GROUPS)
        _transported_by_gloo(backend, devices, zp.topology.shard_size > 1, "deterministic=True")

    def micro_batch_sums(self) -> MicroBatchSums | None:
        """A tree per parameter: autograd never adds ([Note: deterministic mode])."""
        return MicroBatchSums()

    @property
    def divides_loss_by_world(self) -> bool:
        """With loss scaling, backward divides the loss by the world: its values are the world-1
        run's (fp16 gradients subnormal there are here too)."""
        return self._divides

    def start(
        self, bucket: Bucket, layout: StagingLayout, staging: torch.Tensor, output: torch.Tensor | None
    ) -> InFlight:
        """Exchange, and on completion add as trees (:func:`start_canonical_reduce`)."""
        pending = start_canonical_reduce(staging, output, bucket, layout, self._groups, self._log)
        return InFlight(bucket, staging, pending, None, output)

    def finish(self, entry: InFlight) -> Pending | None:
        """Wait for the exchange and add (the replicas' sums included)."""
        entry.pending.finish(home_waits=False)  # rule 1 of [Note: streams]
        return None

    def shard_norm(
        self, parts: Sequence[torch.Tensor], norm_type: float, device: torch.device, log: CommLog
    ) -> torch.Tensor:
        """The norm summed exactly: the same bits whatever rank holds which element."""
        return exact_norm(
            parts,
            norm_type,
            device,
            partial(all_reduce_shard, op=dist.ReduceOp.MAX, groups=self._groups, log=log),
            partial(all_reduce_shard, op=dist.ReduceOp.SUM, groups=self._groups, log=log),
        )

    def step_digest(self, digest: int, micro_batches: int) -> int:
        """Ranks that ran different numbers of micro-batches disagree too."""
        return (digest * 1_000_003 + micro_batches) % (1 << 62)


_EXPERT_GROUPS = (
    "deterministic=True does not support expert groups (param groups with their own "
    "process_group): an expert's backward adds several ranks' tokens in one kernel, so its "
    "gradient has no canonical order across world sizes ([Note: deterministic mode]); use "
    "deterministic=False, or one data-parallel group"
)


def start_encoded_reduce(
    staging: torch.Tensor,
    output: torch.Tensor | None,
    bucket: Bucket,
    layout: StagingLayout,
    codec: WireCodec,
    groups: ProcessGroups,
    log: CommLog,
) -> Pending:
    """One bucket's reduction in a gradient wire format ([Note: wire formats] in ``zeroplan.core``).

    The bucket is encoded into ``layout.wire.send`` (and its scales), one
    ``all_to_all_single`` per part gives this rank every shard rank's encoded
    copy of its piece, and on completion they are decoded into fp32 slots and
    added in rank order; with replicas (MiCS) the group's sum is encoded again,
    all-gathered and added in replica order. The fp32 sum is written (cast)
    into ``output``. Every rank takes part even when it owns no piece.
    """
    rooms = layout.wire
    assert rooms is not None
    n, s = groups.topology.shard_size, groups.shard_rank
    raw = staging.view(torch.uint8)
    dtype = wire_dtype(codec)

    sizes = list(bucket.piece_sizes(n))
    grads = staging[: bucket.numel]
    piece = bucket.piece_of(s)
    own = grads[piece.staging_span.as_slice()] if piece is not None else grads[:0]
    sums = room_view(raw, rooms.sums, torch.float32)
    parts: list[Pending] = []
    if n > 1:
        send, received = room_view(raw, rooms.send, dtype), room_view(raw, rooms.received, dtype)
        send_scales, received_scales = (
            room_view(raw, rooms.send_scales, torch.float32),
            room_view(raw, rooms.received_scales, torch.float32),
        )
        encode_pieces(grads, sizes, codec, send, send_scales, sums[: bucket.numel])
        parts.append(start_piece_exchange(send, received, sizes, groups, log))
        if codec.format.blockwise:  # the scales: each piece's blocks
            blocks = [-(-q // codec.block) for q in sizes]
            parts.append(start_piece_exchange(send_scales, received_scales, blocks, groups, log))
    finish = partial(_encoded_sum, own, rooms, raw, codec, output, groups, log)
    return Pending(None, after=finish, parts=parts)


def _encoded_sum(
    own: torch.Tensor,
    rooms: WireRooms,
    raw: torch.Tensor,
    codec: WireCodec,
    output: torch.Tensor | None,
    groups: ProcessGroups,
    log: CommLog,
) -> None:
    """Once the exchange completed: decode and add the pieces in rank order, then the replicas' sums."""
    mine = own.numel()
    if output is None or mine == 0:
        return
    n, r = groups.topology.shard_size, groups.topology.replica_size
    dtype = wire_dtype(codec)

    sums = room_view(raw, rooms.sums, torch.float32)[: n * mine]
    if n > 1:
        decode_slots(
            room_view(raw, rooms.received, dtype),
            room_view(raw, rooms.received_scales, torch.float32),
            codec,
            sums,
            n,
        )
    else:
        sums.copy_(own)
    total = _fold(sums, n)
    if r > 1:
        total = _encoded_replica_sum(total, rooms, raw, codec, groups, log)
    output.copy_(total, non_blocking=True)  # pinned host memory (offload): asynchronous, as the rest


def _encoded_replica_sum(
    total: torch.Tensor,
    rooms: WireRooms,
    raw: torch.Tensor,
    codec: WireCodec,
    groups: ProcessGroups,
    log: CommLog,
) -> torch.Tensor:
    """The replicas' sum of ``total`` (this rank's fp32 group sum), as every replica decodes it.

    A reduce-scatter and an all-gather, encoded ([Note: wire formats]): ``total``
    is split in parts (:func:`~zeroplan.core.wire.replica_parts`), each encoded
    and sent to the replica owning it by one ``all_to_all``; the owner decodes
    every replica's copy and adds them in replica order, encodes that sum into
    its slot, and one ``all_gather`` gives every replica every slot, decoded
    (the owner's too, so all hold the same bits) into the whole piece.
    """
    r, g = groups.topology.replica_size, groups.replica_rank
    dtype, blockwise = wire_dtype(codec), codec.format.blockwise
    parts = replica_parts(total.numel(), r)
    sub, mine = parts[0], parts[g]
    blocks = [-(-p // codec.block) if blockwise else 0 for p in parts]
    slot_blocks = blocks[0]
    send, send_scales = (
        room_view(raw, rooms.replica_send, dtype),
        room_view(raw, rooms.replica_send_scales, torch.float32),
    )
    slots = room_view(raw, rooms.replica_received, dtype)
    slot_scales = room_view(raw, rooms.replica_received_scales, torch.float32)
    sums = room_view(raw, rooms.replica_sums, torch.float32)

    encode_pieces(total, list(parts), codec, send, send_scales, sums[: total.numel()])
    exchange_replicas(send, slots[: r * mine], list(parts), groups, log)
    if blockwise:
        exchange_replicas(send_scales, slot_scales[: r * blocks[g]], blocks, groups, log)
    if mine:
        decode_slots(slots[: r * mine], slot_scales[: r * blocks[g]], codec, sums[: r * mine], r)
        part_sum = _fold(sums[: r * mine], r)
        encode_into(
            part_sum, codec, slots[g * sub : g * sub + mine], slot_scales[g * slot_blocks :], part_sum
        )
    gather_replicas(slots[g * sub : (g + 1) * sub], slots[: r * sub], groups, log)
    if blockwise:
        own = slot_scales[g * slot_blocks : (g + 1) * slot_blocks]
        gather_replicas(own, slot_scales[: r * slot_blocks], groups, log)
    for q, numel in enumerate(parts):
        if numel:
            scales = slot_scales[q * slot_blocks : q * slot_blocks + blocks[q]]
            decode_into(slots[q * sub : q * sub + numel], scales, codec, sums[q * sub : q * sub + numel])
    return sums[: total.numel()]


def start_canonical_reduce(
    staging: torch.Tensor,
    output: torch.Tensor | None,
    bucket: Bucket,
    layout: StagingLayout,
    groups: ProcessGroups,
    log: CommLog,
) -> Pending:
    """Deterministic mode's reduction of one bucket ([Note: deterministic mode] in ``zeroplan.core``).

    One ``all_to_all_single`` gives this rank every shard rank's copy of its
    piece, in rank order, in ``layout.received``; on completion they are added
    as a binary tree (:func:`~zeroplan.core.deterministic.tree_steps`), then,
    with replicas (MiCS), the replicas' sums are all-gathered into
    ``layout.gathered`` and added the same way, and the sum is written (cast)
    into ``output``. Every rank takes part even when it owns no piece.
    """
    n, s = groups.topology.shard_size, groups.shard_rank
    sizes = list(bucket.piece_sizes(n))
    grads = staging[: bucket.numel]
    piece = bucket.piece_of(s)
    own = grads[piece.staging_span.as_slice()] if piece is not None else grads[:0]
    room = None if layout.received is None else staging[layout.received.as_slice()]
    pending = None
    if n > 1:  # a rank without a piece (or an empty one) sends and receives nothing back
        pending = start_piece_exchange(
            grads, room if room is not None else grads.new_empty(0), sizes, groups, log
        )
    gathered = None if layout.gathered is None else staging[layout.gathered.as_slice()]
    finish = partial(_canonical_sum, own, room, gathered, output, groups, log)
    return Pending(None, after=finish, parts=[] if pending is None else [pending])


def _canonical_sum(
    own: torch.Tensor,
    room: torch.Tensor | None,
    gathered: torch.Tensor | None,
    output: torch.Tensor | None,
    groups: ProcessGroups,
    log: CommLog,
) -> None:
    """Once the exchange completed: add the pieces in rank order, then the replicas' sums in order."""
    if output is None or own.numel() == 0:
        return
    total = own if room is None else _tree_sum(room, groups.topology.shard_size)
    if gathered is not None:
        gather_replicas(total, gathered, groups, log)
        total = _tree_sum(gathered, groups.topology.replica_size)
    output.copy_(total, non_blocking=True)  # pinned host memory (offload): asynchronous, as the rest


def _tree_sum(slots: torch.Tensor, n: int) -> torch.Tensor:
    """Add ``n`` equal slots of ``slots`` as a binary tree in slot order; the sum is slot 0."""
    parts = slots.chunk(n)
    for a, b in tree_steps(n):
        parts[a].add_(parts[b])
    return parts[0]


def _fold(slots: torch.Tensor, n: int) -> torch.Tensor:
    """Add ``n`` equal slots in slot order into slot 0: a tree for a power of two, else left to right."""
    if n & (n - 1) == 0:
        return _tree_sum(slots, n)
    parts = slots.chunk(n)
    for other in parts[1:]:
        parts[0].add_(other)
    return parts[0]
