"""Reshard plans: every target element written exactly once; A -> B -> A is the identity on data.

Plans are drawn in either layout ([Note: layout]): interleaved shards have padding between and
inside their pieces (holes in the shard coordinate), which no copy may read or write.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import event, given
from hypothesis import strategies as st

from property_tests.strategies import alignments, bucket_caps, param_specs
from property_tests.virtual import held, make_plan
from zeroplan.core import plan_reshard


def _labelled_shards(plan):
    """Shards whose every element holds a unique label of (parameter, element); padding -1."""
    shards = {}
    for space in plan.spaces:
        for rank in range(plan.shard_size):
            flat = torch.full((space.shard_numel[rank],), -1, dtype=torch.int64)
            for frag in space.by_rank[rank]:
                start = space.param_offset(frag.param) + frag.param_span.start
                flat[frag.shard_span.as_slice()] = torch.arange(start, start + frag.param_span.numel)
            shards[space.dtype, rank] = flat
    return shards


def _execute(reshard, source_shards, target):
    """Run the copies; return the target shards and how often each target element was written."""
    shards, writes = {}, {}
    for space in target.spaces:
        for rank in range(target.shard_size):
            shards[space.dtype, rank] = torch.full((space.shard_numel[rank],), -2, dtype=torch.int64)
            writes[space.dtype, rank] = torch.zeros(space.shard_numel[rank], dtype=torch.int64)
    for copy in reshard.copies:
        assert copy.src_span.numel == copy.dst_span.numel
        source = source_shards[copy.dtype, copy.src_rank]
        assert copy.src_span.stop <= source.numel(), f"{copy} reads past the source shard"
        shards[copy.dtype, copy.dst_rank][copy.dst_span.as_slice()] = source[copy.src_span.as_slice()]
        writes[copy.dtype, copy.dst_rank][copy.dst_span.as_slice()] += 1
    return shards, writes


def _check_written_once(target, writes):
    """Every parameter element of every target shard written once; padding never."""
    for space in target.spaces:
        for rank in range(target.shard_size):
            counts = writes[space.dtype, rank]
            mine = held(space, rank, counts)
            assert bool((mine == 1).all()), f"rank {rank} {space.dtype}: writes {mine}"
            assert int(counts.sum()) == mine.numel(), f"rank {rank} {space.dtype}: padding written"


#: ``build_partition``'s layout, or None: the strategy's own (rank-major) plan.
layouts = st.sampled_from(["interleaved", None, "rank_major"])


@given(
    specs=param_specs(),
    shard_sizes=st.tuples(st.integers(1, 8), st.integers(1, 8)),
    alignments_=st.tuples(alignments, alignments),
    layouts_=st.tuples(layouts, layouts),
    bucket_bytes=st.tuples(bucket_caps, bucket_caps),
    data=st.data(),
)
def test_reshard_round_trip_is_identity(
    strategy_name, strategies_under_test, specs, shard_sizes, alignments_, layouts_, bucket_bytes, data
):
    """Plan A (strategy under test) -> plan B (any strategy under test, other sizes) -> A gives A back."""
    other = data.draw(st.sampled_from(strategies_under_test), label="other strategy")
    a = make_plan(strategy_name, specs, shard_sizes[0], alignments_[0], layouts_[0], bucket_bytes[0])
    b = make_plan(other, specs, shard_sizes[1], alignments_[1], layouts_[1], bucket_bytes[1])
    event(f"{a.layout} -> {b.layout}" if a.spaces else "no trainable parameters")
    original = _labelled_shards(a)
    forward = plan_reshard(a, b)
    assert forward.fresh == () and forward.target_shard_size == b.shard_size
    moved, writes = _execute(forward, original, b)
    _check_written_once(b, writes)
    expected = _labelled_shards(b)
    for (dtype, rank), tensor in expected.items():
        space = next(s for s in b.spaces if s.dtype == dtype)
        assert torch.equal(held(space, rank, moved[dtype, rank]), held(space, rank, tensor)), (
            f"target shard {dtype, rank} has the wrong elements"
        )
    backward = plan_reshard(b, a)
    restored, writes = _execute(backward, moved, a)
    _check_written_once(a, writes)
    for (dtype, rank), tensor in original.items():
        space = next(s for s in a.spaces if s.dtype == dtype)
        assert torch.equal(held(space, rank, restored[dtype, rank]), held(space, rank, tensor)), (
            f"round trip changed shard {dtype, rank}"
        )
    assert plan_reshard(a, b).fingerprint() == forward.fingerprint()


@given(
    specs=param_specs(frozen=False),
    flips=st.lists(st.booleans(), max_size=8),
    shard_sizes=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    alignment=alignments,
    layouts_=st.tuples(layouts, layouts),
)
def test_reshard_with_trainable_change_fills_every_target_element_once(
    strategy_name, specs, flips, shard_sizes, alignment, layouts_
):
    """Freezing / unfreezing: copies plus ``fresh`` fragments fill each target shard exactly once."""
    changed = tuple(replace(s, trainable=not flips[s.index]) if s.index < len(flips) else s for s in specs)
    source = make_plan(strategy_name, specs, shard_sizes[0], alignment, layouts_[0], 64)
    target = make_plan(strategy_name, changed, shard_sizes[1], alignment, layouts_[1], 64)
    reshard = plan_reshard(source, target, allow_trainable_change=True)
    for space in target.spaces:
        for rank in range(target.shard_size):
            spans = [c.dst_span for c in reshard.reads(rank) if c.dtype == space.dtype]
            spans += [
                f.shard_span
                for f in reshard.fresh
                if f.rank == rank and target.specs[f.param].dtype == space.dtype
            ]
            # Exactly the target's fragments, once each, whatever padding lies between them.
            counts = torch.zeros(space.shard_numel[rank], dtype=torch.int64)
            for span in spans:
                counts[span.as_slice()] += 1
            assert bool((held(space, rank, counts) == 1).all()), f"target rank {rank} {space.dtype}"
            assert int(counts.sum()) == space.owned[rank], f"target rank {rank} {space.dtype}: padding"
    for frag in reshard.fresh:
        assert not source.specs[frag.param].trainable and target.specs[frag.param].trainable
    for copy in reshard.copies:
        assert source.specs[copy.param].trainable and target.specs[copy.param].trainable
