"""``zeroplan demo``: a sharded and an unsharded run of the same training, side by side.

[Note: demo protocol]
``run`` starts ``world`` processes (spawn, one thread each) on gloo, or on NCCL
with one GPU per rank. Every rank builds the same :class:`DemoGPT` and trains
it with ``ZeroOptimizer(torch.optim.AdamW)`` on its own batches of the sort
task: ``backward``, ``clip_grad_norm_(1.0)``, ``step``, ``zero_grad``. Rank 0
also runs the reference: one more copy of the model whose fp32 masters are
stepped by a plain ``torch.optim.AdamW`` on the gradients of *all* ranks'
batches, summed in the model dtype (what a data-parallel all-reduce computes),
averaged, and clipped with ``torch.nn.utils.clip_grad_norm_``. Both runs thus
take the same steps on the same data, and differ only in rounding: the order of
the gradient sum (the ring's, not the reference's), the grouping of the norm.

Each step starts at a barrier and is timed on every rank; the reference is
timed on rank 0 while the other ranks wait. At the end every rank reports its
measured bytes (``measured_memory``, ``last_step_comm``) next to the plan's
(``memory_report``), rank 0 gathers them, compares the parameters of the two
runs, prints the tables (``demo_report``) and hands the exit code back.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zeroplan.core import CommCost
from zeroplan.core.errors import check_config
from zeroplan.facade.demo_model import GPTConfig, SortTask, build_model, loss_of
from zeroplan.facade.demo_settings import DemoSettings
from zeroplan.facade.optimizer import MeasuredMemory, ZeroOptimizer

__all__ = ["DemoSettings", "Outcome", "RankRecord", "run"]

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CLIP = 1.0


class RankRecord(NamedTuple):
    """What one rank measured, next to what the plan says for it."""

    rank: int
    shard_rank: int
    measured: MeasuredMemory
    planned: MeasuredMemory
    comm: tuple[CommCost, ...]
    planned_comm: tuple[CommCost, ...]
    step_ms: float
    optimizer_ms: float


class Outcome(NamedTuple):
    """Everything rank 0 reports at the end (see ``demo_report``)."""

    settings: DemoSettings
    params: int
    fingerprint: str
    strategy: str
    buckets: int
    losses: tuple[tuple[float, float], ...]
    """(sharded, reference) mean loss over all ranks' batches, per step."""
    max_rel_diff: float
    worst_param: str
    ref_step_ms: float
    ref_optimizer_ms: float
    records: tuple[RankRecord, ...]
    seconds: float


def check_devices(settings: DemoSettings) -> None:
    """Raise ``ConfigError`` unless the machine has what ``settings.device`` needs."""
    if settings.device == "cuda":
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        check_config(
            found >= settings.world,
            f"--device cuda needs one GPU per rank: --world {settings.world} but {found} CUDA device(s) "
            "are visible; lower --world or use --device cpu",
        )
        check_config(dist.is_nccl_available(), "--device cuda needs NCCL, which this torch build lacks")
    check_config(dist.is_gloo_available() or settings.device == "cuda", "this torch build lacks gloo")


def run(settings: DemoSettings) -> int:
    """Run the demo in ``settings.world`` processes; returns the exit code (0: the runs agree).

    Raises:
        ConfigError: the machine lacks the requested devices.
    """
    check_devices(settings)
    ctx = mp.get_context("spawn")
    verdict = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="zeroplan-demo-") as scratch:
        rendezvous = os.path.join(scratch, "rendezvous")
        try:
            mp.start_processes(
                _worker,
                args=(settings, rendezvous, verdict),
                nprocs=settings.world,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as exc:
            print(f"zeroplan demo: {exc}".rstrip(), flush=True)
            return 1
        except mp.ProcessExitedException as exc:
            print(f"zeroplan demo: a worker died: {exc}", flush=True)
            return 1
    return int(verdict.get()) if not verdict.empty() else 1


def _worker(rank: int, settings: DemoSettings, rendezvous: str, verdict: Any) -> None:
    torch.set_num_threads(1)
    if settings.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=settings.world,
        timeout=timedelta(minutes=5),
    )
    try:
        outcome = train(settings, rank, device)
        if outcome is not None:
            from zeroplan.facade.demo_report import print_report

            verdict.put(print_report(outcome))
    finally:
        dist.destroy_process_group()


