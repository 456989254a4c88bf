"""Where a buffer role is allocated: the plan's residence of it, made a torch device.

The plan says where each buffer role lives, on the parameters' device or in
host memory ([Note: residences] in ``zeroplan.core.residence``); this is the one
place that turns that into a ``torch.device`` (and pinned memory, for host
memory beside a CUDA device). Every allocation of a planned buffer goes through
:func:`buffer_device`; streams and collectives keep using the parameters' device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zeroplan.core import BufferRole, Residence, ZeroPlan

__all__ = ["BufferDevice", "buffer_device", "device_for"]


class BufferDevice(NamedTuple):
    """Where a tensor is allocated: ``torch.empty(..., device=device, pin_memory=pin_memory)``."""

    device: torch.device
    pin_memory: bool = False

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` zeros of ``dtype`` here."""
        return torch.zeros(numel, dtype=dtype, device=self.device, pin_memory=self.pin_memory)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` uninitialised elements of ``dtype`` here."""
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pin_memory)


def buffer_device(residence: Residence, device: torch.device) -> BufferDevice:
    """Where a buffer of ``residence`` is allocated beside parameters on ``device``.

    ``DEVICE`` is ``device``; ``HOST`` is the CPU, pinned when ``device`` is CUDA
    (so copies to and from it can run asynchronously), the same memory as
    ``DEVICE`` when the parameters are on the CPU (or a device without pinning).

    Example:
        >>> buffer_device(Residence.HOST, torch.device("cpu"))
        BufferDevice(device=device(type='cpu'), pin_memory=False)
        >>> buffer_device(Residence.DEVICE, torch.device("meta")).device
        device(type='meta')
    """
    if residence is Residence.DEVICE or device.type == "cpu":
        return BufferDevice(device)
    return BufferDevice(torch.device("cpu"), pin_memory=device.type == "cuda")


def device_for(zp: ZeroPlan, role: BufferRole, device: torch.device) -> BufferDevice:
    """Where ``zp`` allocates ``role`` beside parameters on ``device``."""
    return buffer_device(zp.residences.of(role), device)
