"""DTensor parameters as the plain local tensors zeroplan shards ([Note: tensor-parallel parameters]).

Takes: the user's parameters (``DTensor`` ones placed by torch's tensor parallel on ``mesh["tp"]``);
gives: each one's local tensor (what buffers, masters and gathers work on: its ``.data`` becomes a
view of a flat buffer like a plain parameter's), its placement for the planner, and the hand-over of
its gradient into the local tensor's ``.grad`` in the parameter's own placement.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from zeroplan.core import MeshPlacement, ParamSpec, Replicate, Shard, chunk_rows, tensor_split

__all__ = [
    "dcp_refusal",
    "dtensor_class",
    "global_place",
    "is_dtensor",
    "local_source",
    "local_tensor",
    "placement_of",
    "placement_problem",
    "take_gradient",
    "tensor_slice_of",
]


@functools.cache
def dtensor_class() -> type | None:
    """torch's ``DTensor`` class (``None`` in a torch without public DTensors)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a tensor-parallel parameter)."""
    if type(tensor) is torch.Tensor:  # the usual case, asked per saved tensor at stage 3
        return False
    cls = dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor ``param`` (a ``DTensor``) holds on this rank: the object itself, not a view, so
    rebinding its ``.data`` rebinds what the DTensor computes with.

    ``to_local()`` gives another Python object for an ``nn.Parameter`` DTensor (a view, or a fresh
    wrapper of the same storage), whose ``.data`` rebinding the DTensor would never see; the
    attribute is what FSDP2 and torchtitan read too.
    """
    return param._local_tensor  # torch keeps no public handle on the object itself


def local_source(param: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """What ``param.copy_(source)`` writes into ``param``'s (a ``DTensor``'s) local tensor: a DTensor
    ``source`` brought to ``param``'s placement and taken local; anything else as it is."""
    if not is_dtensor(source):
        return source
    if tuple(source.placements) != tuple(param.placements):
        source = source.redistribute(param.device_mesh, param.placements)
    return source.to_local()


def placement_problem(param: torch.Tensor, mesh: Any) -> str | None:
    """What keeps zeroplan from sharding ``param`` (a ``DTensor``) over data parallelism, or ``None``.

    It must live on ``mesh`` (the optimizer's ``mesh["tp"]``) and be ``Shard(d)`` or ``Replicate()``
    there: a ``Partial`` parameter holds no values of its own, and a strided shard's local tensor is
    no contiguous slice of the global one.
    """
    if mesh is None:
        return (
            "a DTensor parameter needs ZeroOptimizer(..., device_mesh=mesh) with a 'tp' dimension, the "
            "mesh its placements are on (mesh['tp']); with process_group= zeroplan cannot know how the "
            "local tensors relate"
        )
    if param.device_mesh != mesh:
        return (
            f"the parameter is placed on mesh {param.device_mesh}, not on the optimizer mesh's 'tp' "
            f"dimension {mesh}: parallelize the module over device_mesh['tp']"
        )
    for p in param.placements:
        if p.is_partial():
            return f"placement {p} is Partial: a parameter must hold values (Shard(d) or Replicate())"
        if not (p.is_replicate() or type(p).__name__ == "Shard"):
            return f"placement {p} ({type(p).__name__}) is not supported: use Shard(d) or Replicate()"
    return None


def placement_of(param: torch.Tensor) -> MeshPlacement:
    """``param``'s placement (a ``DTensor``'s, already checked by :func:`placement_problem`) for its spec."""
    names = param.device_mesh.mesh_dim_names or ()
    return tuple(
        (name, Shard(p.dim) if p.is_shard() else Replicate())
        for name, p in zip(names, param.placements, strict=True)
    )


def take_gradient(owner: torch.Tensor, local: torch.Tensor) -> None:
    """Move ``owner``'s gradient (a ``DTensor``) into ``local.grad``, in ``owner``'s placement.

    A gradient autograd gives in another placement (``Partial`` over ``tp`` from a sequence-parallel
    norm, ``Replicate`` for a sharded parameter) is redistributed first: summed over ``tp`` once, or
    sliced. It is added to what ``local.grad`` holds (gradient accumulation, stage 1's views), as
    autograd would add it; ``owner.grad`` is released.
    """
    grad = owner.grad
    if grad is None:
        return
    owner.grad = None
    if tuple(grad.placements) != tuple(owner.placements):
        grad = grad.redistribute(owner.device_mesh, owner.placements)
    with torch.no_grad():
        mine = grad.to_local()
        if local.grad is None:
            local.grad = mine if mine.is_contiguous() else mine.contiguous()
        else:
            local.grad.add_(mine)


def dcp_refusal(spec: ParamSpec) -> str | None:
    """Why DCP may not save or load ``spec``'s pieces in ``checkpoint.interchange``'s model dict, or
    ``None``.

    A tp-split parameter's masters there are pieces of its local tensor; the model's own DTensors
    (torch's ``get_model_state_dict``) are what DCP saves of a tensor-parallel model (the optimizer's
    pieces carry global coordinates: :func:`global_place`). Replicas save as they are.
    """
    if tensor_split(spec) is None:
        return None
    return (
        f"parameter {spec.name!r} is split over tp ({spec.placement}): interchange.model_state_dict does not "
        "take tensor-parallel parameters; save the model with torch's get_model_state_dict (its DTensors) "
        "and the optimizer with get_optimizer_state_dict"
    )


def tensor_slice_of(mesh: Any) -> tuple[int, int]:
    """This rank's position on ``mesh`` (the optimizer mesh's ``tp`` dimension) and its size;
    ``(0, 1)`` without one."""
    return (0, 1) if mesh is None else (mesh.get_local_rank(), mesh.size())


def global_place(spec: ParamSpec, tensor_slice: tuple[int, int]) -> dict[str, tuple[int, ...]]:
    """``FlatPieces``' ``whole`` and ``origin`` for ``spec`` on tp position ``tensor_slice``: where its
    local tensor lies in the global one (nothing for a replica), so DCP sees global coordinates."""
    d = tensor_split(spec)
    if d is None or spec.global_shape is None:
        return {}
    origin = [0] * len(spec.shape)
    origin[d] = chunk_rows(spec.global_shape[d], *tensor_slice).start
    return {"whole": tuple(spec.global_shape), "origin": tuple(origin)}
