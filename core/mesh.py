"""Which dimensions of a device mesh zeroplan shards over, and which hold other pipeline stages.

[Note: mesh roles]
``ZeroOptimizer(..., device_mesh=mesh)`` reads a mesh's dimensions by name, as
torchtitan names them: ``dp`` is the data-parallel dimension zeroplan shards and
reduces over; ``dp_replicate`` x ``dp_shard`` (in that order) is the same with
MiCS-style shard groups (shard groups are ``dp_shard``, their replicas
``dp_replicate``); ``pp`` holds the other pipeline stages of the same data-parallel
slice, whose optimizers step their own parameters, so the gradient norm and the
overflow verdict are joined over it (one norm and one verdict for the whole
model). ``tp`` holds the other tensor-parallel slices of the same parameters
(DTensor parameters placed on ``mesh["tp"]``, [Note: tensor-parallel parameters]
in ``core.tensor_parallel``): zeroplan shards each rank's local tensors over the
data-parallel dimension and joins the norm and the verdict over ``tp`` too. Any
other dimension of size 1 is ignored; one of size above 1 (``cp``, ``ep``) is
refused, naming it. The mesh's order is the ranks' order in the data-parallel group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from zeroplan.core.comm import Collective, all_reduce_send
from zeroplan.core.errors import ConfigError
from zeroplan.core.specs import ParamSpec
from zeroplan.core.tensor_parallel import TENSOR_DIM
from zeroplan.core.traffic import CommCost

__all__ = [
    "DATA_DIMS",
    "MODEL_DIMS",
    "STAGE_DIM",
    "MeshRoles",
    "mesh_roles",
    "pipeline_stages",
    "pipeline_traffic",
]

#: The names of data-parallel mesh dimensions: one ``dp``, or ``dp_replicate`` and/or ``dp_shard``.
DATA_DIMS = ("dp", "dp_replicate", "dp_shard")
#: The name of the pipeline-parallel dimension.
STAGE_DIM = "pp"
#: The model-parallel dimensions zeroplan joins its norm and verdict over.
MODEL_DIMS = (TENSOR_DIM, STAGE_DIM)


@dataclass(frozen=True)
class MeshRoles:
    """A mesh's dimensions (names and sizes, in order) and the role zeroplan gives each.

    Attributes:
        names: the dimension names.
        sizes: their sizes.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.sizes):
            raise ConfigError(f"mesh names {self.names} and sizes {self.sizes} differ in length")
        if len(set(self.names)) != len(self.names) or not all(isinstance(n, str) and n for n in self.names):
            raise ConfigError(f"mesh dimension names must be distinct non-empty strings, got {self.names}")
        if not all(type(s) is int and s >= 1 for s in self.sizes):
            raise ConfigError(f"mesh dimension sizes must be positive ints, got {self.sizes}")

    def size(self, name: str) -> int:
        """The size of dimension ``name`` (1 if the mesh has none)."""
        return self.sizes[self.names.index(name)] if name in self.names else 1

    @property
    def data(self) -> tuple[str, ...]:
        """The data-parallel dimensions, in mesh order."""
        return tuple(n for n in self.names if n in DATA_DIMS)

    @property
    def data_size(self) -> int:
        """Ranks in the data-parallel group."""
        size = 1
        for name in self.data:
            size *= self.size(name)
        return size

    @property
    def stages(self) -> str | None:
        """The pipeline dimension, if it has more than one stage."""
        return STAGE_DIM if self.size(STAGE_DIM) > 1 else None

    @property
    def tensor(self) -> str | None:
        """The tensor-parallel dimension, if it has more than one rank."""
        return TENSOR_DIM if self.size(TENSOR_DIM) > 1 else None

    @property
    def shard_group_size(self) -> int | None:
        """Shard groups of ``dp_shard`` ranks where ``dp_replicate`` replicates them (MiCS), else ``None``."""
        if self.size("dp_replicate") > 1:
            return self.size("dp_shard")
        return None


