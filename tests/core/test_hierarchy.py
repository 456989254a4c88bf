"""Nodes, links and the two-hop parameter gather (``zeroplan.core.hierarchy``)."""

from __future__ import annotations

import pytest

from zeroplan.core import (
    Block,
    Collective,
    ConfigError,
    Link,
    PlanInvariantError,
    Span,
    Topology,
    communication,
    memory_report,
    plan,
    send_elements,
    specs_from_shapes,
    two_hop_gather,
    two_hop_send,
)
from zeroplan.core.hierarchy import GatherCall, TwoHopGather


# ----------------------------------------------------------------- topology: groups and links
def test_two_nodes_of_two():
    t = Topology(world_size=4, ranks_per_node=2)
    assert t.hierarchical
    assert t.node_groups() == ((0, 1), (2, 3))
    assert t.cross_node_groups() == ((0, 2), (1, 3))
    assert [t.node_position(r) for r in range(4)] == [0, 1, 0, 1]
    assert [t.cross_node_position(r) for r in range(4)] == [0, 0, 1, 1]
    assert t.shard_link(3) is Link.INTER and t.world_link is Link.INTER


def test_mics_shard_groups_of_two_nodes():
    t = Topology(world_size=8, shard_size=4, ranks_per_node=2)
    assert t.node_groups() == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert t.cross_node_groups() == ((0, 2), (1, 3), (4, 6), (5, 7))
    for rank in range(8):  # the hop groups split the shard group, and the rank is in both
        node, cross = t.node_group(rank), t.cross_node_group(rank)
        assert rank in node and rank in cross
        assert set(node) <= set(t.shard_group(rank)) and set(cross) <= set(t.shard_group(rank))
        assert not t.spans_nodes(node) and t.spans_nodes(cross)
        assert node[t.node_position(rank)] == rank and cross[t.cross_node_position(rank)] == rank


@pytest.mark.parametrize(
    ("world", "shard", "per_node"),
    [(4, 4, None), (4, 2, 2), (4, 4, 1), (4, 4, 4), (12, 6, 4), (8, 2, 4), (6, 6, 2), (8, 4, 8)],
)
def test_not_hierarchical_without_whole_nodes_in_a_shard_group(world, shard, per_node):
    t = Topology(world_size=world, shard_size=shard, ranks_per_node=per_node)
    assert t.hierarchical == (per_node is not None and 1 < per_node < shard and shard % per_node == 0)
    if not t.hierarchical:
        with pytest.raises(ConfigError, match="do not span whole nodes"):
            t.node_groups()
        with pytest.raises(ConfigError, match="do not span whole nodes"):
            t.cross_node_group(0)


@pytest.mark.parametrize(
    ("world", "shard", "per_node"),
    [(12, 4, 6), (12, 4, 4), (12, 6, 4), (8, 2, 1), (4, 4, None), (16, 4, 8), (16, 8, 2), (6, 3, 12)],
)
def test_links_in_constant_time_agree_with_the_groups_ranks(world, shard, per_node):
    t = Topology(world_size=world, shard_size=shard, ranks_per_node=per_node)

    def link(ranks):
        return Link.INTER if t.spans_nodes(ranks) else Link.INTRA

    for rank in range(world):
        assert t.shard_link(rank) is link(t.shard_group(rank))
        assert t.replica_link(rank) is link(t.replica_group(rank))
    assert t.world_link is link(tuple(range(world)))


def test_a_node_may_hold_parts_of_two_shard_groups():
    t = Topology(world_size=12, shard_size=4, ranks_per_node=6)
    assert [str(t.shard_link(r)) for r in (0, 4, 8)] == ["intra", "inter", "intra"]
    assert not t.hierarchical


