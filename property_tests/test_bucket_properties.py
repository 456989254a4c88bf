"""Gradient buckets: tiling of shards, staging and space; alignment; collectives; launch order."""

from __future__ import annotations

import torch
from hypothesis import event, example, given
from hypothesis import strategies as st

from property_tests.strategies import alignments, bucket_caps, many_specs, param_specs, seeds, topologies
from property_tests.virtual import assert_tiles, held, make_plan, reduce_buckets, shard
from zeroplan.core import Collective, Span, plan_buckets, specs_from_shapes

bucket_alignments = st.one_of(st.none(), alignments)


@given(
    specs=param_specs(),
    shard_size=st.integers(1, 9),
    alignment=alignments,
    bucket_bytes=bucket_caps,
    bucket_alignment=bucket_alignments,
)
@example(
    specs=specs_from_shapes([(17, 257), (3,)]),
    shard_size=4,
    alignment=8,
    bucket_bytes=1000,
    bucket_alignment=None,
)
@example(specs=specs_from_shapes([(5,), (5,)]), shard_size=2, alignment=1, bucket_bytes=1, bucket_alignment=3)
@example(specs=many_specs(2000, seed=1), shard_size=5, alignment=2, bucket_bytes=64, bucket_alignment=None)
def test_bucket_layout(strategy_name, specs, shard_size, alignment, bucket_bytes, bucket_alignment):
    """[Note: buckets]: pieces tile shards, copies tile staging, spans tile spaces, order is launchable."""
    p = make_plan(strategy_name, specs, shard_size, alignment)
    layout = plan_buckets(p, bucket_bytes, bucket_alignment)
    align = alignment if bucket_alignment is None else bucket_alignment
    assert layout.alignment == align and layout.bucket_bytes == bucket_bytes
    event(f"buckets: {min(len(layout.buckets), 10)}{'+' if len(layout.buckets) >= 10 else ''}")
    for position, bucket in enumerate(layout.buckets):
        assert bucket.index == position
        space = p.spaces[bucket.space]
        itemsize = p.specs[space.params[0]].itemsize
        # Cap: at most bucket_bytes, or one alignment unit when that is larger.
        assert bucket.numel >= 1
        assert bucket.numel * itemsize <= bucket_bytes or bucket.numel <= align, (bucket.span, bucket_bytes)
        # Boundaries fall on the alignment, except at the end of the space.
        for bound in (bucket.span.start, bucket.span.stop):
            assert bound % align == 0 or bound == space.numel, f"boundary {bound} off the alignment {align}"
        # Pieces: non-empty, in rank order, packed in the staging buffer.
        ranks = [piece.rank for piece in bucket.pieces]
        assert ranks == sorted(set(ranks)) and all(0 <= r < shard_size for r in ranks)
        assert all(piece.shard_span.numel > 0 for piece in bucket.pieces)
        staging = 0
        for piece in bucket.pieces:
            assert piece.staging_offset == staging
            assert piece.staging_span == Span(staging, staging + piece.shard_span.numel)
            staging += piece.shard_span.numel
            assert bucket.piece_of(piece.rank) == piece
        assert staging == bucket.numel
        sizes = bucket.piece_sizes(shard_size)
        assert sum(sizes) == bucket.numel
        if len(set(sizes)) == 1:
            expected = Collective.REDUCE_SCATTER
        elif len(bucket.pieces) == 1:
            expected = Collective.REDUCE
        else:
            expected = Collective.REDUCE_SCATTER_V
        assert bucket.collective is expected, (sizes, bucket.collective)
        # Copies fill the staging buffer exactly once; each lands where its owner's piece expects it.
        offsets = dict(zip(space.params, space.param_offsets, strict=True))
        assert_tiles(
            [Span(c.staging_offset, c.staging_offset + c.param_span.numel) for c in bucket.copies],
            bucket.numel,
            "staging copies",
        )
        for copy in bucket.copies:
            assert copy.param_span.numel > 0
            assert bucket.span.contains(copy.param_span.shift(offsets[copy.param])), "copy outside bucket"
            frag = next(f for f in p.fragments[copy.param] if f.param_span.contains(copy.param_span))
            piece = bucket.piece_of(frag.rank)
            assert piece is not None, f"copy of {copy} has no piece on its owner {frag.rank}"
            shard_start = frag.shard_offset + copy.param_span.start - frag.param_span.start
            assert piece.shard_span.contains(Span(shard_start, shard_start + copy.param_span.numel))
            assert copy.staging_offset == piece.staging_offset + shard_start - piece.shard_span.start
        assert bucket.params == tuple(sorted({c.param for c in bucket.copies}))
    pieces_of: dict[tuple[int, int], list[Span]] = {}
    copies_of: dict[int, list[Span]] = {}
    buckets_of: dict[int, list[int]] = {}
    for bucket in layout.buckets:
        for piece in bucket.pieces:
            pieces_of.setdefault((bucket.space, piece.rank), []).append(piece.shard_span)
        for copy in bucket.copies:
            copies_of.setdefault(copy.param, []).append(copy.param_span)
        for q in bucket.params:
            buckets_of.setdefault(q, []).append(bucket.index)
    for space in p.spaces:
        # Bucket spans tile the space coordinate.
        spans = [b.span for b in layout.buckets if b.space == space.index]
        assert_tiles(spans, space.numel, f"buckets of space {space.dtype}")
        # Per rank, the pieces tile the rank's shard [0, owned) exactly once.
        for rank in range(shard_size):
            pieces = pieces_of.get((space.index, rank), [])
            assert_tiles(pieces, space.owned[rank], f"pieces of rank {rank} in {space.dtype}")
        # Each non-empty parameter's gradient is copied exactly once, zero-size ones never.
        for q in space.params:
            assert_tiles(copies_of.get(q, []), p.specs[q].numel, f"gradient of parameter {q}")
            assert layout.buckets_of(q) == tuple(buckets_of.get(q, ()))
    for spec in specs:
        if not spec.trainable:
            assert layout.buckets_of(spec.index) == ()
    # Launch order: the lowest parameter of each bucket never increases ...
    lows = [min(b.params) for b in layout.buckets]
    assert lows == sorted(lows, reverse=True), f"launch order lowest params {lows}"
    # ... so when backward readies gradients in reverse index order, buckets complete in launch order.
    ready_at = {spec.index: len(specs) - 1 - spec.index for spec in specs}
    complete_at = [max(ready_at[q] for q in b.params) for b in layout.buckets]
    assert complete_at == sorted(complete_at), f"buckets complete at {complete_at}"


