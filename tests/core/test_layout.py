"""The interleaved layout ([Note: interleaved layout]): hand-checked blocks, buckets = blocks, auto."""

from __future__ import annotations

import heapq
import random

import pytest

import zeroplan.core.layout as layout_module
from zeroplan.core import (
    AUTO_MAX_PIECES,
    Collective,
    ConfigError,
    ParamSpec,
    Span,
    Topology,
    build_partition,
    memory_report,
    plan,
    plan_from_assignment,
    preset_specs,
    register_strategy,
    specs_from_shapes,
)
from zeroplan.core.layout import interleave_even, interleave_whole

TEN_SEVEN = specs_from_shapes([(10,), (7,)], names=["a", "b"])


def _shard_contents(space, rank):
    """What rank ``rank``'s shard holds, element by element: ``(param, element)`` or ``None`` (padding)."""
    held: list[tuple[int, int] | None] = [None] * space.shard_numel[rank]
    for frag in space.by_rank[rank]:
        for i in range(frag.param_span.numel):
            held[frag.shard_offset + i] = (frag.param, frag.param_span.start + i)
    return held


# ----------------------------------------------------------------- interleave_even, by hand
def test_interleave_even_hand_computed():
    # 2 ranks, alignment 2, 32-byte blocks = 8 fp32 elements (a multiple of 2 x 2). The 17 elements
    # need 3 blocks; the first in buffer order takes the 1-element remainder, padded at its front to 4:
    #   buffer [_ _ _ a0 | a1 a2 a3 a4 a5 a6 a7 a8 | a9 b0 b1 b2 b3 b4 b5 b6]
    #   pieces  r0  r1   |     r0          r1      |     r0          r1
    p = interleave_even(TEN_SEVEN, 2, 2, 32)
    assert p.layout == "interleaved" and p.splits_params
    (space,) = p.spaces
    assert [(b.start, b.pieces, b.shard_starts) for b in space.blocks] == [
        (0, (2, 2), (0, 0)),
        (4, (4, 4), (2, 2)),
        (12, (4, 4), (6, 6)),
    ]
    assert space.buffer_numel == 20 and space.numel == 17
    assert space.buffer_offsets == (3, 13)
    assert space.owned == (8, 9) and space.shard_numel == (10, 10) == tuple(map(space.extent, (0, 1)))
    assert _shard_contents(space, 0) == [
        None,
        None,
        *((0, i) for i in range(1, 5)),
        (0, 9),
        *((1, i) for i in range(3)),
    ]
    assert _shard_contents(space, 1) == [
        None,
        (0, 0),
        *((0, i) for i in range(5, 9)),
        *((1, i) for i in range(3, 7)),
    ]
    assert space.pieces_of(1)[2].buffer_span == Span(16, 20) and space.pieces_of(1)[2].shard_span == Span(
        6, 10
    )
    assert not space.shard_is_region
    with pytest.raises(Exception, match="interleaved: its shards are not regions"):
        space.region(0)


def test_interleave_even_buckets_are_its_blocks_each_one_reduce_scatter():
    zp = plan(TEN_SEVEN, Topology(world_size=2), alignment=2, bucket_bytes=32)
    assert zp.partition.layout == "interleaved"
    (space,) = zp.partition.spaces
    # Launch order: the last block first (backward order).
    assert [b.span for b in zp.buckets.buckets] == [Span(12, 20), Span(4, 12), Span(0, 4)]
    assert {b.collective for b in zp.buckets.buckets} == {Collective.REDUCE_SCATTER}
    assert [b.padded for b in zp.buckets.buckets] == [False, False, True]
    first = zp.buckets.buckets[2]
    # Its staging buffer is laid out like the block: a0 after 3 elements of (zero) padding.
    assert [(c.param, c.param_span, c.staging_offset) for c in first.copies] == [(0, Span(0, 1), 3)]
    assert [(pc.rank, pc.shard_span, pc.staging_offset) for pc in first.pieces] == [
        (0, Span(0, 2), 0),
        (1, Span(0, 2), 2),
    ]
    assert {zp.gather_collective(b) for b in space.blocks} == {Collective.ALL_GATHER}


def test_a_space_of_zero_size_parameters_is_one_empty_block():
    # Like the rank-major layout: no padding is invented for a space without elements.
    specs = (
        ParamSpec(index=0, name="z", shape=(0,), dtype="fp32"),
        ParamSpec(index=1, name="y", shape=(3, 0), dtype="fp32"),
        ParamSpec(index=2, name="x", shape=(4,), dtype="bf16"),
    )
    p = interleave_even(specs, 3, 4, 1024)
    empty, full = p.spaces
    assert [b.pieces for b in empty.blocks] == [(0, 0, 0)] and empty.buffer_numel == 0
    assert empty.shard_numel == (0, 0, 0)
    assert full.buffer_numel == 12 and full.buffer_offsets == (8,)
    zp = plan(specs, Topology(world_size=3), alignment=4)
    assert [b.space for b in zp.buckets.buckets] == [1]  # nothing to reduce in the empty space
    report = memory_report(zp)
    assert {r.master_bytes for r in report.ranks} == {4 * 4}  # only the bf16 space has shards


