"""The phases of one optimizer step, and the state that lives for one step.

[Note: step lifecycle]
Every step walks the same phases, forward only::

    IDLE --no_sync backward--> ACCUMULATING --backward--> REDUCING --reduce--> REDUCED --clip--> CLIPPED
      |                                                      ^                  |                 |
      +-----------------------backward-----------------------+                  +------step-------+
                                                                                                  |
    IDLE <-- PUBLISHED <-- STEPPED <--------------------------------------------------------------+

* ``IDLE``: no gradient arrived since the last ``step()`` or ``zero_grad()``.
* ``ACCUMULATING``: backward passes inside ``no_sync()`` accumulate gradients
  locally.
* ``REDUCING``: a backward pass outside ``no_sync()`` runs; each bucket is
  reduced as soon as it is full. A later ``no_sync()`` backward in the same
  step is refused: its gradients could no longer join the reduction.
* ``REDUCED``: ``clip_grad_norm_``, ``step``, ``grad_norm`` or
  ``averaged_gradients`` finished the reduction. First every rank agreed (one
  small all-reduce, a control call of the step: [Note: control calls] in
  ``zeroplan.core.comm``) that none of its
  parameters was detached from the flat buffers and that all hold the same
  hyper-parameters. This rank's *master gradients* (the shard the inner
  optimizer reads) are then averaged over the world and unscaled, and every
  rank knows whether any gradient overflowed (``found_inf``). ``grad_norm``
  and ``averaged_gradients`` only read them: the phase stays ``REDUCED`` (or
  ``CLIPPED``), and their collectives are not counted in the step's traffic.
* ``CLIPPED``: ``clip_grad_norm_`` scaled them; once per step.
* ``STEPPED``: the inner optimizer updated this rank's shard (not on overflow).
* ``PUBLISHED``: the updated shards were gathered into every rank's
  parameters; ``step()`` returns and the next step starts ``IDLE``.

``zero_grad()``, re-planning and loading state return to ``IDLE`` from any
phase and drop the master gradients. Calls out of order raise
:class:`~zeroplan.core.StepOrderError` from this module and nowhere else:
``step``/``clip_grad_norm_``/``grad_norm``/``averaged_gradients`` before any backward,
clipping twice, a backward between the reduction and ``step()``, a
``no_sync()`` backward after a synchronised one.

:class:`StepLifecycle` owns the phase and the per-step state (master
gradients, overflow flag, the log of collectives); what the last completed
step did is kept in :class:`StepRecord`.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core import CommCost, ConfigError, Span, StepOrderError, ZeroPlan, norm_windows, tensor_replicas
from zeroplan.facade.mechanisms.collectives import (
    CommLog,
    all_reduce_shard,
    all_reduce_world,
    to_device,
)
from zeroplan.facade.mechanisms.gathering import PlainGather
from zeroplan.facade.mechanisms.reduction import local_norm
from zeroplan.facade.params.buffers import SpaceBuffers, cut_kept, kept_window, param_views, write_pieces
from zeroplan.facade.runtime.installed import Installed
from zeroplan.facade.state.inner import hyperparameter_digest, sync_hyperparameters

__all__ = [
    "Accumulation",
    "Phase",
    "StepContext",
    "StepLifecycle",
    "StepRecord",
    "norm_type_of",
]


class Phase(enum.Enum):
    """Where the current step is (see [Note: step lifecycle])."""

    IDLE = "idle"
    ACCUMULATING = "accumulating"
    REDUCING = "reducing"
    REDUCED = "reduced"
    CLIPPED = "clipped"
    STEPPED = "stepped"
    PUBLISHED = "published"


class Accumulation(enum.Enum):
    """What a backward pass does with finished buckets: reduce them, or keep them local (``no_sync``)."""

    REDUCE = "reduce"
    LOCAL = "local"


class StepRecord(NamedTuple):
    """What the last completed step did.

    Attributes:
        comm: its collectives, per (group, collective).
        clipped: whether ``clip_grad_norm_`` ran in it.
        applied: ``False`` when the update was skipped because a gradient overflowed.
    """

    comm: tuple[CommCost, ...] = ()
    clipped: bool = False
    applied: bool = True


class StepContext(NamedTuple):
    """What a step needs from the optimizer besides its installed plan.

    Attributes:
        divisor: what summed gradients are divided by (world size times loss scale).
        param_groups: the user's param groups: hyper-parameters to apply and to agree on.
        params: every parameter, by plan index.
        names: their names, for error messages.
    """

    divisor: float
    param_groups: Sequence[dict[str, Any]]
    params: Sequence[torch.Tensor]
    names: Sequence[str]


_REDUCIBLE = (Phase.IDLE, Phase.ACCUMULATING, Phase.REDUCING)
_NO_GRADIENT = (
    "{call} before any backward pass: no gradient arrived since the last step() or zero_grad(), so it "
    "would apply nothing (or weight decay alone). Run the backward pass first (opt.backward(loss) or "
    "loss.backward())"
)


class StepLifecycle:
    """The phase of the current step and its state; every transition happens here."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self.accumulation = Accumulation.REDUCE
        self.log = CommLog()
        self.master_grads: list[MasterGrads] = []
        self.found_inf = False
        self.clipped = False
        self.last = StepRecord()
        self._local = _Local(None, None)
        self._windows: tuple[ZeroPlan, tuple[tuple[Span, ...], ...]] | None = None

    # ------------------------------------------------------------ backward
    def admit_gradient(self, name: str) -> bool:
        """Called by the gradient hook of parameter ``name``; returns whether buckets reduce now.

        Raises:
            StepOrderError: the reduction of this step already finished, or a
                ``no_sync()`` gradient arrives after a synchronised backward began.
        """
        if self.phase not in _REDUCIBLE:
            raise StepOrderError(
                f"parameter {name!r} received a gradient after this step's gradients were reduced "
                f"(phase {self.phase.value}: clip_grad_norm_, grad_norm, averaged_gradients or step already "
                "ran); call step() (or zero_grad()) between backward passes, or accumulate inside "
                "`with optimizer.no_sync():`"
            )
        if self.accumulation is Accumulation.LOCAL:
            if self.phase is Phase.REDUCING:
                raise StepOrderError(
                    f"parameter {name!r} received a second gradient, inside no_sync(), after this "
                    "step's synchronised backward started reducing: it could not join the reduction. "
                    "Run the no_sync() backward passes first and the synchronised one last, or call "
                    "step() (or zero_grad()) in between"
                )
            self.phase = Phase.ACCUMULATING
            return False
        self.phase = Phase.REDUCING
        return True

    @contextlib.contextmanager
    def local_accumulation(self) -> Iterator[None]:
        """``no_sync()``: backward passes inside the block accumulate gradients without reducing."""
        previous, self.accumulation = self.accumulation, Accumulation.LOCAL
        try:
            yield
        finally:
            self.accumulation = previous

    # ------------------------------------------------------------ reduce
    def start_reduce(
        self, inst: Installed, ctx: StepContext, call: str, *, idle_ok: bool = False
    ) -> torch.Tensor | None:
        """Finish the reduction, average and unscale, and start the step's verdict, reading nothing.

        Returns the verdict as a device tensor of ``VERDICT_LENGTH`` integers
        (the step agreement, then this domain's overflow flag), to be read
        once, with other domains' ([Note: one host read]), and handed to
        :meth:`settle`; ``None`` once reduced in this step. ``call`` names the
        public method for error messages. ``idle_ok``: no gradient arrived here
        but the step has some elsewhere (another domain of this rank, see
        [Note: expert domains]): reduce zeros instead of refusing. Nothing the
        step changes (parameters, masters, optimizer state) is touched until
        :meth:`settle`; a refused step keeps the averaged gradients for a retry.
        """
        if self.phase in (Phase.REDUCED, Phase.CLIPPED):
            return None
        if self.phase is Phase.IDLE and inst.zp.partition.spaces and not idle_ok:
            raise StepOrderError(_NO_GRADIENT.format(call=call))
        if self.phase not in _REDUCIBLE:
            raise StepOrderError(
                f"{call} in phase {self.phase.value}: the previous step() did not complete; "
                "call zero_grad() to start a new step"
            )
        inst.residency.finish_param_sync()  # the last step's gathers, if no forward waited for them all
        inst.sync.finish_grad_sync()
        inst.stepping.landed()  # gradients in host memory: the host waits for their copies
        flags, self._local = _start_agreement(inst, ctx, self.log)
        if not self.master_grads:  # averaged once per step, kept if the verdict refuses the step
            self.master_grads = [_averaged(buf, ctx.divisor) for buf in inst.buffers]
        overflow = torch.zeros(1, dtype=torch.float32, device=inst.device)
        if inst.zp.loss_scaling:
            for grad, buf in zip(self.master_grads, inst.buffers, strict=True):
                for part in grad.parts(Span(0, buf.extent)) if buf.extent else ():
                    overflow = torch.maximum(overflow, (~torch.isfinite(part.sum())).float())
            all_reduce_shard(overflow, dist.ReduceOp.MAX, inst.groups, self.log)
        return torch.cat([flags, overflow.to(torch.int64)])

    def settle(self, inst: Installed, ctx: StepContext, call: str, verdict: Sequence[int]) -> None:
        """Raise on every rank unless every rank agreed; else hand the gradients to the step (``-> REDUCED``).

        ``verdict``: what :meth:`start_reduce` returned, read; its overflow flag
        may be the whole model's (several domains, [Note: joint step]).
        Parameters written since the last step are taken into the masters only
        here, once every rank agreed ([Note: parameter writes]).
        """
        counts = inst.reduction.counts_micro_batches
        _check_agreement(ctx, call, self._local, verdict[: VERDICT_LENGTH - 1], counts)
        inst.residency.keep_param_writes()  # [Note: parameter writes]; only once every rank agreed
        self.found_inf = verdict[VERDICT_LENGTH - 1] > 0
        for spec, tensor in zip(inst.inner.specs, inst.inner.tensors, strict=True):
            tensor.grad = self.master_grads[spec.space].window(spec.shard_span).view(spec.shape)
        self.phase = Phase.REDUCED

    def shard_norm(self, inst: Installed, norm_type: float, log: CommLog) -> torch.Tensor:
        """The domain's gradient norm (after :meth:`reduce`), identical on every rank of the shard group.

        Computed as the reduction policy says ([Note: reduction policy]): this
        rank's part (:meth:`local_norm`) combined over the shard group by one
        scalar all-reduce, or (deterministic mode) summed exactly; logged in
        ``log`` (a throwaway log for inspection).
        """
        return inst.reduction.shard_norm(self._parts(inst), norm_type, inst.device, log)

    def replica_free_norm(self, inst: Installed, norm_type: float, log: CommLog) -> torch.Tensor:
        """:meth:`shard_norm` without the parameters every ``tp`` rank holds whole (another ``tp``
        rank counts them: [Note: tensor-parallel parameters] in ``zeroplan.core.tensor_parallel``)."""
        if self._windows is None or self._windows[0] is not inst.zp:  # once per plan, not per step
            extents = [buf.extent for buf in inst.buffers]
            skip = tensor_replicas(inst.zp.specs)
            self._windows = (inst.zp, norm_windows(inst.zp.partition, inst.groups.shard_rank, extents, skip))
        parts = [
            part
            for grad, windows in zip(self.master_grads, self._windows[1], strict=True)
            for w in windows
            for part in grad.parts(w)
        ]
        return inst.reduction.shard_norm(parts, norm_type, inst.device, log)

    def _parts(self, inst: Installed) -> list[torch.Tensor]:
        """The master gradients of this rank's shard, without the buffers' padding."""
        return [
            part
            for grad, buf in zip(self.master_grads, inst.buffers, strict=True)
            for part in grad.parts(Span(0, buf.extent))
        ]

    def check_unclipped(self) -> None:
        """Raise unless this step can still be clipped.

        Raises:
            StepOrderError: ``clip_grad_norm_`` already ran in this step.
        """
        if self.phase is Phase.CLIPPED:
            raise StepOrderError(
                "clip_grad_norm_ was already called in this step; clip once between backward and step()"
            )

    def local_norm(self, inst: Installed, norm_type: float) -> torch.Tensor:
        """This rank's part of the gradient norm (after :meth:`reduce`): the sum of ``|g|^p``, or the max.

        Its shard's elements only; summing (or maxing) it over the shard group
        gives the domain's norm to the ``p``; ``reduction.finish_norm`` takes the root.
        """
        return local_norm(self._parts(inst), norm_type, inst.device)

    def apply_clip(self, total: torch.Tensor, max_norm: float) -> None:
        """Scale the master gradients so a norm of ``total`` becomes at most ``max_norm`` (``-> CLIPPED``)."""
        coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for grad in (t for g in self.master_grads for t in g.tensors()):
            grad.mul_(coefficient.to(device=grad.device, dtype=grad.dtype))  # masters in host memory
        self.clipped = True
        self.phase = Phase.CLIPPED

    # ------------------------------------------------------------ step
    def step(self, inst: Installed, ctx: StepContext, **kwargs: Any) -> bool:
        """Reduce if needed, update the shard, publish it, end the step; ``False`` if skipped (overflow).

        ``kwargs`` go to the inner optimizer's ``step``. Settings the inner
        optimizer writes into its param groups while stepping are copied back
        into the user's groups.
        """
        self._require_reduced("step()")
        applied = not self.found_inf
        if applied:
            inner = inst.inner.optimizer
            sync_hyperparameters(ctx.param_groups, inner.param_groups)
            # On the device, or on the host unit by unit, releasing gathers ([Note: offload, executed]).
            inst.stepping.step(inst.inner, kwargs, partial(inst.residency.start_released, log=self.log))
            sync_hyperparameters(inner.param_groups, ctx.param_groups)
            self.phase = Phase.STEPPED
            self.publish(inst)
            self.phase = Phase.PUBLISHED
        self.release(inst)
        self.last = StepRecord(comm=self.log.summary(), clipped=self.clipped, applied=applied)
        self.log.clear()
        self.clipped = False
        return applied

    def publish(self, inst: Installed) -> None:
        """Write updated shards into the parameter buffers and gather them (see [Note: parameter gather])."""
        inst.residency.start_param_sync(self.log, published=inst.stepping.publishes)

    def release(self, inst: Installed) -> None:
        """Drop the master gradients and this step's reduction progress (``-> IDLE``)."""
        for tensor in inst.inner.tensors:
            tensor.grad = None
        self.master_grads = []
        self.found_inf = False
        inst.sync.reset()
        self.phase = Phase.IDLE

    def _require_reduced(self, call: str) -> None:
        """Raise unless :meth:`settle` ran in this step (``JointStep.reduce`` settles every domain first)."""
        if self.phase not in (Phase.REDUCED, Phase.CLIPPED):
            raise StepOrderError(f"{call} in phase {self.phase.value}: the step was not reduced")

    # ------------------------------------------------------------ inspection
    @torch.no_grad()
    def averaged_gradients(self, inst: Installed, ctx: StepContext) -> list[torch.Tensor | None]:
        """The master gradients, whole, per parameter (``None`` if frozen); collective, not logged."""
        self._require_reduced("averaged_gradients()")
        result: list[torch.Tensor | None] = [None] * len(ctx.params)
        log = CommLog()  # not part of the step's traffic
        gradients = PlainGather(inst.zp)  # gradients travel as they are, whatever the parameters do
        for grads, buf in zip(self.master_grads, inst.buffers, strict=True):
            grad = grads.whole(inst.device)
            full = torch.zeros(buf.space.buffer_numel, dtype=grad.dtype, device=inst.device)  # gathered there
            write_pieces(grad, full, buf.space, inst.groups.shard_rank)
            for pending in gradients.start_space(full, buf.space, inst.groups, log).values():
                for p in pending:
                    p.finish()
            for index, view in param_views(full, buf.space, ctx.params).items():
                result[index] = view.clone()
        return result


