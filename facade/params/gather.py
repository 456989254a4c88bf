"""Gathering updated parameters after ``step()``, overlapped with the next forward.

[Note: parameter gather]
After the inner optimizer stepped, each rank writes its updated shard into its
pieces of the full parameter buffers and every block of the buffer is
gathered by one collective (``all_gather`` of equal pieces, or a broadcast per
owner; see [Note: layout]). Blocks are launched in buffer order, which is
forward order for the usual model that registers its layers in the order it
runs them. On a hierarchical topology an ``all_gather`` is two hops, across
nodes (waited for) then inside each node (see [Note: hierarchical all-gather]
in ``zeroplan.core.hierarchy``).

With ``overlap_param_gather=True`` (the default) ``step()`` returns as soon as
the gathers are launched, and the first *use* of a parameter waits for the
block(s) holding it, so the forward of early layers runs while later blocks
still arrive, without hooks on (or wrapping of) the user's modules. While its
block is in flight a parameter's class is :class:`GatheringParameter`, an
``nn.Parameter`` subclass whose ``__torch_function__`` waits for the block,
restores the class and runs the operation. Every torch operation on it waits
this way: a module's forward, ``model.state_dict()``, ``torch.save``, ``p.data``,
an EMA update, a second optimizer; so **no read of a parameter sees stale values**. Metadata
(``shape``, ``dtype``, ``grad``, ``numel()``, ``data_ptr()``, ...) does not
wait, so ``zero_grad()`` keeps the overlap. Every ``ZeroOptimizer`` call that
reads or writes parameters, masters or state (``step()``, state dicts,
checkpoints, re-planning) waits for all first, and ``opt.wait_for_params()``
does so on demand. Only parameters whose spec is plain and which are
``nn.Parameter`` objects are swapped (:func:`swappable`), and the ``DTensor``
parameters whose local tensors are in the buffer ([Note: deferred DTensor
parameters]); a block holding a plain ``torch.Tensor`` is waited for inside
``step()``. Construction refuses any other tensor class (a tensor subclass).

``overlap_param_gather=False`` waits inside ``step()`` and gives bit-identical
results.

A plain tensor aliasing a parameter's storage (``w = p.data`` or ``p.detach()``
kept from before ``step()``) is not the parameter: reading it does not wait and
may see the previous step's values until ``opt.wait_for_params()`` (or any use
of the parameter itself) completed the gather.

[Note: parameter writes]
Between steps the parameters are the user's to write: ``model.load_state_dict``,
an in-place edit under ``torch.no_grad()``. fp32 parameters at stages 1 and 2
are their own master (stepped in place), so a write is kept. bf16/fp16
parameters are stepped through fp32 masters, whose cast the next step would
publish over the write. So before each step (``StepLifecycle.reduce``), where a
space's parameters were written since this optimizer's last writes completed
(the sum of their version counters moved: an in-place write through a
parameter bumps it, this optimizer's writes into the flat buffer do not), each
rank compares its pieces with the cast of its master, as bits, and takes the
parameter's value into the master wherever they differ; the other elements keep
their fp32 bits. A rank sees only its own pieces, so write on every rank (as
loading a state dict does). Writes through ``p.data`` (a tensor with a version
counter of its own) are not seen: use the parameter itself. Stage 3 keeps writes
made inside ``gathered_params(writeback=True)`` only. Under a parameter wire
(``gather_dtype``, [Note: wire formats] in ``zeroplan.core.wire``) the pieces
hold their master's cast encoded and decoded, not the cast itself, so that is
what they are compared with (``PublishedPieces`` in ``mechanisms.wire_codec``),
here and in ``gathered_params(writeback=True)``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import weakref
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_flatten

from zeroplan.core import ParamSpec, ZeroPlan
from zeroplan.core.host_step import gather_release
from zeroplan.facade.mechanisms.collectives import CommLog, Pending, join_side_stream
from zeroplan.facade.mechanisms.dynamo import between_graphs, compiled_blocks
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.mechanisms.policies import gather_for
from zeroplan.facade.params.buffers import FlatBuffers
from zeroplan.facade.params.local_shards import dtensor_class
from zeroplan.facade.params.owners import Owners

__all__ = [
    "DeferredParameter",
    "GatheringParameter",
    "ParamGather",
    "deferred_dtensor_class",
    "restore_class",
    "swappable",
]


class DeferredParameter(torch.nn.Parameter):
    """Base of the classes a parameter takes while its values are not in place (never constructed).

    Every torch operation on one, except a metadata read, first calls its
    class's ``on_use(param, operation name)``: :class:`GatheringParameter`
    waits for its block, ``ShardedParameter`` (stage 3) gathers it or raises.
    """

    #: Property reads and calls that touch no values: they do not wait.
    METADATA: ClassVar[frozenset[str]] = frozenset(
        {
            "grad", "shape", "dtype", "device", "requires_grad", "is_leaf", "layout", "ndim",
            "grad_fn", "is_cuda", "is_sparse", "is_meta", "is_quantized", "names", "_version",
            "numel", "size", "dim", "data_ptr", "element_size", "nelement", "stride",
            "is_contiguous", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
            "is_floating_point", "is_complex", "get_device", "untyped_storage", "storage_offset",
        }
    )  # fmt: skip

    #: Called with a parameter of this class and the operation's name before the operation runs.
    on_use: ClassVar[Callable[[torch.Tensor, str | None], None]]

    @classmethod
    def intercept(cls, func: Any, args: Any, kind: type) -> tuple[bool, Any]:
        """Whether ``func`` on ``args`` (the first of class ``kind``: this class, or its DTensor
        counterpart) is answered without the values, and the answer; none is, here."""
        del func, args, kind
        return False, None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Inline rather than ``_after_uses``: dynamo traces this frame at each graph break of a compiled
        # model, and the shared helper made it recompile per operation (test_compile counts frames).
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", None) if func.__name__ in ("__get__", "__set__") else func.__name__
        if name not in DeferredParameter.METADATA:
            for leaf in tree_flatten((args, kwargs))[0]:
                if isinstance(leaf, DeferredParameter):  # of any subclass: one operation may mix them
                    type(leaf).on_use(leaf, name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _operation(func: Any) -> str | None:
    """The name of the operation ``func`` (a property's, for its getter and setter)."""
    if func.__name__ in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", None)
    return func.__name__


def _after_uses(func: Any, args: Any, kwargs: Any) -> Any:
    """Run ``func`` once every deferred argument's ``on_use`` ran (none for a metadata read)."""
    name = _operation(func)
    if name not in DeferredParameter.METADATA:
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, DeferredParameter):  # of any subclass: one operation may mix them
                type(leaf).on_use(leaf, name)
            elif isinstance(leaf, _DeferredDTensor):
                type(leaf).deferred.on_use(leaf, name)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class _DeferredDTensor:
    """What a ``DTensor`` parameter's deferred class adds to ``DTensor`` (see
    :func:`deferred_dtensor_class`).

    [Note: deferred DTensor parameters]
    A tensor-parallel parameter is a ``DTensor``; zeroplan shards and gathers its local tensor (the
    object the DTensor holds, a view of a flat buffer). The local tensor cannot guard itself:
    DTensor's dispatch hands it to aten operations below any ``__torch_function__``, so it cannot
    take a deferred class, and a read of it while its values are elsewhere would see stale values
    (a gather in flight) or freed memory (stage 3's sharded block). The DTensor is what modules and
    users touch, so the DTensor's class is swapped instead, exactly when a plain parameter's would
    be: to ``GatheringDTensor`` while its block's gather is in flight (stages 1-2, [Note: parameter
    gather]: a use waits for it) and to ``ShardedDTensor`` while its stage-3 block is sharded
    ([Note: stage 3]: a use gathers inside the attached forward or a backward, raises elsewhere;
    ``detach``/``copy_`` outside them read and write the rank's shard, in global coordinates), back to
    ``DTensor`` after. Both are ``DTensor`` subclasses adding no state, made once per deferred class
    (:func:`deferred_dtensor_class`). DTensor's own Python methods that read the local tensor
    (``to_local``, ``full_tensor``, ``redistribute``, ``repr``), which no ``__torch_function__`` sees,
    wait or gather too; metadata (shape, placements, mesh, ``.grad``) reads as usual. Code that reads
    ``_local_tensor`` itself bypasses the guard, as it bypasses DTensor.
    """

    __slots__ = ()

    #: The plain parameter's deferred class whose ``on_use`` and ``intercept`` this class uses.
    deferred: ClassVar[type[DeferredParameter]]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        done, result = cls.deferred.intercept(func, args, cls)
        return result if done else _after_uses(func, args, kwargs or {})

    def to_local(self, *args: Any, **kwargs: Any) -> Any:
        """The local tensor, once its values are in place."""
        return _dtensor_method(self, "to_local", args, kwargs)

    def full_tensor(self, *args: Any, **kwargs: Any) -> Any:
        """The whole tensor, once its values are in place."""
        return _dtensor_method(self, "full_tensor", args, kwargs)

    def redistribute(self, *args: Any, **kwargs: Any) -> Any:
        """Redistributed, once its values are in place."""
        return _dtensor_method(self, "redistribute", args, kwargs)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return _dtensor_method(self, "__repr__", args, kwargs)


