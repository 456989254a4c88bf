"""Scenarios for ``test_background_save``: ``checkpoint.save(blocking=False)`` ([Note: background saves]).

Every file write is slowed down (``_slow_writes``) so that training really goes on while the thread
writes: what is saved must be the state at the ``save`` call, not what the next steps made of it.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from factory import make_optimizer
from models import DTYPES, batch, loss_of, make_model
from scenarios_checkpoint import _same

from zeroplan.core import CheckpointError, memory_report
from zeroplan.facade import checkpoint
from zeroplan.facade.checkpoint import background, files

_WRITE = files.write_tensors


def _slow_writes(rank: int, fail_on: int | None = None) -> None:
    """Each file write of this rank waits 0.2 s first; on rank ``fail_on`` it fails as a full disk does."""

    def write(path: Path, tensors: dict[str, torch.Tensor]) -> int:
        time.sleep(0.2)
        if rank == fail_on:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return _WRITE(path, tensors)

    checkpoint.write_tensors = write


def _restore_writes() -> None:
    checkpoint.write_tensors = _WRITE


def _setup(cfg: dict[str, Any]) -> tuple[Any, Any]:
    model = make_model(dtype=DTYPES[cfg.get("dtype", "fp32")])
    opt = make_optimizer(model, stage=cfg.get("stage", 2), hyper={"lr": 1e-2})
    if cfg.get("stage") == 3:
        opt.attach(model)
    return model, opt


def _train(model: Any, opt: Any, rank: int, steps: range) -> None:
    for step in steps:
        opt.backward(loss_of(model, *batch(step, rank)))
        opt.step()
        opt.zero_grad()


def _whole(model: Any, opt: Any) -> dict[str, Any]:
    """The whole state (collective): consolidated optimizer state and parameters."""
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    return {"state": opt.consolidated_state_dict(to_rank=None), "params": params}


def _loaded(cfg: dict[str, Any], root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    model, opt = _setup(cfg)
    extra = checkpoint.load(opt, root)
    return extra, _whole(model, opt)


def saved_while_training(
    rank: int, world: int, cases: list[dict[str, Any]], root: str
) -> list[dict[str, Any]]:
    """Training with a background save after every step equals training without, bit for bit; each
    snapshot holds the state of its ``save`` call although the next step ran while it was written."""
    rows = []
    for n, cfg in enumerate(cases):
        where = Path(root) / f"case{n}"
        plain_model, plain_opt = _setup(cfg)
        model, opt = _setup(cfg)
        _slow_writes(rank)
        try:
            at_save, handles = [], []
            for step in range(3):
                _train(plain_model, plain_opt, rank, range(step, step + 1))
                _train(model, opt, rank, range(step, step + 1))
                at_save.append(_whole(model, opt))
                handles.append(checkpoint.save(opt, where, extra={"step": step}, blocking=False, keep=3))
            returned_first = not handles[-1].done()  # save() returned while its slowed writes went on
            _train(model, opt, rank, range(3, 4))  # while the last one is written
            _train(plain_model, plain_opt, rank, range(3, 4))
            last = handles[-1].wait()
        finally:
            _restore_writes()
        staged = background.staging_bytes(opt)
        planned = memory_report(opt.plan).ranks[rank].save_staging_bytes
        extra, loaded = _loaded(cfg, where)
        rows.append(
            {
                "same_training": _same(_whole(model, opt), _whole(plain_model, plain_opt)),
                "snapshot_is_save_time": _same(loaded, at_save[-1]) and extra == {"step": 2},
                "latest": last.name,
                "kept": sorted(p.name for p in where.glob("snapshot-*")),
                "returned_first": returned_first,
                "staged": staged,
                "planned": planned,
            }
        )
    return rows


def failed_in_background(rank: int, world: int, how: str, root: str) -> dict[str, Any]:
    """Rank 1's disk is full during a background save: the error reaches every rank (from ``wait()``, or
    the next ``save``); the previous snapshot stays latest and loads bit for bit."""
    where = Path(root)
    cfg = {"dtype": "bf16"}
    model, opt = _setup(cfg)
    _train(model, opt, rank, range(2))
    checkpoint.save(opt, where, extra={"step": 2})
    before = _whole(model, opt)
    _train(model, opt, rank, range(2, 3))
    _slow_writes(rank, fail_on=None if how == "staging" else 1)
    staging = background.stage
    if how == "staging" and rank == 1:  # host memory runs out while the state is copied, on one rank

        def stage(*args: Any) -> Any:
            raise MemoryError("No space left on device (host staging)")

        background.stage = stage
    error = None
    try:
        handle = checkpoint.save(opt, where, extra={"step": 3}, blocking=False)
        _train(model, opt, rank, range(3, 4))  # training goes on; the failure comes later
        if how == "wait":
            handle.wait()
        else:
            checkpoint.save(opt, where, extra={"step": 4})  # the next save raises the last one's error
    except CheckpointError as exc:
        error = str(exc)
    finally:
        _restore_writes()
        background.stage = staging
    extra, loaded = _loaded(cfg, where)  # collective: rank 0 removed its .partial before it got here
    partials = sorted(p.name for p in where.glob("*.partial"))
    latest = checkpoint.latest(where).name
    dist.barrier()  # every rank looked before the next save starts a .partial of its own
    return {
        "error": error,
        "latest": latest,
        "partials": partials,
        "previous_loads": _same(loaded, before) and extra == {"step": 2},
        "saves_again": checkpoint.save(opt, where, extra={"step": 5}).name,
    }


def two_in_flight(rank: int, world: int, root: str) -> dict[str, Any]:
    """A second background save while the first is written waits for it; both commit, in order."""
    where = Path(root)
    model, opt = _setup({"stage": 3, "dtype": "bf16"})
    _slow_writes(rank)
    try:
        _train(model, opt, rank, range(1))
        first = checkpoint.save(opt, where, extra={"step": 1}, blocking=False, keep=2)
        _train(model, opt, rank, range(1, 2))
        second_state = _whole(model, opt)
        second = checkpoint.save(opt, where, extra={"step": 2}, blocking=False, keep=2)
        first_done = first.done()  # the second save waited for it before starting
        names = (first.wait().name, second.wait().name)
    finally:
        _restore_writes()
    extra, loaded = _loaded({"stage": 3, "dtype": "bf16"}, where)
    return {
        "first_done": first_done,
        "names": names,
        "latest": checkpoint.latest(where).name,
        "latest_is_second": _same(loaded, second_state) and extra == {"step": 2},
    }
