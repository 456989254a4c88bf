"""Interleaved layouts ([Note: interleaved layout]): blocks, padding, buckets = blocks, collectives.

Every strategy under test is laid out by ``build_partition(..., layout="interleaved")`` (a user
strategy that splits parameters keeps its rank-major layout, which these properties hold for too):

* the blocks tile the full buffer and each rank's pieces tile its shard, in block order;
* every fragment lies inside one piece of its rank, every parameter is one contiguous run of the
  full buffer, and padding never holds a parameter element;
* ``flat_even``: equal pieces in every block, full blocks of a multiple of ``shard_size x
  alignment``, padding only at the front of the first block; every bucket is one
  ``reduce_scatter`` and every block one ``all_gather`` (min_bytes policy);
* whole-parameter strategies: no parameter split, blocks of consecutive parameters within the cap
  (or one parameter alone), pieces padded to the alignment only;
* the buckets are the blocks that hold elements, laid out like them;
* spaces stepped in place (fp32, stages 1-2): every elementwise window is a view of one piece.
"""

from __future__ import annotations

from itertools import pairwise

from hypothesis import event, example, given
from hypothesis import strategies as st

from property_tests.strategies import alignments, bucket_caps, many_specs, param_specs
from property_tests.virtual import assert_tiles, make_plan
from zeroplan.core import (
    Collective,
    CollectivePolicy,
    Span,
    Topology,
    flat_even,
    get_strategy,
    greedy_whole,
    lpt_whole,
    plan,
    plan_buckets,
    specs_from_shapes,
)
from zeroplan.core.span import round_up

shard_sizes = st.integers(1, 9)


def _interleaved(strategy_name, specs, shard_size, alignment, bucket_bytes):
    p = make_plan(strategy_name, specs, shard_size, alignment, "interleaved", bucket_bytes)
    event(f"layout: {p.layout}" if p.spaces else "no trainable parameters")
    return p


def _buffer_labels(space):
    """Per element of the full buffer, the (parameter, element) it holds, or ``None`` for padding."""
    labels: list[tuple[int, int] | None] = [None] * space.buffer_numel
    for frag in space.runs:
        start = space.buffer_offset(frag.param) + frag.param_span.start
        for i in range(frag.param_span.numel):
            assert labels[start + i] is None, f"buffer element {start + i} holds two parameter elements"
            labels[start + i] = (frag.param, frag.param_span.start + i)
    return labels


def _fragments_in(space, block):
    """The non-empty fragments whose elements lie in ``block`` of the full buffer."""
    return [
        f
        for f in space.runs
        if f.param_span.numel
        and block.span.start <= space.buffer_offset(f.param) + f.param_span.start < block.span.stop
    ]


@given(specs=param_specs(min_size=1), shard_size=shard_sizes, alignment=alignments, bucket_bytes=bucket_caps)
@example(specs=specs_from_shapes([(17, 257), (0,), (), (3,)]), shard_size=4, alignment=8, bucket_bytes=1000)
@example(specs=specs_from_shapes([(0,), (3, 0)]), shard_size=3, alignment=4, bucket_bytes=64)
@example(specs=many_specs(2500, seed=0), shard_size=7, alignment=3, bucket_bytes=256)
def test_blocks_pieces_and_padding(strategy_name, specs, shard_size, alignment, bucket_bytes):
    """Blocks tile the buffer, pieces tile shards, fragments sit in pieces, padding holds nothing."""
    p = _interleaved(strategy_name, specs, shard_size, alignment, bucket_bytes)
    for spec in specs:  # exact cover, whatever the layout
        if spec.trainable:
            assert_tiles([f.param_span for f in p.fragments[spec.index]], spec.numel, spec.name)
        else:
            assert p.fragments[spec.index] == ()
    for space in p.spaces:
        position, shard = 0, [0] * shard_size
        for block in space.blocks:
            assert block.start == position and len(block.pieces) == shard_size
            assert block.shard_starts == tuple(shard)
            assert block.numel == sum(block.pieces) and block.span == Span(position, position + block.numel)
            for rank in range(shard_size):
                piece = block.piece(rank)
                assert piece.shard_span.numel == piece.buffer_span.numel == block.pieces[rank]
                assert piece.buffer_span.start == position + block.offset_in_block(rank)
            position += block.numel
            shard = [s + size for s, size in zip(shard, block.pieces, strict=True)]
        assert position == space.buffer_numel
        for rank in range(shard_size):
            assert space.extent(rank) == shard[rank]
            assert space.shard_numel[rank] == round_up(shard[rank], alignment)
            pieces = space.pieces_of(rank)
            assert_tiles([pc.shard_span for pc in pieces], shard[rank], f"pieces of rank {rank}")
            # Each fragment lies inside one of its rank's pieces, at the buffer place of its elements.
            # (A zero-size fragment may sit at the end of one piece and the start of the next, or in an
            # empty piece: any of them is its place.)
            every = [b.piece(rank) for b in space.blocks]
            for frag in space.by_rank[rank]:
                inside = [pc for pc in every if pc.shard_span.contains(frag.shard_span)]
                assert inside, f"{frag} is in none of rank {rank}'s pieces"
                assert len(inside) == 1 or not frag.param_span.numel, f"{frag} is in several pieces"
                places = {pc.buffer_span.start + frag.shard_offset - pc.shard_span.start for pc in inside}
                assert space.buffer_offset(frag.param) + frag.param_span.start in places, frag
        # Every parameter is one run of the buffer; the rest is padding, and it holds nothing.
        labels = _buffer_labels(space)
        assert sum(label is not None for label in labels) == space.numel
        assert space.buffer_numel - space.numel == sum(space.extent(r) for r in range(shard_size)) - sum(
            space.owned
        )
        for q, start in zip(space.params, space.buffer_offsets, strict=True):
            numel = p.specs[q].numel
            assert labels[start : start + numel] == [(q, i) for i in range(numel)], f"parameter {q}"
        assert p.layout == "rank_major" or space.shard_is_region == (len(space.blocks) == 1)