def _dtensor_method(param: Any, name: str, args: Any, kwargs: Any) -> Any:
    """DTensor's method ``name`` on ``param`` after its deferred class's ``on_use``."""
    type(param).deferred.on_use(param, name)
    return getattr(dtensor_class(), name)(param, *args, **kwargs)


@functools.cache
def deferred_dtensor_class(deferred: type[DeferredParameter]) -> type | None:
    """The ``DTensor`` subclass a DTensor parameter takes where a plain one takes ``deferred`` (see
    [Note: deferred DTensor parameters]); ``None`` in a torch without DTensors."""
    base = dtensor_class()
    if base is None:
        return None
    name = deferred.__name__.replace("Parameter", "DTensor")
    namespace = {"__slots__": (), "deferred": deferred, "__module__": __name__, "__qualname__": name}
    return type(name, (_DeferredDTensor, base), namespace)


def restore_class(param: torch.Tensor) -> None:
    """Give ``param`` its own class back if it has ``GatheringParameter`` or its DTensor counterpart."""
    if type(param) is GatheringParameter:
        param.__class__ = torch.nn.Parameter
    elif type(param) is deferred_dtensor_class(GatheringParameter):
        param.__class__ = dtensor_class()


class GatheringParameter(DeferredParameter):
    """The class of a parameter whose gather is in flight (see [Note: parameter gather]).

    Never constructed: a plain ``nn.Parameter``'s ``__class__`` is set to it
    and set back once its block arrived.
    """

    @staticmethod
    @between_graphs  # [Note: hooks under torch.compile] in ``params.module_hooks``
    def on_use(param: torch.Tensor, name: str | None) -> None:
        """Wait for the block (the operation reads values)."""
        del name
        _arrive(param)


