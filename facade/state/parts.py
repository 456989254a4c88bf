"""``Shards``: the parts of one domain of a ``ZeroOptimizer`` that state dicts and checkpoints read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from zeroplan.core import ScalerState, ZeroPlan
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.params.buffers import SpaceBuffers
from zeroplan.facade.state.inner import Inner
from zeroplan.facade.state.tree import ParkedParam

__all__ = ["Shards"]


class Shards(NamedTuple):
    """What the state-dict functions read from a ``ZeroOptimizer``."""

    zp: ZeroPlan
    buffers: tuple[SpaceBuffers, ...]
    inner: Inner
    groups: ProcessGroups
    params: tuple[torch.Tensor, ...]
    optimizer_name: str
    param_groups: list[dict[str, Any]]
    scaler: ScalerState | None
    parked: Mapping[int, ParkedParam]
    tensor_slice: tuple[int, int] = (0, 1)
    """This rank's tp position and degree (``(0, 1)`` without tensor parallelism): where its
    tensor-parallel parameters' local tensors lie in the global ones."""
    tensor_group: Any = None
    """The tp group (the optimizer mesh's ``tp`` dimension), ``None`` without one: whole-tensor dicts
    join the slices over it."""

    @property
    def device(self) -> torch.device:
        """Where the parameters and this rank's buffers live (also with no trainable parameter)."""
        return self.params[0].device
