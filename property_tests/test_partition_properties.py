"""Partition plans: exact cover, layout consistency, balance, determinism, metamorphic, round trip."""

from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import event, example, given
from hypothesis import strategies as st

from property_tests.strategies import DTYPES, alignments, bucket_caps, many_specs, param_specs, seeds
from property_tests.virtual import assert_tiles, gather, make_plan, shard
from zeroplan.core import (
    Collective,
    ParamSpec,
    Span,
    Topology,
    flat_even,
    get_strategy,
    greedy_whole,
    lpt_whole,
    plan,
    specs_from_shapes,
)

shard_sizes = st.integers(1, 9)


def _describe(specs, shard_size):
    """Hypothesis events: which kinds of input the examples covered (--hypothesis-show-statistics)."""
    trainable = [s for s in specs if s.trainable]
    if len(specs) >= 1000:
        event("thousands of parameters")
    if len(trainable) < shard_size:
        event("fewer trainable parameters than ranks")
    if any(s.numel == 0 for s in trainable):
        event("zero-size parameter")
    if any(s.numel == 1 for s in trainable):
        event("one-element parameter")
    if len(trainable) < len(specs):
        event("frozen parameter")
    if len({s.dtype for s in trainable}) > 1:
        event("several dtype spaces")
    if len({s.group for s in specs}) > 1:
        event("several param groups")


@given(specs=param_specs(), shard_size=shard_sizes, alignment=alignments)
@example(specs=specs_from_shapes([(17, 257), (0,), (), (3,)]), shard_size=4, alignment=8)
@example(specs=specs_from_shapes([(2,)]), shard_size=5, alignment=1)  # fewer elements than ranks
@example(specs=(), shard_size=3, alignment=4)
@example(specs=many_specs(2500, seed=0), shard_size=7, alignment=3)
def test_exact_cover(strategy_name, specs, shard_size, alignment):
    """Every trainable element is owned exactly once; frozen parameters by nobody."""
    p = make_plan(strategy_name, specs, shard_size, alignment)
    _describe(specs, shard_size)
    for spec in specs:
        frags = p.fragments[spec.index]
        if not spec.trainable:
            assert frags == (), f"frozen {spec.name} is owned: {frags}"
            assert p.owner_ranks(spec.index) == () and p.space_of(spec.index) is None
            continue
        assert frags, f"trainable {spec.name} has no owner"
        for f in frags:
            assert f.param == spec.index and 0 <= f.rank < shard_size, f
        assert [f.param_span for f in frags] == sorted((f.param_span for f in frags), key=lambda s: s.start)
        assert_tiles([f.param_span for f in frags], spec.numel, f"fragments of {spec.name}")
        assert p.space_of(spec.index).dtype == spec.dtype
    assert p.splits_params == any(len(f) > 1 for f in p.fragments)


@given(specs=param_specs(), shard_size=shard_sizes, alignment=alignments)
def test_space_layout(strategy_name, specs, shard_size, alignment):
    """Shards pack in parameter order, allocations are aligned, the full buffer is consistent."""
    p = make_plan(strategy_name, specs, shard_size, alignment)
    trainable_dtypes = list(dict.fromkeys(s.dtype for s in specs if s.trainable))
    assert [s.dtype for s in p.spaces] == trainable_dtypes
    for index, space in enumerate(p.spaces):
        assert space.index == index
        members = [s for s in specs if s.trainable and s.dtype == space.dtype]
        assert space.params == tuple(s.index for s in members)
        offset = 0
        for spec, start in zip(members, space.param_offsets, strict=True):
            assert start == offset, f"space offset of {spec.name}"
            offset += spec.numel
        assert space.numel == offset
        # Each rank's fragments, in parameter order, pack its shard [0, owned) exactly.
        for rank in range(shard_size):
            expected = tuple(f for q in space.params for f in p.fragments[q] if f.rank == rank)
            assert space.by_rank[rank] == expected == p.rank_fragments(index, rank)
            position = 0
            for frag in expected:
                assert frag.shard_offset == position, f"rank {rank} shard not packed at {frag}"
                assert frag.shard_span.numel == frag.param_span.numel
                position += frag.param_span.numel
            assert space.owned[rank] == position
            numel = space.shard_numel[rank]
            assert numel % alignment == 0 and position <= numel < position + alignment
        assert sum(space.owned) == space.numel
        # Runs are every fragment in space-coordinate order and tile the space.
        runs = [f.param_span.shift(space.param_offset(f.param)) for f in space.runs]
        assert sorted(space.runs, key=lambda f: (f.param, f.param_span.start)) == list(space.runs)
        assert [f for q in space.params for f in p.fragments[q]] == list(space.runs)
        assert_tiles(runs, space.numel, f"runs of space {space.dtype}")
        # Rank-major full buffer: regions in rank order, every parameter one contiguous run.
        assert_tiles([space.region(r) for r in range(shard_size)], space.numel, "regions")
        for rank in range(1, shard_size):
            assert space.region(rank).start == space.region(rank - 1).start + space.owned[rank - 1]
        spans = []
        for q, start in zip(space.params, space.buffer_offsets, strict=True):
            assert space.buffer_offset(q) == start
            for frag in p.fragments[q]:
                at = space.region(frag.rank).start + frag.shard_offset
                assert at == start + frag.param_span.start, f"parameter {q} not contiguous in the buffer"
            spans.append(Span(start, start + p.specs[q].numel))
        assert_tiles(spans, space.numel, "parameters in the full buffer")
        equal = len(set(space.owned)) == 1
        assert space.blocks[0].gather is (Collective.ALL_GATHER if equal else Collective.BROADCAST)


