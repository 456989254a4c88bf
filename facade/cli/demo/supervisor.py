"""``zeroplan demo``: start the processes, watch them, return the verdict.

This module imports no torch, so ``zeroplan demo`` spends no time on it before
the workers start (see [Note: fast start] for how the workers avoid it). The
training itself is :mod:`zeroplan.facade.cli.demo.train`; the tables,
:mod:`zeroplan.facade.cli.demo.report`.

Each worker reports through a pipe of its own: rank 0 sends the exit code its
report decided; a worker that raises sends its traceback. When a worker exits with an
error the others, blocked in a collective, are terminated at once rather than
after the collective's timeout.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import traceback
from typing import Any

from zeroplan.core.errors import check_config
from zeroplan.facade.cli.demo.settings import DemoSettings

__all__ = ["check_devices", "run"]

_VERDICT, _FAILED, _CLOSED = "verdict", "failed", "stdout closed"


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
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="zeroplan-demo-") as scratch:
        rendezvous = os.path.join(scratch, "rendezvous")
        pipes = [ctx.Pipe(duplex=False) for _ in range(settings.world)]
        workers = [
            ctx.Process(
                target=_worker, args=(rank, settings, rendezvous, pipes[rank][1]), name=f"rank {rank}"
            )
            for rank in range(settings.world)
        ]
        for worker in workers:
            worker.start()
        for _, writer in pipes:
            writer.close()  # the workers hold the writing ends
        try:
            messages = _supervise(workers, [reader for reader, _ in pipes])
        except KeyboardInterrupt:
            print("zeroplan demo: interrupted", file=sys.stderr, flush=True)
            return 130
        finally:
            stopped = [worker for worker in workers if worker.is_alive()]
            for worker in stopped:
                worker.terminate()
            for worker in workers:
                worker.join()
            if stopped and sys.stdout.isatty():
                sys.stdout.write("\x1b[?25h\n")  # rank 0's progress bar hid the cursor
                sys.stdout.flush()
    if any(kind == _CLOSED for kind, _ in messages.values()):
        return 0  # the output was piped into a reader that went away (`| head`), as `zeroplan plan` does
    failures = {rank: text for rank, (kind, text) in messages.items() if kind == _FAILED}
    for rank, text in sorted(failures.items()):
        print(f"zeroplan demo: rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
    verdict = messages.get(0, (None, None))
    if failures or verdict[0] != _VERDICT:
        if not failures:
            codes = ", ".join(f"{w.name}: {w.exitcode}" for w in workers)
            print(f"zeroplan demo: no result from rank 0 (exit codes {codes})", file=sys.stderr, flush=True)
        return 1
    return int(verdict[1])


def _context() -> Any:
    """Forkserver where the platform has it, preloaded with torch; otherwise spawn.

    [Note: fast start]
    Each worker would otherwise import torch and ``torch._dynamo`` (which the first
    ``torch.optim`` optimizer imports) itself, seconds of CPU per process, paid by
    every worker at once on a small machine. A forkserver imports them once, before any
    thread pool, process group or CUDA context exists, and forks clean workers from
    that state (as ``torch.multiprocessing`` does with ``TORCH_MP_PARALLEL_START``).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["zeroplan.facade.cli.demo.train", "torch._dynamo"])
    return ctx


def _supervise(workers: list[Any], readers: list[Any]) -> dict[int, tuple[str, Any]]:
    """Collect each worker's message until all have exited or one has failed; by rank.

    Messages are read as they arrive, so no worker ever blocks on a full pipe.
    """
    messages: dict[int, tuple[str, Any]] = {}
    alive = {worker.sentinel: rank for rank, worker in enumerate(workers)}
    unread = {reader: rank for rank, reader in enumerate(readers)}

    def read(reader: Any) -> None:
        rank = unread.pop(reader)
        with contextlib.suppress(EOFError, OSError):  # exited without a message
            messages[rank] = reader.recv()

    failed = False
    while alive and not failed:
        for ready in multiprocessing.connection.wait([*alive, *unread]):
            if ready in unread:
                read(ready)
            elif ready in alive:
                worker = workers[alive.pop(ready)]
                worker.join()
                failed = failed or worker.exitcode != 0
    for reader in list(unread):  # sent before exiting, not read yet
        if reader.poll():
            read(reader)
    return messages


def _worker(rank: int, settings: DemoSettings, rendezvous: str, report: Any) -> None:
    """Entry point of a worker process: one thread, then ``train.worker``."""
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, where it is not preloaded
    try:
        from zeroplan.facade.cli.demo import train

        code = train.worker(rank, settings, rendezvous)
        if code is not None:
            report.send((_VERDICT, code))
    except KeyboardInterrupt:
        sys.exit(130)
    except (BrokenPipeError, SystemExit):  # rich raises SystemExit(1) when stdout is a closed pipe
        report.send((_CLOSED, None))
        sys.exit(1)  # non-zero: the parent stops the other ranks, which wait in a collective
    except BaseException:
        report.send((_FAILED, traceback.format_exc()))
        sys.exit(1)
