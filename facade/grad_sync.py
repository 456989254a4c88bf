"""Gradient reduction in buckets, overlapped with backward.

[Note: gradient sync]
A post-accumulate-grad hook first asks the step lifecycle to admit the
gradient (see [Note: step lifecycle]: it refuses one that arrives after the
reduction, and inside ``no_sync()`` it says to keep it local), then marks the
parameter ready. Buckets are launched
strictly in the plan's order (the order of collectives must match on every
rank), each as soon as all of its parameters are ready and every earlier
bucket has been launched: its gradients are copied into a staging buffer and
its reduce-scatter (or reduce) over the shard group starts asynchronously. At
most ``max_inflight_buckets`` staging buffers are alive; launching one more
first completes the oldest, which then starts its all-reduce over the replica
group (MiCS). Under the GLOO policy a bucket is instead all-reduced over the
whole data-parallel group (see [Note: collective policy]).

``finish()`` (once per step, when the lifecycle reduces) launches what is left: parameters that
got no gradient in this step contribute zeros, and gradients accumulated under
``no_sync()`` but not touched by the last backward are reduced as they are.
With ``overlap=False`` nothing launches from hooks and ``finish()`` issues the
very same collectives in the same order, so results are bit-identical.

Sparse gradients (``nn.Embedding(sparse=True)``) are made dense by the hook.
Stage 1 keeps every ``.grad`` as a view of the full gradient buffer (a
gradient autograd allocated after ``zero_grad(set_to_none=True)`` is moved
into it by the hook). Stage 2 frees each ``.grad`` once all its buckets are
staged, so full gradients are never all resident outside ``no_sync()``.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch

from zeroplan.core import Bucket, Collective, Stage, StepOrderError, ZeroPlan
from zeroplan.facade.buffers import SpaceBuffers, param_views
from zeroplan.facade.collectives import CommLog, Pending, all_reduce_replica, reduce_bucket
from zeroplan.facade.groups import ProcessGroups

__all__ = ["GradSync", "PeakTracker"]


class PeakTracker:
    """Bytes of transient buffers alive now, and the peak since the last reset."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def alloc(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor`` as alive; returns it."""
        self.current += tensor.numel() * tensor.element_size()
        self.peak = max(self.peak, self.current)
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Count ``tensor`` as released."""
        self.current -= tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        """Start a new peak measurement (buffers alive now still count)."""
        self.peak = self.current


def _call_weakly(method: weakref.WeakMethod, index: int, param: torch.Tensor) -> None:
    bound = method()
    if bound is not None:
        bound(index, param)


class _InFlight(NamedTuple):
    bucket: Bucket
    staging: torch.Tensor
    pending: Pending
    output: torch.Tensor | None


class GradSync:
    """Bucketed, ordered, overlapped gradient reduction (see [Note: gradient sync])."""

    def __init__(
        self,
        *,
        zp: ZeroPlan,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        buffers: Sequence[SpaceBuffers],
        groups: ProcessGroups,
        overlap: bool,
        admit: Callable[[str], bool],
        log: CommLog,
        tracker: PeakTracker,
    ) -> None:
        self._zp = zp
        self._params = params
        self._names = names
        self._buffers = buffers
        self._groups = groups
        self._overlap = overlap
        self._admit = admit
        self._log = log
        self._tracker = tracker
        self._buckets = zp.buckets.buckets
        self._grad_views: dict[int, torch.Tensor] = {}
        if zp.stage is Stage.OPTIMIZER:
            for buf in buffers:
                if buf.grads is None:  # build_buffers allocates them for stage 1
                    raise RuntimeError("stage 1 needs full gradient buffers")
                self._grad_views.update(param_views(buf.grads, buf.space, params))
        # The hooks hold the sync weakly: a dropped optimizer must not keep reducing gradients
        # (or stay alive through its parameters until the cycle collector runs).
        self._trainable = sorted(zp.trainable_indices)
        method = weakref.WeakMethod(self._on_grad)
        self._handles = [
            params[index].register_post_accumulate_grad_hook(partial(_call_weakly, method, index))
            for index in self._trainable
        ]
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget this step's progress, completing anything still in flight."""
        for entry in getattr(self, "_inflight", ()):
            entry.pending.wait()
            self._tracker.free(entry.staging)
        for pending in getattr(self, "_replica", ()):
            pending.wait()
        self._ready = [False] * len(self._zp.specs)
        self._missing = [len(b.params) for b in self._buckets]
        self._unstaged = [len(self._zp.buckets.buckets_of(s.index)) for s in self._zp.specs]
        self._next = 0
        self._inflight: deque[_InFlight] = deque()
        self._replica: list[Pending] = []

    def remove_hooks(self) -> None:
        """Detach from the parameters (before re-planning)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __del__(self) -> None:
        self.remove_hooks()

    # ------------------------------------------------------------------ hooks
    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if param.grad is not None and param.grad.is_sparse:  # e.g. nn.Embedding(sparse=True)
            param.grad = param.grad.to_dense()  # buckets are dense; the update is the same
        view = self._grad_views.get(index)
        if view is not None and param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view
        if not self._admit(self._names[index]):
            return  # no_sync(): accumulate locally
        if self._ready[index]:
            raise StepOrderError(
                f"parameter {self._names[index]!r} received a second gradient after its reduction "
                "in this step; call step() (or zero_grad()) between backward passes, or accumulate "
                "inside `with optimizer.no_sync():`"
            )
        self._ready[index] = True
        for b in self._zp.buckets.buckets_of(index):
            self._missing[b] -= 1
        if self._overlap:
            while self._next < len(self._buckets) and self._missing[self._next] == 0:
                self._launch(self._buckets[self._next])

    # ------------------------------------------------------------- launching
    def _launch(self, bucket: Bucket) -> None:
        while len(self._inflight) >= self._zp.max_inflight_buckets:
            self._retire(self._inflight.popleft())
        buf = self._buffers[bucket.space]
        staging = self._tracker.alloc(
            torch.empty(bucket.numel, dtype=buf.params.dtype, device=buf.params.device)
        )
        for copy in bucket.copies:
            target = staging[copy.staging_offset : copy.staging_offset + copy.param_span.numel]
            grad = self._params[copy.param].grad
            if grad is None:
                target.zero_()
            else:
                target.copy_(grad.reshape(-1)[copy.param_span.as_slice()])
        if self._zp.stage is not Stage.OPTIMIZER:
            for index in bucket.params:
                self._unstaged[index] -= 1
                if self._unstaged[index] == 0:
                    self._params[index].grad = None
        piece = bucket.piece_of(self._groups.shard_rank)
        output = buf.grad_shard[piece.shard_span.as_slice()] if piece is not None else None
        pending = reduce_bucket(staging, output, bucket, self._groups, self._log)
        self._inflight.append(_InFlight(bucket, staging, pending, output))
        self._next += 1

    def _retire(self, entry: _InFlight) -> None:
        entry.pending.wait()
        self._tracker.free(entry.staging)
        if entry.output is not None and entry.bucket.collective is not Collective.ALL_REDUCE:
            self._replica.append(all_reduce_replica(entry.output, self._groups, self._log))

    def finish(self) -> None:
        """Launch every remaining bucket and wait for all reductions of this step (once per step)."""
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
        while self._inflight:
            self._retire(self._inflight.popleft())
        for pending in self._replica:
            pending.wait()
        self._replica = []

    def written_back(self) -> int | None:
        """After :meth:`finish` at stage 2: a parameter whose ``.grad`` reappeared after it was released.

        Something wrote a gradient after this optimizer reduced it (a
        ``DistributedDataParallel`` wrapper does), which the step would ignore.
        """
        if self._grad_views:  # stage 1: .grad stays a view of the gradient buffer by design
            return None
        return next((i for i in self._trainable if self._params[i].grad is not None), None)

    def zero_grad(self, set_to_none: bool) -> None:
        """Reset every parameter's ``.grad`` as ``torch.optim.Optimizer.zero_grad`` would.

        At stage 1 with ``set_to_none=False`` the gradient buffers are zeroed and
        the trainable parameters' ``.grad`` stay (or become again) views of them.
        """
        keep_views = not set_to_none and bool(self._grad_views)
        if keep_views:
            for buf in self._buffers:
                if buf.grads is not None:
                    buf.grads.zero_()
            for index, view in self._grad_views.items():
                self._params[index].grad = view
        for index, param in enumerate(self._params):
            if (keep_views and index in self._grad_views) or param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.requires_grad_(False)
                param.grad.zero_()