def mesh_roles(
    names: Sequence[str] | None, sizes: Sequence[int], *, shard_group_size: int | None = None
) -> MeshRoles:
    """The roles of a mesh's dimensions ([Note: mesh roles]), or why zeroplan cannot use it.

    Args:
        names: ``mesh.mesh_dim_names``.
        sizes: ``mesh.shape``.
        shard_group_size: the optimizer's own argument, which must agree with ``dp_shard``.

    Raises:
        ConfigError: no names, no data-parallel dimension, ``dp`` beside ``dp_replicate``/``dp_shard``,
            ``dp_shard`` before ``dp_replicate``, a model-parallel dimension zeroplan does not take,
            or a ``shard_group_size`` that disagrees with the mesh.
    """
    if names is None:
        raise ConfigError(
            "the device mesh has no dimension names: create it with mesh_dim_names, e.g. "
            'init_device_mesh("cuda", (2, 4), mesh_dim_names=("pp", "dp")); zeroplan shards over "dp" '
            '(or "dp_replicate" x "dp_shard")'
        )
    roles = MeshRoles(tuple(names), tuple(int(s) for s in sizes))
    if not roles.data:
        raise ConfigError(
            f"the device mesh {roles.names} has no data-parallel dimension: name the one zeroplan shards "
            'over "dp" (or "dp_replicate" and "dp_shard" for replicated shard groups)'
        )
    if "dp" in roles.names and len(roles.data) > 1:
        raise ConfigError(
            f'the device mesh {roles.names} names "dp" beside "dp_replicate"/"dp_shard": use one of them'
        )
    if roles.data == ("dp_shard", "dp_replicate"):
        raise ConfigError(
            'put "dp_replicate" before "dp_shard" in the mesh: shard groups are runs of its inner dimension'
        )
    others = [(n, s) for n, s in zip(roles.names, roles.sizes, strict=True) if n not in DATA_DIMS and s > 1]
    refused = [(n, s) for n, s in others if n not in MODEL_DIMS]
    if refused:
        raise ConfigError(
            f"mesh dimensions {refused} (name, size) are model-parallel ones zeroplan does not take yet: "
            "context and expert parallelism over a mesh are not supported; data-parallel "
            '("dp", "dp_replicate", "dp_shard"), tensor-parallel ("tp") and pipeline ("pp") dimensions are'
        )
    mesh_shard = roles.shard_group_size
    if shard_group_size is not None and mesh_shard is not None and shard_group_size != mesh_shard:
        raise ConfigError(
            f"shard_group_size={shard_group_size} disagrees with the mesh's dp_shard={mesh_shard}: "
            "leave it out (the mesh says it)"
        )
    return roles


def pipeline_stages(specs: Sequence[ParamSpec], stages: int) -> tuple[tuple[ParamSpec, ...], ...]:
    """``specs`` cut into ``stages`` pipeline stages of whole blocks, as a schedule would place them.

    A block is the parameters named by the same first integer path component (``model.layers.12.*``,
    ``transformer.h.3.*``); blocks go to stages in order, as evenly as they divide; parameters before
    the first block (embeddings) go to the first stage, the rest (final norm, head) to the last. Each
    stage's specs are indexed from 0, in their order.

    Raises:
        ConfigError: ``stages`` below 1, or more stages than blocks.
    """
    if type(stages) is not int or stages < 1:
        raise ConfigError(f"the number of pipeline stages must be an int >= 1, got {stages!r}")
    blocks = [_block_of(s.name) for s in specs]
    numbered = sorted({b for b in blocks if b is not None})
    if len(numbered) < stages:
        raise ConfigError(
            f"{stages} pipeline stages need at least as many blocks (parameters named <...>.<i>.<...>); "
            f"the model has {len(numbered)}"
        )
    position = {b: i for i, b in enumerate(numbered)}
    out: list[list[ParamSpec]] = [[] for _ in range(stages)]
    seen_block = False
    for spec, block in zip(specs, blocks, strict=True):
        if block is None:
            stage = stages - 1 if seen_block else 0
        else:
            seen_block = True
            stage = position[block] * stages // len(numbered)
        out[stage].append(spec)
    return tuple(tuple(replace(s, index=i) for i, s in enumerate(group)) for group in out)


def pipeline_traffic(
    stages: int, *, clipping: bool, loss_scaling: bool, rank: int = 0
) -> tuple[CommCost, ...]:
    """What zeroplan sends over the ``pp`` group per step, by stage ``rank``: the stages' gradient norms
    summed (with ``clipping``) and their overflow verdicts joined (with ``loss_scaling``), one float32
    scalar all-reduce each ([Note: mesh roles]). Activations between stages are the schedule's.

    Example:
        >>> [(c.group, c.calls, c.bytes) for c in pipeline_traffic(4, clipping=True, loss_scaling=True)]
        [('pipeline', 2, 8)]

    Raises:
        ConfigError: ``stages`` below 1.
    """
    if type(stages) is not int or stages < 1:
        raise ConfigError(f"the number of pipeline stages must be an int >= 1, got {stages!r}")
    controls = int(clipping) + int(loss_scaling)
    if stages == 1 or not controls:
        return ()
    sent = controls * all_reduce_send(1, stages, rank) * 4
    return (CommCost(group="pipeline", collective=Collective.ALL_REDUCE, calls=controls, bytes=sent),)


def _block_of(name: str) -> int | None:
    """The first integer component of a dotted parameter name, if any."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)
