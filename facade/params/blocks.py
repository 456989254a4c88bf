"""Stage 3's blocks: where each is (sharded, gathering, gathered) and the moves between states.

:class:`BlockTable` is the state machine of [Note: stage 3] (``params.sharded``) and nothing else:
it allocates a block's buffer and starts its gather, completes it, frees it (or moves its parameters
to new storage when someone else still views it), and says what it holds. *When* a block moves is
decided elsewhere: by the module hooks and the gradient hooks of ``ShardedParams``, and by the
saved-tensor hooks of ``params.saved_tensors``. :class:`TracedBlocks` is the same state machine
for a trace under fake tensors: it only allocates and drops ([Note: stage 3 traced]).
"""

from __future__ import annotations

import abc
import contextlib
import enum
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import torch

from zeroplan.core import Block, ConfigError, Stage, StepOrderError, ZeroPlan
from zeroplan.facade.mechanisms.collectives import CommLog, Pending
from zeroplan.facade.mechanisms.dynamo import between_graphs
from zeroplan.facade.mechanisms.flat_pieces import FlatPieces
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.mechanisms.policies import gather_for
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype
from zeroplan.facade.params.buffers import BlockBuffers, block_positions
from zeroplan.facade.params.gather import DeferredParameter, deferred_dtensor_class, swappable
from zeroplan.facade.params.local_shards import dtensor_class
from zeroplan.facade.params.owners import Owners

__all__ = [
    "BlockEntry",
    "BlockKey",
    "BlockState",
    "BlockTable",
    "Blocks",
    "check_shardable",
    "TracedBlocks",
    "GathersOnUse",
    "ShardedParameter",
    "OWNERS",
    "sharded_dtensor_class",
]

BlockKey = tuple[int, int]  # (space index, block index)


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


class GathersOnUse(Protocol):
    """What a sharded parameter's first use asks of its residency (``ShardedParams``)."""

    def gathering_allowed(self) -> bool:
        """Whether a use may gather now (inside the attached forward, or a backward)."""

    def gather_param(self, param: torch.Tensor) -> None:
        """Gather ``param``'s block now."""

    def shard_pieces(self, param: torch.Tensor) -> FlatPieces:
        """This rank's elements of ``param``, as views of its shard."""

    def write_param(self, param: torch.Tensor, source: torch.Tensor) -> None:
        """Write this rank's elements of ``param`` (and their masters) from ``source``."""


_NOT_A_PARAMETER = (
    "{name!r} (a {cls} of shape {shape}, {dtype}) is not an nn.Parameter: stage 3 frees every "
    "parameter's values between uses and gathers them back around forward and backward only for "
    "nn.Parameter objects (whose class it swaps while they are sharded), so a forward would read this "
    "tensor's freed memory. Wrap it in torch.nn.Parameter (a module attribute, e.g. "
    "self.temp = torch.nn.Parameter(...)), or use stage 1 or 2"
)


def check_shardable(zp: ZeroPlan, params: Sequence[torch.Tensor]) -> None:
    """Refuse, at stage 3, a plain tensor among ``params`` (the plan's, in spec order).

    Its block would free its storage between uses, but its class cannot follow the block (see
    ``params.gather.swappable``), so nothing would gather it before a read. A DTensor's local tensor
    (a placed spec) is fine: its DTensor's class follows. Pure: every rank, given the same model,
    raises the same error before anything changes.

    Raises:
        ConfigError: naming the first such tensor.
    """
    if zp.stage is not Stage.PARAMETERS:
        return
    for spec, param in zip(zp.specs, params, strict=True):
        if not spec.placement and not isinstance(param, torch.nn.Parameter):
            cls = f"{type(param).__module__}.{type(param).__qualname__}"
            raise ConfigError(
                _NOT_A_PARAMETER.format(name=spec.name, cls=cls, shape=tuple(spec.shape), dtype=spec.dtype)
            )


#: Each stage-3 parameter's residency (held strongly, as the module hooks hold it).
OWNERS: Owners[GathersOnUse] = Owners()

#: What a module's ``state_dict()`` and ``load_state_dict()`` do to a parameter.
_SHARD_IO = (torch.Tensor.detach, torch.Tensor.copy_)


