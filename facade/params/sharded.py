"""Stage 3: parameters held as shards, gathered block by block around forward and backward.

This module is the residency ([Note: residency]) and decides when blocks move in backward (gradient
hooks, saved tensors brought back, the end of backward) and at the step; the blocks' states and
moves are ``params.blocks``, the forward's module hooks ``params.module_hooks``, the saved-tensor
hooks ``params.saved_tensors``.

[Note: stage 3]
Between steps a rank holds only its shard of every parameter (``BlockBuffers.shard``);
each block of the plan has a full buffer whose storage is allocated only while
the block is *gathered*, and each parameter is a view of its block's buffer
(stage-3 plans cut blocks at parameter boundaries). A parameter whose block is
not gathered has the class :class:`ShardedParameter`: its shape, dtype and
``.grad`` read as usual, any read of its values raises (it has none), except
inside a forward or backward of the model given to ``ZeroOptimizer.attach``,
where it gathers its block on the spot.

``attach(model)`` registers hooks, nothing else changes in the user's modules:

* a forward pre-hook on every module that holds managed parameters directly
  gathers their blocks (waiting for them) and launches the gather of the next
  block in buffer order (prefetch), so it arrives while the module computes;
* its forward hook frees a block once every module holding one of its
  parameters finished (``reshard_after_forward=True``); a block shared with a
  module that has not run yet (tied weights) stays until it has;
* the root's hooks open and close the forward: blocks still gathered at its
  end are freed (``True``) or kept for backward (``False``: stage-2 memory for
  parameters, one gather per step instead of two; a forward under ``no_grad``
  or ``inference_mode`` has no backward and frees them, so a write after it
  reaches the shards), and while it runs,
  ``saved_tensors_hooks`` mark the tensors autograd saves from a block's buffer.
  In backward, unpacking such a tensor gathers its block again if it was freed
  (and prefetches the block before it); so does the first gradient of a block
  (a block none of whose values backward reads is gathered all the same, as
  FSDP gathers every module before its backward: one gather per block and
  backward, as the plan counts). Once every trainable parameter of a block
  received its gradient, the block is freed; what is still gathered when the
  backward ends (a parameter that got no gradient) is freed then. Forwards run
  inside a backward (activation checkpointing recomputes them) free nothing.
* a module called on its own, outside the root's forward, opens and closes a
  forward of its own.

Freeing never pulls memory from under a reader: a block whose buffer is still
viewed by anyone but its parameters and the tensors autograd saved (a
``model.state_dict()`` kept from ``gathered_params()``, a forward's output
``w.t()``) moves its parameters to new storage and leaves the old to its
holders (``_rehome``). Inside ``gathered_params()`` nothing is freed (a forward
there, for evaluation, keeps every block), and its gathers are not the step's
traffic.

Every rank runs the same forward and backward, so every rank gathers the same
blocks in the same order (the collectives match). A step's traffic is the
plan's when each block is gathered once per forward and, if freed, once per
backward: a module run twice in one forward, or a parameter used outside its
modules after its block was freed, costs an extra gather.

``step()`` frees every block (gathered values would be stale after the
update) and writes updated masters into the shards; the next forward gathers
them. ``gathered_params()`` gathers every block for reading outside a forward
(saving the model, evaluation code that reads weights): collective; with
``writeback=True`` what was written into the parameters inside (loading a
model's weights) goes into the shards and masters before the blocks are freed.

[Note: stage-3 model dicts]
Outside a forward or backward a sharded parameter has no values, but a module's
``state_dict()`` detaches every parameter and ``load_state_dict()`` copies into
it, and torch's ``get_model_state_dict`` / ``set_model_state_dict`` (and so
DCP's model recipe) are those two calls. So there ``param.detach()`` gives the
rank's elements as a ``FlatPieces`` of views of its shard (the parameter's
dtype; DCP writes and reads them in place, as FSDP2's sharded DTensors), and
``param.copy_(source)`` writes the rank's elements from ``source`` (whole, or
pieces that hold them): the masters take the values, the shard their cast. Both
are local: no collective, nothing gathered. Loading in place alone (``dcp.load``
into ``model.state_dict()`` without ``load_state_dict`` after it) changes the
shard but not separate fp32 masters, and the next step would overwrite it:
follow torch's recipe, or use ``checkpoint.interchange``, whose model dict holds
the masters. Inside ``gathered_params()`` the parameters are whole, and so are
their dicts.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from functools import partial

import torch

from zeroplan.core import ConfigError, ParamSpec, ZeroPlan
from zeroplan.facade.mechanisms.collectives import CommLog
from zeroplan.facade.mechanisms.flat_pieces import FlatPieces, flat_values
from zeroplan.facade.params import saved_tensors
from zeroplan.facade.params.blocks import OWNERS, BlockKey, Blocks, BlockState
from zeroplan.facade.params.buffers import BlockBuffers
from zeroplan.facade.params.local_shards import global_place, is_dtensor, local_source, tensor_slice_of
from zeroplan.facade.params.module_hooks import ForwardHooks, in_backward
from zeroplan.facade.params.saved_tensors import SavedView

__all__ = ["Peers", "ShardedParams"]


# [Note: several sharded domains]
# An optimizer with expert groups holds one ``ShardedParams`` per domain (see
# [Note: expert domains]), each attached to the same model. Autograd keeps one
# pair of saved-tensor hooks in force (the innermost ``saved_tensors_hooks``), so
# each instance's pack (``saved_tensors.pack``) also recognises the blocks of its
# *peers*, the other domains' instances of the same optimizer (a ``Peers`` object
# the optimizer's domains share; an instance joins when installed and leaves when
# retired), while their forward is open; the saved view remembers its owner,
# whose ``bring_back`` gathers it in backward. Nothing is global: instances of
# other optimizers, or retired ones whose storage addresses may be reused, are
# never consulted. So two stage-3 optimizers cannot share a model: the
# innermost one's pack would not know the other's blocks, which would be freed
# under backward. ``attach`` refuses a model (or a module of it) that another
# optimizer's instance hooks now (``_ATTACHED``, held weakly, only to ask that).


#: Every ``ShardedParams`` whose hooks are on a model now, held weakly ([Note: several sharded domains]).
_ATTACHED: weakref.WeakSet[ShardedParams] = weakref.WeakSet()

_SHARED_MODEL = (
    "another stage-3 ZeroOptimizer is attached to this model (or to one of its modules) already, and "
    "stage-3 optimizers cannot share a model: autograd keeps only the last one's saved-tensor hooks, so "
    "the other's parameters would be freed under backward. Give every parameter to one ZeroOptimizer "
    "(a param group per setting, e.g. matrices and norms in two groups), or build one of the two at "
    "stage 1 or 2 (which needs no attach)"
)


class Peers:
    """The ``ShardedParams`` of one optimizer's domains (see [Note: several sharded domains])."""

    def __init__(self) -> None:
        self.members: list[ShardedParams] = []


