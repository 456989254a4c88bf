# zeroplan.core — pure planning: no torch, no I/O.
# Param groups sharded over different groups of ranks (MoE experts); each domain is an ordinary plan.
"""``DomainPlans``: one :class:`~zeroplan.core.planner.ZeroPlan` per group of ranks.

[Note: expert domains]
In a mixture-of-experts model the expert parameters differ between
expert-parallel ranks. Their gradients are averaged, and their optimizer state
sharded, over the *expert-data-parallel* group (the ranks holding the same
experts), not over the whole data-parallel world (InternLM's MoE param groups).

zeroplan models this with *domains*. A :class:`Domain` is a set of the user's
param groups reduced and sharded over one process group, described by its own
:class:`~zeroplan.core.topology.Topology`; domain 0 is the data-parallel (dense)
domain. Nothing else is new: :func:`plan_domains` gives each domain an ordinary
plan of :func:`~zeroplan.core.planner.plan`, so partitions, buckets, stages,
memory and traffic are those of single-domain zeroplan, domain by domain.

Each domain's plan sees only its own parameters, renumbered: a spec's ``group``
becomes its position in ``Domain.groups`` and ``index`` runs ``0..m-1`` in the
user's order (name, shape, dtype, trainable and cohort are kept).
:attr:`DomainPlans.specs` rebuilds the user's list and :meth:`DomainPlans.locate`
maps a user index to ``(domain, index in that domain's plan)``. With a single
domain holding every group, the renumbering is the identity and the plan is the
one :func:`~zeroplan.core.planner.plan` makes.

Domains share processes, not state: one process is one rank of every
domain's group. :meth:`DomainsReport.rank` adds up one process's memory (a rank
of each domain) and keeps each domain's traffic, named ``"experts/shard"``,
``"experts/replica"``, ... (domain 0's names stay ``"shard"``, ``"world"``, ...).
Each domain's group is a subgroup of the data-parallel world, so its world size
divides domain 0's. Which rank of each domain a process is depends on how the
process groups are laid out, and is the caller's to say.

:func:`expert_domains` builds both from a whole MoE model: what one rank holds
(every dense parameter, its share of each layer's experts) and the ``"data"`` and
``"experts"`` domains (see [Note: one rank's experts] in zeroplan.core.experts).

In the facade the user says which groups are experts' per param group:
``{"params": experts, "process_group": ep_dp_group}``. ``ZeroOptimizer`` splits
its param groups into domains (``facade/runtime/domain.py``: groups without a
process group of their own form domain 0, with MiCS shard groups and nodes;
each other process group one more domain, sharded over that whole group), and
runs each as a ``DomainRuntime``: its own process groups, buffers, gradient
hooks, inner optimizer and step lifecycle, exactly the parts a single-domain
optimizer has. What couples the domains is the joint step's and nothing else's
([Note: joint step] in ``facade/runtime/joint.py``): one loss scale; one divisor
(gradients are summed over a domain's group and divided by the data-parallel
world's size, so that they are the gradients of the world's mean loss, as in one
process); one overflow verdict over the world; one gradient norm over every
parameter of the model (each rank adds its domains' local sums, domain ``d``'s
divided by its replica count, so each element counts once); the user's param
group order (``param_groups`` is one list whose dicts the domains share, so LR
schedulers reach every domain). State follows the domains: ``state_dict()``
holds one sharded dict per domain, and a checkpoint each rank's expert state next
to the data domain's, in the same atomic snapshot; the data domain's state is
elastic, expert state loads at the world size and expert groups it was saved with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, NamedTuple

from zeroplan.core.comm import Collective, send_elements
from zeroplan.core.errors import ConfigError, check_config
from zeroplan.core.fingerprint import digest
from zeroplan.core.memory import MemoryReport, RankReport, memory_report
from zeroplan.core.optim.optimizers import OptimizerSpec, describe_optimizer
from zeroplan.core.planner import Stage, ZeroPlan, plan
from zeroplan.core.specs import ParamSpec, check_specs
from zeroplan.core.topology import Topology
from zeroplan.core.traffic import CommCost

__all__ = [
    "Domain",
    "DomainPlans",
    "DomainsReport",
    "ParamLocation",
    "domains_report",
    "plan_domains",
]

#: The message for a domain without parameters (``format`` it with the domain).
_EMPTY_DOMAIN = (
    "domain {0.name!r} (param groups {0.groups}) has no parameters: an empty domain plans nothing; "
    "drop it, or give its param groups parameters"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Domain:
    """Param groups reduced and sharded over one group of ranks (see [Note: expert domains]).

    Attributes:
        name: short label, unique among the domains (``"data"``, ``"experts"``);
            prefixes the domain's traffic in reports.
        groups: the user's param group indices, strictly increasing.
        topology: world and shard sizes of the domain's process group.

    Example:
        >>> Domain(name="experts", groups=[1], topology=Topology(world_size=2)).groups
        (1,)
    """

    name: str
    groups: tuple[int, ...]
    topology: Topology

    def __post_init__(self) -> None:
        check_config(
            isinstance(self.name, str) and self.name != "",
            f"Domain.name must be a non-empty string such as 'experts', got {self.name!r}",
        )
        if isinstance(self.groups, Sequence) and not isinstance(self.groups, str):
            object.__setattr__(self, "groups", tuple(self.groups))
        groups = self.groups
        check_config(
            isinstance(groups, tuple) and len(groups) >= 1 and all(type(g) is int and g >= 0 for g in groups),
            f"domain {self.name!r}: groups must be a tuple of one or more param group indices "
            f"(ints >= 0), got {groups!r}",
        )
        check_config(
            all(a < b for a, b in pairwise(groups)),
            f"domain {self.name!r}: groups must be strictly increasing, got {groups!r}; "
            f"pass {tuple(sorted(set(groups)))!r}",
        )
        check_config(
            isinstance(self.topology, Topology),
            f"domain {self.name!r}: topology must be a Topology, got {type(self.topology).__name__}",
        )


class ParamLocation(NamedTuple):
    """Where a user parameter lives: ``plans[domain].specs[index]``."""

    domain: int
    index: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DomainPlans:
    """One plan per domain, together covering the user's param groups ``0..G-1`` exactly once.

    Attributes:
        domains: the domains; domain 0 is the data-parallel one.
        plans: ``plans[d]`` plans ``domains[d]``'s parameters, renumbered (see
            [Note: expert domains]); all at one stage.
        specs: the user's parameter list, rebuilt from the plans (derived).
        locations: per user parameter index, where it lives (derived).

    Raises:
        ConfigError: the plans do not fit the domains (the message says which).
    """

    domains: tuple[Domain, ...]
    plans: tuple[ZeroPlan, ...]
    specs: tuple[ParamSpec, ...] = field(init=False)
    locations: tuple[ParamLocation, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "domains", tuple(self.domains))
        object.__setattr__(self, "plans", tuple(self.plans))
        domains, plans = self.domains, self.plans
        check_config(
            len(domains) >= 1 and len(plans) == len(domains),
            f"got {len(plans)} plans for {len(domains)} domains; pass one plan per domain (at least one)",
        )
        check_config(
            all(isinstance(d, Domain) for d in domains) and all(isinstance(p, ZeroPlan) for p in plans),
            "DomainPlans takes a tuple of Domain and a tuple of ZeroPlan",
        )
        _check_domains(domains)
        for d, (domain, zp) in enumerate(zip(domains, plans, strict=True)):
            check_config(
                zp.topology == domain.topology,
                f"plans[{d}] is for {zp.topology} but domain {domain.name!r} has {domain.topology}",
            )
            check_config(
                zp.stage is plans[0].stage,
                f"plans[{d}] (domain {domain.name!r}) is at stage {int(zp.stage)} but plans[0] at "
                f"stage {int(plans[0].stage)}; plan every domain at one stage",
            )
            check_config(len(zp.specs) > 0, _EMPTY_DOMAIN.format(domain))
            local_groups = 1 + max(s.group for s in zp.specs)
            check_config(
                local_groups <= len(domain.groups),
                f"plans[{d}] has {local_groups} param groups but domain {domain.name!r} lists "
                f"{len(domain.groups)} ({domain.groups}); a domain plan's groups are positions in "
                "Domain.groups (use plan_domains)",
            )
        # The user's list is group by group (check_specs), each group's parameters in plan order.
        members: dict[int, list[ParamLocation]] = {}
        for d, (domain, zp) in enumerate(zip(domains, plans, strict=True)):
            for spec in zp.specs:
                members.setdefault(domain.groups[spec.group], []).append(ParamLocation(d, spec.index))
        specs, locations = [], []
        for group in sorted(members):
            for where in members[group]:
                spec = plans[where.domain].specs[where.index]
                locations.append(where)
                specs.append(dataclasses.replace(spec, index=len(specs), group=group))
        object.__setattr__(self, "specs", tuple(specs))
        object.__setattr__(self, "locations", tuple(locations))

    @property
    def stage(self) -> Stage:
        """The stage every domain is planned at."""
        return self.plans[0].stage

    def domain_of_group(self, group: int) -> int:
        """The domain that reduces and shards the user's param group ``group``."""
        for d, domain in enumerate(self.domains):
            if group in domain.groups:
                return d
        groups = sum(len(d.groups) for d in self.domains)
        raise ConfigError(f"param group {group!r} is outside the domains' groups 0..{groups - 1}")

    def locate(self, index: int) -> ParamLocation:
        """Where the user's parameter ``index`` lives: its domain and its index in that domain's plan.

        Example:
            >>> from zeroplan.core.specs import specs_from_shapes
            >>> specs = specs_from_shapes([(4,)] * 3)
            >>> specs = [dataclasses.replace(s, group=g) for s, g in zip(specs, (0, 1, 1))]
            >>> dp = plan_domains(specs, [
            ...     Domain(name="data", groups=(0,), topology=Topology(world_size=2)),
            ...     Domain(name="experts", groups=(1,), topology=Topology(world_size=1)),
            ... ])
            >>> dp.locate(2)
            ParamLocation(domain=1, index=1)
        """
        check_config(
            type(index) is int and 0 <= index < len(self.locations),
            f"parameter index {index!r} is outside 0..{len(self.locations) - 1}",
        )
        return self.locations[index]

    def fingerprint(self) -> str:
        """Stable digest of the domains and of every domain's plan (what ranks must agree on)."""
        return digest(
            "zeroplan-domains/v1",
            [(d.name, d.groups, zp.fingerprint()) for d, zp in zip(self.domains, self.plans, strict=True)],
        )


