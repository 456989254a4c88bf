"""The training of ``zeroplan demo``, in each worker process.

[Note: demo protocol]
``supervisor.run`` starts ``world`` processes (spawn, one thread each) on gloo, or on
NCCL with one GPU per rank. Every rank builds the same :class:`DemoGPT` and trains
it with ``ZeroOptimizer(torch.optim.AdamW)`` on its own batches of the sort
task: ``backward``, ``clip_grad_norm_(1.0)``, ``step``, ``zero_grad``. Rank 0
also runs the reference: another copy of the model whose fp32 masters are
stepped by a plain ``torch.optim.AdamW`` on the gradients of *all* ranks'
batches, summed in the model dtype (what a data-parallel all-reduce computes),
averaged, and clipped with ``torch.nn.utils.clip_grad_norm_``. Both runs thus
take the same steps on the same data, and differ only in rounding: the order of
the gradient sum (the ring's, not the reference's), the grouping of the norm.

Rank 1 (rank 0 when alone) runs the control of [Note: tolerance] (in ``outcome``), at the same
time as the reference. Each step starts at a barrier and is timed on every
rank; the reference is timed on rank 0 while the other ranks wait. At the end
every rank reports its measured bytes (``measured_memory``, ``last_step_comm``) next to the plan's
(``memory_report``), rank 0 gathers them, compares the parameters of the two
runs, prints the tables (``report``) and hands the exit code back.

At stage 3 every rank holds only its shard of each parameter between steps
([Note: stage 3] in ``params.sharded``): the model is attached to the optimizer
before the first forward, and the final parameters are copied inside
``gathered_params()`` on every rank (collective). Memory is measured outside
it, between steps, where the plan counts only the shards.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import statistics
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core.peak import gathered_bytes
from zeroplan.facade import MeasuredMemory, ZeroOptimizer
from zeroplan.facade.cli.demo.model import GPTConfig, SortTask, build_model, loss_of
from zeroplan.facade.cli.demo.outcome import Outcome, RankRecord
from zeroplan.facade.cli.demo.settings import DemoSettings

__all__ = ["Reference", "largest_difference", "train", "worker"]

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CLIP = 1.0


def worker(rank: int, settings: DemoSettings, rendezvous: str) -> int | None:
    """One process of the demo: join the group, train; rank 0 prints the report and returns the code."""
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
    finally:
        # ZeroOptimizer is freed only by the cycle collector (its gradient hooks refer back to it);
        # collected at interpreter exit instead, its gloo groups sometimes abort the process
        # ("terminate called without an active exception"). Free it now.
        gc.collect()
        dist.destroy_process_group()
    if outcome is None:
        return None
    from zeroplan.facade.cli.demo.report import print_report

    return print_report(outcome)


class ReferenceStep(NamedTuple):
    """One step of a :class:`Reference`: mean loss over the batches, and its timings."""

    loss: float
    step_ms: float
    optimizer_ms: float


class Reference:
    """Unsharded data parallelism in one process (see [Note: demo protocol]).

    Args:
        model: the model (any dtype); its fp32 masters are stepped, then rounded into it.
        reordered: the control run of [Note: tolerance]: sum the ranks' gradients in reverse
            order and compute the clipping norm over one flat vector; the same mathematics,
            another rounding.
        **hyper: ``torch.optim.AdamW`` settings.
    """

    def __init__(self, model: torch.nn.Module, *, reordered: bool = False, **hyper: Any) -> None:
        self.model = model
        self.reordered = reordered
        self.master = [p.detach().float().clone() for p in model.parameters()]
        self.optimizer = torch.optim.AdamW(self.master, **hyper)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> ReferenceStep:
        """One step on every rank's batch (forward, backward, average, clip, AdamW, round)."""
        device = self.master[0].device
        started = _now(device)
        params = list(self.model.parameters())
        summed = [torch.zeros_like(p) for p in params]
        losses = []
        for tokens, targets in reversed(batches) if self.reordered else batches:
            loss = loss_of(self.model, tokens, targets)
            loss.backward()
            losses.append(loss.detach())
            for total, param in zip(summed, params, strict=True):
                total.add_(param.grad)  # in the model dtype, as an all-reduce sums (0 + g is exact)
            self.model.zero_grad(set_to_none=True)
        for master, total in zip(self.master, summed, strict=True):
            master.grad = total.float().div_(len(batches))
        if self.reordered:
            norm = torch.linalg.vector_norm(torch.cat([m.grad.reshape(-1) for m in self.master]))
            coefficient = torch.clamp(CLIP / (norm + 1e-6), max=1.0)  # torch's formula
            for master in self.master:
                master.grad.mul_(coefficient)
        else:
            torch.nn.utils.clip_grad_norm_(self.master, CLIP)
        before_step = _now(device)
        self.optimizer.step()
        with torch.no_grad():
            for param, master in zip(params, self.master, strict=True):
                param.copy_(master)
        ended = _now(device)
        loss = float(torch.stack(losses).mean())
        return ReferenceStep(
            loss=loss, step_ms=(ended - started) * 1e3, optimizer_ms=(ended - before_step) * 1e3
        )


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
    hyper = {"lr": settings.lr, "weight_decay": 0.01}
    model = build_model(config, dtype=dtype, device=device)
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        stage=settings.stage,
        shard_group_size=settings.shard_size,
        ranks_per_node=settings.ranks_per_node,
        bucket_bytes=settings.bucket_bytes,
        collectives=settings.collectives,
        reshard_after_forward=settings.reshard_after_forward,
        **hyper,
    )
    opt.attach(model)  # stage 3: the forward gathers the parameters it uses (stages 1-2: nothing to do)
    # The reference on rank 0; the control on rank 1 (in parallel with it), or on rank 0 when alone.
    reference = control = None
    if rank == 0:
        reference = Reference(build_model(config, dtype=dtype, device=device), **hyper)
    if rank == min(1, world - 1):
        control = Reference(build_model(config, dtype=dtype, device=device), reordered=True, **hyper)

    def batches(step: int, ranks: list[int] | range) -> list[tuple[torch.Tensor, torch.Tensor]]:
        made = (task.batch(step=step, rank=r, size=settings.batch_size) for r in ranks)
        return [(tokens.to(device), targets.to(device)) for tokens, targets in made]

    step_ms: list[float] = []
    optimizer_ms: list[float] = []
    ref_steps: list[ReferenceStep] = []
    losses: list[tuple[float, float]] = []
    control_losses: list[float] = []
    progress = _progress() if rank == 0 else None
    if progress is not None:
        _print_header(settings, opt, model)
        progress.start()
        bar = progress.add_task("train", total=settings.steps, zero=math.nan, ref=math.nan)
    try:
        for step in range(settings.steps):
            tokens, targets = batches(step, [rank])[0]
            dist.barrier()  # every rank starts the timed step together
            started = _now(device)
            loss = loss_of(model, tokens, targets)
            opt.backward(loss)
            opt.clip_grad_norm_(CLIP)
            before_step = _now(device)
            opt.step()
            ended = _now(device)
            opt.zero_grad()
            step_ms.append((ended - started) * 1e3)
            optimizer_ms.append((ended - before_step) * 1e3)
            mean_loss = loss.detach().float().reshape(1)
            dist.all_reduce(mean_loss)  # the loss over every rank's batch, as the reference sees it
            if control is not None:
                control_losses.append(control.step(batches(step, range(world))).loss)
            if reference is not None and progress is not None:
                ref_steps.append(reference.step(batches(step, range(world))))
                losses.append((float(mean_loss) / world, ref_steps[-1].loss))
                progress.update(bar, advance=1, zero=losses[-1][0], ref=losses[-1][1])
    finally:
        if progress is not None:
            progress.stop()
    with opt.gathered_params():  # stage 3: whole parameters exist only in here (collective)
        final = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    records = _gather_records(opt, final, step_ms, optimizer_ms)
    controls: list[Any] = [None] * world
    mine = (
        None if control is None else ([p.detach().cpu() for p in control.model.parameters()], control_losses)
    )
    dist.all_gather_object(controls, mine)
    if reference is None:
        return None
    control_params, control_losses = next(c for c in controls if c is not None)
    names = [name for name, _ in model.named_parameters()]
    expected = [p.detach().cpu() for p in reference.model.parameters()]
    diff, worst = largest_difference(names, final, expected)
    control_diff, _ = largest_difference(names, control_params, expected)
    return Outcome(
        settings=settings,
        fingerprint=opt.plan.fingerprint(),
        losses=tuple(losses),
        max_rel_diff=diff,
        worst_param=worst,
        control_diff=control_diff,
        control_losses=tuple(control_losses),
        ref_step_ms=statistics.median(s.step_ms for s in ref_steps),
        ref_optimizer_ms=statistics.median(s.optimizer_ms for s in ref_steps),
        records=records,
        seconds=time.perf_counter() - began,
        gathered_estimate=_gathered_estimate(opt, settings),
    )


