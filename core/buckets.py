# zeroplan.core — pure planning: no torch, no I/O.
# Gradient buckets derived from a partition plan; ranks are shard ranks.
"""``BucketLayout``: how gradients are grouped and reduced.

[Note: buckets]
Backward produces gradients in reverse parameter order, so a bucket is an
interval of a space's *space coordinate*, taken from the end: the first bucket
holds the last parameters. Buckets are capped in bytes and their boundaries fall
on multiples of the alignment; a parameter larger than the cap is cut across
several buckets.

Each rank's share of a bucket is one contiguous window of its shard (shards are
packed in parameter order), a *piece*. A bucket is reduced by one collective
that delivers every rank exactly its piece: its gradients are copied into a
staging buffer laid out as the pieces one after the other, in rank order, and

* ``reduce_scatter`` when every rank has an equal piece,
* ``reduce`` when a single rank owns the whole bucket,
* ``reduce_scatter_v`` (uneven pieces, some empty) otherwise,

except under the ``GLOO`` policy, which reduces uneven pieces by one
``all_reduce`` over the whole data-parallel group, after which every rank
keeps its piece, and equal pieces by a point-to-point exchange that is still
a ``reduce_scatter`` in sizes and bytes (see [Note: collective policy]).

With the ``interleaved`` layout ([Note: interleaved layout]) each block of
the full buffer is one bucket instead: its ``span`` is the block's range of the
full buffer, the staging buffer is laid out exactly like the block (padding
included, which the facade zeroes), and equal pieces make it one
``reduce_scatter``.

Over all buckets, a rank's pieces tile its shard exactly once. Buckets launch
in ``buckets`` order on every rank (the order collectives must match in), each
once all its parameters' gradients are ready.
"""

from __future__ import annotations

import operator
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate, chain
from typing import NamedTuple

from zeroplan.core.comm import Collective, CollectivePolicy
from zeroplan.core.errors import PlanInvariantError, check_config, require
from zeroplan.core.fingerprint import Rendered, digest
from zeroplan.core.partition import PartitionPlan
from zeroplan.core.runs import ComputedTuple, FragmentRun
from zeroplan.core.space import Block, Space
from zeroplan.core.span import Span, round_up

__all__ = ["Bucket", "BucketLayout", "GradCopy", "Piece", "plan_buckets"]


@dataclass(frozen=True, slots=True)
class Piece:
    """One rank's share of a bucket.

    Attributes:
        rank: shard rank.
        shard_span: the window of that rank's shard the bucket reduces into.
        staging_offset: where the piece starts in the bucket's staging buffer.
    """

    rank: int
    shard_span: Span
    staging_offset: int

    @property
    def staging_span(self) -> Span:
        """The piece's range in the staging buffer."""
        return self.shard_span.shift(self.staging_offset - self.shard_span.start)


@dataclass(frozen=True, slots=True)
class GradCopy:
    """Copy ``param.grad.flatten()[param_span]`` to ``staging[staging_offset:]``."""

    param: int
    param_span: Span
    staging_offset: int


class BlockPieces(ComputedTuple[Piece]):
    """The pieces of a bucket that is one block whose every rank has a piece, computed when read.

    Equal to the tuple of ``Piece(r, the rank's piece in its shard, its offset in the block)``
    (see [Note: compact plans] in :mod:`zeroplan.core.runs`).
    """

    __slots__ = ("block",)
    block: Block

    def __init__(self, block: Block) -> None:
        object.__setattr__(self, "block", block)

    def __len__(self) -> int:
        return len(self.block.pieces)

    def _item(self, i: int) -> Piece:
        start = self.block.shard_starts[i]
        return Piece(i, Span(start, start + self.block.pieces[i]), self.block.offsets[i])

    def __iter__(self) -> Iterator[Piece]:
        block = self.block
        for rank, (start, size, offset) in enumerate(
            zip(block.shard_starts, block.pieces, block.offsets, strict=True)
        ):
            yield Piece(rank, Span(start, start + size), offset)

    def __eq__(self, other: object) -> bool:
        return (type(other) is BlockPieces and self.block == other.block) or super().__eq__(other)

    def __hash__(self) -> int:
        return super().__hash__()

    def triples_text(self) -> str:
        """``repr`` of the ``(rank, start, stop)`` of every piece in its shard (for the fingerprint)."""
        starts, sizes = self.block.shard_starts, self.block.pieces
        n = len(sizes)
        if n > 1 and starts.count(starts[0]) == n and sizes.count(sizes[0]) == n:
            start, stop = starts[0], starts[0] + sizes[0]
            return "((" + f", {start}, {stop}), (".join(_rank_names(n)) + f", {start}, {stop}))"
        return repr(tuple(zip(range(n), starts, map(operator.add, starts, sizes), strict=True)))


