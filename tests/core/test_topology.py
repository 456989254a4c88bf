"""``Topology``: the replica x shard grid of data-parallel ranks."""

from __future__ import annotations

import dataclasses

import pytest

from zeroplan.core import ConfigError, Topology


def test_defaults_are_plain_zero_on_one_node():
    t = Topology(world_size=6)
    assert (t.shard_size, t.replica_size, t.ranks_per_node) == (6, 1, 6)
    assert t.shard_groups() == ((0, 1, 2, 3, 4, 5),)
    assert t.replica_groups() == tuple((r,) for r in range(6))


def test_mics_grid():
    t = Topology(world_size=12, shard_size=4, ranks_per_node=4)
    assert t.replica_size == 3
    assert t.shard_groups() == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    assert t.replica_groups() == ((0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11))
    assert [t.shard_rank(r) for r in range(12)] == [0, 1, 2, 3] * 3
    assert [t.replica_rank(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert t.shard_group(9) == (8, 9, 10, 11) and t.replica_group(9) == (1, 5, 9)
    # Shard groups live on one node, replica groups cross nodes.
    assert not any(t.spans_nodes(g) for g in t.shard_groups())
    assert all(t.spans_nodes(g) for g in t.replica_groups())


def test_every_rank_is_in_exactly_one_shard_group_and_one_replica_group():
    t = Topology(world_size=24, shard_size=6)
    for groups in (t.shard_groups(), t.replica_groups()):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(24))


def test_ranks_per_node_larger_than_world_is_one_node():
    t = Topology(world_size=4, ranks_per_node=8)
    assert not t.spans_nodes((0, 1, 2, 3))


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"world_size": 0}, ["world size", "got 0"]),
        ({"world_size": -8}, ["world size", "-8"]),
        ({"world_size": 8.0}, ["world size", "8.0"]),
        ({"world_size": True}, ["world size", "True"]),
        ({"world_size": 8, "shard_size": 0}, ["shard size", "got 0"]),
        ({"world_size": 8, "shard_size": -2}, ["shard size", "-2"]),
        ({"world_size": 8, "shard_size": 3}, ["shard size 3 does not divide world size 8", "divisor"]),
        ({"world_size": 4, "shard_size": 8}, ["shard size 8 does not divide world size 4"]),
        ({"world_size": 8, "ranks_per_node": 0}, ["ranks per node", "got 0"]),
        ({"world_size": 8, "ranks_per_node": 3}, ["ranks per node 3 does not divide world size 8"]),
    ],
)
def test_bad_topologies_are_config_errors_naming_the_value(kwargs, needles):
    with pytest.raises(ConfigError) as info:
        Topology(**kwargs)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_ranks_outside_the_world_are_rejected(rank):
    t = Topology(world_size=8, shard_size=4)
    for query in (t.shard_rank, t.replica_rank, t.shard_group, t.replica_group):
        with pytest.raises(ConfigError, match=f"rank {rank} is outside world of size 8"):
            query(rank)


def test_topology_is_frozen():
    t = Topology(world_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.world_size = 16  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.replica_size = 2  # type: ignore[misc]
    assert t == Topology(world_size=8, shard_size=8, ranks_per_node=8)