def _check_domains(domains: tuple[Domain, ...]) -> None:
    """Names unique, groups exactly ``0..G-1`` once each, worlds dividing domain 0's."""
    names = [d.name for d in domains]
    twice = sorted({n for n in names if names.count(n) > 1})
    check_config(not twice, f"domain names must be unique; {twice} used more than once")
    owner: dict[int, str] = {}
    for domain in domains:
        for group in domain.groups:
            check_config(
                group not in owner,
                f"param group {group} is in two domains, {owner.get(group)!r} and {domain.name!r}; "
                "each param group is reduced over exactly one group of ranks",
            )
            owner[group] = domain.name
    missing = [g for g in range(len(owner)) if g not in owner]
    check_config(
        not missing,
        f"param group {missing[0] if missing else 0} is in no domain (the domains list groups "
        f"{sorted(owner)}); add it to one, e.g. the data domain {domains[0].name!r}",
    )
    world = domains[0].topology.world_size
    for domain in domains[1:]:
        check_config(
            world % domain.topology.world_size == 0,
            f"domain {domain.name!r} has world size {domain.topology.world_size}, which does not divide "
            f"the data-parallel world of {world} (domain {domains[0].name!r}); its group is a subgroup "
            "of the data-parallel ranks",
        )


def _per_group_optimizers(
    optimizer: str | OptimizerSpec | Sequence[OptimizerSpec], groups: int
) -> tuple[OptimizerSpec, ...]:
    """One optimizer description per user param group."""
    if isinstance(optimizer, str):
        optimizer = describe_optimizer(optimizer)
    if isinstance(optimizer, OptimizerSpec):
        return (optimizer,) * groups
    optimizers = tuple(optimizer)
    check_config(
        len(optimizers) == groups and all(isinstance(o, OptimizerSpec) for o in optimizers),
        f"optimizer: pass a name, an OptimizerSpec, or one OptimizerSpec per param group "
        f"({groups} groups), got {len(optimizers)} items",
    )
    return optimizers


