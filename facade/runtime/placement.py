"""Where a buffer role is allocated: the plan's residence of it, made a torch device.

The plan says where each buffer role lives, on the parameters' device or in
host memory ([Note: residences] in ``zeroplan.core.residence``); this is the one
place that turns that into a ``torch.device`` (and pinned memory, for host
memory beside a CUDA device). Every allocation of a planned buffer goes through
:func:`placement`; streams and collectives keep using the parameters' device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zeroplan.core import BufferRole, Residence, ZeroPlan

__all__ = ["Placement", "placed", "placement"]


class Placement(NamedTuple):
    """Where a tensor is allocated: ``torch.empty(..., device=device, pin_memory=pin_memory)``."""

    device: torch.device
    pin_memory: bool = False

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` zeros of ``dtype`` here."""
        return torch.zeros(numel, dtype=dtype, device=self.device, pin_memory=self.pin_memory)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` uninitialised elements of ``dtype`` here."""
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pin_memory)


def placement(residence: Residence, device: torch.device) -> Placement:
    """Where a buffer of ``residence`` is allocated beside parameters on ``device``.

    ``DEVICE`` is ``device``; ``HOST`` is the CPU, pinned when ``device`` is CUDA
    (so copies to and from it can run asynchronously), the same memory as
    ``DEVICE`` when the parameters are on the CPU (or a device without pinning).

    Example:
        >>> placement(Residence.HOST, torch.device("cpu"))
        Placement(device=device(type='cpu'), pin_memory=False)
        >>> placement(Residence.DEVICE, torch.device("meta")).device
        device(type='meta')
    """
    if residence is Residence.DEVICE or device.type == "cpu":
        return Placement(device)
    return Placement(torch.device("cpu"), pin_memory=device.type == "cuda")


def placed(zp: ZeroPlan, role: BufferRole, device: torch.device) -> Placement:
    """Where ``zp`` allocates ``role`` beside parameters on ``device``."""
    return placement(zp.residences.of(role), device)