def norm_type_of(value: float) -> float:
    """``value`` as a float norm type, refused unless it is > 0 or inf."""
    norm_type = float(value)
    if not (norm_type == math.inf or norm_type > 0):
        raise ConfigError(f"norm_type must be > 0 or inf, got {norm_type}")
    return norm_type


class _Local(NamedTuple):
    """What this rank found before the step agreement: the index of a detached parameter and of a
    gradient written back, or ``None`` (for the messages of the error it raises)."""

    detached: int | None
    rewritten: int | None
    uneven: int | None = None
    """Deterministic mode: this rank's count of micro-batches, when it is not a power of two."""
    unplanned: int | None = None
    """A parameter planned frozen that has a gradient (unfrozen without ``refresh_trainable()``)."""


VERDICT_LENGTH = 5
"""The step's verdict per domain: the agreement's four integers, then the overflow flag."""


def _start_agreement(inst: Installed, ctx: StepContext, log: CommLog) -> tuple[torch.Tensor, _Local]:
    """Start the step agreement: one all-reduce (MAX) of four integers over the world, not read here.

    A detached-parameter flag, a written-back-gradient flag and the
    hyper-parameter digest, once negated, so that equal digests on every rank
    show as ``max == -max(-digest)``; planned and logged as a control call
    ([Note: control calls] in ``zeroplan.core.comm``). The integers travel to
    the device without a host sync (``to_device``).
    """
    sync = inst.sync
    local = _Local(
        inst.detached(ctx.params), sync.written_back(), sync.uneven_micro_batches, sync.unplanned_gradient()
    )
    digest = hyperparameter_digest(ctx.param_groups)
    digest = inst.reduction.step_digest(digest, inst.sync.micro_batches)  # [Note: reduction policy]
    astray = local.detached is not None or local.uneven is not None or local.unplanned is not None
    values = [int(astray), int(local.rewritten is not None), digest, -digest]
    flags = to_device(values, torch.int64, inst.device)
    all_reduce_world(flags, dist.ReduceOp.MAX, inst.groups, log)
    return flags, local