# ----------------------------------------------------------------- the two hops of one block
def test_two_hop_spans_hand_computed():
    # 8 shard ranks on 4 nodes of 2; pieces of 5 from buffer offset 100.
    t = Topology(world_size=8, ranks_per_node=2)
    block = Block(start=100, pieces=(5,) * 8, shard_starts=(0,) * 8)
    hops = two_hop_gather(block, t, 3)  # node 1, position 1
    assert hops.across == GatherCall(
        link=Link.INTER,
        position=1,
        pieces=(Span(105, 110), Span(115, 120), Span(125, 130), Span(135, 140)),
    )
    assert [c.span for c in hops.within] == [Span(100, 110), Span(110, 120), Span(120, 130), Span(130, 140)]
    assert all(c.position == 1 and c.link is Link.INTRA for c in hops.within)
    assert not hops.across.contiguous


@pytest.mark.parametrize(("world", "shard", "per_node"), [(4, 4, 2), (8, 4, 2), (8, 8, 4), (12, 6, 3)])
def test_hops_follow_the_groups_and_fill_the_block_once(world, shard, per_node):
    t = Topology(world_size=world, shard_size=shard, ranks_per_node=per_node)
    block = Block(start=7, pieces=(3,) * shard, shard_starts=(2,) * shard)
    for rank in range(world):
        s = t.shard_rank(rank)
        hops = two_hop_gather(block, t, s)
        # hop 1 gathers the pieces of the cross-node group's members, hop 2 those of each node chunk
        members = [block.piece(t.shard_rank(q)).buffer_span for q in t.cross_node_group(rank)]
        assert list(hops.across.pieces) == members
        assert hops.across.position == t.cross_node_position(rank)
        mine = hops.within[t.cross_node_position(rank)]
        assert list(mine.pieces) == [block.piece(t.shard_rank(q)).buffer_span for q in t.node_group(rank)]
        assert all(c.position == t.node_position(rank) for c in hops.within)
        # hop 2 writes every element of the block exactly once
        written = sorted((p for c in hops.within for p in c.pieces), key=lambda p: p.start)
        assert written == [block.piece(q).buffer_span for q in range(shard)]


@pytest.mark.parametrize(("world", "per_node", "piece"), [(4, 2, 6), (8, 2, 5), (8, 4, 1), (12, 3, 7)])
def test_closed_form_equals_the_sum_over_the_calls(world, per_node, piece):
    t = Topology(world_size=world, ranks_per_node=per_node)
    block = Block(start=0, pieces=(piece,) * world, shard_starts=(0,) * world)
    inter, intra = two_hop_send(piece, t)
    for s in range(world):
        hops = two_hop_gather(block, t, s)
        assert (inter.link, inter.calls) == (Link.INTER, 1)
        assert inter.elements == send_elements(Collective.ALL_GATHER, hops.across.sizes, hops.across.position)
        assert (intra.link, intra.calls) == (Link.INTRA, len(hops.within))
        assert intra.elements == sum(
            send_elements(Collective.ALL_GATHER, c.sizes, c.position) for c in hops.within
        )
        # two hops send what the one-hop ring sends
        assert inter.elements + intra.elements == send_elements(Collective.ALL_GATHER, block.pieces, s)


def test_bad_two_hop_requests_are_refused():
    block = Block(start=0, pieces=(2, 2, 2, 2), shard_starts=(0,) * 4)
    with pytest.raises(ConfigError, match="does not gather in two hops"):
        two_hop_gather(block, Topology(world_size=4), 0)
    with pytest.raises(ConfigError, match="does not gather in two hops"):
        two_hop_send(2, Topology(world_size=4, shard_size=2, ranks_per_node=2))
    uneven = Block(start=0, pieces=(2, 2, 2, 1), shard_starts=(0,) * 4)
    with pytest.raises(ConfigError, match="unequal pieces"):
        two_hop_gather(uneven, Topology(world_size=4, ranks_per_node=2), 0)
    with pytest.raises(PlanInvariantError, match="position 2 outside"):
        GatherCall(link=Link.INTRA, position=2, pieces=(Span(0, 1), Span(1, 2)))
    across = GatherCall(link=Link.INTER, position=0, pieces=(Span(0, 1), Span(2, 3)))
    within = (GatherCall(link=Link.INTRA, position=0, pieces=(Span(0, 1), Span(1, 2))),)
    with pytest.raises(PlanInvariantError, match="starts from the piece the first hop delivered"):
        TwoHopGather(across=across, within=within)