def _arrive(param: torch.Tensor) -> None:
    """Wait for ``param``'s block (which restores its class); restore it anyway if its gather is gone."""
    ref = _OWNERS.get(param)
    owner = ref() if ref is not None else None
    if owner is not None:
        owner.wait_for(param)
    restore_class(param)


def _arrive_all(params: Sequence[torch.Tensor], module: torch.nn.Module, args: Any) -> None:
    """A compiled block's pre-hook: its parameters still gathering arrive before its graph runs."""
    del module, args
    gathering = (GatheringParameter, deferred_dtensor_class(GatheringParameter))
    for param in params:
        if type(param) in gathering:
            _arrive(param)


#: Each gathering parameter's ParamGather, held weakly (the optimizer may be dropped mid-gather).
_OWNERS: Owners[weakref.ref[ParamGather]] = Owners()


def swappable(spec: ParamSpec, param: torch.Tensor) -> bool:
    """Whether ``param``'s class is swapped while its values are elsewhere (decided once, at install).

    The spec decides: a plain spec (``placement=()``) is one local tensor, split over data-parallel
    ranks only, and its ``nn.Parameter`` takes a deferred class (:class:`GatheringParameter`, stage
    3's ``ShardedParameter``) until its values arrive. A placed spec (a DTensor's, [Note: placements]
    in ``zeroplan.core.placement``) is a DTensor's local tensor, which is not swapped: its DTensor is
    ([Note: deferred DTensor parameters]). A ``torch.Tensor`` that is no ``nn.Parameter`` is not
    swapped either: the deferred classes are parameters, and its own class could not be given back.
    """
    return not spec.placement and isinstance(param, torch.nn.Parameter)


