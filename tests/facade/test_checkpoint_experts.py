"""Checkpoint directories of a mixture-of-experts optimizer (expert param groups) at world 4.

The data domain is saved and loaded as without experts (elastic); each rank's expert state goes
into its own file of the same snapshot, committed with it, and loads only at the same world,
expert groups and expert partitions. Every refusal is a ``CheckpointError`` on every rank that
leaves the optimizer and the parameters exactly as they were.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import scenarios_checkpoint_experts as scenarios
from checkpoint_damage import flip_tensor_byte, snapshot_of

from zeroplan.facade.checkpoint.manifest import EXPERTS_FORMAT, seal

ROUND_TRIPS = [
    {"stage": 2},
    {"stage": 1, "dtype": "bf16", "loss_scale": "dynamic", "shard": 2},
    {"stage": 2, "optimizer": "sgd", "experts_first": True, "expert_lr": 3e-2, "freeze_expert": True},
    {"stage": 3, "clip": 0.05},  # both domains' parameters sharded: regions come from the shards
    {"optimizer": "adafactor"},
]


@pytest.mark.parametrize("cfg", ROUND_TRIPS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_a_loaded_moe_checkpoint_trains_on_bit_for_bit(pools, tmp_path, cfg):
    results = pools(4).run(scenarios.round_trip, cfg, str(tmp_path / "ckpt"))
    for r in results:
        assert r["extra"] == scenarios.EXTRA
        assert r["loaded"] and r["same"]
    first = results[0]
    assert first["format"] == EXPERTS_FORMAT
    assert first["experts"] == {"experts": [[0, 2], [1, 3]]}
    data = [f"shard-{q:05d}.pt" for q in range(2 if cfg.get("shard") else 4)]
    experts = [f"experts-experts-{r:05d}.pt" for r in range(4)]
    assert first["listed"] == sorted(data + experts)
    assert first["files"] == sorted([*data, *experts, "manifest.json"])


def test_the_data_domain_still_loads_at_another_shard_size(pools, tmp_path):
    for r in pools(4).run(scenarios.data_domain_is_elastic, str(tmp_path / "ckpt")):
        assert r["loaded"] and r["close"] and r["shard_size"] == 2


def test_rotation_removes_old_snapshots_with_their_expert_files(pools, tmp_path):
    root = tmp_path / "ckpt"
    results = pools(4).run(scenarios.rotation, str(root))
    last = Path(results[0]["snapshots"][-1]).name
    assert all(r["loaded"] for r in results)
    assert all(r["snapshots"] == results[0]["snapshots"] for r in results)
    snapshot_files = sorted(
        [f"{last}/manifest.json"]
        + [f"{last}/shard-{q:05d}.pt" for q in range(4)]
        + [f"{last}/experts-experts-{q:05d}.pt" for q in range(4)]
    )
    assert results[0]["found"] == sorted(["latest", "writer.lock", *snapshot_files])


def test_a_failed_expert_write_on_one_rank_fails_the_save_everywhere_and_keeps_the_last(pools, tmp_path):
    results = pools(4).run(scenarios.failed_save, str(tmp_path / "ckpt"))
    for r in results:
        assert r["error"] is not None and r["error"].startswith("CheckpointError: "), r["error"]
        assert r["latest"] == r["first"] and r["loaded"]
        assert r["left"] == [Path(r["first"]).name]  # the failed save's partial directory is gone
    assert any("No space left on device" in r["error"] for r in results)


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    """A MoE checkpoint and a data-only one (an optimizer over the same dense parameters), at world 4."""
    roots = {}
    for name, cfg in {"moe": {}, "dense": {"dense_only": True}}.items():
        root = tmp_path_factory.mktemp(name)
        pools(4).run(scenarios.save, cfg, str(root))
        roots[name] = root
    return roots


def _reseal(root: Path, edit) -> None:
    """Edit the manifest and seal it again, as a tool that rewrites manifests would."""
    path = snapshot_of(root) / "manifest.json"
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(seal(document)))


def _expert_leaf_dtype(document: dict) -> None:
    group = document["experts"]["domains"][0]["groups"][1]
    group["state"]["flat/float32/exp_avg"]["dtype"] = "float16"


def _drop_experts(document: dict) -> None:
    del document["experts"]


CASES = {
    # (source, damage, loading optimizer, fault, a fragment of the error one rank at least reports)
    "missing_expert_file": (
        "moe",
        lambda root: (snapshot_of(root) / "experts-experts-00002.pt").unlink(),
        {},
        False,
        "missing expert files of domain 'experts', which the ranks of expert group [0, 2] read: "
        "experts-experts-00002.pt",
    ),
    "corrupt_expert_file": (
        "moe",
        lambda root: flip_tensor_byte(snapshot_of(root) / "experts-experts-00001.pt"),
        {},
        False,
        "checksum mismatch",
    ),
    "truncated_expert_file": (
        "moe",
        lambda root: (snapshot_of(root) / "experts-experts-00003.pt").write_bytes(b"x"),
        {},
        False,
        "truncated",
    ),
    "resealed_expert_dtype": ("moe", lambda root: _reseal(root, _expert_leaf_dtype), {}, False, "float16"),
    "resealed_without_experts": ("moe", lambda root: _reseal(root, _drop_experts), {}, False, "'experts'"),
    "data_only_into_moe": ("dense", None, {}, False, "holds no expert state"),
    "moe_into_dense": ("moe", None, {"dense_only": True}, False, "this optimizer has no expert param groups"),
    "other_expert_groups": ("moe", None, {"groups": "single"}, False, "is in expert group [0] here"),
    "other_optimizer": ("moe", None, {"optimizer": "sgd"}, False, "checkpoint of optimizer 'AdamW'"),
    "fault_on_one_rank": ("moe", None, {}, True, "injected failure"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_moe_load_fails_on_every_rank_and_changes_nothing(pools, saved, tmp_path, case):
    source, damage, cfg, fault, fragment = CASES[case]
    root = tmp_path / "ckpt"
    shutil.copytree(saved[source], root)
    if damage is not None:
        damage(root)
    results = pools(4).run(scenarios.failed_load, str(root), cfg, fault)
    for r in results:
        assert r["error"] is not None, case
        assert r["unchanged"], f"{case}: the failed load changed the optimizer or parameters"
    errors = [r["error"] for r in results]
    if case != "other_optimizer":  # another optimizer class is an IncompatiblePlanError, as without experts
        assert all(e.startswith("CheckpointError: ") for e in errors), errors
    assert any(fragment in e for e in errors), errors


def test_expert_state_loads_only_at_the_world_size_it_was_saved_at(pools, saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved["moe"], root)
    results = pools(2).run(scenarios.failed_load, str(root), {}, False)
    for r in results:
        assert r["unchanged"]
        assert r["error"].startswith("CheckpointError: ") and "saved at world size 4" in r["error"], r[
            "error"
        ]


DCP_CASES = [
    {"stage": 2},  # the same optimizer: bit for bit, the next steps too
    {"stage": 3, "dtype": "bf16"},  # fp32 masters bit for bit through the model's dict
    {"stage": 3, "load": {"stage": 2}},  # another stage: the values bit for bit
    {"load": {"shard": 2}},  # the dense parameters in shard groups of 2: DCP reshards them
]


@pytest.mark.parametrize("cfg", DCP_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_dcp_moves_every_expert_under_its_own_names(pools, tmp_path, cfg):
    for r in pools(4).run(scenarios.dcp_round_trip, cfg, str(tmp_path / "dcp")):
        assert r["params"] and r["trained_alike"], r
        if "load" not in cfg:
            assert r["same"] and r["bit_for_bit"], r
        assert "expert groups" in r["model"] and "expert groups" in r["optim"], r
