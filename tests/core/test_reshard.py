"""Reshard plans: a hand example, data round trips and incompatible plans."""

from __future__ import annotations

import dataclasses

import pytest

from zeroplan.core import (
    Copy,
    IncompatiblePlanError,
    ParamSpec,
    Span,
    flat_even,
    greedy_whole,
    lpt_whole,
    plan_from_assignment,
    plan_reshard,
    specs_from_shapes,
)


def _shards(p):
    """Every rank's shard of every space, filled with (param, element) labels."""
    out = {}
    for space in p.spaces:
        for rank in range(p.shard_size):
            out[space.dtype, rank] = [
                (f.param, i)
                for f in space.by_rank[rank]
                for i in range(f.param_span.start, f.param_span.stop)
            ]
    return out


def _execute(rp, source_shards, target):
    """Run the copies; every target element must be written exactly once."""
    new = {(s.dtype, r): [None] * s.owned[r] for s in target.spaces for r in range(target.shard_size)}
    writes = {key: [0] * len(buf) for key, buf in new.items()}
    for c in rp.copies:
        assert c.src_span.numel == c.dst_span.numel
        new[c.dtype, c.dst_rank][c.dst_span.as_slice()] = source_shards[c.dtype, c.src_rank][
            c.src_span.as_slice()
        ]
        for i in range(c.dst_span.start, c.dst_span.stop):
            writes[c.dtype, c.dst_rank][i] += 1
    for f in rp.fresh:
        space = target.space_of(f.param)
        for i in range(f.param_span.numel):
            new[space.dtype, f.rank][f.shard_offset + i] = ("fresh", f.param, f.param_span.start + i)
            writes[space.dtype, f.rank][f.shard_offset + i] += 1
    assert all(count == 1 for counts in writes.values() for count in counts)
    return new


def test_hand_example():
    specs = specs_from_shapes([(6,), (2,)])
    source, target = flat_even(specs, 2, 1), lpt_whole(specs, 3, 1)
    # source: r0 = p0[0:4], r1 = p0[4:6] p1; target: r0 = p0, r1 = p1, r2 = nothing.
    rp = plan_reshard(source, target)
    assert rp.copies == (
        Copy("float32", 0, 0, Span(0, 4), 0, Span(0, 4)),
        Copy("float32", 0, 1, Span(0, 2), 0, Span(4, 6)),
        Copy("float32", 1, 1, Span(2, 4), 1, Span(0, 2)),
    )
    assert rp.reads(2) == () and rp.source_ranks(0) == (0, 1) and rp.source_ranks(1) == (1,)
    assert rp.target_shard_size == 3 and rp.fresh == ()
    assert (rp.source, rp.target) == (source.fingerprint(), target.fingerprint())


SPECS = (
    ParamSpec(index=0, name="emb", shape=(17, 257), dtype="bf16"),
    ParamSpec(index=1, name="bias", shape=(31,), dtype="fp32"),
    ParamSpec(index=2, name="frozen", shape=(5,), dtype="bf16", trainable=False),
    ParamSpec(index=3, name="empty", shape=(0,), dtype="bf16"),
    ParamSpec(index=4, name="proj", shape=(257, 17), dtype="bf16"),
    ParamSpec(index=5, name="gain", shape=(), dtype="fp32"),
)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (lambda s: flat_even(s, 4, 128), lambda s: flat_even(s, 3, 8)),
        (lambda s: flat_even(s, 8, 1), lambda s: lpt_whole(s, 2, 128)),
        (lambda s: greedy_whole(s, 5, 4), lambda s: flat_even(s, 7, 16)),
        (lambda s: flat_even(s, 1, 1), lambda s: flat_even(s, 16, 128)),
    ],
)
def test_executing_the_copies_rebuilds_the_target_and_round_trips(source, target):
    a, b = source(SPECS), target(SPECS)
    there = _execute(plan_reshard(a, b), _shards(a), b)
    assert there == _shards(b)
    back = _execute(plan_reshard(b, a), there, a)
    assert back == _shards(a)


def test_resharding_to_the_same_plan_copies_each_fragment_in_place():
    p = flat_even(SPECS, 4, 128)
    rp = plan_reshard(p, p)
    assert all(c.src_rank == c.dst_rank and c.src_span == c.dst_span for c in rp.copies)


def test_trainable_changes_need_permission():
    frozen_b = dataclasses.replace(SPECS[1], trainable=False)
    target = flat_even((SPECS[0], frozen_b, *SPECS[2:]), 2, 8)
    source = flat_even(SPECS, 3, 8)
    with pytest.raises(
        IncompatiblePlanError, match=r"parameter 1 \('bias'\) is trainable in the source but frozen"
    ):
        plan_reshard(source, target)
    dropped = plan_reshard(source, target, allow_trainable_change=True)
    assert all(c.param != 1 for c in dropped.copies) and dropped.fresh == ()
    # The other way round, the newly trainable parameter starts fresh.
    grown = plan_reshard(target, source, allow_trainable_change=True)
    assert [f.param for f in grown.fresh] == [1] * len(source.fragments[1])
    expected = {
        key: [("fresh", 1, i) if param == 1 else (param, i) for param, i in labels]
        for key, labels in _shards(source).items()
    }
    assert _execute(grown, _shards(target), source) == expected


