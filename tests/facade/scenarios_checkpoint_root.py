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


def _job_of_one_rank(rank: int, world: int) -> tuple[torch.nn.Module, Any]:
    """Every rank its own single-rank job (its own process group): several jobs, one test."""
    mine = [dist.new_group([r]) for r in range(world)][rank]
    model = make_model(seed=rank)
    opt = make_optimizer(model, hyper={"lr": 1e-2}, bucket_bytes=1024, alignment=8, process_group=mine)
    return model, opt


def two_writers(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 0's job saves to ``root``; then rank 1's job (another process) tries to save there too."""
    model, opt = _job_of_one_rank(rank, world)
    _train(model, opt, 0, range(1))
    saved: list[str] = []
    if rank == 0:
        saved.append(checkpoint.save(opt, root).name)
    dist.barrier()
    error = None
    if rank == 1:
        before = _snapshot(model, opt)
        try:
            saved.append(checkpoint.save(opt, root).name)
        except ZeroplanError as exc:
            error = f"{type(exc).__name__}: {exc}"
        unchanged = _same(before, _snapshot(model, opt))
    dist.barrier()
    if rank == 0:  # the first job goes on saving (and deleting its own old snapshots)
        _train(model, opt, 0, range(1, 2))
        saved.append(checkpoint.save(opt, root).name)
        _await_cleanup()
    dist.barrier()
    result: dict[str, Any] = {"saved": saved, "error": error}
    if rank == 1:
        result["unchanged"] = unchanged
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
