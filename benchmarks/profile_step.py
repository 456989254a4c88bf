"""Where a step's time goes: forward, backward, and the phases of each optimizer's step.

Runs the configurations of ``step_time.py`` interleaved (same model, batch,
gloo workers) and times phases by wrapping methods of the optimizers:

* torch optimizers: ``forward``, ``backward`` (DDP: includes bucket copies and
  the wait for its all-reduce), ``step``, ``zero_grad``;
  ZeroRedundancyOptimizer's step splits into ``local step`` and ``broadcast``;
* ZeroOptimizer: ``hook: stage+launch`` (``GradSync._carry_out``: the staging
  schedule's copies, launches and waits for older buckets, run from backward
  hooks and, for what is left, from ``finish``), ``finish`` (reductions
  still in flight at ``step()``), ``prepare rest`` (``StepLifecycle.reduce``
  minus ``finish``: the step agreement, averaging, overflow check),
  ``inner step``, ``publish`` (all-gather of updated parameters), ``step other``
  and ``zero_grad``; ``gather wait``: the overlapped gathers, completed after
  the step (configurations are interleaved, so no forward of their own could
  hide them; the barrier before the next step would otherwise wait for them
  untimed).

Phases are summed within a step, averaged over ranks, and the median over the
timed steps is printed (ms), then each configuration's total as a ratio to
DDP's, and the ratio a sharded optimizer would reach with DDP's forward,
backward and communication and ``1/world`` of its optimizer step (see ``_bound``).
``--cprofile`` writes rank 0's cProfile stats of the ZeroOptimizer stage-2
steps to the given path.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _gpt import lm_loss, make_batch
from step_time import MAIN, SWEEP, Options, Runner, _free_port, parse


def _clocks() -> tuple[float, float, float]:
    """Wall time, CPU time of the calling (main) thread, CPU time of the whole process."""
    return time.perf_counter(), time.thread_time(), time.process_time()


class Phases:
    """Per step and phase: wall ms, main-thread CPU ms, and CPU ms of the other threads (gloo's)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def add(self, key: str, start: tuple[float, float, float]) -> None:
        end = _clocks()
        wall, main, proc = (b - a for a, b in zip(start, end, strict=True))
        self.current[key] += wall
        self.current[key + " [cpu]"] += main
        self.current[key + " [gloo]"] += proc - main

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current.clear()

    def wrap(self, obj: Any, attr: str, key: str) -> None:
        inner: Callable[..., Any] = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = _clocks()
            try:
                return inner(*args, **kwargs)
            finally:
                self.add(key, start)

        setattr(obj, attr, timed)


def instrument(runner: Runner, phases: Phases) -> None:
    opt = runner.optimizer
    if runner.zero is not None:
        z = runner.zero
        phases.wrap(z.installed.sync, "_carry_out", "hook: stage+launch")
        phases.wrap(z.installed.sync, "finish", "finish")
        phases.wrap(z.lifecycle, "reduce", "reduce")
        phases.wrap(z.inner_optimizer, "step", "inner step")
        phases.wrap(z.lifecycle, "publish", "publish")
    elif runner.variant.kind == "zero-red":
        phases.wrap(opt, "_local_step", "local step")
        phases.wrap(opt, "_sync_params", "broadcast")


def timed_step(runner: Runner, phases: Phases, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    t0 = _clocks()
    loss = lm_loss(runner.module(tokens), targets)
    phases.add("forward", t0)
    t1 = _clocks()
    loss.backward()
    phases.add("backward", t1)
    t2 = _clocks()
    runner.optimizer.step()
    phases.add("step", t2)
    t3 = _clocks()
    runner.optimizer.zero_grad(set_to_none=runner.variant.set_to_none)
    phases.add("zero_grad", t3)
    t4 = _clocks()
    runner.wait()  # gathers still in flight: gloo's barrier before the next step would wait for them
    phases.add("gather wait", t4)
    phases.add("total", t0)
    phases.end_step()


def _derive(step: dict[str, float]) -> dict[str, float]:
    out = dict(step)
    if "finish" in out:
        for suffix in ("", " [cpu]", " [gloo]"):
            rest = out.pop("reduce" + suffix) - out["finish" + suffix]
            out["prepare rest" + suffix] = rest
            other = out["step" + suffix] - out["finish" + suffix] - rest - out["inner step" + suffix]
            out["step other" + suffix] = other - out["publish" + suffix]
    return out


def _worker(rank: int, world: int, port: int, opts: Options, cprofile: str | None, queue: Any) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        tokens, targets = make_batch(opts.model, opts.batch, rank)
        runners = [Runner(v, opts, world) for v in opts.variants]
        phases = [Phases() for _ in runners]
        for _ in range(opts.warmup):
            for r in runners:
                dist.barrier()
                r.step(tokens, targets)
        for r, p in zip(runners, phases, strict=True):
            instrument(r, p)
        profiler = cProfile.Profile() if cprofile and rank == 0 else None
        k = len(runners)
        for i in range(opts.steps):
            for j in range(k):
                c = (i + j) % k
                dist.barrier()
                use = profiler is not None and runners[c].variant.name == "zero2"
                if use:
                    profiler.enable()
                timed_step(runners[c], phases[c], tokens, targets)
                if use:
                    profiler.disable()
        if profiler is not None:
            profiler.dump_stats(cprofile)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, [[_derive(s) for s in p.steps] for p in phases])
        if rank == 0:
            table = {}
            for c, r in enumerate(runners):
                keys = list(gathered[0][c][0])
                row = {}
                for key in keys:
                    per_step = [
                        statistics.fmean(gathered[q][c][i][key] for q in range(world))
                        for i in range(opts.steps)
                    ]
                    row[key] = 1e3 * statistics.median(per_step)
                table[r.variant.name] = row
            queue.put(table)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


ORDER = (
    "forward",
    "backward",
    "hook: stage+launch",
    "step",
    "finish",
    "prepare rest",
    "local step",
    "inner step",
    "broadcast",
    "publish",
    "step other",
    "zero_grad",
    "gather wait",
    "total",
)


def _bound(table: dict[str, dict[str, float]], world: int) -> str:
    """The ratio to DDP of a step with DDP's costs but ``1/world`` of its optimizer step.

    ``1 - (world - 1) / world * step / total``, from DDP's phases: what sharding
    the optimizer step alone gains. A sharded optimizer's ratio goes below it
    only where its communication (staging, exchanging, summing, gathering, and
    the waits for them) costs less than DDP's all-reduce path, which moves the
    same bytes; a speed target below it is a target for communication.
    """
    if "ddp" not in table:
        return "(no ddp column: no bound)"
    ddp = table["ddp"]
    bound = 1 - (world - 1) / world * ddp["step"] / ddp["total"]
    ratios = ", ".join(
        f"{name} {row['total'] / ddp['total']:.3f}" for name, row in table.items() if name != "ddp"
    )
    return (
        f"ratio of total to ddp's: {ratios}; DDP's step minus {world - 1}/{world} of its "
        f"optimizer step: {bound:.3f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cprofile", default=None, metavar="PATH")
    known, rest = p.parse_known_args()
    opts = parse(rest)
    names = {v.name for v in MAIN + SWEEP}
    assert all(v.name in names for v in opts.variants)
    for world in opts.worlds:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        procs = mp.start_processes(
            _worker,
            args=(world, _free_port(), opts, known.cprofile, queue),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        table = queue.get()
        while not procs.join():
            pass
        cols = list(table)
        print(
            f"\nworld {world}: phase medians, mean over ranks: wall ms / main-thread CPU ms / "
            "CPU ms of other threads (gloo)"
        )
        print("| phase | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for key in ORDER:
            if any(key in table[c] for c in cols):
                cells = [
                    f"{table[c][key]:.0f} / {table[c][key + ' [cpu]']:.0f} / {table[c][key + ' [gloo]']:.0f}"
                    if key in table[c]
                    else ""
                    for c in cols
                ]
                print(f"| {key} | " + " | ".join(cells) + " |")
        print(_bound(table, world))
        if known.cprofile:
            pstats.Stats(known.cprofile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
