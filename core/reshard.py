# zeroplan.core — pure planning: no torch, no I/O.
# Which saved (rank, range) pieces rebuild which new (rank, range); ranks are shard ranks.
"""``ReshardPlan``: rebuild the shards of one plan from the shards of another.

A checkpoint saved under one partition (world, shard size, strategy) loads
under any other by executing the copies of :func:`plan_reshard`: every element
of every new shard comes from exactly one place in exactly one old shard. The
same plan moves optimizer state in memory when the trainable set changes.

Example:
    >>> from zeroplan.core.specs import specs_from_shapes
    >>> from zeroplan.core.strategies import flat_even, lpt_whole
    >>> specs = specs_from_shapes([(6,), (2,)])
    >>> rp = plan_reshard(flat_even(specs, 2, 1), lpt_whole(specs, 3, 1))
    >>> [(c.src_rank, c.src_span.start, c.dst_span.start, c.dst_span.numel) for c in rp.reads(0)]
    [(0, 0, 0, 4), (1, 0, 4, 2)]
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.core.errors import IncompatiblePlanError, require
from zeroplan.core.fingerprint import digest
from zeroplan.core.partition import Fragment, PartitionPlan
from zeroplan.core.span import Span

__all__ = ["Copy", "ReshardPlan", "compare_specs", "plan_reshard"]


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy ``old shard[src_rank][src_span]`` to ``new shard[dst_rank][dst_span]`` of ``dtype``."""

    dtype: str
    param: int
    src_rank: int
    src_span: Span
    dst_rank: int
    dst_span: Span


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardPlan:
    """Copies that rebuild every target shard from source shards.

    Attributes:
        source: fingerprint of the source partition.
        target: fingerprint of the target partition.
        target_shard_size: ranks of the target shard group.
        copies: sorted by (dtype, destination rank, destination offset).
        fresh: target fragments with no source (parameters trainable only in
            the target); they start from the parameter values and empty state.
    """

    source: str
    target: str
    target_shard_size: int
    copies: tuple[Copy, ...]
    fresh: tuple[Fragment, ...] = ()

    def reads(self, dst_rank: int) -> tuple[Copy, ...]:
        """The copies that fill target rank ``dst_rank``'s shards."""
        return tuple(c for c in self.copies if c.dst_rank == dst_rank)

    def source_ranks(self, dst_rank: int) -> tuple[int, ...]:
        """Source ranks target rank ``dst_rank`` reads from, increasing."""
        return tuple(sorted({c.src_rank for c in self.copies if c.dst_rank == dst_rank}))

    def fingerprint(self) -> str:
        """Stable digest of the copies."""
        return digest(
            "reshard/v1",
            [
                self.source,
                self.target,
                *(
                    (
                        c.dtype,
                        c.param,
                        c.src_rank,
                        c.src_span.start,
                        c.dst_rank,
                        c.dst_span.start,
                        c.dst_span.numel,
                    )
                    for c in self.copies
                ),
            ],
        )


def compare_specs(source: PartitionPlan, target: PartitionPlan, *, allow_trainable_change: bool) -> None:
    """Raise :class:`IncompatiblePlanError` naming the first parameter that differs.

    Names, shapes (local and global), placements and dtypes must match one for one; ``trainable`` may differ,
    and the target may append parameters, only with ``allow_trainable_change``.
    """
    old, new = source.specs, target.specs
    if len(old) != len(new) and not (allow_trainable_change and len(new) > len(old)):
        raise IncompatiblePlanError(
            f"the source has {len(old)} parameters but the target has {len(new)}: another model?"
        )
    for a, b in zip(old, new[: len(old)], strict=True):
        for what, x, y in (
            ("name", a.name, b.name),
            ("shape", a.shape, b.shape),
            ("global shape", a.global_shape, b.global_shape),
            ("placement", a.placement, b.placement),
            ("dtype", a.dtype, b.dtype),
        ):
            if x != y:
                raise IncompatiblePlanError(
                    f"parameter {a.index} differs in {what}: source {x!r}, target {y!r}; "
                    "the checkpoint is of another model or parameter order"
                )
        if a.trainable != b.trainable and not allow_trainable_change:
            raise IncompatiblePlanError(
                f"parameter {a.index} ({a.name!r}) is {'trainable' if a.trainable else 'frozen'} in the "
                f"source but {'trainable' if b.trainable else 'frozen'} in the target"
            )


def plan_reshard(
    source: PartitionPlan, target: PartitionPlan, *, allow_trainable_change: bool = False
) -> ReshardPlan:
    """Copies that rebuild ``target``'s shards from ``source``'s.

    Args:
        source: the plan the data is laid out by now (or was saved with).
        target: the plan to lay it out by.
        allow_trainable_change: accept parameters that are trainable in only
            one plan, or appended in the target (dropped, or listed as ``fresh``).

    Raises:
        IncompatiblePlanError: the plans are for different parameters.
    """
    compare_specs(source, target, allow_trainable_change=allow_trainable_change)
    copies: list[Copy] = []
    fresh: list[Fragment] = []
    for spec in target.specs:
        new_frags = target.fragments[spec.index]
        old_frags = source.fragments[spec.index] if spec.index < len(source.specs) else ()
        if not new_frags:
            continue
        if not old_frags:
            fresh.extend(new_frags)
            continue
        i = j = 0
        while i < len(old_frags) and j < len(new_frags):
            a, b = old_frags[i], new_frags[j]
            overlap = a.param_span.intersect(b.param_span)
            if overlap is None and spec.numel == 0:
                overlap = Span(0, 0)
            if overlap is not None:
                copies.append(
                    Copy(
                        dtype=spec.dtype,
                        param=spec.index,
                        src_rank=a.rank,
                        src_span=a.shard_span_of(overlap),
                        dst_rank=b.rank,
                        dst_span=b.shard_span_of(overlap),
                    )
                )
            if a.param_span.stop <= b.param_span.stop:
                i += 1
            else:
                j += 1
    copies.sort(key=lambda c: (c.dtype, c.dst_rank, c.dst_span.start))
    filled: dict[tuple[str, int], int] = {}
    for c in copies:
        filled[c.dtype, c.dst_rank] = filled.get((c.dtype, c.dst_rank), 0) + c.dst_span.numel
    for f in fresh:
        key = (target.specs[f.param].dtype, f.rank)
        filled[key] = filled.get(key, 0) + f.param_span.numel
    for space in target.spaces:
        for rank, owned in enumerate(space.owned):
            got = filled.get((space.dtype, rank), 0)
            require(got == owned, f"reshard fills {got} of {owned} elements of rank {rank} ({space.dtype})")
    return ReshardPlan(
        source=source.fingerprint(),
        target=target.fingerprint(),
        target_shard_size=target.shard_size,
        copies=tuple(copies),
        fresh=tuple(fresh),
    )