class Reference:
    """Unsharded data parallelism in one process (see [Note: demo protocol])."""

    def __init__(self, model: torch.nn.Module, **hyper: Any) -> None:
        self.model = model
        self.master = [p.detach().float().clone() for p in model.parameters()]
        self.optimizer = torch.optim.AdamW(self.master, **hyper)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """One step on every rank's batch; returns (mean loss, ms spent in ``optimizer.step()``)."""
        params = list(self.model.parameters())
        summed = [torch.zeros_like(p) for p in params]
        losses = []
        for tokens, targets in batches:
            loss = loss_of(self.model, tokens, targets)
            loss.backward()
            losses.append(loss.detach())
            for total, param in zip(summed, params, strict=True):
                total.add_(param.grad)  # in the model dtype, as an all-reduce sums (0 + g is exact)
            self.model.zero_grad(set_to_none=True)
        for master, total in zip(self.master, summed, strict=True):
            master.grad = total.float().div_(len(batches))
        torch.nn.utils.clip_grad_norm_(self.master, CLIP)
        started = _now(self.master[0].device)
        self.optimizer.step()
        optimizer_ms = (_now(self.master[0].device) - started) * 1e3
        with torch.no_grad():
            for param, master in zip(params, self.master, strict=True):
                param.copy_(master)
        return float(torch.stack(losses).mean()), optimizer_ms


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _progress() -> Any:
    """A rich progress bar: step, the loss of both runs, steps per second."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn
    from rich.text import Text

    class Speed(ProgressColumn):
        def render(self, task: Task) -> Text:
            return Text(f"{task.speed or 0.0:5.1f} steps/s")

    return Progress(
        TextColumn("[bold]step"),
        MofNCompleteColumn(),
        BarColumn(bar_width=24),
        TextColumn("loss: zero {task.fields[zero]:.4f}  ref {task.fields[ref]:.4f}"),
        Speed(),
    )


def train(settings: DemoSettings, rank: int, device: torch.device) -> Outcome | None:
    """The demo's training on this rank (collective); rank 0 returns the outcome, others ``None``."""
    began = time.perf_counter()
    world, dtype = settings.world, TORCH_DTYPES[settings.dtype]
    task = SortTask()
    config = GPTConfig(vocab=task.vocab, context=task.context)
    hyper = {"lr": settings.lr, "betas": (0.9, 0.95), "weight_decay": 0.01}
    model = build_model(config, dtype=dtype, device=device)
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        stage=settings.stage,
        shard_group_size=settings.shard_size,
        bucket_bytes=settings.bucket_bytes,
        **hyper,
    )
    reference = Reference(build_model(config, dtype=dtype, device=device), **hyper) if rank == 0 else None

    def batch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = task.batch(step=step, rank=r, size=settings.batch_size)
        return tokens.to(device), targets.to(device)

    step_ms, optimizer_ms, ref_step_ms, ref_optimizer_ms = [], [], [], []
    losses: list[tuple[float, float]] = []
    progress = _progress() if rank == 0 else None
    if progress is not None:
        _print_header(settings, opt, model)
        progress.start()
        bar = progress.add_task("train", total=settings.steps, zero=math.nan, ref=math.nan)
    try:
        for step in range(settings.steps):
            dist.barrier()
            started = _now(device)
            loss = loss_of(model, *batch(step, rank))
            opt.backward(loss)
            opt.clip_grad_norm_(CLIP)
            before_step = _now(device)
            opt.step()
            ended = _now(device)
            opt.zero_grad()
            step_ms.append((ended - started) * 1e3)
            optimizer_ms.append((ended - before_step) * 1e3)
            mean_loss = loss.detach().float().reshape(1)
            dist.all_reduce(mean_loss)  # for display: the loss over every rank's batch
            if reference is not None and progress is not None:
                started = _now(device)
                ref_loss, ms = reference.step([batch(step, r) for r in range(world)])
                ref_step_ms.append((_now(device) - started) * 1e3)
                ref_optimizer_ms.append(ms)
                losses.append((float(mean_loss) / world, ref_loss))
                progress.update(bar, advance=1, zero=losses[-1][0], ref=ref_loss)
    finally:
        if progress is not None:
            progress.stop()
    records = _gather_records(opt, step_ms, optimizer_ms)
    if reference is None:
        return None
    worst, name = _largest_difference(model, reference.model)
    return Outcome(
        settings=settings,
        params=sum(p.numel() for p in model.parameters()),
        fingerprint=opt.plan.fingerprint(),
        strategy=opt.plan.partition.strategy,
        buckets=len(opt.plan.buckets.buckets),
        losses=tuple(losses),
        max_rel_diff=worst,
        worst_param=name,
        ref_step_ms=statistics.median(ref_step_ms),
        ref_optimizer_ms=statistics.median(ref_optimizer_ms),
        records=records,
        seconds=time.perf_counter() - began,
    )


def _print_header(settings: DemoSettings, opt: ZeroOptimizer, model: torch.nn.Module) -> None:
    from rich.console import Console

    s = settings
    Console().print(
        f"[bold]zeroplan demo[/]: {sum(p.numel() for p in model.parameters()):,}-parameter GPT learning "
        f"to sort, {s.steps} steps, {s.dtype}, {s.device}\n"
        f"ZeroOptimizer(AdamW) stage {s.stage} on {s.world} ranks in shard groups of {s.shard_size} "
        f"({len(opt.plan.buckets.buckets)} gradient buckets, strategy {opt.plan.partition.strategy}) "
        f"vs torch.optim.AdamW in one process"
    )


def _gather_records(
    opt: ZeroOptimizer, step_ms: list[float], optimizer_ms: list[float]
) -> tuple[RankRecord, ...]:
    """Every rank's measured and planned numbers, on every rank (collective)."""
    groups = opt.process_groups
    planned = opt.memory_report(clipping=True).ranks[groups.rank]
    mine = RankRecord(
        rank=groups.rank,
        shard_rank=groups.shard_rank,
        measured=opt.measured_memory(),
        planned=MeasuredMemory(
            params_bytes=planned.params_bytes,
            grads_bytes=planned.grads_bytes,
            master_bytes=planned.master_bytes,
            optimizer_state_bytes=planned.optimizer_state_bytes,
            buffer_bytes=planned.buffer_bytes,
        ),
        comm=opt.last_step_comm(),
        planned_comm=planned.comm,
        step_ms=statistics.median(step_ms),
        optimizer_ms=statistics.median(optimizer_ms),
    )
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return tuple(rows)


def _largest_difference(model: torch.nn.Module, reference: torch.nn.Module) -> tuple[float, str]:
    """Largest ``max |a - b| / max |b|`` over the parameters, and that parameter's name."""
    worst, name = 0.0, "-"
    for (param_name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        a, b = a.detach().float(), b.detach().float()
        diff = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
        if diff > worst or math.isnan(diff):
            worst, name = diff, param_name
    return worst, name
