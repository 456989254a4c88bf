"""Chunk queries: a shard read in chunks of any size reaches every element exactly once.

Consolidation broadcasts each rank's shard in bounded chunks; the facade copies a
chunk into parameters with :meth:`Space.fragments_in` and fills it from the inner
optimizer's state with :func:`windows_in`. Round trip: scattering every chunk of
every shard rebuilds every parameter; cover: the windows overlapping the chunks
of a shard read each window element once.
"""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from property_tests.strategies import alignments, bucket_caps, param_specs, seeds
from property_tests.virtual import make_plan, shard
from zeroplan.core import Span, Topology, plan, specs_from_shapes, windows_in

shard_sizes = st.integers(1, 9)
chunk_sizes = st.one_of(st.integers(1, 9), st.integers(10, 400))


#: None: the strategy's own (rank-major) plan; "interleaved": padding between and inside pieces.
layouts = st.sampled_from(["interleaved", None])


@given(
    specs=param_specs(),
    shard_size=shard_sizes,
    alignment=alignments,
    chunk=chunk_sizes,
    seed=seeds,
    layout=layouts,
    bucket_bytes=bucket_caps,
)
@example(
    specs=specs_from_shapes([(17, 257), (0,), (), (3,)]),
    shard_size=4,
    alignment=8,
    chunk=5,
    seed=0,
    layout=None,
    bucket_bytes=64,
)
def test_chunked_scatter_rebuilds_every_parameter(
    strategy_name, specs, shard_size, alignment, chunk, seed, layout, bucket_bytes
):
    """Chunks of each shard (padding included), scattered by ``fragments_in``, rebuild the parameters."""
    p = make_plan(strategy_name, specs, shard_size, alignment, layout, bucket_bytes)
    generator = torch.Generator().manual_seed(seed)
    x = [torch.randn(s.shape, generator=generator) for s in specs]
    shards = shard(p, [t.to(getattr(torch, s.dtype)) for s, t in zip(specs, x, strict=True)])
    for space, per_rank in zip(p.spaces, shards, strict=True):
        outputs = {
            q: torch.full((specs[q].numel,), float("nan"), dtype=per_rank[0].dtype) for q in space.params
        }
        for rank in range(shard_size):
            frags = [f.shard_span for f in space.by_rank[rank]]
            for piece in Span(0, space.shard_numel[rank]).chunks(chunk):
                data = per_rank[rank][piece.as_slice()]
                parts = space.fragments_in(rank, piece)
                assert [part.shard_span.start for part in parts] == sorted(
                    part.shard_span.start for part in parts
                )
                inside = sum((f.intersect(piece) or Span(0, 0)).numel for f in frags)  # padding left out
                assert sum(part.chunk_span.numel for part in parts) == inside
                for part in parts:
                    assert piece.contains(part.shard_span) and part.shard_span.numel
                    assert part.chunk_span == part.shard_span.shift(-piece.start)
                    outputs[part.param][part.param_span.as_slice()] = data[part.chunk_span.as_slice()]
        for q in space.params:
            expected = x[q].to(getattr(torch, specs[q].dtype)).reshape(-1)
            assert torch.equal(outputs[q], expected), f"{specs[q].name} differs"


@given(
    specs=param_specs(
        shape=st.sampled_from([(), (1,), (0,), (5,), (3, 4), (2, 0), (9,), (31,)]), cohorts=True
    ),
    world=st.integers(1, 6),
    alignment=alignments,
    chunk=chunk_sizes,
    optimizer=st.sampled_from(["Adam", "Adafactor"]),
    layout=st.sampled_from(["auto", "rank_major"]),
    bucket_bytes=bucket_caps,
)
def test_windows_in_chunks_reads_each_window_element_once(
    strategy_name, specs, world, alignment, chunk, optimizer, layout, bucket_bytes
):
    """Over the chunks of a shard, ``windows_in`` reaches every element of every window exactly once."""
    options = {"alignment": alignment, "layout": layout, "bucket_bytes": bucket_bytes}
    zp = plan(specs, Topology(world_size=world), strategy=strategy_name, optimizer="Adam", **options)
    if optimizer == "Adafactor" and not zp.partition.splits_params:
        zp = plan(specs, Topology(world_size=world), strategy=strategy_name, optimizer=optimizer, **options)
    for rank in range(world):
        tensors = zp.inner_tensors(rank)
        seen = [[0] * t.shard_span.numel for t in tensors]
        for space in zp.partition.spaces:
            for piece in Span(0, space.shard_numel[rank]).chunks(chunk):
                covered = 0
                for part in windows_in(tensors, space.index, piece):
                    window = tensors[part.tensor]
                    assert window.space == space.index and piece.contains(part.shard_span)
                    assert part.chunk_span == part.shard_span.shift(-piece.start)
                    assert part.shard_span == part.window_span.shift(window.shard_span.start)
                    for i in range(part.window_span.start, part.window_span.stop):
                        seen[part.tensor][i] += 1
                    covered += part.chunk_span.numel
                # Every element of every window in the chunk is reached (windows never overlap).
                expected = sum(
                    (t.shard_span.intersect(piece) or Span(0, 0)).numel
                    for t in tensors
                    if t.space == space.index
                )
                assert covered == expected, "windows tile their part of the shard"
        assert all(count == 1 for row in seen for count in row)
