"""The memory and traffic report: the ZeRO paper's family, hand-computed traffic, per-call sums."""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict

import pytest

from zeroplan.core import (
    Collective,
    CommCost,
    Link,
    ParamSpec,
    PlanInvariantError,
    RankReport,
    Stage,
    Topology,
    communication,
    memory_report,
    plan,
    preset_specs,
    send_elements,
    specs_from_shapes,
    two_hop_gather,
)
from zeroplan.core.comm import all_reduce_send

# ----------------------------------------------------------------- the ZeRO paper's family
#: 164,864 = 4 ranks x 128 alignment x 322: flat_even shards have no padding.
EVEN_SHAPES = [(512, 256), (1024,), (256, 128)]
#: Odd shapes: padding and uneven shards.
ODD_SHAPES = [(17, 257), (3,), (1000, 7), (31,), (257, 17)]
SCALAR = 4  # torch keeps AdamW's `step` as a 4-byte scalar per stepped tensor


def rank_major_plan(*args, **kwargs):
    """``plan`` with the rank-major layout, whose numbers these tests compute by hand."""
    return plan(*args, layout="rank_major", **kwargs)


def _family(stage: int, psi: int, n: int, p: int, k: int) -> float:
    """The ZeRO paper's params + grads + optimizer bytes per rank (K includes fp32 master)."""
    return {
        0: p * psi + p * psi + k * psi,
        1: p * psi + p * psi + k * psi / n,
        2: p * psi + (p + k) * psi / n,
        3: (p + p + k) * psi / n,
    }[stage]


def _extras(stage: int, psi: int, n: int, p: int, tensors: int, inner: int, region: bool = True) -> float:
    """What zeroplan keeps beyond the paper's formula (see memory.py's [Note: what is counted]).

    ``region``: whether each shard is a region of the full buffer (rank-major, or one block).
    Otherwise (interleaved) stage 1 reduces into an fp32 gradient shard of its own beside the full
    gradients. fp32 parameters never get a master of their own: stages 1-2 step the rank's pieces of
    the full buffer (``inner`` windows: one per piece when interleaved), stage 3 its shard.
    """
    if stage == 0:
        return SCALAR * tensors  # one `step` per parameter, every rank steps all of them
    fp32_grad_shard = (4 - p) * psi / n if stage >= 2 else 0  # bf16/fp16 reduced into fp32
    if not region and stage == 1:
        fp32_grad_shard = 4 * psi / n
    return fp32_grad_shard + SCALAR * inner