# ----------------------------------------------------------------- the report: bytes per hop
def _comm(zp, rank):
    return {(c.group, c.collective.value, c.link.value): (c.calls, c.bytes) for c in communication(zp, rank)}


def test_hand_computed_two_hop_traffic_world_4_as_2_nodes_of_2():
    # 4 fp32 parameters of 64 in one interleaved bucket of 256 elements: 4 pieces of 64.
    specs = specs_from_shapes([(64,)] * 4)
    zp = plan(specs, Topology(world_size=4, ranks_per_node=2), stage=2, alignment=64, layout="interleaved")
    assert [b.pieces for s in zp.partition.spaces for b in s.blocks] == [(64, 64, 64, 64)]
    for rank in range(4):
        assert _comm(zp, rank) == {
            ("shard", "reduce_scatter", "inter"): (1, 3 * 64 * 4),
            ("shard", "all_gather", "inter"): (1, 64 * 4),  # one piece to the other node
            ("shard", "all_gather", "intra"): (2, 2 * 64 * 4),  # one piece per node chunk, to the neighbour
            ("world", "all_reduce", "inter"): (1, 6 * 8),  # the step agreement: 4 int64 over both nodes
        }
    flat = plan(specs, Topology(world_size=4), stage=2, alignment=64, layout="interleaved")
    assert _comm(flat, 0)[("shard", "all_gather", "intra")] == (1, 3 * 64 * 4)


def test_mics_two_by_two_is_one_hop_on_one_node_and_replicas_across():
    specs = specs_from_shapes([(64,)] * 4)
    zp = plan(specs, Topology(world_size=4, shard_size=2, ranks_per_node=2), stage=2, alignment=64)
    for rank in range(4):
        comm = _comm(zp, rank)
        assert {key[2] for key in comm if key[0] == "shard"} == {"intra"}
        assert {key[2] for key in comm if key[0] == "replica"} == {"inter"}
        assert comm[("shard", "all_gather", "intra")] == (1, 128 * 4)


def test_stage_3_gathers_in_two_hops_twice():
    specs = specs_from_shapes([(64,)] * 4)
    zp = plan(specs, Topology(world_size=8, shard_size=4, ranks_per_node=2), stage=3, alignment=32)
    buckets = [b for b in zp.buckets.buckets if b.collective is Collective.REDUCE_SCATTER]
    piece_bytes = sum(b.numel // 4 for b in buckets) * 4
    comm = _comm(zp, 5)
    assert comm[("shard", "all_gather", "inter")] == (2 * len(buckets), 2 * piece_bytes)
    assert comm[("shard", "all_gather", "intra")] == (4 * len(buckets), 2 * 2 * piece_bytes)


def test_report_json_names_the_link_and_sums_every_hop():
    zp = plan(specs_from_shapes([(17, 257), (3,)]), Topology(world_size=8, shard_size=4, ranks_per_node=2))
    document = memory_report(zp).as_dict()
    for record in document["ranks"]:
        assert {c["link"] for c in record["comm"]} == {"intra", "inter"}
        assert record["comm_bytes_per_step"] == sum(c["bytes"] for c in record["comm"])
        hops = [c for c in record["comm"] if c["collective"] == "all_gather"]
        assert sorted(c["link"] for c in hops) == ["inter", "intra"]


def test_ranks_per_node_leaves_the_fingerprint_and_the_total_bytes_alone():
    specs = specs_from_shapes([(17, 257), (3,)])
    one = plan(specs, Topology(world_size=4))
    for per_node in (None, 1, 2, 4, 8):
        zp = plan(specs, Topology(world_size=4, ranks_per_node=per_node))
        assert zp.fingerprint() == one.fingerprint()  # layouts, state and checkpoints do not change
        for rank in range(4):
            assert sum(c.bytes for c in communication(zp, rank)) == sum(
                c.bytes for c in communication(one, rank)
            )