@given(specs=param_specs(min_size=1), shard_size=shard_sizes, alignment=alignments, bucket_bytes=bucket_caps)
@example(specs=specs_from_shapes([(10,), (7,)]), shard_size=2, alignment=2, bucket_bytes=32)
def test_interleave_even_blocks_are_equal_and_padded_at_the_front(specs, shard_size, alignment, bucket_bytes):
    """flat_even: equal pieces, full blocks of the cap, padding (< one unit) before the first element."""
    p = make_plan("flat_even", specs, shard_size, alignment, "interleaved", bucket_bytes)
    unit = shard_size * alignment
    for space in p.spaces:
        itemsize = p.specs[space.params[0]].itemsize
        cap = max(unit, bucket_bytes // itemsize // unit * unit)
        assert cap % unit == 0
        for block in space.blocks:
            assert len(set(block.pieces)) == 1 and block.gather is Collective.ALL_GATHER
            assert block.numel % unit == 0
        assert [b.numel for b in space.blocks[1:]] == [cap] * (len(space.blocks) - 1)
        assert space.blocks[0].numel <= cap and (space.blocks[0].numel or len(space.blocks) == 1)
        pad = space.buffer_numel - space.numel
        assert 0 <= pad < unit and (pad == 0 or space.numel > 0)
        assert space.buffer_offsets == tuple(o + pad for o in space.param_offsets)
        # Per rank, the padding is at most the unit; the owned elements are within one unit of even.
        for rank in range(shard_size):
            assert 0 <= space.shard_numel[rank] - space.owned[rank] <= pad
        assert max(space.owned) - min(space.owned) <= pad


@given(specs=param_specs(min_size=1), shard_size=shard_sizes, alignment=alignments, bucket_bytes=bucket_caps)
def test_interleave_whole_blocks_keep_parameters_whole_within_the_cap(
    strategy_name, specs, shard_size, alignment, bucket_bytes
):
    """Whole-parameter strategies: consecutive parameters per block, within the cap, pieces aligned."""
    strategy = get_strategy(strategy_name)
    if strategy is flat_even or strategy(specs, shard_size, alignment).splits_params:
        return  # interleave_even, or a user strategy that keeps its own (rank-major) layout
    p = _interleaved(strategy_name, specs, shard_size, alignment, bucket_bytes)
    assert not p.splits_params and p.layout == ("interleaved" if p.spaces else "rank_major")
    for space in p.spaces:
        itemsize = p.specs[space.params[0]].itemsize
        cap = max(alignment, bucket_bytes // itemsize // alignment * alignment)
        previous = -1
        for block in space.blocks:
            members = sorted({f.param for f in _fragments_in(space, block)})
            sizes = [p.specs[q].numel for q in members]
            assert not members or members[0] > previous, "blocks hold consecutive parameters, in order"
            previous = members[-1] if members else previous
            assert sum(sizes) <= cap or len(sizes) == 1, (sizes, cap)
            fill = [0] * shard_size
            for q in members:
                fill[p.fragments[q][0].rank] += p.specs[q].numel
            assert block.pieces == tuple(round_up(f, alignment) for f in fill)
        if get_strategy(strategy_name) in (lpt_whole, greedy_whole) and len(space.blocks) > 1:
            event("several blocks")


@given(
    specs=param_specs(min_size=1),
    shard_size=shard_sizes,
    alignment=alignments,
    bucket_bytes=bucket_caps,
    policy=st.sampled_from(list(CollectivePolicy)),
)
@example(
    specs=specs_from_shapes([(17, 257), (3,)]),
    shard_size=4,
    alignment=8,
    bucket_bytes=1000,
    policy=CollectivePolicy.MIN_BYTES,
)
def test_buckets_are_the_blocks(strategy_name, specs, shard_size, alignment, bucket_bytes, policy):
    """One bucket per block with elements, staged like the block; its pieces tile each shard."""
    p = _interleaved(strategy_name, specs, shard_size, alignment, bucket_bytes)
    if p.layout != "interleaved":
        return  # rank-major buckets: property_tests/test_bucket_properties.py
    layout = plan_buckets(p, bucket_bytes, policy=policy)
    by_span = {(b.space, b.span): b for b in layout.buckets}
    assert len(by_span) == len(layout.buckets)
    for space in p.spaces:
        covered: list[list[Span]] = [[] for _ in range(shard_size)]
        for block in space.blocks:
            bucket = by_span.get((space.index, block.span))
            if bucket is None:
                assert not _fragments_in(space, block), f"block {block.span} holds elements but no bucket"
                continue
            assert [(pc.rank, pc.shard_span, pc.staging_offset) for pc in bucket.pieces] == [
                (r, block.piece(r).shard_span, block.offset_in_block(r))
                for r in range(shard_size)
                if block.pieces[r]
            ]
            for pc in bucket.pieces:
                covered[pc.rank].append(pc.shard_span)
            # Copies land where their elements are in the block; the rest of the staging is padding.
            copied = 0
            for copy in bucket.copies:
                at = space.buffer_offset(copy.param) + copy.param_span.start
                assert copy.staging_offset == at - block.start and copy.param_span.numel
                copied += copy.param_span.numel
            assert bucket.padded == (copied < bucket.numel)
            sizes = bucket.piece_sizes(shard_size)
            if len(set(sizes)) == 1:  # under GLOO too: by point-to-point exchange
                assert bucket.collective is Collective.REDUCE_SCATTER
            elif policy is CollectivePolicy.GLOO:
                assert bucket.collective is Collective.ALL_REDUCE
            if p.strategy == "flat_even":
                assert bucket.collective is Collective.REDUCE_SCATTER
        for rank in range(shard_size):
            # With the pieces of the blocks without elements (pure padding), the buckets tile the shard.
            rest = [b.piece(rank).shard_span for b in space.blocks if (space.index, b.span) not in by_span]
            assert_tiles(covered[rank] + rest, space.extent(rank), f"bucket pieces of rank {rank}")
    # Launch order: backward order, as for rank-major buckets.
    lows = [min(b.params) for b in layout.buckets]
    assert lows == sorted(lows, reverse=True)
    if get_strategy(strategy_name) is flat_even:
        event(f"buckets: {min(len(layout.buckets), 5)}{'+' if len(layout.buckets) >= 5 else ''}")


@given(
    specs=param_specs(min_size=1),
    shard_size=shard_sizes,
    alignment=alignments,
    bucket_bytes=bucket_caps,
    stage=st.sampled_from([1, 2, 3]),
)
@example(specs=many_specs(2500, seed=1), shard_size=5, alignment=4, bucket_bytes=512, stage=2)
def test_windows_stepped_in_place_are_views_of_one_piece(
    strategy_name, specs, shard_size, alignment, bucket_bytes, stage
):
    """fp32 spaces at stages 1-2 are stepped in the full buffer: every window lies in one piece.

    The elementwise windows of a rank tile its shard from 0 in every space; where the space is
    stepped in place (``master_in_params``) and interleaved, each window maps onto one run of the
    full buffer that holds exactly its fragments' elements, and windows break where the (param
    group, cohort) changes or a piece does not follow the last in the buffer, and nowhere else;
    elsewhere only where the group or cohort changes.
    """
    zp = plan(
        specs,
        Topology(world_size=shard_size),
        stage=stage,
        strategy=strategy_name,
        alignment=alignment,
        bucket_bytes=bucket_bytes,
        layout="interleaved",
    )
    for space in zp.partition.spaces:
        in_place = zp.master_in_params(space)
        assert in_place == (stage in (1, 2) and space.dtype == "float32")
        cut = in_place and not space.shard_is_region
        event(f"stepped in place, interleaved: {cut}")
        for rank in range(shard_size):
            windows = [t for t in zp.inner_tensors(rank) if t.space == space.index]
            held = [f for f in zp.partition.rank_fragments(space.index, rank) if f.param_span.numel]
            assert (not windows) == (not held)
            if not windows:
                continue
            assert windows[0].shard_span.start == 0
            assert windows[-1].shard_span.stop == max(f.shard_span.stop for f in held)
            # Where the rank's next piece does not follow its last one in the full buffer.
            breaks = {
                q.shard_span.start
                for p, q in pairwise(space.pieces_of(rank))
                if p.buffer_span.stop != q.buffer_span.start
            }
            for a, b in pairwise(windows):
                assert a.shard_span.stop == b.shard_span.start
                same_run = (a.group, a.cohort) == (b.group, b.cohort)
                assert not same_run or (cut and b.shard_span.start in breaks), (a, b)
            if cut:  # and every break inside a run is a cut
                edges = {w.shard_span.start for w in windows}
                assert all(x in edges for x in breaks if x < windows[-1].shard_span.stop), (breaks, windows)
            for frag in held:
                (w,) = [w for w in windows if w.shard_span.contains(frag.shard_span)]
                key = (zp.specs[frag.param].group, zp.specs[frag.param].cohort)
                assert (w.group, w.cohort) == key
                if cut:
                    run = space.buffer_span(rank, w.shard_span)
                    at = run.start + frag.shard_span.start - w.shard_span.start
                    assert at == space.buffer_offset(frag.param) + frag.param_span.start, (frag, w)
