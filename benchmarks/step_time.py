"""Step time, optimizer-state bytes and traffic: DDP vs ZeroRedundancyOptimizer vs ZeroOptimizer.

One invocation runs, for each world size, ``world`` gloo processes on CPU (one
thread each) that hold one copy of a ~7M-parameter GPT per configuration:

* ``ddp``       DistributedDataParallel + ``torch.optim.AdamW(foreach=True)``
* ``zero-red``  DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)``
* ``zero1``     ``ZeroOptimizer(AdamW, stage=1)`` (no DDP: it reduces gradients itself)
* ``zero2``     ``ZeroOptimizer(AdamW, stage=2)``

A timed step is forward + backward + step + zero_grad on a fixed synthetic
batch (different per rank). Configurations alternate step by step, in an order
rotated every round, so machine noise hits them all alike; a step's time is the
slowest rank's, and the table reports the median over the timed steps. Here a
step also waits for ZeroOptimizer's overlapped parameter gathers
(``wait_for_params()``, timed): another configuration runs before its next
forward, so the gathers could not overlap with anything of its own.

``--sweep`` adds ZeroOptimizer variants (bucket size, in-flight buckets,
overlap, ``zero_grad(set_to_none=False)``) to the same interleaved rounds.

``--fresh-rounds N`` measures differently (issue 12's speed report): N rounds,
each running every configuration once, in an order rotated every round, each
in fresh processes (one spawn per configuration per round) that hold only that
configuration. A configuration warms up, then runs its timed steps back to
back: a step is timed from its start to the next step's start (the last one up
to ``wait_for_params()``), so gathers still in flight after ``step()`` are paid
by the next forward, which waits for them, and every configuration is timed by
the same clock. A round's time for a configuration is the median over its steps
of the slowest rank's; its ratios are to ``ddp`` and ``zero-red`` of the same
round; the table reports the median over rounds of those ratios, and min / max.
Its configurations (``FRESH``):

* ``ddp``, ``zero-red`` as above, ``zero1`` (stage 1, defaults)
* ``zero2``            stage 2, defaults: collectives ``"auto"`` (the gloo
  policy on gloo), layout ``"auto"`` (interleaved), ``overlap_param_gather=True``
* ``zero2-nogather``   the same with ``overlap_param_gather=False``
* ``zero2-minbytes``   ``collectives="min_bytes"`` (reduce_scatter / all_gather)
* ``zero2-rankmajor``  ``layout="rank_major"``, ``overlap_param_gather=False``
  (the previous release's behaviour)

``--keep-heap`` sets ``GLIBC_TUNABLES`` in every worker, of every
configuration alike, so that glibc keeps freed memory instead of returning it
to the operating system (trim threshold 1 GiB, mmap threshold 32 MiB, fixed).
By default glibc trims the top of its heap once more than its (dynamic)
threshold is free there, and the next step faults those pages in again, each
zeroed by the kernel. Configurations that free memory early pay for that:
stage 2 frees each ``.grad`` as soon as it is staged, and in fresh processes
at world 2 it took about 2,000 to 6,000 page faults per step in backward
against DDP's 0 to 600 (``getrusage``); its steps took 168 to 197 ms there, 151
to 153 ms with this option (DDP: 172 to 176, and 163 to 172 ms). CPU training
jobs commonly run with such settings or with jemalloc / tcmalloc.

Usage::

    python benchmarks/step_time.py                      # worlds 2 and 4, full model
    python benchmarks/step_time.py --quick              # smoke run, tiny model
    python benchmarks/step_time.py --sweep --json out.json
    python benchmarks/step_time.py --fresh-rounds 3 --json fresh.json   # about 8 min on 2 cores
    python benchmarks/step_time.py --fresh-rounds 3 --keep-heap         # glibc keeps freed memory
    python benchmarks/step_time.py --fresh-rounds 3 --before /tmp/old   # also zeroplan from /tmp/old/zeroplan
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _gpt import GPT, GPT_7M, GPT_TINY, GPTConfig, lm_loss, make_batch

MB = 2**20
LR = 1e-3
WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class Variant:
    """One configuration of the benchmark."""

    name: str
    kind: str  # "ddp", "zero-red" or "zero"
    stage: int = 0
    bucket_mb: float | None = None  # None: the --bucket-mb option
    max_inflight: int = 2
    overlap: bool = True
    set_to_none: bool = True
    fused: bool = False  # AdamW(fused=True) instead of foreach=True
    overlap_gather: bool = True  # ZeroOptimizer(overlap_param_gather=...)
    layout: str = "auto"  # ZeroOptimizer(layout=...)
    collectives: str = "auto"  # ZeroOptimizer(collectives=...)
    deterministic: bool = False  # ZeroOptimizer(deterministic=...)
    paired: str | None = None  # --deterministic: the default-mode configuration it is compared with
    before: bool = False  # --before: zeroplan from the other source tree
    note: str = ""


#: ``--keep-heap``: glibc returns no freed memory to the system below 1 GiB; blocks over 32 MiB are mapped.
KEEP_HEAP = "glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432"

MAIN = (
    Variant("ddp", "ddp", note="DDP + AdamW(foreach)"),
    Variant("zero-red", "zero-red", note="ZeroRedundancyOptimizer + DDP"),
    Variant("zero1", "zero", stage=1, note="ZeroOptimizer stage 1"),
    Variant("zero2", "zero", stage=2, note="ZeroOptimizer stage 2"),
)

SWEEP = (
    Variant("zero2 bucket=4MB", "zero", stage=2, bucket_mb=4),
    Variant("zero2 bucket=100MB", "zero", stage=2, bucket_mb=100),
    Variant("zero2 inflight=1", "zero", stage=2, max_inflight=1),
    Variant("zero2 inflight=4", "zero", stage=2, max_inflight=4),
    Variant("zero2 overlap=off", "zero", stage=2, overlap=False),
    Variant("zero1 overlap=off", "zero", stage=1, overlap=False),
    Variant("zero1 set_to_none=F", "zero", stage=1, set_to_none=False),
    Variant("ddp fused", "ddp", fused=True),
    Variant("zero2 fused", "zero", stage=2, fused=True),
)

FRESH = (
    Variant("ddp", "ddp", note="DDP + AdamW(foreach)"),
    Variant("zero-red", "zero-red", note="DDP + ZeroRedundancyOptimizer(AdamW)"),
    Variant("zero2", "zero", stage=2, note="stage 2, defaults (gloo policy, interleaved, overlapped gather)"),
    Variant("zero2-nogather", "zero", stage=2, overlap_gather=False, note="stage 2, gather waited in step()"),
    Variant(
        "zero2-minbytes",
        "zero",
        stage=2,
        collectives="min_bytes",
        note="stage 2, reduce_scatter / all_gather",
    ),
    Variant(
        "zero2-rankmajor",
        "zero",
        stage=2,
        layout="rank_major",
        overlap_gather=False,
        note="stage 2, rank-major, gather waited (previous release)",
    ),
    Variant("zero1", "zero", stage=1, note="stage 1, defaults"),
    Variant("zero3", "zero", stage=3, note="stage 3, defaults (attached: gathers around each module)"),
)

#: ``--deterministic`` (issue 27's cost): each mode next to its default, in the same fresh rounds.
DETERMINISTIC = (
    Variant("ddp", "ddp", note="DDP + AdamW(foreach)"),
    Variant("zero2", "zero", stage=2, note="stage 2, defaults"),
    Variant(
        "zero2-det", "zero", stage=2, deterministic=True, paired="zero2", note="stage 2, deterministic=True"
    ),
    Variant("zero1", "zero", stage=1, note="stage 1, defaults"),
    Variant(
        "zero1-det", "zero", stage=1, deterministic=True, paired="zero1", note="stage 1, deterministic=True"
    ),
)


@dataclass
class Options:
    worlds: tuple[int, ...]
    steps: int
    warmup: int
    bucket_mb: float
    batch: int
    model: GPTConfig
    variants: tuple[Variant, ...]
    seed: int = 0
    timeout_s: float = 600.0
    fresh_rounds: int = 0  # > 0: the --fresh-rounds mode
    extra: dict[str, Any] = field(default_factory=dict)


def _state_bytes(state: Any) -> int:
    return sum(
        v.numel() * v.element_size() for entry in state.values() for v in entry.values() if torch.is_tensor(v)
    )


class Runner:
    """One configuration's model, optimizer and step on this rank."""

    def __init__(self, variant: Variant, opts: Options, world: int) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        from zeroplan.facade import ZeroOptimizer

        self.variant = variant
        self.world = world
        torch.manual_seed(opts.seed)
        self.model = GPT(opts.model)
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        bucket_mb = variant.bucket_mb if variant.bucket_mb is not None else opts.bucket_mb
        hyper: dict[str, Any] = {"lr": LR, "weight_decay": WEIGHT_DECAY}
        hyper.update({"fused": True} if variant.fused else {"foreach": True})
        self.zero: Any = None
        if variant.kind == "zero":
            self.module: torch.nn.Module = self.model
            self.zero = ZeroOptimizer(
                self.model.parameters(),
                torch.optim.AdamW,
                stage=variant.stage,
                bucket_bytes=int(bucket_mb * MB),
                max_inflight_buckets=variant.max_inflight,
                overlap_grad_reduce=variant.overlap,
                overlap_param_gather=variant.overlap_gather,
                layout=variant.layout,
                collectives=variant.collectives,
                deterministic=variant.deterministic,
                **hyper,
            )
            if variant.stage == 3:
                self.zero.attach(self.model)  # gathers around each module's use
            self.optimizer: torch.optim.Optimizer = self.zero
        else:
            self.module = DistributedDataParallel(self.model, bucket_cap_mb=bucket_mb)
            if variant.kind == "ddp":
                self.optimizer = torch.optim.AdamW(self.model.parameters(), **hyper)
            else:
                self.optimizer = ZeroRedundancyOptimizer(
                    self.model.parameters(), optimizer_class=torch.optim.AdamW, **hyper
                )

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, *, wait: bool = False) -> None:
        """One training step; ``wait``: also complete the parameter gathers still in flight."""
        loss = lm_loss(self.module(tokens), targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.variant.set_to_none)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Complete ZeroOptimizer's overlapped parameter gathers (nothing for the others)."""
        if self.zero is not None:
            self.zero.wait_for_params()

    def state_bytes(self) -> int:
        """Optimizer-state bytes held by this rank."""
        if self.zero is not None:
            return self.zero.measured_memory().optimizer_state_bytes
        if self.variant.kind == "zero-red":
            return _state_bytes(self.optimizer.optim.state)  # the local optimizer's shard
        return _state_bytes(self.optimizer.state)

    def comm_bytes(self) -> tuple[int, bool]:
        """Bytes this rank sent in the last step, and whether they were measured (else computed)."""
        n = self.world
        if self.zero is not None:
            return sum(c.bytes for c in self.zero.last_step_comm()), True
        all_reduce = 2 * (n - 1) * self.param_bytes // n  # ring all-reduce of fp32 gradients
        if self.variant.kind == "ddp":
            return all_reduce, False
        return all_reduce + (n - 1) * self.param_bytes // n, False  # + broadcast of updated params

    @torch.no_grad()
    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Loss of the current parameters on this rank's batch, averaged over ranks."""
        value = lm_loss(self.model(tokens), targets).detach().reshape(1)
        dist.all_reduce(value)
        return value.item() / self.world


