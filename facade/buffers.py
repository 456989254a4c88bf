"""Flat buffers laid out by the plan; parameters become views into them.

[Note: flat buffers]
For every dtype space of the plan this rank allocates:

* ``params`` — the full rank-major parameter buffer; each trainable parameter's
  ``.data`` becomes a view of it (no second full copy);
* ``grads`` — stage 1 only: the full gradient buffer, parameter ``.grad`` views;
* ``grad_shard`` — this rank's reduced gradients: at stage 1 its region of
  ``grads`` (reduced in place), otherwise ``shard_numel`` elements of
  ``grad_shard_dtype`` (fp32 for bf16/fp16 parameters);
* ``master`` — what the inner optimizer steps: an fp32 copy of this rank's
  region for bf16/fp16 parameters, or the region of ``params`` itself when the
  parameters already have the master dtype (no copy).

All offsets come from the plan; nothing here computes a layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from zeroplan.core import Space, Stage, ZeroPlan, grad_shard_dtype, master_dtype
from zeroplan.facade.state_tree import torch_dtype

__all__ = ["SpaceBuffers", "build_buffers", "param_views"]


class SpaceBuffers(NamedTuple):
    """This rank's buffers of one dtype space (see [Note: flat buffers])."""

    space: Space
    params: torch.Tensor
    grads: torch.Tensor | None
    grad_shard: torch.Tensor
    master: torch.Tensor
    owned: int

    @property
    def separate_master(self) -> bool:
        """Whether ``master`` is its own fp32 tensor (bf16/fp16 parameters)."""
        return self.master.dtype != self.params.dtype

    def region(self, shard_rank: int) -> torch.Tensor:
        """This rank's region of the full parameter buffer."""
        return self.params[self.space.region(shard_rank).as_slice()]


def param_views(flat: torch.Tensor, space: Space, params: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per parameter index of ``space``, its view of the full buffer ``flat``, shaped like the parameter."""
    return {
        index: flat[start : start + params[index].numel()].view(params[index].shape)
        for index, start in zip(space.params, space.buffer_offsets, strict=True)
    }


def build_buffers(
    zp: ZeroPlan, params: Sequence[torch.Tensor], shard_rank: int, device: torch.device
) -> tuple[SpaceBuffers, ...]:
    """Allocate this rank's buffers, copy parameter values in, make parameters views.

    The values of every parameter are unchanged; only their storage moves.
    """
    result = []
    for space in zp.partition.spaces:
        dtype = torch_dtype(space.dtype)
        full = torch.empty(space.numel, dtype=dtype, device=device)
        views = param_views(full, space, params)
        for index, view in views.items():
            view.copy_(params[index].detach())
        grads = None
        if zp.stage is Stage.OPTIMIZER:
            grads = torch.zeros(space.numel, dtype=dtype, device=device)
        grad_views = param_views(grads, space, params) if grads is not None else {}
        for index, view in views.items():
            param = params[index]
            previous = param.grad
            param.data = view
            if grads is not None:
                param.grad = grad_views[index]
                if previous is not None:
                    param.grad.copy_(previous)
        region = full[space.region(shard_rank).as_slice()]
        owned = space.owned[shard_rank]
        shard_numel = space.shard_numel[shard_rank]
        if grads is not None:
            grad_shard = grads[space.region(shard_rank).as_slice()]
        else:
            grad_shard = torch.zeros(
                shard_numel, dtype=torch_dtype(grad_shard_dtype(zp, space)), device=device
            )
        if master_dtype(space.dtype) == space.dtype:
            master = region
        else:
            master = torch.zeros(shard_numel, dtype=torch_dtype(master_dtype(space.dtype)), device=device)
            master[:owned].copy_(region)
        result.append(
            SpaceBuffers(
                space=space, params=full, grads=grads, grad_shard=grad_shard, master=master, owned=owned
            )
        )
    return tuple(result)