def test_zero_size_parameters_at_the_end_of_the_buffer_sit_at_the_end_of_the_last_piece():
    specs = specs_from_shapes([(0,), (10,), (7,), (0,)])
    p = interleave_even(specs, 2, 2, 32)
    (space,) = p.spaces
    assert space.buffer_offsets == (3, 3, 13, 20)
    assert p.fragments[3][0].rank == 1 and p.fragments[3][0].shard_offset == 10
    assert p.fragments[0][0].rank == 1 and p.fragments[0][0].shard_offset == 1


# ----------------------------------------------------------------- interleave_whole
def test_interleave_whole_balances_each_block():
    # 32-byte blocks: 8 elements, packed from the end: [c*2 d*6], then [a*3 b*5]. Both blocks hold 8;
    # in each, largest first, each parameter to the rank with the least of the block (then overall).
    specs = specs_from_shapes([(3,), (5,), (2,), (6,)], names=list("abcd"))
    p = interleave_whole(specs, 2, 1, 32, "lpt_whole")
    (space,) = p.spaces
    assert p.block_pieces == (((5, 3), (2, 6)),)
    assert [p.owner_ranks(i) for i in range(4)] == [(1,), (0,), (0,), (1,)]
    # Block 0: b (5) on rank 0, a (3) on rank 1. Block 1: d (6) on rank 1, which has less overall.
    assert [(b.start, b.shard_starts) for b in space.blocks] == [(0, (0, 0)), (8, (5, 3))]
    assert space.buffer_offsets == (5, 0, 8, 10) and space.owned == (7, 9)
    assert not p.splits_params


def _balanced_by_a_heap_per_block(blocks, n, largest_first):
    """The balancing ``_balanced`` replaced: a heap of (block load, total, rank) of every rank per block."""
    totals, owners = [0] * n, []
    for members in blocks:
        order = range(len(members))
        if largest_first:
            order = sorted(order, key=lambda i: (-members[i].numel, members[i].index))
        heap = [(0, total, rank) for rank, total in enumerate(totals)]
        heapq.heapify(heap)
        mine = [0] * len(members)
        for i in order:
            load, total, rank = heapq.heappop(heap)
            mine[i] = rank
            totals[rank] = total + members[i].numel
            heapq.heappush(heap, (load + members[i].numel, total + members[i].numel, rank))
        owners.append(mine)
    return owners


@pytest.mark.parametrize("seed", range(40))
def test_balancing_with_one_idle_heap_per_space_matches_a_heap_per_block(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3, 7, 64])
    sizes = [[rng.choice([0, 0, 1, 5, 5, 17, 300]) for _ in range(rng.randint(1, 3 * n))] for _ in range(9)]
    specs = iter(specs_from_shapes([(numel,) for block in sizes for numel in block]))
    blocks = [[next(specs) for _ in block] for block in sizes]  # ties are broken by index
    for largest_first in (True, False):
        idle = [(0, rank) for rank in range(n)]
        got = [layout_module._balanced(block, idle, largest_first) for block in blocks]
        assert got == _balanced_by_a_heap_per_block(blocks, n, largest_first)
        assert sorted(rank for _, rank in idle) == list(range(n))


def test_interleave_whole_pads_pieces_to_the_alignment():
    specs = specs_from_shapes([(3,), (5,), (2,)])
    p = interleave_whole(specs, 2, 4, 10**6, "lpt_whole")
    (space,) = p.spaces
    assert space.owned == (5, 5) and [b.pieces for b in space.blocks] == [(8, 8)]
    assert space.shard_numel == (8, 8) and space.buffer_numel == 16


def test_zero_size_parameters_never_make_a_block_of_their_own():
    # 8-element blocks: 'big' fills one; the zero-size ones before and after it join a block with elements.
    specs = specs_from_shapes([(0,), (9,), (0,), (3,), (0,)], names=["z0", "big", "z1", "small", "z2"])
    p = interleave_whole(specs, 2, 1, 32, "greedy_whole")
    (space,) = p.spaces
    assert all(b.numel for b in space.blocks) and len(space.blocks) == 2
    zp = plan(specs, Topology(world_size=2), strategy="greedy_whole", alignment=1, bucket_bytes=32)
    assert len(zp.buckets.buckets) == len(zp.partition.spaces[0].blocks) == 2


