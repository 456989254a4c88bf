"""Gather chunks described by rule ([Note: gather blocks]) equal the blocks of tuples they stand for."""

from __future__ import annotations

import pickle

import pytest

from zeroplan.core import PlanInvariantError
from zeroplan.core.chunks import GatherChunks, OwnerPieces, owner_chunks
from zeroplan.core.computed import Repeated
from zeroplan.core.space import Block


def tuple_chunks(block: Block, cap: int) -> tuple[Block, ...]:
    """The chunks as blocks of tuples (how they were built before they were rules)."""
    n = len(block.pieces)
    chunks = []
    for q, piece in enumerate(block.pieces):
        base = block.start + block.offsets[q]
        for inside in range(0, piece, cap):
            size = min(cap, piece - inside)
            pieces = tuple(size if r == q else 0 for r in range(n))
            starts = tuple(
                block.shard_starts[r] + (block.pieces[r] if r < q else inside if r == q else 0)
                for r in range(n)
            )
            chunks.append(Block(base + inside, pieces, starts))
    return tuple(chunks)


@pytest.mark.parametrize(
    ("pieces", "cap"),
    [((5, 3), 4), ((17, 0, 257, 1), 16), ((0, 0, 9), 9), ((1,), 1), ((128, 128, 0, 300), 128), ((0, 0), 4)],
)
def test_chunks_by_rule_equal_the_blocks_of_tuples(pieces, cap):
    block = Block(7, pieces, (0,) * len(pieces))
    chunks, expected = owner_chunks(block, cap), tuple_chunks(block, cap)
    assert type(chunks) is GatherChunks and chunks == expected and expected == chunks
    assert len(chunks) == len(expected) and hash(chunks) == hash(expected)
    for got, want in zip(chunks, expected, strict=True):
        assert type(got.pieces) is OwnerPieces and got == want
        assert (got.start, got.numel, got.equal, got.gather) == (
            want.start,
            want.numel,
            want.equal,
            want.gather,
        )
        assert tuple(got.offsets) == want.offsets and tuple(got.shard_starts) == want.shard_starts
        assert list(got.nonempty_pieces()) == list(want.nonempty_pieces())
        assert got.pieces.count(0) == want.pieces.count(0) and got.pieces.count(
            got.pieces[0]
        ) == want.pieces.count(want.pieces[0])
        assert [got.piece(r) for r in range(len(pieces))] == [want.piece(r) for r in range(len(pieces))]
    assert chunks[-1:] == expected[-1:] and pickle.loads(pickle.dumps(chunks)) == expected


def test_rules_refuse_what_they_cannot_stand_for():
    with pytest.raises(PlanInvariantError):
        owner_chunks(Block(0, (4,), (0,)), 0)
    with pytest.raises(PlanInvariantError):
        OwnerPieces(ranks=2, owner=2, size=1)
    with pytest.raises(PlanInvariantError):
        Repeated(count=-1, value=0)
    assert Repeated(count=3, value=2) == (2, 2, 2) and Repeated(count=0, value=1) == Repeated(
        count=0, value=2
    )
