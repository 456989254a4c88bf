"""Bad arguments, disagreeing ranks, empty ranks, gradient order and zero_grad semantics."""

from __future__ import annotations

import pytest
import scenarios_safety

FP32_TOL = 1e-6


def test_every_bad_argument_is_a_clear_error_on_every_rank(pools):
    results = pools(2).run(scenarios_safety.bad_arguments)
    expect = {
        "empty": "empty parameter list",
        "duplicate": "already listed",
        "duplicate_across_groups": "already listed",
        "integer": "not floating point",
        "sparse": "sparse",
        "devices": "several devices",
        "shard_size": "does not divide world size",
        "stage_0": "stage must be 1, 2 or 3",
        "non_leaf": "not a leaf",
        "single_tensor": "single tensor",
        "bad_lr": "rejects param group 0",
        "bad_loss_scale": "loss_scale must be",
        "unknown_strategy": "unknown partition strategy",
        "splitting_non_elementwise": "not elementwise",
        "deepcopy": "cannot be deep-copied",
    }
    for r in results:
        assert r["untouched"], "a failed construction modified the model"
        for case, fragment in expect.items():
            assert r[case] is not None, f"{case}: no error raised"
            assert fragment in r[case], (case, r[case])
            # ConfigTypeError (a ConfigError and a TypeError) where torch.optim raises TypeError.
            kind = "ConfigTypeError" if case == "single_tensor" else ("ConfigError", "IncompatiblePlanError")
            assert r[case].startswith(kind), r[case]


def test_ranks_that_disagree_all_get_an_error(pools):
    results = pools(4).run(scenarios_safety.disagreeing_ranks)
    for rank, r in enumerate(results):
        assert "different parameters" in r["shapes"], r["shapes"]
        assert "different parameters" in r["order"], r["order"]
        assert r["settings"].startswith(
            "IncompatiblePlanError: ranks were given different bucket_bytes: "
            "1024 on rank 0, 2048 on rank 1, 3072 on rank 2, 4096 on rank 3"
        ), r["settings"]
        assert "different reduce_dtype: None on rank 0, 'bf16' on ranks [1, 2, 3]" in r["reduce_dtype"], r
        assert "different wire_block: (128,) on ranks [0, 1, 3], (64,) on rank 2" in r["wire_block"], r
        assert "different reshard_after_forward: True on ranks [0, 2, 3], False on rank 1" in r["reshard"], r
        assert "not floating point" in r["one_bad_rank"], r["one_bad_rank"]
        if rank != 3:
            assert r["one_bad_rank"].startswith("ConfigError: rank 3 rejected"), r["one_bad_rank"]


@pytest.mark.parametrize(
    ("strategy", "alignment", "owned"), [("flat_even", 8, [0, 0, 0, 4]), ("lpt_whole", 1, [3, 1, 0, 0])]
)
def test_more_ranks_than_parameters(pools, strategy, alignment, owned):
    results = pools(4).run(scenarios_safety.more_ranks_than_params, strategy, alignment)
    assert [r["owned"][0] for r in results] == owned
    assert max(results[0]["errors"]) < FP32_TOL
    for r in results[1:]:
        assert all((a == b).all() for a, b in zip(results[0]["params"], r["params"], strict=True))


@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_in_any_order_and_unused_parameters(pools, stage):
    results = pools(4).run(scenarios_safety.readiness_order, stage)
    assert max(results[0]["grad_errors"]) < FP32_TOL, results[0]["grad_errors"]
    assert max(results[0]["errors"]) < FP32_TOL, results[0]["errors"]


def test_a_second_backward_without_no_sync_is_refused(pools):
    results = pools(2).run(scenarios_safety.second_backward_is_refused)
    assert all(m is not None and "no_sync" in m for m in results), results


@pytest.mark.parametrize("collectives", ["gloo", "min_bytes"])
def test_determinism_overlap_bucket_size_and_norms(pools, collectives):
    runs = {
        key: pools(2).run(scenarios_safety.determinism, overlap, bucket, stage, collectives)
        for key, (overlap, bucket, stage) in {
            "overlap": (True, 512, 2),
            "no_overlap": (False, 512, 2),
            "stage1_big_buckets": (True, 1 << 20, 1),
            "stage1_overlap": (True, 512, 1),
            "stage1_no_overlap": (False, 512, 1),
        }.items()
    }

    def same(a, b):
        return all((x == y).all() for x, y in zip(a["params"], b["params"], strict=True))

    assert same(runs["overlap"][0], runs["no_overlap"][0])  # overlap on/off: bit-identical
    # Bucket size at world 2: bit-identical where it does not change who owns what (the rank-major
    # layout stage 1 uses). An interleaved layout is cut by bucket size, so ownership, and with it
    # the summation order of the clipping norm, follows the buckets.
    assert same(runs["stage1_overlap"][0], runs["stage1_big_buckets"][0])
    assert same(runs["stage1_overlap"][0], runs["stage1_no_overlap"][0])
    for run in runs.values():
        assert run[0]["norms"] == run[1]["norms"]  # the norm is identical on every rank


@pytest.mark.parametrize("collectives", ["gloo", "min_bytes"])
def test_bucket_size_changes_gradients_only_by_sum_rounding_at_world_4(pools, collectives):
    small = pools(4).run(scenarios_safety.determinism, True, 256, 2, collectives)[0]
    big = pools(4).run(scenarios_safety.determinism, True, 1 << 20, 2, collectives)[0]
    worst = max(
        float((a - b).abs().max() / b.abs().max()) for a, b in zip(small["grads"], big["grads"], strict=True)
    )
    assert worst < 1e-6  # a different summation order of four fp32 values, nothing more


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_semantics(pools, stage):
    r = pools(2).run(scenarios_safety.grads_after_zero_grad, stage)[0]
    if stage == 2:
        assert all(r["after_step_none"])  # gradients are sharded: freed once reduced
    else:
        assert not any(r["after_step_none"])  # stage 1 keeps full gradients as buffer views
    assert all(r["none"])
    if stage == 1:
        assert all(r["kept_zero"])


def test_every_rank_starts_from_rank_zero_parameters(pools):
    for r in pools(4).run(scenarios_safety.start_from_rank_zero):
        assert r["same"] and r["masters"]


def test_a_dropped_optimizer_does_not_reduce_gradients(pools):
    for r in pools(2).run(scenarios_safety.dropped_optimizer_stays_quiet):
        assert r["collected"] and r["applied"]


def test_exchanges_are_refused_off_gloo_on_every_rank(pools):
    """The gloo policy's point-to-point exchanges could deadlock on NCCL (unbatched irecv/isend): refused
    at construction on every rank; stage 1 rank-major (all-reduce, broadcasts) needs none and is built."""
    for r in pools(2).run(scenarios_safety.exchanges_off_gloo):
        assert r["refused"] is not None and "collectives='min_bytes'" in r["refused"], r
        assert r["rank_major"] is None and r["unchanged"], r
