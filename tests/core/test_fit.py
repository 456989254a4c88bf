"""Does a plan fit a device with its activations, and which configuration is the cheapest that does."""

from __future__ import annotations

import dataclasses

import pytest

from zeroplan.core import (
    ConfigError,
    MemoryReport,
    PeakPhase,
    RankReport,
    Topology,
    fit_report,
    memory_report,
    plan,
    recommend,
    shard_sizes,
    specs_from_shapes,
)
from zeroplan.core.sizing.fit import gib
from zeroplan.core.sizing.recommend import TRAFFIC_TOLERANCE

MiB = 2**20


def report_of(*ranks: dict) -> MemoryReport:
    """A hand-made report: persistent bytes 10 + 20 + 30 + 40 (+ 0 buffers) = 100 unless given."""
    made = []
    for rank, fields in enumerate(ranks):
        values = dict(
            params_bytes=10, grads_bytes=20, master_bytes=30, optimizer_state_bytes=40, buffer_bytes=0
        )
        values.update(fields)
        made.append(RankReport(rank=rank, shard_rank=rank, comm=(), **values))
    return MemoryReport(
        fingerprint="0",
        world=len(made),
        shard_size=len(made),
        stage=2,
        strategy="x",
        total_params=1,
        ranks=tuple(made),
    )


# ----------------------------------------------------------------- the fit decision
def test_activations_add_to_the_backward_never_to_the_step():
    report = report_of(dict(backward_transient_bytes=50, step_transient_bytes=70))
    [quiet] = fit_report(report, activation_bytes=15, device_bytes=170).ranks
    assert (quiet.backward_bytes, quiet.step_bytes) == (100 + 50 + 15, 100 + 70)
    assert (quiet.need_bytes, quiet.phase, quiet.spare_bytes, quiet.fits) == (170, PeakPhase.STEP, 0, True)
    [busy] = fit_report(report, activation_bytes=30, device_bytes=170).ranks
    assert (busy.need_bytes, busy.phase, busy.spare_bytes, busy.fits) == (180, PeakPhase.BACKWARD, -10, False)
    assert report.ranks[0].peak_bytes == 170 == quiet.step_bytes
    # The buffers (staging arena) are persistent: in both moments, and in the peak.
    arena = report_of(dict(buffer_bytes=5, backward_transient_bytes=50, step_transient_bytes=70))
    [held] = fit_report(arena, activation_bytes=15, device_bytes=170).ranks
    assert (held.backward_bytes, held.step_bytes) == (105 + 50 + 15, 105 + 70)
    assert arena.ranks[0].peak_bytes == 175 == held.step_bytes


def test_every_rank_must_fit():
    report = report_of(
        dict(backward_transient_bytes=10), dict(backward_transient_bytes=40), dict(step_transient_bytes=20)
    )
    fit = fit_report(report, activation_bytes=5, device_bytes=140)
    assert [r.fits for r in fit.ranks] == [True, False, True]
    assert not fit.fits and fit.worst.rank == 1 and fit.need_bytes == 145
    assert fit.summary() == (
        "stage 2, shard groups of 3: 1 of 3 ranks do not fit, 5 bytes short "
        "(rank 1 needs 145 bytes of 140 bytes at the backward)"
    )
    assert fit_report(report, activation_bytes=5, device_bytes=145).fits


