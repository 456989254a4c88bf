"""ZeroOptimizer against one process running the same torch.optim optimizer on averaged gradients.

Each step checks two things: the reduced gradients equal the exact average (to the rounding of the
sum), and, given those gradients, the sharded step equals the unsharded one. Adam's normalised
update amplifies a last-bit difference where gradients nearly cancel, so comparing the parameters of
two runs that summed in different orders would test the summation order, not the sharding.
"""

from __future__ import annotations

import pytest
import scenarios_train

FP32_TOL = 1e-6

# "gloo" is what collectives="auto" picks on gloo; "min_bytes" (reduce-scatter, replica all-reduce,
# all-gather) is the NCCL default. Both run here.
CASES = [
    # (world, shard, stage, optimizer, collectives)
    (2, None, 2, "adamw", "gloo"),
    (2, None, 1, "sgd", "min_bytes"),
    (4, None, 2, "sgd", "gloo"),
    (4, None, 1, "adamw", "min_bytes"),
    (4, 2, 2, "adamw", "gloo"),
    (4, 2, 2, "adamw", "min_bytes"),
    (4, 2, 1, "sgd", "min_bytes"),
    (2, None, 2, "adafactor", "min_bytes"),
    (4, 2, 2, "adafactor", "gloo"),
    (3, None, 2, "adamw", "min_bytes"),
    (2, 1, 2, "adamw", "gloo"),  # shard groups of one: the fp32 buffer is stepped as one window
]


def _train(pools, world, **cfg):
    return pools(world).run(scenarios_train.train, cfg)


@pytest.mark.parametrize(("world", "shard", "stage", "optimizer", "collectives"), CASES)
def test_fp32_matches_unsharded(pools, world, shard, stage, optimizer, collectives):
    results = _train(
        pools, world, stage=stage, shard=shard, optimizer=optimizer, steps=4, collectives=collectives
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
@pytest.mark.parametrize(
    ("world", "shard", "stage", "collectives"),
    [(2, None, 2, "gloo"), (4, None, 2, "gloo"), (4, 2, 1, "min_bytes")],
)
def test_low_precision_masters_match_within_dtype_precision(
    pools, world, shard, stage, collectives, dtype, eps
):
    """bf16/fp16 parameters, fp32 masters: gradients are computed and reduced in the model dtype, so
    they match the exact average to a few units of the dtype's precision (a backward pass in fp16 on
    the CPU rounds differently when parameters live at other offsets of memory, as ours do in the
    flat buffer); given them, the fp32 master step is exact."""
    results = _train(
        pools,
        world,
        dtype=dtype,
        shard=shard,
        stage=stage,
        steps=4,
        collectives=collectives,
        loss_scale=2.0**14 if dtype == "fp16" else None,
        hyper={"lr": 1e-3},
    )
    assert max(results[0]["grad_errors"]) <= 8 * eps, results[0]["grad_errors"]
    assert max(results[0]["errors"]) < FP32_TOL, results[0]["errors"]


@pytest.mark.parametrize("collectives", ["gloo", "min_bytes"])
def test_gradient_accumulation_with_no_sync(pools, collectives):
    results = _train(pools, 4, shard=2, accumulate=3, steps=3, collectives=collectives)
    assert max(results[0]["errors"]) < FP32_TOL, results[0]["errors"]
    assert max(results[0]["grad_errors"]) < FP32_TOL, results[0]["grad_errors"]


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize(("stage", "collectives"), [(1, "gloo"), (2, "min_bytes")])
def test_clipping_matches_torch_and_is_identical_on_every_rank(pools, norm_type, stage, collectives):
    results = _train(
        pools, 4, shard=2, stage=stage, clip=0.05, norm_type=norm_type, steps=3, collectives=collectives
    )
    ours, ref = results[0]["norms"], results[0]["ref_norms"]
    assert len(ours) == 3
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(ours, ref, strict=True)), (ours, ref)
    assert all(r["norms"] == ours for r in results)  # bit-identical norm on every rank
    assert max(results[0]["errors"]) < FP32_TOL


@pytest.mark.parametrize(
    ("world", "shard", "stage", "collectives"),
    [(2, None, 2, "gloo"), (4, None, 2, "min_bytes"), (4, 2, 2, "gloo"), (4, 2, 2, "min_bytes")],
)
def test_garbage_in_the_staging_arena_never_reaches_the_step(pools, world, shard, stage, collectives):
    # Staging buffers are cut from a persistent arena ([Note: staging arena]); padding is reduced as
    # zeros, so it is zeroed each time a bucket opens. NaN bytes left in the arena before each step
    # would make the norm (and the update) NaN otherwise.
    results = _train(
        pools, world, shard=shard, stage=stage, clip=0.05, steps=3, collectives=collectives, poison_arena=True
    )
    r = results[0]
    assert r["padded_buckets"] > 0 and r["buckets"] > r["inflight"], r  # padding, and room reused
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(r["norms"], r["ref_norms"], strict=True)), r
    assert max(r["errors"]) < FP32_TOL


@pytest.mark.parametrize("scheduler", ["lambda", "onecycle", "cosine"])
def test_lr_schedulers_drive_the_sharded_step(pools, scheduler):
    results = _train(pools, 2, scheduler=scheduler, steps=4)
    assert max(results[0]["errors"]) < FP32_TOL, results[0]["errors"]
    assert len(set(results[0]["lrs"])) > 1  # the schedule really changed the rate


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_skips_the_step_and_backs_off(pools, stage):
    results = pools(2).run(scenarios_train.overflow, stage)
    for r in results:
        assert r["first"] is True
        assert r["applied"] is False
        assert r["params_same"] and r["masters_same"] and r["state_same"]
        assert r["scale_after"] == r["scale_before"] / 2
        assert r["third"] is True and r["changed_after"]
