"""Kill a rank in the middle of a checkpoint save (run as a script by test_checkpoint_failures.py).

Usage: ``python crash_save.py ROOT POINT PORT``. Two gloo processes train, save
snapshot 1, store a reference, then save again while one rank dies at POINT:
``shard_write`` (rank 1 halfway through its shard file), ``background_write`` (the
same, in the thread of a ``blocking=False`` save), ``manifest_written``
(rank 0 after the manifest, before the rename), ``before_latest`` (rank 0 after
the rename, before ``latest`` moves).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from factory import make_optimizer
from models import batch, loss_of, make_model

from zeroplan.facade import checkpoint
from zeroplan.facade.checkpoint import files as files


def _die() -> None:
    os._exit(17)


def run(rank: int, world: int, root: str, point: str, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))
    model = make_model(dtype=torch.bfloat16)
    opt = make_optimizer(model, hyper={"lr": 1e-2}, bucket_bytes=1024, alignment=8)
    for step in range(2):
        loss_of(model, *batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(opt, root, extra={"step": 2})
    reference = opt.consolidated_state_dict(to_rank=0)
    if rank == 0:
        torch.save(
            {"consolidated": reference, "params": [p.detach() for p in model.parameters()]},
            Path(root) / "reference.pt",
        )
    loss_of(model, *batch(2, rank)).backward()
    opt.step()
    if point in ("shard_write", "background_write") and rank == 1:

        def half_then_die(path: Path, tensors: dict) -> str:
            files.write_tensors(path, tensors)
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
            _die()

        checkpoint.write_tensors = half_then_die
    if point == "manifest_written" and rank == 0:

        def write_then_die(path: Path, document: dict) -> None:
            files.write_json(path, document)
            _die()

        checkpoint.write_json = write_then_die
    if point == "before_latest" and rank == 0:
        checkpoint._point_latest = lambda root, name: _die()
    if point == "background_write":
        handle = checkpoint.save(opt, root, extra={"step": 3}, blocking=False)
        loss_of(model, *batch(3, rank)).backward()  # training goes on while rank 1's thread dies
        handle.wait()
    else:
        checkpoint.save(opt, root, extra={"step": 3})
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2, sys.argv[1], sys.argv[2], int(sys.argv[3])), nprocs=2, join=True)
