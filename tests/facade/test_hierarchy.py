"""The hierarchical parameter gather on gloo: world 4 as 2 simulated nodes of 2 (issue 13, part 2).

* With ``ranks_per_node=2`` and one shard group of 4, every equal-piece block is gathered in two
  hops (across nodes, then inside each); the run is bit-identical to the one-hop run, and the
  measured traffic equals the plan's, link by link.
* MiCS shard groups of 2 on nodes of 2 stay one hop (inside the node); replicas talk across nodes.
"""

from __future__ import annotations

import pytest
import scenarios_hierarchy

TWO_HOP_CASES = [
    {"stage": 2},
    {"stage": 2, "dtype": "bf16", "clip": True},
    {"stage": 1, "layout": "interleaved"},
    {"stage": 2, "overlap": False, "strategy": "lpt_whole"},  # unequal blocks: broadcasts stay one hop
]


@pytest.mark.parametrize("cfg", TWO_HOP_CASES)
def test_two_hop_gather_is_bit_identical_and_measured_as_planned(pools, cfg):
    for r in pools(4).run(scenarios_hierarchy.two_hops_against_one, {"per_node": 2, **cfg}):
        assert r["hierarchical"] and r["node_groups"] == (True, True)
        assert all(r["equal"]) and all(r["losses_equal"]), (r["equal"], r["losses_equal"])
        assert r["comm"] == r["planned_comm"]
        assert r["flat_comm"] == r["flat_planned_comm"]
        assert r["fingerprints_equal"]
        gathers = {(link, calls) for group, coll, link, calls, _ in r["comm"] if coll == "all_gather"}
        if cfg.get("strategy") != "lpt_whole":
            links = {link for link, _ in gathers}
            assert links == {"inter", "intra"}, r["comm"]
            inter = next(calls for link, calls in gathers if link == "inter")
            assert ("intra", 2 * inter) in gathers  # one gather per node chunk for each across-node one
        # the shard group spans both nodes: its other collectives are on the inter link
        assert {link for group, coll, link, *_ in r["comm"] if coll != "all_gather"} <= {"inter"}
        # two hops send what one hop sends, in total
        assert r["sent"][0] == r["sent"][1]


def test_mics_two_by_two_on_nodes_of_two_is_one_hop(pools):
    cfg = {"per_node": 2, "shard": 2, "stage": 2, "clip": True}
    for r in pools(4).run(scenarios_hierarchy.two_hops_against_one, cfg):
        assert not r["hierarchical"] and r["node_groups"] == (False, False)
        assert all(r["equal"]) and all(r["losses_equal"])
        assert r["comm"] == r["planned_comm"]
        links = {(group, link) for group, _, link, *_ in r["comm"]}
        # the step agreement spans both nodes ([Note: control calls])
        assert links == {("shard", "intra"), ("replica", "inter"), ("world", "inter")}, r["comm"]
        # the same calls and bytes as without nodes, only the replica link differs
        assert [row[:2] + row[3:] for row in r["comm"]] == [row[:2] + row[3:] for row in r["flat_comm"]]


def test_ranks_must_agree_on_ranks_per_node(pools):
    errors = pools(4).run(scenarios_hierarchy.disagreeing_ranks_per_node)
    for error in errors:
        assert error is not None and "ranks_per_node" in error, error


def test_optimizers_built_again_reuse_their_groups_and_remake_destroyed_ones(pools):
    """[Note: groups made once per job]: a second optimizer over the same shard, replica, node and
    cross-node groups makes none; after one is destroyed, the next construction makes its partition
    again (two groups: MiCS shard groups of 2, or nodes of 2, at world 4) and trains alike."""
    for result in pools(4).run(scenarios_hierarchy.groups_made_once):
        for name, r in result.items():
            assert r["same"] == [True, True, True, True], (name, r)
            assert r["made_by_second"] == 0, (name, r)
            assert r["made_by_third"] == 2, (name, r)
            assert r["renewed"] and r["equal"], (name, r)
