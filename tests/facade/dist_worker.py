"""Worker processes for multi-process tests: gloo, one thread each, scenarios passed as functions.

A pool of ``world`` processes is started once per world size and reused by
many tests; each job is a scenario function ``fn(rank, world, *args)`` whose
per-rank results come back to the test. The workers are spawned, so a job
travels by reference (module and qualified name) and is imported again in
each worker: it must be a module-level function of a module the workers can
import (this directory is on their path).

A pool whose workers made more than ``MAX_GROUPS`` process groups (``new_group``,
device meshes, ZeroOptimizers over part of the world) is worn and replaced
before its next job: a gloo group keeps threads that poll while it lives, and
torch's registry keeps every group alive until the job ends (measured: 150
idle groups of 4 ranks kept 0.8 of a core busy, mostly in the kernel). A full
tier's jobs made hundreds per worker, slowing every test after them. Destroying
the groups after each job instead breaks device meshes, which torch resolves by
group name across jobs.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import sys
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from importlib.machinery import PathFinder
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

#: Process groups a worker may have made before its pool is replaced (about 3 threads each).
MAX_GROUPS = 48

_NOT_BY_REFERENCE = (
    "{name} cannot run in the worker processes: {why}. Workers are spawned and receive a scenario by "
    "reference (module and qualified name), so define it as a module-level function of a module in "
    "tests/facade (such as scenarios_train.py) and pass that function to DistPool.run."
)


def scenario_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a scenario the workers can import, or a TypeError that says why not.

    Checked before anything is sent: a function that does not pickle by reference would fail in the
    queue's feeder thread and leave every rank waiting until the timeout.
    """
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"DistPool.run takes a module-level scenario function, got {fn!r}")
    module, qualname = fn.__module__, fn.__qualname__
    name = f"{module}.{qualname}"
    if "<lambda>" in qualname:
        raise TypeError(_NOT_BY_REFERENCE.format(name=name, why="it is a lambda"))
    if "<locals>" in qualname:
        raise TypeError(_NOT_BY_REFERENCE.format(name=name, why="it is defined inside another function"))
    if module == "__main__" or PathFinder.find_spec(module.partition(".")[0], [HERE, *sys.path]) is None:
        raise TypeError(_NOT_BY_REFERENCE.format(name=name, why=f"module {module!r} is not importable"))
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not fn:
        raise TypeError(_NOT_BY_REFERENCE.format(name=name, why=f"{name} names another object"))
    return name


def _worker(rank: int, world: int, port: int, inbox: Any, outbox: Any) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)  # before the first job is unpickled: it imports the scenario's module
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, True, fn(rank, world, *args), dist.get_pg_count()))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc(), dist.get_pg_count()))
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
        #: Its workers made more than ``MAX_GROUPS`` process groups: replace it (see the module).
        self.worn = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 240.0) -> list[Any]:
        """Run ``fn(rank, world, *args)`` on every rank; per-rank results in rank order.

        Raises:
            TypeError: ``fn`` is not a module-level function the workers can import (nothing is sent).
            AssertionError: ``fn`` raised on some rank; the message holds each failing rank's traceback.
            TimeoutError: some rank sent no result within ``timeout`` seconds.
        """
        name = scenario_name(fn)
        for box in self._inboxes:
            box.put((fn, args))
        results: list[Any] = [None] * self.world
        failures = []
        for _ in range(self.world):
            try:
                rank, ok, value, groups = self._outbox.get(timeout=timeout)
            except Exception:
                self.broken = True
                raise TimeoutError(f"{name} did not finish on every rank within {timeout} s") from None
            self.worn |= groups > MAX_GROUPS
            if ok:
                results[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            self.broken = True
            raise AssertionError(f"{name} failed:\n" + "\n".join(failures))
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
