"""The torch.optim contract and misuse that would train silently wrong: refused on every rank."""

from __future__ import annotations

import pytest
import scenarios_contract

FP32_TOL = 1e-6


@pytest.mark.parametrize(("how", "stage"), [("to_device", 2), ("to_device", 1), ("one_rank", 2)])
def test_detached_parameters_are_refused(pools, how, stage):
    results = pools(2).run(scenarios_contract.detached_parameters, how, stage)
    for result in results:
        assert result["error"] is not None and result["error"].startswith("ConfigError"), result
        assert result["unchanged"], result
    if how == "to_device":
        assert all("no longer shares storage" in r["error"] for r in results)
    else:
        assert "another rank" in results[0]["error"]
        assert "blocks.0.fc.weight" in results[1]["error"] or "no longer shares" in results[1]["error"]


def test_hyperparameters_must_agree_at_construction(pools):
    results = pools(2).run(scenarios_contract.different_hyperparameters)
    for result in results:
        for name in ("lr", "weight_decay", "group_lr", "loss_scale"):
            assert result[name] is not None and "different optimizer settings" in result[name], (name, result)
    assert "'lr'" in results[0]["lr"] and "'weight_decay'" in results[0]["weight_decay"]
    assert "loss_scale" in results[0]["loss_scale"]


def test_param_groups_edited_on_one_rank_are_caught_at_step(pools):
    results = pools(2).run(scenarios_contract.diverging_param_groups)
    for result in results:
        assert result["error"] is not None and "different hyper-parameters" in result["error"], result
        assert result["unchanged"] and result["then"]
        assert result["retried"] is None and result["as_never_refused"], result  # a retry steps


@pytest.mark.parametrize(("stage", "overlap"), [(2, True), (1, True), (2, False)])
def test_no_sync_backward_after_a_synchronised_one_is_refused(pools, stage, overlap):
    results = pools(2).run(scenarios_contract.no_sync_after_synchronised_backward, stage, overlap)
    for result in results:
        assert result["error"] is not None and "second gradient" in result["error"], result
        assert result["unchanged"]
        assert result["moved"] == [-101.0] * 4  # the right order sums both passes


def test_add_param_group_starts_every_rank_from_rank_zero(pools):
    results = pools(2).run(scenarios_contract.add_group_starts_from_rank_zero)
    assert all(bool((r["values"] == 0).all()) for r in results)
    assert all(bool((r["after"] == results[0]["after"]).all()) for r in results)


def test_torch_optim_contract(pools):
    results = pools(2).run(scenarios_contract.torch_optim_contract)
    for result in results:
        assert result["returned"] == pytest.approx(result["expected"], rel=1e-6)
        assert result["plain"] is None
        assert result["k"] == [2] and result["boost"] == [1.0]  # written by the inner step, twice
    assert max(results[0]["errors"]) < FP32_TOL


def test_refused_constructions(pools):
    results = pools(2).run(scenarios_contract.refused_constructions)
    for result in results:
        for name in ("typo", "single_tensor", "not_iterable", "not_a_tensor"):
            assert result[name] is not None and result[name].startswith("ConfigTypeError"), (name, result)
        assert "weight_decya" in result["typo"]
        assert "LBFGS cannot be sharded" in result["lbfgs"]
        assert "SparseAdam cannot be sharded" in result["sparse_adam"]
        assert "stage must be 1, 2 or 3" in result["stage_true"]
        assert result["group_extra_key"] is None  # torch lets groups carry extra keys


@pytest.mark.parametrize("stage", [1, 2])
def test_sparse_gradients_train_like_torch_sgd(pools, stage):
    results = pools(2).run(scenarios_contract.sparse_gradients, stage)
    assert max(results[0]["errors"]) < FP32_TOL, results[0]["errors"]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_model_wrapped_in_ddp_is_refused(pools, stage):
    results = pools(2).run(scenarios_contract.wrapped_in_ddp, stage)
    for result in results:
        assert result["error"] is not None and "DistributedDataParallel" in result["error"], result
        assert result["unchanged"]


def test_a_gradient_changed_by_hand_at_stage_1_is_refused(pools):
    for result in pools(2).run(scenarios_contract.grad_changed_by_hand):
        assert result["error"] is not None and "opt.clip_grad_norm_" in result["error"], result
        assert result["unchanged"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tensor_subclass_parameters_are_refused_naming_them(pools, stage):
    """A DTensor parameter without a device mesh naming its tp dimension is refused rather than sharded
    wrong, as is a parameter subclass; every rank raises, the message names the parameter."""
    for result in pools(2).run(scenarios_contract.tensor_subclass_params, stage):
        assert result["dtensor"] is not None and result["dtensor"].startswith("ConfigError"), result
        assert "blocks.0.fc.weight" in result["dtensor"] and "DTensor" in result["dtensor"], result
        assert result["own"] is not None and "head.weight" in result["own"], result
        assert "_OwnParameter" in result["own"], result
        assert result["unchanged"] and result["plain_after"]


def test_state_dict_hooks_run_as_on_torch_optim(pools):
    for r in pools(2).run(scenarios_contract.state_dict_hooks):
        assert r["zero"] == r["torch"] == ["save_pre", "save_post", "load_pre:1", "load_post"], r
        assert r["zero_marked"] == r["torch_marked"] == 1, r
        assert r["refused"] is not None and "hook refuses" in r["refused"], r  # on every rank
        assert r["unchanged"], r