@lru_cache(maxsize=8)
def _rank_names(n: int) -> tuple[str, ...]:
    return tuple(map(str, range(n)))


class BlockCopies(ComputedTuple[GradCopy]):
    """The copies of a bucket that is one block of a compact space, computed when read.

    Equal to the tuple of ``GradCopy(param, fragment's param span, its place in the block)``
    for every non-empty fragment of the block's runs, in buffer order.
    """

    __slots__ = ("ends", "runs")
    runs: tuple[FragmentRun, ...]
    ends: tuple[int, ...]

    def __init__(self, runs: Sequence[FragmentRun]) -> None:
        object.__setattr__(self, "runs", tuple(r for r in runs if r.numel))
        object.__setattr__(self, "ends", tuple(accumulate(len(r) for r in self.runs)))

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def _item(self, i: int) -> GradCopy:
        k = bisect_right(self.ends, i)
        run = self.runs[k]
        frag = run[i - (self.ends[k - 1] if k else 0)]
        return GradCopy(run.param, frag.param_span, run.position - run.start + frag.param_span.start)

    def __iter__(self) -> Iterator[GradCopy]:
        for run in self.runs:
            shift = run.position - run.start  # where the parameter's element 0 lies in the block
            for frag in run:
                yield GradCopy(run.param, frag.param_span, shift + frag.param_span.start)

    def __eq__(self, other: object) -> bool:
        return (type(other) is BlockCopies and self.runs == other.runs) or super().__eq__(other)

    def __hash__(self) -> int:
        return super().__hash__()


