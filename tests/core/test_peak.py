"""The step's peak: the backward schedule, staging layouts, the step's transients, hand-computed."""

from __future__ import annotations

import dataclasses
import random

import pytest

from zeroplan.core import (
    BackwardPeak,
    Collective,
    PeakPhase,
    Span,
    Topology,
    backward_peak,
    describe_optimizer,
    memory_report,
    plan,
    specs_from_shapes,
    staging_arena,
    staging_layout,
    step_transient,
)
from zeroplan.core.arena import STAGING_ALIGNMENT, StagingLayout, _BasePlacement, _nbytes_with, _place
from zeroplan.core.schedule import ActionKind, staging_schedule


def rank_major_plan(*args, **kwargs):
    """``plan`` with the rank-major layout, whose numbers these tests compute by hand."""
    return plan(*args, layout="rank_major", **kwargs)


def _plan(shapes, *, stage=2, world=2, bucket_bytes=1024, dtype="fp32", **kwargs):
    return plan(
        specs_from_shapes(shapes, dtype=dtype),
        Topology(world_size=world),
        stage=stage,
        alignment=8,
        bucket_bytes=bucket_bytes,
        **kwargs,
    )


def test_stage_2_holds_a_window_of_staging_and_the_arriving_gradient():
    # Four 1 KiB parameters, one per bucket: staging of 2 buckets + the gradient being staged.
    zp = _plan([(256,)] * 4)
    assert backward_peak(zp) == (BackwardPeak(2048, 3072),) * 2
    # A window of 3: three buckets alive at once.
    assert backward_peak(_plan([(256,)] * 4, max_inflight_buckets=3))[0] == BackwardPeak(3072, 4096)


def test_without_overlap_every_gradient_waits_for_the_end_of_backward():
    zp = _plan([(256,)] * 4)
    # All four gradients alive at finish(), next to the two persistent 1 KiB staging arena.
    assert backward_peak(zp.with_options(overlap_grad_reduce=False))[0] == BackwardPeak(2048, 4 * 1024 + 2048)


def test_stage_1_moves_each_gradient_into_its_buffer_at_once():
    zp = _plan([(256,)] * 4, stage=1)
    # The arriving gradient is alive while the window holds 2 buckets; it is freed before staging.
    assert backward_peak(zp)[0] == BackwardPeak(2048, 3072)
    # Without overlap nothing is staged during backward, but each gradient is still moved into the
    # buffer as it arrives: one alive at a time, next to the (persistent) arena.
    assert backward_peak(zp.with_options(overlap_grad_reduce=False))[0] == BackwardPeak(2048, 3072)


def test_a_parameter_larger_than_the_window_stays_alive_until_all_its_buckets_are_staged():
    # 4096 fp32 elements in 1 KiB buckets: 16 buckets; its 16 KiB gradient lives through all of them.
    zp = _plan([(4096,)])
    assert len(zp.buckets.buckets) == 16
    assert backward_peak(zp)[0] == BackwardPeak(2048, 16384 + 2048)


def test_an_exchange_stages_room_for_the_pieces_the_peers_send():
    # GLOO policy, four 1 KiB buckets of equal pieces: each staging buffer holds its 256 gradients
    # and the N - 1 pieces received (128 at world 2, 3 x 64 at world 4); a window of 2 buckets.
    assert backward_peak(_plan([(256,)] * 4, policy="gloo")) == (BackwardPeak(2 * 1536, 2 * 1536 + 1024),) * 2
    at_4 = backward_peak(_plan([(256,)] * 4, policy="gloo", world=4))
    assert at_4 == (BackwardPeak(2 * 1792, 2 * 1792 + 1024),) * 4
    # Uneven pieces are all-reduced in place: no room.
    rank_major = _plan([(256,)] * 4, policy="gloo", layout="rank_major")
    assert backward_peak(rank_major) == (BackwardPeak(2048, 3072),) * 2