def _join(rank: int, world: int, port: int, opts: Options) -> None:
    """Set up one benchmark process: one thread, quiet, in a gloo group of ``world``."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=opts.timeout_s))


def leave() -> None:
    """Leave the group and end this benchmark process at once, skipping the interpreter's teardown.

    A collective of torch's own (``all_gather_object`` here) is released by gloo's worker thread a
    little after it returned; if the interpreter is finalizing by then, that thread aborts the process
    ("terminate called without an active exception", see [Note: retiring a collective] in
    ``zeroplan.facade.mechanisms.collectives``) after the result was sent. Measured: 10 of 60 quick runs.
    """
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank: int, world: int, port: int, opts: Options, queue: Any) -> None:
    _join(rank, world, port, opts)
    try:
        tokens, targets = make_batch(opts.model, opts.batch, rank)
        runners = [Runner(v, opts, world) for v in opts.variants]
        k = len(runners)
        for _ in range(opts.warmup):
            for r in runners:
                dist.barrier()
                r.step(tokens, targets, wait=True)
        times: list[list[float]] = [[] for _ in runners]
        cpu: list[list[float]] = [[] for _ in runners]
        for i in range(opts.steps):
            for j in range(k):
                c = (i + j) % k  # rotate the order every round
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                runners[c].step(tokens, targets, wait=True)  # the next forward is another's
                times[c].append(time.perf_counter() - start)
                cpu[c].append(time.process_time() - start_cpu)
        rows = []
        for r, t, u in zip(runners, times, cpu, strict=True):
            comm, measured = r.comm_bytes()
            rows.append({"times": t, "cpu": u, "state": r.state_bytes(), "comm": comm, "measured": measured})
        losses = [r.loss(tokens, targets) for r in runners]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            queue.put(_summarise(world, opts, runners, gathered, losses))
    finally:
        leave()


def _summarise(
    world: int, opts: Options, runners: list[Runner], gathered: list[Any], losses: list[float]
) -> dict[str, Any]:
    """Per configuration: median of the per-step maximum over ranks, bytes per rank, loss."""
    ddp_state = None
    result = []
    for c, (runner, loss) in enumerate(zip(runners, losses, strict=True)):
        per_rank = [gathered[q][c] for q in range(world)]
        step_max = [max(ts) for ts in zip(*(row["times"] for row in per_rank), strict=True)]
        step_cpu = [statistics.fmean(ts) for ts in zip(*(row["cpu"] for row in per_rank), strict=True)]
        states = [row["state"] for row in per_rank]
        if runner.variant.kind == "ddp":
            ddp_state = states[0]
        result.append(
            {
                "name": runner.variant.name,
                "kind": runner.variant.kind,
                "stage": runner.variant.stage,
                "bucket_mb": runner.variant.bucket_mb or opts.bucket_mb,
                "max_inflight_buckets": runner.variant.max_inflight,
                "overlap_grad_reduce": runner.variant.overlap,
                "set_to_none": runner.variant.set_to_none,
                "median_ms": 1e3 * statistics.median(step_max),
                "min_ms": 1e3 * min(step_max),
                "step_ms": [1e3 * t for t in step_max],
                "cpu_ms_per_rank": 1e3 * statistics.median(step_cpu),
                "state_bytes_max": max(states),
                "state_bytes_min": min(states),
                "comm_bytes_per_rank": max(row["comm"] for row in per_rank),
                "comm_measured": per_rank[0]["measured"],
                "loss": loss,
            }
        )
    ddp = next((r for r in result if r["name"] == "ddp"), None)
    for row in result:
        row["ratio_to_ddp"] = row["median_ms"] / ddp["median_ms"] if ddp else None
        # Median over rounds of the ratio within a round: robust to load that drifts between rounds.
        row["paired_ratio_to_ddp"] = (
            statistics.median(a / b for a, b in zip(row["step_ms"], ddp["step_ms"], strict=True))
            if ddp
            else None
        )
        sharded = row["kind"] != "ddp" and ddp_state is not None
        row["ideal_state_bytes"] = ddp_state / world if sharded else None
        row["state_deviation_pct"] = (
            100.0 * (row["state_bytes_max"] / row["ideal_state_bytes"] - 1.0) if sharded else None
        )
    return {
        "world": world,
        "params": runners[0].numel,
        "param_bytes": runners[0].param_bytes,
        "configs": result,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, opts: Options) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(
        _worker, args=(world, _free_port(), opts, queue), nprocs=world, join=False, start_method="spawn"
    )
    result = queue.get()  # before joining: rank 0 blocks until its result is read
    while not procs.join():
        pass
    return result


def timed_steps(
    runner: Runner, tokens: torch.Tensor, targets: torch.Tensor, opts: Options
) -> tuple[list[float], float]:
    """Warm up, then time ``opts.steps`` steps back to back (``--fresh-rounds``).

    Returns:
        each step's seconds on this rank, and the process CPU seconds per step.
    """
    for _ in range(opts.warmup):
        runner.step(tokens, targets)
    runner.wait()
    dist.barrier()
    # No barrier inside the timed region: gloo's barrier waits for its group's pending work, which
    # would take the gathers in flight out of the next forward.
    marks = [time.perf_counter()]
    start_cpu = time.process_time()
    for _ in range(opts.steps):
        runner.step(tokens, targets)  # the next step's forward waits for this one's gathers
        marks.append(time.perf_counter())
    runner.wait()
    marks[-1] = time.perf_counter()  # the last step ends when its parameters arrived
    cpu = (time.process_time() - start_cpu) / opts.steps
    return [b - a for a, b in itertools.pairwise(marks)], cpu


def _fresh_worker(rank: int, world: int, port: int, opts: Options, variant: Variant, queue: Any) -> None:
    """One configuration in fresh processes: warm up, then time ``opts.steps`` steps back to back."""
    if variant.before:  # zeroplan from the --before tree (the model's code is the same)
        sys.path.insert(0, opts.extra["before"])
        for name in [m for m in sys.modules if m == "zeroplan" or m.startswith("zeroplan.")]:
            del sys.modules[name]
    _join(rank, world, port, opts)
    try:
        tokens, targets = make_batch(opts.model, opts.batch, rank)
        runner = Runner(variant, opts, world)
        times, cpu = timed_steps(runner, tokens, targets, opts)
        loss = runner.loss(tokens, targets)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {"times": times, "cpu": cpu})
        if rank == 0:
            step_max = [max(ts) for ts in zip(*(g["times"] for g in gathered), strict=True)]
            queue.put(
                {
                    "params": runner.numel,
                    "step_ms": [1e3 * t for t in step_max],
                    "median_ms": 1e3 * statistics.median(step_max),
                    "cpu_ms_per_rank": 1e3 * statistics.fmean(g["cpu"] for g in gathered),
                    "loss": loss,
                    "zeroplan": getattr(sys.modules.get("zeroplan.facade"), "__file__", ""),
                    "planned_peak_mb": (
                        runner.zero.memory_report(clipping=False).ranks[0].peak_bytes / MB
                        if runner.zero is not None
                        else None
                    ),
                }
            )
    finally:
        leave()


def join_gloo(rank: int, world: int, port: int, timeout_s: float = 300.0) -> None:
    """A fresh benchmark process joins its gloo group on ``port``: one thread, warnings off."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def run_fresh(
    world: int, variant: Variant, opts: Options, worker: Callable[..., None] = _fresh_worker
) -> dict[str, Any]:
    """One configuration, once, in ``world`` newly spawned processes running ``worker``.

    ``worker(rank, world, port, opts, variant, queue)``: rank 0 puts one result on ``queue``.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    start = time.perf_counter()
    procs = mp.start_processes(
        worker,
        args=(world, _free_port(), opts, variant, queue),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    while queue.empty():  # a worker that died before reporting must not hang the benchmark
        if procs.join(timeout=0.2) and queue.empty():
            raise RuntimeError(f"{getattr(variant, 'name', variant)} at world {world}: no result")
    result = queue.get()
    while not procs.join():
        pass
    result["wall_s"] = time.perf_counter() - start
    return result


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def run_fresh_rounds(world: int, opts: Options) -> dict[str, Any]:
    """``opts.fresh_rounds`` rounds of every configuration, in an order rotated every round."""
    variants = opts.variants
    k = len(variants)
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(opts.fresh_rounds):
        t = time.perf_counter()
        measured = {}
        for j in range(k):
            v = variants[(r + j) % k]
            measured[v.name] = run_fresh(world, v, opts)
        rounds.append(measured)
        line = ", ".join(f"{name} {m['median_ms']:.0f}" for name, m in measured.items())
        print(f"world {world} round {r + 1}: {line} ms ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    configs = []
    for v in variants:
        per_round = [m[v.name] for m in rounds]
        row: dict[str, Any] = {
            "name": v.name,
            "note": v.note,
            "kind": v.kind,
            "stage": v.stage,
            "overlap_param_gather": v.overlap_gather,
            "layout": v.layout,
            "collectives": v.collectives,
            "median_ms": statistics.median(m["median_ms"] for m in per_round),
            "round_ms": [m["median_ms"] for m in per_round],
            "step_ms": [m["step_ms"] for m in per_round],
            "cpu_ms_per_rank": statistics.median(m["cpu_ms_per_rank"] for m in per_round),
            "loss": statistics.median(m["loss"] for m in per_round),
            "wall_s": statistics.fmean(m["wall_s"] for m in per_round),
            "zeroplan": per_round[0].get("zeroplan", ""),
        }
        if v.paired is not None:  # the mode's cost: its step over its default's, round by round
            row["ratio_to_default"] = _spread(
                [m[v.name]["median_ms"] / m[v.paired]["median_ms"] for m in rounds]
            )
            row["paired"] = v.paired
        row["planned_peak_mb"] = per_round[0].get("planned_peak_mb")
        for base, key in (("ddp", "ratio_to_ddp"), ("zero-red", "ratio_to_zero_red")):
            row[key] = (
                _spread([m[v.name]["median_ms"] / m[base]["median_ms"] for m in rounds])
                if base in rounds[0]
                else None
            )
        configs.append(row)
    return {"world": world, "params": rounds[0][variants[0].name]["params"], "configs": configs}


TARGET = 0.90  # issue 12: <= 0.90x both DDP+AdamW and ZeroRedundancyOptimizer


def _ratio_cells(spread: dict[str, Any] | None) -> tuple[str, str]:
    """Median over rounds (green when it meets the target), and the range."""
    if spread is None:
        return "—", ""
    median = f"{spread['median']:.3f}"
    if spread["median"] <= TARGET:
        median = f"[green]{median}[/]"
    return median, f"{spread['min']:.2f}-{spread['max']:.2f}"


def fresh_report(results: list[dict[str, Any]], opts: Options) -> None:
    """The --fresh-rounds tables (rich), one per world size, and how they were measured."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 120  # a file or pipe: do not wrap at rich's default of 80 columns
    for res in results:
        table = Table(title=f"world {res['world']}: {opts.fresh_rounds} fresh rounds", title_justify="left")
        table.add_column("configuration")
        table.add_column("step (ms)", justify="right")
        table.add_column("/ ddp", justify="right")
        table.add_column("(min-max)", justify="right")
        table.add_column("/ zero-red", justify="right")
        table.add_column("(min-max)", justify="right")
        table.add_column(f"both <= {TARGET:.2f}", justify="center")
        table.add_column("CPU ms/step/rank", justify="right")
        table.add_column("loss", justify="right")
        for row in res["configs"]:
            ddp, red = row["ratio_to_ddp"], row["ratio_to_zero_red"]
            meets = "—"
            if row["kind"] == "zero" and ddp is not None and red is not None:
                meets = "yes" if max(ddp["median"], red["median"]) <= TARGET else "no"
            table.add_row(
                row["name"],
                f"{row['median_ms']:.1f}",
                *_ratio_cells(ddp),
                *_ratio_cells(red),
                meets,
                f"{row['cpu_ms_per_rank']:.0f}",
                f"{row['loss']:.4f}",
            )
        console.print(table)
    for res in results:
        for row in res["configs"]:
            if "ratio_to_default" in row:
                spread = row["ratio_to_default"]
                console.print(
                    f"world {res['world']}: {row['name']} / {row['paired']} = {spread['median']:.3f} "
                    f"({spread['min']:.2f}-{spread['max']:.2f}) step time; planned peak per rank "
                    f"{row['planned_peak_mb']:.1f} MiB against "
                    + next(
                        f"{r['planned_peak_mb']:.1f}" for r in res["configs"] if r["name"] == row["paired"]
                    )
                    + " MiB"
                )
    for v in opts.variants:
        console.print(f"  {v.name}: {v.note}")
    m = opts.model
    params = results[0]["params"] if results else 0
    console.print(
        f"GPT {params / 1e6:.2f}M parameters (vocab {m.vocab}, width {m.width}, {m.layers} layers, "
        f"{m.heads} heads, context {m.context}), fp32, batch {opts.batch}x{m.context} tokens per rank; "
        f"gloo on CPU ({os.cpu_count()} cores), one thread per process. Each round runs every "
        "configuration once, in fresh processes, in an order rotated every round; a configuration: "
        f"{opts.warmup} warm-up + {opts.steps} timed steps back to back, a step timed from its start to the "
        "next step's (the last to wait_for_params()), slowest rank, median over steps. Ratios: within the "
        "round; median over rounds (min-max). AdamW(lr="
        f"{LR}, weight_decay={WEIGHT_DECAY}, foreach=True) everywhere; buckets {opts.bucket_mb:g} MiB. "
        f"Load average at the end: {os.getloadavg()[0]:.1f}."
        + (
            f" Every worker: GLIBC_TUNABLES={opts.extra['glibc_tunables']}."
            if opts.extra.get("glibc_tunables")
            else ""
        )
    )


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _mib(n: float | None) -> str:
    return "—" if n is None else f"{n / MB:.3f}"


