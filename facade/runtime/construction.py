"""Building a ``ZeroOptimizer``: its domains planned and agreed on by every rank, then made.

``ZeroOptimizer.__init__`` hands its arguments over as a :class:`Request`; :func:`agree` splits the
param groups into domains ([Note: expert domains] in ``zeroplan.core.domains``), validates and plans each, and
has every rank agree (the data-parallel domain over the world, each expert domain over its group,
then one verdict over the world), so a bad argument on any rank raises on every rank before anything
is modified; :func:`joint_step` then makes the domains and what couples them ([Note: joint step]).

``torch._dynamo`` is imported first thing, and its garbage collected: see [Note: importing
torch._dynamo here] in ``mechanisms.dynamo``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core import (
    ConfigError,
    MeshRoles,
    ScalerConfig,
    StepOptions,
    ZeroPlan,
    ZeroplanError,
    initial_state,
    mesh_roles,
)
from zeroplan.core.wire import DEFAULT_WIRE_BLOCK
from zeroplan.facade.diagnostics.memory_check import check_device_memory
from zeroplan.facade.mechanisms.agreement import verdicts
from zeroplan.facade.mechanisms.dynamo import import_dynamo
from zeroplan.facade.mechanisms.groups import data_parallel_group, group_timeout, new_groups
from zeroplan.facade.mechanisms.policies import check_reduction
from zeroplan.facade.params.sharded import Peers
from zeroplan.facade.runtime import replanning
from zeroplan.facade.runtime.domain import DomainInput, DomainRuntime, check_partition, split_domains
from zeroplan.facade.runtime.joint import JointStep
from zeroplan.facade.runtime.registry import Configured, configure, grad_wire, param_wire

import_dynamo()


__all__ = [
    "Agreed",
    "MeshGroups",
    "Request",
    "agree",
    "agree_over_mesh",
    "check_transport",
    "joint_step",
    "mesh_groups",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """The arguments of ``ZeroOptimizer(...)`` that planning reads (see its docstring for each)."""

    optimizer_class: type[torch.optim.Optimizer]
    optimizer_defaults: dict[str, Any]
    stage: int
    shard_group_size: int | None
    ranks_per_node: int | None
    strategy: str
    bucket_bytes: int
    layout: str
    loss_scale: float | str | None
    scaler: ScalerConfig | None
    alignment: int
    max_inflight_buckets: int
    collectives: str
    options: StepOptions
    strict_memory: bool
    deterministic: bool = False
    reduce_dtype: Any = None
    gather_dtype: Any = None
    wire_block: int = DEFAULT_WIRE_BLOCK
    offload: Any = None
    offload_fraction: Any = None
    tensor_mesh: Any = None

    def configure(self, item: DomainInput, first: bool) -> Configured:
        """Validate the request for one domain (shard groups and nodes are the data domain's only).

        Expert buckets reduce at ``step()``: an expert that got no token on one rank has no
        gradient there, and a backward hook waiting for its bucket would wait for that rank,
        which launches it only in ``step()``, after the data domain it may be waiting on.
        """
        return configure(
            item.param_groups,
            self.optimizer_class,
            self.optimizer_defaults,
            world=item.group,
            stage=self.stage,
            shard_group_size=self.shard_group_size if first else None,
            strategy=self.strategy,
            alignment=self.alignment,
            bucket_bytes=self.bucket_bytes,
            loss_scale=self.loss_scale,
            max_inflight_buckets=self.max_inflight_buckets,
            collectives=self.collectives,
            layout=self.layout,
            ranks_per_node=self.ranks_per_node if first else None,
            deterministic=self.deterministic,
            grad_wire=grad_wire(self.reduce_dtype, self.wire_block),
            param_wire=param_wire(self.gather_dtype, self.wire_block),
            options=self.options if first else dataclasses.replace(self.options, overlap_grad_reduce=False),
            offload=self.offload,
            offload_fraction=self.offload_fraction,
            tensor_mesh=self.tensor_mesh,
        )


class Agreed(NamedTuple):
    """Every domain's input, validated settings and plan, agreed on by every rank."""

    inputs: list[DomainInput]
    configured: list[Configured]
    plans: list[ZeroPlan]

    def param_groups(self, world: dist.ProcessGroup) -> list[dict[str, Any]]:
        """The param groups for ``torch.optim.Optimizer``: the user's order, expert ones with their group."""
        ordered: list[dict[str, Any]] = [{} for _ in range(sum(len(i.positions) for i in self.inputs))]
        for item, c in zip(self.inputs, self.configured, strict=True):
            params_of = c.registry.user_params  # the user's tensors (a DTensor, not its local tensor)
            for position, g in zip(item.positions, c.groups, strict=True):
                extra = {} if item.group is world else {"process_group": item.group}
                ordered[position] = {**g, **extra, "params": [params_of[i] for i in g["params"]]}
        return ordered


def agree(params: Iterable[Any], world: dist.ProcessGroup, request: Request) -> Agreed:
    """Split, validate and plan every domain; every rank agrees, or every rank raises.

    Raises:
        ConfigError: a bad argument on any rank (nothing is modified).
        IncompatiblePlanError: ranks disagree on parameters or settings.
    """
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
            c = request.configure(item, first=d == 0)
            zp = c.settings.plan(c.registry, c.groups)
            devices = {p.device.type for p in c.registry.params}
            check_transport(zp, dist.get_backend(item.group), devices, domains=len(inputs))
            check_current_device(dist.get_backend(item.group), c.registry.device)
            check_device_memory(zp, c, item.group, strict=request.strict_memory)
            configured.append(c)
            plans.append(zp)
        _check_disjoint(inputs, configured)
        return plans[0], configured[0].groups

    # ranks_per_node is not fingerprinted (it changes no layout) but decides the groups made later.
    layout_of_domains = [(i.positions, dist.get_world_size(i.group)) for i in inputs]
    plans[:1] = [
        replanning.agreed_plan(
            make,
            world,
            loss_scale=repr(request.loss_scale),
            scaler=repr(request.scaler),
            ranks_per_node=repr(request.ranks_per_node),
            domains=repr(layout_of_domains),
        )
    ]
    if len(inputs) > 1:
        check_partition(inputs, world)  # before any expert group's own collective
        plans[1:] = _agreed_expert_plans(inputs, configured, plans, world)
    return Agreed(inputs, configured, plans)


def agree_over_mesh(
    params: Iterable[Any], world: dist.ProcessGroup, request: Request, *, meshed: bool
) -> Agreed:
    """:func:`agree` over ``world``; with a device mesh, every rank of the job then hears whether
    every data-parallel group agreed (one of another tensor slice or pipeline stage may have failed
    alone, and its peers would wait for it in their first model-parallel collective).

    A mesh with a tensor-parallel dimension of size > 1 needs DTensor parameters on some rank: a
    pipeline stage may hold only plain ones (replicated over tp, as a norm is), but a job where no
    stage placed any would train a whole replica per tp slice.

    Raises:
        ConfigError: on every rank of the job, as :func:`agree` raises on the ranks of ``world``; or
            no rank's parameters are DTensors though the mesh's tp dimension has several slices.
    """
    if not meshed:
        return agree(params, world, request)
    problem: Exception | None = None
    placed = False
    try:
        agreed = agree(params, world, request)
        placed = agreed.configured[0].registry.placed
    except Exception as exc:  # every rank of the job must hear of it
        problem = exc
    rows = verdicts(
        problem,
        dist.group.WORLD,
        failed="(in another data-parallel group of the mesh) refused the optimizer",
        facts=placed,
    )
    tensor_mesh = request.tensor_mesh
    if tensor_mesh is not None and tensor_mesh.size() > 1 and not any(rows):
        raise ConfigError(_UNPLACED.format(names=tensor_mesh.mesh_dim_names, size=tensor_mesh.size()))
    return agreed


#: A job whose mesh has a tp dimension of size > 1 but whose parameters (on no pipeline stage) are
#: DTensors: every tp slice would train a whole replica, a model nobody parallelized.
_UNPLACED = (
    "the device mesh has a tensor-parallel dimension {names} of size {size}, but no parameter of any "
    "pipeline stage is a DTensor: place the model on mesh['tp'] first (torch.distributed.tensor."
    "parallel.parallelize_module), or build the mesh without 'tp'"
)


class MeshGroups(NamedTuple):
    """What a device mesh gives an optimizer ([Note: mesh roles] in ``zeroplan.core.mesh``).

    Attributes:
        data: the data-parallel group zeroplan shards and reduces over.
        stages: the ranks holding the other pipeline stages of this data-parallel slice, or ``None``.
        shard_group_size: ranks per shard group (``dp_shard`` beside ``dp_replicate``, or the
            optimizer's own argument); ``None``: the whole data-parallel group.
        siblings: every data-parallel group of the mesh (one per pipeline stage), in global ranks.
    """

    data: dist.ProcessGroup
    stages: dist.ProcessGroup | None
    shard_group_size: int | None
    siblings: tuple[tuple[int, ...], ...]
    tensor: dist.ProcessGroup | None = None
    tensor_mesh: Any = None


def mesh_groups(
    mesh: Any,
    process_group: dist.ProcessGroup | None,
    shard_group_size: int | None,
    facts: Any,
    *,
    experts: bool = False,
) -> MeshGroups:
    """The groups of ``mesh``'s dimensions, agreed by every rank of the default group: the same mesh
    and the same ``facts`` (settings every stage must share) everywhere, or a ``ConfigError`` on every
    rank (also for a ``process_group`` beside the mesh, or expert groups: param groups with a
    ``process_group`` of their own). Collective over the default group; what travels is a digest.
    """
    data_parallel_group(None)  # torch.distributed is initialised
    world = dist.get_world_size()
    problem: Exception | None = None
    described: Any = None
    try:
        if process_group is not None:
            raise ConfigError("pass process_group or device_mesh, not both (the mesh names the groups)")
        if experts:
            raise ConfigError(
                "expert groups (param groups with a process_group) with a device mesh are not supported "
                "yet: pass the data-parallel group as process_group instead of the mesh"
            )
        roles = mesh_roles(mesh.mesh_dim_names, tuple(mesh.shape), shard_group_size=shard_group_size)
        ranks = mesh.mesh.flatten().tolist()
        if sorted(ranks) != list(range(world)):
            raise ConfigError(
                f"the device mesh holds ranks {sorted(ranks)[:8]}..., not the {world} ranks of the default "
                "group: build it over every rank (init_device_mesh)"
            )
        siblings = _data_groups(mesh, roles)
        if any(list(row) != sorted(row) for row in siblings):
            raise ConfigError(
                f"the device mesh orders the ranks of a data-parallel group as {siblings}: list each "
                "group's ranks in increasing order (a process group orders its ranks so)"
            )
        whole = repr((roles.names, roles.sizes, ranks, facts)).encode()
        described = (roles.names, roles.sizes, facts, hashlib.sha256(whole).hexdigest()[:16])
    except Exception as exc:  # every rank must hear of it, not hang in the next collective
        problem = exc
    rows = verdicts(problem, dist.group.WORLD, failed="could not use its device mesh", facts=described)
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        raise ConfigError(
            f"ranks were given different device meshes or settings: {rows[0]} on rank 0, "
            f"{rows[differ[0]]} on rank {differ[0]}"
        )
    data = mesh.get_group(roles.data[0]) if len(roles.data) == 1 else _data_group(siblings)
    stages = mesh.get_group(roles.stages) if roles.stages is not None else None
    tensor, tensor_mesh = None, None
    if roles.tensor is not None:  # [Note: tensor-parallel parameters] in zeroplan.core.tensor_parallel
        tensor_mesh = mesh[roles.tensor]
        tensor = tensor_mesh.get_group()
    return MeshGroups(data, stages, roles.shard_group_size or shard_group_size, siblings, tensor, tensor_mesh)


def _data_groups(mesh: Any, roles: MeshRoles) -> tuple[tuple[int, ...], ...]:
    """Every data-parallel group of ``mesh`` (one per pipeline stage), its ranks in mesh order."""
    data_axes = [roles.names.index(n) for n in roles.data]
    other_axes = [a for a in range(len(roles.names)) if a not in data_axes]
    grid = mesh.mesh.permute(*other_axes, *data_axes).reshape(-1, roles.data_size).tolist()
    return tuple(tuple(int(r) for r in row) for row in grid)


def _data_group(siblings: tuple[tuple[int, ...], ...]) -> dist.ProcessGroup:
    """This rank's group among ``siblings`` (every data-parallel group of the mesh): the whole job when
    there is one, else made by every rank for every group, in order."""
    if len(siblings) == 1:
        return dist.group.WORLD
    return new_groups(siblings, group_timeout(dist.group.WORLD))


def check_current_device(backend: str, device: torch.device) -> None:
    """Refuse NCCL with parameters on another GPU than the current one.

    torch's object collectives (the plan agreement, checkpoint metadata) put their tensors on
    ``torch.cuda.current_device()``: without ``torch.cuda.set_device(local_rank)`` every rank of a
    node would use GPU 0 for them, and NCCL would hang or fail on the duplicate device.

    Raises:
        ConfigError: the backend is NCCL and ``device`` is not the current CUDA device.
    """
    if "nccl" not in backend or device.type != "cuda":
        return
    current = torch.cuda.current_device()
    if device.index is not None and device.index != current:
        raise ConfigError(
            f"the parameters are on {device} but the current CUDA device is cuda:{current}; call "
            f"torch.cuda.set_device({device.index}) (the local rank's GPU) before "
            "init_process_group and before building the optimizer"
        )


def check_transport(zp: ZeroPlan, backend: str, devices: set[str], *, domains: int = 1) -> None:
    """Refuse a plan whose calls the backend cannot carry for tensors on ``devices``.

    First the reduction policy's own refusals (``policies.check_reduction``, [Note: reduction
    policy]), in an optimizer of ``domains`` data-parallel domains (expert groups).

    The ``gloo`` collective policy runs reduce-scatters and gathers as point-to-point exchanges
    ([Note: collective policy] in ``zeroplan.core.comm``): gloo carries them for CPU tensors only,
    and on NCCL the ranks' unbatched ``irecv``/``isend`` can deadlock. Rank-major plans at stages 1
    and 2 (all-reduces, and broadcasts of chunks: [Note: gather blocks] in ``zeroplan.core.planner``)
    need no exchange and run on gloo with CUDA tensors too.

    Deterministic mode's and a gradient wire's all-to-all run on NCCL, and on gloo for CPU tensors
    only; deterministic mode refuses expert groups.

    Raises:
        ConfigError: the plan exchanges on another backend than gloo, or CUDA tensors over gloo.
    """
    check_reduction(zp, backend=backend, devices=devices, domains=domains)
    exchanged = any(zp.exchanges(b.collective) for b in zp.buckets.buckets) or any(
        zp.exchanges(zp.gather_collective(block))
        for space in zp.partition.spaces
        for block in zp.gather_blocks(space)
    )
    if not exchanged:
        return
    if backend != "gloo":
        raise ConfigError(
            f"collectives='gloo' runs reduce-scatters and gathers as point-to-point exchanges, which "
            f"{backend} could deadlock on; use collectives='min_bytes' (what 'auto' picks on {backend})"
        )
    if devices - {"cpu"}:
        raise ConfigError(
            f"the parameters are on {sorted(devices - {'cpu'})} and the process group is gloo, whose "
            "point-to-point exchanges (collectives='gloo', the default on gloo) carry CPU tensors only; "
            "use backend='nccl' for GPU tensors, or layout='rank_major' (its gradients are all-reduced "
            "and its parameters broadcast in chunks, which gloo carries for CUDA tensors)"
        )


def joint_step(
    agreed: Agreed,
    param_groups: list[dict[str, Any]],
    defaults: dict[str, Any],
    world: dist.ProcessGroup,
    scaler: ScalerConfig | None,
    stages: dist.ProcessGroup | None = None,
    siblings: tuple[tuple[int, ...], ...] | None = None,
    tensor: dist.ProcessGroup | None = None,
) -> JointStep:
    """Install every agreed domain over the optimizer's own ``param_groups`` and couple them."""
    peers = Peers()  # [Note: several sharded domains]
    domains = [
        DomainRuntime(
            name=item.name,
            world=item.group,
            configured=c,
            zp=zp,
            param_groups=[param_groups[p] for p in item.positions],
            defaults=defaults,
            peers=peers,
            siblings=siblings if d == 0 else None,
        )
        for d, (item, c, zp) in enumerate(zip(agreed.inputs, agreed.configured, agreed.plans, strict=True))
    ]
    mode = agreed.configured[0].mode
    return JointStep(  # [Note: joint step]
        domains,
        world,
        scaler=initial_state(scaler or ScalerConfig()) if mode == "dynamic" else None,
        static_scale=mode if isinstance(mode, float) else 1.0,
        stages=stages,
        tensor=tensor,
    )


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
