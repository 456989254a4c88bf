"""The traced timeline's values and the whole step they give ([Note: one timeline]), without torch."""

from __future__ import annotations

import pytest

from zeroplan.core import ConfigError, Topology, plan, specs_from_shapes
from zeroplan.core.peak import gathered_bytes
from zeroplan.core.sizing.trace import (
    ActivationTrace,
    TracePhase,
    TracePoint,
    step_timeline,
    traced_step_peak,
)

F, B = TracePhase.FORWARD, TracePhase.BACKWARD


def _plan(stage: int):
    return plan(
        specs_from_shapes([(256,)] * 4), Topology(world_size=2), stage=stage, alignment=8, bucket_bytes=1024
    )


def _trace(zp, *, held: bool, reshard: bool | None = None, gathered: int = 0) -> ActivationTrace:
    names = tuple(f"p{i}" for i in range(4))
    points = (
        TracePoint(F, "layer", "enter", 100 + gathered, gathered),
        TracePoint(F, "layer", "exit", 5000 + gathered, gathered),
        *(TracePoint(B, names[i], "grad", 4000 - 500 * i, 0) for i in (3, 2, 1, 0)),
    )
    return ActivationTrace(
        points=points, peak_bytes=6000 + gathered, peak_phase=B, peak_module="layer",
        forward_peak_bytes=5000 + gathered, params=names,
        plan_fingerprint=zp.fingerprint() if held else "", reshard_after_forward=reshard,
    )  # fmt: skip


def test_a_point_holds_its_blocks_within_its_bytes():
    with pytest.raises(ConfigError, match="gathered must be within its bytes"):
        TracePoint(F, "layer", "enter", 10, 11)
    with pytest.raises(ConfigError, match="event"):
        TracePoint(F, "layer", "left", 10)


def test_blocks_are_held_only_by_a_trace_made_with_a_plan():
    with pytest.raises(ConfigError, match="only for a trace made with a stage-3 plan"):
        _trace(_plan(3), held=False, reshard=True)


def test_stage_3_traced_alone_adds_the_most_gathered_blocks_an_upper_bound():
    zp = _plan(3)
    alone = traced_step_peak(zp, _trace(zp, held=False))
    assert all(not p.exact and not p.traced_blocks for p in alone)
    blocks = gathered_bytes(zp)
    held = traced_step_peak(zp, _trace(zp, held=True, reshard=True, gathered=blocks))
    assert all(p.exact and p.traced_blocks and p.traced_gradients for p in held)
    for a, h in zip(alone, held, strict=True):  # the blocks in the trace, not added a second time
        assert h.peak_bytes == h.persistent + 6000 + blocks <= a.peak_bytes


def test_the_blocks_must_be_held_as_the_step_will_hold_them():
    zp = _plan(3)
    trace = _trace(zp, held=True, reshard=False, gathered=64)
    with pytest.raises(ConfigError, match="reshard_after_forward=False"):
        traced_step_peak(zp, trace)
    assert traced_step_peak(zp.with_options(reshard_after_forward=False), trace)[0].exact
    with pytest.raises(ConfigError, match="another plan's schedule"):
        traced_step_peak(_plan(2), _trace(zp, held=True))


def test_the_timeline_stacks_the_blocks_apart_from_the_activations():
    zp = _plan(3)
    timeline = step_timeline(zp, _trace(zp, held=True, reshard=False, gathered=64))
    forward = timeline[1]
    assert (forward.activations, forward.gathered) == (5000, 64)
    assert forward.total == forward.persistent + 5064
    assert timeline[-1].phase == "step" and timeline[-1].gathered == 0


def test_the_model_buffers_are_held_throughout():
    zp = _plan(2)
    plain = _trace(zp, held=False)
    buffered = ActivationTrace(**{**{f: getattr(plain, f) for f in plain.__slots__}, "buffer_bytes": 128})
    for a, b in zip(traced_step_peak(zp, plain), traced_step_peak(zp, buffered), strict=True):
        assert (b.peak_bytes, b.persistent, b.step_bytes) == (
            a.peak_bytes + 128,
            a.persistent + 128,
            a.step_bytes + 128,
        )
    assert all(
        p.persistent == traced_step_peak(zp, plain)[0].persistent + 128 for p in step_timeline(zp, buffered)
    )
    with pytest.raises(ConfigError, match="buffer_bytes"):
        ActivationTrace(**{**{f: getattr(plain, f) for f in plain.__slots__}, "buffer_bytes": -1})


def _stand_in(specs, per_sequence: int, *, plan=None, extra: int = 0) -> ActivationTrace:
    """A trace of one sequence: ``per_sequence`` bytes freed as gradients arrive, ``extra`` more when
    traced with a stage-3 plan (what a recomputed forward gathers again)."""
    names = tuple(s.name for s in specs)
    a = per_sequence + (extra if plan is not None and plan.stage == 3 else 0)
    grads = (TracePoint(B, n, "grad", a * i // len(names)) for i, n in enumerate(names))
    return ActivationTrace(
        points=(TracePoint(F, "", "exit", a), *grads), peak_bytes=a, peak_phase=F, peak_module="",
        forward_peak_bytes=a, params=names, plan_fingerprint="" if plan is None else plan.fingerprint(),
        reshard_after_forward=True if plan is not None and plan.stage == 3 else None,
    )  # fmt: skip


def test_the_recommender_confirms_its_choice_with_its_plan_and_drops_it_if_it_grows():
    from zeroplan.core.sizing.recommend import recommend

    specs = specs_from_shapes([(1024, 1024)] * 4, dtype="bf16")
    trace = _stand_in(specs, 2**23)
    calls = []

    def confirm(zp, extra=0):
        calls.append(zp.fingerprint())
        return _stand_in(specs, 2**23, plan=zp, extra=extra)

    only3 = {"stages": (3,), "device_bytes": 72 * 2**20}
    fits = recommend(specs, 2, trace=trace, confirm=confirm, **only3)
    assert fits.best is not None and fits.best.exact and fits.best.fit.stage == 3
    assert len(calls) == len(set(calls))  # the fused twin shares its plan's trace
    grows = recommend(specs, 2, trace=trace, confirm=lambda zp: confirm(zp, extra=2**24), **only3)
    assert grows.best is None  # every stage-3 option, traced with its plan, no longer fits
    assert all(o.exact for o in grows.options if o.fit.shard_size == 2)
    assert "nothing fits" in grows.reason


def test_a_confirmation_must_be_traced_with_the_plan_and_needs_a_trace():
    from zeroplan.core.sizing.recommend import recommend

    specs = specs_from_shapes([(1024, 1024)] * 4, dtype="bf16")
    trace = _stand_in(specs, 2**23)
    with pytest.raises(ConfigError, match="must trace with that plan"):
        recommend(specs, 2, device_bytes=72 * 2**20, stages=(3,), trace=trace, confirm=lambda zp: trace)
    with pytest.raises(ConfigError, match="confirm needs a trace"):
        recommend(specs, 2, device_bytes=40 * 2**20, confirm=lambda zp: trace)
    with pytest.raises(ConfigError, match="not both"):
        recommend(specs, 2, device_bytes=40 * 2**20, trace=trace, activation_bytes=1)
