# zeroplan.core — pure planning: no torch, no I/O.
# One dtype space's layout: fragments, the full buffer's blocks, every offset derived and checked.
"""``Space``: where the trainable elements of one dtype live, in shards and in the full buffer.

[Note: layout]
Trainable parameters of one dtype form a *space*. Three coordinates describe it:

* the **space coordinate**: the parameters concatenated in index order;
* the **shard coordinate** of rank ``r``: where rank ``r``'s fragments lie in
  its shard (``shard_numel[r]`` elements allocated, a multiple of the alignment);
* the **buffer coordinate**: the full parameter buffer every rank holds, which
  ``param.data`` views (so every parameter must be one contiguous run of it).

The full buffer is a sequence of **blocks**. A block holds one *piece* of
every rank's shard, in rank order, and rank ``r``'s shard is its pieces of all
blocks, in block order. Two layouts exist (``PartitionPlan.layout``):

* ``rank_major``: one block whose pieces are exactly the ranks' owned
  elements, packed in parameter order (a split parameter ends one rank's piece
  and starts the next's). The rank's shard is one contiguous region of the
  buffer, so its fp32 master (fp32 parameters) and, at stage 1, its reduced
  gradients are views of the full buffers.
* ``interleaved``: blocks cut in backward order and capped like gradient
  buckets (see :mod:`zeroplan.core.layout`). Each block is reduced by one
  collective straight from its staging copy and gathered by one collective into
  the full buffer; with equal pieces these are one ``reduce_scatter`` and one
  ``all_gather``. Pieces may contain padding (zeros that every rank steps and
  gathers, never a parameter's element). The shard is not contiguous in the
  buffer, so reduced gradients are a separate tensor, and so is the fp32 master
  of bf16/fp16 parameters; fp32 parameters are stepped in place, one window per
  run of pieces that follow each other in the buffer (``ZeroPlan.master_in_params``).

A block's per-rank pieces and shard starts are tuples, or sequences given by
rule that equal them (a gather chunk's: [Note: gather blocks] in
``zeroplan.core.planner``; equal shard starts: ``zeroplan.core.computed.Repeated``).

Strategies only decide ownership (or, for interleaved layouts, the blocks too);
:class:`Space` derives every offset and checks that fragments lie inside their
rank's pieces, do not overlap, and that each parameter is contiguous in the
buffer.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate, pairwise
from typing import NamedTuple, Protocol, cast

from zeroplan.core.comm import Collective
from zeroplan.core.computed import Repeated
from zeroplan.core.errors import PlanInvariantError, require
from zeroplan.core.span import Span, round_up
from zeroplan.core.specs import ParamSpec

__all__ = ["Block", "Fragment", "FragmentOverlap", "ShardPiece", "Space", "build_space"]


@dataclass(frozen=True, slots=True)
class Fragment:
    """A contiguous element range of one flattened parameter in one rank's shard.

    Attributes:
        param: index of the parameter.
        rank: shard rank that owns the range.
        param_span: the range, in the flattened parameter's elements.
        shard_offset: where the range starts in the owner's shard of the
            parameter's dtype space.
    """

    param: int
    rank: int
    param_span: Span
    shard_offset: int

    @property
    def shard_span(self) -> Span:
        """The range in the owner's shard coordinate."""
        return Span(self.shard_offset, self.shard_offset + self.param_span.numel)

    def shard_span_of(self, param_span: Span) -> Span:
        """Where elements ``param_span`` of the parameter (inside this fragment) lie in the owner's shard.

        Example:
            >>> Fragment(param=3, rank=1, param_span=Span(10, 20), shard_offset=4).shard_span_of(Span(12, 15))
            Span(start=6, stop=9)
        """
        if not self.param_span.contains(param_span):  # (hot loop: no message unless it fails)
            raise PlanInvariantError(f"{param_span} is not inside fragment {self.param_span} of {self.param}")
        return param_span.shift(self.shard_offset - self.param_span.start)

    def param_span_of(self, shard_span: Span) -> Span:
        """The elements of the flattened parameter at ``shard_span`` of the shard (inside this fragment).

        Example:
            >>> Fragment(param=3, rank=1, param_span=Span(10, 20), shard_offset=4).param_span_of(Span(6, 9))
            Span(start=12, stop=15)
        """
        if not self.shard_span.contains(shard_span):  # (hot loop: no message unless it fails)
            raise PlanInvariantError(f"{shard_span} is not inside the shard span {self.shard_span} of {self}")
        return shard_span.shift(self.param_span.start - self.shard_offset)


