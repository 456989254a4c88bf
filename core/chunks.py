# zeroplan.core — pure planning: no torch, no I/O.
# A rank-major block's gather chunks, described by rule: O(1) per chunk, never a tuple per rank.
"""``GatherChunks``: a rank-major block cut into chunks that each lie in one rank's piece.

At stages 1 and 2 a rank-major space is gathered in chunks of at most a bucket,
each broadcast by the rank whose piece holds it ([Note: gather blocks] in
``zeroplan.core.planner``). llama-70b at world 4,096 has 8,193 such chunks; as
:class:`~zeroplan.core.space.Block` s of tuples they would hold 33.5 million
per-rank numbers, all but one of each block's pieces zero. Here a chunk is a
:class:`Block` whose per-rank sequences are given by rule (:class:`OwnerPieces`,
:class:`ChunkStarts`, :class:`OwnerOffsets`: computed tuples, see [Note: compact
plans] in :mod:`zeroplan.core.runs`), and the chunks of a block are a computed
sequence (:class:`GatherChunks`) built from the block and the cap alone. Each
equals the tuple it stands for, so every reader sees the values it saw before.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from functools import lru_cache
from itertools import accumulate, chain, repeat

from zeroplan.core.errors import PlanInvariantError
from zeroplan.core.runs import ComputedTuple
from zeroplan.core.space import Block

__all__ = ["ChunkStarts", "GatherChunks", "OwnerOffsets", "OwnerPieces", "owner_chunks"]


class OwnerPieces(ComputedTuple[int]):
    """The pieces of a chunk only its owner sends: ``size`` elements on rank ``owner``, none elsewhere.

    Example:
        >>> pieces = OwnerPieces(ranks=4, owner=2, size=5)
        >>> pieces == (0, 0, 5, 0), pieces.count(0), list(pieces.nonempty())
        (True, 3, [(2, 5)])
    """

    __slots__ = ("_hash", "owner", "ranks", "size")
    ranks: int
    owner: int
    size: int
    _hash: int | None

    def __init__(self, *, ranks: int, owner: int, size: int) -> None:
        object.__setattr__(self, "_hash", None)
        if not (type(ranks) is int and type(owner) is int and type(size) is int and 0 <= owner < ranks):
            raise PlanInvariantError(f"invalid owner pieces: rank {owner!r} of {ranks!r}, {size!r} elements")
        if size < 0:
            raise PlanInvariantError(f"rank {owner}'s chunk has {size} elements; give a non-negative count")
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "size", size)

    def __len__(self) -> int:
        return self.ranks

    def _item(self, i: int) -> int:
        return self.size if i == self.owner else 0

    def __iter__(self) -> Iterator[int]:
        return _one_of(self.ranks, self.owner, self.size, 0)

    def count(self, value: object) -> int:
        """How many pieces equal ``value`` (as ``tuple.count``, in O(1))."""
        if value == 0:
            return self.ranks if self.size == 0 else self.ranks - 1
        return int(value == self.size)

    def nonempty(self) -> Iterator[tuple[int, int]]:
        """``(rank, elements)`` of every non-empty piece: the owner's, if it has elements."""
        if self.size:
            yield self.owner, self.size

    def block_layout(self) -> tuple[bool, ComputedTuple[int], int]:
        """What :class:`Block` derives from its pieces: equal or not, offsets in the block, elements."""
        equal = self.ranks == 1 or self.size == 0
        return equal, OwnerOffsets(ranks=self.ranks, owner=self.owner, size=self.size), self.size

    def __eq__(self, other: object) -> bool:
        if type(other) is OwnerPieces:
            return (self.ranks, self.owner, self.size) == (other.ranks, other.owner, other.size) or (
                self.size == other.size == 0 and self.ranks == other.ranks
            )
        return super().__eq__(other)

    def __hash__(self) -> int:  # the tuple's (rooms of encoded gathers are cached by pieces), kept
        value = self._hash
        if value is None:
            value = hash((0,) * self.owner + (self.size,) + (0,) * (self.ranks - self.owner - 1))
            object.__setattr__(self, "_hash", value)
        return value


class OwnerOffsets(ComputedTuple[int]):
    """Where each rank's piece starts in a chunk of :class:`OwnerPieces`: 0 up to the owner, then ``size``."""

    __slots__ = ("owner", "ranks", "size")
    ranks: int
    owner: int
    size: int

    def __init__(self, *, ranks: int, owner: int, size: int) -> None:
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "size", size)

    def __len__(self) -> int:
        return self.ranks

    def _item(self, i: int) -> int:
        return self.size if i > self.owner else 0

    def __iter__(self) -> Iterator[int]:
        return chain(repeat(0, self.owner + 1), repeat(self.size, self.ranks - self.owner - 1))


