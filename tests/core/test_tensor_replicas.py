"""Which elements each tp rank counts in the gradient norm ([Note: tensor-parallel parameters]); pure."""

from __future__ import annotations

import itertools

import pytest

from zeroplan.core import ParamSpec, Replicate, Shard, Span, Topology, norm_windows, plan, tensor_replicas

SPLIT = (("tp", Shard(0)),)
SPECS = (
    ParamSpec(index=0, name="norm.weight", shape=(24,), placement=(("tp", Replicate()),)),
    ParamSpec(index=1, name="up.weight", shape=(12, 24), global_shape=(24, 24), placement=SPLIT),
    ParamSpec(index=2, name="up.bias", shape=(12,), global_shape=(24,), placement=SPLIT),
    ParamSpec(
        index=3, name="down.weight", shape=(24, 12), global_shape=(24, 24), placement=(("tp", Shard(1)),)
    ),
    ParamSpec(index=4, name="down.bias", shape=(24,)),  # plain: a replica on every tp rank
    ParamSpec(index=5, name="frozen", shape=(7,), trainable=False),
)


def test_replicas_are_the_parameters_no_tp_dimension_splits():
    assert tensor_replicas(SPECS) == frozenset({0, 4, 5})


@pytest.mark.parametrize("layout", ["rank_major", "interleaved"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_windows_hold_every_element_but_the_replicas_once(world, layout):
    zp = plan(SPECS, Topology(world_size=world), stage=2, layout=layout, alignment=4)
    replicas = tensor_replicas(SPECS)
    for rank in range(world):
        for s in range(len(zp.partition.spaces)):
            extent = max((f.shard_span.stop for f in zp.partition.rank_fragments(s, rank)), default=0)
            windows = norm_windows(zp.partition, rank, [extent], replicas)[0]
            covered = {i for w in windows for i in range(w.start, w.stop)}
            assert all(a.stop < b.start for a, b in itertools.pairwise(windows))  # merged
            for frag in zp.partition.rank_fragments(s, rank):
                inside = set(range(frag.shard_span.start, frag.shard_span.stop))
                if frag.param in replicas:
                    assert not inside & covered, (rank, frag)
                else:
                    assert inside <= covered, (rank, frag)


def test_nothing_skipped_is_one_window_per_space():
    zp = plan(SPECS, Topology(world_size=2), stage=2)
    assert norm_windows(zp.partition, 1, [40], frozenset()) == ((Span(0, 40),),)