@dataclass(frozen=True, slots=True, kw_only=True)
class Bucket:
    """A group of gradient elements reduced by one collective.

    Attributes:
        index: position in launch order.
        space: index of the dtype space.
        span: the interval of the space coordinate it covers (rank-major), or
            its block's range of the full buffer (interleaved).
        pieces: non-empty per-rank pieces, in rank order (a tuple, or for
            a block, a :class:`BlockPieces` equal to one).
        copies: how to fill the staging buffer from parameter gradients (a
            tuple, or for a block of a compact space a :class:`BlockCopies`).
        params: parameters whose gradients it needs, increasing.
        collective: the collective that reduces it (see [Note: buckets]).
    """

    index: int
    space: int
    span: Span
    pieces: Sequence[Piece]
    copies: Sequence[GradCopy]
    params: tuple[int, ...]
    collective: Collective

    @property
    def numel(self) -> int:
        """Elements in the bucket (and its staging buffer)."""
        return self.span.numel

    @property
    def padded(self) -> bool:
        """Whether part of the staging buffer is padding, which must be zero (interleaved layouts)."""
        return sum(c.param_span.numel for c in self.copies) < self.numel

    def padding(self) -> tuple[Span, ...]:
        """The ranges of the staging buffer no gradient is copied into: zeroed before each reduction.

        Example:
            >>> bucket = Bucket(index=0, space=0, span=Span(0, 8), pieces=(), params=(0,),
            ...     copies=(GradCopy(param=0, param_span=Span(0, 3), staging_offset=2),),
            ...     collective=Collective.ALL_REDUCE)
            >>> bucket.padding()
            (Span(start=0, stop=2), Span(start=5, stop=8))
        """
        gaps = []
        at = 0
        filled = sorted((c.staging_offset, c.staging_offset + c.param_span.numel) for c in self.copies)
        for start, stop in filled:
            if start > at:
                gaps.append(Span(at, start))
            at = max(at, stop)
        if at < self.numel:
            gaps.append(Span(at, self.numel))
        return tuple(gaps)

    def piece_sizes(self, shard_size: int) -> tuple[int, ...]:
        """Elements of the bucket each shard rank receives (0 for most ranks of a ``reduce``)."""
        if type(self.pieces) is BlockPieces and len(self.pieces) == shard_size:
            return self.pieces.block.pieces
        sizes = [0] * shard_size
        for piece in self.pieces:
            sizes[piece.rank] = piece.shard_span.numel
        return tuple(sizes)

    def piece_numels(self) -> Iterator[tuple[int, int]]:
        """``(rank, elements)`` of every piece, in order (no :class:`Piece` made for a block's)."""
        if type(self.pieces) is BlockPieces:
            return enumerate(self.pieces.block.pieces)
        return ((p.rank, p.shard_span.numel) for p in self.pieces)

    def piece_of(self, rank: int) -> Piece | None:
        """Rank ``rank``'s piece, or ``None`` when it receives nothing from this bucket."""
        if type(self.pieces) is BlockPieces:  # a piece per rank, in rank order
            return self.pieces[rank] if 0 <= rank < len(self.pieces) else None
        return next((p for p in self.pieces if p.rank == rank), None)

    def _digest_part(self) -> object:
        """What :meth:`BucketLayout.fingerprint` hashes of the bucket."""
        if type(self.pieces) is BlockPieces:
            head = repr((self.space, self.span.start, self.span.stop, self.collective.value))
            return Rendered(f"\x1f{head[:-1]}, {self.pieces.triples_text()})")
        triples = tuple((p.rank, p.shard_span.start, p.shard_span.stop) for p in self.pieces)
        return (self.space, self.span.start, self.span.stop, self.collective.value, triples)


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketLayout:
    """All gradient buckets of a partition plan, in launch order.

    Attributes:
        bucket_bytes: byte cap of one bucket.
        alignment: bucket boundaries are multiples of it (space coordinate).
        policy: which collectives reduce the buckets.
        buckets: the buckets, in the order every rank launches them.
        param_buckets: per parameter index, the buckets holding part of it.
    """

    bucket_bytes: int
    alignment: int
    buckets: tuple[Bucket, ...]
    policy: CollectivePolicy = CollectivePolicy.MIN_BYTES
    param_buckets: tuple[tuple[int, ...], ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        nparams = 1 + max((p for b in self.buckets for p in b.params), default=-1)
        table: list[list[int]] = [[] for _ in range(nparams)]
        for position, bucket in enumerate(self.buckets):
            require(bucket.index == position, f"bucket at position {position} has index {bucket.index}")
            for p in bucket.params:
                table[p].append(position)
        object.__setattr__(self, "param_buckets", tuple(tuple(t) for t in table))

    def buckets_of(self, param: int) -> tuple[int, ...]:
        """Indices of the buckets that need parameter ``param``'s gradient."""
        return self.param_buckets[param] if param < len(self.param_buckets) else ()

    def fingerprint(self) -> str:
        """Stable digest of the layout."""
        return digest(
            "buckets/v1",
            chain(
                (self.bucket_bytes, self.alignment, self.policy.value),
                (b._digest_part() for b in self.buckets),  # each written when hashed
            ),
        )


class _Part(NamedTuple):
    """A fragment clipped to one bucket: the gradient elements it copies and their place in the shard."""

    param: int
    param_span: Span
    shard_span: Span


class _Draft(NamedTuple):
    """A bucket whose launch position is not known yet."""

    space: int
    span: Span
    pieces: Sequence[Piece]
    copies: Sequence[GradCopy]
    params: tuple[int, ...]
    collective: Collective

    def launch_key(self) -> tuple[int, int, int]:
        """Sort key of the launch order.

        A bucket is complete when its lowest-index parameter is ready, and
        backward readies parameters in decreasing index order.
        """
        return (-self.params[0], self.space, -self.span.start)


def plan_buckets(
    plan: PartitionPlan,
    bucket_bytes: int,
    alignment: int | None = None,
    policy: CollectivePolicy = CollectivePolicy.MIN_BYTES,
) -> BucketLayout:
    """Group the plan's gradients into reduce buckets (see [Note: buckets]).

    Args:
        plan: the partition plan.
        bucket_bytes: cap of one bucket, in bytes (at least one alignment unit
            is always taken).
        alignment: boundary multiple in elements; defaults to the plan's.
        policy: ``GLOO`` all-reduces every bucket of uneven pieces over the
            data-parallel group instead (see [Note: collective policy]).

    Example:
        >>> from zeroplan.core.specs import specs_from_shapes
        >>> from zeroplan.core.strategies import flat_even
        >>> layout = plan_buckets(flat_even(specs_from_shapes([(8,), (8,)]), 2, 4), 32)
        >>> [(b.span, b.collective.value) for b in layout.buckets]
        [(Span(start=8, stop=16), 'reduce'), (Span(start=0, stop=8), 'reduce')]
    """
    check_config(
        type(bucket_bytes) is int and bucket_bytes >= 1,
        f"bucket size must be a positive number of bytes, got {bucket_bytes!r}",
    )
    alignment = plan.alignment if alignment is None else alignment
    check_config(
        type(alignment) is int and alignment >= 1,
        f"alignment must be an int >= 1 (elements), got {alignment!r}",
    )
    drafts: list[_Draft] = []
    for space in plan.spaces:
        if plan.layout == "interleaved":
            drafts.extend(_block_drafts(plan, space, policy))
            continue
        itemsize = plan.specs[space.params[0]].itemsize
        cap = max(alignment, bucket_bytes // itemsize // alignment * alignment)
        offset_of = dict(zip(space.params, space.param_offsets, strict=True))
        runs = [f for f in space.runs if f.param_span.numel]
        run = len(runs) - 1
        hi = space.numel
        while hi > 0:
            lo = max(0, round_up(hi - cap, alignment))
            bucket = Span(lo, hi)
            by_rank: dict[int, list[_Part]] = {}
            while run >= 0 and offset_of[runs[run].param] + runs[run].param_span.stop > lo:
                frag = runs[run]
                # The fragment's part of the bucket, in parameter elements (the walk guarantees an
                # overlap; spelled out rather than Span.intersect: this loop runs per fragment and bucket).
                offset, whole = offset_of[frag.param], frag.param_span
                param_span = Span(max(lo - offset, whole.start), min(hi - offset, whole.stop))
                by_rank.setdefault(frag.rank, []).append(
                    _Part(frag.param, param_span, frag.shard_span_of(param_span))
                )
                if offset + whole.start >= lo:
                    run -= 1
                else:
                    break
            pieces: list[Piece] = []
            copies: list[GradCopy] = []
            staging = 0
            for rank in sorted(by_rank):
                # Runs were walked downwards and a rank's shard follows space order (the plan
                # checks it), so reversing puts the rank's parts in shard order.
                parts = by_rank[rank][::-1]
                window = Span(parts[0].shard_span.start, parts[-1].shard_span.stop)
                if window.numel != sum(part.shard_span.numel for part in parts):  # (hot loop)
                    raise PlanInvariantError(
                        f"bucket [{lo}, {hi}) of space {space.index} is not contiguous in rank {rank}'s shard"
                    )
                pieces.append(Piece(rank, window, staging))
                for part in parts:
                    copies.append(
                        GradCopy(part.param, part.param_span, staging + part.shard_span.start - window.start)
                    )
                staging += window.numel
            require(
                staging == hi - lo, f"bucket [{lo}, {hi}) of space {space.index} covers {staging} elements"
            )
            params = tuple(sorted({c.param for c in copies}))
            sizes = [p.shard_span.numel for p in pieces]
            collective = _collective(sizes, plan.shard_size, policy)
            drafts.append(_Draft(space.index, bucket, tuple(pieces), tuple(copies), params, collective))
            hi = lo
    drafts.sort(key=_Draft.launch_key)
    buckets = tuple(
        Bucket(
            index=i,
            space=d.space,
            span=d.span,
            pieces=d.pieces,
            copies=d.copies,
            params=d.params,
            collective=d.collective,
        )
        for i, d in enumerate(drafts)
    )
    return BucketLayout(bucket_bytes=bucket_bytes, alignment=alignment, buckets=buckets, policy=policy)


def _block_drafts(plan: PartitionPlan, space: Space, policy: CollectivePolicy) -> list[_Draft]:
    """One bucket per block of an interleaved space: its staging buffer is laid out like the block.

    A block whose every rank has a piece gets :class:`BlockPieces`, a block of
    a compact space :class:`BlockCopies` too (see [Note: compact plans]).
    """
    n = plan.shard_size
    if space.block_runs:
        drafts = []
        for block, runs in zip(space.blocks, space.block_runs, strict=True):
            params = tuple(run.param for run in runs if run.numel)  # in buffer order: increasing
            if not params:
                continue  # padding and zero-size parameters only: nothing to reduce
            require(block.pieces[0] > 0, f"a block of the {space.dtype} space holds parameters in no piece")
            collective = _collective(block.pieces, n, policy)
            drafts.append(
                _Draft(space.index, block.span, BlockPieces(block), BlockCopies(runs), params, collective)
            )
        return drafts
    drafts = []
    offset_of = dict(zip(space.params, space.buffer_offsets, strict=True))
    # Non-empty fragments by their place in the full buffer; each lies inside one piece (the plan checks).
    runs = [f for f in space.runs if f.param_span.stop > f.param_span.start]
    places = [offset_of[f.param] + f.param_span.start for f in runs]
    order = sorted(range(len(runs)), key=places.__getitem__)
    position, count = 0, len(order)
    for block in space.blocks:
        span = block.span
        copies = []
        while position < count and places[order[position]] < span.stop:
            frag = runs[order[position]]
            copies.append(GradCopy(frag.param, frag.param_span, places[order[position]] - span.start))
            position += 1
        if not copies:
            continue  # padding and zero-size parameters only: nothing to reduce
        shard_starts, offsets = block.shard_starts, block.offsets
        pieces: Sequence[Piece]
        if min(block.pieces) > 0:
            pieces = BlockPieces(block)
        else:
            pieces = tuple(
                Piece(r, Span(shard_starts[r], shard_starts[r] + size), offsets[r])
                for r, size in enumerate(block.pieces)
                if size
            )
        params = tuple(sorted({c.param for c in copies}))
        collective = _collective(block.pieces, n, policy)
        drafts.append(_Draft(space.index, span, pieces, tuple(copies), params, collective))
    return drafts


def _collective(sizes: Sequence[int], shard_size: int, policy: CollectivePolicy) -> Collective:
    """How a bucket of pieces of ``sizes`` (0: no piece) is reduced (see [Note: collective policy])."""
    if type(sizes) is tuple and sizes and sizes[0] and sizes.count(sizes[0]) == len(sizes) == shard_size:
        return Collective.REDUCE_SCATTER  # equal pieces (a compact block: decided without a set)
    count = len(sizes) - list(sizes).count(0)
    if count == shard_size and len(set(sizes)) == 1:
        return Collective.REDUCE_SCATTER
    if policy is CollectivePolicy.GLOO:
        return Collective.ALL_REDUCE
    if count == 1:
        return Collective.REDUCE
    return Collective.REDUCE_SCATTER_V