def plan_domains(
    specs: Sequence[ParamSpec],
    domains: Sequence[Domain],
    *,
    stage: int = Stage.GRADIENTS,
    optimizer: str | OptimizerSpec | Sequence[OptimizerSpec] = "AdamW",
    **options: Any,
) -> DomainPlans:
    """Plan each domain's param groups on its own topology (see [Note: expert domains]).

    Args:
        specs: the whole model's parameters: indices ``0..n-1``, the user's group indices.
        domains: the domains, domain 0 first; together they list groups ``0..G-1`` once each.
        stage: 0 (DDP), 1, 2 or 3, for every domain.
        optimizer: a name or spec for every group, or one spec per user group
            (each domain gets those of its groups, in order).
        **options: passed to :func:`~zeroplan.core.planner.plan` unchanged
            (``strategy``, ``alignment``, ``bucket_bytes``, ``loss_scaling``,
            ``max_inflight_buckets``, ``policy``, ``layout``).

    Returns:
        The domains and their plans; ``plans[d]``'s specs are domain ``d``'s,
        renumbered (``group``: position in ``Domain.groups``; ``index``: ``0..m-1``).

    Raises:
        ConfigError: a group in no domain or in two, a parameter whose group no
            domain lists, a domain without parameters, or an invalid ``plan`` setting.

    Example:
        A world of 4 whose experts are sharded over expert-data-parallel groups of 2:

        >>> from zeroplan.core.specs import specs_from_shapes
        >>> shapes = [(1000, 64), (64, 256), (256, 64)]
        >>> specs = [dataclasses.replace(s, group=g)
        ...          for s, g in zip(specs_from_shapes(shapes, names=["embed", "w1", "w2"]), (0, 1, 1))]
        >>> dp = plan_domains(specs, [
        ...     Domain(name="data", groups=(0,), topology=Topology(world_size=4)),
        ...     Domain(name="experts", groups=(1,), topology=Topology(world_size=2)),
        ... ], stage=2)
        >>> [[(s.index, s.name, s.group) for s in zp.specs] for zp in dp.plans]
        [[(0, 'embed', 0)], [(0, 'w1', 0), (1, 'w2', 0)]]
        >>> [zp.partition.spaces[0].shard_numel for zp in dp.plans]   # elements per shard rank
        [(16000, 16000, 16000, 16000), (16384, 16384)]
    """
    specs = check_specs(specs)
    domains = tuple(domains)
    check_config(
        len(domains) >= 1 and all(isinstance(d, Domain) for d in domains),
        f"pass one or more Domain values (domain 0: the data-parallel one), got {domains!r}",
    )
    _check_domains(domains)
    groups = sum(len(d.groups) for d in domains)
    for spec in specs:
        check_config(
            spec.group < groups,
            f"parameter {spec.name!r} is in param group {spec.group}, which no domain lists (the domains "
            f"cover groups 0..{groups - 1}); add group {spec.group} to a domain",
        )
    optimizers = _per_group_optimizers(optimizer, groups)
    plans = []
    for domain in domains:
        position = {group: local for local, group in enumerate(domain.groups)}
        mine = [s for s in specs if s.group in position]
        check_config(len(mine) > 0, _EMPTY_DOMAIN.format(domain))
        local = [dataclasses.replace(s, index=i, group=position[s.group]) for i, s in enumerate(mine)]
        domain_optimizers = tuple(optimizers[g] for g in domain.groups)
        plans.append(plan(local, domain.topology, stage=stage, optimizer=domain_optimizers, **options))
    return DomainPlans(domains=domains, plans=tuple(plans))


