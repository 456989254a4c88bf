"""Gradient buckets: a hand-checked layout and the tiling invariants."""

from __future__ import annotations

import dataclasses

import pytest

from zeroplan.core import (
    Bucket,
    BucketLayout,
    Collective,
    ConfigError,
    GradCopy,
    ParamSpec,
    Piece,
    PlanInvariantError,
    Span,
    flat_even,
    greedy_whole,
    lpt_whole,
    plan_buckets,
    specs_from_shapes,
)

MIXED = (
    ParamSpec(index=0, name="a", shape=(5,), dtype="fp32"),
    ParamSpec(index=1, name="b", shape=(7,), dtype="fp32"),
    ParamSpec(index=2, name="c", shape=(10,), dtype="bf16"),
)


def test_hand_checked_layout_with_all_three_reducing_collectives():
    # fp32 space [a a a a a b | b b b b b b] split 6/6; bf16 space [c*5 | c*5] split 5/5.
    # 16-byte cap: 4 fp32 elements, 8 bf16 elements; buckets are cut from the end.
    layout = plan_buckets(flat_even(MIXED, 2, 1), 16)
    assert layout.bucket_bytes == 16 and layout.alignment == 1
    summary = [(b.index, b.space, b.span, b.params, b.collective) for b in layout.buckets]
    # Launch order: by the lowest parameter a bucket needs, highest first (backward order).
    assert summary == [
        (0, 1, Span(2, 10), (2,), Collective.REDUCE_SCATTER_V),  # c: 3 elements on r0, 5 on r1
        (1, 1, Span(0, 2), (2,), Collective.REDUCE),  # c[0:2]: rank 0 only
        (2, 0, Span(8, 12), (1,), Collective.REDUCE),  # b[3:7]: rank 1 only
        (3, 0, Span(4, 8), (0, 1), Collective.REDUCE_SCATTER),  # 2 + 2 elements
        (4, 0, Span(0, 4), (0,), Collective.REDUCE),  # a[0:4]: rank 0 only
    ]
    rs = layout.buckets[3]
    assert rs.pieces == (Piece(0, Span(4, 6), 0), Piece(1, Span(0, 2), 2))
    assert rs.copies == (
        GradCopy(0, Span(4, 5), 0),  # a[4]     -> staging[0]
        GradCopy(1, Span(0, 1), 1),  # b[0]     -> staging[1] (still rank 0's shard)
        GradCopy(1, Span(1, 3), 2),  # b[1:3]   -> staging[2:4] (rank 1's piece)
    )
    assert rs.piece_sizes(2) == (2, 2) and rs.piece_of(1) == Piece(1, Span(0, 2), 2)
    assert rs.pieces[1].staging_span == Span(2, 4)
    v = layout.buckets[0]
    assert v.pieces == (Piece(0, Span(2, 5), 0), Piece(1, Span(0, 5), 3))
    assert v.copies == (GradCopy(2, Span(2, 5), 0), GradCopy(2, Span(5, 10), 3))
    assert v.piece_sizes(2) == (3, 5)
    reduce = layout.buckets[2]
    assert reduce.pieces == (Piece(1, Span(2, 6), 0),) and reduce.copies == (GradCopy(1, Span(3, 7), 0),)
    assert reduce.piece_sizes(2) == (0, 4) and reduce.piece_of(0) is None
    assert layout.param_buckets == ((3, 4), (2, 3), (0, 1))
    assert layout.buckets_of(1) == (2, 3) and layout.buckets_of(99) == ()


def test_alignment_puts_bucket_boundaries_on_multiples():
    p = flat_even(specs_from_shapes([(17, 257)]), 4, 128)
    layout = plan_buckets(p, 1000 * 4)  # 1000 fp32 elements -> cap 896 = 7 units
    spans = [b.span for b in layout.buckets]
    assert spans == [Span(3584, 4369), Span(2688, 3584), Span(1792, 2688), Span(896, 1792), Span(0, 896)]
    # Shards: r0 [0, 1024), r1 [1024, 2176), r2 [2176, 3328), r3 [3328, 4369).
    assert [(b.collective, b.piece_sizes(4)) for b in layout.buckets] == [
        (Collective.REDUCE, (0, 0, 0, 785)),
        (Collective.REDUCE_SCATTER_V, (0, 0, 640, 256)),
        (Collective.REDUCE_SCATTER_V, (0, 384, 512, 0)),
        (Collective.REDUCE_SCATTER_V, (128, 768, 0, 0)),
        (Collective.REDUCE, (896, 0, 0, 0)),
    ]


def test_a_cap_below_one_unit_still_takes_one_alignment_unit():
    layout = plan_buckets(flat_even(specs_from_shapes([(20,)]), 2, 8), 1)
    assert [b.span for b in layout.buckets] == [Span(16, 20), Span(8, 16), Span(0, 8)]


def test_an_explicit_alignment_overrides_the_plans():
    p = flat_even(specs_from_shapes([(12,)]), 2, 1)
    assert [b.span for b in plan_buckets(p, 20).buckets] == [Span(7, 12), Span(2, 7), Span(0, 2)]
    assert [b.span for b in plan_buckets(p, 20, 4).buckets] == [Span(8, 12), Span(4, 8), Span(0, 4)]


