"""Stage 3's saved-tensor hooks: tensors autograd saves from a block's buffer, and bringing them back.

Inside the attached forward, ``ShardedParams`` opens ``torch.autograd.graph.saved_tensors_hooks``
with :func:`pack` and :func:`unpack`. A saved tensor that views a block's buffer is packed as a
:class:`SavedView`, which the block counts among its expected holders (so freeing it is not taken
for someone else's use); in backward, unpacking it asks its owner to gather the block again first
([Note: stage 3], [Note: several sharded domains] in ``params.sharded``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from zeroplan.facade.params.blocks import BlockEntry
from zeroplan.facade.params.local_shards import is_dtensor, local_tensor

__all__ = ["SavedView", "ViewsBlocks", "pack", "unpack"]


class ViewsBlocks(Protocol):
    """A residency whose blocks saved tensors may view (``ShardedParams``)."""

    def view_of(self, tensor: torch.Tensor, storage: int, *, own: bool) -> SavedView | None:
        """A saved view of ``tensor`` if it views one of its blocks (``own``: its own forward saves it)."""

    def bring_back(self, packed: SavedView) -> torch.Tensor:
        """Gather the block of ``packed`` and return its tensor."""


class SavedView:
    """A tensor autograd saved from a stage-3 block's buffer, and that block.

    While it lives its tensor is one of the block's expected holders
    (``BlockEntry.saved``: per tensor, how many saved views hold it), unless it
    is a parameter itself (which the block counts already).
    """

    __slots__ = ("entry", "key", "owner", "tensor")

    def __init__(self, tensor: torch.Tensor, entry: BlockEntry, owner: ViewsBlocks) -> None:
        self.tensor = tensor
        self.key = entry.key
        self.entry = entry
        self.owner = owner
        # A parameter is counted among the members already (an unknown one viewing the block would be
        # left uncounted: then the block moves rather than frees, the safe side).
        # A plain tensor first: ``isinstance`` on ``Parameter`` runs its metaclass's Python check.
        if type(tensor) is torch.Tensor or not isinstance(tensor, torch.nn.Parameter):
            entry.saved[id(tensor)] = entry.saved.get(id(tensor), 0) + 1

    def __del__(self) -> None:
        left = self.entry.saved.get(id(self.tensor), 0) - 1
        if left > 0:
            self.entry.saved[id(self.tensor)] = left
        else:
            self.entry.saved.pop(id(self.tensor), None)


def pack(owner: ViewsBlocks, peers: Sequence[ViewsBlocks], tensor: torch.Tensor) -> Any:
    """What autograd keeps of ``tensor``: a :class:`SavedView` if it views a block of ``owner``, or of
    one of its ``peers`` while their forward is open ([Note: several sharded domains]); else itself."""
    if tensor.layout is not torch.strided or tensor.is_meta:
        return tensor  # sparse and meta tensors never view a block
    # A DTensor's values are its local tensor's ([Note: deferred DTensor parameters] in ``params.gather``).
    placed = type(tensor) is not torch.Tensor and is_dtensor(tensor)  # no call for a plain tensor
    storage = (local_tensor(tensor) if placed else tensor).untyped_storage()._cdata
    view = owner.view_of(tensor, storage, own=True)
    if view is not None:
        return view
    if len(peers) > 1:  # the owner alone has no peer to ask
        for peer in peers:
            view = peer.view_of(tensor, storage, own=False) if peer is not owner else None
            if view is not None:
                return view
    return tensor


def unpack(packed: Any) -> torch.Tensor:
    """The tensor autograd saved, its block gathered again first if it was a :class:`SavedView`."""
    if not isinstance(packed, SavedView):
        return packed
    return packed.owner.bring_back(packed)