@dataclass(frozen=True, slots=True, kw_only=True)
class DomainsReport:
    """Memory and traffic of every domain's plan (:func:`domains_report`).

    Attributes:
        domains: the domains.
        reports: ``reports[d]`` is :func:`~zeroplan.core.memory.memory_report` of
            domain ``d``'s plan; its ranks are the ranks of the domain's group.
        controls: scalar all-reduces over domain 0's world per step that couple
            the domains (the joint gradient norm when clipping, the overflow
            verdict with a loss scale; see [Note: expert domains]); 0 for one domain.
    """

    domains: tuple[Domain, ...]
    reports: tuple[MemoryReport, ...]
    controls: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "domains", tuple(self.domains))
        object.__setattr__(self, "reports", tuple(self.reports))
        check_config(
            len(self.domains) >= 1 and len(self.reports) == len(self.domains),
            f"got {len(self.reports)} reports for {len(self.domains)} domains; pass one per domain",
        )
        for domain, report in zip(self.domains, self.reports, strict=True):
            t = domain.topology
            check_config(
                (report.world, report.shard_size) == (t.world_size, t.shard_size),
                f"report of world {report.world}, shard size {report.shard_size} does not match "
                f"domain {domain.name!r} ({t})",
            )

    def rank(self, positions: Sequence[int]) -> RankReport:
        """One process's totals: it is rank ``positions[d]`` of domain ``d``'s group, for every domain.

        ``positions[d]`` indexes ``reports[d].ranks`` (a rank of the domain's
        group, ``0..world-1``; with no replicas it is the shard rank). Bytes are
        summed field by field. The comm entries of every domain are kept, their
        ``group`` prefixed with the domain's name (``"experts/shard"``), except
        domain 0's. The backward and step transients are summed too, which is an
        upper bound: the domains' peaks need not coincide. ``rank`` and
        ``shard_rank`` are domain 0's.

        Raises:
            ConfigError: not one position per domain, or one out of its domain's range.
        """
        positions = tuple(positions)
        check_config(
            len(positions) == len(self.domains),
            f"got {len(positions)} positions for {len(self.domains)} domains; pass the process's "
            f"rank in each domain's group, in domain order ({[d.name for d in self.domains]})",
        )
        rows = []
        for domain, report, p in zip(self.domains, self.reports, positions, strict=True):
            check_config(
                type(p) is int and 0 <= p < report.world,
                f"position {p!r} is outside domain {domain.name!r}'s ranks 0..{report.world - 1}",
            )
            rows.append(report.ranks[p])
        comm = list(rows[0].comm)
        if self.controls:  # float32 scalars over the world, merged with domain 0's world entry if any
            world = self.domains[0].topology
            sent = send_elements(Collective.ALL_REDUCE, [1] * world.world_size, positions[0]) * 4
            extra = CommCost(
                group="world",
                collective=Collective.ALL_REDUCE,
                calls=self.controls,
                bytes=self.controls * sent,
                link=world.world_link,
            )
            same = next(
                (
                    i
                    for i, c in enumerate(comm)
                    if (c.group, c.collective, c.link) == ("world", extra.collective, extra.link)
                ),
                None,
            )
            if same is None:
                comm.append(extra)
            else:
                comm[same] = dataclasses.replace(
                    comm[same], calls=comm[same].calls + extra.calls, bytes=comm[same].bytes + extra.bytes
                )
        for domain, row in zip(self.domains[1:], rows[1:], strict=True):
            comm.extend(dataclasses.replace(c, group=f"{domain.name}/{c.group}") for c in row.comm)
        return RankReport(
            rank=rows[0].rank,
            shard_rank=rows[0].shard_rank,
            params_bytes=sum(r.params_bytes for r in rows),
            grads_bytes=sum(r.grads_bytes for r in rows),
            master_bytes=sum(r.master_bytes for r in rows),
            optimizer_state_bytes=sum(r.optimizer_state_bytes for r in rows),
            buffer_bytes=sum(r.buffer_bytes for r in rows),
            comm=tuple(comm),
            backward_transient_bytes=sum(r.backward_transient_bytes for r in rows),
            step_transient_bytes=sum(r.step_transient_bytes for r in rows),
            host_bytes=sum(r.host_bytes for r in rows),
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready mapping: per domain its name, groups, sizes and memory report."""
        return {
            "domains": [
                {
                    "name": domain.name,
                    "groups": list(domain.groups),
                    "world": domain.topology.world_size,
                    "shard_size": domain.topology.shard_size,
                    "report": report.as_dict(),
                }
                for domain, report in zip(self.domains, self.reports, strict=True)
            ]
        }


def domains_report(
    dp: DomainPlans,
    *,
    clipping: bool = False,
    arrivals: Sequence[Sequence[int] | None] | None = None,
) -> DomainsReport:
    """Memory per rank and traffic per step of every domain's plan.

    Each domain is reported as its own plan would be (its overflow all-reduce
    included); :meth:`DomainsReport.rank` adds up one process. With several
    domains the gradient norm is one all-reduce over the world, not one per
    domain, and the overflow verdict one more (``DomainsReport.controls``).

    Args:
        dp: the domain plans.
        clipping: include each domain's all-reduce of ``clip_grad_norm_``.
        arrivals: per domain, the order its gradients arrive in, as indices of
            that domain's plan (see :func:`~zeroplan.core.peak.backward_peak`), or ``None``.

    Raises:
        ConfigError: ``arrivals`` is not one entry per domain.
    """
    arrivals = (None,) * len(dp.plans) if arrivals is None else tuple(arrivals)
    check_config(
        len(arrivals) == len(dp.plans),
        f"got {len(arrivals)} arrival orders for {len(dp.plans)} domains; pass one per domain "
        "(None for the default order)",
    )
    joint = len(dp.plans) > 1
    reports = tuple(
        memory_report(zp, clipping=clipping and not joint, arrivals=order)
        for zp, order in zip(dp.plans, arrivals, strict=True)
    )
    controls = int(clipping) + int(dp.plans[0].loss_scaling) if joint else 0
    return DomainsReport(domains=dp.domains, reports=reports, controls=controls)
