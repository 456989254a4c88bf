"""The staging schedule: every gradient staged once into each of its buckets, buckets launched once and
in order, at most ``max_inflight_buckets`` consecutive buckets alive, every ``.grad`` released once."""

from __future__ import annotations

import pytest

from zeroplan.core import Topology, plan, specs_from_shapes
from zeroplan.core.schedule import ActionKind, staging_schedule

SHAPES = [(17, 257), (3,), (1000, 7), (31,), (257, 17), (64,)]


def _run(zp, order, *, overlap):
    schedule = staging_schedule(zp, overlap=overlap)
    assert next(schedule) == []
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
    staged = [(a.param, a.bucket) for a in actions if a.kind is ActionKind.STAGE]
    assert sorted(staged) == sorted((p, b.index) for b in buckets for p in b.params)
    assert [a.bucket for a in actions if a.kind is ActionKind.LAUNCH] == list(range(len(buckets)))
    released = [a.param for a in actions if a.kind is ActionKind.RELEASE]
    assert sorted(released) == (trainable if stage == 2 else [])
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
    schedule = staging_schedule(zp, overlap=False)
    next(schedule)
    assert all(schedule.send(i) == [] for i in sorted(zp.trainable_indices, reverse=True))
    assert schedule.send(None)
