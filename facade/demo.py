"""``zeroplan demo``: start the processes, watch them, return the verdict.

This module imports no torch, so ``zeroplan demo`` spends no time on it before
the workers start, and every worker imports it once, already limited to one
thread. The training itself is :mod:`zeroplan.facade.demo_train`; the tables,
:mod:`zeroplan.facade.demo_report`.

Each worker reports through one queue: rank 0 sends the exit code its report
decided; a worker that raises sends its traceback. When a worker exits with an
error the others, blocked in a collective, are terminated at once rather than
after the collective's timeout.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import traceback
from typing import Any

from zeroplan.core.errors import check_config
from zeroplan.facade.demo_settings import DemoSettings

__all__ = ["check_devices", "run"]

_VERDICT, _FAILED = "verdict", "failed"


def check_devices(settings: DemoSettings) -> None:
    """Raise ``ConfigError`` unless this machine has what ``settings.device`` needs."""
    if settings.device != "cuda":
        return
    import torch
    import torch.distributed as dist

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_config(
        found >= settings.world,
        f"--device cuda needs one GPU per rank: --world {settings.world}, but {found} CUDA device(s) "
        "are visible; lower --world or use --device cpu",
    )
    check_config(dist.is_nccl_available(), "--device cuda needs NCCL, which this torch build lacks")


def run(settings: DemoSettings) -> int:
    """Run the demo in ``settings.world`` processes; returns the exit code.

    0: the sharded and the unsharded runs agree and every measured byte equals
    the plan's; 1: they do not, or a worker failed (its traceback is printed).

    Raises:
        ConfigError: the machine lacks the requested devices.
    """
    check_devices(settings)
    ctx = multiprocessing.get_context("spawn")
    reports = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="zeroplan-demo-") as scratch:
        rendezvous = os.path.join(scratch, "rendezvous")
        workers = [
            ctx.Process(
                target=_worker, args=(rank, settings, rendezvous, reports), name=f"zeroplan-demo-{rank}"
            )
            for rank in range(settings.world)
        ]
        for worker in workers:
            worker.start()
        try:
            _supervise(workers)
        finally:
            for worker in workers:
                if worker.is_alive():
                    worker.terminate()
            for worker in workers:
                worker.join()
    verdict, failures = None, []
    while not reports.empty():
        kind, rank, payload = reports.get()
        if kind == _VERDICT:
            verdict = int(payload)
        else:
            failures.append((rank, payload))
    for rank, text in sorted(failures):
        print(f"zeroplan demo: rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
    if failures or verdict is None:
        if not failures:
            codes = ", ".join(f"rank {w.name.rsplit('-', 1)[1]}: {w.exitcode}" for w in workers)
            print(f"zeroplan demo: a worker exited without a result ({codes})", file=sys.stderr, flush=True)
        return 1
    return verdict


def _supervise(workers: list[Any]) -> None:
    """Wait until every worker has exited, or until one has failed."""
    alive = {worker.sentinel: worker for worker in workers}
    while alive:
        for sentinel in multiprocessing.connection.wait(list(alive)):
            worker = alive.pop(sentinel)
            worker.join()
            if worker.exitcode != 0:
                return


def _worker(rank: int, settings: DemoSettings, rendezvous: str, reports: Any) -> None:
    """Entry point of a worker process: one thread, then ``demo_train.worker``."""
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported in this process
    try:
        from zeroplan.facade import demo_train

        code = demo_train.worker(rank, settings, rendezvous)
        if code is not None:
            reports.put((_VERDICT, rank, code))
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseException:
        reports.put((_FAILED, rank, traceback.format_exc()))
        sys.exit(1)
