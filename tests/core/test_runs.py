"""``zeroplan.core.runs``: fragment runs behave as the tuples they stand for ([Note: compact plans])."""

from __future__ import annotations

import copy
import pickle
from dataclasses import FrozenInstanceError

import pytest

from zeroplan.core import Fragment, ParamSpec, PlanInvariantError, Span, Topology, plan, specs_from_shapes
from zeroplan.core.buckets import BlockCopies, BlockPieces
from zeroplan.core.fingerprint import Rendered, digest, render
from zeroplan.core.runs import FragmentRun, RankFragments, RunChain, rank_windows


def _stage_3(shapes, world=4, alignment=2, bucket_bytes=64, **kwargs):
    return plan(
        specs_from_shapes(shapes), Topology(world_size=world), stage=3, alignment=alignment,
        bucket_bytes=bucket_bytes, **kwargs,
    )  # fmt: skip


def test_a_run_is_its_fragments():
    # Elements 6..16 of a block of pieces of 4, whose pieces start at shard offset 8.
    run = FragmentRun(param=3, numel=10, block=0, position=6, piece=4, base=8, shard_size=4)
    frags = (
        Fragment(3, 1, Span(0, 2), 10),
        Fragment(3, 2, Span(2, 6), 8),
        Fragment(3, 3, Span(6, 10), 8),
    )
    assert run == frags and frags == run and not (run != frags)
    assert hash(run) == hash(frags) and len({run, frags}) == 1
    assert tuple(run) == frags and list(reversed(run)) == list(reversed(frags))
    assert run[0] == frags[0] and run[-1] == frags[-1] and run[1:] == frags[1:] and run[::-1] == frags[::-1]
    assert repr(run) == repr(frags) and frags[1] in run and run.index(frags[2]) == 2
    assert run + () == frags and () + run == frags  # noqa: RUF005 (tuple concatenation is what is tested)
    assert run != list(frags) and run != frags[:2]
    with pytest.raises(IndexError):
        run[3]
    with pytest.raises(FrozenInstanceError):
        run.base = 0  # type: ignore[misc]


def test_zero_size_runs_sit_where_the_parameter_does():
    def empty(position, piece):
        return tuple(
            FragmentRun(param=0, numel=0, block=0, position=position, piece=piece, base=8, shard_size=4)
        )

    assert empty(5, 4) == (Fragment(0, 1, Span(0, 0), 9),)
    assert empty(16, 4) == (Fragment(0, 3, Span(0, 0), 12),)  # at the block's end
    assert empty(0, 0) == (Fragment(0, 3, Span(0, 0), 8),)  # in a block of pieces of nothing


@pytest.mark.parametrize("values", [(0, 5, 0, 0, 0, 0, 4), (0, 1, 0, 0, 1, 0, 0), (-1, 1, 0, 0, 1, 0, 1)])
def test_invalid_runs_are_refused(values):
    names = ("param", "numel", "block", "position", "piece", "base", "shard_size")
    with pytest.raises(PlanInvariantError):
        FragmentRun(**dict(zip(names, values, strict=True)))


def test_runs_pickle_and_copy_as_values():
    zp = _stage_3([(10,), (7,), (0,), (33,)])
    for value in (zp.partition, zp.buckets, zp.partition.spaces[0].by_rank[1]):
        assert pickle.loads(pickle.dumps(value)) == value
        assert copy.deepcopy(value) == value
    assert pickle.loads(pickle.dumps(zp)).fingerprint() == zp.fingerprint()


def test_a_stage_3_flat_even_plan_is_compact():
    zp = _stage_3([(10,), (7,), (0,), (33,)])
    space = zp.partition.spaces[0]
    assert all(type(f) is FragmentRun for f in zp.partition.fragments)
    assert all(type(f) is RankFragments for f in space.by_rank)
    assert [tuple(run.param for run in runs) for runs in space.block_runs] == [(0,), (1,), (2, 3)]
    bucket = zp.buckets.buckets[0]
    assert type(bucket.pieces) is BlockPieces and type(bucket.copies) is BlockCopies
    assert [r.param for r in bucket.copies.runs] == [3] and bucket.piece_of(2) == bucket.pieces[2]
    # Rank-major plans and other strategies keep tuples.
    stage_2 = plan(specs_from_shapes([(10,)]), Topology(world_size=2), stage=2, layout="rank_major")
    assert type(stage_2.partition.fragments[0]) is tuple
    lpt = _stage_3([(10,), (7,)], strategy="lpt_whole")
    assert not any(s.block_runs for s in lpt.partition.spaces)


def test_windows_follow_groups_and_cohorts():
    specs = tuple(
        ParamSpec(index=i, name=f"p{i}", shape=(numel,), group=group, cohort=cohort)
        for i, (numel, group, cohort) in enumerate([(6, 0, 0), (0, 0, 1), (5, 0, 1), (9, 1, 0), (3, 1, 0)])
    )
    zp = plan(specs, Topology(world_size=3), stage=3, alignment=1, bucket_bytes=40)
    space = zp.partition.spaces[0]
    windows = rank_windows(space, specs)
    assert windows == tuple(
        tuple((t.group, t.cohort, t.shard_span.start, t.shard_span.stop) for t in zp.inner_tensors(r))
        for r in range(3)
    )
    assert len({w[0] for w in windows[0]}) == 2  # both groups on rank 0


def test_render_is_repr():
    values = [
        (),
        (1,),
        (5, 5),
        (7,) * 300,
        (1, True),
        (True, True),
        ("blocks", ((4, 4, 4), (3,), ()), ((2, 2),)),
        (None, "a", (1, (2, (3,)))),
        ((0, 0), (0, 0)),
        ("x",),
        ((),),
    ]
    for value in values:
        assert render(value) == repr(value), value
    parts = [1, "a", (2, 3), (4,) * 9]
    assert digest("k", parts) == digest("k", [Rendered.of(parts[:2]), *parts[2:]])


def test_an_interleaved_stage_2_plan_is_compact_with_chains_across_blocks():
    """Stages 1-2 ``flat_even`` interleaved: a parameter a block boundary cuts is a chain of runs,
    one per block, equal to its fragments (block 0 is padded at its front: [Note: interleaved layout])."""
    zp = plan(
        specs_from_shapes([(10,), (7,), (0,), (33,)]),
        Topology(world_size=4),
        stage=2,
        alignment=2,
        bucket_bytes=64,
        layout="interleaved",
    )
    frags = zp.partition.fragments
    assert [type(f) for f in frags] == [RunChain, FragmentRun, FragmentRun, RunChain]
    assert zp.partition.block_pieces == (((2,) * 4, (4,) * 4, (4,) * 4, (4,) * 4),)
    chain = frags[3]  # 1 element ends block 1, then two whole blocks
    runs = [(run.block, run.position, run.start, run.numel) for run in chain.parts]
    assert runs == [(1, 15, 0, 1), (2, 0, 1, 16), (3, 0, 17, 16)]
    assert tuple(chain) == tuple(chain.parts[0]) + tuple(chain.parts[1]) + tuple(chain.parts[2])
    assert [(f.rank, f.param_span, f.shard_offset) for f in chain][:2] == [
        (3, Span(0, 1), 5),
        (0, Span(1, 5), 6),
    ]
    assert all(space.block_runs for space in zp.partition.spaces)