class ShardedParams:
    """The stage-3 parameters of one installed plan (see [Note: stage 3])."""

    def __init__(
        self,
        *,
        zp: ZeroPlan,
        params: Sequence[torch.Tensor],
        blocks: Blocks,
        buffers: Sequence[BlockBuffers],
        shard_rank: int,
        peers: Peers | None = None,
        owners: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """``blocks``: the table of ``buffers``' blocks (``BlockTable``), or a trace's ``TracedBlocks``
        (no buffers: [Note: stage 3 traced]). ``owners``: per parameter, the user's tensor (a
        ``DTensor`` whose local tensor is in ``params``, [Note: deferred DTensor parameters]): its
        gradient arrives there, and its ``detach``/``copy_`` read and write the shard."""
        owners = params if owners is None else owners
        self._buffers = buffers
        self._specs = zp.specs
        self._held = zp.partition.held_fragments(shard_rank)
        self._index = {id(p): i for i, p in enumerate(params)}
        self._index.update((id(o), i) for i, o in enumerate(owners))
        # Under a parameter wire every gathered piece holds decoded values ([Note: wire formats]).
        self._published = [blocks.gather.published(buf.space, shard_rank) for buf in buffers]
        self.reshard_after_forward = zp.options.reshard_after_forward  # [Note: plan options]
        self._blocks = blocks
        for p in self._blocks.members():
            OWNERS.claim(p, self)
        managed = set(zp.trainable_indices)
        # Held weakly, as the gradient sync's hooks: a dropped optimizer must not act on gradients.
        method = weakref.WeakMethod(self.gradient_arrived)
        self._grad_handles = [
            owners[index].register_post_accumulate_grad_hook(partial(_call_weakly, method))
            for index in sorted(managed)
        ]
        self._hold = 0  # gathered_params() blocks: nothing is freed until it exits
        self._hooked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # the attached model's modules
        self._backward_queued = False
        self._peers = Peers()
        self.join(peers if peers is not None else Peers())  # [Note: several sharded domains]
        self._hooks = ForwardHooks(
            self._blocks,
            reshard_after_forward=self.reshard_after_forward,
            may_free=self._may_free,
            begin_pass=self._begin_pass,
            saved_tensor_hooks=self._saved_tensor_hooks,
        )
        self._begin_pass()

    def join(self, peers: Peers) -> None:
        """Recognise the blocks of ``peers`` (the other domains' instances) in saved tensors, and be seen."""
        peers.members.append(self)
        self._peers = peers

    # ------------------------------------------------------- the residency's life
    def settle(self, model: torch.nn.Module | None) -> None:
        """Shard every block (construction leaves them so) and hook ``model`` if one is attached."""
        self.shard_all()
        if model is not None:
            self.attach(model)

    def prepare_replan(self) -> None:
        """Gather every block: the new plan's buffers are filled from the parameters' values."""
        self.finish_param_sync()
        self.gather_all()

    def gathered(self, *, writeback: bool) -> contextlib.AbstractContextManager[None]:
        """Every block gathered inside (see :meth:`all_gathered`)."""
        return self.all_gathered(writeback=writeback)

    def detached(
        self, params: Sequence[torch.Tensor] = (), links: Sequence[tuple[int, int]] = ()
    ) -> int | None:
        """The first parameter whose ``.data`` no longer views its block's buffer (``Installed.detached``)."""
        return self._blocks.detached()

    def _may_free(self) -> bool:
        return self._hold == 0

    def shard_all(self) -> None:
        """Free every block: each rank holds only its shards (after install, and after a step)."""
        self._blocks.shard_all()

    def gather_all(self) -> None:
        """Gather every block (collective)."""
        self._blocks.gather_all()

    def block_gathered(self, key: BlockKey) -> bool:
        """Whether block ``key`` is gathered (for tests and tools)."""
        return self._blocks.block_gathered(key)

    def saved_views(self) -> int:
        """Tensors autograd saved from this instance's blocks, alive now (for tests and tools)."""
        return self._blocks.saved_views()

    def held_bytes(self) -> int:
        """Bytes of block buffers allocated now."""
        return self._blocks.held_bytes()

    # ------------------------------------------------------- the step's calls
    def start_param_sync(self, log: CommLog, *, published: bool = False) -> None:
        """After the inner optimizer stepped: free the (stale) blocks, write masters into the shards
        (unless the step did, ``published``)."""
        del log  # the next forward gathers, into the log of its own step
        self.shard_all()
        for buf in () if published else self._buffers:
            buf.publish_master()

    def start_released(self, bucket: int, log: CommLog) -> None:
        """Nothing: stage 3 gathers each block when a forward first uses it."""
        del bucket, log

    def finish_param_sync(self) -> None:
        """Complete every gather in flight (blocks stay gathered)."""
        self._blocks.finish_gathers()

    def keep_param_writes(self) -> None:
        """Nothing to keep: stage 3 keeps writes made inside ``gathered_params(writeback=True)`` only.

        See [Note: parameter writes]; between steps a stage-3 parameter holds no values of its own.
        """

    def forget(self) -> None:
        """Drop gathers in flight without waiting (the process group is gone)."""
        self._blocks.forget()

    # ------------------------------------------------------------- attaching
    def attach(self, model: torch.nn.Module) -> None:
        """Hook ``model``'s modules (see [Note: stage 3]); replaces an earlier attachment.

        Raises:
            ConfigError: another optimizer's instance hooks ``model`` or one of its modules (nothing
                changes; [Note: several sharded domains]).
        """
        modules = list(model.modules())
        for other in list(_ATTACHED):
            mine = other is self or other in self._peers.members  # this optimizer's (a re-attach, a domain)
            if not mine and any(m in other._hooked for m in modules):
                raise ConfigError(_SHARED_MODEL)
        self._hooks.attach(model)
        self._hooked = weakref.WeakSet(modules)
        _ATTACHED.add(self)

    def retire(self) -> None:
        """Let go of the parameters for good (re-planning installed another plan over them)."""
        self.detach()
        if self in self._peers.members:
            self._peers.members.remove(self)
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles = []
        for p in self._blocks.members():
            OWNERS.release(p, self)
        self._blocks.release()  # the new plan's buffers hold the values now

    def detach(self) -> None:
        """Remove the hooks of :meth:`attach`."""
        self._hooks.detach()
        self._hooked = weakref.WeakSet()
        _ATTACHED.discard(self)

    @property
    def attached(self) -> bool:
        """Whether a model is attached."""
        return self._hooks.attached

    def gathering_allowed(self) -> bool:
        """Whether a sharded parameter may gather on use: inside the attached forward, or a backward."""
        return self._hooks.in_forward or in_backward()

    def gather_param(self, param: torch.Tensor) -> None:
        """Gather ``param``'s block now (used outside its modules); kept until the forward ends."""
        key = self._blocks.key_of(param)
        if key is not None:
            self._blocks.ensure(key)
            self._hooks.pin(key)

    def shard_pieces(self, param: torch.Tensor) -> FlatPieces:
        """This rank's elements of ``param`` as views of its shard: what ``param.detach()`` gives outside
        a forward, so ``model.state_dict()`` holds them ([Note: stage-3 model dicts])."""
        spec, buf = self._where(param)
        parts = [(f.param_span, buf.shard[f.shard_span.as_slice()]) for f in self._held.get(spec.index, ())]
        place = global_place(spec, tensor_slice_of(param.device_mesh)) if is_dtensor(param) else {}
        return FlatPieces(spec.shape, parts, dtype=buf.shard.dtype, device=buf.shard.device, **place)

    def write_param(self, param: torch.Tensor, source: torch.Tensor) -> None:
        """``param.copy_(source)`` outside a forward: this rank's elements of ``param`` take ``source``'s
        (whole, or pieces holding them), its masters the values, its shard their cast.

        A DTensor parameter's ``source`` is a DTensor (brought to its placement first), pieces in
        global coordinates (``shard_pieces``'), or its local tensor's values."""
        spec, buf = self._where(param)
        source = local_source(param, source) if is_dtensor(param) else source
        shape = source.local_shape if isinstance(source, FlatPieces) else tuple(source.shape)
        if tuple(shape) != tuple(spec.shape):
            local = " (a DTensor's local shape: copy a DTensor, or local values)" if is_dtensor(param) else ""
            raise ValueError(f"cannot copy a tensor of shape {tuple(shape)} into {spec.name!r}{local}")
        frags = self._held.get(spec.index, ())
        values = [flat_values(source, f.param_span) for f in frags]  # all read before any write
        for f, v in zip(frags, values, strict=True):
            target = buf.shard[f.shard_span.as_slice()]
            if buf.master is not None:  # a master of its own: bf16/fp16, or fp32 kept apart (offload)
                buf.write_master(v.reshape(-1), f.shard_span)
                target.copy_(buf.read_master(f.shard_span))
            else:
                target.copy_(v)

    def _where(self, param: torch.Tensor) -> tuple[ParamSpec, BlockBuffers]:
        spec = self._specs[self._index[id(param)]]
        return spec, next(b for b in self._buffers if b.space.dtype == spec.dtype)

    def _begin_pass(self) -> None:
        """A new forward began: forget the last backward's progress."""
        self._visited_backward: set[BlockKey] = set()
        self._brought: set[BlockKey] = set()  # blocks a saved tensor was brought back from
        self._arrived: dict[BlockKey, int] = {}

    def _saved_tensor_hooks(self) -> contextlib.AbstractContextManager[None]:
        """The saved-tensor hooks of the attached forward ([Note: several sharded domains])."""
        pack = partial(saved_tensors.pack, self, self._peers.members)
        return torch.autograd.graph.saved_tensors_hooks(pack, saved_tensors.unpack)

    # ------------------------------------------------------------- backward
    def view_of(self, tensor: torch.Tensor, storage: int, *, own: bool) -> SavedView | None:
        """A saved view of ``tensor`` if it views one of this instance's blocks (a peer's: only while
        this instance's own forward is open, [Note: several sharded domains])."""
        key = self._blocks.by_storage.get(storage) if own or self._hooks.in_forward else None
        return None if key is None else SavedView(tensor, self._blocks.entries[key], self)

    def bring_back(self, packed: SavedView) -> torch.Tensor:
        """Gather the block of a saved tensor autograd needs now (and prefetch the one before)."""
        key = packed.key
        if key in self._brought and self._backward_queued and packed.entry.state is BlockState.GATHERED:
            return packed.tensor  # brought back already in this backward: nothing left to do
        self._brought.add(key)
        self._visited_backward.add(key)
        self._queue_end_of_backward()
        self._blocks.ensure(key)
        self._blocks.prefetch(key, -1, self._visited_backward)
        return packed.tensor

    def gradient_arrived(self, param: torch.Tensor) -> None:
        """A trainable parameter's gradient accumulated: free its block once all of the block's did."""
        if not self._backward_queued:
            self._queue_end_of_backward()
        key = self._blocks.key_of(param)
        if key is None:
            return
        if key not in self._visited_backward:  # every block is gathered once per backward, needed or not
            self._visited_backward.add(key)
            self._blocks.start_gather(key)
        count = self._arrived[key] = self._arrived.get(key, 0) + 1
        if count == 1:  # once per block and backward: the next block down (a no-op if visited)
            self._blocks.prefetch(key, -1, self._visited_backward)
        if count >= self._blocks.entries[key].trainable and self._hold == 0:
            self._blocks.free(key)

    def _queue_end_of_backward(self) -> None:
        """Once per backward: free what is still gathered when it ends (a parameter got no gradient)."""
        if not self._backward_queued and in_backward():
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._backward_queued = False
        if self._hold == 0 and not self._hooks.in_forward:
            self.shard_all()

    @contextlib.contextmanager
    def all_gathered(self, *, writeback: bool = False) -> Iterator[None]:
        """Every block gathered inside the block, freed after (collective).

        Args:
            writeback: keep what was written into the parameters inside: on a
                normal exit each rank copies its pieces of every block into its
                shard and reloads its masters from them before the blocks are
                freed (every rank must have written the same values). Without
                it, changes are dropped.
        """
        with self._blocks.logging_to(CommLog()):  # inspection traffic, not the step's
            self.gather_all()
        self._hold += 1
        try:
            yield
            if writeback:
                for buf, published in zip(self._buffers, self._published, strict=True):
                    buf.load_shard(published)
                    buf.load_master()
        finally:
            self._hold -= 1
            if self._hold == 0:
                self.shard_all()


def _call_weakly(method: weakref.WeakMethod, param: torch.Tensor) -> None:
    bound = method()
    if bound is not None:
        bound(param)
