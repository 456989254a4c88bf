"""Worker processes for multi-process tests: gloo, one thread each, scenarios run by name.

A pool of ``world`` processes is started once per world size and reused by
many tests; each job names a scenario function ``module.fn(rank, world, *args)``
in this directory, whose per-rank results come back to the test.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _worker(rank: int, world: int, port: int, inbox: Any, outbox: Any) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    while True:
        job = inbox.get()
        if job is None:
            break
        module, fn, args = job
        try:
            result = getattr(importlib.import_module(module), fn)(rank, world, *args)
            outbox.put((rank, True, result))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DistPool:
    """``world`` gloo processes that run scenarios on request."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world)]
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world, port, self._inboxes[r], self._outbox), daemon=True)
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, module: str, fn: str, *args: Any, timeout: float = 240.0) -> list[Any]:
        """Run ``module.fn(rank, world, *args)`` on every rank; per-rank results in rank order."""
        for box in self._inboxes:
            box.put((module, fn, args))
        results: list[Any] = [None] * self.world
        failures = []
        for _ in range(self.world):
            try:
                rank, ok, value = self._outbox.get(timeout=timeout)
            except Exception:
                self.broken = True
                raise TimeoutError(f"{module}.{fn} did not finish on every rank within {timeout} s") from None
            if ok:
                results[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            self.broken = True
            raise AssertionError(f"{module}.{fn} failed:\n" + "\n".join(failures))
        return results

    def close(self) -> None:
        """Stop the workers (forcefully if they do not exit)."""
        if not self.broken:
            for box in self._inboxes:
                box.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