def _counted(r: RankReport) -> int:
    return r.params_bytes + r.grads_bytes + r.master_bytes + r.optimizer_state_bytes


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("dtype", "p", "k"), [("bf16", 2, 12), ("fp16", 2, 12), ("fp32", 4, 8)])
def test_zero_family_exactly_when_shards_need_no_padding(stage, dtype, p, k):
    specs = specs_from_shapes(EVEN_SHAPES, dtype=dtype)
    psi, n = sum(s.numel for s in specs), 4
    assert psi % (n * 128) == 0
    report = memory_report(plan(specs, Topology(world_size=n), stage=stage, optimizer="AdamW"))
    for r in report.ranks:
        expected = _family(stage, psi, n, p, k) + _extras(stage, psi, n, p, len(specs), inner=1)
        assert _counted(r) == expected, (stage, dtype, r)
        # K = 12 splits into 4 bytes of fp32 master and 8 of Adam moments (K = 8 without a master).
        master_per_element = 4 if k == 12 else 0
        if stage == 0:
            assert r.master_bytes == master_per_element * psi
        else:
            assert r.master_bytes == master_per_element * psi // n


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("dtype", "p", "k"), [("bf16", 2, 12), ("fp32", 4, 8)])
@pytest.mark.parametrize(("world", "shard"), [(4, 4), (12, 4), (5, 5)])
@pytest.mark.parametrize(("layout", "bucket_bytes"), [("rank_major", 2**20), ("interleaved", 8192)])
def test_zero_family_up_to_padding_with_odd_shapes(stage, dtype, p, k, world, shard, layout, bucket_bytes):
    alignment = 128
    specs = specs_from_shapes(ODD_SHAPES, dtype=dtype)
    psi = sum(s.numel for s in specs)
    topology = Topology(world_size=world, shard_size=shard)
    zp = plan(specs, topology, stage=stage, alignment=alignment, bucket_bytes=bucket_bytes, layout=layout)
    (space,) = zp.partition.spaces
    assert zp.partition.layout == layout and space.shard_is_region == (layout == "rank_major")
    # Rank-major: padding is below one alignment unit per rank, at the end of each shard. Interleaved
    # (flat_even): below one unit of shard x alignment in all, at the front of the first block, so
    # one rank may hold nearly all of it.
    # Stage 3 pads every block (blocks end at parameter boundaries) to such a unit.
    slack = alignment if layout == "rank_major" else shard * alignment
    if stage == 3 and layout != "rank_major":
        slack *= len(space.blocks)
    assert 0 <= space.buffer_numel - space.numel < slack
    report = memory_report(zp)
    for r in report.ranks:
        s = r.shard_rank
        assert 0 <= space.shard_numel[s] - space.owned[s] < slack
        assert abs(space.owned[s] - psi / shard) <= slack
        inner = len(zp.inner_tensors(s))
        # One window, cut where the rank steps its pieces of the full buffer in place and one piece
        # does not follow the last there (always, with other ranks' pieces between).
        in_place = layout == "interleaved" and stage in (1, 2) and dtype == "fp32"
        assert inner == (len(space.pieces_of(s)) if in_place and shard > 1 else 1)
        region = space.shard_is_region
        expected = _family(stage, psi, shard, p, k) + _extras(stage, psi, shard, p, len(specs), inner, region)
        # bytes per element held per shard: fp32 master + state (K), the gradient shard (p, or 4 for
        # an interleaved stage 1), and at stage 3 the parameter shard (p); nothing is sharded at stage 0.
        sharded = {0: 0, 1: k + p, 2: k + p, 3: k + 2 * p}[stage] + (
            4 if not region and stage in (1, 2) else 0
        )
        assert abs(_counted(r) - expected) <= sharded * 2 * slack, r


@pytest.mark.parametrize("strategy", ["lpt_whole", "greedy_whole", "flat_even"])
@pytest.mark.parametrize(("layout", "bucket_bytes"), [("rank_major", 2**20), ("interleaved", 8192)])
def test_summed_over_ranks_sharded_bytes_are_the_model_plus_padding(strategy, layout, bucket_bytes):
    specs = specs_from_shapes(ODD_SHAPES, dtype="bf16")
    psi, n, alignment = sum(s.numel for s in specs), 4, 128
    topology = Topology(world_size=n)
    zp = plan(
        specs,
        topology,
        stage=3,
        strategy=strategy,
        alignment=alignment,
        bucket_bytes=bucket_bytes,
        layout=layout,
    )
    report = memory_report(zp)
    (space,) = zp.partition.spaces
    padding = sum(space.shard_numel) - psi
    # Rank-major: below one alignment unit per rank. Interleaved at stage 3: flat_even pads every block
    # (blocks end at parameter boundaries) to a multiple of n x alignment; whole-parameter blocks pad
    # each piece to the alignment.
    blocks = len(space.blocks)
    assert 0 <= padding < n * alignment * blocks
    assert padding == space.buffer_numel - psi or layout == "rank_major"
    assert sum(r.master_bytes for r in report.ranks) == 4 * (psi + padding)
    assert sum(r.params_bytes for r in report.ranks) == 2 * (psi + padding)
    assert sum(r.grads_bytes for r in report.ranks) == 4 * (psi + padding)  # bf16 reduced into fp32
    inner = sum(len(zp.inner_tensors(s)) for s in range(n))
    # Adam's two moments per element the rank steps: its windows, which run over the padding
    # between its fragments (interleaved) but not past the last one.
    stepped = sum(t.shard_span.numel for s in range(n) for t in zp.inner_tensors(s))
    assert psi <= stepped <= psi + padding and (stepped == psi or layout == "interleaved")
    assert sum(r.optimizer_state_bytes for r in report.ranks) == 8 * stepped + SCALAR * inner


