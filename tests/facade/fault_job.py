"""One rank of a job in which rank 1 raises between backward and step (run by test_faults.py).

Usage: ``RANK=r python fault_job.py PORT TIMEOUT_S MODE``. Two gloo processes
with ``init_process_group(timeout=TIMEOUT_S)`` train; in the second step rank
1 raises after its backward pass. MODE ``exit``: the exception ends rank 1's
process, as in a plain script. MODE ``stay``: rank 1 catches it and stays
alive without entering a collective (an exception handler that blocks, a
hung thread), so rank 0 can only learn of it from the timeout; the optimizer
then uses MiCS groups of one rank (``shard_group_size=1``, reduce-scatter
policy), whose replica all-reduce runs on a group zeroplan created.

Rank 0 prints ``FAILED AFTER <seconds> <exception>``: how long ``step()``
blocked before it raised.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from factory import make_optimizer
from models import batch, loss_of, make_model


def main(rank: int, port: int, timeout: float, mode: str) -> int:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=timeout))
    model = make_model()
    mics: dict[str, Any] = {"shard": 1, "collectives": "min_bytes"} if mode == "stay" else {}
    opt = make_optimizer(model, hyper={"lr": 1e-2}, bucket_bytes=1024, alignment=8, **mics)
    for step in range(2):
        loss_of(model, *batch(step, rank)).backward()
        if step == 1 and rank == 1:
            if mode == "exit":
                raise RuntimeError("rank 1 fails between backward and step")
            print("rank 1 raised and stays alive", flush=True)
            time.sleep(4 * timeout)
            return 3
        started = time.monotonic()
        try:
            opt.step()
        except Exception as exc:
            print(f"FAILED AFTER {time.monotonic() - started:.1f} {type(exc).__name__}: {exc}", flush=True)
            raise
        opt.zero_grad()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(os.environ["RANK"]), int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]))
