"""One domain of a ``ZeroOptimizer``: the param groups reduced and sharded over one process group.

:func:`split_domains` splits the user's param groups into domains, and each runs as a
:class:`DomainRuntime`: an ordinary plan with its own process groups, buffers, gradient hooks,
inner optimizer and step lifecycle. Why and how, and what couples the domains: [Note: expert
domains] in ``zeroplan.core.domains``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core import ConfigError, MemoryReport, ZeroPlan, memory_report
from zeroplan.facade.diagnostics.accounting import MeasuredMemory, measure
from zeroplan.facade.mechanisms.collectives import all_gather_objects
from zeroplan.facade.mechanisms.groups import ProcessGroups, make_groups
from zeroplan.facade.params.local_shards import tensor_slice_of
from zeroplan.facade.params.sharded import Peers
from zeroplan.facade.runtime import replanning
from zeroplan.facade.runtime.installed import Installed, broadcast_from_rank_zero, broadcast_values, install
from zeroplan.facade.runtime.lifecycle import StepContext, StepLifecycle
from zeroplan.facade.runtime.registry import Configured, ParamRegistry
from zeroplan.facade.state import restore as state_restore
from zeroplan.facade.state.dicts import Shards
from zeroplan.facade.state.inner import hyperparameters
from zeroplan.facade.state.parked import ParkedParam
from zeroplan.facade.state.restore import LoadedState

__all__ = [
    "DATA",
    "DomainRuntime",
    "DomainInput",
    "check_partition",
    "same_ranks",
    "split_domains",
]

#: Name of domain 0, the data-parallel domain.
DATA = "data"


class DomainInput(NamedTuple):
    """The param groups of one domain, before validation.

    Attributes:
        name: ``"data"`` for domain 0, ``"experts"`` (or ``"experts<i>"``) otherwise.
        group: the process group it reduces and shards over.
        positions: indices of its groups in the user's list (increasing).
        param_groups: those groups, without their ``process_group`` entry.
    """

    name: str
    group: dist.ProcessGroup
    positions: tuple[int, ...]
    param_groups: list[dict[str, Any]]


def same_ranks(group: dist.ProcessGroup, world: dist.ProcessGroup) -> bool:
    """Whether ``group`` is ``world`` or another group of exactly its ranks (then it is domain 0's)."""
    return group is world or dist.get_process_group_ranks(group) == dist.get_process_group_ranks(world)


def check_partition(inputs: Sequence[DomainInput], world: dist.ProcessGroup) -> None:
    """Raise on every rank unless each expert domain's groups split ``world`` into disjoint groups.

    One collective over the world: every rank learns every rank's groups. A rank
    must be in its own group, and every member of a group must name the same
    group; otherwise the groups' own agreements would wait on ranks that never
    come, and the joint gradient norm would count some experts twice.

    Raises:
        ConfigError: on every rank, naming the first rank whose group is inconsistent.
    """
    rank = dist.get_rank(world)
    global_rank = {dist.get_global_rank(world, r): r for r in range(dist.get_world_size(world))}
    mine = [tuple(global_rank.get(g, -1) for g in dist.get_process_group_ranks(i.group)) for i in inputs[1:]]
    rows = all_gather_objects(mine, world)
    for d, item in enumerate(inputs[1:]):
        for r, groups in enumerate(rows):
            group = groups[d] if d < len(groups) else ()
            wrong = [q for q in group if q < 0 or rows[q][d] != group] if r in group else [r]
            if wrong:
                why = "does not include it" if r not in group else f"rank {wrong[0]} does not share"
                raise ConfigError(
                    f"domain {item.name!r}: rank {r}'s process_group holds ranks {list(group)} of the "
                    f"optimizer's group, which {why}; the expert groups must split the data-parallel ranks "
                    f"into disjoint groups, each named by all of its members (this rank is {rank})"
                )


def split_domains(params: Any, world: dist.ProcessGroup) -> list[DomainInput]:
    """Split what the user passed into domains (see [Note: expert domains]); touches no tensor.

    Param groups without a ``"process_group"`` entry (or with ``None``, or with
    ``world`` itself) form domain 0; each other process group one more domain,
    in order of first appearance. Anything but a list of dicts is one domain.

    Raises:
        ConfigError: a ``process_group`` that is no process group, that this
            rank is not a member of, or param groups that all have one (then
            pass it as ``ZeroOptimizer(process_group=...)`` instead).
    """
    try:
        items = list(params) if not isinstance(params, torch.Tensor) else None
    except TypeError:
        items = None
    if items is None:
        return [DomainInput(DATA, world, (0,), params)]  # collect_params explains the mistake
    if not items or not all(isinstance(g, dict) for g in items):
        return [DomainInput(DATA, world, (0,), items)]  # one group of tensors (or nothing: refused later)
    owners: list[dist.ProcessGroup | None] = []
    for i, group in enumerate(items):
        pg = group.get("process_group")
        if pg is dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group returns on ranks outside it
            raise ConfigError(
                f"param group {i}: this rank ({dist.get_rank()}) is not a member of its process_group; give "
                "each rank the group of the ranks that hold the same expert parameters (its "
                "expert-data-parallel group)"
            )
        if pg is not None and not isinstance(pg, dist.ProcessGroup):
            raise ConfigError(
                f"param group {i}: 'process_group' must be a torch.distributed ProcessGroup "
                f"(from dist.new_group), got {type(pg).__name__}"
            )
        if pg is not None and dist.get_rank(pg) < 0:
            raise ConfigError(
                f"param group {i}: this rank ({dist.get_rank()}) is not a member of its process_group "
                f"(ranks {dist.get_process_group_ranks(pg)}); give each rank the group of the ranks that "
                "hold the same expert parameters (its expert-data-parallel group)"
            )
        owners.append(None if pg is None or same_ranks(pg, world) else pg)
    if all(pg is not None for pg in owners):
        raise ConfigError(
            "every param group names its own process_group: there is no data-parallel domain. Pass the group "
            "as ZeroOptimizer(process_group=...) instead, or keep the dense parameters in a group without one"
        )
    distinct: list[dist.ProcessGroup | None] = [None]
    for pg in owners:
        if not any(pg is seen for seen in distinct):
            distinct.append(pg)
    inputs = []
    for d, pg in enumerate(distinct):
        positions = tuple(i for i, owner in enumerate(owners) if owner is pg)
        name = DATA if d == 0 else ("experts" if len(distinct) == 2 else f"experts{d - 1}")
        groups = [{k: v for k, v in items[i].items() if k != "process_group"} for i in positions]
        inputs.append(DomainInput(name, world if pg is None else pg, positions, groups))
    return inputs


class DomainRuntime:
    """The parts of one domain and what acts on them alone (see [Note: expert domains]).

    Args:
        name: the domain's name (``"data"``, ``"experts"``, ...).
        world: the process group it reduces and shards over.
        configured: its validated arguments.
        zp: its agreed plan.
        param_groups: the user's dicts of its groups (shared with ``ZeroOptimizer.param_groups``).
        defaults: ``ZeroOptimizer.defaults``: the inner optimizer's defaults are added to it.
        peers: shared by the optimizer's domains (see [Note: several sharded domains]).
        siblings: every data-parallel group of the job in global ranks, where there are several
            (pipeline stages: ``make_groups``).
    """

    def __init__(
        self,
        *,
        name: str,
        world: dist.ProcessGroup,
        configured: Configured,
        zp: ZeroPlan,
        param_groups: list[dict[str, Any]],
        defaults: dict[str, Any],
        peers: Peers,
        siblings: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.name = name
        self.world = world
        self.settings = configured.settings
        self.registry: ParamRegistry = configured.registry
        self.param_groups = param_groups
        self._defaults = defaults
        self._peers = peers
        self.groups: ProcessGroups = make_groups(world, self.settings.topology, siblings)
        self.lifecycle = StepLifecycle()
        self.parked: dict[int, ParkedParam] = {}  # [Note: parked state]
        self.attached: torch.nn.Module | None = None
        self.installed = self._install(zp, from_rank_zero=True)
        broadcast_from_rank_zero(self.installed, self.registry.params)
        self._settle(self.installed)

    # ------------------------------------------------------------ installation
    def context(self, loss_scale: float, data_world: int, *, divided: float = 1.0) -> StepContext:
        """What a step of this domain needs: its divisor, its groups.

        Every domain divides its summed gradients by the *data-parallel* world
        ``data_world`` (times the loss scale), not by its own group's size: an
        expert's gradient summed over its group already holds the tokens of every
        rank that routed to it, so this is the gradient of the world's mean loss,
        as one process training on the whole batch computes it (see [Note:
        expert domains]); ``divided``: the step's further divisor (``divide_gradients``).
        """
        scale = loss_scale if self.installed.zp.loss_scaling else 1.0
        return StepContext(
            divisor=data_world * scale * divided,
            param_groups=self.param_groups,
            params=self.registry.params,
            names=self.registry.names,
        )

    def _install(self, zp: ZeroPlan, *, from_rank_zero: bool = False) -> Installed:
        installed = install(
            zp,
            self.registry,
            self.groups,
            self.settings.optimizer_class,
            self.param_groups,
            admit=self.lifecycle.admit_gradient,
            log=self.lifecycle.log,
            from_rank_zero=from_rank_zero,
            peers=self._peers,
            optimizer_kwargs=dict(self.settings.optimizer_kwargs),
        )
        # Show the inner optimizer's full settings (LR schedulers read e.g. ``betas``).
        inner = installed.inner.optimizer
        for key, value in inner.defaults.items():
            self._defaults.setdefault(key, value)
        for outer, group in zip(self.param_groups, inner.param_groups, strict=True):
            for key, value in hyperparameters(group).items():
                outer.setdefault(key, value)
        return installed

    def _settle(self, installed: Installed) -> None:
        """The freshly installed residency takes its resting state (stage 3: sharded, model hooked)."""
        installed.residency.settle(self.attached)

    def replan(self, zp: ZeroPlan) -> None:
        """Switch to the agreed plan ``zp`` (see [Note: re-planning]); a no-op for the same plan."""
        if zp.fingerprint() == self.installed.zp.fingerprint():
            return
        old = self.installed
        old.residency.finish_param_sync()
        self.lifecycle.release(old)
        old.residency.prepare_replan()  # the new plan's buffers are filled from the parameters' values
        self.installed, self.parked = replanning.replan(
            old, zp, self.registry.params, self._install, self.parked
        )
        old.residency.retire()
        self._settle(self.installed)

    def hyper(self) -> list[dict[str, Any]]:
        """Its groups' hyper-parameters."""
        return [hyperparameters(g) for g in self.param_groups]

    # ------------------------------------------------------------ parameters
    def attach(self, model: torch.nn.Module) -> None:
        """Hook ``model`` so that its forward finds this domain's parameters (stage 3 gathers them)."""
        self.installed.residency.attach(model)  # may refuse (nothing changes)
        self.attached = model

    def gathered(self, *, writeback: bool) -> contextlib.AbstractContextManager[None]:
        """Whole parameter values inside the block (see ``ZeroOptimizer.gathered_params``)."""
        return self.installed.residency.gathered(writeback=writeback)

    # ------------------------------------------------------------ accounting
    def measured_memory(self) -> MeasuredMemory:
        """Bytes this domain holds on this rank now (buffers: the staging arena)."""
        return measure(self.installed, self.registry.params)

    def memory_report(self, clipping: bool) -> MemoryReport:
        """The planner's report of this domain's plan, with the last step's gradient arrival order."""
        return memory_report(self.installed.zp, clipping=clipping, arrivals=self.installed.sync.last_arrivals)

    # ------------------------------------------------------------ state
    def shards(self, scaler: Any) -> Shards:
        """What its state dicts and checkpoints read."""
        inst = self.installed
        inst.residency.finish_param_sync()  # they read the parameters: the last gathers must be complete
        return Shards(
            zp=inst.zp,
            buffers=inst.buffers,
            inner=inst.inner,
            groups=inst.groups,
            params=self.registry.params,
            optimizer_name=self.settings.optimizer_name,
            param_groups=self.param_groups,
            scaler=scaler,
            parked=self.parked,
            tensor_slice=tensor_slice_of(self.registry.tensor_mesh),
            tensor_group=None if self.registry.tensor_mesh is None else self.registry.tensor_mesh.get_group(),
        )

    def plan_with_cohorts(self, cohorts: Sequence[int]) -> ZeroPlan:
        """Its plan with the parameters in other cohorts (pure: changes nothing)."""
        return self.settings.plan(self.registry.with_cohorts(tuple(cohorts)), self.hyper())

    def restore(self, loaded: LoadedState) -> None:
        """Install validated state of this domain; cannot fail for a user reason (scaler: the caller's)."""
        self.installed.residency.finish_param_sync()
        self.lifecycle.release(self.installed)
        if loaded.target.fingerprint() != self.installed.zp.fingerprint():
            self.registry = self.registry.with_cohorts([s.cohort for s in loaded.target.specs])
            self.replan(loaded.target)
        if loaded.param_values is not None:
            with self.gathered(writeback=True):  # the loaded values reach the masters (stage 3: shards)
                state_restore.copy_param_values(self.registry.params, loaded.param_values)
        inst = self.installed
        state_restore.commit_state(inst.zp, inst.buffers, inst.inner, loaded, self.param_groups)
        if loaded.parked is not None:
            self.parked = loaded.parked

    def restore_masters(self, values: dict[str, torch.Tensor]) -> None:
        """Install this rank's master values per dtype space and publish them to the parameters.

        ``values[dtype]`` has the space's ``extent`` elements: the fp32 master of bf16/fp16
        parameters, or the parameters' own shard where they are their own master. Every rank's
        parameters then hold them (stages 1-2 gather, stage 3 keeps its shard). Collective.
        """
        inst = self.installed
        inst.residency.finish_param_sync()
        for buf in inst.buffers:
            if buf.space.dtype not in values:
                continue
            if buf.master is not None:  # its own, or the rank's region of the parameters
                buf.write_master(values[buf.space.dtype])
            else:
                buf.write_shard(values[buf.space.dtype])
        inst.residency.start_param_sync(self.lifecycle.log)
        inst.residency.finish_param_sync()

    def plan_refresh(self) -> tuple[ParamRegistry, ZeroPlan]:
        """The registry and agreed plan after ``requires_grad`` changed (collective over the domain; pure)."""
        return replanning.refresh_trainable(
            self.registry, self.settings, self.installed.zp, self.hyper(), self.world, self.parked
        )

    def adopt(self, registry: ParamRegistry, zp: ZeroPlan) -> None:
        """Switch to ``registry`` and its agreed plan ``zp`` (re-planning; cannot fail for a user reason)."""
        self.registry = registry
        self.replan(zp)

    def plan_group(
        self, param_group: dict[str, Any], listed: Sequence[tuple[torch.Tensor, str]], first_group: int
    ) -> tuple[ParamRegistry, ZeroPlan, dict[str, Any]]:
        """The registry, agreed plan and settings with ``param_group`` appended (collective, pure);
        ``listed`` and ``first_group`` as :func:`replanning.add_param_group` takes them."""
        return replanning.add_param_group(
            self.registry,
            self.settings,
            self.hyper(),
            self._defaults,
            param_group,
            self.world,
            listed,
            first_group,
        )

    def adopt_group(self, registry: ParamRegistry, zp: ZeroPlan, group: dict[str, Any]) -> None:
        """Take the new group (``group`` is the user's dict, already in ``param_groups``) and its plan."""
        broadcast_values(registry.params[len(self.registry.params) :], self.world)
        self.param_groups.append(group)
        self.registry = registry
        self.replan(zp)
