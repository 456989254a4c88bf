"""``ZeroOptimizer``: a ``torch.optim.Optimizer`` that executes a zeroplan plan.

The class decides *when* things happen; its typed parts (see [Note: optimizer
parts] in ``registry``) hold the state, ``StepLifecycle`` drives each step
(see [Note: step lifecycle]), ``zeroplan.core`` decides every layout, and the
functions of ``buffers``, ``grad_sync``, ``collectives`` and ``shard_state``
do the work.

[Note: importing torch._dynamo here]
torch imports ``torch._dynamo`` the first time any ``torch.optim`` optimizer
is built, and one of the modules it loads keeps the frame that called it in a
reference cycle (``torch.fx.wrap`` holds ``inspect.currentframe()`` in a local).
That frame's ``f_back`` chain reaches whatever stack was running: when that is
``ZeroOptimizer.__init__`` (or a user's function that first touched
``zeroplan.facade.ZeroOptimizer``), everything those frames hold, the first
``ZeroOptimizer`` and its process groups included, outlives its last
reference until the cycle collector runs, often not before the interpreter
finalizes. A gloo group freed then lets its worker thread take the GIL during
finalization, and the process aborts ("terminate called without an active
exception") after its work is done. So this module imports it once, then
collects that garbage cycle at once (:func:`_import_dynamo_now`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import sys
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from zeroplan.core import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BUCKET_BYTES,
    CommCost,
    ConfigError,
    DomainPlans,
    DomainsReport,
    MemoryReport,
    ScalerConfig,
    ScalerState,
    ZeroPlan,
    ZeroplanError,
    initial_state,
)
from zeroplan.facade import replanning, state_loading
from zeroplan.facade.accounting import MeasuredMemory
from zeroplan.facade.agreement import verdicts
from zeroplan.facade.buffers import SpaceBuffers
from zeroplan.facade.consolidate import consolidated_state_dict
from zeroplan.facade.domain import (
    Domain,
    DomainInput,
    ExecutionOptions,
    check_partition,
    same_ranks,
    split_domains,
)
from zeroplan.facade.groups import ProcessGroups, data_parallel_group
from zeroplan.facade.installed import Installed
from zeroplan.facade.joint import JointStep
from zeroplan.facade.lifecycle import StepLifecycle
from zeroplan.facade.memory_check import check_device_memory
from zeroplan.facade.param_shards import Peers
from zeroplan.facade.registry import Configured, configure
from zeroplan.facade.state_dicts import Shards, sharded_state_dict
from zeroplan.facade.state_loading import LoadedState


def _import_dynamo_now() -> None:
    """Import ``torch._dynamo``, then free the frames it keeps in a cycle.

    See [Note: importing torch._dynamo here].
    """
    if "torch._dynamo" in sys.modules:
        return
    importlib.import_module("torch._dynamo")
    gc.collect()


_import_dynamo_now()

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
        max_inflight_buckets: staging buffers alive at once (and persistent staging arena kept).
        collectives: ``"min_bytes"`` (reduce-scatter / all-gather), ``"gloo"``
            (the same as point-to-point exchanges, faster on gloo; uneven pieces
            all-reduced / broadcast) or ``"auto"`` (by backend); see
            [Note: collective policy] in ``zeroplan.core.comm``.
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
        split_problem: ConfigError | None = None
        try:
            inputs = split_domains(params, world)  # [Note: expert domains]
        except ConfigError as exc:  # raised on every rank by the agreement below, not here alone
            inputs, split_problem = [], exc
        configured: list[Configured] = []
        plans: list[ZeroPlan] = []

        def make() -> tuple[ZeroPlan, list[dict[str, Any]]]:
            if split_problem is not None:
                raise split_problem
            configured[:], plans[:] = [], []
            for d, item in enumerate(inputs):
                c = configure(
                    item.param_groups,
                    optimizer_class,
                    optimizer_defaults,
                    world=item.group,
                    stage=stage,
                    shard_group_size=shard_group_size if d == 0 else None,
                    strategy=strategy,
                    alignment=alignment,
                    bucket_bytes=bucket_bytes,
                    loss_scale=loss_scale,
                    max_inflight_buckets=max_inflight_buckets,
                    collectives=collectives,
                    layout=layout,
                    ranks_per_node=ranks_per_node if d == 0 else None,
                )
                zp = c.settings.plan(c.registry, c.groups)
                check_device_memory(zp, c, item.group, overlap=overlap_grad_reduce, strict=strict_memory)
                configured.append(c)
                plans.append(zp)
            _check_disjoint(inputs, configured)
            return plans[0], configured[0].groups

        # ranks_per_node is not fingerprinted (it changes no layout) but decides the groups made below.
        layout_of_domains = [(i.positions, dist.get_world_size(i.group)) for i in inputs]
        plans[:1] = [
            replanning.agreed_plan(
                make,
                world,
                loss_scale=repr(loss_scale),
                scaler=repr(scaler),
                ranks_per_node=repr(ranks_per_node),
                domains=repr(layout_of_domains),
            )
        ]
        if len(inputs) > 1:
            check_partition(inputs, world)  # before any expert group's own collective
            plans[1:] = _agreed_expert_plans(inputs, configured, plans, world)
        # Nothing below can fail for a user reason: state changes start here.
        ordered: list[dict[str, Any]] = [{} for _ in range(sum(len(i.positions) for i in inputs))]
        for item, c in zip(inputs, configured, strict=True):
            params_of = c.registry.params
            for position, g in zip(item.positions, c.groups, strict=True):
                extra = {} if item.group is world else {"process_group": item.group}
                ordered[position] = {**g, **extra, "params": [params_of[i] for i in g["params"]]}
        super().__init__(ordered, optimizer_defaults)
        self._world = world
        mode = configured[0].mode
        options = ExecutionOptions(
            overlap=overlap_grad_reduce,
            overlap_gather=bool(overlap_param_gather),
            reshard=bool(reshard_after_forward),
        )
        peers = Peers()  # [Note: several sharded domains]
        domains = [
            Domain(
                name=item.name,
                world=item.group,
                configured=c,
                zp=zp,
                param_groups=[self.param_groups[p] for p in item.positions],
                defaults=self.defaults,
                # Expert buckets reduce at step(): an expert that got no token on one rank has no
                # gradient there, and a backward hook waiting for its bucket would wait for that rank,
                # which launches it only in step(), after the data domain it may be waiting on.
                options=options if item.group is world else options._replace(overlap=False),
                peers=peers,
            )
            for item, c, zp in zip(inputs, configured, plans, strict=True)
        ]
        self._joint = JointStep(  # [Note: joint step]
            domains,
            world,
            scaler=initial_state(scaler or ScalerConfig()) if mode == "dynamic" else None,
            static_scale=mode if isinstance(mode, float) else 1.0,
        )
        self._initialized = True

    @property
    def _domains(self) -> tuple[Domain, ...]:
        return self._joint.domains

    @property
    def _data(self) -> Domain:
        """Domain 0: the data-parallel domain (the only one without expert groups)."""
        return self._joint.data

    # ------------------------------------------------------------ properties
    @property
    def plan(self) -> ZeroPlan:
        """The plan this optimizer executes (of the data-parallel domain, with expert groups)."""
        return self._data.installed.zp

    @property
    def domains(self) -> tuple[Domain, ...]:
        """Its domains ([Note: expert domains]): only ``"data"`` unless param groups carry a process group."""
        return self._domains

    @property
    def process_groups(self) -> ProcessGroups:
        """World, shard and replica groups (of the data-parallel domain)."""
        return self._data.groups

    @property
    def installed(self) -> Installed:
        """The installed plan: plan, groups, buffers, inner optimizer, gradient sync (for tools)."""
        return self._data.installed

    @property
    def lifecycle(self) -> StepLifecycle:
        """The step lifecycle ([Note: step lifecycle]); for inspection and profiling tools."""
        return self._data.lifecycle

    @property
    def buffers(self) -> tuple[SpaceBuffers, ...]:
        """This rank's flat buffers, one per dtype space of the plan (see [Note: flat buffers])."""
        return self._data.installed.buffers

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The ``torch.optim`` optimizer stepping this rank's shard (of the data-parallel domain)."""
        return self._data.installed.inner.optimizer

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 without loss scaling)."""
        return self._joint.loss_scale

    @property
    def scaler_state(self) -> ScalerState | None:
        """The dynamic loss scaler's state, or ``None``."""
        return self._joint.scaler

    # ------------------------------------------------------------ training API
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, multiplied by the loss scale when scaling is on."""
        if self._data.installed.zp.loss_scaling:
            loss = loss * self.loss_scale
        loss.backward(**kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context in which backward accumulates gradients locally, without reduction."""
        return self._joint.no_sync()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the whole model's gradient to ``max_norm``; return its total norm.

        Reduces gradients if backward left any pending, unscales them, then
        computes the norm over all shards (one all-reduce), identical on every
        rank, as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model
        (with expert groups: over every expert of every group).
        Once per step, between backward and :meth:`step`.
        """
        return self._joint.clip_grad_norm_(max_norm, norm_type)

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
        return self._joint.grad_norm(norm_type)

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
        self._joint.step(**kwargs)
        return loss

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` skipped its update because a gradient overflowed (inf/NaN)."""
        return self._joint.last_step_skipped

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients (stage 1 keeps ``.grad`` as views of its buffer when not set to ``None``)."""
        self._joint.zero_grad(set_to_none)

    def averaged_gradients(self) -> list[torch.Tensor | None]:
        """The gradients the next ``step()`` applies, whole, per parameter (collective).

        Finishes the reduction if needed; the result is averaged over the data
        parallel world (expert parameters too: see [Note: expert domains]), unscaled and
        clipped (if ``clip_grad_norm_`` ran), in the master dtype, ``None`` for
        frozen parameters, in the order of ``param_groups``. It gathers every
        shard on every rank of the shard group: meant for inspection and tests.
        """
        return self._joint.averaged_gradients(self.param_groups)

    # ------------------------------------------------------------ accounting
    def measured_memory(self) -> MeasuredMemory:
        """Bytes this rank holds now, by category (every domain); buffers: the staging arena."""
        return self._joint.measured_memory()

    def last_step_comm(self) -> tuple[CommCost, ...]:
        """Collectives of the last completed step: calls and bytes sent, per (group, collective).

        With expert groups, the groups of domains other than ``"data"`` are
        named ``"<domain>/<group>"`` (``"experts/shard"``).
        """
        return self._joint.last_step_comm()

    def memory_report(self, *, clipping: bool | None = None) -> MemoryReport:
        """The planner's report for this optimizer's plan (no communication).

        ``clipping`` adds the all-reduce of :meth:`clip_grad_norm_` to the traffic;
        by default it is counted if the last completed step clipped. Its
        ``peak_bytes`` follows this optimizer's ``overlap_grad_reduce`` and the
        order the last step's gradients arrived in.

        Raises:
            ConfigError: the optimizer has expert groups: one report would leave
                them out; use :meth:`memory_reports`.
        """
        if len(self._domains) > 1:
            raise ConfigError(
                "memory_report() describes one plan, but this optimizer has expert groups (one plan per "
                "domain); use memory_reports(), whose .rank(...) sums a rank's domains"
            )
        return self._data.memory_report(self._joint.clipped(clipping))

    def memory_reports(self, *, clipping: bool | None = None) -> DomainsReport:
        """The planner's report of every domain ([Note: expert domains]); ``clipping``: see ``memory_report``.

        ``.rank(self.domain_positions())`` is this rank's total; its traffic is
        what :meth:`last_step_comm` measures (with several domains the clipping
        norm and the overflow verdict are one all-reduce each over the world).
        """
        return self._joint.memory_reports(self._positions(), clipping)

    def domain_plans(self) -> DomainPlans:
        """Every domain's plan, with the user's group positions (pure value)."""
        return self._joint.domain_plans(self._positions())

    def _positions(self) -> dict[int, int]:
        return {id(g): i for i, g in enumerate(self.param_groups)}

    def domain_positions(self) -> tuple[int, ...]:
        """This rank's position in each domain's process group (what ``memory_reports().rank`` takes)."""
        return tuple(d.groups.rank for d in self._domains)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """Refused: a copy would share the process groups, the hooks and the flat buffers, and fail later.

        Raises:
            ConfigError: always; copy the state instead.
        """
        raise ConfigError(
            "a ZeroOptimizer cannot be deep-copied: it holds process groups, hooks on the model's "
            "parameters and the flat buffers they view. Copy its state instead (opt.state_dict(), or "
            "zeroplan.facade.checkpoint) and build a new ZeroOptimizer over the copied model"
        )

    def wait_for_params(self) -> None:
        """Complete the last step's parameter gathers (before reading parameters outside a forward)."""
        self._joint.wait_for_params()

    def attach(self, model: torch.nn.Module) -> None:
        """Let ``model``'s forward gather the stage-3 parameters it uses (see [Note: stage 3]).

        Registers forward hooks on ``model`` and its submodules that hold this
        optimizer's parameters; call once, before the first forward, with the
        module whose forward runs the model (the root). At stages 1 and 2 it
        does nothing (parameters are whole there), so code can call it always.
        """
        self._joint.attach(model)

    def gathered_params(self, *, writeback: bool = False) -> contextlib.AbstractContextManager[None]:
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
                it, stage 3 drops such changes; stages 1 and 2 keep them anyway
                at the next step ([Note: parameter writes]).
        """
        return self._joint.gathered_params(writeback=writeback)

    # ------------------------------------------------------------ state dicts
    def shards(self) -> Shards:
        """What state dicts and checkpoints read: plan, buffers, inner optimizer, groups, settings.

        Raises:
            ConfigError: the optimizer has expert groups: consolidated dicts
                hold one plan, and one domain's parts would leave the experts
                out; ``zeroplan.facade.checkpoint`` and ``state_dict()`` save
                every domain (each domain's parts: ``opt.domains[d].shards(...)``).
        """
        if len(self._domains) > 1:
            raise ConfigError(
                "consolidated state dicts hold one plan, but this optimizer has expert groups (one plan per "
                "domain) and no rank holds every expert; save with zeroplan.facade.checkpoint.save(opt, "
                "path) or opt.state_dict() on every rank"
            )
        return self._data.shards(self._joint.scaler)

    def plan_with_cohorts(self, cohorts: Iterable[int]) -> ZeroPlan:
        """This optimizer's plan with the parameters in other cohorts (pure: changes nothing)."""
        return self._data.plan_with_cohorts(tuple(cohorts))

    def state_dict(self) -> dict[str, Any]:
        """This rank's sharded state (see [Note: state dict forms] in ``state_dicts``).

        Loads back with :meth:`load_state_dict` on the same plan and restores
        training bit for bit. For another world or shard size use
        :meth:`consolidated_state_dict` or ``zeroplan.facade.checkpoint``. With
        expert groups it holds one sharded dict per domain (``"domains"``).
        """
        if len(self._domains) == 1:
            return sharded_state_dict(self.shards())
        return {
            "format": DOMAINS_FORMAT,
            "domains": {d.name: sharded_state_dict(d.shards(self._joint.scaler)) for d in self._domains},
        }

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
        and changes nothing on any. With expert groups only this optimizer's
        own ``state_dict()`` loads (same world and groups).

        Raises:
            ConfigError, IncompatiblePlanError: on every rank, if any rank's
                dict is invalid or the ranks' dicts disagree.
        """
        if len(self._domains) > 1:
            loaded = self._read_domains(state_dict)
            for domain, state in zip(self._domains, loaded, strict=True):
                domain.restore(state)
            self._restore_scaler(loaded[0])
            return
        sh = self.shards()
        with self.gathered_params():  # a plain dict without masters reads the parameters' values
            state = state_loading.agreed_state(
                lambda: state_loading.read_state_dict(state_dict, sh, self.plan_with_cohorts),
                sh,
                what="state dict",
            )
        self.restore(state)

    def _read_domains(self, state_dict: dict[str, Any]) -> list[LoadedState]:
        """Every domain's validated state from a multi-domain dict; raises on every rank if any rank fails.

        Every rank enters every domain's agreement (a dict this rank rejects
        outright fails inside it), then one verdict over the world carries an
        expert group's failure to the ranks outside it.
        """
        names = [d.name for d in self._domains]
        held = sorted(state_dict.get("domains", {})) if isinstance(state_dict, dict) else None
        rejected: ConfigError | None = None
        if not (isinstance(state_dict, dict) and state_dict.get("format") == DOMAINS_FORMAT):
            rejected = ConfigError(
                "this optimizer has expert groups and loads only its own state_dict() (one sharded dict per "
                f"domain, format {DOMAINS_FORMAT!r}); plain torch.optim dicts, single-domain sharded dicts "
                "and consolidated dicts do not say which expert group their state belongs to"
            )
        elif held != sorted(names):
            rejected = ConfigError(f"the state dict holds domains {held}, the optimizer {names}")

        def read(domain: Domain, sh: Shards) -> LoadedState:
            if rejected is not None:
                raise rejected
            return state_loading.read_state_dict(
                state_dict["domains"][domain.name], sh, domain.plan_with_cohorts
            )

        loaded: list[LoadedState] = []
        problem: Exception | None = None
        for domain in self._domains:
            sh = domain.shards(self._joint.scaler)
            try:
                what = f"state dict of domain {domain.name!r}"
                loaded.append(state_loading.agreed_state(partial(read, domain, sh), sh, what=what))
            except Exception as exc:  # raised on every rank of that domain; the others go on agreeing
                problem = problem or exc
        verdicts(problem, self._world, failed="rejected the state dict", error=ConfigError)
        return loaded

    @torch.no_grad()
    def restore(self, loaded: LoadedState) -> None:
        """Install validated state (``load_state_dict``, ``checkpoint.load``); cannot fail for a user reason.

        Adopts the plan the state is laid out for (same parameters, other
        cohorts) first; every rank must call it with state of the same plan.
        """
        self._data.restore(loaded)
        self._restore_scaler(loaded)

    def _restore_scaler(self, loaded: LoadedState) -> None:
        scaler = self._joint.scaler
        if loaded.scaler is not None and scaler is not None:
            self._joint.scaler = ScalerState(config=scaler.config, **loaded.scaler)

    # ------------------------------------------------------------ re-planning
    def refresh_trainable(self) -> None:
        """Re-plan after ``requires_grad`` changed; no parameter loses its optimizer state.

        Parameters that become frozen keep their state aside (parked, still
        sharded) and continue with it when unfrozen, as with ``torch.optim``;
        parameters trainable for the first time start fresh (their own ``step``
        counter). Collective: call on every rank.
        """
        planned, problem = [], None
        for domain in self._domains:  # every domain agrees over its group; nothing changes yet
            try:
                planned.append(domain.plan_refresh())
            except Exception as exc:
                problem = problem or exc
        verdicts(
            problem, self._world, failed="could not re-plan after requires_grad changed", error=ConfigError
        )
        for domain, (registry, zp) in zip(self._domains, planned, strict=True):
            domain.adopt(registry, zp)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (collective: call on every rank with the same group).

        New parameters become trainable with fresh optimizer state. A bad
        group raises on every rank and changes nothing. A group with a
        ``"process_group"`` joins the expert domain of that process group.
        """
        if not self._initialized:  # torch.optim.Optimizer.__init__ adds the first groups
            super().add_param_group(param_group)
            return
        pg = param_group.get("process_group") if isinstance(param_group, dict) else None
        if pg is not None and isinstance(pg, dist.ProcessGroup) and same_ranks(pg, self._world):
            pg = None  # the world's ranks: the data-parallel domain, as at construction
        target = self._world if pg is None else pg
        index = next((i for i, d in enumerate(self._domains) if d.world is target), None)
        unknown = None
        if index is None:
            unknown = ConfigError(
                "add_param_group: its process_group is none of this optimizer's (the data-parallel group or "
                "an expert group given at construction); pass every expert group when creating the optimizer"
            )
        routes = verdicts(unknown, self._world, failed="could not add the param group", facts=index)
        if len(set(routes)) > 1:
            raise ConfigError(
                f"add_param_group: the ranks add the group to different domains ({routes}, by rank); give "
                "every rank a group of the same domain (the data-parallel one, or each its expert group)"
            )
        domain = self._domains[routes[0]]
        if isinstance(param_group, dict):
            param_group = {k: v for k, v in param_group.items() if k != "process_group"}
        planned, problem = None, None
        try:  # agreed over the domain's group; one verdict over the world then reaches every rank
            planned = domain.plan_group(param_group)
        except Exception as exc:
            problem = exc
        verdicts(problem, self._world, failed="rejected the new param group", error=ConfigError)
        assert planned is not None  # verdicts raised otherwise
        registry, zp, group = planned
        new = registry.params[len(domain.registry.params) :]
        extra = {} if domain is self._data else {"process_group": domain.world}
        super().add_param_group({**group, **extra, "params": list(new)})
        domain.adopt_group(registry, zp, self.param_groups[-1])