def test_sgd_without_momentum_keeps_no_state_and_fp32_no_master():
    report = memory_report(plan(specs_from_shapes(EVEN_SHAPES), Topology(world_size=4), optimizer="SGD"))
    assert {(r.master_bytes, r.optimizer_state_bytes) for r in report.ranks} == {(0, 0)}


def test_ranks_that_own_nothing_have_no_master_or_state():
    specs = specs_from_shapes([(3,)], dtype="bf16")
    report = memory_report(rank_major_plan(specs, Topology(world_size=4), stage=2, alignment=4))
    # flat_even: 1 unit of 4 for 4 ranks, the last one owns [0, 3).
    assert [(r.master_bytes, r.optimizer_state_bytes, r.grads_bytes) for r in report.ranks] == [
        (0, 0, 0),
        (0, 0, 0),
        (0, 0, 0),
        (16, 2 * 3 * 4 + SCALAR, 16),  # its bf16 gradients are reduced into an fp32 shard of 4
    ]
    assert all(r.params_bytes == 6 for r in report.ranks)


def test_frozen_parameters_are_replicated_without_grads_or_state():
    specs = specs_from_shapes([(128,), (17, 257)], dtype="bf16", trainable=[True, False])
    for stage in (0, 1, 2, 3):
        report = memory_report(plan(specs, Topology(world_size=2), stage=stage, alignment=64))
        frozen = 4369 * 2
        trainable_params = 256 if stage < 3 else 128
        assert {r.params_bytes for r in report.ranks} == {frozen + trainable_params}
        if stage == 0:
            assert {r.grads_bytes for r in report.ranks} == {256}


def test_buffers_are_the_staging_arena_and_the_fp32_scratch_is_transient():
    specs = specs_from_shapes([(4096,)], dtype="bf16")

    def report(stage, bucket_bytes, inflight=2):
        zp = rank_major_plan(
            specs,
            Topology(world_size=4),
            stage=stage,
            bucket_bytes=bucket_bytes,
            max_inflight_buckets=inflight,
        )
        return memory_report(zp).ranks[0]

    def buffers(stage, bucket_bytes, inflight=2):
        return report(stage, bucket_bytes, inflight).buffer_bytes

    # Stage 1, 1 KiB buckets: room for the buckets in flight, 2 or 8 of them ([Note: staging arena]).
    assert buffers(1, 1024) == 2048
    assert buffers(1, 1024, inflight=8) == 8192
    # The fp32 copy of the 1024 reduced elements (4 KiB) lives inside step() only.
    assert report(1, 1024).step_transient_bytes >= 4096
    assert report(1, 1024).step_transient_bytes - report(2, 1024).step_transient_bytes == 4096
    # Stage 2 reduces into fp32 (no copy): staging only. A 1 KiB bucket lies in one rank's shard
    # and is reduced to it in place; the 8 KiB one below is reduce-scattered, and each rank's
    # staging has room for its 2 KiB bf16 piece.
    assert buffers(2, 1024) == 2048
    # One 8 KiB bucket: room for it alone; stage 3 stages as stage 2 (its gathered blocks are in the
    # backward's transient bytes, not in the buffers).
    assert buffers(1, 2**20) == 8192
    assert buffers(2, 2**20) == 8192 + 2048
    assert buffers(3, 2**20) == 8192 + 2048
    # Stage 0: DDP's flat bucket copy of every gradient.
    assert buffers(0, 1024) == 8192


# ----------------------------------------------------------------- traffic, by hand
#: fp32 [a*5 b*7] over 2 ranks, alignment 1, 16-byte buckets: [8,12) -> r1 (reduce),
#: [4,8) -> r0 2 + r1 2 (reduce_scatter), [0,4) -> r0 (reduce).
SMALL = specs_from_shapes([(5,), (7,)], names=["a", "b"])


