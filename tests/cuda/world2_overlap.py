"""Does a bucket's reduction run while backward still computes? A probe, run by ``world2.py``.

[Note: overlap probe]
The claim: with ``overlap_grad_reduce=True`` the reduction of the first
buckets runs while the GPU is still computing later gradients. The probe
makes "later gradients" long and observable: a parameterless ``Stall`` layer
between the embeddings and the first block whose backward enqueues a
``torch.cuda._sleep`` kernel (about half a second) on the backward stream and
records a CUDA event ``stall_end`` after it. In stream order that kernel comes
after the gradients of every block and before those of the embeddings, so
while ``stall_end`` has not completed the GPU has provably not finished
backward. Meanwhile ``torch.distributed.all_reduce`` is wrapped: each bucket
reduction launched during backward is counted, a CUDA event is recorded at
its launch, and a callback on its ``Work``'s future notes when it completed.

Inside the stall's backward (host side, after the sleep is enqueued) the probe
waits until the first bucket's reduction completed or ``stall_end`` completed,
then reads, in this order, "first reduction done" and "``stall_end`` not yet
reached". Both true means the reduction finished on both ranks while this
rank's GPU was still in backward: that is the overlap, observed without
comparing host and GPU clocks. If reductions were launched only at ``step()``
(``finish_grad_sync()``), none would exist during backward: nothing is launched before
the stall and nothing completes while it runs. The same probe on
``overlap_grad_reduce=False`` is the control and must see exactly that.

What is observable with gloo: an all-reduce of a CUDA tensor copies it to
pinned host memory on a gloo stream (after an event recorded at launch, so
after the bucket's staging copy), sums on the host in gloo's worker thread
with the other rank, and copies back on that stream. No reduction kernel runs
on the GPU, so a profiler would show only memcpys; the ``Work``'s future
completing (host sum done on both ranks) is the clearest signal, and the probe
uses it. NCCL at world 1 would not help: at world 1 ``start_bucket_reduce`` issues
no collective at all (the reduction is a copy), and NCCL refuses two ranks on
one GPU, so with one GPU gloo is the only way to have a real reduction in flight.

The CUDA events also give the timeline: GPU milliseconds from the first
launch to the end of backward (at least the stall, since the launch precedes
it in stream order), of backward, of the stall. With ``--device cpu`` the
stall is a host sleep inside backward and "still in backward" holds by
construction: it checks the plumbing (wrapping, counting, callbacks, the
control), not the GPU's concurrency.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.cli.demo.model import GPTConfig, build_model, loss_of

# ffn 1021 and alignment 16 (below) make the two ranks' shards differ in size, so the plan broadcasts
# the updated parameters: gloo carries all-reduces and broadcasts of CUDA tensors, not exchanges.
CONFIG = GPTConfig(vocab=512, width=256, layers=4, heads=4, context=64, ffn=1021, qkv_bias=True)
BATCH = 8
BUCKET_BYTES = 1 << 20  # about 3 buckets per block
STEPS = 3  # the first warms up (pinned host buffers, allocator, cuBLAS)
STALL_S = 0.5
WAIT_S = 10.0  # the longest the probe waits inside the stall for the first reduction


class Probe:
    """Counts and times the bucket reductions of one backward pass (see [Note: overlap probe])."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.cycles = sleep_cycles(STALL_S) if self.cuda else 0
        self.armed = False
        self._reset()

    def _reset(self) -> None:
        self.launches: list[tuple[float, Any]] = []  # (host time, CUDA event at launch)
        self.done_at: dict[int, float] = {}
        self.first_done = threading.Event()
        self.stall_record: dict[str, Any] = {}
        self.stall_events: tuple[Any, Any] | None = None
        self.stall_host: tuple[float, float] = (0.0, 0.0)

    def _event(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else 1e3 * (end - start)

    def arm(self) -> None:
        """Start observing a backward pass."""
        self._reset()
        self.start = self._event()
        self.armed = True

    def on_launch(self, work: dist.Work) -> None:
        """Called by the wrapped ``all_reduce`` with the work it launched."""
        if not self.armed:
            return
        k = len(self.launches)
        self.launches.append((time.perf_counter(), self._event()))
        work.get_future().add_done_callback(partial(self._done, k))  # holds no reference to the work

    def _done(self, k: int, future: Any) -> None:
        del future
        self.done_at[k] = time.perf_counter()
        if k == 0:
            self.first_done.set()

    def stall(self) -> None:
        """The stall's backward: enqueue the sleep, then look for the first reduction completing."""
        before = len(self.launches)
        host_start = time.perf_counter()
        if self.cuda:
            start = self._event()
            torch.cuda._sleep(self.cycles)
            end = self._event()
            deadline = time.perf_counter() + WAIT_S
            while not self.first_done.is_set() and not end.query() and time.perf_counter() < deadline:
                time.sleep(1e-4)
            done = self.first_done.is_set()
            busy = not end.query()  # read after `done`: if both hold, the reduction finished first
            self.stall_events = (start, end)
        else:
            deadline = host_start + STALL_S
            while not self.first_done.is_set() and time.perf_counter() < deadline:
                time.sleep(1e-4)
            done, busy = self.first_done.is_set(), True  # the host itself is still inside backward
            time.sleep(max(0.0, deadline - time.perf_counter()))
        self.stall_host = (host_start, time.perf_counter())
        self.stall_record = {"launched_before_stall": before, "reduced_while_busy": done and busy}

    def disarm(self) -> dict[str, Any]:
        """End of backward: what the probe saw, with the CUDA-event timeline."""
        self.armed = False
        end = self._event()
        if self.cuda:
            end.synchronize()
        stall = self.stall_events or self.stall_host
        first = self.launches[0][1] if self.launches else None
        first_done = self.done_at.get(0)
        return {
            **self.stall_record,
            "launched_in_backward": len(self.launches),
            "backward_ms": self._ms(self.start, end),
            "stall_ms": self._ms(*stall),
            "first_launch_ms_before_backward_end": None if first is None else self._ms(first, end),
            "first_done_host_ms_into_stall": (
                None if first_done is None else 1e3 * (first_done - self.stall_host[0])
            ),
        }


def sleep_cycles(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds`` on this device."""
    probe = 50_000_000
    torch.cuda._sleep(1000)  # load the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds * 1e3 / start.elapsed_time(end))


class _StallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, probe: Probe) -> torch.Tensor:
        ctx.probe = probe
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.probe.stall()
        return grad, None


class Stall(nn.Module):
    """Identity forward; its backward runs :meth:`Probe.stall` (long, observable later gradients)."""

    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StallFn.apply(x, self.probe)


def _trace_all_reduce(probe: Probe) -> None:
    """Route ``torch.distributed.all_reduce`` (what the GLOO policy reduces buckets with) past ``probe``."""
    real = dist.all_reduce

    def traced(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = real(tensor, *args, **kwargs)
        if work is not None:
            probe.on_launch(work)
        return work

    dist.all_reduce = traced


def overlap(rank: int, world: int, device: torch.device, cfg: dict[str, Any]) -> dict[str, Any]:
    """``STEPS`` probed steps with ``overlap_grad_reduce=True``, then as many with ``False``."""
    del world, cfg
    probe = Probe(device)
    _trace_all_reduce(probe)
    g = torch.Generator().manual_seed(rank)
    seq = torch.randint(0, CONFIG.vocab, (BATCH, CONFIG.context + 1), generator=g).to(device)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    result: dict[str, Any] = {"stall_cycles": probe.cycles}
    for name, flag in (("overlap", True), ("no_overlap", False)):
        model = build_model(CONFIG, seed=0, device=device)
        model.blocks.insert(0, Stall(probe))  # backward: blocks, then the stall, then the embeddings
        opt = ZeroOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            stage=1,  # all-reduces and broadcasts: gloo carries them for CUDA tensors
            collectives="gloo",
            layout="rank_major",
            alignment=16,
            bucket_bytes=BUCKET_BYTES,
            overlap_grad_reduce=flag,
            lr=1e-3,
        )
        steps = []
        for _ in range(STEPS):
            loss = loss_of(model, tokens, targets)
            probe.arm()
            opt.backward(loss)
            steps.append(probe.disarm())
            opt.step()
            opt.zero_grad()
        result[name] = {"buckets": len(opt.plan.buckets.buckets), "steps": steps}
        del opt, model
    return result