def markdown(results: list[dict[str, Any]], opts: Options) -> str:
    head = (
        "| world | configuration | median step (ms) | ratio to DDP | paired ratio "
        "| opt. state / rank max (MiB) | min (MiB) | ideal total/N (MiB) | max dev. "
        "| sent / step / rank (MiB) | loss | CPU ms / step / rank |"
    )
    lines = [head, "|" + "---|" * 12]
    for res in results:
        for row in res["configs"]:
            dev = row["state_deviation_pct"]
            dev_s = "— (replicated)" if dev is None else f"{dev:+.2f}%"
            comm = _mib(row["comm_bytes_per_rank"]) + ("" if row["comm_measured"] else " (computed)")
            lines.append(
                f"| {res['world']} | {row['name']} | {row['median_ms']:.0f} | {_num(row['ratio_to_ddp'])} "
                f"| {_num(row['paired_ratio_to_ddp'])} "
                f"| {_mib(row['state_bytes_max'])} | {_mib(row['state_bytes_min'])} "
                f"| {_mib(row['ideal_state_bytes'])} | {dev_s} | {comm} | {row['loss']:.4f} "
                f"| {row['cpu_ms_per_rank']:.0f} |"
            )
    m = opts.model
    params = results[0]["params"] if results else 0
    lines.append("")
    lines.append(
        f"GPT {params / 1e6:.2f}M parameters (vocab {m.vocab}, width {m.width}, {m.layers} layers, "
        f"{m.heads} heads, context {m.context}), fp32, batch {opts.batch}x{m.context} tokens per rank; "
        f"gloo on CPU ({os.cpu_count()} cores), "
        f"one thread per process; {opts.warmup} warm-up + {opts.steps} timed steps per configuration, "
        f"interleaved; step = forward+backward+step+zero_grad, slowest rank, median; paired ratio = median "
        f"over rounds of the ratio to DDP's step in the same round. AdamW(lr={LR}, "
        f"weight_decay={WEIGHT_DECAY}, foreach=True) everywhere (fused=True where named); "
        f"buckets {opts.bucket_mb:g} MiB (DDP "
        "bucket_cap_mb and ZeroOptimizer bucket_bytes). Sent bytes: ZeroOptimizer measured "
        "(`last_step_comm()`); DDP = ring all-reduce 2(N-1)/N x grad bytes, ZeroRedundancyOptimizer = "
        "that + (N-1)/N x param bytes (computed). Loss: after all steps, on each rank's batch, mean. "
        "CPU ms: process CPU time of a step (all threads, gloo's included), median, mean over ranks "
        f"(less sensitive to other load than wall time). Load average at the end: {os.getloadavg()[0]:.1f}."
    )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per configuration")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb / ZeroOptimizer bucket")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    p.add_argument("--sweep", action="store_true", help="add ZeroOptimizer bucket/overlap variants")
    p.add_argument("--only", default=None, help="comma-separated configuration names to run")
    p.add_argument(
        "--fresh-rounds",
        type=int,
        default=0,
        metavar="N",
        help="N rounds of every configuration in fresh processes, ratios within a round (issue 12)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--keep-heap",
        action="store_true",
        help="glibc keeps freed memory in every worker (GLIBC_TUNABLES, see the docstring)",
    )
    p.add_argument(
        "--before",
        default=None,
        metavar="DIR",
        help="with --fresh-rounds: also every ZeroOptimizer configuration with zeroplan from DIR/zeroplan "
        "(name@before), in the same rounds",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="with --fresh-rounds: ZeroOptimizer(deterministic=True) next to the default mode",
    )
    a = p.parse_args(argv)
    if a.fresh_rounds < 0:
        p.error("--fresh-rounds must be >= 0")
    if a.deterministic and not a.fresh_rounds:
        p.error("--deterministic needs --fresh-rounds N")
    if a.before and not a.fresh_rounds:
        p.error("--before needs --fresh-rounds N")
    if a.quick:
        model = GPT_TINY
        steps, warmup, batch = 3, 1, 2
    else:
        model = GPT_7M
        steps, warmup, batch = (10, 3, 4) if a.fresh_rounds else (25, 3, 4)
    base = (DETERMINISTIC if a.deterministic else FRESH) if a.fresh_rounds else MAIN
    variants = base + (SWEEP if a.sweep else ())
    if a.only:
        wanted = [s.strip() for s in a.only.split(",")]
        variants = tuple(v for v in variants if v.name in wanted)
        if not variants:
            p.error(f"--only matched no configuration of {[v.name for v in base + SWEEP]}")
    if a.before:
        variants += tuple(
            dataclasses.replace(v, name=f"{v.name}@before", before=True) for v in variants if v.kind == "zero"
        )
    return Options(
        worlds=tuple(int(w) for w in a.worlds.split(",")),
        steps=a.steps if a.steps is not None else steps,
        warmup=a.warmup if a.warmup is not None else warmup,
        bucket_mb=a.bucket_mb,
        batch=a.batch if a.batch is not None else batch,
        model=model,
        variants=variants,
        fresh_rounds=a.fresh_rounds,
        extra={"json": a.json, "glibc_tunables": KEEP_HEAP if a.keep_heap else None, "before": a.before},
    )


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    tunables = opts.extra.get("glibc_tunables")
    if tunables is not None:
        os.environ["GLIBC_TUNABLES"] = tunables  # read by glibc in every spawned worker
    results = []
    start = time.perf_counter()
    for world in opts.worlds:
        t = time.perf_counter()
        results.append(run_fresh_rounds(world, opts) if opts.fresh_rounds else run_world(world, opts))
        print(f"world {world}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    if opts.fresh_rounds:
        fresh_report(results, opts)
        table = None
    else:
        table = markdown(results, opts)
        print(table)
    print(f"\ntotal {time.perf_counter() - start:.0f} s", file=sys.stderr)
    path = opts.extra.get("json")
    if path:
        payload = {
            "mode": "fresh_rounds" if opts.fresh_rounds else "interleaved",
            "fresh_rounds": opts.fresh_rounds,
            "model": opts.model._asdict(),
            "batch": opts.batch,
            "steps": opts.steps,
            "warmup": opts.warmup,
            "bucket_mb": opts.bucket_mb,
            "glibc_tunables": tunables,
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
            "results": results,
            "table": table,
        }
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