def _check_tiling(p, layout):
    """Each rank's pieces tile its shard once; each parameter's copies tile it once."""
    itemsize = {s.index: p.specs[s.params[0]].itemsize for s in p.spaces}
    for space in p.spaces:
        for rank in range(p.shard_size):
            got = sorted(
                (
                    piece.shard_span
                    for b in layout.buckets
                    if b.space == space.index
                    for piece in b.pieces
                    if piece.rank == rank
                ),
                key=lambda span: span.start,
            )
            position = 0
            for span in got:
                assert span.start == position and span.numel > 0
                position = span.stop
            assert position == space.owned[rank]
    for spec in p.specs:
        if not spec.trainable or spec.numel == 0:
            continue
        spans = sorted(
            (c.param_span for b in layout.buckets for c in b.copies if c.param == spec.index),
            key=lambda span: span.start,
        )
        position = 0
        for span in spans:
            assert span.start == position
            position = span.stop
        assert position == spec.numel
    for b in layout.buckets:
        staging = 0
        for piece in b.pieces:
            assert piece.staging_offset == staging
            staging += piece.shard_span.numel
        assert staging == b.numel
        assert sum(c.param_span.numel for c in b.copies) == b.numel
        cap = max(
            layout.alignment, layout.bucket_bytes // itemsize[b.space] // layout.alignment * layout.alignment
        )
        assert b.numel <= cap
        assert b.span.start % layout.alignment == 0
        ranks = [piece.rank for piece in b.pieces]
        assert ranks == sorted(set(ranks))
    lowest = [b.params[0] for b in layout.buckets]
    assert lowest == sorted(lowest, reverse=True)


@pytest.mark.parametrize("strategy", [flat_even, greedy_whole, lpt_whole])
@pytest.mark.parametrize(
    ("n", "alignment", "bucket_bytes"), [(3, 8, 300), (4, 128, 4096), (5, 1, 37), (1, 4, 64)]
)
def test_pieces_and_copies_tile_shards_and_parameters_exactly_once(strategy, n, alignment, bucket_bytes):
    specs = (
        ParamSpec(index=0, name="emb", shape=(17, 257), dtype="bf16"),
        ParamSpec(index=1, name="empty", shape=(0,), dtype="bf16"),
        ParamSpec(index=2, name="bias", shape=(3,), dtype="fp32"),
        ParamSpec(index=3, name="frozen", shape=(11,), dtype="bf16", trainable=False),
        ParamSpec(index=4, name="proj", shape=(257, 17), dtype="bf16"),
        ParamSpec(index=5, name="scale", shape=(), dtype="fp32"),
    )
    p = strategy(specs, n, alignment)
    _check_tiling(p, plan_buckets(p, bucket_bytes))


def test_whole_parameter_plans_need_uneven_collectives():
    p = lpt_whole(specs_from_shapes([(6,), (2,), (4,)]), 3, 1)  # r0: 6, r1: 4, r2: 2
    layout = plan_buckets(p, 12 * 4)  # one bucket of everything
    (bucket,) = layout.buckets
    assert bucket.collective is Collective.REDUCE_SCATTER_V
    assert bucket.piece_sizes(3) == (6, 4, 2)
    # The staging buffer is laid out rank by rank, not in parameter order.
    assert bucket.copies == (
        GradCopy(0, Span(0, 6), 0),
        GradCopy(2, Span(0, 4), 6),
        GradCopy(1, Span(0, 2), 10),
    )


def test_one_rank_group_uses_reduce_scatter():
    layout = plan_buckets(flat_even(specs_from_shapes([(17, 257)]), 1, 128), 2**20)
    assert [b.collective for b in layout.buckets] == [Collective.REDUCE_SCATTER]


def test_zero_size_and_frozen_parameters_are_in_no_bucket():
    specs = specs_from_shapes([(4,), (0,), (4,)], trainable=[True, True, False])
    layout = plan_buckets(flat_even(specs, 2, 1), 1024)
    assert layout.buckets_of(1) == () and layout.buckets_of(2) == () and layout.buckets_of(0) == (0,)


@pytest.mark.parametrize(
    ("bucket_bytes", "alignment", "needle"),
    [
        (0, None, "bucket size must be a positive number of bytes, got 0"),
        (-4, None, "got -4"),
        (1.5, None, "got 1.5"),
        (1024, 0, "alignment must be an int >= 1 (elements), got 0"),
        (1024, -8, "got -8"),
    ],
)
def test_bad_arguments_are_config_errors_naming_the_value(bucket_bytes, alignment, needle):
    p = flat_even(specs_from_shapes([(17, 257)]), 2, 4)
    with pytest.raises(ConfigError) as info:
        plan_buckets(p, bucket_bytes, alignment)
    assert needle in str(info.value)


def test_layout_values_are_frozen_and_validated():
    layout = plan_buckets(flat_even(MIXED, 2, 1), 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.bucket_bytes = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.buckets[0].collective = Collective.REDUCE  # type: ignore[misc]
    with pytest.raises(PlanInvariantError, match="bucket at position 1 has index 0"):
        BucketLayout(bucket_bytes=16, alignment=1, buckets=(layout.buckets[0], layout.buckets[0]))
    assert isinstance(layout.buckets[0], Bucket)


def test_fingerprint_depends_on_the_layout():
    p = flat_even(MIXED, 2, 1)
    a, b, c = plan_buckets(p, 16), plan_buckets(p, 16), plan_buckets(p, 32)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    assert plan_buckets(p, 16, 2).fingerprint() != a.fingerprint()