class FragmentOverlap(NamedTuple):
    """The part of one fragment that falls in a chunk of its owner's shard (:meth:`Space.fragments_in`).

    Attributes:
        param: index of the parameter.
        shard_span: the overlap, in the owner's shard coordinate.
        chunk_span: the overlap relative to the chunk's start: slice the chunk with it.
        param_span: the overlap, in the flattened parameter's elements: slice the parameter with it.
    """

    param: int
    shard_span: Span
    chunk_span: Span
    param_span: Span


class ShardPiece(NamedTuple):
    """One rank's piece of one block: the same elements in its shard and in the full buffer."""

    shard_span: Span
    buffer_span: Span


class _PieceRule(Protocol):
    """A block's pieces given by a rule rather than a tuple (:class:`~zeroplan.core.chunks.OwnerPieces`):
    a sequence equal to the tuple it stands for, which derives the block's layout in O(1)."""

    def block_layout(self) -> tuple[bool, Sequence[int], int]:
        """``(equal, offsets, numel)`` of a block of these pieces."""
        ...

    def nonempty(self) -> Iterator[tuple[int, int]]:
        """``(rank, elements)`` of every non-empty piece, in rank order."""
        ...


@dataclass(frozen=True, slots=True)
class Block:
    """A segment of the full buffer: one piece of every rank's shard, in rank order (see [Note: layout]).

    Attributes:
        start: where the block starts in the full buffer.
        pieces: per rank, the elements of its piece (padding included). A tuple, or
            for a gather chunk a sequence given by rule that equals the tuple
            (:mod:`zeroplan.core.chunks`; see [Note: gather blocks]).
        shard_starts: per rank, where its piece starts in its shard (a tuple, or a
            sequence given by rule for a gather chunk).
        numel: elements of the block in the full buffer (derived).
        offsets: per rank, where its piece starts inside the block (derived).
        equal: whether every rank's piece has the same size (one ``all_gather``
            rebuilds the block; derived).
    """

    start: int
    pieces: tuple[int, ...]
    shard_starts: tuple[int, ...]
    numel: int = field(init=False, repr=False, compare=False)
    offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    equal: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Derived once: plans of thousands of ranks ask for pieces by the million.
        pieces = self.pieces
        if type(pieces) is not tuple:  # pieces by rule (a gather chunk: zeroplan.core.chunks)
            equal, offsets, numel = cast(_PieceRule, pieces).block_layout()
            object.__setattr__(self, "equal", equal)
            object.__setattr__(self, "offsets", offsets)
            object.__setattr__(self, "numel", numel)
            return
        equal = bool(pieces) and pieces.count(pieces[0]) == len(pieces)
        object.__setattr__(self, "equal", equal)
        if equal:  # blocks of one piece size share their offsets (a stage-3 plan has hundreds)
            object.__setattr__(self, "offsets", _even_offsets(pieces[0], len(pieces)))
            object.__setattr__(self, "numel", pieces[0] * len(pieces))
            return
        bounds = (0, *accumulate(pieces))
        object.__setattr__(self, "offsets", bounds[:-1])
        object.__setattr__(self, "numel", bounds[-1])

    @property
    def span(self) -> Span:
        """The block's range of the full buffer."""
        return Span(self.start, self.start + self.numel)

    @property
    def gather(self) -> Collective:
        """The collective that rebuilds the block: ``all_gather`` for equal pieces, else broadcasts."""
        return Collective.ALL_GATHER if self.equal else Collective.BROADCAST

    def nonempty_pieces(self) -> Iterator[tuple[int, int]]:
        """``(rank, elements)`` of every non-empty piece, in rank order (a gather chunk has one).

        Example:
            >>> list(Block(start=0, pieces=(4, 0, 2), shard_starts=(0, 0, 0)).nonempty_pieces())
            [(0, 4), (2, 2)]
        """
        pieces = self.pieces
        if type(pieces) is not tuple:
            return cast(_PieceRule, pieces).nonempty()
        return ((q, size) for q, size in enumerate(pieces) if size)

    def offset_in_block(self, rank: int) -> int:
        """Where rank ``rank``'s piece starts inside the block."""
        return self.offsets[rank]

    def piece(self, rank: int) -> ShardPiece:
        """Rank ``rank``'s piece, in its shard and in the full buffer.

        Example:
            >>> Block(start=8, pieces=(4, 4), shard_starts=(2, 2)).piece(1)
            ShardPiece(shard_span=Span(start=2, stop=6), buffer_span=Span(start=12, stop=16))
        """
        at = self.start + self.offsets[rank]
        size = self.pieces[rank]
        return ShardPiece(Span(self.shard_starts[rank], self.shard_starts[rank] + size), Span(at, at + size))


