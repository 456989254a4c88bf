"""Gradient reduction in buckets, overlapped with backward.

Takes: the gradients autograd hands the hooks; gives: each bucket staged and handed to the
reduction policy ([Note: reduction policy] in ``reduction``), whose sums land in this rank's
gradient shard (``SpaceBuffers.grad_shard``). The whole path: [Note: gradient path].

[Note: gradient sync]
A post-accumulate-grad hook first asks the step lifecycle to admit the
gradient (see [Note: step lifecycle]: it refuses one that arrives after the
reduction, and inside ``no_sync()`` it says to keep it local), then sends the
parameter to the step's staging schedule and carries out what it answers
([Note: staging schedule] in ``zeroplan.core.schedule``, the same coroutine the
planner replays to plan the peak, [Note: the step's peak]): nothing, for most
arrivals; when the next bucket's gradients have all arrived, open its staging
buffer (its room in the persistent arena, [Note: staging arena]), copy the
gradients in, free them (stage 2) or move them into the gradient buffer
(stage 1), and launch its reduction (its reduce-scatter, or reduce, over the
shard group starts asynchronously); or complete the oldest reduction, which
then starts its all-reduce over the replica group (MiCS). Buckets launch
strictly in the plan's order (the order of collectives must match on every
rank). Under the GLOO policy a bucket of equal pieces is reduce-scattered by
a point-to-point exchange into room after its gradients
(``StagingLayout.received``), and one of uneven pieces is all-reduced over
the whole data-parallel group (see [Note: collective policy]).

[Note: gradient path]
From the hook to the summed gradient shard, in four facade modules, each
entered once (``grad_sync`` -> ``reduction`` -> ``collectives``, into
``params.buffers``' gradient shard):

1. ``grad_sync.GradSync._on_grad`` (the post-accumulate-grad hook) reads
   ``.grad``, asks ``admit`` (the lifecycle's callback) whether to reduce, in
   deterministic mode hands the gradient to the policy's micro-batch tree
   (``Reduction.micro_batch_sums``), marks it ready and sends its index to the
   staging schedule (``zeroplan.core.schedule``), which answers the actions.
2. ``GradSync._carry_out`` carries them out: ``_stage`` (one foreach copy of
   the bucket's parts into its staging view), then ``_start_reduce``, which
   takes this rank's piece of ``SpaceBuffers.grad_shard`` and calls
   ``Reduction.start`` of the policy chosen once
   (``policies.reduction_for``, [Note: reduction policy]).
3. ``reduction.DefaultReduction.start`` / ``EncodedReduction.start`` /
   ``CanonicalReduction.start`` issue ``collectives``' primitives
   (``start_bucket_reduce``; ``start_piece_exchange`` with the codec's
   arithmetic of ``wire_codec``) and return an ``InFlight`` whose ``Pending``
   adds the pieces into the shard piece when it finishes.
4. A RETIRE action: ``GradSync._finish_oldest`` calls ``Reduction.finish``
   (on the side stream), which completes the sum into the gradient shard and
   starts the replica step (``collectives.start_replica_reduce``); a replica
   reduction left in flight comes back to ``grad_sync``, which waits for it in
   ``finish_grad_sync``. The lifecycle divides the shard afterwards (by the
   divisor ``joint`` takes from ``Reduction.divides_loss_by_world``).

Host work is per bucket, not per parameter (a GPU step is bound by it when
kernels are short). Per parameter, the hook only reads ``.grad``, asks the
lifecycle to admit it, marks it ready and sends its index to the schedule,
which counts down its buckets and, for an arrival that completes nothing,
answers one shared empty tuple. Per bucket, once: one ``torch._foreach_copy_``
of its gradient parts into staging views built at construction (a part that is
a whole parameter is copied from ``.grad`` as it is, with no view built per
step), at stage 1 one more into the gradient buffer, the releases, the launch
(one call into the policy).
The actions come from tables built once per plan (``ScheduleTables``), so a
step builds Python objects per bucket, not per parameter. The price is that a
gradient lives until its bucket is complete (the planner replays the same
schedule, so the planned peak includes it).

Stage 2 frees each ``.grad`` once all its buckets are staged, so a gradient
outlives its arrival until its last bucket is complete and its turn came. bf16/fp16
gradients are reduced in their dtype into room at the end of the staging
buffer (``StagingLayout.reduced``), summed over replicas there, and cast into
the fp32 gradient shard, so the step needs no fp32 copy. The sum is divided
(by the data-parallel world times the loss scale) afterwards, in fp32, where
DDP divides each rank's bf16/fp16 gradient first. Summing first is kept on
purpose: dividing by a power-of-two world is then exact, so the sum's own
rounding is the only one (the one a deterministic summation and fp32 wire
accumulation address); dividing first would round every rank's gradient
once more and push small fp16 gradients into subnormals the loss scale is
there to avoid; and a sum that overflows fp16 is caught by the loss scaler's
overflow check like any other overflow (bf16's range does not overflow). Stage 1 keeps every
``.grad`` as a view of the full gradient buffer between steps (a gradient
autograd allocated after ``zero_grad(set_to_none=True)`` is moved into it when
its buckets are staged, or at once inside ``no_sync()``, where the next
backward adds into it) and
reduces each bucket into the rank's own region of that buffer, in place: after
the reduction, ``.grad`` of the elements this rank owns holds the averaged
gradient, the others the local one.

``finish_grad_sync()`` (once per step, when the lifecycle reduces) stages and launches
what is left: parameters that got no gradient in this step contribute zeros,
and gradients accumulated under ``no_sync()`` but not touched by the last
backward are reduced as they are. With ``overlap=False`` nothing is staged
from hooks and ``finish_grad_sync()`` issues the very same collectives in the same
order, so results are bit-identical.

Sparse gradients (``nn.Embedding(sparse=True)``) are made dense by the hook.

On CUDA a bucket's completion (the wait for its reduction and the copy out of
staging) runs on the side stream, and ``finish_grad_sync()`` makes the compute
stream wait for it (rule 1 of [Note: streams] in ``collectives``).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch

from zeroplan.core import (
    BufferRole,
    Stage,
    StepOrderError,
    ZeroPlan,
    staging_arena,
    staging_layout,
)
from zeroplan.core.schedule import Action, ActionKind, schedule_tables, staging_schedule
from zeroplan.facade.mechanisms.accumulation import BackwardPasses
from zeroplan.facade.mechanisms.buffer_devices import device_for
from zeroplan.facade.mechanisms.collectives import (
    Pending,
    StreamMark,
    join_side_stream,
    mark_side_stream,
    on_side_stream,
    wait_for_mark,
)
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.mechanisms.reduction import InFlight, Reduction
from zeroplan.facade.params.buffers import SpaceBuffers, param_views
from zeroplan.facade.params.local_shards import take_gradient

__all__ = ["GradSync"]


def _call_weakly(method: weakref.WeakMethod, index: int, param: torch.Tensor) -> None:
    bound = method()
    if bound is not None:
        bound(index, param)


class _BucketCopies(NamedTuple):
    """A bucket's gradient parts: per part, its parameter, the slice of the flattened gradient it
    takes (``None``: the whole gradient) and its target in the staging buffer; the padding's views."""

    params: tuple[int, ...]
    spans: tuple[slice | None, ...]
    targets: tuple[torch.Tensor, ...]
    padding: list[torch.Tensor]


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
        reduction: Reduction,
        admit: Callable[[str], bool],
        device: torch.device,
        user_params: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self._zp = zp
        self._params = params
        # The tensors autograd writes: the parameters, or the DTensors whose local tensors they are
        # (their gradients are handed to the local tensors first, [Note: tensor-parallel parameters]).
        self._user_params = params if user_params is None else user_params
        self._names = names
        self._buffers = buffers
        self._groups = groups
        self._admit = admit
        self.reduction = reduction
        """How buckets are summed ([Note: reduction policy]), chosen once by ``policies``."""
        self._buckets = zp.buckets.buckets
        self._layouts = [staging_layout(zp, b, groups.shard_rank) for b in self._buckets]
        self._padding = [b.padding() for b in self._buckets]
        arena = staging_arena(zp, groups.shard_rank)  # [Note: staging arena] in zeroplan.core.arena
        self._offsets = arena.offsets
        self._device = device  # the parameters': its streams order the reduction ([Note: streams])
        self._arena = device_for(zp, BufferRole.STAGING, device).empty(arena.nbytes, torch.uint8)
        # [Note: staging schedule]: its tables are built once and read every step.
        self._tables = schedule_tables(zp)  # the plan's options.overlap_grad_reduce
        self._stagings = [self._staging_view(b) for b in range(len(self._buckets))]
        self._copies = [self._bucket_copies(b) for b in range(len(self._buckets))]
        self._grad_views: dict[int, torch.Tensor] = {}
        if zp.stage is Stage.OPTIMIZER:
            for buf in buffers:
                if buf.grads is None:  # build_flat_buffers allocates them for stage 1
                    raise RuntimeError("stage 1 needs full gradient buffers")
                self._grad_views.update(param_views(buf.grads, buf.space, params))
        self._trainable = sorted(zp.trainable_indices)
        trainable = set(self._trainable)
        self._frozen = [(i, self._user_params[i]) for i in range(len(zp.specs)) if i not in trainable]
        self._sums = reduction.micro_batch_sums()  # [Note: deterministic mode]: a tree, or None
        self._passes = BackwardPasses()
        self.uneven_micro_batches: int | None = None
        """Deterministic mode: a count of this step's micro-batches that is not a power of two."""
        self.last_arrivals: tuple[int, ...] | None = None
        """The order the last reduced step's gradients arrived in (``memory_report(arrivals=...)``)."""
        # The hooks hold the sync weakly: a dropped optimizer must not keep reducing gradients
        # (or stay alive through its parameters until the cycle collector runs).
        method = weakref.WeakMethod(self._on_grad)
        self._handles = [
            self._user_params[index].register_post_accumulate_grad_hook(partial(_call_weakly, method, index))
            for index in self._trainable
        ]
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget this step's progress, completing anything still in flight."""
        inflight, self._inflight = getattr(self, "_inflight", deque()), deque()
        replica, self._replica = getattr(self, "_replica", []), []
        opened, self._open = getattr(self, "_open", {}), {}
        del opened  # their room in the arena is free again
        if inflight or replica:  # completed on the side stream, as always ([Note: streams])
            with on_side_stream(self._device):
                for entry in inflight:  # waited for, never completed: nothing more is sent or written
                    entry.pending.abandon()
                for pending in replica:
                    pending.finish()
            join_side_stream(self._device)
        self._ready = [False] * len(self._zp.specs)
        if self._sums is not None:
            self._sums.reset()
        self._passes.reset()
        self.uneven_micro_batches = None
        self._arrivals: list[int] = []
        self._schedule = staging_schedule(self._zp, tables=self._tables)
        next(self._schedule)
        self._next = 0
        self._finished = False  # finish_grad_sync ran in this step
        self._written: list[int] | None = None  # stage 1: expected buffer versions, once all launched
        self._open: dict[int, torch.Tensor] = {}
        self._inflight: deque[InFlight] = deque()
        self._replica: list[Pending] = []
        self._retired: StreamMark | None = None  # the last retirement, on the side stream

    @property
    def micro_batches(self) -> int:
        """Backward passes of this step so far (deterministic mode counts them; 0 otherwise)."""
        return self._passes.count if self._sums is not None else 0

    def remove_hooks(self) -> None:
        """Detach from the parameters (before re-planning)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __del__(self) -> None:
        if hasattr(self, "_handles"):  # not when construction failed before hooking
            self.remove_hooks()

    # ------------------------------------------------------------------ hooks
    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        """Note the arrival of parameter ``index``'s gradient; a bucket it completes is staged and
        launched ([Note: gradient path])."""
        if param is not self._params[index]:  # a DTensor's: into its local tensor, in its placement
            take_gradient(param, self._params[index])
            param = self._params[index]
        grad = param.grad
        if grad is not None and grad.is_sparse:  # e.g. nn.Embedding(sparse=True)
            param.grad = grad.to_dense()  # buckets are dense; the update is the same
        if self._sums is not None:  # [Note: deterministic mode]: the tree, not autograd, adds
            reduce_now = self._admit(self._names[index])
            self._sums.add(index, param.grad, self._passes.current())
            param.grad = None
            if not reduce_now:
                return
            self._take_root(index, self._passes.count)
        elif not self._admit(self._names[index]):  # no_sync(): accumulate locally
            if self._grad_views:  # stage 1: in the gradient buffer, where the next backward adds
                self._into_views([index])
            return
        if self._ready[index]:
            raise StepOrderError(
                f"parameter {self._names[index]!r} received a second gradient after its reduction "
                "in this step; call step() (or zero_grad()) between backward passes, or accumulate "
                "inside `with optimizer.no_sync():`. Within one backward, a module used in two "
                "reentrant activation checkpoints (torch.utils.checkpoint(use_reentrant=True), whose "
                "segments run backward passes of their own) does this too: use use_reentrant=False"
            )
        self._ready[index] = True
        self._arrivals.append(index)
        actions = self._schedule.send(index)
        if actions:  # most arrivals complete no bucket: nothing to do
            self._carry_out(actions)

    def _take_root(self, index: int, micro_batches: int) -> None:
        """``.grad`` of parameter ``index`` becomes its micro-batch tree's sum (deterministic mode).

        A count that is not a power of two has no canonical tree: the partial
        sums are still added (the collectives go on, nothing hangs) and the
        step agreement raises on every rank.
        """
        assert self._sums is not None
        try:
            grad = self._sums.root(index, micro_batches)
        except ValueError:
            self.uneven_micro_batches = micro_batches
            grad = self._sums.root(index, 1 << (micro_batches - 1).bit_length())
        self._params[index].grad = grad
        self._into_views([index])

    def _into_views(self, indices: list[int]) -> None:
        """Stage 1: the gradients of parameters ``indices`` move into their views of the full
        gradient buffer, by one batched copy, and ``.grad`` becomes the view."""
        views: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        moved: list[int] = []
        for index in indices:
            view, grad = self._grad_views.get(index), self._params[index].grad
            if view is None or grad is None or grad.data_ptr() == view.data_ptr():
                continue
            if view.numel():  # an empty copy would still bump the buffer's version (see written_back)
                views.append(view)
                grads.append(grad)
            moved.append(index)
        if views:
            torch._foreach_copy_(views, grads)
        for index in moved:
            self._params[index].grad = self._grad_views[index]

    # ------------------------------------------------------------- staging
    def _carry_out(self, actions: Sequence[Action]) -> None:
        """Carry out the schedule's actions on tensors ([Note: staging schedule])."""
        moving: list[int] = []  # stage 1's released gradients, moved into the buffer before a launch
        for action in actions:
            if action.kind is ActionKind.RETIRE:  # rule 1 of [Note: streams]
                with on_side_stream(self._device):
                    self._finish_oldest()
                self._retired = mark_side_stream(self._device)
            elif action.kind is ActionKind.OPEN:
                # Its room may have been a retired bucket's: the side stream must be done with it.
                wait_for_mark(self._device, self._retired)
                self._open[action.bucket] = self._open_staging(action.bucket)
            elif action.kind is ActionKind.STAGE:
                self._stage(action.bucket)
            elif action.kind is ActionKind.RELEASE:
                if self._grad_views:
                    moving.append(action.param)
                else:
                    self._params[action.param].grad = None
            else:
                if moving:  # at stage 1 the reduction writes into the buffer: move them in first
                    self._into_views(moving)
                    moving = []
                self._start_reduce(action.bucket)
        if moving:
            self._into_views(moving)

    def _staging_view(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s staging buffer: its room in the arena, the same every step."""
        dtype = self._buffers[self._buckets[b].space].dtype
        return self._arena[self._offsets[b] :].view(dtype)[: self._layouts[b].numel]

    def _bucket_copies(self, b: int) -> _BucketCopies:
        """Where bucket ``b``'s gradient parts go in its staging buffer (views, built once).

        A part that is a whole parameter gets a target shaped as the parameter, so
        staging it takes the gradient as it is, with no view built per step.
        """
        staging = self._stagings[b]
        params, spans, targets = [], [], []
        for copy in self._buckets[b].copies:
            spec = self._zp.specs[copy.param]
            target = staging[copy.staging_offset : copy.staging_offset + copy.param_span.numel]
            whole = copy.param_span.start == 0 and copy.param_span.numel == spec.numel
            params.append(copy.param)
            spans.append(None if whole else copy.param_span.as_slice())
            targets.append(target.view(spec.shape) if whole else target)
        padding = [staging[span.as_slice()] for span in self._padding[b]]
        return _BucketCopies(tuple(params), tuple(spans), tuple(targets), padding)

    def _open_staging(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s staging buffer with its padding zeroed (it is reduced as zeros)."""
        padding = self._copies[b].padding
        if padding:
            torch._foreach_zero_(padding)
        return self._stagings[b]

    @property
    def arena(self) -> torch.Tensor:
        """The staging arena (bytes), for inspection: what it holds between steps is garbage."""
        return self._arena

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging arena (persistent)."""
        return self._arena.numel()

    def _stage(self, b: int) -> None:
        """Copy every gradient part of bucket ``b`` into its (open) staging buffer: one batched copy.

        A parameter with no gradient (none arrived this step) contributes zeros.
        """
        entry = self._copies[b]
        params = self._params
        sources: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        zeros: list[torch.Tensor] = []
        for index, span, target in zip(entry.params, entry.spans, entry.targets, strict=True):
            grad = params[index].grad
            if grad is None:
                zeros.append(target)
            else:
                sources.append(grad if span is None else grad.reshape(-1)[span])
                targets.append(target)
        if targets:
            torch._foreach_copy_(targets, sources)
        if zeros:
            torch._foreach_zero_(zeros)

    # ------------------------------------------------------------- launching
    def _start_reduce(self, b: int) -> None:
        """Launch bucket ``b``'s reduction into this rank's piece of the gradient shard, by the
        reduction policy ([Note: gradient path])."""
        bucket = self._buckets[b]
        piece = bucket.piece_of(self._groups.shard_rank)
        buf = self._buffers[bucket.space]
        output = buf.grad_window(piece.shard_span) if piece is not None else None
        self._launched(b, self.reduction.start(bucket, self._layouts[b], self._open[b], output))

    def _launched(self, b: int, entry: InFlight) -> None:
        del self._open[b]  # only now: a launch that raised leaves it open, for reset() to drop
        self._inflight.append(entry)
        self._next += 1
        if self._grad_views and self._next == len(self._buckets):
            self._written = self._grad_versions()  # stage 1: see written_back()

    def _finish_oldest(self) -> None:
        """Complete the oldest reduction in flight; it leaves the queue only once completed."""
        before = self._grad_versions()
        replica = self.reduction.finish(self._inflight[0])  # on the side stream ([Note: streams])
        if replica is not None:  # summed over the replicas in place, waited for at the step's end
            self._replica.append(replica)
        self._inflight.popleft()
        if self._written is not None:  # this optimizer's own writes into the gradient buffers
            after = self._grad_versions()
            self._written = [w + a - b for w, a, b in zip(self._written, after, before, strict=True)]

    def _grad_versions(self) -> list[int]:
        """Version counters of the stage-1 gradient buffers (every in-place write bumps them)."""
        return [buf.grads._version for buf in self._buffers if buf.grads is not None]

    def finish_grad_sync(self) -> None:
        """Stage and launch everything left, wait for all reductions of this step (once per step).

        Parameters that got no gradient in this step contribute zeros; gradients
        accumulated under ``no_sync()`` but untouched by the last backward are
        reduced as they are.
        """
        if self._finished:  # a step refused after its reduction is retried with what it reduced
            return
        if self._sums is not None:  # gradients of earlier micro-batches only: their trees end here
            for index in self._trainable:
                if not self._ready[index]:
                    self._take_root(index, self._passes.count)
        self._carry_out(self._schedule.send(None))
        with on_side_stream(self._device):  # rule 1 of [Note: streams]
            for pending in self._replica:
                pending.finish()
        join_side_stream(self._device)  # before anything reads a gradient shard
        self.last_arrivals = tuple(self._arrivals)
        self._replica = []
        self._finished = True

    def written_back(self) -> int | None:
        """After :meth:`finish`: a parameter whose gradient something wrote after this optimizer took it.

        A ``DistributedDataParallel`` wrapper writes reduced gradients back at
        the end of backward; ``torch.nn.utils.clip_grad_norm_`` or a
        ``GradScaler`` scale ``.grad``. At stage 2 the step would ignore such a
        write (``.grad`` reappeared after it was released); at stage 1, where
        the rank's region of the gradient buffer *is* its reduced shard, it
        would corrupt the step: any write into a gradient buffer after the last
        bucket launched, other than this optimizer's own, is reported (the
        buffer's version counter). The parameter named is the buffer's first.
        """
        if not self._grad_views:
            with torch._C.DisableTorchFunctionSubclass():  # stage 3: a sharded parameter's .grad, unhooked
                return next((i for i in self._trainable if self._params[i].grad is not None), None)
        if self._written is None or self._written == self._grad_versions():
            return None
        changed = next(
            i for i, (w, v) in enumerate(zip(self._written, self._grad_versions(), strict=True)) if w != v
        )
        spaces = [buf.space for buf in self._buffers if buf.grads is not None]
        return next((i for i in spaces[changed].params if i in self._grad_views), spaces[changed].params[0])

    def unplanned_gradient(self) -> int | None:
        """A parameter the plan holds frozen that has a gradient now, or ``None``.

        Its ``requires_grad`` was turned on without ``refresh_trainable()``: no hook
        takes its gradient, so the step would never update it (``torch.optim`` would).
        One attribute read per frozen parameter and step.
        """
        with torch._C.DisableTorchFunctionSubclass():  # stage 3: a sharded parameter's .grad, unhooked
            return next((i for i, p in self._frozen if p.grad is not None), None)

    def zero_grad(self, set_to_none: bool) -> None:
        """Reset every parameter's ``.grad`` as ``torch.optim.Optimizer.zero_grad`` would.

        At stage 1 with ``set_to_none=False`` the gradient buffers are zeroed and
        the trainable parameters' ``.grad`` stay (or become again) views of them.
        """
        # Deterministic mode: autograd must hand each micro-batch's gradient over, never add it.
        set_to_none = set_to_none or self._sums is not None
        keep_views = not set_to_none and bool(self._grad_views)
        if keep_views:
            for buf in self._buffers:
                if buf.grads is not None:
                    buf.grads.zero_()
            for index, view in self._grad_views.items():
                self._params[index].grad = view
        for user, param in zip(self._user_params, self._params, strict=True):
            if user is not param:  # a DTensor's gradient its hook did not take (none ran)
                user.grad = None
        with torch._C.DisableTorchFunctionSubclass():  # stage 3: sharded parameters' .grad, unhooked
            for index, param in enumerate(self._params):
                if (keep_views and index in self._grad_views) or param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_()
                    param.grad.requires_grad_(False)
                    param.grad.zero_()