@given(specs=param_specs(), shard_size=shard_sizes, alignment=alignments)
@example(specs=specs_from_shapes([(100,), (1,), (100,), (1,), (100,), (1,)]), shard_size=2, alignment=1)
def test_balance(strategy_name, specs, shard_size, alignment):
    """flat_even within one alignment unit; whole-parameter plans within the largest parameter."""
    p = make_plan(strategy_name, specs, shard_size, alignment)
    for space in p.spaces:
        if p.strategy == "flat_even":
            spread = max(space.owned) - min(space.owned)
            assert spread <= alignment, f"flat_even owned {space.owned} spread {spread} > {alignment}"
        elif not p.splits_params:
            total = space.numel
            largest = max(p.specs[q].numel for q in space.params)
            # max load <= max(total / N, largest) + largest, in integers.
            bound = max(total, largest * shard_size) + largest * shard_size
            assert max(space.owned) * shard_size <= bound, (
                f"{p.strategy}: owned {space.owned} exceeds max({total}/{shard_size}, {largest}) + {largest}"
            )


@given(specs=param_specs(), shard_size=shard_sizes, alignment=alignments)
def test_trainable_indices_are_the_members_of_the_spaces(strategy_name, specs, shard_size, alignment):
    """The managed parameters: trainable specs = union of the spaces' parameters = those with fragments."""
    p = make_plan(strategy_name, specs, shard_size, alignment)
    members = [q for space in p.spaces for q in space.params]
    assert len(members) == len(set(members)), "a parameter is in two spaces"
    assert p.trainable_indices == frozenset(members) == {s.index for s in specs if s.trainable}
    assert p.trainable_indices == {q for q, frags in enumerate(p.fragments) if frags}


@given(specs=param_specs(), shard_size=shard_sizes, alignment=alignments)
def test_deterministic_and_fingerprinted(strategy_name, specs, shard_size, alignment):
    """The same inputs give the same plan and fingerprint; another shard size another fingerprint."""
    a = make_plan(strategy_name, specs, shard_size, alignment)
    b = make_plan(strategy_name, specs, shard_size, alignment)
    assert a == b
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 16 and int(a.fingerprint(), 16) >= 0
    c = make_plan(strategy_name, specs, shard_size + 1, alignment)
    assert c.fingerprint() != a.fingerprint()


@given(
    specs=param_specs(shape=st.sampled_from([(), (1,), (0,), (5,), (3, 4), (2, 0), (9,)]), cohorts=True),
    world=st.integers(1, 6),
    alignment=alignments,
    layout=st.sampled_from(["auto", "rank_major"]),
    bucket_bytes=bucket_caps,
)
def test_inner_tensors(strategy_name, specs, world, alignment, layout, bucket_bytes):
    """Elementwise: maximal (group, cohort) windows tiling the shard; otherwise whole parameters.

    Windows tile the shard from 0 to the end of its last fragment, padding between fragments
    (interleaved layouts) included: it is zero, and stepping zeros leaves them zero.
    """
    topology = Topology(world_size=world)
    options = {
        "strategy": strategy_name,
        "alignment": alignment,
        "layout": layout,
        "bucket_bytes": bucket_bytes,
    }
    zp = plan(specs, topology, optimizer="Adam", **options)
    zw = None
    if not zp.partition.splits_params:
        zw = plan(specs, topology, optimizer="Adafactor", **options)
    for rank in range(world):
        tensors = zp.inner_tensors(rank)
        for space in zp.partition.spaces:
            frags = space.by_rank[rank]
            windows = [t for t in tensors if t.space == space.index]
            assert [t.shard_span.start for t in windows] == sorted(t.shard_span.start for t in windows)
            last = max((f.shard_span.stop for f in frags if f.param_span.numel), default=0)
            assert last == space.owned[rank] or zp.partition.layout == "interleaved"
            assert_tiles([t.shard_span for t in windows], last, "windows")
            runs = []
            for f in frags:
                if not f.param_span.numel:
                    continue  # zero-size fragments hold nothing to step
                key = (zp.specs[f.param].group, zp.specs[f.param].cohort)
                if not runs or runs[-1] != key:
                    runs.append(key)
            assert [(t.group, t.cohort) for t in windows] == runs, "windows are maximal (group, cohort) runs"
            for t in windows:
                assert t.param is None and t.shape == (t.shard_span.numel,)
                for f in frags:
                    if t.shard_span.contains(f.shard_span) and f.shard_span.numel:
                        assert (zp.specs[f.param].group, zp.specs[f.param].cohort) == (t.group, t.cohort)
        if zw is not None:
            whole_tensors = zw.inner_tensors(rank)
            expected = [
                (f.param, f.shard_span)
                for s in zw.partition.spaces
                for f in s.by_rank[rank]
                if zw.specs[f.param].numel
            ]
            assert [(t.param, t.shard_span) for t in whole_tensors] == expected
            for t in whole_tensors:
                spec = zw.specs[t.param]
                assert (t.shape, t.group, t.cohort) == (spec.shape, spec.group, spec.cohort)