def test_bf16_stage_2_stages_room_for_the_reduced_piece():
    zp = _plan([(512,)], dtype="bf16", bucket_bytes=2**20, policy="min_bytes")
    (bucket,) = zp.buckets.buckets
    assert [staging_layout(zp, bucket, r) for r in (0, 1)] == [
        StagingLayout(512 + 256, Span(512, 768), None),
        StagingLayout(512 + 256, Span(512, 768), None),
    ]
    # Under the GLOO policy equal pieces are exchanged: room for the peer's piece after the
    # gradients, and the sum lands in the rank's own window (never sent), then is cast.
    gloo = _plan([(512,)], dtype="bf16", bucket_bytes=2**20, policy="gloo")
    assert [staging_layout(gloo, gloo.buckets.buckets[0], r) for r in (0, 1)] == [
        StagingLayout(768, Span(0, 256), Span(512, 768)),
        StagingLayout(768, Span(256, 512), Span(512, 768)),
    ]
    # ... and uneven pieces are all-reduced over the world, each rank keeping its piece in place.
    uneven = _plan([(256,)] * 4, dtype="bf16", bucket_bytes=512, policy="gloo", layout="rank_major")
    whole = uneven.buckets.buckets[0]  # rank 1's alone
    assert whole.collective is Collective.ALL_REDUCE
    assert staging_layout(uneven, whole, 1) == StagingLayout(256, Span(0, 256), None)
    # fp32 gradients are reduced straight into the fp32 shard; stage 1 into its own region.
    assert staging_layout(_plan([(512,)]), _plan([(512,)]).buckets.buckets[0], 1).reduced is None
    stage1 = _plan([(512,)], dtype="bf16", stage=1)
    assert all(staging_layout(stage1, b, 0).reduced is None for b in stage1.buckets.buckets)


def test_step_transient_adds_the_fp32_copy_at_stage_1_only():
    sgd = describe_optimizer("SGD", device="cpu")  # for-loop SGD without momentum: no temporaries
    assert sgd.step_temporary_bytes([1024, 8], 4) == 0
    stage1 = _plan([(1024,)], dtype="bf16", stage=1, optimizer=sgd, layout="rank_major")
    stage2 = _plan([(1024,)], dtype="bf16", stage=2, optimizer=sgd)
    assert [step_transient(stage1, r) for r in (0, 1)] == [512 * 4, 512 * 4]
    # An interleaved shard is reduced into an fp32 shard of its own: no copy at the step.
    interleaved = _plan([(1024,)], dtype="bf16", stage=1, optimizer=sgd, layout="interleaved")
    assert [step_transient(interleaved, r) for r in (0, 1)] == [0, 0]
    assert [step_transient(stage2, r) for r in (0, 1)] == [0, 0]


def test_step_transient_is_the_inner_optimizers_temporaries_of_the_rank_and_its_largest_group():
    adamw = describe_optimizer("AdamW", {"foreach": True}, device="cpu")
    specs = specs_from_shapes([(1024,), (64,)])
    grouped = tuple(dataclasses.replace(s, group=i) for i, s in enumerate(specs))
    zp = plan(grouped, Topology(world_size=2), alignment=8, optimizer=(adamw, adamw))
    for rank in (0, 1):
        sizes: dict[int, list[int]] = {}
        for tensor in zp.inner_tensors(rank):
            sizes.setdefault(tensor.group, []).append(tensor.shard_span.numel)
        expected = max(adamw.step_temporary_bytes(v, 4) for v in sizes.values())
        assert expected > 0
        assert step_transient(zp, rank) == expected


@pytest.mark.parametrize("stage", [1, 2])
def test_peak_is_persistent_plus_the_larger_transient(stage):
    zp = _plan([(17, 257), (31,), (1000, 7)], stage=stage, dtype="bf16", optimizer="AdamW")
    for r in memory_report(zp).ranks:
        persistent = r.params_bytes + r.grads_bytes + r.master_bytes + r.optimizer_state_bytes
        assert r.total_bytes == persistent + r.buffer_bytes  # the staging arena are persistent
        assert r.peak_bytes == r.total_bytes + max(r.backward_transient_bytes, r.step_transient_bytes)
        larger = PeakPhase.STEP if r.step_transient_bytes > r.backward_transient_bytes else PeakPhase.BACKWARD
        assert r.peak_phase is larger
        record = r.as_dict()
        assert (record["peak_bytes"], record["peak_phase"]) == (r.peak_bytes, r.peak_phase.value)


# ----------------------------------------------------------------- the staging arena
def _alive_spans(zp, order, overlap):
    """Replay the schedule; every set of buckets whose staging is alive at once."""
    schedule = staging_schedule(zp.with_options(overlap_grad_reduce=overlap))
    next(schedule)
    opened, inflight, seen = set(), [], []
    for message in [*order, None]:
        for action in schedule.send(message):
            if action.kind is ActionKind.RETIRE:
                inflight.pop(0)
            elif action.kind is ActionKind.OPEN:
                opened.add(action.bucket)
                seen.append({*inflight, *opened})
            elif action.kind is ActionKind.LAUNCH:
                opened.discard(action.bucket)
                inflight.append(action.bucket)
    return seen


