"""Reshard plans: every target element written exactly once; A -> B -> A is the identity on data."""

from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import given
from hypothesis import strategies as st

from property_tests.strategies import alignments, param_specs
from property_tests.virtual import assert_tiles, make_plan
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
    for space in target.spaces:
        for rank in range(target.shard_size):
            counts = writes[space.dtype, rank]
            owned = space.owned[rank]
            assert bool((counts[:owned] == 1).all()), f"rank {rank} {space.dtype}: writes {counts[:owned]}"
            assert bool((counts[owned:] == 0).all()), f"rank {rank} {space.dtype}: padding written"


@given(
    specs=param_specs(),
    shard_sizes=st.tuples(st.integers(1, 8), st.integers(1, 8)),
    alignments_=st.tuples(alignments, alignments),
    data=st.data(),
)
def test_reshard_round_trip_is_identity(
    strategy_name, strategies_under_test, specs, shard_sizes, alignments_, data
):
    """Plan A (strategy under test) -> plan B (any strategy under test, other sizes) -> A gives A back."""
    other = data.draw(st.sampled_from(strategies_under_test), label="other strategy")
    a = make_plan(strategy_name, specs, shard_sizes[0], alignments_[0])
    b = make_plan(other, specs, shard_sizes[1], alignments_[1])
    original = _labelled_shards(a)
    forward = plan_reshard(a, b)
    assert forward.fresh == () and forward.target_shard_size == b.shard_size
    moved, writes = _execute(forward, original, b)
    _check_written_once(b, writes)
    expected = _labelled_shards(b)
    for key, tensor in expected.items():
        owned = b.spaces[[s.dtype for s in b.spaces].index(key[0])].owned[key[1]]
        assert torch.equal(moved[key][:owned], tensor[:owned]), f"target shard {key} has the wrong elements"
    backward = plan_reshard(b, a)
    restored, writes = _execute(backward, moved, a)
    _check_written_once(a, writes)
    for key, tensor in original.items():
        owned = a.spaces[[s.dtype for s in a.spaces].index(key[0])].owned[key[1]]
        assert torch.equal(restored[key][:owned], tensor[:owned]), f"round trip changed shard {key}"
    assert plan_reshard(a, b).fingerprint() == forward.fingerprint()


@given(
    specs=param_specs(frozen=False),
    flips=st.lists(st.booleans(), max_size=8),
    shard_sizes=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    alignment=alignments,
)
def test_reshard_with_trainable_change_fills_every_target_element_once(
    strategy_name, specs, flips, shard_sizes, alignment
):
    """Freezing / unfreezing: copies plus ``fresh`` fragments fill each target shard exactly once."""
    changed = tuple(replace(s, trainable=not flips[s.index]) if s.index < len(flips) else s for s in specs)
    source = make_plan(strategy_name, specs, shard_sizes[0], alignment)
    target = make_plan(strategy_name, changed, shard_sizes[1], alignment)
    reshard = plan_reshard(source, target, allow_trainable_change=True)
    for space in target.spaces:
        for rank in range(target.shard_size):
            spans = [c.dst_span for c in reshard.reads(rank) if c.dtype == space.dtype]
            spans += [
                f.shard_span
                for f in reshard.fresh
                if f.rank == rank and target.specs[f.param].dtype == space.dtype
            ]
            assert_tiles(spans, space.owned[rank], f"target rank {rank} {space.dtype}")
    for frag in reshard.fresh:
        assert not source.specs[frag.param].trainable and target.specs[frag.param].trainable
    for copy in reshard.copies:
        assert source.specs[copy.param].trainable and target.specs[copy.param].trainable
