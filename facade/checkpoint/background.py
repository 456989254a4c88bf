"""Saves that do not stop training: a rank's files staged in host memory, written and sealed by a thread.

[Note: background saves]
``checkpoint.save(opt, root, blocking=False)``:

1. On the caller's thread, collectively: the snapshot's name is agreed as for
   any save, and each rank's files (their tensors) are copied into a staging
   buffer in host memory that is kept from save to save (pinned beside a GPU:
   the copies run on the side stream after it waited for the compute stream,
   and the compute stream waits for them before anything later can change
   the state; the host does not wait). What the manifest needs of the
   optimizer (hyper-parameters, loss scale, plan) is taken now too. Then
   ``save`` returns a :class:`SaveHandle`.
2. A thread writes the files, agrees with the other ranks' threads on the
   outcome over a gloo group of its own (``background_group``: never the
   step's groups, whose collectives the main thread issues), rank 0 seals the
   manifest and moves ``latest``, and the threads agree once more: exactly
   the steps of a blocking save, so ``latest`` never names an unsealed
   snapshot and a failure leaves the previous one.
3. ``handle.wait()``, the next ``save`` and ``load`` of the optimizer wait for
   the thread and raise its error: the same on every rank, since the threads
   agreed on it. One background save per optimizer is in flight at a time.

A process that ends before its thread finished leaves what an interrupted save
leaves: the previous snapshot ``latest`` and a ``.partial`` directory nothing
references.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroplan.facade.mechanisms.assembly import Assembly, FileTensor
from zeroplan.facade.mechanisms.collectives import (
    StreamMark,
    join_side_stream,
    mark_side_stream,
    on_side_stream,
)
from zeroplan.facade.mechanisms.groups import background_group

__all__ = [
    "SaveHandle",
    "Staging",
    "committed",
    "finish_pending",
    "stage",
    "staging_buffers",
    "staging_bytes",
    "start",
]

Files = list[tuple[str, dict[str, FileTensor]]]


class SaveHandle:
    """A save running in the background; :meth:`wait` returns its snapshot or raises its error."""

    def __init__(
        self, run: Callable[[dist.ProcessGroup], Path], group: dist.ProcessGroup, mark: StreamMark | None
    ) -> None:
        self._result: Path | None = None
        self._error: BaseException | None = None
        self.reported = False
        """Whether :meth:`wait` gave the outcome to the caller already (the next save does not raise it)."""
        self._thread = threading.Thread(
            target=self._run, args=(run, group, mark), name="zeroplan-save", daemon=True
        )
        self._thread.start()

    def _run(
        self, run: Callable[[dist.ProcessGroup], Path], group: dist.ProcessGroup, mark: StreamMark | None
    ) -> None:
        try:
            if mark is not None:
                mark.synchronize()  # the staging copies landed
            self._result = run(group)
        except BaseException as exc:  # raised by wait() on the caller's thread
            self._error = exc

    def done(self) -> bool:
        """Whether the snapshot is committed or the save failed (``wait()`` then returns at once)."""
        return not self._thread.is_alive()

    def succeeded(self) -> bool:
        """Whether the snapshot is committed (the thread ended without error); never waits."""
        return self.done() and self._error is None

    def wait(self) -> Path:
        """The committed snapshot, once written and sealed.

        Raises:
            CheckpointError: the save failed on some rank (raised on every rank); the previous
                snapshot stays ``latest``.
        """
        self._thread.join()
        self.reported = True
        if self._error is not None:
            raise self._error
        if self._result is None:  # unreachable: the thread either returned or failed
            raise RuntimeError("background save ended without a result")
        return self._result


class Staging:
    """This optimizer's host buffers for background saves, reused while the files keep their shapes."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, str], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(t.untyped_storage().nbytes() for t in self.buffers.values())

    def copy(self, files: Files, device: torch.device) -> tuple[Files, StreamMark | None]:
        """``files`` with every tensor copied into its staging buffer, and the mark the copies end at."""
        out: Files = []
        wanted = {(name, key) for name, tensors in files for key in tensors}
        for stale in set(self.buffers) - wanted:
            del self.buffers[stale]
        with on_side_stream(device):
            for name, tensors in files:
                staged = {}
                for key, tensor in tensors.items():
                    buf = self.buffers.get((name, key))
                    pinned = tensor.device.type == "cuda"
                    if buf is None or tuple(buf.shape) != tuple(tensor.shape) or buf.dtype != tensor.dtype:
                        buf = self.buffers[name, key] = torch.empty(
                            tensor.shape, dtype=tensor.dtype, pin_memory=pinned
                        )
                    if isinstance(tensor, Assembly):  # copied once, straight here
                        tensor.into(buf, non_blocking=pinned)
                    else:
                        buf.copy_(tensor.detach(), non_blocking=pinned)
                    staged[key] = buf
                out.append((name, staged))
        mark = mark_side_stream(device)
        join_side_stream(device)  # nothing later on the compute stream changes the state before the copies
        return out, mark


class _Background:
    """What one optimizer keeps for background saves: its staging and the save in flight."""

    def __init__(self) -> None:
        self.staging = Staging()
        self.handle: SaveHandle | None = None
        self.mark: StreamMark | None = None


_BY_OPTIMIZER: weakref.WeakKeyDictionary[Any, _Background] = weakref.WeakKeyDictionary()


def _of(opt: Any) -> _Background:
    found = _BY_OPTIMIZER.get(opt)
    if found is None:
        found = _BY_OPTIMIZER[opt] = _Background()
    return found


def finish_pending(opt: Any) -> Path | None:
    """Wait for ``opt``'s save in flight, if any: its snapshot, or its error raised (on every rank)."""
    found = _BY_OPTIMIZER.get(opt)
    if found is None or found.handle is None:
        return None
    handle, found.handle = found.handle, None
    if handle.reported:  # the caller's wait() returned or raised it already
        return None
    return handle.wait()


def committed(opt: Any) -> bool:
    """Whether ``opt`` has no save in flight or it committed; never waits, raises nothing.

    A thread that ended without error committed (its last agreement follows rank 0's commit), so
    what depends on the snapshot (deleting an older one) may go ahead; a failed save's error waits
    for the next ``wait()``, save or load, where every rank raises it.
    """
    found = _BY_OPTIMIZER.get(opt)
    if found is None or found.handle is None:
        return True
    return found.handle.succeeded()


def stage(opt: Any, files: Files, device: torch.device) -> Files:
    """``files`` copied into ``opt``'s staging buffers (reused; pinned beside a GPU)."""
    state = _of(opt)
    staged, state.mark = state.staging.copy(files, device)
    return staged


def staging_bytes(opt: Any) -> int:
    """Host bytes ``opt``'s background saves hold for staging (0 before the first)."""
    found = _BY_OPTIMIZER.get(opt)
    return 0 if found is None else found.staging.nbytes


def staging_buffers(opt: Any) -> list[torch.Tensor]:
    """``opt``'s staging buffers (for tests and tools: pinned beside a GPU)."""
    found = _BY_OPTIMIZER.get(opt)
    return [] if found is None else list(found.staging.buffers.values())


def start(opt: Any, run: Callable[[dist.ProcessGroup], Path], world: dist.ProcessGroup) -> SaveHandle:
    """Run ``run`` (write, agree, seal) on a thread, agreeing over ``world``'s background group."""
    state = _of(opt)
    group = background_group(world)
    state.handle = SaveHandle(run, group, state.mark)
    return state.handle
