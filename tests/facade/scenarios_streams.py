"""The stream rules of [Note: streams], checked on CPU by a recording fake of CUDA's streams.

On the CPU the helpers of ``collectives`` are no-ops; here ``collectives._side`` returns a fake side
stream for every device and ``torch.cuda.current_stream``/``torch.cuda.stream`` follow a stack of
fakes, so the facade's CUDA ordering runs for real and every wait, mark and collective completion is
logged with the stream it ran on.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from factory import make_optimizer
from models import DTYPES, batch, loss_of, make_model

from zeroplan.facade.mechanisms import collectives


class FakeMark:
    def __init__(self, stream: str, number: int) -> None:
        self.stream, self.number = stream, number


class FakeStream:
    """A named stream that logs what is asked of it."""

    def __init__(self, name: str, log: list[tuple[str, ...]]) -> None:
        self.name, self.log, self.device, self.marks = name, log, torch.device("cpu"), 0

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append((self.name, "waits for", other.name))

    def record_event(self) -> FakeMark:
        self.marks += 1
        self.log.append((self.name, "mark", str(self.marks)))
        return FakeMark(self.name, self.marks)

    def wait_event(self, mark: FakeMark) -> None:
        self.log.append((self.name, "waits for mark", f"{mark.stream}:{mark.number}"))

    def synchronize(self) -> None:
        self.log.append(("host", "waits for", self.name))


class FakeCuda:
    """A compute and a side stream, and the current-stream stack ``torch.cuda.stream`` would keep."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.compute = FakeStream("compute", self.log)
        self.side = FakeStream("side", self.log)
        self.stack = [self.compute]

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.stack[-1]

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Any:
        self.stack.append(stream)
        try:
            yield
        finally:
            self.stack.pop()


@contextlib.contextmanager
def fake_cuda() -> Any:
    fake = FakeCuda()
    saved = (collectives._side, torch.cuda.current_stream, torch.cuda.stream, collectives.Pending.finish)
    original_finish = collectives.Pending.finish

    def finish(self: collectives.Pending, *, home_waits: bool = True) -> None:
        if self._work is not None:
            fake.log.append((fake.stack[-1].name, "completes a collective"))
        original_finish(self, home_waits=home_waits)

    collectives._side = lambda device: fake.side  # type: ignore[assignment]
    torch.cuda.current_stream = fake.current_stream  # type: ignore[assignment]
    torch.cuda.stream = fake.stream  # type: ignore[assignment]
    collectives.Pending.finish = finish  # type: ignore[method-assign]
    try:
        yield fake
    finally:
        collectives._side, torch.cuda.current_stream, torch.cuda.stream, collectives.Pending.finish = saved


def _logged_steps(fake: FakeCuda, model: Any, opt: Any, rank: int) -> dict[str, list[tuple[str, ...]]]:
    """Two steps; the second's log, split into forward, backward (the hooks) and ``step()``."""
    for step in range(2):
        start = len(fake.log)
        loss = loss_of(model, *batch(step, rank))  # the forward completes the last step's gathers
        in_forward = len(fake.log)
        loss.backward()
        in_backward = len(fake.log)
        opt.step()
        in_step = len(fake.log)
        opt.zero_grad()
    opt.wait_for_params()
    return {
        "forward": fake.log[start:in_forward],
        "backward": fake.log[in_forward:in_backward],
        "step": fake.log[in_backward:in_step],
    }


def bucket_streams(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One step's stream log, split into backward (the hooks) and the reduction's end."""
    torch.manual_seed(0)
    model = make_model(dtype=DTYPES[cfg.get("dtype", "fp32")])
    settings = {k: cfg[k] for k in ("collectives", "ranks_per_node") if k in cfg}
    opt = make_optimizer(model, stage=cfg["stage"], hyper={"lr": 1e-3}, max_inflight_buckets=1, **settings)
    opt.attach(model)
    with fake_cuda() as fake:
        phases = _logged_steps(fake, model, opt, rank)
    return {
        **phases,
        "buckets": len(opt.plan.buckets.buckets),
    }


@contextlib.contextmanager
def logged_copies(fake: FakeCuda) -> Any:
    """Log every asynchronous copy (``non_blocking=True``) with the stream it is queued on."""
    copy, foreach = torch.Tensor.copy_, torch._foreach_copy_

    def logged_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if non_blocking:
            fake.log.append((fake.stack[-1].name, "copies", "1"))
        return copy(self, src, non_blocking)

    def logged_foreach(targets: Any, sources: Any, non_blocking: bool = False) -> None:
        if non_blocking:
            fake.log.append((fake.stack[-1].name, "copies", str(len(targets))))
        foreach(targets, sources, non_blocking=non_blocking)

    torch.Tensor.copy_ = logged_copy  # type: ignore[method-assign]
    torch._foreach_copy_ = logged_foreach  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.copy_, torch._foreach_copy_ = copy, foreach  # type: ignore[method-assign]


def offload_streams(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One offloaded step's log: the gradients' copies to host memory during backward, the host's
    wait, each unit stepped on the host and its copy back ([Note: offload, executed])."""
    from zeroplan.core import host_link, kept_tensors, step_units
    from zeroplan.core.host_step import gather_release

    torch.manual_seed(0)
    model = make_model(dtype=DTYPES[cfg.get("dtype", "fp32")])
    opt = make_optimizer(
        model,
        stage=cfg["stage"],
        hyper={"lr": 1e-3},
        offload=cfg.get("offload", "optimizer"),
        offload_fraction=cfg.get("offload_fraction"),
    )
    opt.attach(model)
    inner = opt.installed.inner.optimizer
    with fake_cuda() as fake, logged_copies(fake):
        step_inner = inner.step

        def logged_step(*args: Any, **kwargs: Any) -> Any:
            fake.log.append(("host", "steps a unit"))
            return step_inner(*args, **kwargs)

        inner.step = logged_step  # type: ignore[method-assign]
        launch = collectives._start

        def logged_start(*args: Any, **kwargs: Any) -> Any:
            fake.log.append((fake.stack[-1].name, "launches a collective"))
            return launch(*args, **kwargs)

        collectives._start = logged_start  # type: ignore[assignment]
        try:
            phases = _logged_steps(fake, model, opt, rank)
        finally:
            collectives._start = launch  # type: ignore[assignment]
    zp, shard_rank = opt.plan, opt.installed.groups.shard_rank
    link = host_link(zp, shard_rank)
    pieces = [b.piece_of(shard_rank) for b in zp.buckets.buckets]
    return {
        **phases,
        "to_host_copies": link.to_host_copies,
        "to_device_copies": link.to_device_copies,
        "units": len(step_units(zp, shard_rank)),
        "kept_tensors": len(kept_tensors(zp, shard_rank)),
        "bucket_pieces": sum(p is not None and p.shard_span.numel > 0 for p in pieces),
        "kept_blocks": sum(b == -1 for s in zp.partition.spaces for b in gather_release(zp, s.index)),
    }
