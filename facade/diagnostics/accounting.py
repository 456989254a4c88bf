"""Bytes this rank holds, measured from its live tensors, for comparison with ``memory_report``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from zeroplan.facade.runtime.installed import Installed

__all__ = ["MeasuredMemory", "measure"]


class MeasuredMemory(NamedTuple):
    """Bytes this rank holds, measured from its tensors (compare with ``memory_report``)."""

    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (a view adds nothing to its base)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure(installed: Installed, params: Sequence[torch.Tensor]) -> MeasuredMemory:
    """What ``installed`` and the frozen ``params`` hold now (``buffer_bytes``: the staging arena)."""
    managed = installed.zp.trainable_indices
    frozen = sum(_nbytes(p) for i, p in enumerate(params) if i not in managed)
    state = sum(
        _nbytes(value)
        for entry in installed.inner.optimizer.state.values()
        for value in entry.values()
        if torch.is_tensor(value)
    )
    buffers = installed.buffers
    return MeasuredMemory(
        params_bytes=sum(b.param_bytes for b in buffers) + frozen,
        grads_bytes=_storage_bytes([t for b in buffers for t in (b.grads, b.grad_shard) if t is not None]),
        master_bytes=sum(_nbytes(b.master_copy) for b in buffers if b.carries_master),
        optimizer_state_bytes=state,
        buffer_bytes=installed.sync.staging_bytes,
    )
