"""``ZeroOptimizer``: a ``torch.optim.Optimizer`` that executes a zeroplan plan.

The class decides *when* things happen; its typed parts (see [Note: optimizer
parts] in ``registry``) hold the state, ``StepLifecycle`` drives each step
(see [Note: step lifecycle]), ``zeroplan.core`` decides every layout, and the
functions of ``buffers``, ``grad_sync``, ``collectives`` and ``shard_state``
do the work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from zeroplan.core import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BUCKET_BYTES,
    CommCost,
    MemoryReport,
    ScalerConfig,
    ScalerState,
    ZeroPlan,
    initial_state,
    memory_report,
    update,
)
from zeroplan.facade import replanning, state_loading
from zeroplan.facade.accounting import MeasuredMemory, measure
from zeroplan.facade.buffers import SpaceBuffers
from zeroplan.facade.consolidate import consolidated_state_dict
from zeroplan.facade.groups import ProcessGroups, data_parallel_group, make_groups
from zeroplan.facade.inner import hyperparameters
from zeroplan.facade.installed import Installed, broadcast_from_rank_zero, broadcast_values, install
from zeroplan.facade.lifecycle import StepContext, StepLifecycle
from zeroplan.facade.memory_check import check_device_memory
from zeroplan.facade.param_shards import ShardedParams
from zeroplan.facade.parked import ParkedParam
from zeroplan.facade.registry import Configured, configure
from zeroplan.facade.state_dicts import Shards, sharded_state_dict
from zeroplan.facade.state_loading import LoadedState

__all__ = ["MeasuredMemory", "ZeroOptimizer"]


class ZeroOptimizer(torch.optim.Optimizer):
    """Shards optimizer state (stage 1) and gradients (stage 2) across data-parallel ranks.

    Wraps any ``torch.optim.Optimizer`` class. The model is *not* wrapped in
    DDP: this optimizer reduces gradients itself, in buckets overlapped with
    backward. Parameters become views of flat buffers laid out by the plan.

    Args:
        params: what ``torch.optim`` accepts: tensors, ``(name, tensor)``
            pairs or param-group dicts.
        optimizer_class: the inner optimizer, e.g. ``torch.optim.AdamW``.
        stage: 1 (optimizer state and master weights sharded), 2 (gradients
            too) or 3 (parameters too: call :meth:`attach` with the model; see
            [Note: stage 3] in ``param_shards``).
        process_group: the data-parallel group (default: the default group).
        shard_group_size: ranks per shard group (MiCS); default: the whole group.
        ranks_per_node: ranks sharing a node (consecutive ranks of the group);
            default: the whole group. When shard groups span whole nodes,
            parameters are gathered in two hops, across nodes then inside
            each ([Note: hierarchical all-gather]), bit-identical to one hop;
            traffic is reported per link. The layout, state and checkpoints
            do not depend on it.
        strategy: partition strategy name, or ``"auto"`` (``flat_even`` for
            elementwise optimizers, ``lpt_whole`` otherwise).
        bucket_bytes: byte cap of a gradient bucket.
        overlap_grad_reduce: launch reductions from backward hooks (``False``:
            all at ``step()``; results are bit-identical).
        overlap_param_gather: let ``step()`` return before the updated
            parameters arrived; their first reader waits ([Note: parameter
            gather]; ``False``: wait in ``step()``, bit-identical).
        layout: ``"auto"``, ``"interleaved"`` or ``"rank_major"`` ([Note: layout]).
        reshard_after_forward: stage 3: free gathered parameters after the
            forward and gather them again in backward (``False``: keep them
            until their gradients arrived: less traffic, stage-2 memory for
            parameters).
        loss_scale: ``None``, a static scale, or ``"dynamic"``.
        scaler: settings of the dynamic loss scale.
        alignment: elements; shard allocations and bucket bounds are multiples.
        max_inflight_buckets: staging buffers alive at once.
        collectives: ``"min_bytes"`` (reduce-scatter / all-gather), ``"gloo"``
            (all-reduce / broadcasts, faster on gloo) or ``"auto"`` (by backend);
            see [Note: collective policy] in ``zeroplan.core.comm``.
        strict_memory: raise, not warn, when the planned peak does not fit the GPU.
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
        ranks_per_node: int | None = None,
        strategy: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = True,
        layout: str = "auto",
        reshard_after_forward: bool = True,
        loss_scale: float | str | None = None,
        scaler: ScalerConfig | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
        max_inflight_buckets: int = 2,
        collectives: str = "auto",
        strict_memory: bool = False,
        **optimizer_defaults: Any,
    ) -> None:
        self._initialized = False
        world = data_parallel_group(process_group)
        configured: list[Configured] = []

        def make() -> tuple[ZeroPlan, list[dict[str, Any]]]:
            c = configure(
                params,
                optimizer_class,
                optimizer_defaults,
                world=world,
                stage=stage,
                shard_group_size=shard_group_size,
                strategy=strategy,
                alignment=alignment,
                bucket_bytes=bucket_bytes,
                loss_scale=loss_scale,
                max_inflight_buckets=max_inflight_buckets,
                collectives=collectives,
                layout=layout,
                ranks_per_node=ranks_per_node,
            )
            configured[:] = [c]
            zp = c.settings.plan(c.registry, c.groups)
            check_device_memory(zp, c, world, overlap=overlap_grad_reduce, strict=strict_memory)
            return zp, c.groups

        # ranks_per_node is not fingerprinted (it changes no layout) but decides the groups made below.
        zp = replanning.agreed_plan(
            make, world, loss_scale=repr(loss_scale), scaler=repr(scaler), ranks_per_node=repr(ranks_per_node)
        )
        # Nothing below can fail for a user reason: state changes start here.
        mode, groups, self._settings, self._registry = configured[0]
        params_of = self._registry.params
        super().__init__(
            [{**g, "params": [params_of[i] for i in g["params"]]} for g in groups], optimizer_defaults
        )
        self._world = world
        self._groups: ProcessGroups = make_groups(world, self._settings.topology)
        self._lifecycle = StepLifecycle()
        self._parked: dict[int, ParkedParam] = {}  # [Note: parked state]
        self._mode = mode
        self._scaler: ScalerState | None = (
            initial_state(scaler or ScalerConfig()) if mode == "dynamic" else None
        )
        self._overlap = overlap_grad_reduce
        self._overlap_gather = bool(overlap_param_gather)
        self._reshard = bool(reshard_after_forward)
        self._attached: torch.nn.Module | None = None
        self._installed = self._install(zp)
        broadcast_from_rank_zero(self._installed, self._registry.params)
        self._settle(self._installed)
        self._initialized = True

    def _context(self) -> StepContext:
        scale = self.loss_scale if self._installed.zp.loss_scaling else 1.0
        return StepContext(
            divisor=self._settings.topology.world_size * scale,
            param_groups=self.param_groups,
            params=self._registry.params,
            names=self._registry.names,
        )

    def _install(self, zp: ZeroPlan) -> Installed:
        installed = install(
            zp,
            self._registry,
            self._groups,
            self._settings.optimizer_class,
            self.param_groups,
            overlap=self._overlap,
            overlap_param_gather=self._overlap_gather,
            reshard_after_forward=self._reshard,
            admit=self._lifecycle.admit_gradient,
            log=self._lifecycle.log,
            tracker=self._lifecycle.tracker,
        )
        # Show the inner optimizer's full settings (LR schedulers read e.g. ``betas``).
        inner = installed.inner.optimizer
        for key, value in inner.defaults.items():
            self.defaults.setdefault(key, value)
        for outer, group in zip(self.param_groups, inner.param_groups, strict=True):
            for key, value in hyperparameters(group).items():
                outer.setdefault(key, value)
        return installed

    def _settle(self, installed: Installed) -> None:
        """Stage 3: shard the freshly installed parameters and hook the attached model."""
        if isinstance(installed.gather, ShardedParams):
            installed.gather.shard_all()
            if self._attached is not None:
                installed.gather.attach(self._attached)

    def _replan(self, zp: ZeroPlan) -> None:
        """Switch to the agreed plan ``zp`` (see [Note: re-planning]); a no-op for the same plan."""
        if zp.fingerprint() == self._installed.zp.fingerprint():
            return
        old = self._installed
        old.gather.wait_all()
        self._lifecycle.release(old)
        if isinstance(old.gather, ShardedParams):
            old.gather.gather_all()  # the new plan's buffers are filled from the parameters' values
        self._installed, self._parked = replanning.replan(
            old, zp, self._registry.params, self._install, self._parked
        )
        if isinstance(old.gather, ShardedParams):
            old.gather.retire()
        self._settle(self._installed)

    def _hyper(self) -> list[dict[str, Any]]:
        return [hyperparameters(g) for g in self.param_groups]

    # ------------------------------------------------------------ properties
    @property
    def plan(self) -> ZeroPlan:
        """The plan this optimizer executes."""
        return self._installed.zp

    @property
    def process_groups(self) -> ProcessGroups:
        """World, shard and replica groups."""
        return self._groups

    @property
    def installed(self) -> Installed:
        """The installed plan: plan, groups, buffers, inner optimizer, gradient sync (for tools)."""
        return self._installed

    @property
    def lifecycle(self) -> StepLifecycle:
        """The step lifecycle ([Note: step lifecycle]); for inspection and profiling tools."""
        return self._lifecycle

    @property
    def buffers(self) -> tuple[SpaceBuffers, ...]:
        """This rank's flat buffers, one per dtype space of the plan (see [Note: flat buffers])."""
        return self._installed.buffers

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The ``torch.optim`` optimizer stepping this rank's shard."""
        return self._installed.inner.optimizer

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
        if self._installed.zp.loss_scaling:
            loss = loss * self.loss_scale
        loss.backward(**kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context in which backward accumulates gradients locally, without reduction."""
        return self._lifecycle.local_accumulation()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the whole model's gradient to ``max_norm``; return its total norm.

        Reduces gradients if backward left any pending, unscales them, then
        computes the norm over all shards (one all-reduce), identical on every
        rank, as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.
        Once per step, between backward and :meth:`step`.
        """
        return self._lifecycle.clip(self._installed, self._context(), max_norm, norm_type)

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm, as :meth:`clip_grad_norm_` returns it, without clipping.

        At stage 2 no rank holds whole gradients (``.grad`` is ``None`` after
        backward), so code that logs or inspects them reads this instead of
        ``torch.nn.utils.clip_grad_norm_(params, inf)``. Reduces gradients if
        backward left any pending, then one all-reduce of a scalar; identical on
        every rank; collective. Between backward and :meth:`step`, as often as
        needed; after :meth:`clip_grad_norm_` it is the norm of the clipped
        gradients. For the gradients themselves, see :meth:`averaged_gradients`.
        """
        return self._lifecycle.grad_norm(self._installed, self._context(), norm_type)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Apply the update; returns what ``closure`` returned (``None`` without one), as ``torch.optim``.

        ``kwargs`` go to the inner optimizer's ``step``. A step whose gradients
        overflowed (inf/NaN, with loss scaling) is skipped on every rank:
        :attr:`last_step_skipped` says so.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        applied = self._lifecycle.step(self._installed, self._context(), **kwargs)
        if self._scaler is not None:
            self._scaler = update(self._scaler, not applied)
        return loss

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` skipped its update because a gradient overflowed (inf/NaN)."""
        return not self._lifecycle.last.applied

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients (stage 1 keeps ``.grad`` as views of its buffer when not set to ``None``)."""
        self._lifecycle.release(self._installed)
        self._installed.sync.zero_grad(set_to_none)

    def averaged_gradients(self) -> list[torch.Tensor | None]:
        """The gradients the next ``step()`` applies, whole, per parameter (collective).

        Finishes the reduction if needed; the result is averaged over the data
        parallel world, unscaled and clipped (if ``clip_grad_norm_`` ran), in
        the master dtype, ``None`` for frozen parameters. It gathers every
        shard on every rank of the shard group: meant for inspection and tests.
        """
        return self._lifecycle.averaged_gradients(self._installed, self._context())

    # ------------------------------------------------------------ accounting
    def measured_memory(self) -> MeasuredMemory:
        """Bytes this rank holds now, by category; buffers are the last step's peak."""
        return measure(self._installed, self._registry.params, self._lifecycle.last.buffer_peak)

    def last_step_comm(self) -> tuple[CommCost, ...]:
        """Collectives of the last completed step: calls and bytes sent, per (group, collective)."""
        return self._lifecycle.last.comm

    def memory_report(self, *, clipping: bool | None = None) -> MemoryReport:
        """The planner's report for this optimizer's plan (no communication).

        ``clipping`` adds the all-reduce of :meth:`clip_grad_norm_` to the traffic;
        by default it is counted if the last completed step clipped. Its
        ``peak_bytes`` follows this optimizer's ``overlap_grad_reduce`` and the
        order the last step's gradients arrived in.
        """
        clipped = self._lifecycle.last.clipped if clipping is None else clipping
        arrivals = self._installed.sync.last_arrivals
        return memory_report(
            self._installed.zp,
            clipping=clipped,
            overlap=self._overlap,
            arrivals=arrivals,
            reshard_after_forward=self._reshard,
        )

    def wait_for_params(self) -> None:
        """Complete the last step's parameter gathers (before reading parameters outside a forward)."""
        self._installed.gather.wait_all()

    def attach(self, model: torch.nn.Module) -> None:
        """Let ``model``'s forward gather the stage-3 parameters it uses (see [Note: stage 3]).

        Registers forward hooks on ``model`` and its submodules that hold this
        optimizer's parameters; call once, before the first forward, with the
        module whose forward runs the model (the root). At stages 1 and 2 it
        does nothing (parameters are whole there), so code can call it always.
        """
        self._attached = model
        if isinstance(self._installed.gather, ShardedParams):
            self._installed.gather.attach(model)

    @contextlib.contextmanager
    def gathered_params(self, *, writeback: bool = False) -> Iterator[None]:
        """Inside the block every parameter holds its whole values (collective: call on every rank).

        At stage 3 this gathers every block and frees them after the block;
        at stages 1 and 2 it only completes the last step's gathers. For
        saving the model (``model.state_dict()``), evaluation code that reads
        weights, EMA.

        Args:
            writeback: keep values written into the parameters inside (e.g.
                ``model.load_state_dict(...)``; every rank must write the same):
                on leaving the block normally they go into this rank's shards
                (stage 3) and the masters are reloaded from them (fp32 masters
                of bf16/fp16 parameters then hold the parameters' values). Without
                it, stage 3 drops such changes, and at stages 1 and 2 the next
                step overwrites bf16/fp16 parameters from the unchanged masters.
        """
        gather = self._installed.gather
        if isinstance(gather, ShardedParams):
            with gather.all_gathered(writeback=writeback):
                yield
            return
        gather.wait_all()
        yield
        if writeback:
            for buf in self._installed.buffers:
                buf.load_master()

    # ------------------------------------------------------------ state dicts
    def shards(self) -> Shards:
        """What state dicts and checkpoints read: plan, buffers, inner optimizer, groups, settings."""
        inst = self._installed
        inst.gather.wait_all()  # they read the parameters: the last step's gathers must be complete
        return Shards(
            zp=inst.zp,
            buffers=inst.buffers,
            inner=inst.inner,
            groups=inst.groups,
            params=self._registry.params,
            optimizer_name=self._settings.optimizer_name,
            param_groups=self.param_groups,
            scaler=self._scaler,
            parked=self._parked,
        )

    def plan_with_cohorts(self, cohorts: Iterable[int]) -> ZeroPlan:
        """This optimizer's plan with the parameters in other cohorts (pure: changes nothing)."""
        return self._settings.plan(self._registry.with_cohorts(tuple(cohorts)), self._hyper())

    def state_dict(self) -> dict[str, Any]:
        """This rank's sharded state (see [Note: state dict forms] in ``state_dicts``).

        Loads back with :meth:`load_state_dict` on the same plan and restores
        training bit for bit. For another world or shard size use
        :meth:`consolidated_state_dict` or ``zeroplan.facade.checkpoint``.
        """
        return sharded_state_dict(self.shards())

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
        return consolidated_state_dict(self.shards(), to_rank, chunk_bytes)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a sharded dict (same plan) or a plain ``torch.optim`` dict (any plan).

        A plain dict (from ``torch.optim`` or :meth:`consolidated_state_dict`)
        is sliced by every rank; call it on every rank. Collective: every rank
        validates its dict, then all agree (see [Note: load agreement] in
        ``state_loading``), so a dict rejected on one rank raises on every rank
        and changes nothing on any.

        Raises:
            ConfigError, IncompatiblePlanError: on every rank, if any rank's
                dict is invalid or the ranks' dicts disagree.
        """
        sh = self.shards()
        with self.gathered_params():  # a plain dict without masters reads the parameters' values
            loaded = state_loading.agreed_state(
                lambda: state_loading.read_state_dict(state_dict, sh, self.plan_with_cohorts),
                sh,
                what="state dict",
            )
        self.restore(loaded)

    @torch.no_grad()
    def restore(self, loaded: LoadedState) -> None:
        """Install validated state (``load_state_dict``, ``checkpoint.load``); cannot fail for a user reason.

        Adopts the plan the state is laid out for (same parameters, other
        cohorts) first; every rank must call it with state of the same plan.
        """
        self.wait_for_params()
        self._lifecycle.release(self._installed)
        if loaded.target.fingerprint() != self._installed.zp.fingerprint():
            self._registry = self._registry.with_cohorts([s.cohort for s in loaded.target.specs])
            self._replan(loaded.target)
        if loaded.param_values is not None:
            gather = self._installed.gather
            if isinstance(gather, ShardedParams):  # stage 3: write into the blocks, keep this rank's pieces
                with gather.all_gathered(writeback=True):
                    state_loading.copy_param_values(self._registry.params, loaded.param_values)
            else:
                state_loading.copy_param_values(self._registry.params, loaded.param_values)
        state_loading.commit_state(self._installed, loaded, self.param_groups)
        if loaded.parked is not None:
            self._parked = loaded.parked
        if loaded.scaler is not None and self._scaler is not None:
            self._scaler = ScalerState(config=self._scaler.config, **loaded.scaler)

    # ------------------------------------------------------------ re-planning
    def refresh_trainable(self) -> None:
        """Re-plan after ``requires_grad`` changed; no parameter loses its optimizer state.

        Parameters that become frozen keep their state aside (parked, still
        sharded) and continue with it when unfrozen, as with ``torch.optim``;
        parameters trainable for the first time start fresh (their own ``step``
        counter). Collective: call on every rank.
        """
        self._registry, zp = replanning.refresh_trainable(
            self._registry, self._settings, self._installed.zp, self._hyper(), self._world, self._parked
        )
        self._replan(zp)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (collective: call on every rank with the same group).

        New parameters become trainable with fresh optimizer state. A bad
        group raises on every rank and changes nothing.
        """
        if not self._initialized:  # torch.optim.Optimizer.__init__ adds the first groups
            super().add_param_group(param_group)
            return
        start = len(self._registry.params)
        registry, zp, group = replanning.add_param_group(
            self._registry, self._settings, self._hyper(), self.defaults, param_group, self._world
        )
        new = registry.params[start:]
        broadcast_values(new, self._world)  # every rank starts from rank 0's values, as at construction
        super().add_param_group({**group, "params": list(new)})
        self._registry = registry
        self._replan(zp)