def test_a_user_whole_parameter_strategy_keeps_its_owners():
    def everything_on_the_last_rank(specs, shard_size, alignment):
        pieces = [(s.index, Span(0, s.numel), shard_size - 1) for s in specs if s.trainable]
        return plan_from_assignment(specs, shard_size, alignment, "last_rank", pieces)

    register_strategy("test_layout.last_rank", everything_on_the_last_rank, replace=True)
    specs = specs_from_shapes([(4,), (6,), (5,)])
    p = build_partition(specs, 3, 1, 40, "test_layout.last_rank")
    assert p.layout == "interleaved" and {f.rank for frags in p.fragments for f in frags} == {2}
    assert [b.pieces for b in p.spaces[0].blocks] == [(0, 0, 10), (0, 0, 5)]  # [4 6] [5]


def test_interleaved_refuses_a_user_strategy_that_splits_parameters():
    def halves(specs, shard_size, alignment):
        pieces = []
        for s in specs:
            pieces += [(s.index, Span(0, s.numel // 2), 0), (s.index, Span(s.numel // 2, s.numel), 1)]
        return plan_from_assignment(specs, shard_size, alignment, "halves", pieces)

    register_strategy("test_layout.halves", halves, replace=True)
    specs = specs_from_shapes([(4,)])
    assert build_partition(specs, 2, 1, 40, "test_layout.halves").layout == "rank_major"
    with pytest.raises(ConfigError, match="splits parameters, so it lays out shards itself"):
        build_partition(specs, 2, 1, 40, "test_layout.halves", layout="interleaved")


def test_unknown_layout_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown layout 'columns'"):
        plan(TEN_SEVEN, Topology(world_size=2), layout="columns")


# ----------------------------------------------------------------- layout="auto"
@pytest.mark.parametrize("strategy", ["flat_even", "lpt_whole", "greedy_whole"])
def test_auto_interleaves_up_to_the_piece_limit_then_keeps_rank_major(monkeypatch, strategy):
    specs = specs_from_shapes([(1000,)] * 8)
    # 8,000 elements in blocks of at most 2,000: 4 blocks (4 or 5 for flat_even) x 4 ranks.
    p = build_partition(specs, 4, 8, 8000, strategy)
    assert p.layout == "interleaved"
    pieces = sum(len(b) for b in p.block_pieces) * 4
    monkeypatch.setattr(layout_module, "AUTO_MAX_PIECES", pieces - 1)
    assert build_partition(specs, 4, 8, 8000, strategy).layout == "rank_major"
    assert build_partition(specs, 4, 8, 8000, strategy, layout="interleaved") == p  # asked for: no limit
    monkeypatch.setattr(layout_module, "AUTO_MAX_PIECES", pieces)
    assert build_partition(specs, 4, 8, 8000, strategy) == p


def test_llama_70b_on_4096_ranks_stays_rank_major_under_auto():
    specs = preset_specs("llama-70b", "bf16")
    for strategy in ("flat_even", "lpt_whole"):
        p = build_partition(specs, 4096, 128, 25 * 2**20, strategy)
        assert p.layout == "rank_major", strategy
    assert AUTO_MAX_PIECES == 2**18


# ----------------------------------------------------------------- what a llama-7b job sends
@pytest.mark.parametrize(("shard", "replica_all_reduce"), [(None, False), (8, True)])
def test_llama_7b_on_64_ranks_sends_only_reduce_scatter_and_all_gather(shard, replica_all_reduce):
    specs = preset_specs("llama-7b", "bf16")
    zp = plan(specs, Topology(world_size=64, shard_size=shard), stage=2, policy="min_bytes")
    assert zp.partition.layout == "interleaved"
    assert {b.collective for b in zp.buckets.buckets} == {Collective.REDUCE_SCATTER}
    expected = {("shard", "reduce_scatter"), ("shard", "all_gather"), ("world", "all_reduce")}  # + agreement
    if replica_all_reduce:
        expected.add(("replica", "all_reduce"))
    report = memory_report(zp)
    blocks = len(zp.partition.spaces[0].blocks)
    assert len(zp.buckets.buckets) == blocks
    for r in report.ranks:
        costs = {(c.group, c.collective.value): c for c in r.comm}
        assert set(costs) == expected, (r.rank, set(costs))
        assert costs["shard", "reduce_scatter"].calls == costs["shard", "all_gather"].calls == blocks
    # Equal pieces: every rank holds the same, and sends the same data (the step agreement's 4 integers
    # split unevenly over 64 ranks, so its bytes differ by rank).
    data = {(r.total_bytes, sum(c.bytes for c in r.comm if c.group != "world")) for r in report.ranks}
    assert len(data) == 1


# ----------------------------------------------------------------- memory and traffic, by hand
#: fp32 [a*5 b*7] over 2 ranks, alignment 1, 16-byte blocks of 4: [a0 a1 | a2 a3], [a4 b0 | b1 b2],
#: [b3 b4 | b5 b6]; rank 0's shard is a0 a1 a4 b0 b3 b4, rank 1's a2 a3 b1 b2 b5 b6.
SMALL = specs_from_shapes([(5,), (7,)], names=["a", "b"])


def _small(stage, world=2, shard=2):
    topology = Topology(world_size=world, shard_size=shard)
    zp = plan(SMALL, topology, stage=stage, alignment=1, bucket_bytes=16, layout="interleaved")
    assert zp.partition.layout == "interleaved"
    return list(memory_report(zp).ranks)


def _costs(r):
    return {(c.group, c.collective.value): (c.calls, c.bytes) for c in r.comm}


def test_hand_computed_interleaved_traffic_stage_2():
    for r in _small(2):
        assert _costs(r) == {
            ("shard", "reduce_scatter"): (3, 24),  # 3 blocks, 2 of 4 elements leave each rank per call
            ("shard", "all_gather"): (3, 24),  # each rank sends its 2-element piece of each block
            ("world", "all_reduce"): (1, 32),  # the step agreement: 4 int64, a 2-rank ring sends 4
        }


def test_hand_computed_interleaved_memory_stages_1_to_3():
    r1, r2, r3 = (_small(stage)[0] for stage in (1, 2, 3))
    # The shard (6 fp32 elements) is not a region of the full buffer: the rank reduces into a gradient
    # shard of its own, at stage 1 too (beside the full gradients), and steps its three 2-element
    # pieces of the full buffer in place: no master, three AdamW windows of 2 x 2 x 4 bytes + a step each.
    assert (r1.params_bytes, r1.grads_bytes, r1.master_bytes, r1.optimizer_state_bytes) == (48, 72, 0, 60)
    assert (r2.params_bytes, r2.grads_bytes, r2.master_bytes, r2.optimizer_state_bytes) == (48, 24, 0, 60)
    # Stage 3 cuts blocks at parameters: [a, pad] and [b, pad], 3 + 4 elements per rank. It keeps the
    # parameter shard itself and steps it: no separate fp32 master.
    assert (r3.params_bytes, r3.grads_bytes, r3.master_bytes, r3.optimizer_state_bytes) == (28, 28, 0, 60)
    assert r1.buffer_bytes == r2.buffer_bytes == 32  # two 16-byte buckets in flight, no fp32 scratch


def test_hand_computed_interleaved_traffic_stage_3_and_mics():
    for r in _small(3):
        # blocks [a, pad] and [b, pad], each gathered for forward and backward: 2 x (3 + 4) elements sent
        assert _costs(r)[("shard", "all_gather")] == (4, 56)
        assert ("shard", "broadcast") not in _costs(r)
    for r in _small(2, world=4, shard=2):
        # three 2-element pieces per rank; a 2-rank ring all-reduce of m elements sends m
        assert _costs(r)[("replica", "all_reduce")] == (3, 3 * 2 * 4)


def test_auto_keeps_stage_1_rank_major():
    """Stage 1 reduces into its full gradient buffer in place only when the shard is a region."""
    topology = Topology(world_size=2)
    assert plan(SMALL, topology, stage=1, alignment=1, bucket_bytes=16).partition.layout == "rank_major"
    assert plan(SMALL, topology, stage=2, alignment=1, bucket_bytes=16).partition.layout == "interleaved"


def test_a_shard_group_of_one_steps_its_interleaved_fp32_buffer_as_one_window():
    # Shard size 1: every block is one piece, each following the last in the full buffer, so the
    # window is not cut (it was cut per block) and is one run of the buffer.
    zp = plan(SMALL, Topology(world_size=2, shard_size=1), alignment=1, bucket_bytes=16, layout="interleaved")
    (space,) = zp.partition.spaces
    assert len(space.blocks) == 3 and zp.master_in_params(space)
    (window,) = zp.inner_tensors(0)
    assert window.shard_span == Span(0, 12) and space.buffer_span(0, window.shard_span) == Span(0, 12)
    # Two ranks: rank 0's pieces [a0 a1], [a4 b0], [b3 b4] are apart in the buffer: three windows.
    two = plan(SMALL, Topology(world_size=2), alignment=1, bucket_bytes=16, layout="interleaved")
    assert [t.shard_span for t in two.inner_tensors(0)] == [Span(0, 2), Span(2, 4), Span(4, 6)]
    assert [two.partition.spaces[0].buffer_span(0, t.shard_span) for t in two.inner_tensors(0)] == [
        Span(0, 2),
        Span(4, 6),
        Span(8, 10),
    ]