def _small(stage: int, world: int = 2, shard: int = 2, **kwargs) -> list[RankReport]:
    zp = rank_major_plan(
        SMALL,
        Topology(world_size=world, shard_size=shard),
        stage=stage,
        alignment=1,
        bucket_bytes=16,
        **kwargs,
    )
    return list(memory_report(zp).ranks)


def _costs(r: RankReport) -> dict[tuple[str, str], tuple[int, int]]:
    return {(c.group, c.collective.value): (c.calls, c.bytes) for c in r.comm}


def test_hand_computed_traffic_stage_2():
    for r in _small(2):
        assert _costs(r) == {
            ("shard", "reduce"): (2, 16),  # r0 sends [8,12) to r1; r1 sends [0,4) to r0: 4 fp32
            ("shard", "reduce_scatter"): (1, 8),  # 2 of 4 elements leave each rank
            # 12-element buffer, 6 per rank, gathered in chunks of a 16-byte bucket (4, 2 per rank,
            # [Note: gather blocks]), each broadcast by its owner: each rank sends its 6
            ("shard", "broadcast"): (4, 24),
            ("world", "all_reduce"): (1, 32),  # the step agreement: 4 int64, a 2-rank ring sends 4
        }
        assert r.comm_bytes_per_step == 80


def test_hand_computed_memory_stage_1_and_2():
    r1, r2 = _small(1)[0], _small(2)[0]
    # stage 1 reduces in place into its full gradient buffer: no separate shard
    assert (r1.params_bytes, r1.grads_bytes, r1.master_bytes, r1.optimizer_state_bytes) == (48, 48, 0, 52)
    assert (r2.params_bytes, r2.grads_bytes, r2.master_bytes, r2.optimizer_state_bytes) == (48, 24, 0, 52)
    assert r1.buffer_bytes == r2.buffer_bytes == 32  # two 16-byte buckets in flight
    assert r2.total_bytes == 48 + 24 + 52 + 32


def test_hand_computed_traffic_stage_0_is_ddp_all_reduce():
    for r in _small(0):
        # three 4-element buckets, ring all-reduce over 2 ranks: 4 elements each
        assert _costs(r) == {("world", "all_reduce"): (3, 48)}
        assert (r.params_bytes, r.grads_bytes, r.optimizer_state_bytes, r.buffer_bytes) == (48, 48, 104, 48)


def test_hand_computed_traffic_stage_3_gathers_each_block_twice():
    r0, r1 = _small(3)
    # Rank-major: one block of 12 fp32 elements, 6 per rank, all-gathered for the forward and again
    # for the backward: each rank sends its 6 elements (24 bytes) per gather. Gradients as at stage 2.
    for r in (r0, r1):
        assert _costs(r) == {
            ("shard", "reduce"): (2, 16),
            ("shard", "reduce_scatter"): (1, 8),
            ("shard", "all_gather"): (2, 48),
            ("world", "all_reduce"): (1, 32),  # the step agreement
        }
    assert r0.params_bytes == 24  # its shard


def test_hand_computed_mics_replica_all_reduce():
    ranks = _small(2, world=4, shard=2)
    for r in ranks:
        costs = _costs(r)
        # each rank's pieces are 4 and 2 elements; a 2-rank ring all-reduce of m sends m
        assert costs[("replica", "all_reduce")] == (2, (4 + 2) * 4)
        assert costs[("shard", "broadcast")] == (4, 24)  # bucket-sized chunks ([Note: gather blocks])
    assert [r.shard_rank for r in ranks] == [0, 1, 0, 1]


def test_clipping_and_loss_scaling_add_one_scalar_all_reduce_each():
    zp = plan(SMALL, Topology(world_size=2), alignment=1, bucket_bytes=16, loss_scaling=True)
    costs = {(c.group, c.collective.value): (c.calls, c.bytes) for c in communication(zp, 0, clipping=True)}
    assert costs[("shard", "all_reduce")] == (2, 8)
    ddp = plan(SMALL, Topology(world_size=2), stage=0, alignment=1, bucket_bytes=16)
    costs = {(c.group, c.collective.value): (c.calls, c.bytes) for c in communication(ddp, 1, clipping=True)}
    assert costs[("world", "all_reduce")] == (4, 48 + 4)


