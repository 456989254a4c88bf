"""``ZeroOptimizer``: a ``torch.optim.Optimizer`` that executes a zeroplan plan.

The class decides *when* things happen (hooks, step, clipping, re-planning);
``zeroplan.core`` decides every layout, and the functions of ``buffers``,
``grad_sync``, ``collectives`` and ``shard_state`` do the work.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BUCKET_BYTES,
    CommCost,
    ConfigError,
    MemoryReport,
    ParamSpec,
    ScalerConfig,
    ScalerState,
    Stage,
    Topology,
    ZeroPlan,
    ZeroplanError,
    describe_optimizer,
    initial_state,
    memory_report,
    plan,
    update,
)
from zeroplan.facade import replanning, state_loading
from zeroplan.facade.agreement import agree
from zeroplan.facade.buffers import SpaceBuffers, build_buffers, param_views
from zeroplan.facade.collectives import CommLog, all_reduce_shard, gather_space
from zeroplan.facade.consolidate import consolidated_state_dict
from zeroplan.facade.grad_sync import GradSync, PeakTracker
from zeroplan.facade.groups import ProcessGroups, data_parallel_group, make_groups
from zeroplan.facade.inner import (
    Inner,
    build_inner,
    check_hyperparameters,
    hyperparameters,
    sync_hyperparameters,
)
from zeroplan.facade.inputs import collect_params, describe_params
from zeroplan.facade.state_dicts import Shards, sharded_state_dict

__all__ = ["MeasuredMemory", "ZeroOptimizer"]


class MeasuredMemory(NamedTuple):
    """Bytes this rank holds, measured from its tensors (compare with ``memory_report``)."""

    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _scale_mode(loss_scale: float | str | None) -> float | str | None:
    if loss_scale is None or loss_scale == "dynamic":
        return loss_scale
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        if math.isfinite(loss_scale) and loss_scale > 0:
            return float(loss_scale)
    raise ConfigError(f"loss_scale must be None, a finite number > 0 or 'dynamic', got {loss_scale!r}")


class ZeroOptimizer(torch.optim.Optimizer):
    """Shards optimizer state (stage 1) and gradients (stage 2) across data-parallel ranks.

    Wraps any ``torch.optim.Optimizer`` class. The model is *not* wrapped in
    DDP: this optimizer reduces gradients itself, in buckets overlapped with
    backward. Parameters become views of flat buffers laid out by the plan.

    Args:
        params: what ``torch.optim`` accepts: tensors, ``(name, tensor)``
            pairs or param-group dicts.
        optimizer_class: the inner optimizer, e.g. ``torch.optim.AdamW``.
        stage: 1 (optimizer state and master weights sharded) or 2 (gradients too).
        process_group: the data-parallel group (default: the default group).
        shard_group_size: ranks per shard group (MiCS); default: the whole group.
        strategy: partition strategy name, or ``"auto"`` (``flat_even`` for
            elementwise optimizers, ``lpt_whole`` otherwise).
        bucket_bytes: byte cap of a gradient bucket.
        overlap_grad_reduce: launch reductions from backward hooks (``False``:
            all at ``step()``; results are bit-identical).
        loss_scale: ``None``, a static scale, or ``"dynamic"``.
        scaler: settings of the dynamic loss scale.
        alignment: elements; shard allocations and bucket bounds are multiples.
        max_inflight_buckets: staging buffers alive at once.
        collectives: ``"min_bytes"`` (reduce-scatter / all-gather), ``"gloo"``
            (all-reduce / broadcasts, faster on gloo) or ``"auto"`` (by backend);
            see [Note: collective policy] in ``zeroplan.core.comm``.
        **optimizer_defaults: hyper-parameters of the inner optimizer (``lr``, ...).

    Raises:
        ConfigError: a bad argument (nothing is modified).
        IncompatiblePlanError: ranks disagree on parameters or settings.

    Example::

        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4, stage=2)
        opt.backward(loss)           # or loss.backward() without loss scaling
        opt.clip_grad_norm_(1.0)
        opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        stage: int = 2,
        process_group: dist.ProcessGroup | None = None,
        shard_group_size: int | None = None,
        strategy: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap_grad_reduce: bool = True,
        loss_scale: float | str | None = None,
        scaler: ScalerConfig | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
        max_inflight_buckets: int = 2,
        collectives: str = "auto",
        **optimizer_defaults: Any,
    ) -> None:
        self._initialized = False
        world = data_parallel_group(process_group)
        problem: ZeroplanError | None = None
        zp: ZeroPlan | None = None
        try:
            if stage not in (1, 2):
                raise ConfigError(
                    f"stage must be 1 or 2, got {stage!r} (stage 3 is planned by zeroplan.core but not "
                    "executed; use DistributedDataParallel for stage 0)"
                )
            mode = _scale_mode(loss_scale)
            inputs = collect_params(params)
            groups = [{**optimizer_defaults, **group} for group in inputs.groups]
            check_hyperparameters(optimizer_class, groups)
            if shard_group_size is not None and (type(shard_group_size) is not int or shard_group_size < 1):
                raise ConfigError(f"shard_group_size must be an int >= 1, got {shard_group_size!r}")
            self._optimizer_class = optimizer_class
            if collectives == "auto":
                collectives = "gloo" if dist.get_backend(world) == "gloo" else "min_bytes"
            self._settings = {
                "policy": collectives,
                "stage": stage,
                "strategy": strategy,
                "alignment": alignment,
                "bucket_bytes": bucket_bytes,
                "loss_scaling": mode is not None,
                "max_inflight_buckets": max_inflight_buckets,
            }
            world_size = dist.get_world_size(world)
            self._topology = Topology(world_size=world_size, shard_size=shard_group_size or world_size)
            self._params = list(inputs.params)
            self._names = list(inputs.names)
            self._group_members = [list(g["params"]) for g in inputs.groups]
            self._cohorts = [0] * len(self._params)
            self._next_cohort = 1
            zp = self._plan(groups)
        except ZeroplanError as exc:
            problem = exc
        zp = agree(zp, world, problem)
        # Nothing below can fail for a user reason: state changes start here.
        super().__init__(
            [{**g, "params": [self._params[i] for i in g["params"]]} for g in groups], optimizer_defaults
        )
        self._device = inputs.device
        self._world = world
        self._groups: ProcessGroups = make_groups(world, self._topology)
        self._log = CommLog()
        self._tracker = PeakTracker()
        self._mode = mode
        self._scaler: ScalerState | None = (
            initial_state(scaler or ScalerConfig()) if mode == "dynamic" else None
        )
        self._overlap = overlap_grad_reduce
        self._last_comm: tuple[CommCost, ...] = ()
        self._clipped = self._last_clipped = False
        self._last_buffer_peak = 0
        self._master_grads: list[torch.Tensor] = []
        self._prepared = False
        self._found_inf = False
        self._install(zp)
        self._broadcast_from_rank_zero()
        self._initialized = True

    # ------------------------------------------------------------ planning
    def _specs(self) -> tuple[ParamSpec, ...]:
        groups = tuple({"params": members} for members in self._group_members)
        return describe_params(tuple(self._params), tuple(self._names), groups, tuple(self._cohorts))

    def _plan(self, groups: list[dict[str, Any]]) -> ZeroPlan:
        name = self._optimizer_class.__name__
        optimizers = tuple(describe_optimizer(name, strict=False, **g) for g in groups)
        return plan(
            self._specs(),
            self._topology,
            stage=self._settings["stage"],
            strategy=self._settings["strategy"],
            optimizer=optimizers,
            alignment=self._settings["alignment"],
            bucket_bytes=self._settings["bucket_bytes"],
            loss_scaling=self._settings["loss_scaling"],
            max_inflight_buckets=self._settings["max_inflight_buckets"],
            policy=self._settings["policy"],
        )

    def _install(self, zp: ZeroPlan) -> None:
        self._zp = zp
        self._buffers: tuple[SpaceBuffers, ...] = build_buffers(
            zp, self._params, self._groups.shard_rank, self._device
        )
        self._inner: Inner = build_inner(
            zp, self._buffers, self._groups.shard_rank, self._optimizer_class, self.param_groups
        )
        # Show the inner optimizer's full settings (LR schedulers read e.g. ``betas``).
        for key, value in self._inner.optimizer.defaults.items():
            self.defaults.setdefault(key, value)
        for outer, inner in zip(self.param_groups, self._inner.optimizer.param_groups, strict=True):
            for key, value in hyperparameters(inner).items():
                outer.setdefault(key, value)
        self._sync = GradSync(
            zp=zp,
            params=self._params,
            names=self._names,
            buffers=self._buffers,
            groups=self._groups,
            overlap=self._overlap,
            log=self._log,
            tracker=self._tracker,
        )

    @torch.no_grad()
    def _broadcast_from_rank_zero(self) -> None:
        """Start every rank from rank 0's parameter values, as ``DistributedDataParallel`` does."""
        if self._topology.world_size == 1:
            return
        managed = {index for buf in self._buffers for index in buf.space.params}
        for buf in self._buffers:
            dist.broadcast(buf.params, group_src=0, group=self._world)
            if buf.separate_master:
                buf.master[: buf.owned].copy_(buf.region(self._groups.shard_rank))
        for index, param in enumerate(self._params):
            if index not in managed:
                dist.broadcast(param.data, group_src=0, group=self._world)

    # ------------------------------------------------------------ properties
    @property
    def plan(self) -> ZeroPlan:
        """The plan this optimizer executes."""
        return self._zp

    @property
    def process_groups(self) -> ProcessGroups:
        """World, shard and replica groups."""
        return self._groups

    @property
    def buffers(self) -> tuple[SpaceBuffers, ...]:
        """This rank's flat buffers, one per dtype space of the plan (see [Note: flat buffers])."""
        return self._buffers

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The ``torch.optim`` optimizer stepping this rank's shard."""
        return self._inner.optimizer

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 without loss scaling)."""
        if self._scaler is not None:
            return self._scaler.scale
        return self._mode if isinstance(self._mode, float) else 1.0

    @property
    def scaler_state(self) -> ScalerState | None:
        """The dynamic loss scaler's state, or ``None``."""
        return self._scaler

    # ------------------------------------------------------------ training API
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, multiplied by the loss scale when scaling is on."""
        if self._zp.loss_scaling:
            loss = loss * self.loss_scale
        loss.backward(**kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context in which backward accumulates gradients locally, without reduction."""
        return self._sync.paused()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the whole model's gradient to ``max_norm``; return its total norm.

        Reduces gradients if backward left any pending, unscales them, then
        computes the norm over all shards (one all-reduce), identical on every
        rank, as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.
        """
        norm_type = float(norm_type)
        if not (norm_type == math.inf or norm_type > 0):
            raise ConfigError(f"norm_type must be > 0 or inf, got {norm_type}")
        self._prepare_grads()
        local = torch.zeros((), dtype=torch.float32, device=self._device)
        for grad, buf in zip(self._master_grads, self._buffers, strict=True):
            part = grad[: buf.owned]
            if part.numel() == 0:
                continue
            norm = torch.linalg.vector_norm(part, norm_type).float()
            local = torch.maximum(local, norm) if norm_type == math.inf else local + norm**norm_type
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        all_reduce_shard(local, op, self._groups, self._log)
        self._clipped = True
        total = local if norm_type == math.inf else local ** (1.0 / norm_type)
        coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for grad in self._master_grads:
            grad.mul_(coefficient.to(grad.dtype))
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> bool:  # type: ignore[override]
        """Apply the update; returns ``False`` when it was skipped for inf/NaN gradients."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        self._prepare_grads()
        applied = not self._found_inf
        if applied:
            sync_hyperparameters(self.param_groups, self._inner.optimizer.param_groups)
            self._inner.optimizer.step()
            self._publish()
        if self._scaler is not None:
            self._scaler = update(self._scaler, self._found_inf)
        self._end_step()
        return applied

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients (stage 1 keeps ``.grad`` as views of its buffer when not set to ``None``)."""
        self._release_grads()
        self._sync.reset()
        if self._zp.stage is Stage.OPTIMIZER and not set_to_none:
            for buf in self._buffers:
                if buf.grads is not None:
                    buf.grads.zero_()

            def restore(index: int, view: torch.Tensor) -> None:
                self._params[index].grad = view

            self._sync.for_each_grad_view(restore)
            managed = {index for buf in self._buffers for index in buf.space.params}
        else:
            managed = set()
        for index, param in enumerate(self._params):
            if index in managed or param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.requires_grad_(False)
                param.grad.zero_()

    # ------------------------------------------------------------ step phases
    def _prepare_grads(self) -> None:
        """Finish reduction; average (and unscale) into the tensors the inner optimizer reads."""
        if self._prepared:
            return
        self._sync.finish()
        divisor = self._topology.world_size * (self.loss_scale if self._zp.loss_scaling else 1.0)
        grads = []
        for buf in self._buffers:
            if buf.separate_master:
                grad = self._tracker.alloc(buf.grad_shard.to(buf.master.dtype))
            else:
                grad = buf.grad_shard
            grad.div_(divisor)
            grads.append(grad)
        self._master_grads = grads
        self._found_inf = False
        if self._zp.loss_scaling:
            flag = torch.zeros(1, dtype=torch.float32, device=self._device)
            for grad, buf in zip(grads, self._buffers, strict=True):
                if buf.owned and not bool(torch.isfinite(grad[: buf.owned].sum())):
                    flag.fill_(1.0)
            all_reduce_shard(flag, dist.ReduceOp.MAX, self._groups, self._log)
            self._found_inf = bool(flag.item() > 0)
        for spec, tensor in zip(self._inner.specs, self._inner.tensors, strict=True):
            tensor.grad = grads[spec.space][spec.shard_span.as_slice()].view(spec.shape)
        self._prepared = True

    def _publish(self) -> None:
        """Write updated shards into the parameter buffers and gather them in each shard group."""
        pending = []
        for buf in self._buffers:
            if buf.separate_master:
                buf.region(self._groups.shard_rank).copy_(buf.master[: buf.owned])
            collective = self._zp.gather_collective(buf.space)
            pending += gather_space(buf.params, buf.space, collective, self._groups, self._log)
        for p in pending:
            p.wait()

    def _release_grads(self) -> None:
        for tensor in self._inner.tensors:
            tensor.grad = None
        for grad, buf in zip(self._master_grads, self._buffers, strict=False):
            if buf.separate_master:
                self._tracker.free(grad)
        self._master_grads = []
        self._prepared = False
        self._found_inf = False

    def _end_step(self) -> None:
        self._release_grads()
        self._sync.reset()
        self._last_comm = self._log.summary()
        self._log.clear()
        self._last_buffer_peak = self._tracker.peak
        self._tracker.reset()
        self._last_clipped, self._clipped = self._clipped, False

    @torch.no_grad()
    def averaged_gradients(self) -> list[torch.Tensor | None]:
        """The gradients the next ``step()`` applies, whole, per parameter (collective).

        Finishes the reduction if needed; the result is averaged over the data
        parallel world, unscaled and clipped (if ``clip_grad_norm_`` ran), in
        the master dtype, ``None`` for frozen parameters. It gathers every
        shard on every rank of the shard group: meant for inspection and tests.
        """
        self._prepare_grads()
        result: list[torch.Tensor | None] = [None] * len(self._params)
        log = CommLog()  # not part of the step's traffic
        for grad, buf in zip(self._master_grads, self._buffers, strict=True):
            full = grad.new_empty(buf.space.numel)
            full[buf.space.region(self._groups.shard_rank).as_slice()] = grad[: buf.owned]
            for pending in gather_space(
                full, buf.space, self._zp.gather_collective(buf.space), self._groups, log
            ):
                pending.wait()
            for index, view in param_views(full, buf.space, self._params).items():
                result[index] = view.clone()
        return result

    # ------------------------------------------------------------ accounting
    def measured_memory(self) -> MeasuredMemory:
        """Bytes this rank holds now, by category; buffers are the last step's peak."""
        managed = {index for buf in self._buffers for index in buf.space.params}
        frozen = sum(_nbytes(p) for i, p in enumerate(self._params) if i not in managed)
        state = sum(
            _nbytes(value)
            for entry in self._inner.optimizer.state.values()
            for value in entry.values()
            if torch.is_tensor(value)
        )
        return MeasuredMemory(
            params_bytes=sum(_nbytes(b.params) for b in self._buffers) + frozen,
            grads_bytes=sum(_nbytes(b.grads) + _nbytes(b.grad_shard) for b in self._buffers),
            master_bytes=sum(_nbytes(b.master) for b in self._buffers if b.separate_master),
            optimizer_state_bytes=state,
            buffer_bytes=self._last_buffer_peak,
        )

    def last_step_comm(self) -> tuple[CommCost, ...]:
        """Collectives of the last completed step: calls and bytes sent, per (group, collective)."""
        return self._last_comm

    def memory_report(self, *, clipping: bool | None = None) -> MemoryReport:
        """The planner's report for this optimizer's plan (no communication).

        ``clipping`` adds the all-reduce of :meth:`clip_grad_norm_` to the traffic;
        by default it is counted if the last completed step clipped.
        """
        return memory_report(self._zp, clipping=self._last_clipped if clipping is None else clipping)

    # ------------------------------------------------------------ state dicts
    def _shards(self) -> Shards:
        return Shards(
            zp=self._zp,
            buffers=self._buffers,
            inner=self._inner,
            groups=self._groups,
            params=tuple(self._params),
            optimizer_name=self._optimizer_class.__name__,
            param_groups=self.param_groups,
            scaler=self._scaler,
        )

    def state_dict(self) -> dict[str, Any]:
        """This rank's sharded state (see [Note: state dict forms] in ``state_dicts``).

        Loads back with :meth:`load_state_dict` on the same plan and restores
        training bit for bit. For another world or shard size use
        :meth:`consolidated_state_dict` or ``zeroplan.facade.checkpoint``.
        """
        return sharded_state_dict(self._shards())

    @torch.no_grad()
    def consolidated_state_dict(
        self, to_rank: int | None = 0, *, chunk_bytes: int = 16 * 2**20
    ) -> dict[str, Any] | None:
        """A plain ``torch.optim`` state dict of the whole model on ``to_rank`` (every rank with ``None``).

        Gathered in chunks of at most ``chunk_bytes``, so no rank needs more
        extra memory than that beyond the result. Collective; ranks that are
        not a destination return ``None``. fp32 master weights of bf16/fp16
        parameters come along under ``"zeroplan_master"``.
        """
        return consolidated_state_dict(self._shards(), to_rank, chunk_bytes)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a sharded dict (same plan) or a plain ``torch.optim`` dict (any plan).

        A plain dict (from ``torch.optim`` or :meth:`consolidated_state_dict`)
        is sliced by every rank; call it on every rank. Invalid dicts raise and
        change nothing.
        """
        state_loading.load_state_dict(self, state_dict)

    # ------------------------------------------------------------ re-planning
    def refresh_trainable(self) -> None:
        """Re-plan after ``requires_grad`` changed; keeps the state of parameters that stay trainable.

        Parameters that become trainable start with fresh optimizer state (their
        own ``step`` counter); parameters that become frozen release their
        state. Collective: call on every rank.
        """
        replanning.refresh_trainable(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (collective: call on every rank with the same group).

        New parameters become trainable with fresh optimizer state. A bad
        group raises on every rank and changes nothing.
        """
        if not self._initialized:  # torch.optim.Optimizer.__init__ adds the first groups
            super().add_param_group(param_group)
            return
        replanning.add_param_group(self, param_group)