@lru_cache(maxsize=64)
def _even_offsets(piece: int, count: int) -> tuple[int, ...]:
    """Where each of ``count`` pieces of ``piece`` elements starts in their block."""
    return tuple(range(0, piece * count, piece)) if piece else (0,) * count


class ParamRun(Protocol):
    """One parameter's fragments in a block of a compact space, as the space sees them (the
    type is :class:`~zeroplan.core.runs.FragmentRun`, which builds spaces and so is not imported here)."""

    param: int
    numel: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Space:
    """Layout of the trainable parameters of one dtype (see [Note: layout]).

    Attributes:
        index: position in ``PartitionPlan.spaces``.
        dtype: the dtype of every parameter in the space.
        params: indices of its parameters, increasing.
        param_offsets: start of each parameter (same order as ``params``) in
            the space coordinate.
        numel: elements in the space (parameters only).
        owned: elements of parameters each shard rank owns.
        shard_numel: each rank's shard allocation, a multiple of the alignment.
        blocks: the full buffer's blocks, in buffer order.
        buffer_numel: elements of the full buffer (``numel`` plus padding).
        buffer_offsets: start of each parameter (same order as ``params``) in
            the full buffer.
        runs: every fragment of the space, parameters in index order.
        by_rank: per rank, its fragments in shard order.
        block_runs: per block, the :class:`~zeroplan.core.runs.FragmentRun` of each of
            its parameters in buffer order, when the space is compact (see
            [Note: compact plans] in :mod:`zeroplan.core.runs`); empty otherwise.
            ``runs`` and ``by_rank`` are then computed sequences, equal to tuples.
    """

    index: int
    dtype: str
    params: tuple[int, ...]
    param_offsets: tuple[int, ...]
    numel: int
    owned: tuple[int, ...]
    shard_numel: tuple[int, ...]
    blocks: tuple[Block, ...]
    buffer_numel: int
    buffer_offsets: tuple[int, ...]
    runs: Sequence[Fragment]
    by_rank: tuple[Sequence[Fragment], ...]
    block_runs: tuple[tuple[ParamRun, ...], ...] = field(default=(), repr=False, compare=False)
    _even_extent: int = field(init=False, repr=False, compare=False)
    _uneven: tuple[Block, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Derived once for :meth:`extent`: a report of 4,096 ranks asks it of every rank, and an
        # interleaved space has thousands of blocks, each of equal pieces (the same on every rank).
        uneven = tuple(block for block in self.blocks if not block.equal)
        even = sum(block.pieces[0] for block in self.blocks if block.equal)
        object.__setattr__(self, "_even_extent", even)
        object.__setattr__(self, "_uneven", uneven)

    def _position(self, param: int) -> int:
        position = bisect_left(self.params, param)
        require(
            position < len(self.params) and self.params[position] == param,
            f"parameter {param} is not in the {self.dtype} space",
        )
        return position

    def param_offset(self, param: int) -> int:
        """Space-coordinate start of parameter ``param``."""
        return self.param_offsets[self._position(param)]

    def buffer_offset(self, param: int) -> int:
        """Full-buffer start of parameter ``param``."""
        return self.buffer_offsets[self._position(param)]

    @property
    def shard_is_region(self) -> bool:
        """Whether every rank's shard is one contiguous region of the full buffer (``rank_major``)."""
        return len(self.blocks) == 1

    def extent(self, rank: int) -> int:
        """Elements of rank ``rank``'s shard that lie in the full buffer (its pieces, padding included)."""
        return self._even_extent + sum(block.pieces[rank] for block in self._uneven)

    def pieces_of(self, rank: int) -> tuple[ShardPiece, ...]:
        """Rank ``rank``'s non-empty pieces, in shard (and buffer) order."""
        return tuple(block.piece(rank) for block in self.blocks if block.pieces[rank])

    def buffer_span(self, rank: int, span: Span) -> Span:
        """Where elements ``span`` of rank ``rank``'s shard lie in the full buffer, if contiguous there.

        ``span`` may run over several of the rank's pieces when each follows the
        last in the full buffer (as at shard size 1).

        Raises:
            PlanInvariantError: ``span`` is empty, runs past the rank's pieces, or into a piece that
                does not follow the last one in the full buffer.
        """
        k = bisect_right(self.blocks, span.start, key=lambda b: b.shard_starts[rank]) - 1
        require(k >= 0 and span.numel > 0, f"rank {rank}'s shard has no piece holding {span}")
        piece = self.blocks[k].piece(rank)
        offset, stop = piece.buffer_span.start - piece.shard_span.start, piece.shard_span.stop
        while stop < span.stop:
            k += 1
            require(k < len(self.blocks), f"{span} runs past rank {rank}'s shard of the {self.dtype} space")
            piece = self.blocks[k].piece(rank)
            if piece.shard_span.numel == 0:
                continue
            require(
                piece.buffer_span.start - piece.shard_span.start == offset,
                f"{span} of rank {rank}'s shard runs into its piece {piece.shard_span} of the {self.dtype} "
                "space, which does not follow the last one in the full buffer",
            )
            stop = piece.shard_span.stop
        return Span(span.start + offset, span.stop + offset)

    def region(self, rank: int) -> Span:
        """Rank ``rank``'s region of the full buffer (``rank_major`` layouts only).

        Raises:
            PlanInvariantError: the layout is interleaved (use :meth:`pieces_of`).
        """
        require(self.shard_is_region, f"the {self.dtype} space is interleaved: its shards are not regions")
        return self.blocks[0].piece(rank).buffer_span

    def fragments_in(self, rank: int, chunk: Span) -> tuple[FragmentOverlap, ...]:
        """Rank ``rank``'s fragments overlapping ``chunk`` of its shard, clipped to it, in shard order.

        Empty fragments (zero-size parameters) overlap nothing. Costs
        ``O(log fragments + overlaps)``.

        Args:
            rank: shard rank.
            chunk: a span of rank ``rank``'s shard coordinate, inside its
                allocation ``[0, shard_numel[rank])``.

        Raises:
            PlanInvariantError: ``rank`` or ``chunk`` is out of range.

        Example:
            >>> from zeroplan.core.partition import plan_from_assignment
            >>> from zeroplan.core.specs import specs_from_shapes
            >>> plan = plan_from_assignment(
            ...     specs_from_shapes([(4,), (6,)]), 1, 1, "mine", [(0, Span(0, 4), 0), (1, Span(0, 6), 0)]
            ... )
            >>> for part in plan.spaces[0].fragments_in(0, Span(2, 7)):
            ...     print(part.param, part.shard_span, part.chunk_span, part.param_span)
            0 Span(start=2, stop=4) Span(start=0, stop=2) Span(start=2, stop=4)
            1 Span(start=4, stop=7) Span(start=2, stop=5) Span(start=0, stop=3)
        """
        require(0 <= rank < len(self.owned), f"rank {rank} outside 0..{len(self.owned) - 1}")
        require(
            chunk.stop <= self.shard_numel[rank],
            f"chunk {chunk} is beyond rank {rank}'s shard of {self.shard_numel[rank]} elements "
            f"({self.dtype} space)",
        )
        frags = self.by_rank[rank]
        # The last fragment starting at or before the chunk holds its first element, if any.
        first = bisect_right(frags, chunk.start, key=lambda f: f.shard_offset)
        overlaps = []
        for frag in frags[max(first - 1, 0) :]:
            if frag.shard_offset >= chunk.stop:
                break
            shard_span = frag.shard_span.intersect(chunk)
            if shard_span is not None:
                overlaps.append(
                    FragmentOverlap(
                        frag.param, shard_span, shard_span.shift(-chunk.start), frag.param_span_of(shard_span)
                    )
                )
        return tuple(overlaps)


def blocks_of(
    pieces: Sequence[Sequence[int]] | None, owned: Sequence[int], n: int, dtype: str
) -> tuple[Block, ...]:
    """The blocks of a layout: ``pieces`` per block and rank, or one block of ``owned`` (rank-major).

    (Thousands of blocks of thousands of ranks: no Python step per piece.)
    """
    if pieces is None:
        return (Block(0, tuple(owned), (0,) * n),)
    blocks = []
    start, shard = 0, cast(Sequence[int], (0,) * n)
    checked: dict[int, int] = {}  # id of a tuple of pieces already checked (equal blocks share one) -> sum
    for sizes in pieces:
        sizes = tuple(sizes)
        total = checked.get(id(sizes))
        if total is None:
            if len(sizes) != n or not set(map(type, sizes)) <= {int} or (sizes and min(sizes) < 0):
                raise PlanInvariantError(
                    f"a block of the {dtype} space has pieces {sizes}; give {n} non-negative element counts"
                )
            total = checked[id(sizes)] = sum(sizes)
        blocks.append(Block(start, sizes, shard))
        start += total
        if shard.count(shard[0]) == n and sizes.count(sizes[0]) == n:  # equal pieces from one offset
            shard = Repeated(count=n, value=shard[0] + sizes[0])  # (one number, not one per rank)
        else:
            shard = tuple(map(operator.add, shard, sizes))
    return tuple(blocks)


def build_space(
    specs: Sequence[ParamSpec],
    fragments: Sequence[Sequence[Fragment]],
    shard_size: int,
    alignment: int,
    index: int,
    dtype: str,
    pieces: Sequence[Sequence[int]] | None,
) -> Space:
    """Derive and check the layout of the ``dtype`` space (see [Note: layout]).

    Args:
        specs: every parameter of the plan.
        fragments: per parameter, its fragments (validated to tile it).
        shard_size: ranks in the shard group.
        alignment: shard allocations are multiples of it.
        index: the space's position in the plan.
        dtype: the space's dtype.
        pieces: per block, per rank, its piece's elements (interleaved), or
            ``None`` for the rank-major layout, whose fragments must be packed
            in parameter order from 0.

    Raises:
        PlanInvariantError: a fragment lies outside its rank's pieces, two
            overlap, or a parameter is not contiguous in the full buffer.
    """
    n = shard_size
    params = tuple(s.index for s in specs if s.trainable and s.dtype == dtype)
    param_offsets: list[int] = []
    total = 0
    for p in params:
        param_offsets.append(total)
        total += specs[p].numel
    runs = tuple(f for p in params for f in fragments[p])
    owned = [0] * n
    for frag in runs:
        owned[frag.rank] += frag.param_span.stop - frag.param_span.start
    if pieces is None:
        packed = [0] * n  # rank-major: each rank's fragments, in parameter order, tile [0, owned)
        for frag in runs:
            if frag.shard_offset != packed[frag.rank]:  # (hot loop: no message unless it fails)
                raise PlanInvariantError(
                    f"parameter {frag.param} ({specs[frag.param].name!r}): fragment {frag.param_span} on "
                    f"rank {frag.rank} starts at shard offset {frag.shard_offset}, expected "
                    f"{packed[frag.rank]}; each rank's fragments must be packed in parameter order "
                    "(build plans with plan_from_assignment)"
                )
            packed[frag.rank] += frag.param_span.numel
    blocks = blocks_of(pieces, owned, n, dtype)
    starts = list(zip(*(b.shard_starts for b in blocks), strict=True))  # per rank, its blocks' shard starts
    by_rank: list[list[Fragment]] = [[] for _ in range(n)]
    for frag in runs:
        by_rank[frag.rank].append(frag)
    for r, frags in enumerate(by_rank):
        frags.sort(key=lambda f: f.shard_offset)
        for before, after in pairwise(frags):
            span = before.param_span  # (hot loop: arithmetic rather than Span objects)
            if before.shard_offset + span.stop - span.start > after.shard_offset:
                raise PlanInvariantError(
                    f"fragments of parameters {before.param} and {after.param} overlap in rank {r}'s "
                    f"shard ({dtype} space): {before.shard_span} and {after.shard_span}"
                )

    def buffer_at(frag: Fragment, numel: int) -> int:
        """Full-buffer position of the first of the fragment's ``numel`` elements."""
        rank = frag.rank
        block = blocks[max(bisect_right(starts[rank], frag.shard_offset) - 1, 0)]
        inside = frag.shard_offset - block.shard_starts[rank]
        if not 0 <= inside <= block.pieces[rank] - numel:
            raise PlanInvariantError(
                f"parameter {frag.param} ({specs[frag.param].name!r}): fragment {frag.param_span} at "
                f"shard offset {frag.shard_offset} of rank {frag.rank} does not lie inside one of its "
                f"pieces ({dtype} space)"
            )
        return block.start + block.offsets[rank] + inside

    buffer_offsets: list[int] = []
    for p in params:
        start = position = -1
        for frag in fragments[p]:
            numel = frag.param_span.stop - frag.param_span.start
            at = buffer_at(frag, numel)
            if start < 0:
                start = position = at
            if at != position:  # (hot loop: no message unless it fails)
                raise PlanInvariantError(
                    f"parameter {p} ({specs[p].name!r}) would not be contiguous in the full buffer: "
                    f"its fragment on rank {frag.rank} starts at {at}, expected {position}. A split "
                    "parameter must end one piece and start the next (see [Note: layout])"
                )
            position += numel
        buffer_offsets.append(start)
    # A rank's shard starts accumulate its pieces: its last block's start and piece are its extent.
    extents = map(operator.add, blocks[-1].shard_starts, blocks[-1].pieces) if blocks else [0] * n
    return Space(
        index=index,
        dtype=dtype,
        params=params,
        param_offsets=tuple(param_offsets),
        numel=total,
        owned=tuple(owned),
        shard_numel=tuple(round_up(e, alignment) for e in extents),
        blocks=blocks,
        buffer_numel=sum(b.numel for b in blocks),
        buffer_offsets=tuple(buffer_offsets),
        runs=runs,
        by_rank=tuple(tuple(frags) for frags in by_rank),
    )