def _print_header(settings: DemoSettings, opt: ZeroOptimizer, model: torch.nn.Module) -> None:
    from rich.console import Console

    s = settings
    if s.device == "cuda":
        where = f"{s.world} x {torch.cuda.get_device_name()}"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        where = f"{s.world} processes on {cores} CPU cores"
    Console().print(
        f"[bold]zeroplan demo[/]: a {sum(p.numel() for p in model.parameters()):,}-parameter GPT learns "
        f"to sort; {s.steps} steps, {s.dtype}, {where}\n"
        f"ZeroOptimizer(AdamW): stage {s.stage}{_stage_3_mode(s)} on {s.world} ranks in shard groups of "
        f"{s.shard_size}{'' if s.ranks_per_node is None else f' on nodes of {s.ranks_per_node}'}, "
        f"{len(opt.plan.buckets.buckets)} gradient buckets, strategy {opt.plan.partition.strategy}, "
        f"collectives {opt.plan.policy}\n"
        "reference: torch.optim.AdamW in one process, on every rank's batches"
    )


def _stage_3_mode(settings: DemoSettings) -> str:
    """How stage 3 gathers, for the header ("" at stages 1-2)."""
    if settings.stage != 3:
        return ""
    if settings.reshard_after_forward:
        return " (parameters resharded after forward, gathered again in backward)"
    return " (parameters kept from forward to backward)"