_BUILTIN = (flat_even, greedy_whole, lpt_whole)


def insert_zero_size(specs, at, shape=(0,), dtype="float32", trainable=True):
    """``specs`` with a zero-size parameter inserted at position ``at`` (later ones renumbered)."""
    extra = ParamSpec(
        index=at,
        name="inserted",
        shape=shape,
        dtype=dtype,
        group=specs[at - 1].group if at else 0,
        trainable=trainable,
    )
    moved = tuple(replace(s, index=s.index + 1) for s in specs[at:])
    return (*specs[:at], extra, *moved)


@st.composite
def zero_size_insertions(draw):
    specs = draw(param_specs())
    at = draw(st.integers(0, len(specs)))
    shape = draw(st.sampled_from([(0,), (3, 0), (0, 0, 2)]))
    dtype = draw(st.sampled_from(DTYPES))
    return specs, insert_zero_size(specs, at, shape, dtype, draw(st.booleans())), at


_FIVE_SEVEN = specs_from_shapes([(5,), (7,)])


#: None: the strategy's own (rank-major) plan; "interleaved": ``build_partition``'s blocks.
layouts = st.sampled_from([None, "interleaved"])


@given(
    case=zero_size_insertions(),
    shard_size=shard_sizes,
    alignment=alignments,
    layout=layouts,
    bucket_bytes=bucket_caps,
)
@example(
    case=(_FIVE_SEVEN, insert_zero_size(_FIVE_SEVEN, 2), 2),
    shard_size=2,
    alignment=1,
    layout=None,
    bucket_bytes=16,
)
@example(
    case=(_FIVE_SEVEN, insert_zero_size(_FIVE_SEVEN, 1, dtype="bfloat16"), 1),
    shard_size=3,
    alignment=2,
    layout=None,
    bucket_bytes=16,
)
@example(
    case=(_FIVE_SEVEN, insert_zero_size(_FIVE_SEVEN, 1), 1),
    shard_size=2,
    alignment=1,
    layout="interleaved",
    bucket_bytes=16,
)
def test_zero_size_parameter_moves_nothing(strategy_name, case, shard_size, alignment, layout, bucket_bytes):
    """Inserting (or appending) a zero-size parameter leaves every other fragment and offset in place.

    Interleaved too: it joins a block without moving its blocks, pieces or owners.
    """
    before_specs, after_specs, at = case
    after = make_plan(strategy_name, after_specs, shard_size, alignment, layout, bucket_bytes)
    assert bool(after.fragments[at]) == after_specs[at].trainable  # valid for every strategy
    if get_strategy(strategy_name) not in _BUILTIN:
        return
    before = make_plan(strategy_name, before_specs, shard_size, alignment, layout, bucket_bytes)
    for spec in before_specs:
        new = spec.index + (spec.index >= at)
        old_frags = [(f.rank, f.param_span, f.shard_offset) for f in before.fragments[spec.index]]
        new_frags = [(f.rank, f.param_span, f.shard_offset) for f in after.fragments[new]]
        assert old_frags == new_frags, f"{spec.name} moved: {old_frags} -> {new_frags}"
        if spec.trainable:
            old_space, new_space = before.space_of(spec.index), after.space_of(new)
            assert old_space.param_offset(spec.index) == new_space.param_offset(new)
            assert old_space.buffer_offset(spec.index) == new_space.buffer_offset(new)
    for old_space in before.spaces:
        new_space = next(s for s in after.spaces if s.dtype == old_space.dtype)
        assert (old_space.owned, old_space.shard_numel, old_space.blocks) == (
            new_space.owned,
            new_space.shard_numel,
            new_space.blocks,
        )


@given(
    specs=param_specs(),
    shard_size=shard_sizes,
    alignment=alignments,
    seed=seeds,
    layout=layouts,
    bucket_bytes=bucket_caps,
)
def test_gather_of_shard_is_identity(strategy_name, specs, shard_size, alignment, seed, layout, bucket_bytes):
    """gather(shard(x)) == x, executed with real tensors of each parameter's dtype (NaN padding)."""
    p = make_plan(strategy_name, specs, shard_size, alignment, layout, bucket_bytes)
    generator = torch.Generator().manual_seed(seed)
    x = [torch.randn(s.shape, generator=generator).to(getattr(torch, s.dtype)) for s in specs]
    shards = shard(p, x)
    for space, per_rank in zip(p.spaces, shards, strict=True):
        assert [t.numel() for t in per_rank] == list(space.shard_numel)
    blank = [torch.full_like(t, float("nan")) if s.trainable else t for s, t in zip(specs, x, strict=True)]
    y = gather(p, shards, blank)
    for spec, a, b in zip(specs, x, y, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{spec.name} differs"