def test_a_single_rank_sends_nothing():
    report = memory_report(plan(SMALL, Topology(world_size=1), stage=2, loss_scaling=True), clipping=True)
    assert report.ranks[0].comm == () and report.ranks[0].comm_bytes_per_step == 0


# ----------------------------------------------------------------- traffic, call by call
def _per_call(zp, clipping: bool) -> list[dict[tuple[str, Collective, Link], list[int]]]:
    """Traffic summed one collective call at a time with ``send_elements`` (no linearity tricks).

    Links are read off the groups' ranks (``Topology.spans_nodes``); on hierarchical topologies
    equal-piece gathers are the calls of ``two_hop_gather``.
    """
    topo, n, r = zp.topology, zp.topology.shard_size, zp.topology.replica_size
    spaces = zp.partition.spaces
    out: list[dict[tuple[str, Collective, Link], list[int]]] = []

    def link_of(ranks):
        return Link.INTER if topo.spans_nodes(ranks) else Link.INTRA

    for w in range(topo.world_size):
        s, g = topo.shard_rank(w), topo.replica_rank(w)
        tally: dict[tuple[str, Collective, Link], list[int]] = defaultdict(lambda: [0, 0])
        links = {
            "shard": link_of(topo.shard_group(w)),
            "replica": link_of(topo.replica_group(w)),
            "world": link_of(tuple(range(topo.world_size))),
        }

        def add(group, collective, nbytes, tally=tally, links=links, link=None):
            key = (group, collective, link or links[group])
            tally[key][0] += 1
            tally[key][1] += nbytes

        def broadcasts(pieces, isz, s=s, add=add):
            for q, size in enumerate(pieces):  # one chain broadcast q, q+1, ... per owner
                if size:
                    add("shard", Collective.BROADCAST, 0 if s == (q - 1) % n else size * isz)

        def all_gather(block, isz, s=s, w=w, add=add):
            if not topo.hierarchical:
                add(
                    "shard",
                    Collective.ALL_GATHER,
                    send_elements(Collective.ALL_GATHER, block.pieces, s) * isz,
                )
                return
            hops = two_hop_gather(block, topo, s)
            assert len(hops.across.pieces) == len(topo.cross_node_group(w))
            for call in (hops.across, *hops.within):
                sent = send_elements(Collective.ALL_GATHER, call.sizes, call.position) * isz
                add("shard", Collective.ALL_GATHER, sent, link=call.link)

        for b in zp.buckets.buckets:
            isz = zp.specs[spaces[b.space].params[0]].itemsize
            if zp.stage is Stage.DDP:
                if topo.world_size > 1:
                    add("world", Collective.ALL_REDUCE, all_reduce_send(b.numel, topo.world_size, w) * isz)
                continue
            sizes = b.piece_sizes(n)
            if n > 1:
                add("shard", b.collective, send_elements(b.collective, sizes, s) * isz)
            if r > 1 and sizes[s]:
                add("replica", Collective.ALL_REDUCE, all_reduce_send(sizes[s], r, g) * isz)
        # Stage 3 gathers every block for the forward and again for the backward.
        times = {Stage.OPTIMIZER: 1, Stage.GRADIENTS: 1, Stage.PARAMETERS: 2}.get(zp.stage, 0)
        for _ in range(times if n > 1 else 0):
            for space in spaces:
                isz = zp.specs[space.params[0]].itemsize
                for block in zp.gather_blocks(space):  # [Note: gather blocks]
                    if zp.gather_collective(block) is Collective.ALL_GATHER:
                        all_gather(block, isz)
                    else:
                        broadcasts(block.pieces, isz)
        group, size, position = ("world", topo.world_size, w) if zp.stage is Stage.DDP else ("shard", n, s)
        for _ in range(int(zp.loss_scaling) + int(clipping)):
            if size > 1:
                add(group, Collective.ALL_REDUCE, all_reduce_send(1, size, position) * 4)
        if zp.stage is not Stage.DDP and topo.world_size > 1:  # the step agreement: 4 int64 over the world
            add("world", Collective.ALL_REDUCE, all_reduce_send(4, topo.world_size, w) * 8)
        out.append(dict(tally))
    return out


