"""The staging schedule: every bucket staged whole and launched once, in order, once all its gradients
arrived, at most ``max_inflight_buckets`` consecutive buckets alive, every ``.grad`` released once."""

from __future__ import annotations

import pytest

from zeroplan.core import Topology, plan, specs_from_shapes
from zeroplan.core.schedule import ActionKind, schedule_tables, staging_schedule

SHAPES = [(17, 257), (3,), (1000, 7), (31,), (257, 17), (64,)]


def _run(zp, order, *, overlap):
    schedule = staging_schedule(zp.with_options(overlap_grad_reduce=overlap))
    assert not next(schedule)
    actions = [a for index in order for a in schedule.send(index)]
    return actions + schedule.send(None)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("inflight", [1, 2, 3])
@pytest.mark.parametrize("order", ["reverse", "forward", "half"])
def test_every_gradient_is_staged_once_and_buckets_launch_in_order(stage, overlap, inflight, order):
    zp = plan(
        specs_from_shapes(SHAPES),
        Topology(world_size=2),
        stage=stage,
        alignment=8,
        bucket_bytes=4096,
        max_inflight_buckets=inflight,
    )
    trainable = sorted(zp.trainable_indices)
    arrivals = {"reverse": trainable[::-1], "forward": trainable, "half": trainable[::2]}[order]
    actions = _run(zp, arrivals, overlap=overlap)
    buckets = zp.buckets.buckets
    staged = [a.bucket for a in actions if a.kind is ActionKind.STAGE]
    assert staged == list(range(len(buckets)))  # each bucket staged whole, once, in order
    assert [a.bucket for a in actions if a.kind is ActionKind.LAUNCH] == list(range(len(buckets)))
    released = [a.param for a in actions if a.kind is ActionKind.RELEASE]
    assert sorted(released) == trainable  # freed (stage 2) or moved into the gradient buffer (stage 1)
    for position, a in enumerate(actions):
        if a.kind is ActionKind.RELEASE and (stage == 2 or overlap):
            done = {x.bucket for x in actions[:position] if x.kind is ActionKind.STAGE}
            launched = {x.bucket for x in actions[:position] if x.kind is ActionKind.LAUNCH}
            of = set(zp.buckets.buckets_of(a.param))
            if stage == 2:  # freed only once all its buckets hold it
                assert of <= done
            else:  # moved once its first bucket holds it, before any of its buckets reduces into it
                assert min(of) in done and not of & launched
    alive: list[int] = []  # opened or in flight, oldest first
    for a in actions:
        if a.kind is ActionKind.OPEN:
            alive.append(a.bucket)
            assert max(alive) - min(alive) < inflight, (alive, a)
        elif a.kind is ActionKind.RETIRE:
            alive.remove(min(alive))
        elif a.kind is ActionKind.STAGE:
            assert a.bucket in alive
    assert alive == []  # finish retires everything


def test_without_overlap_nothing_happens_before_finish():
    zp = plan(specs_from_shapes(SHAPES), Topology(world_size=2), alignment=8, bucket_bytes=4096)
    schedule = staging_schedule(zp.with_options(overlap_grad_reduce=False))
    next(schedule)
    assert all(not schedule.send(i) for i in sorted(zp.trainable_indices, reverse=True))
    assert schedule.send(None)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_step_builds_no_action_per_parameter(stage):
    """Every action comes from the plan's tables (built once); an arrival that completes no bucket
    answers the one shared empty tuple, and only a bucket's completion builds a list."""
    zp = plan(
        specs_from_shapes(SHAPES * 20), Topology(world_size=2), stage=stage, alignment=8, bucket_bytes=65536
    )
    tables = schedule_tables(zp)
    known = {id(a) for actions in tables.completion + tables.lone for a in actions}
    schedule = staging_schedule(zp, tables=tables)
    next(schedule)
    answers = [schedule.send(i) for i in sorted(zp.trainable_indices, reverse=True)] + [schedule.send(None)]
    lists = [a for a in answers if isinstance(a, list)]
    assert len(lists) <= len(zp.buckets.buckets) + 1 < len(zp.specs) // 4  # the finish, and one per bucket
    assert all(a == () for a in answers if not isinstance(a, list))
    assert all(id(a) in known or a.kind is ActionKind.RETIRE for answer in answers for a in answer)
