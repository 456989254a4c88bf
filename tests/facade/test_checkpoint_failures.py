"""Corrupted, truncated, foreign or incomplete checkpoints and interrupted saves."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import scenarios_checkpoint
import torch
from checkpoint_damage import flip_tensor_byte, snapshot_of

from zeroplan.facade.checkpoint.manifest import seal

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def good(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    pools(2).run(scenarios_checkpoint.save_reference, {"dtype": "bf16"}, str(root))
    return root


def _copy(good: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(good, target)
    return target


CASES = {
    "truncated": ("truncated", lambda root: _truncate(snapshot_of(root) / "shard-00001.pt")),
    "corrupted": ("checksum mismatch", lambda root: flip_tensor_byte(snapshot_of(root) / "shard-00000.pt")),
    "corrupted_region": (
        "checksum mismatch",
        lambda root: flip_tensor_byte(snapshot_of(root) / "shard-00001.pt"),
    ),
    "missing_rank": ("missing shard files", lambda root: (snapshot_of(root) / "shard-00001.pt").unlink()),
    "no_manifest": (
        "not a complete zeroplan checkpoint",
        lambda root: (snapshot_of(root) / "manifest.json").unlink(),
    ),
    "other_model": ("differs in shape", None),
    "other_optimizer": ("checkpoint of optimizer 'AdamW'", None),
    "partial": (
        "interrupted save",
        lambda root: shutil.copytree(snapshot_of(root), root / "snapshot-00000009.partial"),
    ),
}


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def _edit_manifest(edit: Callable[[dict[str, Any]], None], *, reseal: bool = False) -> Callable[[Path], None]:
    """Damage: ``edit`` the manifest; ``reseal``: then record the files' sizes and digest again,
    as a tool that rewrites manifests would (only the cross-checks against the data can tell)."""

    def damage(root: Path) -> None:
        path = snapshot_of(root) / "manifest.json"
        document = json.loads(path.read_text())
        edit(document)
        if reseal:
            for name in document["files"]:
                document["files"][name] = (path.parent / name).stat().st_size
            document = seal(document)
        path.write_text(json.dumps(document))

    return damage


def _set(*keys: str | int, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(document: dict[str, Any]) -> None:
        for key in keys[:-1]:
            document = document[key]
        document[keys[-1]] = value

    return edit


def _drop(*keys: str) -> Callable[[dict[str, Any]], None]:
    def edit(document: dict[str, Any]) -> None:
        for key in keys[:-1]:
            document = document[key]
        del document[keys[-1]]

    return edit


def _string_for_a_tensor(root: Path) -> None:
    """Rank 1's shard file holds a string where a state tensor was (a crafted, self-consistent file)."""
    path = snapshot_of(root) / "shard-00001.pt"
    data = torch.load(path, weights_only=True)
    data["tensors"]["state/flat/bfloat16/exp_avg"] = "not a tensor"
    torch.save(data, path)
    _edit_manifest(lambda document: None, reseal=True)(root)


def _latest_outside(root: Path, absolute: bool) -> None:
    """``latest`` names a valid snapshot outside the checkpoint root."""
    elsewhere = root.parent / "elsewhere" / snapshot_of(root).name
    shutil.copytree(snapshot_of(root), elsewhere)
    (root / "latest").write_text(str(elsewhere) if absolute else f"../elsewhere/{elsewhere.name}")


LR = ("param_groups", 0, "lr")
STEP = ("state", "scalars/0/0", "value", "step", "__tensor__")
EXP_AVG_DTYPE = ("state", "flat/bfloat16/exp_avg", "dtype")

