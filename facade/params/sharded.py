"""Stage 3: parameters held as shards, gathered block by block around forward and backward.

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
  parameters, one gather per step instead of two), and while it runs,
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
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from zeroplan.core import Block, StepOrderError, ZeroPlan
from zeroplan.facade.params.buffers import BlockBuffers, block_positions
from zeroplan.facade.params.gather import DeferredParameter
from zeroplan.facade.params.owners import Owners
from zeroplan.facade.runtime.collectives import CommLog, Pending, start_block_gather
from zeroplan.facade.runtime.groups import ProcessGroups

__all__ = ["Peers", "ShardedParameter", "ShardedParams"]

_Key = tuple[int, int]  # (space index, block index)

# [Note: several sharded domains]
# An optimizer with expert groups holds one ``ShardedParams`` per domain (see [Note:
# expert domains]), each attached to the same model. Autograd keeps one pair of
# saved-tensor hooks in force (the innermost ``saved_tensors_hooks``), so each
# instance's ``_pack`` also recognises the blocks of its *peers*, the other domains'
# instances of the same optimizer (a ``Peers`` object the optimizer's domains share;
# an instance joins when installed and leaves when retired), while their forward is
# open; the saved view remembers its owner, whose ``_bring_back`` gathers it in
# backward. Nothing is global: instances of other optimizers, or retired ones whose
# storage addresses may be reused, are never consulted.


class Peers:
    """The ``ShardedParams`` of one optimizer's domains (see [Note: several sharded domains])."""

    def __init__(self) -> None:
        self.members: list[ShardedParams] = []


class BlockState(enum.Enum):
    """Where a stage-3 block is, and what memory it holds on this rank (as FSDP2's ``ShardedState``).

    * ``SHARDED``: only the rank's piece, inside the domain's shard; the block's buffer has no
      storage (resized to 0) and its parameters are ``ShardedParameter`` views of it.
    * ``GATHERING``: the buffer is allocated (the whole block) and this rank's piece written into it;
      the collective that fills the others' pieces is in flight. The parameters are still
      ``ShardedParameter``: the first use waits for the gather.
    * ``GATHERED``: the whole block, complete; its parameters are plain ``nn.Parameter`` again.
      Freeing it (after its modules ran, or at the end of backward) returns it to ``SHARDED``.
    """

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ShardedParameter(DeferredParameter):
    """The class of a stage-3 parameter whose block is not gathered (see [Note: stage 3]).

    Never constructed: a plain ``nn.Parameter``'s ``__class__`` is set to it
    while its block is sharded.
    """

    @staticmethod
    def on_use(param: torch.Tensor, name: str | None) -> None:
        """Gather the block inside the attached forward or a backward; raise elsewhere."""
        _gather_on_use(param, name)


#: Each stage-3 parameter's residency (held strongly, as the module hooks hold it).
_OWNERS: Owners[ShardedParams] = Owners()


def _gather_on_use(param: torch.Tensor, name: str | None) -> None:
    sharded = _OWNERS.get(param)
    if sharded is None or not sharded.gathering_allowed():
        raise StepOrderError(
            f"{name or 'an operation'} read a stage-3 parameter outside a forward or backward: each rank "
            "holds only its shard of it between steps. Call opt.attach(model) once before the first forward "
            "(the forward then gathers what it uses), and read parameters elsewhere inside "
            "`with opt.gathered_params():` on every rank"
        )
    sharded.gather_param(param)


class _Entry:
    """One block: its buffer, plan block (shifted to start at 0), members and state."""

    def __init__(self, key: _Key, buffer: torch.Tensor, block: Block, nbytes: int) -> None:
        self.key = key
        self.buffer = buffer
        self.block = replace(block, start=0)  # the buffer holds the block alone
        self.nbytes = nbytes
        self.members: list[torch.Tensor] = []
        self.indices: list[int] = []  # the members' parameter indices
        self.offsets: list[int] = []  # where each member starts in the buffer
        self.trainable = 0
        self.state = BlockState.SHARDED  # construction leaves every block sharded
        self.pending: list[Pending] = []
        self.saved: dict[int, int] = {}  # tensors autograd saved from the buffer, alive now (_SavedView)