def _gathered_estimate(opt: ZeroOptimizer, settings: DemoSettings) -> int | None:
    """Stage 3: the plan's bytes of gathered blocks alive at once in backward (not measured here)."""
    if settings.stage != 3:
        return None
    return gathered_bytes(opt.plan)  # the plan carries reshard_after_forward


def params_digest(params: Iterable[torch.Tensor]) -> str:
    """sha256 of every parameter's bytes, in order (equal digests: bit-identical parameters)."""
    digest = hashlib.sha256()
    for param in params:
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _gather_records(
    opt: ZeroOptimizer, params: list[torch.Tensor], step_ms: list[float], optimizer_ms: list[float]
) -> tuple[RankRecord, ...]:
    """Every rank's measured and planned numbers, on every rank (collective).

    ``params``: this rank's whole parameters (at stage 3 copied inside ``gathered_params``).
    """
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
        params_digest=params_digest(params),
    )
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return tuple(rows)


def largest_difference(
    names: list[str], actual: list[torch.Tensor], expected: list[torch.Tensor]
) -> tuple[float, str]:
    """Largest ``max |a - b| / max |b|`` over parameters (NaN wins), and that parameter's name.

    Example:
        >>> largest_difference(["w", "b"], [torch.ones(2), torch.zeros(1)], [torch.ones(2), torch.ones(1)])
        (1.0, 'b')
    """
    worst, name = 0.0, "-"
    for param_name, a, b in zip(names, actual, expected, strict=True):
        a, b = a.detach().float(), b.detach().float()
        diff = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0
        if diff > worst or math.isnan(diff):
            worst, name = diff, param_name
            if math.isnan(diff):
                break
    return worst, name