class ChunkStarts(ComputedTuple[int]):
    """Where each rank stands in its shard at a chunk of ``block``'s piece of rank ``owner``.

    Ranks before the owner have sent their whole piece, the owner ``inside``
    elements of it, the ranks after nothing yet.

    Example:
        >>> ChunkStarts(block=Block(0, (5, 3, 2), (0, 0, 0)), owner=1, inside=2) == (5, 2, 0)
        True
    """

    __slots__ = ("block", "inside", "owner")
    block: Block
    owner: int
    inside: int

    def __init__(self, *, block: Block, owner: int, inside: int) -> None:
        object.__setattr__(self, "block", block)
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "inside", inside)

    def __len__(self) -> int:
        return len(self.block.pieces)

    def _item(self, i: int) -> int:
        block, owner = self.block, self.owner
        return block.shard_starts[i] + (block.pieces[i] if i < owner else self.inside if i == owner else 0)

    def __eq__(self, other: object) -> bool:
        if type(other) is ChunkStarts and (self.block, self.owner, self.inside) == (
            other.block,
            other.owner,
            other.inside,
        ):
            return True
        return super().__eq__(other)

    def __hash__(self) -> int:
        return super().__hash__()


class GatherChunks(ComputedTuple[Block]):
    """``block`` cut into chunks of at most ``cap`` elements that each lie in one rank's piece.

    The chunks are in buffer order; rank ``q``'s piece of ``p`` elements gives
    ``ceil(p / cap)`` of them. The sequence holds the block, the cap, and per
    non-empty piece its last chunk's number; its chunks are built when first
    read, each in O(1) (their per-rank sequences are rules), and kept.

    Example:
        >>> chunks = GatherChunks(block=Block(0, (5, 0, 3), (0, 0, 0)), cap=4)
        >>> len(chunks), [c.pieces for c in chunks] == [(4, 0, 0), (1, 0, 0), (0, 0, 3)]
        (3, True)
        >>> chunks[1].piece(0)
        ShardPiece(shard_span=Span(start=4, stop=5), buffer_span=Span(start=4, stop=5))
    """

    __slots__ = ("_items", "block", "cap", "ends", "owners")
    block: Block
    cap: int
    owners: tuple[int, ...]
    ends: tuple[int, ...]
    _items: tuple[Block, ...] | None

    def __init__(self, *, block: Block, cap: int) -> None:
        if type(cap) is not int or cap < 1:
            raise PlanInvariantError(f"gather chunks need a cap of at least one element, got {cap}")
        owners = tuple(q for q, piece in enumerate(block.pieces) if piece)
        counts = (-(-block.pieces[q] // cap) for q in owners)
        object.__setattr__(self, "block", block)
        object.__setattr__(self, "cap", cap)
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "ends", tuple(accumulate(counts)))
        object.__setattr__(self, "_items", None)

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def _chunk(self, k: int) -> Block:
        """Chunk ``k``, built from the numbers."""
        block, cap, n = self.block, self.cap, len(self.block.pieces)
        j = bisect_right(self.ends, k)
        q = self.owners[j]
        inside = (k - (self.ends[j - 1] if j else 0)) * cap
        size = min(cap, block.pieces[q] - inside)
        return Block(
            block.start + block.offsets[q] + inside,
            OwnerPieces(ranks=n, owner=q, size=size),  # type: ignore[arg-type]
            ChunkStarts(block=block, owner=q, inside=inside),  # type: ignore[arg-type]
        )

    def _tuple(self) -> tuple[Block, ...]:
        items = self._items
        if items is None:
            items = tuple(self._chunk(k) for k in range(len(self)))
            object.__setattr__(self, "_items", items)  # (a cache: the value never changes)
        return items

    def _item(self, i: int) -> Block:
        return self._tuple()[i]

    def __iter__(self) -> Iterator[Block]:
        return iter(self._tuple())

    def __eq__(self, other: object) -> bool:
        same = type(other) is GatherChunks and (self.block, self.cap) == (other.block, other.cap)
        return same or super().__eq__(other)

    def __hash__(self) -> int:
        return super().__hash__()


def _one_of(ranks: int, owner: int, value: int, other: int) -> Iterator[int]:
    """``other`` for every rank but ``owner``, which has ``value`` (iterated in C)."""
    return chain(repeat(other, owner), (value,), repeat(other, ranks - owner - 1))


@lru_cache(maxsize=256)
def owner_chunks(block: Block, cap: int) -> GatherChunks:
    """``block`` cut into chunks of at most ``cap`` elements that each lie in one rank's piece.

    Every chunk is a :class:`Block` whose only non-empty piece is its owner's, so it is rebuilt by one
    broadcast from that owner; in buffer order. ``shard_starts`` say where each rank stands in its
    shard at the chunk (ranks before the owner have sent their whole piece). See [Note: gather blocks]
    in ``zeroplan.core.planner``; the chunks are described by rule (:class:`GatherChunks`).

    Example:
        >>> [c.pieces for c in owner_chunks(Block(0, (5, 3), (0, 0)), 4)]
        [(4, 0), (1, 0), (0, 3)]
        >>> owner_chunks(Block(0, (5, 3), (0, 0)), 4)[1].piece(0)
        ShardPiece(shard_span=Span(start=4, stop=5), buffer_span=Span(start=4, stop=5))
    """
    return GatherChunks(block=block, cap=cap)
