"""Gather policies: how a space's updated pieces become every rank's full parameters.

[Note: gather policy]
A plan gathers parameters one of two ways (``ZeroPlan.gather``, a
:class:`~zeroplan.core.GatherKind`), each one policy here, chosen once by
:func:`~zeroplan.facade.mechanisms.policies.gather_for`: :class:`PlainGather`
moves the values as they are, :class:`EncodedGather` encodes each rank's piece
in the parameter wire format and every rank decodes every piece, the owner
its own too ([Note: wire formats]). ``params.gather`` (stages 1-2) and
``params.blocks`` / ``params.sharded`` (stage 3) ask the policy, never the
plan, whether and how pieces are encoded; gradients (``averaged_gradients``)
are always gathered plain.

[Note: parameter path]
From the updated shard to every rank's parameters, in four facade modules
(``params.gather`` or ``params.sharded``/``params.blocks`` -> ``gathering`` ->
``collectives``, in ``params.buffers``' buffers):

- Stages 1-2: ``params.gather.ParamGather.start_param_sync`` (after the
  step) publishes each space's master into its flat buffer
  (``FlatBuffers.publish_master``) and starts each gather block in buffer
  order (``Gather.start_block`` -> ``collectives.start_block_gather``, or
  ``start_encoded_block_gather``, encoding and decoding by ``wire_codec``);
  a host step (CPU offload) has published its units and started the blocks
  they completed already (``ParamGather.start_released``). The ``Pending`` handles wait in
  ``ParamGather._pending`` until the first read of a block's parameter (its
  ``__torch_function__`` hook, ``ParamGather.wait_for``) or
  ``finish_param_sync``; a user's write is then kept through
  ``FlatBuffers.keep_param_writes(Gather.published(...))``.
- Stage 3: ``params.module_hooks.ForwardHooks`` (a module's pre-forward, or
  ``params.sharded.ShardedParams.gradient_arrived`` in backward) calls
  ``params.blocks.Blocks.ensure``/``prefetch`` -> ``BlockTable.start_gather``,
  which writes this rank's piece into the block buffer
  (``BlockBuffers.write_piece``) and calls ``Gather.start_block`` (as above);
  ``ensure`` finishes the ``Pending`` handles, ``free`` drops the block after
  its modules ran. ``ShardedParams`` loads a shard with
  ``Gather.published(...)``; a trace's ``TracedBlocks`` sizes the gather's
  extra room with ``Gather.room``.

Takes: a full buffer (or block buffer) whose piece of this rank holds its
values. Gives: the :class:`~zeroplan.facade.mechanisms.collectives.Pending`
handles whose completion leaves every piece in place (decoded).
"""

from __future__ import annotations

from typing import Protocol

import torch

from zeroplan.core import Block, Space, ZeroPlan
from zeroplan.core.wire import GatherRoom, WireCodec
from zeroplan.facade.mechanisms.collectives import (
    CommLog,
    Pending,
    start_block_gather,
    start_encoded_block_gather,
)
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.mechanisms.wire_codec import PublishedPieces

__all__ = ["EncodedGather", "Gather", "PlainGather"]


class Gather(Protocol):
    """How a plan gathers updated parameters ([Note: gather policy]); one object per installed plan."""

    def published(self, space: Space, shard_rank: int) -> PublishedPieces | None:
        """How ``space``'s pieces of shard rank ``shard_rank`` travel: ``None`` as they are."""

    def room(self, space: Space, block: Block) -> GatherRoom | None:
        """The room a gather of ``space``'s ``block`` holds besides the block (``None``: none)."""

    def start_block(
        self, full: torch.Tensor, space: Space, block: Block, groups: ProcessGroups, log: CommLog
    ) -> list[Pending]:
        """Start the gather of ``space``'s ``block`` in ``full``; this rank's piece holds its values."""

    def start_space(
        self, full: torch.Tensor, space: Space, groups: ProcessGroups, log: CommLog
    ) -> dict[int, list[Pending]]:
        """Start the gathers of every block of ``full`` (``space``'s full buffer), in buffer order;
        per block index, its collectives (blocks that needed none are left out)."""


class PlainGather:
    """Pieces travel as they are ([Note: gather policy])."""

    def __init__(self, zp: ZeroPlan) -> None:
        self._zp = zp

    def published(self, space: Space, shard_rank: int) -> PublishedPieces | None:
        """``None``: every rank holds the values the owner sent."""
        del space, shard_rank
        return None

    def room(self, space: Space, block: Block) -> GatherRoom | None:
        """``None``: the gather moves the block itself."""
        del space, block
        return None

    def start_block(
        self, full: torch.Tensor, space: Space, block: Block, groups: ProcessGroups, log: CommLog
    ) -> list[Pending]:
        """The block's collectives on ``full`` itself."""
        del space
        return start_block_gather(full, block, self._zp, groups, log)

    def start_space(
        self, full: torch.Tensor, space: Space, groups: ProcessGroups, log: CommLog
    ) -> dict[int, list[Pending]]:
        """Each block's :meth:`start_block`, in buffer order ([Note: gather blocks] in core.planner)."""
        started = {}
        for k, block in enumerate(self._zp.gather_blocks(space)):
            pending = self.start_block(full, space, block, groups, log)
            if pending:
                started[k] = pending
        return started


class EncodedGather(PlainGather):
    """Pieces travel in the plan's parameter wire format ([Note: wire formats])."""

    def __init__(self, zp: ZeroPlan) -> None:
        super().__init__(zp)
        codec = zp.param_wire
        if codec is None:
            raise ValueError("an encoded gather needs a plan with a parameter wire format")
        self._codec: WireCodec = codec

    def published(self, space: Space, shard_rank: int) -> PublishedPieces | None:
        """Each gather block's piece of ``shard_rank``, encoded on its own."""
        blocks = self._zp.gather_blocks(space)
        return PublishedPieces(
            self._codec, tuple(b.piece(shard_rank) for b in blocks if b.pieces[shard_rank])
        )

    def room(self, space: Space, block: Block) -> GatherRoom | None:
        """The encoded slots, scales and scratch the plan gives the block's gather."""
        return self._zp.gather_room(space, block)

    def start_block(
        self, full: torch.Tensor, space: Space, block: Block, groups: ProcessGroups, log: CommLog
    ) -> list[Pending]:
        """Encode this rank's piece, gather the slots, decode every piece on completion."""
        room = self._zp.gather_room(space, block)
        if room is None:  # nothing gathered (a shard group of one)
            return []
        return start_encoded_block_gather(full, block, room, self._codec, self._zp, groups, log)