def test_appended_parameters_start_fresh_with_permission():
    source = flat_even(SPECS, 2, 8)
    extra = ParamSpec(index=len(SPECS), name="new.weight", shape=(3, 5), dtype="bf16")
    target = flat_even((*SPECS, extra), 2, 8)
    with pytest.raises(IncompatiblePlanError, match="source has 6 parameters but the target has 7"):
        plan_reshard(source, target)
    rp = plan_reshard(source, target, allow_trainable_change=True)
    assert {f.param for f in rp.fresh} == {6}
    _execute(rp, _shards(source), target)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"name": "embedding"}, "parameter 0 differs in name: source 'emb', target 'embedding'"),
        ({"shape": (257, 17)}, "parameter 0 differs in shape: source (17, 257), target (257, 17)"),
        ({"dtype": "fp32"}, "parameter 0 differs in dtype: source 'bfloat16', target 'float32'"),
    ],
)
def test_plans_of_another_model_are_incompatible(change, needle):
    other = (dataclasses.replace(SPECS[0], **change), *SPECS[1:])
    with pytest.raises(IncompatiblePlanError) as info:
        plan_reshard(flat_even(SPECS, 2, 8), flat_even(other, 2, 8))
    assert needle in str(info.value)


def test_a_different_parameter_count_is_incompatible():
    with pytest.raises(IncompatiblePlanError, match="source has 6 parameters but the target has 5"):
        plan_reshard(flat_even(SPECS, 2, 8), flat_even(SPECS[:5], 2, 8))


def test_reshard_plan_is_frozen_with_a_stable_fingerprint():
    a, b = flat_even(SPECS, 4, 128), lpt_whole(SPECS, 2, 8)
    rp = plan_reshard(a, b)
    assert rp.fingerprint() == plan_reshard(a, b).fingerprint() != plan_reshard(b, a).fingerprint()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rp.copies = ()  # type: ignore[misc]


def test_zero_size_parameters_get_an_empty_copy():
    specs = specs_from_shapes([(0,), (4,)])
    a = plan_from_assignment(specs, 2, 1, "x", [(0, Span(0, 0), 1), (1, Span(0, 4), 0)])
    b = plan_from_assignment(specs, 2, 1, "x", [(0, Span(0, 0), 0), (1, Span(0, 4), 1)])
    copies = [c for c in plan_reshard(a, b).copies if c.param == 0]
    assert copies == [Copy("float32", 0, 1, Span(0, 0), 0, Span(0, 0))]


def test_interleaved_shards_with_padding_holes_reshard_both_ways():
    from zeroplan.core.layout import interleave_even

    # interleave_even (see tests/core/test_layout.py): rank 0 = [_ _ a1-a4 a9 b0-b2],
    # rank 1 = [_ a0 a5-a8 b3-b6]; flat_even on 3 ranks: [a0-a4], [a5-a9 b0], [b1-b6].
    specs = specs_from_shapes([(10,), (7,)], names=["a", "b"])
    interleaved, rank_major = interleave_even(specs, 2, 2, 32), flat_even(specs, 3, 1)
    rp = plan_reshard(interleaved, rank_major)
    assert [(c.param, c.src_rank, c.src_span, c.dst_rank, c.dst_span) for c in rp.copies] == [
        (0, 1, Span(1, 2), 0, Span(0, 1)),
        (0, 0, Span(2, 6), 0, Span(1, 5)),
        (0, 1, Span(2, 6), 1, Span(0, 4)),
        (0, 0, Span(6, 7), 1, Span(4, 5)),
        (1, 0, Span(7, 8), 1, Span(5, 6)),
        (1, 0, Span(8, 10), 2, Span(0, 2)),
        (1, 1, Span(6, 10), 2, Span(2, 6)),
    ]
    back = plan_reshard(rank_major, interleaved)
    written = {(c.dst_rank, i) for c in back.copies for i in range(c.dst_span.start, c.dst_span.stop)}
    padding = {(0, 0), (0, 1), (1, 0)}
    assert written == {(r, i) for r in (0, 1) for i in range(10)} - padding  # holes are never written
    original = _labelled(interleaved)
    moved = _execute(rp, original, rank_major)
    assert moved == _shards(rank_major)
    restored = {key: [None] * len(flat) for key, flat in original.items()}
    for c in back.copies:
        restored[c.dtype, c.dst_rank][c.dst_span.as_slice()] = moved[c.dtype, c.src_rank][
            c.src_span.as_slice()
        ]
    assert restored == original


def _labelled(p):
    """Every rank's whole shard (padding included: None), its elements labelled (param, element)."""
    out = {}
    for space in p.spaces:
        for rank in range(p.shard_size):
            flat = [None] * space.shard_numel[rank]
            for f in space.by_rank[rank]:
                for i in range(f.param_span.numel):
                    flat[f.shard_offset + i] = (f.param, f.param_span.start + i)
            out[space.dtype, rank] = flat
    return out
