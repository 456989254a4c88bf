"""The domains of one optimizer stepped as one: loss scale, overflow verdict, gradient norm, divisor.

[Note: joint step]
An optimizer has a domain per process group its param groups name ([Note:
expert domains] in ``zeroplan.core.domains``); a model without expert groups has one. What
couples the domains is owned here, once, and ``ZeroOptimizer`` delegates every
step call to it, so one domain is a set of one on the same path:

* one loss scale (one dynamic scaler, updated once per ``step()``);
* one divisor: every domain divides its summed gradients by the data-parallel
  world (domain 0's), so an expert's gradient is that of the world's mean loss;
* one overflow verdict: a step is skipped on every rank of every domain, or on
  none;
* one gradient norm over every domain's gradients, identical on every rank.

Each domain reduces, checks overflow and sums its norm over its own shard
group. Where several domains must agree, one more all-reduce of a scalar over
the data-parallel world joins their verdicts (and one their norms): the
``controls`` of ``zeroplan.core.DomainsReport``. A single domain needs neither:
its shard group's verdict and norm already hold on every rank (its replicas
hold the same reduced gradients), and its report plans no joint call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zeroplan.core import (
    Collective,
    CommCost,
    ConfigError,
    Domain,
    DomainPlans,
    DomainsReport,
    ScalerState,
    StepOrderError,
    ZeroPlan,
    update,
)
from zeroplan.facade.diagnostics.accounting import MeasuredMemory
from zeroplan.facade.mechanisms.agreement import verdicts
from zeroplan.facade.mechanisms.collectives import CommLog, all_reduce
from zeroplan.facade.mechanisms.reduction import finish_norm, norm_op
from zeroplan.facade.runtime.domain import DomainRuntime, same_ranks
from zeroplan.facade.runtime.lifecycle import (
    VERDICT_LENGTH,
    Phase,
    StepContext,
    norm_type_of,
)
from zeroplan.facade.runtime.registry import ParamRegistry
from zeroplan.facade.state.restore import LoadedState

__all__ = ["JointStep"]

_UNKNOWN_GROUP = (
    "add_param_group: its process_group is none of this optimizer's (the data-parallel group or an "
    "expert group given at construction); pass every expert group when creating the optimizer"
)


class JointStep:
    """The step of every domain of one optimizer, coupled as [Note: joint step] says.

    Args:
        domains: the domains, the data-parallel one first.
        world: the data-parallel process group (domain 0's).
        scaler: the dynamic loss scaler's state, or ``None``.
        static_scale: the static loss scale (1.0 without one; ignored with ``scaler``).
        stages: the ranks holding the other pipeline stages of this data-parallel slice ([Note:
            mesh roles] in ``zeroplan.core.mesh``): the norm and the overflow verdict join over them.
        tensor: the ranks holding the other tensor-parallel slices of the same parameters ([Note:
            tensor-parallel parameters] in ``zeroplan.core.tensor_parallel``): the norm (counting
            the parameters they all hold whole once) and the overflow verdict join over them.
    """

    def __init__(
        self,
        domains: Sequence[DomainRuntime],
        world: dist.ProcessGroup,
        scaler: ScalerState | None,
        static_scale: float,
        stages: dist.ProcessGroup | None = None,
        tensor: dist.ProcessGroup | None = None,
    ) -> None:
        self.domains = tuple(domains)
        self.world = world
        self.stages = stages
        self.tensor = tensor
        # The model-parallel groups one norm and one verdict span, besides the data-parallel group.
        self._model = tuple(g for g in (tensor, stages) if g is not None)
        self.scaler = scaler
        self._static_scale = static_scale
        self._divided = 1.0  # divide_gradients(): this step's extra divisor

    @property
    def data(self) -> DomainRuntime:
        """Domain 0: the data-parallel domain (the only one without an expert group)."""
        return self.domains[0]

    @property
    def joint(self) -> bool:
        """Whether verdicts and norms need the joint all-reduce over the world (several domains)."""
        return len(self.domains) > 1

    def only_domain(self, call: str) -> DomainRuntime:
        """The data domain, for a ``call`` that describes one plan; with expert groups, why it cannot.

        Raises:
            ConfigError: there are several domains (the message says what to use instead).
        """
        if self.joint:
            raise ConfigError(
                f"{call} describes one plan, but this optimizer has expert groups (one plan "
                f"per domain): {_INSTEAD[call]}"
            )
        return self.data

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        return self.scaler.scale if self.scaler is not None else self._static_scale

    @property
    def backward_scale(self) -> float:
        """What :meth:`backward` multiplies a loss by: the loss scale, divided by the world in
        deterministic mode with loss scaling ([Note: reduction policy])."""
        installed = self.data.installed
        if not installed.zp.loss_scaling:
            return 1.0
        world = installed.zp.topology.world_size if installed.reduction.divides_loss_by_world else 1
        return self.loss_scale / world

    def context(self, domain: DomainRuntime) -> StepContext:
        """What a step of ``domain`` needs: the one loss scale and the data-parallel divisor."""
        scaled_by_world = self.data.installed.reduction.divides_loss_by_world  # backward() divided it
        world = 1 if scaled_by_world else self.data.settings.topology.world_size
        return domain.context(self.loss_scale, world, divided=self._divided)

    def divide_gradients(self, divisor: float) -> None:
        """Divide this step's gradients by ``divisor`` too (a pipeline schedule's ``scale_grads``).

        Raises:
            ConfigError: ``divisor`` is not a finite number > 0.
            StepOrderError: the gradients were already averaged for this step (``clip_grad_norm_``,
                ``grad_norm`` or ``step()`` ran).
        """
        if not (isinstance(divisor, (int, float)) and math.isfinite(divisor) and divisor > 0):
            raise ConfigError(f"divide_gradients takes a finite number > 0, got {divisor!r}")
        if any(d.lifecycle.phase in (Phase.REDUCED, Phase.CLIPPED) for d in self.domains):
            raise StepOrderError(
                "divide_gradients() after the gradients were averaged for clip_grad_norm_(), grad_norm() "
                "or step(): call it right after the backward passes"
            )
        self._divided *= float(divisor)

    # ------------------------------------------------------------ a step's calls
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward accumulates locally in every domain."""
        with contextlib.ExitStack() as stack:
            for domain in self.domains:
                stack.enter_context(domain.lifecycle.local_accumulation())
            yield

    def reduce(self, call: str) -> None:
        """Finish every domain's reduction and settle the step's verdict with one host read.

        [Note: one host read]
        On a GPU every read of a device value on the host (``item()``, ``bool``)
        waits for all the work queued before it: the whole backward. A step
        reads once: every domain starts its reduction and its verdict (the step
        agreement, its overflow flag) on the device, several domains join their
        overflow flags over the world, and the verdicts of every domain travel
        to the host together; then each domain settles (raises, or takes the
        step). ``call`` names the public method for error messages.
        """
        phases = [d.lifecycle.phase for d in self.domains]
        if all(p in (Phase.REDUCED, Phase.CLIPPED) for p in phases):
            return
        live = any(p is not Phase.IDLE for p in phases)  # a domain without gradients here reduces zeros
        started = [
            d.lifecycle.start_reduce(d.installed, self.context(d), call, idle_ok=live) for d in self.domains
        ]
        parts = [v for v in started if v is not None]
        joint = None
        coupled = self.joint or bool(self._model)
        if coupled and self.data.installed.zp.loss_scaling:  # one verdict for the whole model
            joint = torch.stack([v[VERDICT_LENGTH - 1] for v in parts]).max().float().reshape(1)
            if self.joint:
                self._all_reduce_joint(joint, dist.ReduceOp.MAX, self.data.lifecycle.log)
            for group in self._model:  # every tensor slice and pipeline stage skips the step, or none
                all_reduce(joint, dist.ReduceOp.MAX, group)
            parts.append(joint.to(torch.int64))
        read = torch.cat(parts).tolist() if parts else []  # the step's one host read
        whole_model = read.pop() if joint is not None else None
        for d, verdict in zip(self.domains, started, strict=True):
            if verdict is None:
                continue
            mine, read = read[:VERDICT_LENGTH], read[VERDICT_LENGTH:]
            if whole_model is not None:
                mine[VERDICT_LENGTH - 1] = whole_model
            d.lifecycle.settle(d.installed, self.context(d), call, mine)

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip every domain's gradients by the norm over all of them; return that norm."""
        norm_type = norm_type_of(norm_type)
        for domain in self.domains:
            domain.lifecycle.check_unclipped()
        self.reduce("clip_grad_norm_()")
        total = self._norm(norm_type, self.data.lifecycle.log)
        for domain in self.domains:
            domain.lifecycle.apply_clip(total, max_norm)
        return total

    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """The norm :meth:`clip_grad_norm_` would return, without clipping (inspection: not logged)."""
        norm_type = norm_type_of(norm_type)
        self.reduce("grad_norm()")
        return self._norm(norm_type, CommLog())

    def step(self, **kwargs: Any) -> None:
        """Update every domain (or skip them all on an overflow), then the loss scale."""
        self.reduce("step()")
        applied = True
        for domain in self.domains:
            applied = domain.lifecycle.step(domain.installed, self.context(domain), **kwargs)
        if self.scaler is not None:
            self.scaler = update(self.scaler, not applied)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` skipped its update (an overflow)."""
        return not self.data.lifecycle.last.applied

    def zero_grad(self, set_to_none: bool) -> None:
        """End the step in every domain and reset its gradients."""
        self._divided = 1.0
        for domain in self.domains:
            domain.lifecycle.release(domain.installed)
            domain.installed.sync.zero_grad(set_to_none)

    def averaged_gradients(self, param_groups: Sequence[dict[str, Any]]) -> list[torch.Tensor | None]:
        """Every parameter's whole reduced gradient, in the order of ``param_groups`` (collective)."""
        self.reduce("averaged_gradients()")
        found: dict[int, torch.Tensor | None] = {}
        for domain in self.domains:
            grads = domain.lifecycle.averaged_gradients(domain.installed, self.context(domain))
            found.update((id(p), g) for p, g in zip(domain.registry.user_params, grads, strict=True))
        return [found[id(p)] for group in param_groups for p in group["params"]]

    def _norm(self, norm_type: float, log: CommLog) -> torch.Tensor:
        """The norm over every domain's reduced gradients, identical on every rank."""
        if not self.joint:
            data = self.data
            if self.tensor is not None and dist.get_rank(self.tensor) != 0:  # tp rank 0 counts replicas
                norm = data.lifecycle.replica_free_norm(data.installed, norm_type, log)
            else:
                norm = data.lifecycle.shard_norm(data.installed, norm_type, log)
            if not self._model:
                return norm
            if norm_type == math.inf:  # the largest of every slice's and stage's
                for group in self._model:
                    all_reduce(norm, dist.ReduceOp.MAX, group)
                return norm
            power = norm.pow(norm_type)  # every slice's and stage's sum of powers, summed
            for group in self._model:
                all_reduce(power, dist.ReduceOp.SUM, group)
            return finish_norm(power, norm_type)
        local = torch.zeros((), dtype=torch.float32, device=self.data.installed.device)
        for domain in self.domains:
            part = domain.lifecycle.local_norm(domain.installed, norm_type)
            if norm_type == math.inf:
                local = torch.maximum(local, part)
            else:  # every shard group holds the domain's gradient once: count it once over the world
                local = local + part / domain.settings.topology.replica_size
        self._all_reduce_joint(local, norm_op(norm_type), log)
        if self.stages is not None:
            all_reduce(local, norm_op(norm_type), self.stages)
        return finish_norm(local, norm_type)

    def _all_reduce_joint(self, value: torch.Tensor, op: dist.ReduceOp, log: CommLog) -> None:
        """One float32 scalar all-reduced over the world, logged (planned as ``DomainsReport.controls``)."""
        topology = self.data.settings.topology
        world = topology.world_size
        log.record(
            "world", Collective.ALL_REDUCE, [1] * world, self.data.groups.rank, 4, link=topology.world_link
        )
        all_reduce(value, op, self.world)

    # ------------------------------------------------------------ accounting
    def measured_memory(self) -> MeasuredMemory:
        """Bytes this rank holds now, by category, over every domain."""
        parts = [d.measured_memory() for d in self.domains]
        return MeasuredMemory(*(sum(values) for values in zip(*parts, strict=True)))

    def last_step_comm(self) -> tuple[CommCost, ...]:
        """The last completed step's calls; other domains' groups named ``"<domain>/<group>"``."""
        costs = list(self.data.lifecycle.last.comm)
        for domain in self.domains[1:]:
            costs += [
                dataclasses.replace(c, group=f"{domain.name}/{c.group}") for c in domain.lifecycle.last.comm
            ]
        return tuple(costs)

    def clipped(self, clipping: bool | None) -> bool:
        """``clipping``, or by default whether the last completed step clipped."""
        return self.data.lifecycle.last.clipped if clipping is None else clipping

    def memory_reports(self, param_groups: Sequence[dict[str, Any]], clipping: bool | None) -> DomainsReport:
        """Every domain's planned report, the joint calls as ``controls`` (``param_groups``: the user's)."""
        clipped = self.clipped(clipping)
        controls = int(clipped) + int(self.data.installed.zp.loss_scaling) if self.joint else 0
        return DomainsReport(
            domains=self.domain_plans(param_groups).domains,
            reports=tuple(d.memory_report(clipped and not self.joint) for d in self.domains),
            controls=controls,
        )

    def domain_plans(self, param_groups: Sequence[dict[str, Any]]) -> DomainPlans:
        """Every domain's plan with its param groups' positions among the user's ``param_groups``."""
        positions = {id(g): i for i, g in enumerate(param_groups)}
        return DomainPlans(
            domains=tuple(
                Domain(
                    name=d.name,
                    groups=tuple(positions[id(g)] for g in d.param_groups),
                    topology=d.settings.topology,
                )
                for d in self.domains
            ),
            plans=tuple(d.installed.zp for d in self.domains),
        )

    def restore(self, states: Sequence[LoadedState]) -> None:
        """Install validated state: ``states[d]`` into domain ``d`` (the first ``len(states)`` domains; a
        checkpoint restores the others itself), the loss scaler from domain 0's state."""
        for domain, state in zip(self.domains, states, strict=False):
            domain.restore(state)
        if states and states[0].scaler is not None and self.scaler is not None:
            self.scaler = ScalerState(config=self.scaler.config, **states[0].scaler)

    # ------------------------------------------------------------ re-planning
    def refresh_trainable(self) -> None:
        """Re-plan every domain after ``requires_grad`` changed; all agree first, or all raise."""
        planned, problem = [], None
        for domain in self.domains:  # every domain agrees over its group; nothing changes yet
            try:
                planned.append(domain.plan_refresh())
            except Exception as exc:
                problem = problem or exc
        verdicts(
            problem, self.world, failed="could not re-plan after requires_grad changed", error=ConfigError
        )
        for domain, (registry, zp) in zip(self.domains, planned, strict=True):
            domain.adopt(registry, zp)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, multiplied by the loss scale when scaling is on.

        In deterministic mode the scale is divided by the world, so the backward
        computes exactly the world-1 run's values (fp16 gradients that are
        subnormal there are here too), and the divisor leaves the world out
        (:meth:`context`, [Note: deterministic mode]).
        """
        if self.data.installed.zp.loss_scaling:
            loss = loss * self.backward_scale
        loss.backward(**kwargs)

    def add_param_group(
        self,
        param_group: Any,
        register: Callable[[dict[str, Any]], None],
        param_groups: Sequence[dict[str, Any]],
    ) -> None:
        """Plan ``param_group`` into its domain (agreed by every rank), ``register`` it as
        ``torch.optim`` does (it lands last in ``param_groups``), then the domain adopts it."""
        domain, (registry, zp, group) = self.plan_group(param_group, param_groups)
        new = registry.params[len(domain.registry.params) :]
        extra = {} if domain is self.data else {"process_group": domain.world}
        register({**group, **extra, "params": list(new)})
        domain.adopt_group(registry, zp, param_groups[-1])

    def plan_group(
        self, param_group: Any, param_groups: Sequence[dict[str, Any]]
    ) -> tuple[DomainRuntime, tuple[ParamRegistry, ZeroPlan, dict[str, Any]]]:
        """The domain a new param group joins (by its ``process_group``) and its plan with the group.

        Every rank agrees on the domain and on the plan, or every rank raises; nothing changes here.
        A parameter of any domain (``param_groups``: the user's) listed again is refused inside the
        domain's agreement, before torch's own check could raise on one rank alone.
        """
        listed = [
            (p, f"param group {g}, position {i}")
            for g, group in enumerate(param_groups)
            for i, p in enumerate(group["params"])
        ]
        pg = param_group.get("process_group") if isinstance(param_group, dict) else None
        if pg is not None and isinstance(pg, dist.ProcessGroup) and same_ranks(pg, self.world):
            pg = None  # the world's ranks: the data-parallel domain, as at construction
        target = self.world if pg is None else pg
        index = next((i for i, d in enumerate(self.domains) if d.world is target), None)
        unknown = None if index is not None else ConfigError(_UNKNOWN_GROUP)
        routes = verdicts(unknown, self.world, failed="could not add the param group", facts=index)
        if len(set(routes)) > 1:
            raise ConfigError(
                f"add_param_group: the ranks add the group to different domains ({routes}, by rank); give "
                "every rank a group of the same domain (the data-parallel one, or each its expert group)"
            )
        domain = self.domains[routes[0]]
        if isinstance(param_group, dict):
            param_group = {k: v for k, v in param_group.items() if k != "process_group"}
        planned, problem = None, None
        try:  # agreed over the domain's group; one verdict over the world then reaches every rank
            planned = domain.plan_group(param_group, listed, len(param_groups))
        except Exception as exc:
            problem = exc
        verdicts(problem, self.world, failed="rejected the new param group", error=ConfigError)
        assert planned is not None  # verdicts raised otherwise
        return domain, planned

    # ------------------------------------------------------------ parameters
    def wait_for_params(self) -> None:
        """Finish the last step's parameter gathers in every domain."""
        for domain in self.domains:
            domain.installed.residency.finish_param_sync()

    def attach(self, model: torch.nn.Module) -> None:
        """Hook ``model`` for every stage-3 domain."""
        for domain in self.domains:
            domain.attach(model)

    @contextlib.contextmanager
    def gathered_params(self, *, writeback: bool) -> Iterator[None]:
        """Every domain's parameters whole inside the block."""
        with contextlib.ExitStack() as stack:
            for domain in self.domains:
                stack.enter_context(domain.gathered(writeback=writeback))
            yield


#: What to call instead of a one-plan call when the optimizer has expert groups.
_INSTEAD = {
    "memory_report()": "one report would leave them out; use memory_reports(), whose .rank(...) sums "
    "a rank's domains",
    "shards()": "consolidated state dicts hold one plan and no rank holds every expert; save with "
    "zeroplan.facade.checkpoint.save(opt, path) or opt.state_dict() on every rank",
}

NO_DEEPCOPY = (
    "a ZeroOptimizer cannot be deep-copied: it holds process groups, hooks on the model's parameters "
    "and the flat buffers they view. Copy its state instead (opt.state_dict(), or "
    "zeroplan.facade.checkpoint) and build a new ZeroOptimizer over the copied model"
)
