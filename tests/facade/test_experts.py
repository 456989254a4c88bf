"""Expert param groups (issue 13, part 3): a mixture-of-experts model at world 4 on gloo.

Two expert-parallel groups of 2 ranks exchange tokens with ``all_to_all``; the expert param
group carries its expert-data-parallel group (``{"params": experts, "process_group": ep_dp}``),
so its gradients are averaged and its state sharded over those 2 ranks while the dense
parameters use all 4. Checked against one process stepping ``torch.optim`` with every expert.
"""

from __future__ import annotations

import pytest
import scenarios_experts

REFERENCE_CASES = [
    {"stage": 2},
    {"stage": 1},
    {"stage": 2, "clip": 0.05},
    {"stage": 2, "clip": 0.05, "experts_first": True, "expert_lr": 3e-3},
    {"stage": 2, "optimizer": "sgd", "clip": 0.5, "collectives": "min_bytes"},
    {"stage": 2, "shard": 2, "clip": 0.05},  # MiCS for the dense parameters, experts over their group
    {"stage": 2, "loss_scale": "dynamic", "clip": 0.05, "overlap_grad_reduce": False},
    {"stage": 2, "dtype": "bf16", "clip": 0.05},
    {"stage": 2, "micro": 2, "clip": 0.05},  # no_sync accumulation in every domain
    {"stage": 1, "scheduler": True, "expert_lr": 3e-2, "experts_first": True},  # LR schedules reach experts
    {"stage": 3, "clip": 0.05},  # one ShardedParams per domain, attached to the same model
    {"stage": 3, "clip": 0.05, "micro": 2, "loss_scale": "dynamic", "reshard_after_forward": False},
    {"stage": 3, "dtype": "bf16", "clip": 0.05, "shard": 2},
    # CPU offload in both domains ([Note: offload, executed]), MiCS for the dense parameters
    {"stage": 2, "offload": "optimizer", "shard": 2, "clip": 0.05, "loss_scale": "dynamic"},
    {"stage": 3, "offload": "all", "dtype": "bf16", "clip": 0.05},
    {"stage": 2, "offload": "optimizer", "offload_fraction": 0.5, "clip": 0.05},  # each domain splits
    # wire formats in both domains: int8 / fp8 gradients and parameters, added in fp32. SGD: AdamW
    # would step every element by about lr whatever its (rounded) gradient, far from the reference
    {"stage": 2, "dtype": "bf16", "optimizer": "sgd", "reduce_dtype": "int8", "gather_dtype": "int8"},
    {
        "stage": 3,
        "dtype": "bf16",
        "optimizer": "sgd",
        "shard": 2,
        "reduce_dtype": "fp8",
        "gather_dtype": "fp8",
    },
]