ARENA_PLANS = [
    dict(shapes=[(256,)] * 4),
    dict(shapes=[(1024,), (16,), (1024,), (32,), (1024,)], stage=3, bucket_bytes=4096),
    dict(shapes=[(1000, 7), (31,), (17, 257), (5,)], dtype="bf16", world=4, policy="gloo"),
    dict(shapes=[(300,), (40,), (700,), (9,)], stage=1, world=4, layout="rank_major"),
    dict(shapes=[(64, 64), (100,), (33, 3)], strategy="lpt_whole", world=4, bucket_bytes=2048),
]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("case", range(len(ARENA_PLANS)))
def test_the_arena_never_places_buckets_alive_together_over_each_other(case, k):
    options = dict(ARENA_PLANS[case])
    zp = _plan(options.pop("shapes"), max_inflight_buckets=k, **options)
    n = len(zp.buckets.buckets)
    trainable = sorted(zp.trainable_indices, reverse=True)
    # What the arena relies on: whatever the arrival order (some parameters getting no gradient),
    # the buckets alive at once are fewer than k apart.
    for order in (trainable, trainable[::-1], trainable[::2], trainable[1::3]):
        for overlap in (True, False):
            for alive in _alive_spans(zp, order, overlap):
                assert max(alive) - min(alive) < k, (order, alive)
    for rank in range(zp.topology.shard_size):
        arena = staging_arena(zp, rank)
        assert len(arena.offsets) == len(arena.sizes) == n
        for b, bucket in enumerate(zp.buckets.buckets):
            itemsize = 2 if options.get("dtype") == "bf16" else 4
            assert arena.sizes[b] == staging_layout(zp, bucket, rank).numel * itemsize
            assert arena.offsets[b] % STAGING_ALIGNMENT == 0
            assert arena.offsets[b] + arena.sizes[b] <= arena.nbytes
            for later in range(b + 1, min(b + k, n)):
                apart = (
                    arena.offsets[b] + arena.sizes[b] <= arena.offsets[later]
                    or arena.offsets[later] + arena.sizes[later] <= arena.offsets[b]
                )
                assert apart, (b, later, arena)
        assert backward_peak(zp)[rank].staging == arena.nbytes


def test_uneven_buckets_take_the_smaller_of_first_fit_and_k_slots():
    # Stage 3 buckets are whole blocks: 4 KiB, 64 B, 4 KiB, 64 B, 4 KiB (fp32, world 2), k = 3.
    zp = _plan([(1024,), (16,), (1024,), (16,), (1024,)], stage=3, bucket_bytes=4096, max_inflight_buckets=3)
    arena = staging_arena(zp, 0)
    assert arena.sizes == (4096, 64, 4096, 64, 4096)
    # First fit: the second bucket after the first, the third after both, the fourth at 0 (only the
    # second and third can be alive with it), the fifth right after it, below the third: 8256 bytes,
    # where slots b % 3 would hold three 4 KiB buffers (12288).
    assert (arena.nbytes, arena.offsets) == (8256, (0, 4096, 4160, 0, 64))
    # With a 128-byte fourth bucket the fifth no longer fits below the third: slots win (12288).
    # (Buckets follow the backward: the last parameter first.)
    zp = _plan([(1024,), (32,), (1024,), (16,), (1024,)], stage=3, bucket_bytes=4096, max_inflight_buckets=3)
    arena = staging_arena(zp, 0)
    assert arena.sizes == (4096, 64, 4096, 128, 4096)
    assert (arena.nbytes, arena.offsets) == (12288, (0, 4096, 8192, 0, 4096))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
def test_a_placement_redone_only_where_sizes_changed_is_the_full_placement(k):
    # _arena_bytes places each rank by redoing the base (no pieces) placement from its first changed
    # bucket until it falls back into step with the base or with an earlier rank's redone placement
    # (remembered in `tails`, shared by the ranks of one base): its bytes must be those of placing
    # the changed sizes anew. Equal buckets make a larger one shift every later placement.
    rng = random.Random(k)
    for _ in range(60):
        n = rng.randint(1, 40)
        if rng.random() < 0.5:
            base = (rng.choice([64, 4096]),) * n
        else:
            base = tuple(rng.choice([16, 64, 100, 4096, rng.randint(1, 5000)]) for _ in range(n))
        placement, tails = _BasePlacement.of(base, k), {}
        assert _nbytes_with(placement, (), tails) == _place(base, k).nbytes
        for _ in range(20):
            # Mostly larger sizes (a rank's pieces only add room: the redone path); sometimes any size.
            grown = rng.random() < 0.8
            picked = {rng.randrange(n) for _ in range(rng.randint(1, 3))}
            changes = [
                (i, base[i] + rng.randint(1, 5000) if grown else rng.randint(1, 9000)) for i in sorted(picked)
            ]
            sizes = list(base)
            for index, size in changes:
                sizes[index] = size
            assert _nbytes_with(placement, changes, tails) == _place(tuple(sizes), k).nbytes, (base, changes)
