"""``communication(zp, rank)`` equals the per-call cost model summed over every call the facade issues.

The facade issues, per step and world rank (stages 1 and 2):

* per bucket, one reduce-family call on the shard group with ``bucket.piece_sizes(N)``;
* with replicas (MiCS), one all-reduce on the replica group per non-empty piece the rank holds;
* per block of each dtype space, the gather on the shard group: one ``all_gather`` over the block's
  pieces (on a hierarchical topology, the calls of ``two_hop_gather``: one across nodes, one per node
  chunk inside the node), or one ``broadcast`` per rank ``q`` with a piece (pieces
  ``[0, .., piece[q], .., 0]``);
* one single-element fp32 all-reduce on the shard group for the loss-scale overflow check and
  one for gradient clipping, when used;
* the step agreement: one all-reduce of 4 int64 over the world.

Groups of one rank issue nothing. Each call is on the link of its group's ranks. ``communication``
computes the same totals in closed form.
"""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from property_tests.strategies import alignments, bucket_caps, param_specs, topologies
from zeroplan.core import (
    Collective,
    Link,
    Topology,
    communication,
    plan,
    send_elements,
    specs_from_shapes,
    two_hop_gather,
)


def _per_call_traffic(zp, rank, clipping):
    topology = zp.topology
    n, replicas = topology.shard_size, topology.replica_size
    s, g = topology.shard_rank(rank), topology.replica_rank(rank)
    spaces = zp.partition.spaces
    totals = {}
    links = {
        "shard": topology.shard_group(rank),
        "replica": topology.replica_group(rank),
        "world": tuple(range(topology.world_size)),
    }
    links = {
        group: Link.INTER if topology.spans_nodes(ranks) else Link.INTRA for group, ranks in links.items()
    }

    def call(group, collective, elements, itemsize, link=None):
        entry = totals.setdefault((group, collective, link or links[group]), [0, 0])
        entry[0] += 1
        entry[1] += elements * itemsize

    for bucket in zp.buckets.buckets:
        itemsize = zp.specs[spaces[bucket.space].params[0]].itemsize
        sizes = bucket.piece_sizes(n)
        if n > 1:
            call("shard", bucket.collective, send_elements(bucket.collective, sizes, s), itemsize)
        if replicas > 1 and sizes[s]:
            call(
                "replica",
                Collective.ALL_REDUCE,
                send_elements(Collective.ALL_REDUCE, [sizes[s]] * replicas, g),
                itemsize,
            )
    for space in spaces:
        itemsize = zp.specs[space.params[0]].itemsize
        if n == 1:
            continue
        for block in zp.gather_blocks(space):  # [Note: gather blocks]
            if zp.gather_collective(block) is Collective.ALL_GATHER and topology.hierarchical:
                hops = two_hop_gather(block, topology, s)
                for c in (hops.across, *hops.within):
                    sent = send_elements(Collective.ALL_GATHER, c.sizes, c.position)
                    call("shard", Collective.ALL_GATHER, sent, itemsize, link=c.link)
                continue
            if zp.gather_collective(block) is Collective.ALL_GATHER:
                sent = send_elements(Collective.ALL_GATHER, block.pieces, s)
                call("shard", Collective.ALL_GATHER, sent, itemsize)
                continue
            for q, size in enumerate(block.pieces):
                if size:
                    pieces = [0] * n
                    pieces[q] = size
                    call(
                        "shard",
                        Collective.BROADCAST,
                        send_elements(Collective.BROADCAST, pieces, s),
                        itemsize,
                    )
    for used in (zp.loss_scaling, clipping):
        if used and n > 1:
            call("shard", Collective.ALL_REDUCE, send_elements(Collective.ALL_REDUCE, [1] * n, s), 4)
    world = topology.world_size
    if world > 1:
        call("world", Collective.ALL_REDUCE, send_elements(Collective.ALL_REDUCE, [4] * world, rank), 8)
    return {key: tuple(value) for key, value in totals.items()}


@given(
    specs=param_specs(),
    topology=topologies(),
    alignment=alignments,
    bucket_bytes=bucket_caps,
    stage=st.sampled_from([1, 2]),
    loss_scaling=st.booleans(),
    clipping=st.booleans(),
    layout=st.sampled_from(["auto", "rank_major"]),
)
@example(
    specs=specs_from_shapes([(17, 257), (3,), (0,)], dtype="bf16"),
    topology=Topology(world_size=8, shard_size=4, ranks_per_node=2),
    alignment=8,
    bucket_bytes=2048,
    stage=2,
    loss_scaling=True,
    clipping=True,
    layout="auto",
)
def test_communication_equals_sum_of_calls(
    strategy_name, specs, topology, alignment, bucket_bytes, stage, loss_scaling, clipping, layout
):
    """Both layouts: ``"auto"`` interleaves the built-in strategies (a gather per block); the
    topologies put ranks on nodes (two-hop gathers where shard groups span whole nodes)."""
    zp = plan(
        specs,
        topology,
        stage=stage,
        strategy=strategy_name,
        optimizer="SGD",
        alignment=alignment,
        bucket_bytes=bucket_bytes,
        loss_scaling=loss_scaling,
        layout=layout,
    )
    for rank in range(topology.world_size):
        expected = _per_call_traffic(zp, rank, clipping)
        got = {
            (c.group, c.collective, c.link): (c.calls, c.bytes)
            for c in communication(zp, rank, clipping=clipping)
        }
        assert len(got) == len(communication(zp, rank, clipping=clipping)), (
            "duplicate (group, collective, link) rows"
        )
        assert got == expected, f"rank {rank}: report {got} != per-call sum {expected}"
