# zeroplan.core — pure planning: no torch, no I/O.
# Every buffer a rank holds for a plan, as one value: the report sums it, the facade allocates it.
"""The allocation plan: every buffer a rank holds, per dtype space, derived from the plan.

[Note: allocation plan]
Which tensors a rank allocates for a plan is decided once, here, as a frozen
value: per dtype space, each buffer's role, elements and dtype, whether it is
persistent or a step's transient (stage 3's blocks), and whether it is a view
of another buffer of the space (no bytes of its own). ``memory_report`` sums
it (``core.memory``) and the facade allocates exactly it
(``facade.params.buffers``), so the two agree by construction rather than by
the MemTracker tests alone. The staging arena is planned beside it
(``core.arena``), the optimizer state by the inner optimizer's description.

* stages 1 and 2: ``FULL_PARAMS`` (the full buffer; parameters view it), at
  stage 1 ``FULL_GRADS`` (``.grad`` views it), ``GRAD_SHARD`` (a view of the
  rank's region of ``FULL_GRADS`` when stage 1 reduces in place, else a tensor
  of the gradient-shard dtype), ``MASTER`` for bf16/fp16 parameters (fp32 of
  their own; other dtypes are stepped in place: a view of the rank's region of
  ``FULL_PARAMS`` with a rank-major layout, none with an interleaved one);
* stage 3: ``PARAM_SHARD`` (the rank's pieces of every block), ``MASTER`` (fp32
  of its own for bf16/fp16, else a view of ``PARAM_SHARD``), ``GRAD_SHARD``,
  and one ``BLOCK`` per block of the plan, allocated only while gathered.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from zeroplan.core.arena import grad_shard_dtype
from zeroplan.core.dtypes import DTYPE_ITEMSIZE, master_dtype
from zeroplan.core.errors import PlanInvariantError
from zeroplan.core.planner import Stage, ZeroPlan
from zeroplan.core.span import Span

__all__ = ["Allocation", "BufferRole", "BufferSpec", "SpaceAllocation", "allocation"]


class BufferRole(enum.Enum):
    """What a buffer of a dtype space holds (see [Note: allocation plan])."""

    FULL_PARAMS = "full_params"
    FULL_GRADS = "full_grads"
    PARAM_SHARD = "param_shard"
    GRAD_SHARD = "grad_shard"
    MASTER = "master"
    BLOCK = "block"


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
    """

    role: BufferRole
    numel: int
    dtype: str
    view_of: BufferRole | None = None
    span: Span | None = None
    block: int = -1

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
    R = BufferRole
    spaces = []
    for space in zp.partition.spaces:
        shard = space.shard_numel[shard_rank]
        dtype, master = space.dtype, master_dtype(space.dtype)
        own_master = master != dtype
        buffers: list[BufferSpec] = []
        if zp.stage is Stage.PARAMETERS:
            buffers.append(BufferSpec(R.PARAM_SHARD, shard, dtype))
            if own_master:
                buffers.append(BufferSpec(R.MASTER, shard, master))
            else:
                buffers.append(BufferSpec(R.MASTER, shard, master, R.PARAM_SHARD, Span(0, shard)))
            buffers.append(BufferSpec(R.GRAD_SHARD, shard, grad_shard_dtype(zp, space)))
            if blocks:
                buffers += [BufferSpec(R.BLOCK, b.numel, dtype, block=k) for k, b in enumerate(space.blocks)]
            spaces.append(SpaceAllocation(space.index, tuple(buffers)))
            continue
        full = space.buffer_numel
        buffers.append(BufferSpec(R.FULL_PARAMS, full, dtype))
        region = space.region(shard_rank) if space.shard_is_region else None
        if zp.stage is Stage.OPTIMIZER:
            buffers.append(BufferSpec(R.FULL_GRADS, full, dtype))
        if zp.stage is Stage.OPTIMIZER and region is not None:  # reduced in place
            buffers.append(BufferSpec(R.GRAD_SHARD, region.numel, dtype, R.FULL_GRADS, region))
        else:
            buffers.append(BufferSpec(R.GRAD_SHARD, shard, grad_shard_dtype(zp, space)))
        if not zp.master_in_params(space):
            buffers.append(BufferSpec(R.MASTER, shard, master))
        elif region is not None:  # stepped in place: the rank's region of the full buffer
            buffers.append(BufferSpec(R.MASTER, region.numel, master, R.FULL_PARAMS, region))
        spaces.append(SpaceAllocation(space.index, tuple(buffers)))
    return Allocation(shard_rank, tuple(spaces))