MIXED = (
    ParamSpec(index=0, name="emb", shape=(17, 257), dtype="bf16"),
    ParamSpec(index=1, name="bias", shape=(31,), dtype="fp32"),
    ParamSpec(index=2, name="frozen", shape=(5, 5), dtype="bf16", trainable=False),
    ParamSpec(index=3, name="proj", shape=(257, 17), dtype="bf16"),
    ParamSpec(index=4, name="empty", shape=(0,), dtype="fp32"),
    ParamSpec(index=5, name="gain", shape=(3,), dtype="fp32"),
)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("strategy", ["flat_even", "lpt_whole"])
@pytest.mark.parametrize(
    ("world", "shard", "per_node"),
    [(6, 3, None), (4, 4, None), (8, 2, None), (3, 1, None), (4, 4, 2), (8, 4, 2), (8, 8, 4), (12, 4, 6)],
)
@pytest.mark.parametrize("layout", ["interleaved", "rank_major"])
def test_report_traffic_equals_the_sum_of_per_call_costs(stage, strategy, world, shard, per_node, layout):
    """Also with nodes: two-hop gathers (4/2, 8/4/2, 8/8/4) and shard groups on one node or two (12/4/6)."""
    zp = plan(
        MIXED,
        Topology(world_size=world, shard_size=shard, ranks_per_node=per_node),
        stage=stage,
        strategy=strategy,
        alignment=8,
        bucket_bytes=2000,
        loss_scaling=True,
        layout=layout,
    )
    assert zp.partition.layout == layout
    expected = _per_call(zp, clipping=True)
    report = memory_report(zp, clipping=True)
    for w, r in enumerate(report.ranks):
        got = {(c.group, c.collective, c.link): [c.calls, c.bytes] for c in r.comm}
        assert len(got) == len(r.comm), "duplicate (group, collective, link) rows"
        assert got == expected[w], (w, got, expected[w])


# ----------------------------------------------------------------- report values
def test_report_records_and_json_shape():
    zp = plan(specs_from_shapes(ODD_SHAPES, dtype="bf16"), Topology(world_size=8, shard_size=4), stage=2)
    report = memory_report(zp)
    assert (report.world, report.shard_size, report.stage, report.strategy) == (8, 4, 2, "flat_even")
    assert report.fingerprint == zp.fingerprint()
    assert report.total_params == sum(s.numel for s in zp.specs)
    document = report.as_dict()
    assert set(document) >= {"fingerprint", "world", "shard_size", "stage", "strategy", "ranks"}
    for rank, record in enumerate(document["ranks"]):
        r = report.ranks[rank]
        assert record["rank"] == rank and record["shard_rank"] == rank % 4
        assert record["total_bytes"] == (
            r.params_bytes + r.grads_bytes + r.master_bytes + r.optimizer_state_bytes + r.buffer_bytes
        )
        assert record["comm_bytes_per_step"] == sum(c["bytes"] for c in record["comm"])
    # Ranks of one replica group hold identical shards.
    assert report.ranks[1].total_bytes == report.ranks[5].total_bytes
    assert communication(zp, 5) == report.ranks[5].comm


