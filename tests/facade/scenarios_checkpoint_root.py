"""Checkpoint root scenarios: stray folders beside the snapshots, two jobs writing one root."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from factory import make_optimizer
from models import make_model
from scenarios_checkpoint import _optimizer, _same, _snapshot, _train

from zeroplan.core import ZeroplanError
from zeroplan.facade import checkpoint


def _await_cleanup() -> None:
    """Wait for the background deletion of old snapshots (so the test sees what it left)."""
    for thread in threading.enumerate():
        if thread.name.startswith("zeroplan-checkpoint-cleanup"):
            thread.join()


def save_beside_stray(rank: int, world: int, root: str, stray: str) -> dict[str, Any]:
    """Save, copy the snapshot to ``root/stray`` as a user might, save again and load that."""
    model = make_model()
    opt = _optimizer(model, {})
    _train(model, opt, rank, range(2))
    first = checkpoint.save(opt, root)
    if rank == 0:
        shutil.copytree(first, Path(root) / stray)
    dist.barrier()
    _train(model, opt, rank, range(2, 3))
    committed = checkpoint.save(opt, root)
    _await_cleanup()
    dist.barrier()
    twin = make_model(seed=7)
    checkpoint.load(_optimizer(twin, {}), root)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    return {"committed": committed.name, "loaded_same": same}


def _two_jobs(rank: int, world: int) -> tuple[int, int, torch.nn.Module, Any]:
    """The ranks split into two jobs of ``world // 2`` ranks, each with its own process group.

    Returns (job, rank in the job, model, optimizer).
    """
    size = world // 2
    groups = [dist.new_group(list(range(job * size, (job + 1) * size))) for job in range(2)]
    job, mine = divmod(rank, size)
    model = make_model(seed=job)
    opt = make_optimizer(model, hyper={"lr": 1e-2}, bucket_bytes=1024, alignment=8, process_group=groups[job])
    _train(model, opt, mine, range(1))
    return job, mine, model, opt


def two_writers(rank: int, world: int, root: str) -> dict[str, Any]:
    """Job 0 saves to ``root`` and starts another save; then job 1 tries to save there too."""
    job, mine, model, opt = _two_jobs(rank, world)
    saved: list[str] = []
    in_progress = Path(root) / "snapshot-00000005.partial"
    if job == 0:
        saved.append(checkpoint.save(opt, root).name)
        if mine == 0:  # as if job 0 were half way through its next save
            in_progress.mkdir()
    dist.barrier()
    result: dict[str, Any] = {"job": job, "error": None}
    if job == 1:
        before = _snapshot(model, opt)
        try:
            saved.append(checkpoint.save(opt, root).name)
        except ZeroplanError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["unchanged"] = _same(before, _snapshot(model, opt))
    _await_cleanup()
    dist.barrier()
    result["partial_kept"] = in_progress.is_dir()
    dist.barrier()
    if job == 0:  # job 0 goes on saving, and deletes its own old snapshots and partials
        _train(model, opt, mine, range(1, 2))
        saved.append(checkpoint.save(opt, root).name)
        _await_cleanup()
    dist.barrier()
    result["saved"] = saved
    return result


def resume_and_save(rank: int, world: int, root: str) -> str:
    """What a restarted job does: load the latest snapshot, train, save; returns the new snapshot's name."""
    model = make_model(dtype=torch.bfloat16)
    opt = make_optimizer(model, hyper={"lr": 1e-2}, bucket_bytes=1024, alignment=8)
    checkpoint.load(opt, root)
    _train(model, opt, rank, range(3, 4))
    name = checkpoint.save(opt, root, extra={"step": 4}).name
    _await_cleanup()
    return name
