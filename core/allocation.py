# zeroplan.core — pure planning: no torch, no I/O.
# Every buffer a rank holds for a plan, as one value: the report sums it, the facade allocates it.
"""The allocation plan: every buffer a rank holds, per dtype space, derived from the plan.

[Note: allocation plan]
Which tensors a rank allocates for a plan is decided once, here, as a frozen
value: per dtype space, each buffer's role, elements and dtype, whether it is
persistent or a step's transient (stage 3's blocks), whether it is a view
of another buffer of the space (no bytes of its own), and where it lives, on
the device or in host memory (``ZeroPlan.residences``, [Note: residences]; a
view lives with its buffer). ``memory_report`` sums
it (``core.memory``) and the facade allocates exactly it
(``facade.params.buffers``), so the two agree by construction rather than by
the MemTracker tests alone. The staging arena is planned beside it
(``core.arena``), the optimizer state by the inner optimizer's description;
where those live is ``zp.residences.of(BufferRole.STAGING)`` and
``zp.residences.of(BufferRole.OPTIMIZER_STATE)`` (also ``GATHER_ROOM``).

* stages 1 and 2: ``FULL_PARAMS`` (the full buffer; parameters view it), at
  stage 1 ``FULL_GRADS`` (``.grad`` views it), ``GRAD_SHARD`` (a view of the
  rank's region of ``FULL_GRADS`` when stage 1 reduces in place, else a tensor
  of the gradient-shard dtype), ``MASTER`` for bf16/fp16 parameters (fp32 of
  their own; other dtypes are stepped in place: a view of the rank's region of
  ``FULL_PARAMS`` with a rank-major layout, none with an interleaved one);
* stage 3: ``PARAM_SHARD`` (the rank's pieces of every block), ``MASTER`` (fp32
  of its own for bf16/fp16, else a view of ``PARAM_SHARD``), ``GRAD_SHARD``,
  and one ``BLOCK`` per block of the plan, allocated only while gathered.

A role placed apart from the buffer it would view (host memory,
[Note: offload, planned]) is a buffer of its own instead (``ZeroPlan.own_master``,
``ZeroPlan.reduces_in_place``). A partial offload ([Note: kept on the device])
gives the gradient shard and the masters of a rank's first ``kept_numel``
elements buffers of their own on the device (``KEPT_GRAD_SHARD``,
``KEPT_MASTER``); the host buffers hold the rest, from element ``kept_numel``.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.core.arena import grad_shard_dtype
from zeroplan.core.dtypes import DTYPE_ITEMSIZE, master_dtype
from zeroplan.core.errors import PlanInvariantError
from zeroplan.core.planner import Stage, ZeroPlan
from zeroplan.core.residence import KEPT_ROLES, BufferRole, Residence
from zeroplan.core.space import Space
from zeroplan.core.span import Span

__all__ = ["Allocation", "BufferRole", "BufferSpec", "SpaceAllocation", "allocation", "held_roles"]


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One buffer of one dtype space on one rank.

    Attributes:
        role: what it holds.
        numel: its elements.
        dtype: its dtype (a zeroplan dtype name).
        view_of: the buffer of the same space it is a view of (``None``: a tensor of its own).
        span: where in ``view_of`` it lies (``None`` for a tensor of its own).
        block: for ``BLOCK``, which block of the space.
        residence: where it lives ([Note: residences]); a view, where the buffer it views does.
    """

    role: BufferRole
    numel: int
    dtype: str
    view_of: BufferRole | None = None
    span: Span | None = None
    block: int = -1
    residence: Residence = Residence.DEVICE

    def __post_init__(self) -> None:
        if self.numel < 0 or (self.view_of is None) != (self.span is None):
            raise PlanInvariantError(f"a {self.role.value} buffer needs numel >= 0 and a span iff a view")
        if self.span is not None and self.span.numel != self.numel:
            raise PlanInvariantError(
                f"the {self.role.value} view has {self.numel} elements but spans {self.span}"
            )

    @property
    def persistent(self) -> bool:
        """Whether it is held between steps (a stage-3 block is held only while gathered)."""
        return self.role is not BufferRole.BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes of its own (a view has none)."""
        return 0 if self.view_of is not None else self.numel * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class SpaceAllocation:
    """The buffers of one dtype space on one rank, at most one per role but for the blocks."""

    space: int
    buffers: tuple[BufferSpec, ...]

    def __post_init__(self) -> None:
        for spec in self.buffers:
            if spec.view_of is not None and spec.residence is not self[spec.view_of].residence:
                raise PlanInvariantError(
                    f"space {self.space}: the {spec.role.value} view lives on the {spec.residence.value} "
                    f"but the {spec.view_of.value} buffer it views does not"
                )

    def get(self, role: BufferRole) -> BufferSpec | None:
        """The buffer of ``role`` (not ``BLOCK``), or ``None`` where the plan has none."""
        for spec in self.buffers:
            if spec.role is role:
                return spec
        return None

    def __getitem__(self, role: BufferRole) -> BufferSpec:
        spec = self.get(role)
        if spec is None:
            raise PlanInvariantError(f"space {self.space} has no {role.value} buffer")
        return spec

    @property
    def blocks(self) -> tuple[BufferSpec, ...]:
        """Stage 3: one buffer per block, in block order."""
        return tuple(spec for spec in self.buffers if spec.role is BufferRole.BLOCK)


@dataclass(frozen=True, slots=True)
class Allocation:
    """Every buffer of one shard rank, per dtype space (see [Note: allocation plan])."""

    shard_rank: int
    spaces: tuple[SpaceAllocation, ...]

    def persistent_bytes(self, *roles: BufferRole) -> int:
        """Bytes of its own of the persistent buffers of ``roles``, over every space."""
        return sum(
            spec.nbytes
            for space in self.spaces
            for spec in space.buffers
            if spec.role in roles and spec.persistent
        )

    def bytes_in(self, residence: Residence) -> int:
        """Bytes of its own of the persistent buffers that live in ``residence``, over every space."""
        return sum(
            spec.nbytes
            for space in self.spaces
            for spec in space.buffers
            if spec.residence is residence and spec.persistent
        )


def held_roles(zp: ZeroPlan) -> tuple[BufferRole, ...]:
    """The roles of the buffers a rank of ``zp`` holds (stages 1-3), in role order: its spaces' buffers,
    the staging arena, the optimizer state, and the gather rooms under a parameter wire.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(64,)], dtype="bf16"), Topology(world_size=2), stage=3)
        >>> [role.value for role in held_roles(zp)]
        ['param_shard', 'grad_shard', 'master', 'block', 'staging', 'optimizer_state']
    """
    if zp.stage is Stage.DDP:
        return ()
    held = {spec.role for space in allocation(zp, 0, blocks=False).spaces for spec in space.buffers}
    held |= {BufferRole.STAGING, BufferRole.OPTIMIZER_STATE}
    if zp.residences.partial:  # [Note: kept on the device]
        held.update(KEPT_ROLES)
    if zp.stage is Stage.PARAMETERS:
        held.add(BufferRole.BLOCK)
    if zp.param_wire is not None and zp.topology.shard_size > 1:
        held.add(BufferRole.GATHER_ROOM)
    return tuple(role for role in BufferRole if role in held)


def _kept(zp: ZeroPlan, space: Space, kept: int) -> list[BufferSpec]:
    """The device part of a partial offload ([Note: kept on the device]): the first ``kept`` elements
    of the rank's gradient shard and masters (masters of their own, as the offloaded part's)."""
    if not kept:
        return []
    return [
        BufferSpec(BufferRole.KEPT_GRAD_SHARD, kept, grad_shard_dtype(zp, space)),
        BufferSpec(BufferRole.KEPT_MASTER, kept, master_dtype(space.dtype)),
    ]


def allocation(zp: ZeroPlan, shard_rank: int, *, blocks: bool = True) -> Allocation:
    """Every buffer shard rank ``shard_rank`` holds for ``zp`` (stages 1-3; see [Note: allocation plan]).

    ``blocks=False`` leaves out stage 3's block buffers (the same on every rank, and thousands for a
    large model): the persistent buffers alone, which is what a report of every rank sums.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(64,), (32,)], dtype="bf16"), Topology(world_size=2), stage=2)
        >>> [(b.role.value, b.numel, b.dtype) for b in allocation(zp, 0).spaces[0].buffers]
        [('full_params', 256, 'bfloat16'), ('grad_shard', 128, 'float32'), ('master', 128, 'float32')]
    """
    if zp.stage is Stage.DDP:
        raise PlanInvariantError("a stage-0 (DDP) plan is a baseline: nothing of zeroplan's is allocated")
    R, where = BufferRole, zp.residences.of
    spaces = []
    for space in zp.partition.spaces:
        shard = space.shard_numel[shard_rank]
        dtype, master = space.dtype, master_dtype(space.dtype)
        own_master = zp.own_master(space)
        buffers: list[BufferSpec] = []
        kept = zp.kept_numel(space.index, shard_rank)  # [Note: kept on the device]
        if zp.stage is Stage.PARAMETERS:
            buffers.append(BufferSpec(R.PARAM_SHARD, shard, dtype, residence=where(R.PARAM_SHARD)))
            if own_master:
                buffers.append(BufferSpec(R.MASTER, shard - kept, master, residence=where(R.MASTER)))
            else:
                buffers.append(
                    BufferSpec(
                        R.MASTER, shard, master, R.PARAM_SHARD, Span(0, shard), residence=where(R.MASTER)
                    )
                )
            buffers.append(
                BufferSpec(
                    R.GRAD_SHARD, shard - kept, grad_shard_dtype(zp, space), residence=where(R.GRAD_SHARD)
                )
            )
            buffers += _kept(zp, space, kept)
            if blocks:
                buffers += [
                    BufferSpec(R.BLOCK, b.numel, dtype, block=k, residence=where(R.BLOCK))
                    for k, b in enumerate(space.blocks)
                ]
            spaces.append(SpaceAllocation(space.index, tuple(buffers)))
            continue
        full = space.buffer_numel
        buffers.append(BufferSpec(R.FULL_PARAMS, full, dtype, residence=where(R.FULL_PARAMS)))
        region = space.region(shard_rank) if space.shard_is_region else None
        if zp.stage is Stage.OPTIMIZER:
            buffers.append(BufferSpec(R.FULL_GRADS, full, dtype, residence=where(R.FULL_GRADS)))
        grad_shard = where(R.GRAD_SHARD)
        if zp.reduces_in_place(space):
            buffers.append(
                BufferSpec(R.GRAD_SHARD, region.numel, dtype, R.FULL_GRADS, region, residence=grad_shard)
            )
        else:
            buffers.append(
                BufferSpec(R.GRAD_SHARD, shard - kept, grad_shard_dtype(zp, space), residence=grad_shard)
            )
        if not zp.master_in_params(space):
            buffers.append(BufferSpec(R.MASTER, shard - kept, master, residence=where(R.MASTER)))
        elif region is not None:  # stepped in place: the rank's region of the full buffer
            buffers.append(
                BufferSpec(R.MASTER, region.numel, master, R.FULL_PARAMS, region, residence=where(R.MASTER))
            )
        buffers += _kept(zp, space, kept)
        spaces.append(SpaceAllocation(space.index, tuple(buffers)))
    return Allocation(shard_rank, tuple(spaces))