CASES.update(
    {
        # item 3: `latest` names only a snapshot of its own directory
        "latest_absolute": ("not the name of a snapshot", lambda root: _latest_outside(root, True)),
        "latest_outside": ("not the name of a snapshot", lambda root: _latest_outside(root, False)),
        # item 4: an edited manifest fails its digest ...
        "manifest_lr": ("manifest was edited", _edit_manifest(_set(*LR, value=5.0))),
        "manifest_step": ("manifest was edited", _edit_manifest(_set(*STEP, value=[3000.0]))),
        "manifest_dtype": ("manifest was edited", _edit_manifest(_set(*EXP_AVG_DTYPE, value="float16"))),
        "manifest_masters": ("manifest was edited", _edit_manifest(_set("separate_master", value=[]))),
        "manifest_state_key": (
            "manifest was edited",
            _edit_manifest(_drop("state", "flat/bfloat16/exp_avg_sq")),
        ),
        # ... and a resealed one is cross-checked against the data files
        "resealed_dtype": (
            "the manifest says float16",
            _edit_manifest(_set(*EXP_AVG_DTYPE, value="float16"), reseal=True),
        ),
        "resealed_masters": (
            "separate_master",
            _edit_manifest(_set("separate_master", value=[]), reseal=True),
        ),
        "resealed_no_masters": (
            "'separate_master'",
            _edit_manifest(_drop("separate_master"), reseal=True),
        ),
        "resealed_state_key": (
            "which the manifest does not list",
            _edit_manifest(_drop("state", "flat/bfloat16/exp_avg_sq"), reseal=True),
        ),
        # item 5: a failure on one rank only reaches every rank
        "string_for_a_tensor": ("not a tensor", _string_for_a_tensor),
        "fault_on_one_rank": ("injected failure", None),
    }
)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_checkpoint_is_a_clear_error_and_changes_nothing(pools, good, tmp_path, case):
    fragment, damage = CASES[case]
    root = _copy(good, tmp_path)
    if damage is not None:
        damage(root)
    results = pools(2).run(scenarios_checkpoint.failed_loads, str(root), case, timeout=120)
    for r in results:
        assert r["error"] is not None, case
        assert r["unchanged"], f"{case}: the failed load changed the optimizer or parameters"
    assert any(fragment in r["error"] for r in results), [r["error"] for r in results]


@pytest.fixture(scope="module")
def good_adafactor(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("good_adafactor")
    pools(2).run(scenarios_checkpoint.save_reference, {"optimizer": "adafactor"}, str(root))
    return root


def test_a_manifest_entry_only_one_rank_reads_fails_on_every_rank(pools, good_adafactor, tmp_path):
    """Whole-parameter state is read by its owner only: a bad entry there must still reach rank 0."""
    root = _copy(good_adafactor, tmp_path)
    manifest = json.loads((snapshot_of(root) / "manifest.json").read_text())
    leaf = next(p for p, d in manifest["state"].items() if d.get("ranks") == [1])
    _edit_manifest(_set("state", leaf, "ranks", value=["x"]), reseal=True)(root)
    results = pools(2).run(
        scenarios_checkpoint.failed_loads,
        str(root),
        "one_rank_entry",
        {"optimizer": "adafactor"},
        timeout=120,
    )
    for r in results:
        assert r["error"] is not None and r["unchanged"], r
    assert all(leaf in r["error"] for r in results), [r["error"] for r in results]


def test_bad_state_dicts_are_clear_errors_and_change_nothing(pools):
    for r in pools(2).run(scenarios_checkpoint.failed_state_dict_loads):
        assert "another plan" in r["errors"]["other_plan"]
        assert "has shape (3, 3)" in r["errors"]["bad_shape"]
        assert "'state' and 'param_groups'" in r["errors"]["not_a_dict"]
        assert r["unchanged"]


ONE_RANK_DICTS = {
    "sharded": "has shape (3,)",
    "plain_bad_shape": "has shape (3, 3)",
    "plain_not_a_dict": "'state' and 'param_groups'",
    "plain_other_steps": "another plan than rank 0's",
    "plain_other_lr": "other hyper-parameters",
}


@pytest.mark.parametrize("case", sorted(ONE_RANK_DICTS))
def test_a_state_dict_rejected_on_one_rank_raises_on_every_rank(pools, case):
    results = pools(2).run(scenarios_checkpoint.state_dict_bad_on_one_rank, case, timeout=120)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"{case}: rank {rank} loaded a dict another rank rejected"
        assert r["unchanged"], f"{case}: the failed load changed rank {rank}'s optimizer or parameters"
    assert any(ONE_RANK_DICTS[case] in r["error"] for r in results), [r["error"] for r in results]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("point", ["shard_write", "background_write", "manifest_written", "before_latest"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(pools, tmp_path, point):
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(HERE / "crash_save.py"), str(root), point, str(_free_port())],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode != 0, "the interrupted save should fail"
    assert (root / "latest").read_text().strip() == "snapshot-00000001"
    results = pools(2).run(scenarios_checkpoint.load_and_compare, {"dtype": "bf16"}, str(root))
    assert results[0]["state_same"] and results[0]["params_same"]
    assert results[0]["extra"] == {"step": 2}
    for partial in root.glob("*.partial"):
        bad = pools(2).run(scenarios_checkpoint.failed_loads, str(root), "partial")
        assert all("interrupted save" in r["error"] and r["unchanged"] for r in bad)
        del partial
        break
