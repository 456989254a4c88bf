"""Chunk queries: ``Fragment`` coordinate maps, ``Space.fragments_in`` and ``windows_in``.

The facade broadcasts shards in chunks and copies each chunk into parameters
(fragments) or out of inner-tensor state (windows); these queries say where,
so it never clips intervals itself.
"""

from __future__ import annotations

import pytest

from zeroplan.core import (
    Fragment,
    FragmentOverlap,
    InnerTensor,
    ParamSpec,
    PlanInvariantError,
    Span,
    Topology,
    WindowOverlap,
    plan,
    plan_from_assignment,
    specs_from_shapes,
    windows_in,
)

SPECS = specs_from_shapes([(10,), (6,), (0,), (4,)], names=["w", "v", "z", "b"])

#: rank 0: w[0:7] at 0..7; rank 1: w[7:10] at 0..3, v at 3..9, z at 9..9, b at 9..13.
ASSIGNMENT = [
    (0, Span(0, 7), 0),
    (0, Span(7, 10), 1),
    (1, Span(0, 6), 1),
    (2, Span(0, 0), 1),
    (3, Span(0, 4), 1),
]


def rank_major_plan(*args, **kwargs):
    """``plan`` with the rank-major layout, whose numbers these tests compute by hand."""
    return plan(*args, layout="rank_major", **kwargs)


def _space():
    return plan_from_assignment(SPECS, 2, 8, "hand", ASSIGNMENT).spaces[0]


def test_fragment_maps_between_parameter_and_shard_coordinates():
    frag = Fragment(param=0, rank=1, param_span=Span(7, 10), shard_offset=0)
    assert frag.shard_span_of(Span(8, 10)) == Span(1, 3)
    assert frag.param_span_of(Span(1, 3)) == Span(8, 10)
    assert frag.shard_span_of(frag.param_span) == frag.shard_span
    assert frag.param_span_of(frag.shard_span) == frag.param_span


@pytest.mark.parametrize(("param_span", "shard_span"), [(Span(6, 8), Span(0, 2)), (Span(9, 11), Span(3, 5))])
def test_fragment_maps_refuse_spans_outside_the_fragment(param_span, shard_span):
    frag = Fragment(param=0, rank=1, param_span=Span(7, 10), shard_offset=1)  # shard span [1, 4)
    with pytest.raises(PlanInvariantError, match="not inside"):
        frag.shard_span_of(param_span)
    with pytest.raises(PlanInvariantError, match="not inside"):
        frag.param_span_of(shard_span)


def test_fragments_in_clips_every_overlapping_fragment():
    space = _space()
    assert space.fragments_in(1, Span(2, 10)) == (
        FragmentOverlap(param=0, shard_span=Span(2, 3), chunk_span=Span(0, 1), param_span=Span(9, 10)),
        FragmentOverlap(param=1, shard_span=Span(3, 9), chunk_span=Span(1, 7), param_span=Span(0, 6)),
        FragmentOverlap(param=3, shard_span=Span(9, 10), chunk_span=Span(7, 8), param_span=Span(0, 1)),
    )
    # A chunk inside one fragment; a chunk starting exactly where a fragment starts.
    assert space.fragments_in(0, Span(3, 5)) == (FragmentOverlap(0, Span(3, 5), Span(0, 2), Span(3, 5)),)
    assert space.fragments_in(1, Span(9, 13)) == (FragmentOverlap(3, Span(9, 13), Span(0, 4), Span(0, 4)),)


def test_fragments_in_skips_empty_fragments_empty_chunks_and_padding():
    space = _space()
    assert space.shard_numel == (8, 16)
    assert space.fragments_in(1, Span(9, 9)) == ()  # the zero-size parameter z sits at 9
    assert space.fragments_in(1, Span(13, 16)) == ()  # alignment padding
    assert space.fragments_in(0, Span(7, 8)) == ()
    assert space.fragments_in(0, Span(0, 0)) == ()