#: ParamGathers with gathers in flight, held strongly (the optimizer may be gone already), so that
#: those gathers are retired before the interpreter exits.
_IN_FLIGHT: set[ParamGather] = set()


@atexit.register
def _retire_at_exit() -> None:
    """Complete the gathers of the last ``step()`` before exit (or after ``destroy_process_group``).

    A collective nobody waited for may still hold a tensor when the interpreter
    finalizes, which aborts the process ([Note: retiring a collective] in
    ``collectives``); a job that ends right after ``step()`` must not crash.
    """
    for gather in list(_IN_FLIGHT):
        try:
            gather.finish_param_sync()
        except Exception:  # a destroyed group: nothing is left to wait for
            gather.forget()


class ParamGather:
    """Replicated residency: the parameter gathers of one installed plan (see [Note: parameter
    gather]; it implements :class:`~zeroplan.facade.params.residency.Residency`)."""

    def __init__(
        self,
        *,
        zp: ZeroPlan,
        params: Sequence[torch.Tensor],
        buffers: Sequence[FlatBuffers],
        groups: ProcessGroups,
        owners: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """``owners``: per parameter, the user's tensor (a ``DTensor`` whose local tensor is in
        ``params``, or the parameter itself): a DTensor takes the deferred class instead of its local
        tensor ([Note: deferred DTensor parameters])."""
        self._zp = zp
        self._buffers = buffers
        self._groups = groups
        self.overlap = zp.options.overlap_param_gather  # [Note: plan options]
        # Per (space, block), the tensors whose class follows it (its parameters, or their DTensors);
        # per parameter and DTensor (by identity), its blocks.
        self._members: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._blocks_of: dict[int, list[tuple[int, int]]] = {}
        kept: set[tuple[int, int]] = set()  # blocks with a member that is not swapped
        for buf in buffers:
            blocks = zp.gather_blocks(buf.space)  # [Note: gather blocks] in zeroplan.core.planner
            starts = [b.start for b in blocks]
            for index, offset in zip(buf.space.params, buf.space.buffer_offsets, strict=True):
                stop = offset + params[index].numel()
                k = max(bisect_right(starts, offset) - 1, 0)
                keys = [(buf.space.index, k)]
                while k + 1 < len(blocks) and starts[k + 1] < stop:  # a parameter cut by a block boundary
                    k += 1
                    keys.append((buf.space.index, k))
                owner = params[index] if owners is None else owners[index]
                self._blocks_of[id(params[index])] = self._blocks_of[id(owner)] = keys
                for key in keys:
                    self._members.setdefault(key, []).append(owner)
                    if owner is params[index] and not swappable(zp.specs[index], owner):
                        kept.add(key)
        # The blocks whose members all take a deferred class while in flight (see :func:`swappable`).
        self._swapped = frozenset(self._members.keys() - kept)
        self._pending: dict[tuple[int, int], list[Pending]] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._self = weakref.ref(self)
        # Per space, its parameters: their version counters move with every in-place write through
        # them (model.load_state_dict, p.copy_, p.clamp_), never with this optimizer's own writes,
        # which go into the flat buffer they view.
        self._space_params = [[params[i] for i in buf.space.params] for buf in buffers]
        self._settled: list[int] = []
        self._settle()
        # Under a parameter wire the parameters hold their pieces' decoded values ([Note: wire formats]).
        self._gather = gather_for(zp)  # [Note: gather policy]
        self._published = [self._gather.published(buf.space, groups.shard_rank) for buf in buffers]
        # A host step releases blocks as its units arrive ([Note: offload, executed]): in this order,
        # the same on every rank; ``_released`` counts those started in this step.
        self._releases = sorted(
            (bucket, b, k)
            for b, buf in enumerate(buffers)
            for k, bucket in enumerate(gather_release(zp, buf.space.index))
            if bucket is not None
        )
        self._released = 0

    def _versions(self) -> list[int]:
        """Per space, the sum of its parameters' version counters (a loop, not a generator per item)."""
        out = []
        with torch._C.DisableTorchFunctionSubclass():  # a parameter still gathering: its counter, unhooked
            for members in self._space_params:
                total = 0
                for p in members:
                    total += p._version
                out.append(total)
        return out

    def _settle(self) -> None:
        """Note the parameters' versions once this optimizer's writes into them are done."""
        self._settled = self._versions()

    def keep_param_writes(self) -> None:
        """Before a step: keep what was written into bf16/fp16 parameters since the last gather.

        See [Note: parameter writes]. Only spaces whose parameters were written
        since (a version counter moved: an in-place write through a parameter
        bumps it) are compared with their masters.
        """
        self.finish_param_sync()
        versions = self._versions()
        spaces = zip(self._buffers, self._published, self._settled, versions, strict=True)
        written = False
        for buf, published, settled, now in spaces:
            if now != settled:
                buf.keep_param_writes(published)
                written = True
        if written:
            self._settle()
        else:  # nothing written since the last look: the versions just read are the settled ones
            self._settled = versions

    def start_released(self, bucket: int, log: CommLog) -> None:
        """A host step stepped (and sent back) every unit up to ``bucket``'s: start the gathers of the
        blocks that leaves complete on every rank ([Note: offload, executed]), after the copies."""
        releases, first = self._releases, self._released
        while self._released < len(releases) and releases[self._released][0] <= bucket:
            _, b, k = releases[self._released]
            self._released += 1
            buf = self._buffers[b]
            if self._released == first + 1:
                join_side_stream(buf.params.device)  # the gathers read what the side stream copied
            block = self._zp.gather_blocks(buf.space)[k]
            pending = self._gather.start_block(buf.params, buf.space, block, self._groups, log)
            if pending:
                self._pending[buf.space.index, k] = pending

    def start_param_sync(self, log: CommLog, *, published: bool = False) -> None:
        """Publish this rank's updated shards (unless the step did, ``published``) and start every
        block's gather not started yet (:meth:`start_released`); finished unless overlapping.

        A host step's blocks start in the release order first (some ranks released fewer during
        their step: every rank launches the same sequence), then the others in buffer order.
        """
        if self._releases:
            self.start_released(self._releases[-1][0], log)
        early = {(b, k) for _, b, k in self._releases[: self._released]}
        self._released = 0
        if not early:
            self.finish_param_sync()
        for buf in () if published else self._buffers:
            buf.publish_master()
        for b, buf in enumerate(self._buffers):
            for k, block in enumerate(self._zp.gather_blocks(buf.space)):
                if (b, k) in early:
                    continue
                pending = self._gather.start_block(buf.params, buf.space, block, self._groups, log)
                if pending:
                    self._pending[buf.space.index, k] = pending
        if not self._pending:  # nothing to gather (a world of one): the writes are done
            self._settle()
            return
        if not self.overlap:
            self.finish_param_sync()
            return
        _IN_FLIGHT.add(self)
        for key in list(self._pending):
            members = self._members.get(key, [])
            if key not in self._swapped:
                self._finish_block(key)  # a plain tensor among its members: not swapped, so not deferred
                continue
            plain, placed = dtensor_class(), deferred_dtensor_class(GatheringParameter)
            for p in members:
                if _OWNERS.get(p) is not self._self:  # claimed once, not every step
                    _OWNERS.claim(p, self._self)
                p.__class__ = placed if plain is not None and isinstance(p, plain) else GatheringParameter

    def _finish_block(self, key: tuple[int, int]) -> None:
        for p in self._pending.pop(key, ()):
            p.finish()
        if not self._pending:
            _IN_FLIGHT.discard(self)
            self._settle()
        pending = self._pending
        gathering = (GatheringParameter, deferred_dtensor_class(GatheringParameter))
        for param in self._members.get(key, ()):
            kind = type(param)
            if kind not in gathering:
                continue
            keys = self._blocks_of[id(param)]
            if len(keys) > 1 and any(k in pending for k in keys):  # cut by a block boundary
                continue
            # restore_class, inline: no Python call per parameter and step (test_host_work counts them)
            param.__class__ = torch.nn.Parameter if kind is GatheringParameter else dtensor_class()

    def finish_param_sync(self) -> None:
        """Finish every gather in flight, in the order they started."""
        for key in list(self._pending):
            self._finish_block(key)
        _IN_FLIGHT.discard(self)

    def wait_for(self, param: torch.Tensor) -> None:
        """Complete the gathers of the blocks holding ``param``."""
        for key in self._blocks_of.get(id(param), ()):
            self._finish_block(key)

    # ------------------------------------------------------- the residency's life
    def settle(self, model: torch.nn.Module | None) -> None:
        """Nothing to do: replicated parameters rest whole, in place."""

    def attach(self, model: torch.nn.Module) -> None:
        """Hook ``model``'s compiled blocks: each waits for its parameters' gathers before its graph
        runs (see [Note: hooks under torch.compile]); elsewhere a parameter's first use waits."""
        self._detach()
        for block in compiled_blocks(model)[0]:
            members = [p for p in block.parameters() if id(p) in self._blocks_of]
            self._hooks.append(block.register_forward_pre_hook(partial(_arrive_all, members)))

    def _detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def prepare_replan(self) -> None:
        """The parameters already hold their whole values once the gathers finished."""
        self.finish_param_sync()

    def retire(self) -> None:
        """Nothing is held beyond the gathers, which re-planning finished; the hooks go."""
        self._detach()

    @contextlib.contextmanager
    def gathered(self, *, writeback: bool) -> Iterator[None]:
        """The parameters whole (every gather finished); with ``writeback``, masters take what was written."""
        self.finish_param_sync()
        yield
        if writeback:
            for buf, published in zip(self._buffers, self._published, strict=True):
                if published is None:
                    buf.load_master()
                else:  # the master keeps its bits wherever nothing was written
                    buf.keep_param_writes(published)

    def detached(self, params: Sequence[torch.Tensor], links: Sequence[tuple[int, int]]) -> int | None:
        """The first trainable parameter whose ``.data`` no longer views its place in the flat buffer.

        ``links`` holds each one's data pointer as installed: the flat buffers stay allocated, so no
        other storage can start there, and equal pointers mean the same place in the same buffer
        (compared without building a storage object per parameter and step).
        """
        with torch._C.DisableTorchFunctionSubclass():  # a parameter still gathering, unhooked
            for index, pointer in links:
                if params[index].data_ptr() != pointer:
                    return index
        return None

    def forget(self) -> None:
        """Drop what is in flight without waiting (the process group is gone); restore the classes."""
        self._pending = {}
        _IN_FLIGHT.discard(self)
        for members in self._members.values():
            for param in members:
                restore_class(param)