#: ``format`` of a multi-domain ``state_dict()`` (see [Note: expert domains]).
DOMAINS_FORMAT = "zeroplan.domains/1"


def _check_disjoint(inputs: list[DomainInput], configured: list[Configured]) -> None:
    """Raise if a parameter is in two domains' groups."""
    owner: dict[int, str] = {}
    for item, c in zip(inputs, configured, strict=True):
        for param, name in zip(c.registry.params, c.registry.names, strict=True):
            if owner.setdefault(id(param), item.name) != item.name:
                raise ConfigError(
                    f"parameter {name!r} is in a group of domain {owner[id(param)]!r} and in one of "
                    f"{item.name!r} (groups with another process_group); list each parameter once"
                )


def _agreed_expert_plans(
    inputs: list[DomainInput], configured: list[Configured], plans: list[ZeroPlan], world: dist.ProcessGroup
) -> list[ZeroPlan]:
    """Every expert domain's plan once its group's ranks agreed; raises on every rank if any group failed.

    Each expert group agrees over itself (its ranks hold the same experts);
    one verdict over the world then carries any group's failure to all.
    """
    agreed: list[ZeroPlan] = []
    problem: Exception | None = None
    for d in range(1, len(inputs)):
        try:
            agreed.append(
                replanning.agreed_plan(lambda d=d: (plans[d], configured[d].groups), inputs[d].group)
            )
        except Exception as exc:  # the other expert groups still agree, so no rank waits
            ranks = dist.get_process_group_ranks(inputs[d].group)
            where = (
                f"domain {inputs[d].name!r} (param groups {list(inputs[d].positions)}, global ranks {ranks})"
            )
            if isinstance(exc, ZeroplanError):
                exc = type(exc)(f"{where}: {exc} (ranks and group indices are the domain's own)")
            problem = problem or exc
    verdicts(problem, world, failed="(in an expert group) rejected the optimizer settings", error=ConfigError)
    return agreed
