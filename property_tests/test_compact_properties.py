"""Compact plans ([Note: compact plans] in ``zeroplan.core.runs``) equal their plans of tuples.

An interleaved ``flat_even`` plan (stage 3's blocks of whole parameters, stages 1-2's blocks that
cut parameters, whose fragments are then a ``RunChain`` of runs) holds its fragments as
``FragmentRun`` s and derives its spaces,
buckets, inner tensors and report from their numbers. The same partition with every fragment
written out as a tuple takes the general path (``build_space``, fragments walked one by one,
inner tensors rank by rank). Every value must be the same:

* the spaces field by field (``runs`` and ``by_rank`` equal to the tuples, in both directions);
* the partition's, the buckets' and the plan's fingerprints;
* the buckets, their pieces and copies included;
* every rank's inner tensors, and the memory report of every world rank;
* offloaded, stepped bucket by bucket in host memory (whole or in part): every rank's bucket pieces
  as the buckets give them, and its host link, where ranks' pieces are alike and computed once.
"""

from __future__ import annotations

from hypothesis import event, given
from hypothesis import strategies as st

from property_tests.strategies import alignments, bucket_caps, param_specs, topologies
from zeroplan.core import (
    CollectivePolicy,
    PartitionPlan,
    Stage,
    ZeroPlan,
    host_link,
    host_links,
    memory_report,
    plan,
    plan_buckets,
)


def _as_tuples(partition: PartitionPlan) -> PartitionPlan:
    return PartitionPlan(
        specs=partition.specs,
        shard_size=partition.shard_size,
        alignment=partition.alignment,
        strategy=partition.strategy,
        fragments=tuple(tuple(frags) for frags in partition.fragments),
        block_pieces=partition.block_pieces,
    )


@given(
    specs=param_specs(min_size=1, cohorts=True),
    topology=topologies(max_shard=9),
    alignment=alignments,
    bucket_bytes=bucket_caps,
    optimizer=st.sampled_from(["AdamW", "SGD", "Adagrad"]),
    policy=st.sampled_from(list(CollectivePolicy)),
    clipping=st.booleans(),
    stage=st.sampled_from([Stage.PARAMETERS, Stage.GRADIENTS, Stage.OPTIMIZER]),
    offload=st.sampled_from([None, 1.0, 0.5]),
)
def test_a_compact_plan_equals_its_plan_of_tuples(
    specs, topology, alignment, bucket_bytes, optimizer, policy, clipping, stage, offload
):
    zp = plan(
        specs,
        topology,
        stage=stage,
        strategy="flat_even",
        layout="interleaved",
        optimizer=optimizer,
        alignment=alignment,
        bucket_bytes=bucket_bytes,
        policy=policy,
        offload="optimizer" if offload else None,
        offload_fraction=offload if offload != 1.0 else None,
    )
    compact = zp.partition
    tuples = _as_tuples(compact)
    assert all(space.block_runs for space in compact.spaces)
    assert not any(space.block_runs for space in tuples.spaces)
    event(f"{sum(len(s.blocks) for s in compact.spaces)} blocks" if compact.spaces else "nothing trainable")
    assert compact.fragments == tuples.fragments and tuples.fragments == compact.fragments
    for a, b in zip(compact.spaces, tuples.spaces, strict=True):
        assert a == b
        assert tuple(a.runs) == b.runs and len(a.runs) == len(b.runs)
        assert [tuple(frags) for frags in a.by_rank] == list(b.by_rank)
        assert all(len(x) == len(y) and hash(x) == hash(y) for x, y in zip(a.by_rank, b.by_rank, strict=True))
    assert compact.fingerprint() == tuples.fingerprint()

    reference = ZeroPlan(
        topology=topology,
        stage=stage,
        partition=tuples,
        buckets=plan_buckets(tuples, bucket_bytes, alignment, policy),
        optimizers=zp.optimizers,
        residences=zp.residences,
    )
    assert zp.buckets == reference.buckets
    for a, b in zip(zp.buckets.buckets, reference.buckets.buckets, strict=True):
        assert tuple(a.pieces) == tuple(b.pieces) and tuple(a.copies) == tuple(b.copies)
        assert a.piece_sizes(topology.shard_size) == b.piece_sizes(topology.shard_size)
        assert [a.piece_of(r) for r in range(topology.shard_size)] == [
            b.piece_of(r) for r in range(topology.shard_size)
        ]
    assert zp.fingerprint() == reference.fingerprint()
    n = topology.shard_size
    for space in zp.partition.spaces:
        event(f"pieces alike: {zp.pieces_alike(space.index)}")
        for r in range(n):
            pieces = [(b.index, b.piece_of(r)) for b in zp.buckets.buckets if b.space == space.index]
            assert zp.bucket_pieces(space.index, r) == tuple(
                sorted(
                    (p.shard_span.start, p.shard_span.stop, b) for b, p in pieces if p and p.shard_span.numel
                )
            )
    assert host_links(zp) == tuple(host_link(zp, r) for r in range(n))
    assert zp.inner_tensors_by_rank() == tuple(reference.inner_tensors(r) for r in range(n))
    assert zp.inner_tensors_by_rank() == reference.inner_tensors_by_rank()
    assert [zp.inner_tensors(r) for r in range(n)] == [reference.inner_tensors(r) for r in range(n)]
    report, expected = memory_report(zp, clipping=clipping), memory_report(reference, clipping=clipping)
    assert report.as_dict() == expected.as_dict()