class ShardedParameter(DeferredParameter):
    """The class of a stage-3 parameter whose block is not gathered (see [Note: stage 3]).

    Never constructed: a plain ``nn.Parameter``'s ``__class__`` is set to it
    while its block is sharded.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """``detach`` and ``copy_`` outside a forward or backward read and write the rank's shard
        ([Note: stage-3 model dicts]); every other use is :class:`DeferredParameter`'s."""
        if func in _SHARD_IO and args and type(args[0]) is ShardedParameter:  # inline: per use, no call
            done, result = _shard_io(func, args)
            if done:
                return result
        return super().__torch_function__(func, types, args, kwargs)

    @classmethod
    def intercept(cls, func: Any, args: Any, kind: type) -> tuple[bool, Any]:
        """``detach``/``copy_`` of a sharded parameter of class ``kind`` (or its DTensor) outside a pass."""
        if func in _SHARD_IO and args and type(args[0]) is kind:
            return _shard_io(func, args)
        return False, None

    @staticmethod
    @between_graphs  # [Note: hooks under torch.compile] in ``params.module_hooks``
    def on_use(param: torch.Tensor, name: str | None) -> None:
        """Gather the block inside the attached forward or a backward; raise elsewhere."""
        sharded = OWNERS.get(param)
        if sharded is None or not sharded.gathering_allowed():
            raise StepOrderError(
                f"{name or 'an operation'} read a stage-3 parameter outside a forward or backward: each "
                "rank holds only its shard of it between steps. Call opt.attach(model) once before the "
                "first forward (the forward then gathers what it uses), and read parameters elsewhere "
                "inside `with opt.gathered_params():` on every rank"
            )
        sharded.gather_param(param)


def _shard_io(func: Any, args: Any) -> tuple[bool, Any]:
    """``param.detach()`` or ``param.copy_(source)`` on a sharded parameter outside a forward or
    backward: the rank's shard, read or written ([Note: stage-3 model dicts]); ``(False, None)``
    inside one, where the use gathers."""
    sharded = OWNERS.get(args[0])
    if sharded is None or sharded.gathering_allowed():
        return False, None
    if func is torch.Tensor.detach:
        return True, sharded.shard_pieces(args[0])
    sharded.write_param(args[0], args[1])
    return True, args[0]


def sharded_dtensor_class() -> type | None:
    """The class of a stage-3 ``DTensor`` parameter whose block is not gathered (``None`` without
    DTensors); see [Note: deferred DTensor parameters] in ``params.gather``."""
    return deferred_dtensor_class(ShardedParameter)


class BlockEntry:
    """One block: its buffer, plan block (shifted to start at 0), members and state."""

    def __init__(self, key: BlockKey, buffer: torch.Tensor, block: Block, nbytes: int) -> None:
        self.key = key
        self.buffer = buffer
        self.block = replace(block, start=0)  # the buffer holds the block alone
        self.nbytes = nbytes
        self.members: list[torch.Tensor] = []
        self.swapped: list[torch.Tensor] = []  # the members whose class follows the state (``swappable``)
        self.guarded: list[torch.Tensor] = []  # the DTensors whose local tensors are members (swapped too)
        self.indices: list[int] = []  # the members' parameter indices
        self.offsets: list[int] = []  # where each member starts in the buffer
        self.trainable = 0
        self.state = BlockState.SHARDED  # construction leaves every block sharded
        self.pending: list[Pending] = []
        self.saved: dict[int, int] = {}  # tensors autograd saved from the buffer, alive now (SavedView)