@given(
    specs=param_specs(max_size=6),
    topology=topologies(max_shard=6),
    alignment=alignments,
    bucket_bytes=bucket_caps,
    seed=seeds,
    interleaved=st.booleans(),
)
def test_executed_buckets_deliver_each_rank_its_shard(
    strategy_name, specs, topology, alignment, bucket_bytes, seed, interleaved
):
    """Staging, reducing and scattering every bucket gives each rank exactly its shard of the mean.

    Rank-major buckets (the strategy's own plan) or the blocks of an interleaved one, whose staging
    padding (NaN here) lands only in padding.
    """
    layout_name = "interleaved" if interleaved else None
    p = make_plan(strategy_name, specs, topology.shard_size, alignment, layout_name, bucket_bytes)
    layout = plan_buckets(p, bucket_bytes)
    generator = torch.Generator().manual_seed(seed)
    grads = [
        [torch.randint(-8, 9, s.shape, generator=generator).to(torch.float64) for s in specs]
        for _ in range(topology.world_size)
    ]
    reduced = reduce_buckets(p, layout, topology, grads)
    mean = [sum(g[i] for g in grads) / topology.world_size for i in range(len(specs))]
    expected = shard(p, mean)
    for space, got, want in zip(p.spaces, reduced, expected, strict=True):
        for rank in range(topology.shard_size):
            mine, expected = held(space, rank, got[rank]), held(space, rank, want[rank])
            assert torch.equal(mine, expected), f"rank {rank} of {space.dtype}"
