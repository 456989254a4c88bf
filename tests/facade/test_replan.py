"""Frozen parameters, refresh_trainable and add_param_group."""

from __future__ import annotations

import pytest
import scenarios_replan
from models import rel_err

FP32_TOL = 1e-6


@pytest.mark.parametrize(
    ("world", "stage", "optimizer"), [(2, 2, "adamw"), (4, 1, "sgd"), (4, 2, "adafactor"), (3, 2, "adamw")]
)
def test_freeze_and_unfreeze_mid_run_keeps_state(pools, world, stage, optimizer):
    results = pools(world).run(scenarios_replan.freeze_and_unfreeze, stage, "fp32", optimizer)
    r = results[0]
    assert len(r["errors"]) == 6
    assert max(r["errors"]) < FP32_TOL, r["errors"]
    assert r["frozen_unchanged"]


@pytest.mark.parametrize("stage", [1, 2])
def test_add_param_group_mid_run(pools, stage):
    r = pools(4).run(scenarios_replan.add_group, stage)[0]
    assert max(r["errors"]) < FP32_TOL, r["errors"]
    assert r["groups"][-1] == [1e-2, 3e-3]


def test_new_bf16_parameters_start_from_their_own_values(pools):
    for r in pools(2).run(scenarios_replan.new_bf16_params_keep_their_values):
        assert set(r["changes"].values()) == {0.0}, r["changes"]


def test_bad_add_param_group_changes_nothing(pools):
    for r in pools(2).run(scenarios_replan.bad_add_group):
        assert r["error"] is not None and "already listed" in r["error"], r["error"]
        assert r["same"] and r["applied"]


@pytest.mark.parametrize("stage", [2, 1, 3])
def test_a_parameter_unfrozen_without_refresh_trainable_is_refused(pools, stage):
    """torch.optim would train it; without refresh_trainable() no hook takes its gradient."""
    for rank, r in enumerate(pools(2).run(scenarios_replan.unfrozen_without_refresh, stage)):
        assert r["error"] is not None and r["error"].startswith("ConfigError"), r
        assert ("refresh_trainable" in r["error"]) and ("another rank" in r["error"]) == (rank == 0), r
        assert r["same"] and r["applied"], r


@pytest.mark.parametrize(
    ("world", "stage", "dtype", "optimizer", "shard"),
    [
        (2, 2, "fp32", "adamw", None),
        (2, 1, "bf16", "adamw", None),
        (4, 2, "bf16", "adamw", 2),
        (2, 2, "fp32", "sgd", None),
        (2, 2, "fp32", "adafactor", None),
    ],
)
def test_a_temporarily_frozen_parameter_keeps_its_state(pools, world, stage, dtype, optimizer, shard):
    r = pools(world).run(scenarios_replan.freeze_then_unfreeze, stage, dtype, optimizer, shard)[0]
    tolerance = FP32_TOL if dtype == "fp32" else 2**-7
    assert len(r["errors"]) == 7 and max(r["errors"]) < tolerance, r["errors"]


@pytest.mark.parametrize("form", ["sharded", "consolidated"])
def test_parked_state_survives_state_dicts(pools, form):
    results = pools(2).run(scenarios_replan.parked_state_survives_state_dicts, form)
    for r in results:
        assert r["parked_in_dict"]
        assert max(r["errors"]) <= (0.0 if form == "sharded" else FP32_TOL), r["errors"]


def test_parked_state_survives_elastic_checkpoints(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    uninterrupted = pools(2).run(scenarios_replan.parked_state_survives_checkpoints, root, "save")[0]
    resumed = pools(4).run(scenarios_replan.parked_state_survives_checkpoints, root, "load")
    for r in resumed:
        errors = [rel_err(a, b) for a, b in zip(r["params"], uninterrupted["params"], strict=True)]
        assert max(errors) < FP32_TOL, errors