def test_fit_of_a_real_plan_matches_its_report():
    zp = plan(
        specs_from_shapes([(17, 257), (1024, 1024), (3,)], dtype="bf16"), Topology(world_size=4), stage=2
    )
    report = memory_report(zp)
    fit = fit_report(report, activation_bytes=0, device_bytes=2**30)
    assert [r.need_bytes for r in fit.ranks] == [r.peak_bytes for r in report.ranks]
    assert fit.comm_bytes_per_step == max(r.comm_bytes_per_step for r in report.ranks)
    assert fit.as_dict()["need_bytes"] == max(r.peak_bytes for r in report.ranks)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"activation_bytes": -1, "device_bytes": 10}, "activation bytes must be an int >= 0, got -1"),
        ({"activation_bytes": 0, "device_bytes": 0}, "device memory must be an int >= 1 (bytes), got 0"),
        ({"activation_bytes": 0, "device_bytes": 8.0e10}, "got 80000000000.0"),
    ],
)
def test_bad_fit_arguments_are_config_errors(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        fit_report(report_of({}), **kwargs)


# ----------------------------------------------------------------- the recommender
SPECS = specs_from_shapes([(4096, 4096)] * 8, dtype="bf16")  # 134M parameters in bf16


def test_shard_sizes_are_all_divisors():
    assert shard_sizes(1) == (1,)
    assert shard_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert shard_sizes(24) == (1, 2, 3, 4, 6, 8, 12, 24)
    with pytest.raises(ConfigError, match="world size must be an int >= 1, got 0"):
        shard_sizes(0)


def test_only_stage_2_fits():
    r = recommend(SPECS, 4, device_bytes=1000 * MiB, stages=(1, 2))
    assert [(o.fit.stage, o.fit.shard_size) for o in r.options if o.fit.fits] == [(2, 4), (2, 4)]
    best = r.best
    assert (best.fit.stage, best.fit.shard_size, best.fused) == (2, 4, True)
    assert best.implementation.value == "fused"
    spare = gib(best.fit.worst.spare_bytes)
    assert r.reason.startswith(
        f"stage 2 with shard groups of 4, AdamW(fused=True): fits with {spare} to spare"
    )
    stage1 = min(o.fit.need_bytes for o in r.options if o.fit.stage == 1)
    assert stage1 > 1000 * MiB
    assert r.reason.endswith(
        f"; stage 1 does not fit (needs {gib(stage1)} at the least, with shard groups of 4)"
    )


def test_stage_3_sends_more_and_is_chosen_only_when_the_others_do_not_fit():
    r = recommend(SPECS, 4, device_bytes=2**30)
    assert (r.best.fit.stage, r.best.fit.shard_size) == (2, 4)
    assert "stage 3 fits but sends 576.0 MiB per step (shard groups of 4)" in r.reason


def test_fused_is_recommended_only_where_it_lowers_the_peak():
    # Without activations the step's temporaries set the peak of the foreach AdamW: fused=True lowers it.
    lowered = recommend(SPECS, 4, device_bytes=2**31)
    assert lowered.best.fused and "fused=True saves 64.0 MiB over foreach" in lowered.reason
    # With activations the backward is the peak: fused=True changes nothing, and is not recommended.
    same = recommend(SPECS, 4, device_bytes=2**31, activation_bytes=128 * MiB)
    assert not same.best.fused and same.best.implementation.value == "foreach"
    assert "fused=True does not lower its peak (backward)" in same.reason
    # Optimizers without a fused kernel are assessed as given only.
    rprop = recommend(SPECS, 4, device_bytes=2**31, optimizer="Rprop")
    assert not any(o.fused for o in rprop.options) and len(rprop.options) == 3 * 3
    # An optimizer already fused is not doubled.
    fused = recommend(SPECS, 4, device_bytes=2**31, settings={"fused": True})
    assert len(fused.options) == 3 * 3 and all(o.implementation.value == "fused" for o in fused.options)


def test_least_traffic_first_then_least_memory():
    r = recommend(SPECS, 8, device_bytes=2**30)
    fitting = [o for o in r.options if o.fit.fits]
    least = min(o.fit.comm_bytes_per_step for o in fitting)
    # Stages 1 and 2 send the same at every shard size (up to padding): the least memory decides.
    near = [o for o in fitting if o.fit.comm_bytes_per_step <= least * (1 + TRAFFIC_TOLERANCE)]
    assert {o.fit.stage for o in near} == {1, 2}
    assert r.best.fit.need_bytes == min(o.fit.need_bytes for o in near)
    # At stage 3 bigger shard groups send more: the smallest that fits wins, not the smallest peak.
    only3 = recommend(SPECS, 8, device_bytes=2**30, stages=(3,))
    assert [o.fit.shard_size for o in only3.options if o.fit.fits] == [4, 4, 8, 8]
    assert only3.best.fit.shard_size == 4
    assert only3.reason.startswith("stage 3 with shard groups of 4, AdamW(fused=True): fits")


def test_only_stage_3_fits():
    r = recommend(SPECS, 4, device_bytes=2**30, optimizer="Rprop")
    assert r.best.fit.stage == 3
    assert r.reason.startswith("stage 3 with shard groups of 4: fits")
    assert "stage 1 does not fit" in r.reason and "stage 2 does not fit" in r.reason


def test_nothing_fits_says_what_is_needed():
    r = recommend(SPECS, 4, device_bytes=512 * MiB, activation_bytes=64 * MiB, offload=False)
    assert r.best is None and not any(o.fit.fits for o in r.options)
    least = min(o.fit.need_bytes for o in r.options)
    assert r.reason == (
        f"nothing fits in 512.0 MiB: the least any configuration needs is {gib(least)} "
        f"(stage 3 with shard groups of 4), {gib(least - 512 * MiB)} more; "
        "the activations take 64.0 MiB of it"
    )
    assert r.as_dict()["best"] is None and len(r.as_dict()["options"]) == len(r.options)


def test_recommend_passes_plan_options_and_checks_stages():
    r = recommend(SPECS, 2, device_bytes=2**32, strategy="lpt_whole", alignment=64, stages=(2,))
    assert {o.fit.stage for o in r.options} == {2}
    with pytest.raises(ConfigError, match="assesses stages 1, 2 and 3, got \\(0,\\)"):
        recommend(SPECS, 2, device_bytes=2**32, stages=(0,))
    with pytest.raises(ConfigError, match="unknown optimizer 'Lion'"):
        recommend(SPECS, 2, device_bytes=2**32, optimizer="Lion")


@pytest.mark.parametrize("device_mib", [600, 700, 800])
def test_a_partial_offload_is_recommended_where_it_fits_keeping_the_most_on_the_device(device_mib):
    """[Note: kept on the device]: where offload="optimizer" fits, the smallest host share that fits
    is an option of its own, moving fewer bytes over the host link, so it is chosen."""
    from zeroplan.core.sizing.recommend import OFFLOAD_FRACTIONS, option_plan

    specs = specs_from_shapes([(4096, 4096)] * 8, dtype="bf16")
    r = recommend(specs, 4, device_bytes=device_mib * MiB, activation_bytes=64 * MiB)
    partial = [o for o in r.options if o.offload_fraction is not None]
    assert partial and all(o.fit.fits and o.offload == "optimizer" for o in partial)
    assert r.best in partial and "offload_fraction=" in r.best.label
    for o in partial:
        full = next(
            f
            for f in r.options
            if f.offload == "optimizer"
            and f.offload_fraction is None
            and (f.fit.stage, f.fit.shard_size, f.fused) == (o.fit.stage, o.fit.shard_size, o.fused)
        )
        assert full.fit.fits and o.host_link_bytes < full.host_link_bytes
        smaller = [x for x in OFFLOAD_FRACTIONS if x < o.offload_fraction]
        for fraction in smaller:  # keeping more on the device would not fit
            zp = option_plan(specs, 4, dataclasses.replace(o, offload_fraction=fraction))
            fit = fit_report(memory_report(zp), activation_bytes=64 * MiB, device_bytes=device_mib * MiB)
            assert not fit.fits, (o.label, fraction)
        zp = option_plan(specs, 4, o)
        assert zp.residences.host_fraction == o.offload_fraction
        assert o.as_dict()["offload_fraction"] == o.offload_fraction
    tight = recommend(specs, 4, device_bytes=512 * MiB, activation_bytes=64 * MiB)
    assert tight.best.offload == "optimizer" and tight.best.offload_fraction is None  # none fits partly
