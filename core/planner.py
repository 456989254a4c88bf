# zeroplan.core — pure planning: no torch, no I/O.
# The whole plan of one sharded optimizer; rank enters only as an argument.
"""``ZeroPlan``: partition, buckets, topology, stage and optimizer in one value.

:func:`plan` is the entry point::

    from zeroplan.core import Topology, plan, memory_report, specs_from_shapes
    zp = plan(specs_from_shapes([(1024, 1024)] * 8, dtype="bf16"),
              Topology(world_size=8, shard_size=4), stage=2, optimizer="AdamW")
    print(memory_report(zp).ranks[0].total_bytes)
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from itertools import groupby, pairwise
from typing import Any, NamedTuple, TypeVar

from zeroplan.core.buckets import BlockPieces, Bucket, BucketLayout, plan_buckets
from zeroplan.core.chunks import owner_chunks
from zeroplan.core.comm import Collective, CollectivePolicy
from zeroplan.core.deterministic import check_power_of_two
from zeroplan.core.dtypes import DTYPE_ITEMSIZE, master_dtype
from zeroplan.core.errors import ConfigError, check_config
from zeroplan.core.fingerprint import digest
from zeroplan.core.layout import build_partition
from zeroplan.core.offload import Offload, offload_name, offload_residences
from zeroplan.core.optim.optimizers import OptimizerSpec, describe_optimizer
from zeroplan.core.options import StepOptions
from zeroplan.core.partition import PartitionPlan
from zeroplan.core.residence import ALL_ON_DEVICE, BufferRole, Residence, Residences
from zeroplan.core.runs import rank_windows
from zeroplan.core.space import Block, Space
from zeroplan.core.span import Span
from zeroplan.core.specs import ParamSpec, check_specs, specs_fingerprint
from zeroplan.core.topology import Topology
from zeroplan.core.wire import GatherRoom, WireCodec, WireFormat, check_wire, gather_room

_T = TypeVar("_T")

#: What updated parameters may travel as (fp32 is never smaller than the parameters).
_PARAM_WIRES = (WireFormat.BF16, WireFormat.INT8, WireFormat.FP8)

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEFAULT_BUCKET_BYTES",
    "InnerTensor",
    "Stage",
    "WindowOverlap",
    "ZeroPlan",
    "auto_strategy",
    "plan",
    "windows_in",
]

#: Shard allocations and bucket boundaries are multiples of this many elements.
DEFAULT_ALIGNMENT = 128
#: Byte cap of one gradient bucket (the ``DistributedDataParallel`` default).
DEFAULT_BUCKET_BYTES = 25 * 2**20


class Stage(IntEnum):
    """What is sharded across the shard group."""

    DDP = 0
    """Nothing: plain data parallelism (all-reduce), for comparison."""
    OPTIMIZER = 1
    """Optimizer state and fp32 master weights."""
    GRADIENTS = 2
    """Optimizer state, master weights and gradients."""
    PARAMETERS = 3
    """Everything, parameters included (gathered block by block around forward and backward)."""


class ReductionKind(StrEnum):
    """How a bucket's gradients are summed.

    See [Note: reduction policy] in ``zeroplan.facade.mechanisms.policies``.

    ``DEFAULT``: the bucket's own collective (the collective policy); ``ENCODED``: exchanged in the
    gradient wire format and added in fp32 ([Note: wire formats]); ``CANONICAL``: exchanged and
    added in rank order as a tree ([Note: deterministic mode]).
    """

    DEFAULT = "default"
    ENCODED = "encoded"
    CANONICAL = "canonical"


class GatherKind(StrEnum):
    """How updated parameters are gathered: ``PLAIN`` as they are, ``ENCODED`` in the parameter wire
    format ([Note: wire formats]; a shard group of one gathers nothing, so it is ``PLAIN``)."""

    PLAIN = "plain"
    ENCODED = "encoded"


@dataclass(frozen=True, slots=True, kw_only=True)
class InnerTensor:
    """A tensor the inner optimizer steps on one rank: a window of its shard.

    Attributes:
        space: the dtype space.
        group: the param group whose hyper-parameters apply.
        shard_span: the window of the rank's shard.
        shape: ``(numel,)`` for an elementwise window, the parameter's shape
            for a whole parameter.
        param: the parameter, for whole-parameter tensors; ``None`` for windows.
        cohort: the cohort of the parameters it holds (see ``ParamSpec``).
    """

    space: int
    group: int
    shard_span: Span
    shape: tuple[int, ...]
    param: int | None = None
    cohort: int = 0


class WindowOverlap(NamedTuple):
    """The part of one inner tensor's window that falls in a chunk of the shard (:func:`windows_in`).

    Attributes:
        tensor: position of the inner tensor in the sequence searched.
        shard_span: the overlap, in the rank's shard coordinate.
        chunk_span: the overlap relative to the chunk's start: slice the chunk with it.
        window_span: the overlap relative to the window's start: slice the
            (flattened) inner tensor, or its per-element state, with it.
    """

    tensor: int
    shard_span: Span
    chunk_span: Span
    window_span: Span


def windows_in(tensors: Sequence[InnerTensor], space: int, chunk: Span) -> tuple[WindowOverlap, ...]:
    """The windows of ``tensors`` in space ``space`` that overlap ``chunk`` of the shard, clipped to it.

    ``tensors`` is one rank's ``ZeroPlan.inner_tensors(rank)`` (or a sequence
    in the same order); the overlaps come in that order.

    Args:
        tensors: the inner tensors of one shard rank.
        space: index of the dtype space the chunk belongs to.
        chunk: a span of that rank's shard coordinate.

    Example:
        >>> tensors = (
        ...     InnerTensor(space=0, group=0, shard_span=Span(0, 4), shape=(4,)),
        ...     InnerTensor(space=0, group=1, shard_span=Span(4, 10), shape=(6,)),
        ... )
        >>> for part in windows_in(tensors, 0, Span(2, 7)):
        ...     print(part.tensor, part.chunk_span, part.window_span)
        0 Span(start=0, stop=2) Span(start=2, stop=4)
        1 Span(start=2, stop=5) Span(start=0, stop=3)
    """
    overlaps = []
    for position, tensor in enumerate(tensors):
        if tensor.space != space:
            continue
        window = tensor.shard_span
        shard_span = window.intersect(chunk)
        if shard_span is not None:
            overlaps.append(
                WindowOverlap(
                    position, shard_span, shard_span.shift(-chunk.start), shard_span.shift(-window.start)
                )
            )
    return tuple(overlaps)


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroPlan:
    """Everything the facade executes, derived from descriptions only.

    Attributes:
        topology: world, shard and replica sizes.
        stage: what is sharded.
        partition: element ownership inside a shard group.
        buckets: gradient buckets and their collectives.
        optimizers: per param group, the inner optimizer's description.
        loss_scaling: whether a dynamic or static loss scale is applied (one
            overflow all-reduce per step).
        max_inflight_buckets: buckets whose staging buffers may be alive at
            once: the number of persistent staging arena ([Note: staging arena]).
        deterministic: sums in canonical orders ([Note: deterministic mode]):
            buckets are exchanged and added in rank order, replicas gathered.
        grad_wire: what gradients travel as ([Note: wire formats]); ``None``:
            the parameter dtype, by the policy's collectives. Otherwise every
            bucket is exchanged encoded and added in fp32 by its receiver.
        param_wire: what updated parameters travel as in their gathers
            ([Note: wire formats]); ``None``: the parameter dtype. Otherwise
            every rank, the owner included, holds the decoded values.
        options: how the plan executes in a step: overlap of the reduction and
            the gather, stage 3's resharding ([Note: plan options]).
        residences: where each buffer role lives, the device or host memory
            ([Note: residences]); everything on the device by default.

    Raises:
        ConfigError: inconsistent settings, or a parameter-splitting plan for
            a non-elementwise optimizer.
    """

    topology: Topology
    stage: Stage
    partition: PartitionPlan
    buckets: BucketLayout
    optimizers: tuple[OptimizerSpec, ...]
    loss_scaling: bool = False
    max_inflight_buckets: int = 2
    deterministic: bool = False
    grad_wire: WireCodec | None = None
    param_wire: WireCodec | None = None
    options: StepOptions = dataclasses.field(default_factory=StepOptions)
    residences: Residences = ALL_ON_DEVICE
    #: Values derived from the fields, computed once on first use (:meth:`kept_numel`,
    #: :meth:`bucket_pieces`): a memo, not state; neither compared nor copied by ``dataclasses.replace``.
    _derived: dict[tuple[object, ...], Any] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        check_config(
            isinstance(self.options, StepOptions), f"options must be a StepOptions, got {self.options!r}"
        )
        check_config(self.stage in tuple(Stage), f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        object.__setattr__(self, "stage", Stage(self.stage))
        check_config(
            self.partition.shard_size == self.topology.shard_size,
            f"partition is for {self.partition.shard_size} shard ranks but the topology has "
            f"shard size {self.topology.shard_size}",
        )
        groups = 1 + max((s.group for s in self.partition.specs), default=0)
        check_config(
            len(self.optimizers) >= groups,
            f"need an optimizer description for each of {groups} param groups, got {len(self.optimizers)}",
        )
        check_config(
            len({o.elementwise for o in self.optimizers}) <= 1,
            "all param groups must use the same inner optimizer",
        )
        check_config(
            type(self.max_inflight_buckets) is int and self.max_inflight_buckets >= 1,
            f"max_inflight_buckets must be an int >= 1, got {self.max_inflight_buckets!r}",
        )
        check_config(
            type(self.deterministic) is bool, f"deterministic must be a bool, got {self.deterministic!r}"
        )
        if self.deterministic:
            check_config(
                self.stage is not Stage.DDP,
                "deterministic=True needs stage 1, 2 or 3 (stage 0 all-reduces whole gradients in ring "
                "order); stage 1 holds the same memory",
            )
            check_power_of_two("world size", self.topology.world_size)
            check_config(
                self.loss_scaling or all(space.dtype != "float16" for space in self.partition.spaces),
                "deterministic=True with fp16 parameters needs a loss scale (loss_scale='dynamic' or a "
                "number): opt.backward then divides it by the world, so the fp16 backward computes the "
                "world-1 values; without one, gradients W times larger round differently near fp16's limits",
            )
        if self.grad_wire is not None:
            check_config(
                isinstance(self.grad_wire, WireCodec) and self.grad_wire.format is not WireFormat.PARAM,
                f"grad_wire must be a WireCodec of a format other than 'param', got {self.grad_wire!r}",
            )
            check_config(
                self.stage is not Stage.DDP,
                "a gradient wire format (reduce_dtype) needs stage 1, 2 or 3 (stage 0 all-reduces whole "
                "gradients)",
            )
            check_config(
                not self.deterministic,
                "deterministic=True and a gradient wire format (reduce_dtype) cannot be combined yet: an "
                "encoded rank sum is not the world-1 run's sum; use one or the other",
            )
            check_wire(self.grad_wire, self.partition.alignment)
        if self.param_wire is not None:
            self._check_param_wire(self.param_wire)
        self._check_residences(self.residences)
        if self.partition.splits_params and not self.elementwise:
            split = next(s for s in self.partition.specs if len(self.partition.fragments[s.index]) > 1)
            raise ConfigError(
                f"{self.optimizers[0].name} is not elementwise (it needs whole parameters), but "
                f"strategy {self.partition.strategy!r} splits parameter {split.name!r} across "
                f"ranks {self.partition.owner_ranks(split.index)}; use a whole-parameter "
                "strategy such as 'lpt_whole' or 'greedy_whole' (or strategy='auto')"
            )

    @property
    def elementwise(self) -> bool:
        """Whether the inner optimizer is elementwise."""
        return all(o.elementwise for o in self.optimizers)

    @property
    def frozen_bytes(self) -> int:
        """Bytes of the frozen parameters (replicated on every rank)."""
        return sum(s.nbytes for s in self.specs if not s.trainable)

    @property
    def specs(self) -> tuple[ParamSpec, ...]:
        """The parameters."""
        return self.partition.specs

    @property
    def trainable_indices(self) -> frozenset[int]:
        """Indices of the parameters the plan manages: the trainable ones, exactly those of its spaces.

        Example:
            >>> from zeroplan.core.specs import specs_from_shapes
            >>> specs = specs_from_shapes([(4,), (3,), (0,)], trainable=[True, False, True])
            >>> sorted(plan(specs, Topology(world_size=2)).trainable_indices)
            [0, 2]
        """
        return self.partition.trainable_indices

    @property
    def policy(self) -> CollectivePolicy:
        """The collective policy (see [Note: collective policy])."""
        return self.buckets.policy

    def gather_collective(self, block: Block) -> Collective:
        """How a block of updated shards is gathered: ``all_gather`` of equal pieces, else broadcasts.

        Under the ``GLOO`` policy an ``all_gather`` is a point-to-point exchange
        (see [Note: collective policy]).
        """
        return block.gather

    @property
    def reduction(self) -> ReductionKind:
        """How gradients are summed, from ``grad_wire`` and ``deterministic`` (the one place that
        reads them together; the facade picks its reduction policy by this)."""
        if self.grad_wire is not None:
            return ReductionKind.ENCODED
        return ReductionKind.CANONICAL if self.deterministic else ReductionKind.DEFAULT

    @property
    def gather(self) -> GatherKind:
        """How updated parameters are gathered, from ``param_wire`` (the facade picks its gather
        policy by this)."""
        encoded = self.param_wire is not None and self.topology.shard_size > 1
        return GatherKind.ENCODED if encoded else GatherKind.PLAIN

    def reduce_collective(self, bucket: Bucket) -> Collective:
        """How ``bucket``'s gradients are summed over the shard group: its own collective, or in
        deterministic mode an exchange added in rank order ([Note: deterministic mode])."""
        return bucket.collective if self.reduction is ReductionKind.DEFAULT else Collective.ALL_TO_ALL

    @property
    def replica_collective(self) -> Collective:
        """How a reduced piece is summed over the replica group (MiCS): an all-reduce, in
        deterministic mode an all-gather added in replica order ([Note: deterministic mode]), and
        under a gradient wire an all-to-all of encoded parts (their sums then all-gathered,
        [Note: wire formats])."""
        return {
            ReductionKind.DEFAULT: Collective.ALL_REDUCE,
            ReductionKind.ENCODED: Collective.ALL_TO_ALL,
            ReductionKind.CANONICAL: Collective.ALL_GATHER,
        }[self.reduction]

    def _check_residences(self, where: Residences) -> None:
        """Refuse a placement that cannot work ([Note: residences]); a role placed apart from the buffer
        it would view gets a buffer of its own ([Note: offload, planned])."""
        check_config(isinstance(where, Residences), f"residences must be a Residences, got {where!r}")
        if where.all_on_device:
            return
        R = BufferRole
        check_config(
            self.stage is not Stage.DDP,
            "residences: a stage-0 (DDP) plan allocates nothing of zeroplan's, so nothing can be placed in "
            "host memory; use stage 1, 2 or 3",
        )
        check_config(
            not where.partial or where.of(R.PARAM_SHARD) is Residence.DEVICE,
            f"residences: host_fraction={where.host_fraction} keeps part of the masters on the device, but "
            "param_shard is placed in host memory, where the kept part would have to publish its values "
            "to; offload the parameter shards whole (offload='all'), or keep them on the device",
        )
        check_config(
            where.of(R.OPTIMIZER_STATE) is where.of(R.MASTER),
            f"residences: optimizer_state is placed on the {where.of(R.OPTIMIZER_STATE).value} but master "
            f"on the {where.of(R.MASTER).value}; the inner optimizer makes its state beside the masters it "
            "steps, so place both in host memory or neither",
        )

    def _check_param_wire(self, codec: WireCodec) -> None:
        """Refuse a parameter wire the plan cannot keep exact masters under ([Note: wire formats])."""
        check_config(
            isinstance(codec, WireCodec) and codec.format in _PARAM_WIRES,
            f"param_wire must be a WireCodec of format 'bf16', 'int8' or 'fp8', got {codec!r} (fp32 "
            "would send more bytes than bf16/fp16 parameters and change nothing)",
        )
        check_config(
            self.stage is not Stage.DDP,
            "a parameter wire format (gather_dtype) needs stage 1, 2 or 3 (stage 0 gathers nothing)",
        )
        check_config(
            not self.deterministic,
            "deterministic=True and a parameter wire format (gather_dtype) cannot be combined: a world "
            "of one gathers nothing, so its parameters are never encoded; use one or the other",
        )
        # Stages 1-2 hold no exact copy of fp32 parameters but the parameters themselves: stepped in
        # place, or (offload) copied from host masters that checkpoints and re-plans do not read.
        in_place = [
            s.dtype
            for s in self.partition.spaces
            if self.stage in (Stage.OPTIMIZER, Stage.GRADIENTS) and master_dtype(s.dtype) == s.dtype
        ]
        if in_place:
            raise ConfigError(
                f"gather_dtype={codec.format.value!r} at stage {int(self.stage)} needs fp32 masters apart "
                f"from the parameters, but the {in_place[0]} parameters are their own master (every rank "
                "would hold, save and re-plan from the decoded values, with or without offload); train "
                "in bf16/fp16 (fp32 masters are kept) or use stage 3 (its shard stays exact)"
            )
        check_wire(codec, self.partition.alignment)

    def gather_room(self, space: Space, block: Block) -> GatherRoom | None:
        """The room of the encoded gather of ``space``'s ``block``; ``None`` when parameters travel as
        they are, or nothing is gathered (a shard group of one)."""
        if self.gather is GatherKind.PLAIN or self.param_wire is None:
            return None
        return gather_room(self.param_wire, block.pieces, space.dtype)

    @property
    def exchanges_encoded(self) -> bool:
        """Whether gradients travel in a wire format of their own ([Note: wire formats])."""
        return self.reduction is ReductionKind.ENCODED

    def exchanges(self, collective: Collective) -> bool:
        """Whether ``collective`` runs as a point-to-point exchange (see [Note: collective policy])."""
        exchanged = collective in (Collective.REDUCE_SCATTER, Collective.ALL_GATHER)
        return exchanged and self.policy.point_to_point and self.topology.shard_size > 1

    def gather_blocks(self, space: Space) -> Sequence[Block]:
        """The blocks ``space``'s updated parameters are gathered in, in buffer order.

        [Note: gather blocks]
        A space of one block (the ``rank_major`` layout, the default at stage 1)
        would be gathered as a whole after each step, so the next forward's
        first read would wait for the whole model. At stages 1 and 2 it is
        gathered instead in chunks of at most a bucket (``bucket_bytes``), each
        inside one rank's region and broadcast by that rank, in buffer order:
        the forward of early layers runs while later chunks still arrive
        ([Note: parameter gather] in the facade). The bytes sent are those of
        the block's broadcasts; an ``all_gather`` of equal regions becomes one
        broadcast per chunk (more calls, never a point-to-point exchange, so
        gloo carries it for CUDA tensors too). Stage 3's blocks are its
        residency units and are gathered as they are, and so is a block a
        hierarchical topology gathers in two hops. Interleaved spaces already
        are blocks of at most a bucket.

        The chunks are described by rule (:class:`~zeroplan.core.chunks.GatherChunks`:
        the block, the cap, and per rank its number of chunks), and each chunk is a
        :class:`Block` whose per-rank pieces and shard starts are computed tuples,
        so a world of 4,096 ranks with 8,193 chunks holds a few numbers per chunk,
        not two tuples of 4,096 (33.5 million numbers). Readers that sum over the
        senders use :meth:`Block.nonempty_pieces` (one per chunk).
        """
        blocks = space.blocks
        if (
            self.stage is Stage.PARAMETERS
            or self.partition.layout != "rank_major"
            or len(blocks) != 1
            or self.topology.shard_size == 1
            or self.gathers_in_two_hops(blocks[0])
        ):
            return blocks
        layout = self.buckets
        itemsize = DTYPE_ITEMSIZE[space.dtype]
        cap = max(layout.alignment, layout.bucket_bytes // itemsize // layout.alignment * layout.alignment)
        return owner_chunks(blocks[0], cap)

    def gathers_in_two_hops(self, block: Block) -> bool:
        """Whether ``block`` is gathered across nodes, then inside them ([Note: hierarchical all-gather])."""
        gather = self.gather_collective(block)
        return gather is Collective.ALL_GATHER and self.topology.hierarchical and not self.exchanges(gather)

    def master_in_params(self, space: Space) -> bool:
        """Whether a rank steps its own pieces of ``space``'s full parameter buffer in place.

        Stages 1 and 2 with parameters already in the master dtype (fp32): the
        rank's pieces of the full buffer are its master, so no copy is held
        or made each step. With a rank-major layout they are one region; with
        an interleaved one, one piece per block, so elementwise windows are
        cut where one piece does not follow the last in the buffer
        (:meth:`inner_tensors`). Stage 3 steps its own shard tensor, and
        bf16/fp16 parameters get a separate fp32 master. Masters placed apart
        from the parameters (host memory, [Note: offload, planned]) are a
        buffer of their own.
        """
        return (
            self.stage in (Stage.OPTIMIZER, Stage.GRADIENTS)
            and master_dtype(space.dtype) == space.dtype
            and self.residences.of(BufferRole.MASTER) is self.residences.of(BufferRole.FULL_PARAMS)
        )

    def own_master(self, space: Space) -> bool:
        """Whether the rank's masters of ``space`` are a buffer of their own (not a view of parameters).

        bf16/fp16 parameters get fp32 masters; fp32 ones are stepped in place
        (stages 1-2: :meth:`master_in_params`; stage 3: the parameter shard)
        unless the masters live apart from them ([Note: offload, planned]).
        """
        if self.stage is Stage.PARAMETERS:
            where = self.residences.of
            return master_dtype(space.dtype) != space.dtype or where(BufferRole.MASTER) is not where(
                BufferRole.PARAM_SHARD
            )
        return not self.master_in_params(space)

    def split_views(self) -> tuple[BufferRole, ...]:
        """The roles the placement gives a buffer of their own where they would view another.

        Empty with everything on the device ([Note: offload, planned]): fp32
        masters apart from the parameters, a stage-1 gradient shard apart from
        the full gradients.
        """
        split = set()
        for space in self.partition.spaces:
            if (
                self.stage is not Stage.DDP
                and master_dtype(space.dtype) == space.dtype
                and self.own_master(space)
            ):
                split.add(BufferRole.MASTER)
            if self.stage is Stage.OPTIMIZER and space.shard_is_region and not self.reduces_in_place(space):
                split.add(BufferRole.GRAD_SHARD)
        return tuple(role for role in BufferRole if role in split)

    def reduces_in_place(self, space: Space) -> bool:
        """Whether the rank's gradient shard of ``space`` is its region of the full gradient buffer.

        Stage 1 with a rank-major layout reduces in place, unless the gradient
        shard lives apart from the full gradients ([Note: offload, planned]).
        """
        where = self.residences.of
        return (
            self.stage is Stage.OPTIMIZER
            and space.shard_is_region
            and where(BufferRole.GRAD_SHARD) is where(BufferRole.FULL_GRADS)
        )

    def inner_tensors(self, shard_rank: int) -> tuple[InnerTensor, ...]:
        """What the inner optimizer steps on shard rank ``shard_rank``.

        Elementwise optimizers get one flat window per run of fragments with
        the same (param group, cohort) in each space, cut where the rank's
        next piece does not follow its last one in the full buffer when it
        steps them in place (:meth:`master_in_params`); others get each
        owned parameter whole, shaped like the parameter (always inside one
        piece). Tensors without elements are left out: there is nothing to
        step (and some optimizers, such as Adafactor, fail on them).
        """
        check_config(
            0 <= shard_rank < self.topology.shard_size,
            f"shard rank {shard_rank} outside 0..{self.topology.shard_size - 1}",
        )
        tensors: list[InnerTensor] = []
        for space in self.partition.spaces:
            frags = self.partition.rank_fragments(space.index, shard_rank)
            if not self.elementwise:
                for f in frags:
                    spec = self.specs[f.param]
                    if spec.numel == 0:
                        continue
                    tensors.append(
                        InnerTensor(
                            space=space.index,
                            group=spec.group,
                            shard_span=f.shard_span,
                            shape=spec.shape,
                            param=f.param,
                            cohort=spec.cohort,
                        )
                    )
                continue
            specs = self.specs
            cuts = []  # where the rank's next piece does not follow its last one in the full buffer
            if self.master_in_params(space) and not space.shard_is_region:
                cuts = [
                    b.shard_span.start
                    for a, b in pairwise(space.pieces_of(shard_rank))
                    if a.buffer_span.stop != b.buffer_span.start
                ]
            if self.steps_on_host:  # [Note: offload, executed]: a window per bucket, stepped as it lands
                starts = (start for start, _, _ in self.bucket_pieces(space.index, shard_rank))
                cuts = sorted({*cuts, *starts})
            start = 0
            # Zero-size fragments hold nothing; the others, in shard order, form maximal runs.
            held = (f for f in frags if f.param_span.stop > f.param_span.start)
            for (group, cohort), run in groupby(
                held, key=lambda f: (specs[f.param].group, specs[f.param].cohort)
            ):
                *_, last = run
                stop = last.shard_offset + last.param_span.stop - last.param_span.start
                edges = [start, *(c for c in cuts if start < c < stop), stop]
                tensors.extend(
                    InnerTensor(
                        space=space.index, group=group, shard_span=Span(a, b), shape=(b - a,), cohort=cohort
                    )
                    for a, b in pairwise(edges)
                )
                start = stop
        return tuple(tensors)

    def kept_numel(self, space: int, shard_rank: int) -> int:
        """Elements ``[0, k)`` of shard rank ``shard_rank``'s shard of ``space`` that a partial offload
        keeps on the device ([Note: kept on the device]); 0 unless ``residences.partial``.

        ``k`` is the start of one of the rank's bucket pieces, or its extent: the one nearest
        ``(1 - host_fraction)`` of the extent (the lower on a tie). An optimizer that steps whole
        parameters (not elementwise) takes only starts that cut none of the rank's parameters.

        Example:
            >>> from zeroplan.core import Topology, plan, specs_from_shapes
            >>> zp = plan(specs_from_shapes([(64,)] * 4, dtype="bf16"), Topology(world_size=2),
            ...     alignment=8, bucket_bytes=128, offload="optimizer", offload_fraction=0.5)
            >>> zp.kept_numel(0, 0), zp.partition.spaces[0].extent(0)
            (64, 128)
        """
        if not self.residences.partial:  # partial places the masters in host memory: steps there
            return 0
        # The allocation, the report and the step each ask, per rank.
        return self._memo(("kept", space, shard_rank), lambda: self._kept_numel(space, shard_rank))

    def _kept_numel(self, space: int, shard_rank: int) -> int:
        """:meth:`kept_numel`, computed."""
        extent = self.partition.spaces[space].extent(shard_rank)
        target = (1 - self.residences.host_fraction) * extent
        edges = [start for start, _, _ in self.bucket_pieces(space, shard_rank)] + [extent]
        if not self.elementwise:  # a whole parameter is stepped in one place
            inside = [
                (f.shard_offset, f.shard_offset + f.param_span.numel)
                for f in self.partition.rank_fragments(space, shard_rank)
            ]
            edges = [e for e in edges if not any(a < e < b for a, b in inside)]
        return min(edges, key=lambda k: (abs(k - target), k))

    @property
    def steps_on_host(self) -> bool:
        """Whether the inner optimizer steps in host memory ([Note: offload, executed])."""
        return self.residences.of(BufferRole.MASTER) is Residence.HOST

    def bucket_pieces(self, space: int, shard_rank: int) -> tuple[tuple[int, int, int], ...]:
        """Shard rank ``shard_rank``'s non-empty bucket pieces of ``space``: ``(start, stop, bucket
        index)`` in its shard, sorted by start (they are disjoint).

        The pieces of buckets that list them (rank-major: a few ranks each) are indexed by rank
        once, on first use; a block's (interleaved: every rank has one) are read off the block per
        call, and once for all ranks where they are alike (:meth:`pieces_alike`).
        """
        if self.pieces_alike(space):
            return self._memo(("alike pieces", space), lambda: self._bucket_pieces(space, 0))
        return self._bucket_pieces(space, shard_rank)

    def _bucket_pieces(self, space: int, shard_rank: int) -> tuple[tuple[int, int, int], ...]:
        """:meth:`bucket_pieces`, computed."""
        held = list(self._memo(("bucket pieces",), self._listed_pieces).get((space, shard_rank), ()))
        for index, block in self._block_buckets().get(space, ()):
            size = block.pieces[shard_rank] if shard_rank < len(block.pieces) else 0
            if size:
                start = block.shard_starts[shard_rank]
                held.append((start, start + size, index))
        return tuple(sorted(held))

    def _block_buckets(self) -> dict[int, list[tuple[int, Block]]]:
        """Per space, ``(bucket index, block)`` of its buckets that are one block each (their
        ``pieces`` a :class:`~zeroplan.core.buckets.BlockPieces`), in launch order; on first use."""

        def index() -> dict[int, list[tuple[int, Block]]]:
            found: dict[int, list[tuple[int, Block]]] = {}
            for bucket in self.buckets.buckets:
                if type(bucket.pieces) is BlockPieces:
                    found.setdefault(bucket.space, []).append((bucket.index, bucket.pieces.block))
            return found

        return self._memo(("block buckets",), index)

    def pieces_alike(self, space: int) -> bool:
        """Whether every shard rank holds the same pieces of ``space`` (the same starts and sizes in
        its shard, in every gather block and every bucket).

        True for a space of blocks of equal pieces whose buckets are blocks (stage 3's default
        layout, when each block divides evenly): then a rank's shard, buckets and windows differ
        from another's only in which parameters they hold, and what depends on the pieces alone
        (:meth:`bucket_pieces`, and with an elementwise optimizer the windows' cuts, the kept
        prefix and the host link) is computed once for all ranks.
        """

        def alike() -> bool:
            listed = self._memo(("bucket pieces",), self._listed_pieces)
            blocks = [
                *self.partition.spaces[space].blocks,
                *(b for _, b in self._block_buckets().get(space, ())),
            ]
            return not any(s == space for s, _ in listed) and all(
                block.equal and block.shard_starts.count(block.shard_starts[0]) == len(block.shard_starts)
                for block in blocks
            )

        return self._memo(("alike", space), alike)

    def _memo(self, key: tuple[object, ...], compute: Callable[[], _T]) -> _T:
        """``compute()``, remembered in ``_derived`` under ``key`` (computed on first use)."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    def _listed_pieces(self) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
        """``(space, rank) -> (start, stop, bucket)`` of the non-empty pieces of buckets that list
        their pieces (not a block's), in one pass over them."""
        index: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for bucket in self.buckets.buckets:
            if type(bucket.pieces) is not BlockPieces:
                for p in bucket.pieces:
                    if p.shard_span.numel:
                        index.setdefault((bucket.space, p.rank), []).append(
                            (p.shard_span.start, p.shard_span.stop, bucket.index)
                        )
        return index

    def inner_tensors_by_rank(self) -> tuple[tuple[InnerTensor, ...], ...]:
        """:meth:`inner_tensors` of every shard rank.

        For a compact plan (see [Note: compact plans] in :mod:`zeroplan.core.runs`)
        stepped in windows without cuts, or cut only where buckets start when
        every rank's bucket pieces are alike (:meth:`pieces_alike`: an
        offloaded stage 3), computed for all ranks at once from its runs
        (:func:`~zeroplan.core.runs.rank_windows`), not rank by rank, and
        ranks with equal tensors share one tuple (a memory report computes
        their state and temporaries once).
        """
        n = self.topology.shard_size
        spaces = self.partition.spaces
        compact = (
            bool(spaces)
            and all(
                space.block_runs and not (self.master_in_params(space) and not space.shard_is_region)
                for space in spaces
            )
            and (not self.steps_on_host or all(self.pieces_alike(space.index) for space in spaces))
        )
        if not (compact and self.elementwise):
            return tuple(map(self.inner_tensors, range(n)))
        windows = [rank_windows(space, self.specs) for space in spaces]
        # [Note: offload, executed]: a window per bucket; the buckets start alike on every rank.
        cuts = [
            [start for start, _, _ in self.bucket_pieces(space.index, 0)] if self.steps_on_host else []
            for space in spaces
        ]
        shared: dict[tuple[object, ...], tuple[InnerTensor, ...]] = {}
        result = []
        for r in range(n):
            key = tuple(w[r] for w in windows)
            tensors = shared.get(key)
            if tensors is None:
                tensors = shared[key] = tuple(
                    InnerTensor(space=space.index, group=g, shard_span=Span(a, b), shape=(b - a,), cohort=c)
                    for space, mine, at in zip(spaces, key, cuts, strict=True)
                    for g, c, start, stop in mine
                    for a, b in pairwise([start, *at[bisect_right(at, start) : bisect_left(at, stop)], stop])
                )
            result.append(tensors)
        return tuple(result)

    def specs_fingerprint(self) -> str:
        """Stable digest of the parameters alone (:func:`~zeroplan.core.specs.specs_fingerprint`).

        Ranks compare it before :meth:`fingerprint`, to tell "other parameters"
        from "same parameters, other settings".
        """
        return specs_fingerprint(self.specs)

    def with_options(self, **changes: bool) -> ZeroPlan:
        """The same plan executed with other :class:`StepOptions` (``overlap_grad_reduce=False``, ...).

        Raises:
            ConfigError: an unknown option, or a value that is not a bool.
        """
        known = {f.name for f in dataclasses.fields(StepOptions)}
        unknown = sorted(set(changes) - known)
        check_config(not unknown, f"unknown step options {unknown}; the options are {sorted(known)}")
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **changes))

    def settings(self) -> dict[str, object]:
        """Every setting the plan was made with, by ``ZeroOptimizer``'s name for it.

        What ranks compare when their fingerprints differ, so the error names
        the field and each rank's value ([Note: plan options]).
        """
        grad, param = self.grad_wire, self.param_wire
        return {
            "world_size": self.topology.world_size,
            "shard_group_size": self.topology.shard_size,
            "stage": int(self.stage),
            "strategy": self.partition.strategy,
            "layout": self.partition.layout,
            "alignment": self.partition.alignment,
            "bucket_bytes": self.buckets.bucket_bytes,
            "collectives": self.buckets.policy.value,
            "optimizer": tuple(o.name for o in self.optimizers),
            "loss_scale": "on" if self.loss_scaling else None,
            "max_inflight_buckets": self.max_inflight_buckets,
            "deterministic": self.deterministic,
            "reduce_dtype": None if grad is None else grad.format.value,
            "gather_dtype": None if param is None else param.format.value,
            "wire_block": tuple(w.block for w in (grad, param) if w is not None) or None,
            **{f.name: getattr(self.options, f.name) for f in dataclasses.fields(StepOptions)},
            "offload": offload_name(self.residences, int(self.stage)),  # or the roles, if no mode
            **({"offload_fraction": self.residences.host_fraction} if self.residences.partial else {}),
        }

    def fingerprint(self) -> str:
        """Stable digest of the layout: what a rank's buffers and state hold, and where.

        ``options`` are not in it (a sharded state dict saved with one overlap
        setting loads under another); ranks compare them through :meth:`settings`.
        """
        t = self.topology
        return digest(
            "zeroplan/v1",
            [
                t.world_size,
                t.shard_size,
                int(self.stage),
                self.partition.fingerprint(),
                self.buckets.fingerprint(),
                tuple((o.name, o.elementwise, o.per_element, o.scalars, o.factored) for o in self.optimizers),
                self.loss_scaling,
                self.max_inflight_buckets,
                *(["deterministic"] if self.deterministic else []),  # default plans keep their digest
                *(
                    [("grad_wire", self.grad_wire.format.value, self.grad_wire.block)]
                    if self.grad_wire
                    else []
                ),
                *(
                    [("param_wire", self.param_wire.format.value, self.param_wire.block)]
                    if self.param_wire
                    else []
                ),
                *([("host", tuple(r.value for r in self.residences.host))] if self.residences.host else []),
                *([("host_fraction", self.residences.host_fraction)] if self.residences.partial else []),
            ],
        )


