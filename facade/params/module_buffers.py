"""Module buffers kept identical across ranks, as DDP's ``broadcast_buffers=True`` did.

[Note: module buffers]
``ZeroOptimizer`` replaces DDP for parameters and gradients, not for buffers:
a module's buffers (BatchNorm's ``running_mean``, ``running_var`` and
``num_batches_tracked``, or any state a forward pass updates) are updated by
each rank from its own batch and drift apart. DDP, with its default
``broadcast_buffers=True``, copies rank 0's buffers to every rank at the start
of each forward pass in training, so every rank computes with rank 0's
statistics and saves them. :func:`broadcast_buffers` does that copy; call it
where DDP did, before each training forward pass (``ZeroTrainer`` does so
unless ``TrainingArguments.ddp_broadcast_buffers`` is ``False``), or at least
before evaluating and saving, so that every rank holds the same model.
Models without buffers, and buffers no forward pass changes, need nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zeroplan.facade.mechanisms.collectives import broadcast

__all__ = ["broadcast_buffers"]


@torch.no_grad()
def broadcast_buffers(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Copy every buffer of ``module`` from the first rank of ``group`` to all its ranks (collective).

    What DDP's ``broadcast_buffers=True`` does before each forward pass (see
    [Note: module buffers]): one broadcast per buffer dtype, in place. Every
    rank of ``group`` must call it with the same module structure.

    Args:
        module: the model; all its buffers, persistent or not, are copied.
        group: the data-parallel group (default: the default group).

    Example::

        for batch in loader:
            broadcast_buffers(model)          # BatchNorm statistics of rank 0 everywhere
            opt.backward(loss_fn(model(batch)))
            opt.step(); opt.zero_grad()
    """
    buffers = [b for b in module.buffers() if b.numel()]
    if not buffers or dist.get_world_size(group) == 1:
        return
    by_kind: dict[tuple[str, str], list[torch.Tensor]] = {}
    for b in buffers:
        by_kind.setdefault((str(b.dtype), b.device.type), []).append(b)
    for key in sorted(by_kind):  # the same order on every rank
        members = by_kind[key]
        flat = torch.cat([b.reshape(-1) for b in members])
        wire = flat.view(torch.uint8) if flat.dtype is torch.bool else flat  # gloo has no bool
        broadcast(wire, 0, group)  # retired safely: [Note: retiring a collective]
        offset = 0
        for b in members:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