class Blocks(abc.ABC):
    """The blocks of one installed stage-3 plan and their state machine (see the module docstring).

    Moving a block's values is the subclass's: :class:`BlockTable` gathers over the process group,
    :class:`TracedBlocks` only allocates (a trace under fake tensors, [Note: stage 3 traced]).
    """

    def __init__(
        self,
        zp: ZeroPlan,
        params: Sequence[torch.Tensor],
        entries: dict[BlockKey, BlockEntry],
        owners: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """``owners``: per parameter, the user's tensor (a ``DTensor`` whose local tensor is in
        ``params``, or the parameter itself); both find the block."""
        self._zp = zp
        self.gather = gather_for(zp)
        """How the blocks' pieces travel ([Note: gather policy]), chosen once by ``policies``."""
        self.log = CommLog()
        self.entries = entries
        self._key_of: dict[int, BlockKey] = {}  # id(param) -> its block
        self.by_storage: dict[int, BlockKey] = {}
        """Storage address (``StorageImpl``) -> block: what a saved tensor views (``saved_tensors``)."""
        managed = set(zp.trainable_indices)
        for s in sorted({key[0] for key in entries}):
            for index, (k, local) in block_positions(zp.partition.spaces[s]).items():
                entry = entries[s, k]
                self._key_of[id(params[index])] = (s, k)
                entry.members.append(params[index])
                if swappable(zp.specs[index], params[index]):
                    entry.swapped.append(params[index])
                owner = params[index] if owners is None else owners[index]
                if owner is not params[index]:  # [Note: deferred DTensor parameters] in ``params.gather``
                    self._key_of[id(owner)] = (s, k)
                    entry.guarded.append(owner)
                entry.indices.append(index)
                entry.offsets.append(local)
                entry.trainable += index in managed

    # ------------------------------------------------------------------ lookups
    def key_of(self, param: torch.Tensor) -> BlockKey | None:
        """The block holding ``param`` (``None``: not one of this plan's)."""
        return self._key_of.get(id(param))

    def key_of_storage(self, storage: int) -> BlockKey | None:
        """The block whose buffer has the storage at address ``storage`` (``StorageImpl``)."""
        return self.by_storage.get(storage)

    def members(self) -> Iterator[torch.Tensor]:
        """Every parameter of every block, and the DTensors whose local tensors they are."""
        for entry in self.entries.values():
            yield from entry.members
            yield from entry.guarded

    # ------------------------------------------------------------------ moves
    @abc.abstractmethod
    def _set_class(self, entry: BlockEntry, *, sharded: bool) -> None:
        """Give the block's parameters their class: a deferred one while ``sharded``, else their own."""

    @abc.abstractmethod
    def start_gather(self, key: BlockKey) -> None:
        """SHARDED -> GATHERING: allocate the block and start filling it."""

    @abc.abstractmethod
    def free(self, key: BlockKey) -> None:
        """-> SHARDED: release the block."""

    @abc.abstractmethod
    def release(self) -> None:
        """Let go of every parameter (another plan's buffers hold their values now); all sharded."""

    @abc.abstractmethod
    def detached(self) -> int | None:
        """The first parameter whose values no longer live where the table put them."""

    def ensure(self, key: BlockKey) -> None:
        """-> GATHERED: the block complete, its parameters plain ``nn.Parameter`` again."""
        entry = self.entries[key]
        if entry.state is BlockState.SHARDED:
            self.start_gather(key)
        if entry.state is BlockState.GATHERING:
            for pending in entry.pending:
                pending.finish()
            entry.pending = []
            entry.state = BlockState.GATHERED
            self._set_class(entry, sharded=False)

    def prefetch(self, key: BlockKey, step: int, visited: set[BlockKey]) -> None:
        """Start the gather of the block ``step`` away from ``key`` in its space, once per ``visited``."""
        nxt = (key[0], key[1] + step)
        if nxt in self.entries and nxt not in visited:
            visited.add(nxt)
            self.start_gather(nxt)

    def shard_all(self) -> None:
        """Free every block: each rank holds only its shards."""
        for key in self.entries:
            self.free(key)

    def gather_all(self) -> None:
        """Gather every block (collective)."""
        for key in self.entries:
            self.start_gather(key)
        for key in self.entries:
            self.ensure(key)

    def finish_gathers(self) -> None:
        """Complete every gather in flight (blocks stay gathered)."""
        for key, entry in self.entries.items():
            if entry.state is BlockState.GATHERING:
                self.ensure(key)

    def forget(self) -> None:
        """Drop gathers in flight without waiting (the process group is gone)."""
        for entry in self.entries.values():
            entry.pending = []

    @contextlib.contextmanager
    def logging_to(self, log: CommLog) -> Iterator[None]:
        """Count the gathers started inside in ``log`` (inspection traffic is not the step's)."""
        saved, self.log = self.log, log
        try:
            yield
        finally:
            self.log = saved

    # ------------------------------------------------------------------ what it holds
    def block_gathered(self, key: BlockKey) -> bool:
        """Whether block ``key`` is gathered (for tests and tools)."""
        return self.entries[key].state is BlockState.GATHERED

    def saved_views(self) -> int:
        """Tensors autograd saved from the blocks, alive now (for tests and tools)."""
        return sum(sum(e.saved.values()) for e in self.entries.values())

    def held_bytes(self) -> int:
        """Bytes of block buffers allocated now."""
        return sum(e.nbytes for e in self.entries.values() if e.state is not BlockState.SHARDED)


class BlockTable(Blocks):
    """The blocks of one installed stage-3 plan, gathered over the process group into their buffers."""

    def __init__(
        self,
        *,
        zp: ZeroPlan,
        params: Sequence[torch.Tensor],
        buffers: Sequence[BlockBuffers],
        groups: ProcessGroups,
        log: CommLog,
        owners: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """``owners``: per parameter, the user's tensor (a ``DTensor``, or the parameter itself)."""
        entries: dict[BlockKey, BlockEntry] = {}
        for buf in buffers:
            s = buf.space.index
            for k, (block, buffer) in enumerate(zip(buf.space.blocks, buf.blocks, strict=True)):
                entries[s, k] = BlockEntry((s, k), buffer, block, block.numel * buffer.element_size())
        super().__init__(zp, params, entries, owners)
        self._buffers = buffers
        self._groups = groups
        self.log = log
        for entry in entries.values():
            self.by_storage[entry.buffer.untyped_storage()._cdata] = entry.key
            self._set_class(entry, sharded=True)  # built sharded (``build_block_buffers``)

    def _set_class(self, entry: BlockEntry, *, sharded: bool) -> None:
        """Swap the members' class: ``ShardedParameter`` while sharded (a read gathers or raises), and
        their DTensors' (``ShardedDTensor``, [Note: deferred DTensor parameters] in ``params.gather``)."""
        cls = ShardedParameter if sharded else torch.nn.Parameter
        for p in entry.swapped:
            if type(p) in (torch.nn.Parameter, ShardedParameter):  # not another optimizer's deferred class
                p.__class__ = cls
        if entry.guarded:
            plain, guarded = dtensor_class(), sharded_dtensor_class()
            for d in entry.guarded:
                if type(d) in (plain, guarded):
                    d.__class__ = guarded if sharded else plain

    def start_gather(self, key: BlockKey) -> None:
        """SHARDED -> GATHERING: allocate the buffer, write this rank's piece, start the gather."""
        entry = self.entries[key]
        if entry.state is not BlockState.SHARDED:
            return
        entry.buffer.untyped_storage().resize_(entry.nbytes)
        self._buffers[key[0]].write_piece(key[1])
        space = self._zp.partition.spaces[entry.key[0]]
        entry.pending = self.gather.start_block(entry.buffer, space, entry.block, self._groups, self.log)
        entry.state = BlockState.GATHERING

    def free(self, key: BlockKey) -> None:
        """-> SHARDED: release the buffer (waiting for a gather in flight first).

        A tensor that still views the buffer from outside (``model.state_dict()``
        kept from ``gathered_params()``, a forward's output ``w.t()``) keeps it: the
        parameters move to a buffer of their own and the old one is left to its
        holders, so no reader ever sees freed memory. So does a buffer shared with numpy
        (``p.detach().numpy()`` inside ``gathered_params()``), whose storage torch marks as not
        resizable for good, whether or not the array is still alive.
        """
        entry = self.entries[key]
        if entry.state is BlockState.SHARDED:
            return
        for pending in entry.pending:
            pending.finish()
        entry.pending = []
        storage = entry.buffer.untyped_storage()
        # Holders: the buffer, each parameter, ``storage`` itself and the tensors autograd saved (they
        # gather the block again when unpacked); anyone else keeps the memory.
        held = torch._C._storage_Use_Count(storage._cdata) > 2 + len(entry.members) + len(entry.saved)
        if held or not storage.resizable():
            del storage
            self._rehome(entry)
        else:
            storage.resize_(0)
        entry.state = BlockState.SHARDED
        self._set_class(entry, sharded=True)

    def _rehome(self, entry: BlockEntry) -> None:
        """Move the block's buffer and parameters to empty storage; the old one stays with its holders."""
        del self.by_storage[entry.buffer.untyped_storage()._cdata]
        # Moving a parameter's storage reads none of its values: no member, whatever its class, gathers.
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            entry.buffer.set_(torch.empty_like(entry.buffer))  # the same tensor (the buffers' tuple holds it)
            for p, local in zip(entry.members, entry.offsets, strict=True):
                p.data = entry.buffer[local : local + p.numel()].view(p.shape)
        storage = entry.buffer.untyped_storage()
        self.by_storage[storage._cdata] = entry.key
        storage.resize_(0)

    def release(self) -> None:
        """Let go of every parameter (another plan's buffers hold their values now); all sharded."""
        for entry in self.entries.values():
            entry.members, entry.swapped, entry.indices, entry.offsets = [], [], [], []
            entry.guarded = []
            for pending in entry.pending:
                pending.finish()
            entry.pending = []
            storage = entry.buffer.untyped_storage()
            if storage.resizable():
                storage.resize_(0)
            else:  # shared with numpy: left to the array, the buffer gets empty storage of its own
                with torch.no_grad():
                    entry.buffer.set_(entry.buffer.new_empty(0))
            entry.state = BlockState.SHARDED

    def detached(self) -> int | None:
        """The first parameter whose ``.data`` no longer views its block's buffer."""
        with torch._C.DisableTorchFunctionSubclass():  # a sharded parameter's storage, unhooked
            for entry in self.entries.values():
                home = entry.buffer.untyped_storage()._cdata
                for p, index in zip(entry.members, entry.indices, strict=True):
                    if p.untyped_storage()._cdata != home:
                        return index
        return None


class TracedBlocks(Blocks):
    """Stage 3's blocks in a trace under fake tensors.

    See [Note: stage 3 traced] in ``diagnostics.activation_trace``.

    Gathering allocates the whole block, so torch's ``MemTracker`` counts it where a ``BlockTable``
    would hold it, and freeing drops it; nothing moves between ranks. Under a parameter wire a
    gather also holds its encoded room from its start until it completes, with the fp32 scratch
    shard rank 0 encodes its piece through and the one every piece is decoded through
    (``collectives.start_encoded_block_gather``'s, the sizes the plan's ``GatherRoom`` gives). The traced
    model's parameters stay its own (plain, each with its storage): a tensor autograd saves from one
    is a saved view of its block, as it is of a ``BlockTable``'s buffer.
    """

    def __init__(self, zp: ZeroPlan, params: Sequence[torch.Tensor], device: torch.device) -> None:
        entries: dict[BlockKey, BlockEntry] = {}
        for space in zp.partition.spaces:
            empty = torch.empty(0, dtype=torch_dtype(space.dtype), device=device)
            for k, block in enumerate(space.blocks):
                entries[space.index, k] = BlockEntry(
                    (space.index, k), empty, block, block.numel * empty.element_size()
                )
        super().__init__(zp, params, entries)
        for entry in entries.values():
            for p in entry.members:
                self.by_storage[p.untyped_storage()._cdata] = entry.key
        self._rooms = {
            key: self.gather.room(zp.partition.spaces[key[0]], entry.block) for key, entry in entries.items()
        }

    def _set_class(self, entry: BlockEntry, *, sharded: bool) -> None:
        """Nothing: the traced parameters hold their values whatever the block's state."""

    def start_gather(self, key: BlockKey) -> None:
        """SHARDED -> GATHERING: allocate the whole block."""
        entry = self.entries[key]
        if entry.state is not BlockState.SHARDED:
            return
        entry.buffer = entry.buffer.new_empty(entry.block.numel)
        entry.state = BlockState.GATHERING
        room = self._rooms[key]
        if room is not None:
            raw = entry.buffer.new_empty(room.nbytes, dtype=torch.uint8)
            if entry.block.pieces[0]:  # rank 0 encodes its piece through a scratch, let go at once
                entry.buffer.new_empty(room.scratch_numel, dtype=torch.float32)
            decode = partial(_decode, raw, room.scratch_numel)
            entry.pending = [Pending(None, after=decode)]

    def free(self, key: BlockKey) -> None:
        """-> SHARDED: drop the block (a gather in flight completes first, as a ``BlockTable``'s)."""
        entry = self.entries[key]
        for pending in entry.pending:
            pending.finish()
        entry.pending = []
        entry.buffer = entry.buffer.new_empty(0)
        entry.state = BlockState.SHARDED

    def release(self) -> None:
        """Drop every block and forget the parameters."""
        for key, entry in self.entries.items():
            self.free(key)
            entry.members, entry.swapped, entry.indices, entry.offsets = [], [], [], []
            entry.guarded = []

    def detached(self) -> int | None:
        """None: the traced parameters are never moved."""
        return None


def _decode(raw: torch.Tensor, scratch_numel: int) -> None:
    """A traced encoded gather completing: the scratch its pieces are decoded through is allocated
    while ``raw`` (the room) is still held; both go when this returns (the caller drops ``raw``)."""
    scratch = raw.new_empty(scratch_numel, dtype=torch.float32)
    del scratch