def test_report_values_are_frozen_and_validated():
    report = memory_report(plan(specs_from_shapes(ODD_SHAPES), Topology(world_size=2)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.ranks[0].total_bytes = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.world = 3  # type: ignore[misc]
    with pytest.raises(PlanInvariantError, match="negative byte count in report of rank 3"):
        RankReport(
            rank=3,
            shard_rank=3,
            params_bytes=1,
            grads_bytes=-1,
            master_bytes=0,
            optimizer_state_bytes=0,
            buffer_bytes=0,
            comm=(CommCost(group="shard", collective=Collective.REDUCE, calls=1, bytes=2),),
        )


def test_gloo_policy_all_reduces_buckets_over_the_world_and_broadcasts_parameters():
    """Under the GLOO collective policy every bucket is one world all-reduce (no replica step)
    and each shard group gathers parameters by one broadcast per owning rank."""
    from zeroplan.core import Collective, CollectivePolicy, Topology, communication, specs_from_shapes
    from zeroplan.core.comm import all_reduce_send

    specs = specs_from_shapes([(17, 257), (3,), (64,)])
    topology = Topology(world_size=4, shard_size=2)
    zp = rank_major_plan(specs, topology, alignment=8, bucket_bytes=4096, policy=CollectivePolicy.GLOO)
    assert {b.collective for b in zp.buckets.buckets} == {Collective.ALL_REDUCE}
    for rank in range(4):
        costs = {(c.group, c.collective): c for c in communication(zp, rank)}
        world = costs["world", Collective.ALL_REDUCE]  # the buckets, and the step agreement (4 int64)
        assert world.calls == len(zp.buckets.buckets) + 1
        buckets = sum(all_reduce_send(b.numel, 4, rank) * 4 for b in zp.buckets.buckets)
        assert world.bytes == buckets + all_reduce_send(4, 4, rank) * 8
        gather = costs["shard", Collective.BROADCAST]
        space = zp.partition.spaces[0]
        assert gather.calls == len(zp.gather_blocks(space))  # bucket-sized chunks, one owner each
        assert gather.bytes == (space.numel - space.owned[(topology.shard_rank(rank) + 1) % 2]) * 4
        assert ("replica", Collective.ALL_REDUCE) not in costs
    assert zp.fingerprint() != rank_major_plan(specs, topology, alignment=8, bucket_bytes=4096).fingerprint()


def test_gloo_policy_exchanges_equal_pieces_sending_what_min_bytes_sends():
    """Interleaved (equal) pieces under GLOO: the same reduce-scatter, replica all-reduce and
    all-gather, call for call and byte for byte, as MIN_BYTES (run as point-to-point exchanges);
    only the peak differs, by the room for the N - 1 received pieces of the buckets in flight."""
    from zeroplan.core import Collective, CollectivePolicy, Topology, communication, plan, specs_from_shapes

    specs = specs_from_shapes([(17, 257), (3,), (64,)])
    topology = Topology(world_size=4, shard_size=2)
    gloo, nccl = (
        plan(specs, topology, alignment=8, bucket_bytes=4096, policy=p)
        for p in (CollectivePolicy.GLOO, CollectivePolicy.MIN_BYTES)
    )
    assert {b.collective for b in gloo.buckets.buckets} == {Collective.REDUCE_SCATTER}
    assert all(gloo.exchanges(b.collective) for b in gloo.buckets.buckets)
    assert not any(nccl.exchanges(b.collective) for b in nccl.buckets.buckets)
    for rank in range(4):
        costs = communication(gloo, rank)
        assert costs == communication(nccl, rank)
        assert {(c.group, c.collective) for c in costs} == {
            ("shard", Collective.REDUCE_SCATTER),
            ("shard", Collective.ALL_GATHER),
            ("replica", Collective.ALL_REDUCE),
            ("world", Collective.ALL_REDUCE),  # the step agreement
        }
    peak = [r.peak_bytes for r in memory_report(gloo).ranks]
    assert all(a > b for a, b in zip(peak, (r.peak_bytes for r in memory_report(nccl).ranks), strict=True))


def test_unknown_collective_policy_is_a_config_error():
    import pytest

    from zeroplan.core import ConfigError, Topology, plan, specs_from_shapes

    with pytest.raises(ConfigError, match="unknown collective policy 'fast'"):
        plan(specs_from_shapes([(4,)]), Topology(world_size=2), policy="fast")


def test_stage_1_at_shard_size_8_is_the_zero_papers_4_psi_plus_12_psi_over_n():
    # The ZeRO paper's P_os with mixed precision: 2Ψ bf16 parameters, 2Ψ bf16 gradients, 12Ψ/N of fp32
    # master and Adam moments. Stage 1 reduces in place into its gradient buffer, so nothing else is
    # kept between steps but padding and Adam's `step` scalars.
    specs = preset_specs("llama-7b", dtype="bf16")
    psi, n = sum(s.numel for s in specs), 8
    report = memory_report(rank_major_plan(specs, Topology(world_size=n), stage=1, optimizer="AdamW"))
    paper = 4 * psi + 12 * psi / n
    for r in report.ranks:
        assert abs(_counted(r) / paper - 1) < 0.02, (r.rank, _counted(r) / paper)


def test_interleaved_stage_1_keeps_an_fp32_gradient_shard_beside_the_full_gradients():
    # Interleaved, the rank's shard is not a region of the gradient buffer: its reduced gradients go
    # to an fp32 shard of their own (4Ψ/N kept between steps), where rank-major stage 1 reduces in
    # place and makes the fp32 copy only inside step() (a transient of the same size).
    specs = preset_specs("llama-7b", dtype="bf16")
    psi, n = sum(s.numel for s in specs), 8
    zp = plan(specs, Topology(world_size=n), stage=1, optimizer="AdamW", layout="interleaved")
    assert zp.partition.layout == "interleaved"
    interleaved = memory_report(zp).ranks
    rank_major = memory_report(
        rank_major_plan(specs, Topology(world_size=n), stage=1, optimizer="AdamW")
    ).ranks
    paper = 4 * psi + 12 * psi / n + 4 * psi / n
    for r, m in zip(interleaved, rank_major, strict=True):
        assert abs(_counted(r) / paper - 1) < 0.02, (r.rank, _counted(r) / paper)
        assert r.step_transient_bytes < m.step_transient_bytes  # no fp32 copy inside step()
        assert abs(r.grads_bytes - m.grads_bytes - 4 * psi / n) < 4 * 128 * n


@pytest.mark.parametrize("stage", [1, 2])
def test_a_rank_major_space_is_gathered_in_bucket_sized_chunks_in_buffer_order(stage):
    """[Note: gather blocks]: chunks tile the buffer in order, each inside one rank's region, each at
    most a bucket; an all-gather of equal regions becomes broadcasts of the same bytes."""
    from zeroplan.core import Block, Topology, communication, specs_from_shapes

    specs = specs_from_shapes([(64, 64), (64, 64), (64,), (64, 64)])
    zp = plan(specs, Topology(world_size=2), stage=stage, layout="rank_major", alignment=8, bucket_bytes=4096)
    (space,) = zp.partition.spaces
    (whole,) = space.blocks
    chunks = zp.gather_blocks(space)
    assert len(chunks) > 2
    assert [c.start for c in chunks] == sorted(c.start for c in chunks)
    assert chunks[0].start == 0 and chunks[-1].span.stop == whole.span.stop
    for before, after in itertools.pairwise(chunks):
        assert before.span.stop == after.start
    for chunk in chunks:
        owners = [q for q, piece in enumerate(chunk.pieces) if piece]
        assert len(owners) == 1 and chunk.numel * 4 <= 4096
        q = owners[0]
        region = whole.piece(q)
        inside = chunk.piece(q)
        assert region.buffer_span.start <= inside.buffer_span.start < region.buffer_span.stop
        assert inside.shard_span.start == inside.buffer_span.start - region.buffer_span.start
        assert zp.gather_collective(chunk) is Collective.BROADCAST
    one_block = {c.collective: c for c in communication(zp, 0)}[Collective.BROADCAST]
    assert one_block.calls == len(chunks)
    assert isinstance(chunks[0], Block)


def test_stage_3_interleaved_and_two_hop_gathers_keep_their_blocks():
    from zeroplan.core import Topology, specs_from_shapes

    specs = specs_from_shapes([(64, 64), (64, 64), (64,)])
    for zp in (
        plan(specs, Topology(world_size=2), stage=3, layout="rank_major", alignment=8, bucket_bytes=4096),
        plan(specs, Topology(world_size=2), stage=2, layout="interleaved", alignment=8, bucket_bytes=4096),
        plan(specs, Topology(world_size=4, ranks_per_node=2), stage=2, layout="rank_major", alignment=8),
    ):
        for space in zp.partition.spaces:
            assert zp.gather_blocks(space) == space.blocks