@pytest.mark.parametrize("cfg", REFERENCE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_moe_matches_the_unsharded_optimizer(pools, cfg):
    tolerance = 3e-2 if cfg.get("dtype") == "bf16" else 2e-5
    if "reduce_dtype" in cfg:  # measured 0.044 (int8) and 0.039 (fp8): 1/254 and 1/16 of a block's
        tolerance = 0.1  # largest gradient per element, times lr 0.1 with momentum, over three steps
    for r in pools(4).run(scenarios_experts.matches_reference, cfg):
        assert r["domains"] == ["data", "experts"] and r["expert_world"] == 2
        assert r["stepping"] == ["HostStep" if "offload" in cfg else "DeviceStep"] * 2, r["stepping"]
        assert max(r["param_err"]) < tolerance, r["param_err"]
        assert max(r["norm_err"]) < tolerance, r["norm_err"]
        assert not r["skipped"]
        if cfg["stage"] == 3:  # both domains' parameters are sharded between steps and gathered by use
            assert r["classes"] == ["ShardedParameter"], r["classes"]
            gathers = {
                ("experts/shard", "all_gather"),
                ("experts/shard", "broadcast"),
            }  # by collective policy
            assert gathers & set(r["comm"]), r["comm"]
            # autograd's saved tensors of both domains' blocks are marked (they gather again when unpacked)
            assert all(min(counts) > 0 for counts in r["saved_views"]), r["saved_views"]
            if cfg.get("reshard_after_forward", True):  # freed after forward, saved views included
                assert r["held_after_forward"] == 0, r["held_after_forward"]


@pytest.mark.parametrize(
    "cfg",
    [
        {"stage": 2},
        {"stage": 2, "loss_scale": "dynamic", "collectives": "min_bytes"},
        {"stage": 1},
        {"stage": 3},
        {"stage": 3, "reduce_dtype": "int8", "gather_dtype": "int8", "wire_block": 16},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_expert_state_is_sharded_over_the_expert_group_and_measured_as_planned(pools, cfg):
    for r in pools(4).run(scenarios_experts.accounting, cfg):
        assert r["measured"] == r["planned"], (r["measured"], r["planned"])
        assert r["comm"] == r["planned_comm"], (r["comm"], r["planned_comm"])
        # 2 ranks share each expert's state: about half of it here (stage 1 splits unevenly)
        assert 0.45 * r["expert_unsharded_state"] <= r["expert_state"] <= 0.55 * r["expert_unsharded_state"]
        assert any(g.startswith("experts/") for g in r["comm_groups"]), r["comm_groups"]
        assert "memory_reports()" in r["single_report_error"]


def test_state_dict_round_trip_with_expert_groups(pools):
    for r in pools(4).run(scenarios_experts.state_dict_round_trip, {"stage": 2}):
        assert r["equal"]
        assert r["format"] == "zeroplan.domains/1" and r["domains"] == ["data", "experts"]
        assert set(r["errors"]) == {"shards", "consolidated", "plain"}, r["errors"]
        assert "expert groups" in r["errors"]["shards"]


def test_an_expert_overflow_on_one_rank_skips_the_step_everywhere(pools):
    for r in pools(4).run(scenarios_experts.overflow_on_one_expert, {"stage": 2}):
        assert r["skipped"] and r["unchanged"]
        assert r["scale"][1] == r["scale"][0] / 2


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("shapes", "domain 'experts' (param groups [1], global ranks [0, 2]): rank 1 describes different"),
        ("lr", "domain 'experts' (param groups [1], global ranks [1, 3]): rank 1 was given different"),
        ("not_a_group", "ProcessGroup"),
        ("not_member", "not a member"),
        ("not_partition", "the expert groups must split the data-parallel ranks into disjoint groups"),
        ("twice", "list each parameter once"),
    ],
)
def test_wrong_expert_setups_raise_on_every_rank(pools, case, words):
    errors = pools(4).run(scenarios_experts.misuse, case)
    for error in errors:
        assert error is not None, errors
    assert any(words in e for e in errors), errors
    if case in ("shapes", "lr"):  # ranks of the other expert group learn of it too
        assert sum("(in an expert group) rejected the optimizer settings" in e for e in errors) == 2, errors


@pytest.mark.parametrize("stage", [1, 2])
def test_an_expert_idle_on_one_rank_of_its_group_neither_hangs_nor_diverges(pools, stage):
    for r in pools(4).run(scenarios_experts.idle_experts_on_one_rank, {"stage": stage}):
        assert r["same_in_group"] and r["overlap_equal"]


@pytest.mark.parametrize("stage", [1, 2])  # (stage 3 reads parameters only inside the model's forward)
def test_refresh_trainable_and_add_param_group_with_expert_groups(pools, stage):
    for r in pools(4).run(scenarios_experts.replanning_with_experts, {"stage": stage}):
        assert (r["frozen"], r["moved"], r["same_in_group"]) == (True, True, True), r
        assert r["groups"] == [("data", 1), ("experts", 2)] and r["lr"] == 0.5


@pytest.mark.parametrize(
    "case", ["unknown_group", "bad_state_dict", "expert_group_only", "expert_param_again"]
)
def test_one_rank_misusing_replanning_or_loading_raises_everywhere(pools, case):
    errors = pools(4).run(scenarios_experts.one_rank_misuses_replanning, case)
    assert all(e is not None for e in errors), errors
    if case == "expert_param_again":  # named where it is listed already, on rank 0; heard elsewhere
        assert "param group 2, position 0: this parameter is already listed at param group 1" in errors[0]
        assert all("rank 0 rejected" in e and "already listed at param group 1" in e for e in errors[1:]), [
            e[:90] for e in errors
        ]
