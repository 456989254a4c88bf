"""The checkpoint root: snapshot names, what ``latest`` may name, one writer per root."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import scenarios_checkpoint_root

from zeroplan.core import CheckpointError
from zeroplan.facade import checkpoint
from zeroplan.facade.checkpoint import root as checkpoint_root

HERE = Path(__file__).parent


@pytest.mark.parametrize("stray", ["snapshot-backup", "snapshot-999999999", "snapshot-00000001.old"])
def test_a_stray_folder_beside_the_snapshots_never_costs_the_new_one(pools, tmp_path, stray):
    root = tmp_path / "ckpt"
    results = pools(2).run(scenarios_checkpoint_root.save_beside_stray, str(root), stray)
    committed = results[0]["committed"]
    assert all(r["loaded_same"] for r in results)
    assert (root / "latest").read_text().strip() == committed
    assert (root / committed / "manifest.json").is_file()
    if stray == "snapshot-999999999":  # a snapshot name: numbered after it, and older snapshots go
        assert committed == "snapshot-1000000000"
        assert sorted(p.name for p in root.glob("snapshot-*")) == [committed]
    else:  # not a snapshot name: ignored, never deleted
        assert committed == "snapshot-00000002"
        assert sorted(p.name for p in root.glob("snapshot-*")) == sorted([committed, stray])


@pytest.mark.parametrize("world", [2, 4])
def test_a_second_job_writing_the_same_root_is_refused(pools, tmp_path, world):
    """Two jobs (of one rank, or of two) on one root: the second raises on each of its ranks."""
    root = tmp_path / "ckpt"
    results = pools(world).run(scenarios_checkpoint_root.two_writers, str(root))
    for r in results:
        assert r["partial_kept"], "the second job deleted the first job's save in progress"
        if r["job"] == 1:
            assert r["saved"] == [] and r["unchanged"]
            assert "another job" in r["error"] and "writer.lock" in r["error"], r["error"]
        else:
            assert r["saved"] == ["snapshot-00000001", "snapshot-00000006"] and r["error"] is None
    assert (root / "latest").read_text().strip() == "snapshot-00000006"
    assert sorted(p.name for p in root.glob("snapshot-*")) == ["snapshot-00000006"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_job_that_died_mid_save_leaves_no_lock_and_its_partial_goes(pools, tmp_path):
    root = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, str(HERE / "crash_save.py"), str(root), "shard_write", str(_free_port())],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode != 0, "the interrupted save should fail"
    assert [p.name for p in root.glob("*.partial")] == ["snapshot-00000002.partial"]
    names = pools(2).run(scenarios_checkpoint_root.resume_and_save, str(root))
    assert names == ["snapshot-00000003"] * 2
    assert (root / "latest").read_text().strip() == "snapshot-00000003"
    assert sorted(p.name for p in root.glob("snapshot-*")) == ["snapshot-00000003"]


@pytest.mark.parametrize(
    "content", ["/abs/snapshot-00000001", "../other/snapshot-00000001", "snapshot-x", ""]
)
def test_latest_must_name_a_snapshot_of_its_own_directory(tmp_path, content):
    root = tmp_path / "ckpt"
    (root / "snapshot-00000001").mkdir(parents=True)
    (tmp_path / "other" / "snapshot-00000001").mkdir(parents=True)
    (root / "latest").write_text(content)
    with pytest.raises(CheckpointError, match="not the name of a snapshot"):
        checkpoint.latest(root)


def test_latest_of_nothing_yet_is_none_and_a_dangling_latest_raises(tmp_path):
    assert checkpoint.latest(tmp_path / "missing") is None
    (tmp_path / "snapshot-00000001.partial").mkdir()
    assert checkpoint.latest(tmp_path) is None  # an interrupted first save
    (tmp_path / "latest").write_text("snapshot-00000001")
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.latest(tmp_path)
    (tmp_path / "snapshot-00000001").mkdir()
    assert checkpoint.latest(tmp_path) == tmp_path / "snapshot-00000001"


# ---------------------------------------------------------------- the lock without flock
@pytest.fixture
def no_flock(monkeypatch):
    """A filesystem without flock (some network filesystems): the lock falls back to its record."""

    def unsupported(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(checkpoint_root.fcntl, "flock", unsupported)


def _record(root: Path, **fields: object) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "writer.lock").write_text(json.dumps({"host": socket.gethostname(), "token": "other", **fields}))


def test_without_flock_a_live_writer_on_this_host_is_refused(tmp_path, no_flock):
    _record(tmp_path, pid=os.getppid())  # a process that is alive
    with pytest.raises(CheckpointError, match="another job"):
        checkpoint_root.claim(tmp_path)


def test_without_flock_a_writer_on_another_host_is_refused_until_its_lock_is_deleted(tmp_path, no_flock):
    _record(tmp_path, host="elsewhere.invalid", pid=1)
    with pytest.raises(CheckpointError, match="delete"):
        checkpoint_root.claim(tmp_path)
    (tmp_path / "writer.lock").unlink()
    checkpoint_root.claim(tmp_path)


def test_without_flock_a_dead_writers_lock_is_taken_over(tmp_path, no_flock):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _record(tmp_path, pid=gone.pid)
    checkpoint_root.claim(tmp_path)
    record = json.loads((tmp_path / "writer.lock").read_text())
    assert record["pid"] == os.getpid() and record["token"] != "other"
    checkpoint_root.claim(tmp_path)  # ours now: claiming again is fine
