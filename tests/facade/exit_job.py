"""One rank of a job that adds a param group, steps and exits (run as a script by test_exit.py).

Usage: ``RANK=r python exit_job.py PORT DESTROY``. Two gloo processes train a
step, call ``add_param_group`` with the embeddings and head, train two more
steps and return, calling ``destroy_process_group`` first when DESTROY is 1.
The interpreter then exits normally. A gloo worker thread that still holds a
tensor of the last collective at that point takes the GIL while the
interpreter finalizes and the process dies with SIGABRT ("terminate called
without an active exception"; see [Note: retiring a collective] in
``zeroplan.facade.mechanisms.collectives``).

Unaided that happens in about one run in ten on a loaded machine. The job
makes it likely, without changing what a correct program computes, by
scheduling alone: for the last step the process runs on one CPU with gloo's
threads at the lowest priority (so the woken main thread runs on before a
worker has let go of a finished collective) and the main thread keeps the
GIL until it blocks (a long switch interval); after training it does a
little pure-Python work and leaves more for the interpreter's finalization.
With collectives that are not fully retired 9 runs in 10 aborted.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from factory import make_optimizer
from models import batch, loss_of, make_model

_LEFT_FOR_EXIT: list[list[int]] = []


def _deprioritize_other_threads(rank: int) -> None:
    """Run on one CPU, every thread but this one (gloo's) at the lowest priority (Linux)."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    main = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid != main:
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def main(rank: int, port: int, destroy: bool) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    model = make_model()
    first = [p for n, p in model.named_parameters() if n.startswith("blocks")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks")]
    for p in rest:
        p.requires_grad_(False)
    opt = make_optimizer(first, hyper={"lr": 1e-2}, bucket_bytes=1024, alignment=8)
    for step in range(3):
        if step == 1:
            for p in rest:
                p.requires_grad_(True)
            opt.add_param_group({"params": rest, "lr": 3e-3})
        if step == 2:  # the last step
            _deprioritize_other_threads(rank)
            sys.setswitchinterval(60.0)
        loss_of(model, *batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    if destroy:
        dist.destroy_process_group()
    _LEFT_FOR_EXIT.extend([i] for i in range(500_000))


if __name__ == "__main__":
    main(int(os.environ["RANK"]), int(sys.argv[1]), sys.argv[2] == "1")
