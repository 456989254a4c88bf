"""ZeroOptimizer against one process running the same torch.optim optimizer on averaged gradients."""

from __future__ import annotations

import pytest

FP32_TOL = 1e-6

CASES = [
    # (world, shard, stage, optimizer)
    (2, None, 2, "adamw"),
    (2, None, 1, "sgd"),
    (4, None, 2, "sgd"),
    (4, None, 1, "adamw"),
    (4, 2, 2, "adamw"),
    (4, 2, 1, "sgd"),
    (2, None, 2, "adafactor"),
    (4, 2, 2, "adafactor"),
]


@pytest.mark.parametrize(("world", "shard", "stage", "optimizer"), CASES)
def test_fp32_matches_unsharded(pools, world, shard, stage, optimizer):
    results = pools(world).run(
        "scenarios_train",
        "train",
        {
            "stage": stage,
            "shard": shard,
            "optimizer": optimizer,
            "steps": 4,
        },
    )
    errors, grad_errors = results[0]["errors"], results[0]["grad_errors"]
    assert len(errors) == len(grad_errors) == 4
    assert max(grad_errors) < FP32_TOL, grad_errors  # the reduction is the average, to fp32 rounding
    assert max(errors) < FP32_TOL, errors  # and the sharded step is the unsharded step
    if optimizer == "adafactor":
        assert results[0]["strategy"] == "lpt_whole"
    for other in results[1:]:  # every rank ends with the same parameters
        assert all((a == b).all() for a, b in zip(results[0]["params"], other["params"], strict=True))


@pytest.mark.parametrize(("dtype", "eps"), [("bf16", 2**-7), ("fp16", 2**-10)])
@pytest.mark.parametrize(("world", "shard", "stage"), [(2, None, 2), (4, 2, 1)])
def test_low_precision_masters_match_within_dtype_precision(pools, world, shard, stage, dtype, eps):
    """bf16/fp16 parameters, fp32 masters: gradients are reduced in the model dtype, so they match the
    exact average to the dtype's precision; given them, the fp32 master step is exact."""
    results = pools(world).run(
        "scenarios_train",
        "train",
        {
            "dtype": dtype,
            "shard": shard,
            "stage": stage,
            "steps": 4,
            "loss_scale": 1024.0 if dtype == "fp16" else None,
            "hyper": {"lr": 1e-3},
        },
    )
    assert max(results[0]["grad_errors"]) <= 2 * eps, results[0]["grad_errors"]
    assert max(results[0]["errors"]) < FP32_TOL, results[0]["errors"]


def test_gradient_accumulation_with_no_sync(pools):
    results = pools(4).run("scenarios_train", "train", {"shard": 2, "accumulate": 3, "steps": 3})
    assert max(results[0]["errors"]) < FP32_TOL, results[0]["errors"]
    assert max(results[0]["grad_errors"]) < FP32_TOL, results[0]["grad_errors"]


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_matches_torch_and_is_identical_on_every_rank(pools, norm_type, stage):
    results = pools(4).run(
        "scenarios_train",
        "train",
        {
            "shard": 2,
            "stage": stage,
            "clip": 0.05,
            "norm_type": norm_type,
            "steps": 3,
        },
    )
    ours, ref = results[0]["norms"], results[0]["ref_norms"]
    assert len(ours) == 3
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(ours, ref, strict=True)), (ours, ref)
    assert all(r["norms"] == ours for r in results)  # bit-identical norm on every rank
    assert max(results[0]["errors"]) < FP32_TOL


@pytest.mark.parametrize("scheduler", ["lambda", "onecycle", "cosine"])
def test_lr_schedulers_drive_the_sharded_step(pools, scheduler):
    results = pools(2).run("scenarios_train", "train", {"scheduler": scheduler, "steps": 4})
    assert max(results[0]["errors"]) < FP32_TOL, results[0]["errors"]
    assert len(set(results[0]["lrs"])) > 1  # the schedule really changed the rate


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_skips_the_step_and_backs_off(pools, stage):
    results = pools(2).run("scenarios_train", "overflow", stage)
    for r in results:
        assert r["first"] is True
        assert r["applied"] is False
        assert r["params_same"] and r["masters_same"] and r["state_same"]
        assert r["scale_after"] == r["scale_before"] / 2
        assert r["third"] is True and r["changed_after"]