def test_fragments_in_over_chunks_rebuilds_every_parameter():
    """Scattering each rank's shard chunk by chunk puts every element of every parameter back."""
    space = _space()
    rebuilt = {p: [None] * SPECS[p].numel for p in space.params}
    for rank in range(2):
        shard = [None] * space.shard_numel[rank]
        for frag in space.by_rank[rank]:
            shard[frag.shard_span.as_slice()] = [
                (frag.param, i) for i in range(frag.param_span.start, frag.param_span.stop)
            ]
        for chunk in Span(0, space.owned[rank]).chunks(3):
            data = shard[chunk.as_slice()]
            for part in space.fragments_in(rank, chunk):
                rebuilt[part.param][part.param_span.as_slice()] = data[part.chunk_span.as_slice()]
    assert rebuilt == {p: [(p, i) for i in range(SPECS[p].numel)] for p in space.params}


@pytest.mark.parametrize(("rank", "chunk", "needle"), [(2, Span(0, 1), "rank 2"), (0, Span(0, 9), "beyond")])
def test_fragments_in_refuses_ranks_and_chunks_outside_the_shard(rank, chunk, needle):
    with pytest.raises(PlanInvariantError, match=needle):
        _space().fragments_in(rank, chunk)


def test_fragments_in_on_a_planned_multi_dtype_model():
    specs = (
        ParamSpec(index=0, name="a", shape=(17, 257)),
        ParamSpec(index=1, name="b", shape=(300,), dtype="bf16"),
        ParamSpec(index=2, name="c", shape=(3,), trainable=False),
        ParamSpec(index=3, name="d", shape=(257, 17)),
    )
    zp = plan(specs, Topology(world_size=3), alignment=8)
    for space in zp.partition.spaces:
        for rank in range(3):
            parts = space.fragments_in(rank, Span(0, space.shard_numel[rank]))
            assert [p.shard_span for p in parts] == [
                f.shard_span for f in space.by_rank[rank] if f.param_span.numel
            ]
            assert [p.param_span for p in parts] == [
                f.param_span for f in space.by_rank[rank] if f.param_span.numel
            ]
            assert all(p.chunk_span == p.shard_span for p in parts)


def _window(space, start, stop):
    return InnerTensor(space=space, group=0, shard_span=Span(start, stop), shape=(stop - start,))


def test_windows_in_clips_windows_of_the_chunks_space():
    tensors = (_window(0, 0, 4), _window(1, 0, 5), _window(0, 4, 10), _window(0, 10, 12))
    assert windows_in(tensors, 0, Span(2, 11)) == (
        WindowOverlap(tensor=0, shard_span=Span(2, 4), chunk_span=Span(0, 2), window_span=Span(2, 4)),
        WindowOverlap(tensor=2, shard_span=Span(4, 10), chunk_span=Span(2, 8), window_span=Span(0, 6)),
        WindowOverlap(tensor=3, shard_span=Span(10, 11), chunk_span=Span(8, 9), window_span=Span(0, 1)),
    )
    assert windows_in(tensors, 1, Span(2, 11)) == (WindowOverlap(1, Span(2, 5), Span(0, 3), Span(2, 5)),)
    assert windows_in(tensors, 0, Span(12, 16)) == ()  # padding beyond the last window
    assert windows_in(tensors, 2, Span(0, 4)) == ()
    assert windows_in((), 0, Span(0, 4)) == ()


def test_windows_in_over_chunks_reads_every_window_element_once():
    specs = tuple(
        ParamSpec(index=i, name=f"p{i}", shape=shape, group=group)
        for i, (shape, group) in enumerate([((17, 13), 0), ((5,), 0), ((40,), 1)])
    )
    zp = rank_major_plan(specs, Topology(world_size=3), alignment=8)
    for rank in range(3):
        tensors = zp.inner_tensors(rank)
        space = zp.partition.spaces[0]
        seen = [[0] * t.shard_span.numel for t in tensors]
        for chunk in Span(0, space.owned[rank]).chunks(7):
            covered = 0
            for part in windows_in(tensors, 0, chunk):
                assert part.chunk_span == part.shard_span.shift(-chunk.start)
                assert part.shard_span == part.window_span.shift(tensors[part.tensor].shard_span.start)
                for i in range(part.window_span.start, part.window_span.stop):
                    seen[part.tensor][i] += 1
                covered += part.chunk_span.numel
            assert covered == chunk.numel  # windows tile the owned part of the shard
        assert all(count == 1 for row in seen for count in row)
