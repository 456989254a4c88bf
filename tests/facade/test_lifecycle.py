"""The step lifecycle ([Note: step lifecycle]): out-of-order calls fail loudly on every rank."""

from __future__ import annotations

import pytest
import scenarios_lifecycle

FP32_TOL = 1e-6
REFUSED = [
    "step_before_backward",
    "clip_before_backward",
    "averaged_before_backward",
    "clip_twice",
    "backward_after_clip",
    "step_after_zero_grad",
    "second_step",
]


@pytest.mark.parametrize(("stage", "dtype"), [(1, "fp32"), (2, "fp32"), (2, "bf16")])
def test_out_of_order_calls_are_refused_and_change_nothing(pools, stage, dtype):
    results = pools(2).run(scenarios_lifecycle.out_of_order, stage, dtype)
    for rank, result in enumerate(results):
        for name in REFUSED:
            assert result["messages"][name] is not None, (rank, name)
            assert result["unchanged"][name], (rank, name)
    messages = results[0]["messages"]
    assert "before any backward" in messages["step_before_backward"]
    assert "clip_grad_norm_()" in messages["clip_before_backward"]
    assert "already called" in messages["clip_twice"]
    assert "no_sync" in messages["backward_after_clip"]
    # Training after the refused calls equals the unsharded optimizer stepping once per accepted step.
    tolerance = FP32_TOL if dtype == "fp32" else 2**-7
    assert max(results[0]["errors"]) < tolerance, results[0]["errors"]


def test_a_plan_without_trainable_parameters_steps_quietly(pools):
    assert pools(2).run(scenarios_lifecycle.frozen_model_steps_quietly) == [True, True]


@pytest.mark.parametrize(
    ("stage", "dtype", "overlap"),
    [(1, "bf16", True), (2, "bf16", True), (2, "bf16", False), (2, "fp32", True)],
)
def test_writes_into_parameters_between_steps_are_kept(pools, stage, dtype, overlap):
    """``model.load_state_dict`` and in-place edits survive the next step, bf16 as fp32 (no revert)."""
    results = pools(2).run(scenarios_lifecycle.parameter_writes, stage, dtype, overlap)
    for r in results:
        assert r["alias_current"]
        assert r["clamp_kept"] and r["kept"], r
        assert r["changed"] <= 1, r  # bf16: only the clamped element's master; fp32: the buffer is it
    if dtype != "fp32":  # the clamped element's master took its value on exactly one rank
        assert sum(r["changed"] for r in results) == 1, results
