"""Bytes this rank holds, measured from its live tensors, for comparison with ``memory_report``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from zeroplan.core import BufferRole, Residence, Stage, kept_tensors
from zeroplan.facade.runtime.installed import Installed

__all__ = ["MeasuredMemory", "measure", "measure_residences"]


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
        grads_bytes=_storage_bytes(
            [t for b in buffers for t in (b.grads, b.grad_shard, b.kept_grad) if t is not None]
        ),
        master_bytes=sum(_nbytes(b.master) + _nbytes(b.kept_master) for b in buffers if b.owns_master),
        optimizer_state_bytes=state,
        buffer_bytes=installed.sync.staging_bytes,
    )


def measure_residences(installed: Installed, params: Sequence[torch.Tensor]) -> dict[Residence, int]:
    """The bytes :func:`measure` counts, split by where the plan places each buffer's role
    ([Note: residences]): host memory and the device counted apart, also on the CPU, where they
    are one memory. Frozen parameters live on the device."""
    where = installed.zp.residences.of
    held = measure(installed, params)
    sharded = installed.zp.stage is Stage.PARAMETERS
    out = dict.fromkeys(Residence, 0)
    buffers = installed.buffers
    managed = sum(b.param_bytes for b in buffers)
    out[where(BufferRole.PARAM_SHARD if sharded else BufferRole.FULL_PARAMS)] += managed
    out[Residence.DEVICE] += held.params_bytes - managed  # frozen parameters stay where they are
    full_grads = _storage_bytes([b.grads for b in buffers if b.grads is not None])
    out[where(BufferRole.FULL_GRADS)] += full_grads
    # A partial offload's kept part lives on the device ([Note: kept on the device]).
    kept_grads = sum(_nbytes(b.kept_grad) for b in buffers)
    kept_masters = sum(_nbytes(b.kept_master) for b in buffers)
    inner = installed.inner
    kept_state = sum(
        _nbytes(value)
        for i in kept_tensors(installed.zp, installed.groups.shard_rank, inner.specs)
        for value in inner.optimizer.state.get(inner.tensors[i], {}).values()
        if torch.is_tensor(value)
    )
    out[Residence.DEVICE] += kept_grads + kept_masters + kept_state
    out[where(BufferRole.GRAD_SHARD)] += held.grads_bytes - full_grads - kept_grads
    out[where(BufferRole.MASTER)] += held.master_bytes - kept_masters
    out[where(BufferRole.OPTIMIZER_STATE)] += held.optimizer_state_bytes - kept_state
    out[where(BufferRole.STAGING)] += held.buffer_bytes
    return out
