"""Flat buffers laid out by the plan; parameters become views into them.

[Note: flat buffers]
For every dtype space of the plan this rank allocates:

* ``params`` — the full parameter buffer (``buffer_numel`` elements, padding
  included, zero); each trainable parameter's ``.data`` becomes a view of it
  (no second full copy);
* ``grads`` — stage 1 only: the full gradient buffer, parameter ``.grad`` views;
* ``grad_shard`` — this rank's reduced gradients: at stage 1 with a rank-major
  layout its region of ``grads`` (reduced in place), otherwise ``shard_numel``
  elements of ``grad_shard_dtype`` (fp32 for bf16/fp16 parameters);
* ``master`` — what the inner optimizer steps: the region of ``params`` itself
  when the parameters have the master dtype and the layout is rank-major (no
  copy), otherwise a tensor of its own (fp32 copies of bf16/fp16 parameters,
  or the shard of an interleaved layout, whose pieces are not contiguous in
  ``params``, see [Note: layout]).

The rank's shard in the full buffer is its *pieces*; :func:`read_pieces` and
:func:`write_pieces` move a flat shard out of and into them. All offsets come
from the plan; nothing here computes a layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from zeroplan.core import Space, Stage, ZeroPlan, grad_shard_dtype, master_dtype
from zeroplan.facade.state_tree import torch_dtype

__all__ = ["SpaceBuffers", "build_buffers", "param_views", "read_pieces", "write_pieces"]


class SpaceBuffers(NamedTuple):
    """This rank's buffers of one dtype space (see [Note: flat buffers]).

    ``extent`` is the length of the rank's shard in the full buffer (its
    pieces, padding included): ``master[:extent]`` and ``grad_shard[:extent]``
    hold everything the rank steps, the rest is allocation padding.
    """

    space: Space
    params: torch.Tensor
    grads: torch.Tensor | None
    grad_shard: torch.Tensor
    master: torch.Tensor
    extent: int
    shard_rank: int

    @property
    def carries_master(self) -> bool:
        """Whether the master holds more than the parameters (fp32 copies of bf16/fp16 ones): saved, moved."""
        return self.master.dtype != self.params.dtype

    @property
    def separate_master(self) -> bool:
        """Whether ``master`` is a tensor of its own rather than the rank's region of ``params``."""
        return not (self.space.shard_is_region and self.master.dtype == self.params.dtype)

    def shard_values(self) -> torch.Tensor:
        """The rank's shard of the parameters, flat: a view of its region, or a copy of its pieces."""
        if self.space.shard_is_region:
            return self.params[self.space.region(self.shard_rank).as_slice()]
        out = self.params.new_empty(self.extent)
        read_pieces(self.params, self.space, self.shard_rank, out)
        return out

    def load_master(self) -> None:
        """Copy the rank's shard of the parameters into a separate master."""
        if self.separate_master:
            read_pieces(self.params, self.space, self.shard_rank, self.master)

    def publish_master(self) -> None:
        """Copy a separate master into the rank's pieces of the parameter buffer (cast)."""
        if self.separate_master:
            write_pieces(self.master, self.params, self.space, self.shard_rank)


def read_pieces(full: torch.Tensor, space: Space, shard_rank: int, out: torch.Tensor) -> None:
    """``out[shard span] = full[buffer span]`` for each of the rank's pieces (cast to ``out``'s dtype)."""
    for piece in space.pieces_of(shard_rank):
        out[piece.shard_span.as_slice()].copy_(full[piece.buffer_span.as_slice()])


def write_pieces(flat: torch.Tensor, full: torch.Tensor, space: Space, shard_rank: int) -> None:
    """``full[buffer span] = flat[shard span]`` for each of the rank's pieces (cast to ``full``'s dtype)."""
    for piece in space.pieces_of(shard_rank):
        full[piece.buffer_span.as_slice()].copy_(flat[piece.shard_span.as_slice()])


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
        full = torch.zeros(space.buffer_numel, dtype=dtype, device=device)  # padding stays zero
        views = param_views(full, space, params)
        for index, view in views.items():
            view.copy_(params[index].detach())
        grads = None
        if zp.stage is Stage.OPTIMIZER:
            grads = torch.zeros(space.buffer_numel, dtype=dtype, device=device)
        grad_views = param_views(grads, space, params) if grads is not None else {}
        for index, view in views.items():
            param = params[index]
            previous = param.grad
            param.data = view
            if grads is not None:
                param.grad = grad_views[index]
                if previous is not None:
                    param.grad.copy_(previous)
        shard_numel = space.shard_numel[shard_rank]
        if grads is not None and space.shard_is_region:
            grad_shard = grads[space.region(shard_rank).as_slice()]  # reduced in place
        else:
            grad_shard = torch.zeros(
                shard_numel, dtype=torch_dtype(grad_shard_dtype(zp, space)), device=device
            )
        master_type = torch_dtype(master_dtype(space.dtype))
        if space.shard_is_region and master_type == dtype:
            master = full[space.region(shard_rank).as_slice()]
        else:
            master = torch.zeros(shard_numel, dtype=master_type, device=device)
        buf = SpaceBuffers(
            space=space,
            params=full,
            grads=grads,
            grad_shard=grad_shard,
            master=master,
            extent=space.extent(shard_rank),
            shard_rank=shard_rank,
        )
        buf.load_master()
        result.append(buf)
    return tuple(result)