class MasterGrads(NamedTuple):
    """A space's averaged gradients in the master dtype: ``rest`` the rank's gradient shard, or under a
    partial offload ([Note: kept on the device]) its elements from ``kept`` on, and ``head`` the
    first ``kept`` (on the device)."""

    kept: int
    head: torch.Tensor | None
    rest: torch.Tensor

    def window(self, span: Span) -> torch.Tensor:
        """Elements ``span`` (within one part), as a view."""
        return kept_window(span, self.kept, self.head, self.rest)

    def parts(self, span: Span) -> list[torch.Tensor]:
        """Elements ``span`` as views, cut where the kept part ends."""
        return [self.window(part) for part in cut_kept(span, self.kept)]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors that hold them."""
        return (self.rest,) if self.head is None else (self.head, self.rest)

    def whole(self, device: torch.device) -> torch.Tensor:
        """All of them as one flat tensor on ``device`` (the shard's coordinates): the shard, or a copy."""
        if self.head is None:
            return self.rest
        return torch.cat([self.head.to(device), self.rest.to(device)])


def _averaged(buf: SpaceBuffers, divisor: float) -> MasterGrads:
    """The rank's reduced gradient shard of ``buf``, in the master dtype, divided by ``divisor``."""

    def averaged(shard: torch.Tensor) -> torch.Tensor:
        grad = shard.to(buf.master_dtype) if shard.dtype != buf.master_dtype else shard  # stage 1, bf16
        return grad.div_(divisor)

    head = None if buf.kept_grad is None else averaged(buf.kept_grad)
    return MasterGrads(buf.kept, head, averaged(buf.grad_shard))


def _check_agreement(
    ctx: StepContext, call: str, local: _Local, flags: Sequence[int], counts_micro_batches: bool = False
) -> None:
    """Raise unless no rank's gradients or parameters went astray and all share settings (every rank
    reads the same ``flags``, so every rank raises alike). ``counts_micro_batches``: the reduction
    policy mixes the count of micro-batches into the digest ([Note: reduction policy])."""
    detached, rewritten, uneven, unplanned = local
    if unplanned is not None:
        raise ConfigError(
            f"{call}: parameter {ctx.names[unplanned]!r} has a gradient, but it was frozen when this "
            "optimizer planned its parameters: its requires_grad was turned on since, so the step would "
            "never update it. Call opt.refresh_trainable() on every rank after changing requires_grad "
            "(it keeps every parameter's optimizer state); nothing was changed"
        )
    if uneven is not None:
        raise ConfigError(
            f"{call}: deterministic=True, but this rank ran {uneven} backward passes in this step: "
            "each rank must run a power of two of micro-batches (G/W of the G canonical ones, "
            "no_sync() around all but the last), whose sums form whole subtrees of the canonical "
            "tree ([Note: deterministic mode]); nothing was changed. (A reentrant activation "
            "checkpoint, torch.utils.checkpoint(use_reentrant=True), runs backward passes of its own "
            "that count too: use use_reentrant=False)"
        )
    if detached is not None:
        raise ConfigError(
            f"{call}: parameter {ctx.names[detached]!r} no longer shares storage with the optimizer's flat "
            "buffer: its .data was replaced after the ZeroOptimizer was created (model.to(...), a copy "
            "assigned to param.data, load_state_dict(assign=True)), so updates would never reach the model. "
            "Move or convert the model before creating the optimizer, and load weights with "
            "model.load_state_dict(...) (which copies in place). With Hugging Face transformers, use "
            "zeroplan.facade.hf.ZeroTrainer instead of Trainer(optimizers=(ZeroOptimizer(...), ...)): "
            "Trainer and Accelerate move the model and wrap it in DistributedDataParallel"
        )
    if rewritten is not None:
        raise ConfigError(
            f"{call}: the gradient of parameter {ctx.names[rewritten]!r} was written after "
            "ZeroOptimizer took it for the reduction (stage 2: its .grad reappeared and would be "
            "ignored; stage 1: its gradient buffer, which holds the reduced shard, changed and would "
            "corrupt the update): the model is probably wrapped in DistributedDataParallel (which "
            "writes reduced gradients back), or .grad was changed by hand (torch.nn.utils."
            "clip_grad_norm_, GradScaler.unscale_: use opt.clip_grad_norm_ and "
            "ZeroOptimizer(loss_scale=...) instead). Do not wrap the model: ZeroOptimizer reduces "
            "gradients itself. With Hugging Face transformers use zeroplan.facade.hf.ZeroTrainer; "
            "with accelerate, do not prepare() the model"
        )
    if flags[0] > 0 or flags[1] > 0:
        raise ConfigError(
            f"{call}: another rank has a parameter detached from the optimizer's flat buffer, a gradient "
            "written back after the reduction, a gradient of a parameter unfrozen without "
            "refresh_trainable(), or (deterministic=True) a count of micro-batches that is not a power "
            "of two; see the error on that rank"
        )
    if flags[2] != -flags[3]:
        counts = (
            ", or (deterministic=True) ran different numbers of micro-batches in this step (each must "
            "run G/W of the G canonical ones)"
            if counts_micro_batches
            else ""
        )
        raise ConfigError(
            f"{call}: the ranks hold different hyper-parameters in param_groups (an edit such as "
            "param_groups[0]['lr'] = ... made on some ranks only, or a scheduler stepped on some ranks "
            f"only){counts}; every rank must step with the same settings"
        )
