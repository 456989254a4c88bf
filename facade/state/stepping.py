"""Where the inner optimizer steps: on the device, all at once, or on the host, bucket by bucket.

Chosen once per plan (:func:`stepping_for`): :class:`DeviceStep` when the masters live on the
parameters' device (the default), :class:`HostStep` when the plan places them in host memory
(CPU offload, [Note: offload, executed] in ``zeroplan.core.host_step``). The lifecycle asks the
chosen one to wait for the gradients (:meth:`HostStep.landed`) and to step
(:meth:`HostStep.step`), which for the host also sends each unit's values back to the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from zeroplan.core import StepUnit, ZeroPlan, kept_unit, publishes_via_host_cast, step_units
from zeroplan.facade.mechanisms.collectives import join_side_stream, on_side_stream, wait_on_host
from zeroplan.facade.params.buffers import SpaceBuffers
from zeroplan.facade.state.inner import Inner

__all__ = ["DeviceStep", "HostStep", "Stepping", "stepping_for"]


class Stepping(Protocol):
    """How a domain's inner optimizer steps (see the module docstring)."""

    #: Whether :meth:`step` also wrote the updated values into the parameters (their shard).
    publishes: bool

    def landed(self) -> None:
        """Before the step reads a gradient: wait until the reduced gradients are where it reads them."""

    def step(self, inner: Inner, kwargs: dict[str, Any], release: Callable[[int], None]) -> None:
        """Step the inner optimizer over every tensor with a gradient; ``release(b)`` tells the
        residency every unit up to bucket ``b``'s is back where the parameters live."""


class DeviceStep:
    """The inner optimizer steps every tensor by one call, where the parameters live."""

    publishes = False

    def landed(self) -> None:
        """Nothing: the gradient shard is on the device, after the stream join of the reduction."""

    def step(self, inner: Inner, kwargs: dict[str, Any], release: Callable[[int], None]) -> None:
        """One call of the inner optimizer; the residency publishes the masters afterwards."""
        del release
        inner.optimizer.step(**kwargs)


class _HostUnit(NamedTuple):
    """One unit of a host step: its tensors, and its values' way back (views built once)."""

    bucket: int
    tensors: tuple[int, ...]
    sources: list[torch.Tensor]  # the unit's masters
    rooms: list[torch.Tensor]  # the cast of them on the host, in the unit's own gradient elements
    targets: list[torch.Tensor]  # where they go: the full parameter buffer, or the parameter shard


class HostStep:
    """The inner optimizer steps in host memory, unit by unit ([Note: offload, executed]).

    After each unit, its updated values are copied to where the parameters live
    (asynchronously, on the side stream, from pinned memory beside a GPU) while
    the CPU steps the next one; the compute stream waits for the copies once, at
    the end. A partial offload's kept part ([Note: kept on the device]) is
    stepped first, by one call on the device (queued there: the CPU goes on with
    the units), its values cast into the parameters there and its gathers
    released before the first unit.
    """

    publishes = True

    def __init__(
        self, zp: ZeroPlan, buffers: Sequence[SpaceBuffers], shard_rank: int, device: torch.device
    ) -> None:
        self._device = device
        tensors = zp.inner_tensors(shard_rank)
        kept = kept_unit(zp, shard_rank, tensors)
        self._kept = None if kept is None else _unit(zp, buffers, kept, on_host=False)
        self._units = [_unit(zp, buffers, unit) for unit in step_units(zp, shard_rank, tensors)]

    def landed(self) -> None:
        """The host waits for the gradients' copies into host memory (one synchronisation per step)."""
        wait_on_host(self._device)

    def step(self, inner: Inner, kwargs: dict[str, Any], release: Callable[[int], None]) -> None:
        """Step unit by unit, each unit's values sent back while the next steps (``release`` starts
        the gathers they complete); the parameters' stream waits for the last copy before anything
        reads them."""
        tensors = inner.tensors
        grads = [t.grad for t in tensors]
        for t in tensors:
            t.grad = None
        try:
            if self._kept is not None:  # [Note: kept on the device]: queued on the device first
                for i in self._kept.tensors:
                    tensors[i].grad = grads[i]
                inner.optimizer.step(**kwargs)
                for i in self._kept.tensors:
                    tensors[i].grad = None
                torch._foreach_copy_(self._kept.targets, self._kept.sources)  # cast there
            release(-1)  # blocks every rank keeps on the device
            for unit in self._units:
                release(unit.bucket - 1)  # what the units of other ranks completed meanwhile
                for i in unit.tensors:
                    tensors[i].grad = grads[i]
                inner.optimizer.step(**kwargs)
                for i in unit.tensors:
                    tensors[i].grad = None
                up = unit.sources
                if unit.rooms:
                    torch._foreach_copy_(unit.rooms, unit.sources)  # the cast, on the CPU
                    up = unit.rooms
                with on_side_stream(self._device):
                    torch._foreach_copy_(unit.targets, up, non_blocking=True)
                release(unit.bucket)
        finally:
            for t, g in zip(tensors, grads, strict=True):
                t.grad = g
        join_side_stream(self._device)


def _unit(
    zp: ZeroPlan, buffers: Sequence[SpaceBuffers], unit: StepUnit, *, on_host: bool = True
) -> _HostUnit:
    """The views ``unit`` steps and copies, built once. A unit in host memory casts bf16/fp16 values
    on the host before they travel; the kept unit casts them on the device, in the copy."""
    sources, rooms, targets = [], [], []
    for copy in unit.copies:
        buf = buffers[copy.space]
        source = buf.master_window(copy.shard_span)
        sources.append(source)
        target = buf.param_target[copy.target_span.as_slice()]
        targets.append(target)
        if on_host and publishes_via_host_cast(zp, copy.space):
            # The unit's gradients are consumed once it stepped: half their bytes take the cast.
            room = buf.grad_window(copy.shard_span).view(target.dtype)[: copy.shard_span.numel]
            rooms.append(room)
    if rooms and len(rooms) != len(sources):
        raise RuntimeError("a unit's copies mix spaces with and without a host cast")
    return _HostUnit(unit.bucket, unit.tensors, sources, rooms, targets)


def stepping_for(
    zp: ZeroPlan, buffers: Sequence[SpaceBuffers], shard_rank: int, device: torch.device
) -> Stepping:
    """The stepping ``zp`` asks for: on the host where it places the masters there."""
    if zp.steps_on_host:
        return HostStep(zp, buffers, shard_rank, device)
    return DeviceStep()