class ShardedParams:
    """The stage-3 parameters of one installed plan (see [Note: stage 3])."""

    def __init__(
        self,
        *,
        zp: ZeroPlan,
        params: Sequence[torch.Tensor],
        buffers: Sequence[BlockBuffers],
        groups: ProcessGroups,
        log: CommLog,
        reshard_after_forward: bool,
        peers: Peers | None = None,
    ) -> None:
        self._zp = zp
        self._buffers = buffers
        self._groups = groups
        self._log = log
        self.reshard_after_forward = reshard_after_forward
        self._entries: dict[_Key, _Entry] = {}
        self._key_of: dict[int, _Key] = {}  # id(param) -> its block
        self._storage: dict[int, _Key] = {}  # storage address (StorageImpl) -> block
        managed = set(zp.trainable_indices)
        for buf in buffers:
            s = buf.space.index
            for k, (block, buffer) in enumerate(zip(buf.space.blocks, buf.blocks, strict=True)):
                entry = _Entry((s, k), buffer, block, block.numel * buffer.element_size())
                self._entries[s, k] = entry
                self._storage[buffer.untyped_storage()._cdata] = (s, k)
            for index, (k, local) in block_positions(buf.space).items():
                entry = self._entries[s, k]
                self._key_of[id(params[index])] = (s, k)
                entry.members.append(params[index])
                entry.indices.append(index)
                entry.offsets.append(local)
                entry.trainable += index in managed
        for entry in self._entries.values():
            for p in entry.members:
                _OWNERS.claim(p, self)
            self._set_class(entry, ShardedParameter)  # built sharded (``build_block_buffers``)
        # Held weakly, as the gradient sync's hooks: a dropped optimizer must not act on gradients.
        method = weakref.WeakMethod(self.gradient_arrived)
        self._grad_handles = [
            params[index].register_post_accumulate_grad_hook(partial(_call_weakly, method))
            for index in sorted(managed)
        ]
        self._modules: dict[int, list[_Key]] = {}  # id(module) -> blocks of its own parameters
        self._users: dict[_Key, set[int]] = {}  # block -> modules holding its parameters
        self._handles: list[Any] = []
        self._forward_depth = 0
        self._opened_by: list[int] = []  # modules that opened a forward of their own (called directly)
        self._hold = 0  # gathered_params() blocks: nothing is freed until it exits
        self._backward_queued = False
        self._saved: contextlib.ExitStack | None = None
        self._peers = Peers()
        self.join(peers if peers is not None else Peers())  # [Note: several sharded domains]
        self._reset_pass()

    def join(self, peers: Peers) -> None:
        """Recognise the blocks of ``peers`` (the other domains' instances) in saved tensors, and be seen."""
        peers.members.append(self)
        self._peers = peers

    # ------------------------------------------------------------------ blocks
    def _set_class(self, entry: _Entry, cls: type) -> None:
        for p in entry.members:
            if type(p) in (torch.nn.Parameter, ShardedParameter):
                p.__class__ = cls

    def _start_gather(self, key: _Key) -> None:
        """Allocate block ``key``'s buffer, write this rank's piece, start its gather."""
        entry = self._entries[key]
        if entry.state is not BlockState.SHARDED:
            return
        entry.buffer.untyped_storage().resize_(entry.nbytes)
        buf = self._buffers[key[0]]
        buf.write_piece(key[1])
        entry.pending = start_block_gather(entry.buffer, entry.block, self._zp, self._groups, self._log)
        entry.state = BlockState.GATHERING

    def _ensure(self, key: _Key) -> None:
        """Block ``key`` gathered and complete (its parameters plain ``nn.Parameter`` again)."""
        entry = self._entries[key]
        if entry.state is BlockState.SHARDED:
            self._start_gather(key)
        if entry.state is BlockState.GATHERING:
            for pending in entry.pending:
                pending.finish()
            entry.pending = []
            entry.state = BlockState.GATHERED
            self._set_class(entry, torch.nn.Parameter)

    def _free(self, key: _Key) -> None:
        """Release block ``key``'s buffer (waiting for a gather in flight first).

        A tensor that still views the buffer from outside (``model.state_dict()``
        kept from ``gathered_params()``, a forward's output ``w.t()``) keeps it: the
        parameters move to a buffer of their own and the old one is left to its
        holders, so no reader ever sees freed memory.
        """
        entry = self._entries[key]
        if entry.state is BlockState.SHARDED:
            return
        for pending in entry.pending:
            pending.finish()
        entry.pending = []
        storage = entry.buffer.untyped_storage()
        # Holders: the buffer, each parameter, ``storage`` itself and the tensors autograd saved (they
        # gather the block again when unpacked); anyone else keeps the memory.
        if torch._C._storage_Use_Count(storage._cdata) > 2 + len(entry.members) + len(entry.saved):
            del storage
            self._rehome(entry)
        else:
            storage.resize_(0)
        entry.state = BlockState.SHARDED
        self._set_class(entry, ShardedParameter)

    def _rehome(self, entry: _Entry) -> None:
        """Move the block's buffer and parameters to empty storage; the old one stays with its holders."""
        del self._storage[entry.buffer.untyped_storage()._cdata]
        # Moving a parameter's storage reads none of its values: no member, whatever its class, gathers.
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            entry.buffer.set_(torch.empty_like(entry.buffer))  # the same tensor (the buffers' tuple holds it)
            for p, local in zip(entry.members, entry.offsets, strict=True):
                p.data = entry.buffer[local : local + p.numel()].view(p.shape)
        storage = entry.buffer.untyped_storage()
        self._storage[storage._cdata] = entry.key
        storage.resize_(0)

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
        self, params: Sequence[torch.Tensor] = (), links: Sequence[tuple[int, tuple[int, int]]] = ()
    ) -> int | None:
        """The first parameter whose ``.data`` no longer views its block's buffer (``Installed.detached``)."""
        for entry in self._entries.values():
            home = entry.buffer.untyped_storage()._cdata
            for p, index in zip(entry.members, entry.indices, strict=True):
                if p.untyped_storage()._cdata != home:
                    return index
        return None

    def _may_free(self) -> bool:
        return self._hold == 0

    def _prefetch(self, key: _Key, step: int, visited: set[_Key]) -> None:
        """Launch the gather of the block ``step`` away from ``key`` in its space, once per pass."""
        nxt = (key[0], key[1] + step)
        if nxt in self._entries and nxt not in visited:
            visited.add(nxt)
            self._start_gather(nxt)

    def shard_all(self) -> None:
        """Free every block: each rank holds only its shards (after install, and after a step)."""
        for key in self._entries:
            self._free(key)

    def gather_all(self) -> None:
        """Gather every block (collective)."""
        for key in self._entries:
            self._start_gather(key)
        for key in self._entries:
            self._ensure(key)

    def block_gathered(self, key: _Key) -> bool:
        """Whether block ``key`` is gathered (for tests and tools)."""
        return self._entries[key].state is BlockState.GATHERED

    def saved_views(self) -> int:
        """Tensors autograd saved from this instance's blocks, alive now (for tests and tools)."""
        return sum(sum(e.saved.values()) for e in self._entries.values())

    def held_bytes(self) -> int:
        """Bytes of block buffers allocated now."""
        return sum(e.nbytes for e in self._entries.values() if e.state is not BlockState.SHARDED)

    # ------------------------------------------------------- the step's calls
    def start_param_sync(self, log: CommLog) -> None:
        """After the inner optimizer stepped: free the (stale) blocks, write masters into the shards."""
        del log  # the next forward gathers, into the log of its own step
        self.shard_all()
        for buf in self._buffers:
            buf.publish_master()

    def finish_param_sync(self) -> None:
        """Complete every gather in flight (blocks stay gathered)."""
        for key, entry in self._entries.items():
            if entry.state is BlockState.GATHERING:
                self._ensure(key)

    def keep_param_writes(self) -> None:
        """Nothing to keep: stage 3 keeps writes made inside ``gathered_params(writeback=True)`` only.

        See [Note: parameter writes]; between steps a stage-3 parameter holds no values of its own.
        """

    def forget(self) -> None:
        """Drop gathers in flight without waiting (the process group is gone)."""
        for entry in self._entries.values():
            entry.pending = []

    # ------------------------------------------------------------- attaching
    def attach(self, model: torch.nn.Module) -> None:
        """Hook ``model``'s modules (see [Note: stage 3]); replaces an earlier attachment."""
        self.detach()
        root = model.register_forward_pre_hook(self._begin_forward, prepend=True)
        self._handles.append(root)
        for module in model.modules():
            keys = sorted(
                {self._key_of[id(p)] for p in module.parameters(recurse=False) if id(p) in self._key_of}
            )
            if not keys:
                continue
            self._modules[id(module)] = keys
            for key in keys:
                self._users.setdefault(key, set()).add(id(module))
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        self._handles.append(model.register_forward_hook(self._end_forward, always_call=True))

    def retire(self) -> None:
        """Let go of the parameters for good (re-planning installed another plan over them)."""
        self.detach()
        if self in self._peers.members:
            self._peers.members.remove(self)
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles = []
        for entry in self._entries.values():
            for p in entry.members:
                _OWNERS.release(p, self)
            entry.members, entry.indices, entry.offsets = [], [], []
            for pending in entry.pending:
                pending.finish()
            entry.pending = []
            entry.buffer.untyped_storage().resize_(0)  # the new plan's buffers hold the values now
            entry.state = BlockState.SHARDED

    def detach(self) -> None:
        """Remove the hooks of :meth:`attach`."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._modules = {}
        self._users = {}

    @property
    def attached(self) -> bool:
        """Whether a model is attached."""
        return bool(self._handles)

    def gathering_allowed(self) -> bool:
        """Whether a sharded parameter may gather on use: inside the attached forward, or a backward."""
        return self._forward_depth > 0 or _in_backward()

    def gather_param(self, param: torch.Tensor) -> None:
        """Gather ``param``'s block now (used outside its modules); kept until the forward ends."""
        key = self._key_of.get(id(param))
        if key is not None:
            self._ensure(key)
            self._pinned.add(key)

    def _reset_pass(self) -> None:
        self._done: set[int] = set()
        self._running: dict[int, int] = {}
        self._visited_forward: set[_Key] = set()
        self._visited_backward: set[_Key] = set()
        self._arrived: dict[_Key, int] = {}
        self._pinned: set[_Key] = set()

    def _begin_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._forward_depth == 0:
            self._reset_pass()
            stack = contextlib.ExitStack()
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
            self._saved = stack
        self._forward_depth += 1

    def _end_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._forward_depth == 0:  # a pre-hook before ours raised: this forward never began
            return
        self._forward_depth -= 1
        if self._forward_depth:
            return
        if self._saved is not None:
            self._saved.close()
            self._saved = None
        if self.reshard_after_forward and self._hold == 0 and not _in_backward():
            self.shard_all()
        self._pinned = set()

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if self._forward_depth == 0 and not _in_backward():  # a submodule called on its own
            self._begin_forward(module, args)
            self._opened_by.append(id(module))
        keys = self._modules.get(id(module), ())
        for key in keys:
            self._visited_forward.add(key)
            self._ensure(key)
        if keys:
            self._prefetch(keys[-1], 1, self._visited_forward)
        self._running[id(module)] = self._running.get(id(module), 0) + 1

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._running[id(module)] = self._running.get(id(module), 1) - 1
        self._done.add(id(module))
        # In backward (activation checkpointing recomputes forwards) blocks wait for their gradients.
        if self.reshard_after_forward and self._hold == 0 and not _in_backward():
            self._free_finished(module)
        if self._opened_by and self._opened_by[-1] == id(module) and self._running[id(module)] == 0:
            self._opened_by.pop()
            self._end_forward(module, args, output)

    def _free_finished(self, module: torch.nn.Module) -> None:
        """Free the blocks of ``module`` whose every module has run (and none runs now)."""
        for key in self._modules.get(id(module), ()):
            users = self._users.get(key, set())
            if (
                key not in self._pinned
                and users <= self._done
                and not any(self._running.get(u) for u in users)
            ):
                self._free(key)

    # ------------------------------------------------------------- backward
    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.layout is not torch.strided or tensor.device.type == "meta":
            return tensor  # sparse and meta tensors never view a block
        storage = tensor.untyped_storage()._cdata
        key = self._storage.get(storage)
        if key is not None:
            return _SavedView(tensor, self._entries[key], self)
        for peer in self._peers.members:  # [Note: several sharded domains]
            view = peer._view_of(tensor, storage) if peer is not self else None
            if view is not None:
                return view
        return tensor

    def _view_of(self, tensor: Any, storage: int) -> _SavedView | None:
        """A saved view of ``tensor`` if it views one of this instance's blocks inside its open forward."""
        key = self._storage.get(storage) if self._forward_depth > 0 else None
        return None if key is None else _SavedView(tensor, self._entries[key], self)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _SavedView):
            return packed
        return packed.owner._bring_back(packed)

    def _bring_back(self, packed: _SavedView) -> torch.Tensor:
        """Gather the block of a saved tensor autograd needs now (and prefetch the one before)."""
        key = packed.key
        self._visited_backward.add(key)
        self._queue_end_of_backward()
        self._ensure(key)
        self._prefetch(key, -1, self._visited_backward)
        return packed.tensor

    def gradient_arrived(self, param: torch.Tensor) -> None:
        """A trainable parameter's gradient accumulated: free its block once all of the block's did."""
        self._queue_end_of_backward()
        key = self._key_of.get(id(param))
        if key is None:
            return
        if key not in self._visited_backward:  # every block is gathered once per backward, needed or not
            self._visited_backward.add(key)
            self._start_gather(key)
        count = self._arrived[key] = self._arrived.get(key, 0) + 1
        self._prefetch(key, -1, self._visited_backward)
        if count >= self._entries[key].trainable and self._hold == 0:
            self._free(key)

    def _queue_end_of_backward(self) -> None:
        """Once per backward: free what is still gathered when it ends (a parameter got no gradient)."""
        if not self._backward_queued and _in_backward():
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._backward_queued = False
        if self._hold == 0 and self._forward_depth == 0:
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
        log, self._log = self._log, CommLog()  # inspection traffic, not the step's
        try:
            self.gather_all()
        finally:
            self._log = log
        self._hold += 1
        try:
            yield
            if writeback:
                for buf in self._buffers:
                    buf.load_shard()
                    buf.load_master()
        finally:
            self._hold -= 1
            if self._hold == 0:
                self.shard_all()


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def _call_weakly(method: weakref.WeakMethod, param: torch.Tensor) -> None:
    bound = method()
    if bound is not None:
        bound(param)


class _SavedView:
    """A tensor autograd saved from a stage-3 block's buffer, and that block.

    While it lives its tensor is one of the block's expected holders
    (``_Entry.saved``: per tensor, how many saved views hold it), unless it is a
    parameter itself (which the block counts already).
    """

    __slots__ = ("entry", "key", "owner", "tensor")

    def __init__(self, tensor: torch.Tensor, entry: _Entry, owner: ShardedParams) -> None:
        self.tensor = tensor
        self.key = entry.key
        self.entry = entry
        self.owner = owner
        # A parameter is counted among the members already (an unknown one viewing the block would be
        # left uncounted: then the block moves rather than frees, the safe side).
        if not isinstance(tensor, torch.nn.Parameter):
            entry.saved[id(tensor)] = entry.saved.get(id(tensor), 0) + 1

    def __del__(self) -> None:
        left = self.entry.saved.get(id(self.tensor), 0) - 1
        if left > 0:
            self.entry.saved[id(self.tensor)] = left
        else:
            self.entry.saved.pop(id(self.tensor), None)