def _wire(wire: WireCodec | str | None) -> WireCodec | None:
    """``plan(grad_wire=...)`` or ``plan(param_wire=...)`` as a codec, ``None`` for the parameter dtype."""
    if isinstance(wire, str):
        wire = WireCodec(wire)  # type: ignore[arg-type]  # validated there
    if wire is None or wire.format is WireFormat.PARAM:
        return None
    return wire


def auto_strategy(optimizer: OptimizerSpec) -> str:
    """The strategy ``strategy="auto"`` picks: ``flat_even`` if elementwise, else ``lpt_whole``."""
    return "flat_even" if optimizer.elementwise else "lpt_whole"


def plan(
    specs: Sequence[ParamSpec],
    topology: Topology,
    *,
    stage: int = Stage.GRADIENTS,
    strategy: str = "auto",
    optimizer: str | OptimizerSpec | Sequence[OptimizerSpec] = "AdamW",
    alignment: int = DEFAULT_ALIGNMENT,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    loss_scaling: bool = False,
    max_inflight_buckets: int = 2,
    policy: CollectivePolicy | str = CollectivePolicy.MIN_BYTES,
    layout: str = "auto",
    deterministic: bool = False,
    grad_wire: WireCodec | str | None = None,
    param_wire: WireCodec | str | None = None,
    options: StepOptions | None = None,
    residences: Residences = ALL_ON_DEVICE,
    offload: Offload | str | None = None,
    offload_fraction: float | None = None,
) -> ZeroPlan:
    """Plan a sharded optimizer for ``specs`` on ``topology``.

    Args:
        specs: the parameters (see :func:`specs_from_shapes`).
        topology: world and shard-group sizes.
        stage: 0 (DDP), 1, 2 or 3.
        strategy: a registered strategy name, or ``"auto"``.
        optimizer: an optimizer name, a spec, or one spec per param group.
        alignment: elements; shard allocations and bucket bounds are multiples.
        bucket_bytes: byte cap of one gradient bucket.
        loss_scaling: whether a loss scale (with its overflow check) is used.
        max_inflight_buckets: bound on buckets being reduced at once.
        policy: ``"min_bytes"`` (NCCL) or ``"gloo"``, see [Note: collective policy].
        layout: ``"auto"``, ``"interleaved"`` or ``"rank_major"``, see
            [Note: layout] and [Note: interleaved layout]. ``"auto"`` is rank-major at
            stage 1 (in-place reduction into the full gradient buffer) and interleaved
            otherwise (unless the pieces would be too many).
        deterministic: sum in canonical orders, bit-identical at any world size
            ([Note: deterministic mode]).
        grad_wire: what gradients travel as: ``None`` (the parameter dtype), a
            format name (``"fp32"``, ``"bf16"``, ``"int8"``, ``"fp8"``) or a
            :class:`WireCodec` ([Note: wire formats]).
        param_wire: what updated parameters travel as in their gathers: ``None``
            (the parameter dtype), ``"bf16"``, ``"int8"``, ``"fp8"`` or a codec.
        options: how the plan executes in a step (``None``: the defaults,
            see [Note: plan options]).
        residences: where each buffer role lives ([Note: residences]); all on the device by default.
        offload: ``"none"`` (``None``), ``"optimizer"`` or ``"all"``: the placement of CPU
            offload ([Note: offload, planned]), instead of ``residences``.
        offload_fraction: with ``offload="optimizer"``, the share of each rank's optimizer
            elements placed in host memory, the rest kept on the device ([Note: kept on the
            device]); ``None``: all of them.

    Raises:
        ConfigError: any argument is invalid (the message says how to fix it).

    Example:
        >>> from zeroplan.core.specs import specs_from_shapes
        >>> zp = plan(specs_from_shapes([(17, 257), (3,)]), Topology(world_size=4), alignment=8)
        >>> zp.partition.strategy, zp.stage.name, len(zp.buckets.buckets)
        ('flat_even', 'GRADIENTS', 1)
    """
    specs = check_specs(specs)
    check_config(stage in tuple(Stage), f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if Offload.parse(offload) is not Offload.NONE or offload_fraction is not None:
        check_config(
            residences == ALL_ON_DEVICE,
            f"pass offload={Offload.parse(offload).value!r} or residences={residences!r}, not both: the "
            "offload mode is a placement of its own",
        )
        residences = offload_residences(offload, stage, offload_fraction)
    if isinstance(optimizer, str):
        optimizer = describe_optimizer(optimizer)
    groups = 1 + max((s.group for s in specs), default=0)
    optimizers = (optimizer,) * groups if isinstance(optimizer, OptimizerSpec) else tuple(optimizer)
    check_config(len(optimizers) >= 1, "optimizer: pass a name, a spec or one spec per param group")
    try:
        policy = CollectivePolicy(policy)
    except ValueError:
        choices = ", ".join(repr(p.value) for p in CollectivePolicy)
        raise ConfigError(f"unknown collective policy {policy!r}; use one of {choices}") from None
    name = auto_strategy(optimizers[0]) if strategy == "auto" else strategy
    if layout == "auto" and Stage(stage) is Stage.OPTIMIZER:
        # Stage 1 keeps full gradient buffers: rank-major reduces into the rank's region in place,
        # an interleaved shard would need a reduced-gradient shard of its own ([Note: layout]).
        layout = "rank_major"
    # Stage 3 gathers and frees each block on its own: no parameter may cross a block boundary.
    whole_blocks = Stage(stage) is Stage.PARAMETERS
    partition = build_partition(
        specs, topology.shard_size, alignment, bucket_bytes, name, layout, whole_blocks=whole_blocks
    )
    return ZeroPlan(
        topology=topology,
        stage=Stage(stage),
        partition=partition,
        buckets=plan_buckets(partition, bucket_bytes, alignment, policy),
        optimizers=optimizers,
        loss_scaling=loss_scaling,
        max_inflight_buckets=max_inflight_buckets,
        deterministic=deterministic,
        grad_wire=_wire(grad_wire),
        param_wire=_wire(param_wire),
        options=StepOptions() if options is None else options,
        residences=residences,
    )
