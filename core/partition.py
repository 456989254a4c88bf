# zeroplan.core — pure planning: no torch, no I/O.
# Ranks are shard-group ranks 0..k-1 and enter only as values in the plan.
"""``PartitionPlan``: which shard rank owns which elements of which parameter.

[Note: layout]
Trainable parameters of one dtype form a *space*. Two coordinates describe it:

* the **space coordinate**: the parameters concatenated in index order. Backward
  produces gradients in reverse index order, so buckets are intervals of it.
* the **shard coordinate** of rank ``r``: rank ``r``'s fragments of the space,
  sorted by parameter index and packed from 0 (``owned[r]`` elements, padded to
  ``shard_numel[r]``, a multiple of the alignment, for allocation).

The full parameter buffer of a space is **rank-major**: rank 0's region, then
rank 1's, each exactly ``owned[r]`` elements. Every parameter must be one
contiguous run of it (so ``param.data`` can be a view), which the plan checks:
a split parameter's fragments lie at the end of one rank's shard and the start
of the next ranks' shards, in order (``flat_even`` does exactly this). The
updated shards are gathered into that buffer with one ``all_gather`` when every
region has the same size and one ``broadcast`` per rank otherwise.

A chunk of rank ``r``'s shard (a span of its shard coordinate, as consolidation
broadcasts) meets some of ``r``'s fragments; :meth:`Space.fragments_in` clips
them to it and says where each overlap lies in the shard, in the chunk and in
the flattened parameter, so the facade slices and never clips by hand.

Strategies only decide ownership: they return ``(param, span, rank)`` pieces
and :func:`plan_from_assignment` derives every offset, so a strategy cannot
produce an inconsistent layout by accident.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from zeroplan.core.comm import Collective
from zeroplan.core.errors import ConfigError, PlanInvariantError, check_config, require
from zeroplan.core.fingerprint import digest
from zeroplan.core.span import Span, round_up
from zeroplan.core.specs import ParamSpec, check_specs

__all__ = ["Fragment", "FragmentOverlap", "PartitionPlan", "Space", "plan_from_assignment"]


@dataclass(frozen=True, slots=True)
class Fragment:
    """A contiguous element range of one flattened parameter in one rank's shard.

    Attributes:
        param: index of the parameter.
        rank: shard rank that owns the range.
        param_span: the range, in the flattened parameter's elements.
        shard_offset: where the range starts in the owner's shard of the
            parameter's dtype space.
    """

    param: int
    rank: int
    param_span: Span
    shard_offset: int

    @property
    def shard_span(self) -> Span:
        """The range in the owner's shard coordinate."""
        return Span(self.shard_offset, self.shard_offset + self.param_span.numel)

    def shard_span_of(self, param_span: Span) -> Span:
        """Where elements ``param_span`` of the parameter (inside this fragment) lie in the owner's shard.

        Example:
            >>> Fragment(param=3, rank=1, param_span=Span(10, 20), shard_offset=4).shard_span_of(Span(12, 15))
            Span(start=6, stop=9)
        """
        if not self.param_span.contains(param_span):  # (hot loop: no message unless it fails)
            raise PlanInvariantError(f"{param_span} is not inside fragment {self.param_span} of {self.param}")
        return param_span.shift(self.shard_offset - self.param_span.start)

    def param_span_of(self, shard_span: Span) -> Span:
        """The elements of the flattened parameter at ``shard_span`` of the shard (inside this fragment).

        Example:
            >>> Fragment(param=3, rank=1, param_span=Span(10, 20), shard_offset=4).param_span_of(Span(6, 9))
            Span(start=12, stop=15)
        """
        if not self.shard_span.contains(shard_span):  # (hot loop: no message unless it fails)
            raise PlanInvariantError(f"{shard_span} is not inside the shard span {self.shard_span} of {self}")
        return shard_span.shift(self.param_span.start - self.shard_offset)


class FragmentOverlap(NamedTuple):
    """The part of one fragment that falls in a chunk of its owner's shard (:meth:`Space.fragments_in`).

    Attributes:
        param: index of the parameter.
        shard_span: the overlap, in the owner's shard coordinate.
        chunk_span: the overlap relative to the chunk's start: slice the chunk with it.
        param_span: the overlap, in the flattened parameter's elements: slice the parameter with it.
    """

    param: int
    shard_span: Span
    chunk_span: Span
    param_span: Span


@dataclass(frozen=True, slots=True, kw_only=True)
class Space:
    """Layout of the trainable parameters of one dtype (see [Note: layout]).

    Attributes:
        index: position in ``PartitionPlan.spaces``.
        dtype: the dtype of every parameter in the space.
        params: indices of its parameters, increasing.
        param_offsets: start of each parameter (same order as ``params``) in
            the space coordinate.
        numel: elements in the space.
        owned: elements each shard rank owns.
        shard_numel: each rank's shard allocation: ``owned`` rounded up to the
            alignment.
        region_offsets: start of each rank's region in the full buffer.
        buffer_offsets: start of each parameter (same order as ``params``) in
            the full buffer.
        runs: every fragment of the space, sorted by space coordinate.
        by_rank: per rank, its fragments in shard order.
        gather: collective that rebuilds the full buffer from the shards.
    """

    index: int
    dtype: str
    params: tuple[int, ...]
    param_offsets: tuple[int, ...]
    numel: int
    owned: tuple[int, ...]
    shard_numel: tuple[int, ...]
    region_offsets: tuple[int, ...]
    buffer_offsets: tuple[int, ...]
    runs: tuple[Fragment, ...]
    by_rank: tuple[tuple[Fragment, ...], ...]
    gather: Collective

    def _position(self, param: int) -> int:
        position = bisect_left(self.params, param)
        require(
            position < len(self.params) and self.params[position] == param,
            f"parameter {param} is not in the {self.dtype} space",
        )
        return position

    def param_offset(self, param: int) -> int:
        """Space-coordinate start of parameter ``param``."""
        return self.param_offsets[self._position(param)]

    def buffer_offset(self, param: int) -> int:
        """Full-buffer start of parameter ``param``."""
        return self.buffer_offsets[self._position(param)]

    def region(self, rank: int) -> Span:
        """Rank ``rank``'s region of the full buffer."""
        start = self.region_offsets[rank]
        return Span(start, start + self.owned[rank])

    def fragments_in(self, rank: int, chunk: Span) -> tuple[FragmentOverlap, ...]:
        """Rank ``rank``'s fragments overlapping ``chunk`` of its shard, clipped to it, in shard order.

        Empty fragments (zero-size parameters) overlap nothing. Costs
        ``O(log fragments + overlaps)``.

        Args:
            rank: shard rank.
            chunk: a span of rank ``rank``'s shard coordinate, inside its
                allocation ``[0, shard_numel[rank])``.

        Raises:
            PlanInvariantError: ``rank`` or ``chunk`` is out of range.

        Example:
            >>> from zeroplan.core.specs import specs_from_shapes
            >>> plan = plan_from_assignment(
            ...     specs_from_shapes([(4,), (6,)]), 1, 1, "mine", [(0, Span(0, 4), 0), (1, Span(0, 6), 0)]
            ... )
            >>> for part in plan.spaces[0].fragments_in(0, Span(2, 7)):
            ...     print(part.param, part.shard_span, part.chunk_span, part.param_span)
            0 Span(start=2, stop=4) Span(start=0, stop=2) Span(start=2, stop=4)
            1 Span(start=4, stop=7) Span(start=2, stop=5) Span(start=0, stop=3)
        """
        require(0 <= rank < len(self.owned), f"rank {rank} outside 0..{len(self.owned) - 1}")
        require(
            chunk.stop <= self.shard_numel[rank],
            f"chunk {chunk} is beyond rank {rank}'s shard of {self.shard_numel[rank]} elements "
            f"({self.dtype} space)",
        )
        frags = self.by_rank[rank]
        # The last fragment starting at or before the chunk holds its first element, if any.
        first = bisect_right(frags, chunk.start, key=lambda f: f.shard_offset)
        overlaps = []
        for frag in frags[max(first - 1, 0) :]:
            if frag.shard_offset >= chunk.stop:
                break
            shard_span = frag.shard_span.intersect(chunk)
            if shard_span is not None:
                overlaps.append(
                    FragmentOverlap(
                        frag.param, shard_span, shard_span.shift(-chunk.start), frag.param_span_of(shard_span)
                    )
                )
        return tuple(overlaps)


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionPlan:
    """Ownership of every trainable element by the ranks of one shard group.

    Attributes:
        specs: the parameters.
        shard_size: ranks in the shard group.
        alignment: elements; shard allocations are multiples of it.
        strategy: name of the strategy that produced the plan.
        fragments: per parameter index, its fragments ordered by ``param_span``
            (empty for frozen parameters).
        spaces: per dtype, the derived layout (see [Note: layout]).
        splits_params: whether any parameter is split across ranks.
        trainable_indices: indices of the trainable parameters, the ones the
            plan manages: exactly the parameters of its spaces (zero-size ones
            included), so also the parameters of the facade's flat buffers.

    Raises:
        PlanInvariantError: the fragments do not form a valid layout (the
            message names the parameter and the invariant).
        ConfigError: ``specs``, ``shard_size`` or ``alignment`` are invalid.
    """

    specs: tuple[ParamSpec, ...]
    shard_size: int
    alignment: int
    strategy: str
    fragments: tuple[tuple[Fragment, ...], ...]
    spaces: tuple[Space, ...] = field(init=False)
    splits_params: bool = field(init=False)
    trainable_indices: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", check_specs(self.specs))
        check_config(
            type(self.shard_size) is int and self.shard_size >= 1,
            f"shard size must be an int >= 1, got {self.shard_size!r}",
        )
        check_config(
            type(self.alignment) is int and self.alignment >= 1,
            f"alignment must be an int >= 1 (elements), got {self.alignment!r}",
        )
        require(
            len(self.fragments) == len(self.specs),
            f"plan has fragments for {len(self.fragments)} parameters but {len(self.specs)} specs",
        )
        for spec, frags in zip(self.specs, self.fragments, strict=True):
            problem = _cover_problem(spec, frags, self.shard_size)
            if problem is not None:
                raise PlanInvariantError(
                    f"parameter {spec.index} ({spec.name!r}, shape {spec.shape}) {problem}"
                )
        object.__setattr__(self, "spaces", _build_spaces(self))
        object.__setattr__(self, "splits_params", any(len(f) > 1 for f in self.fragments))
        trainable = frozenset(s.index for s in self.specs if s.trainable)
        require(
            frozenset(p for space in self.spaces for p in space.params) == trainable,
            "the spaces must hold exactly the trainable parameters",
        )
        object.__setattr__(self, "trainable_indices", trainable)

    # ----------------------------------------------------------------- queries
    def owner_ranks(self, param: int) -> tuple[int, ...]:
        """Shard ranks owning part of parameter ``param`` (empty if frozen)."""
        return tuple(f.rank for f in self.fragments[param])

    def space_of(self, param: int) -> Space | None:
        """The space holding parameter ``param``; ``None`` when it is frozen."""
        if not self.specs[param].trainable:
            return None
        dtype = self.specs[param].dtype
        return next(s for s in self.spaces if s.dtype == dtype)

    def rank_fragments(self, space: int, rank: int) -> tuple[Fragment, ...]:
        """Rank ``rank``'s fragments of space ``space``, in shard order."""
        return self.spaces[space].by_rank[rank]

    def fingerprint(self) -> str:
        """Stable digest of the layout (not of the strategy name)."""
        return digest(
            "partition/v1",
            [
                self.shard_size,
                self.alignment,
                *(s.key() for s in self.specs),
                *(
                    (f.param, f.rank, f.param_span.start, f.param_span.stop, f.shard_offset)
                    for frags in self.fragments
                    for f in frags
                ),
            ],
        )


def _cover_problem(spec: ParamSpec, frags: tuple[Fragment, ...], shard_size: int) -> str | None:
    """Why the fragments of ``spec`` fail to tile it exactly once (frozen: own none); ``None`` if they do.

    Runs for every parameter of every plan, so messages are formatted only on failure.
    """
    if not spec.trainable:
        return None if not frags else f"is frozen but the plan gives it {len(frags)} fragment(s)"
    if not frags:
        return "is trainable but no rank owns it"
    if spec.numel == 0 and len(frags) != 1:
        return f"is zero-size: give it exactly one (empty) fragment, got {len(frags)}"
    position = 0
    for frag in frags:
        if not (isinstance(frag, Fragment) and frag.param == spec.index):
            return f"lists a fragment of parameter {getattr(frag, 'param', frag)!r}"
        if not 0 <= frag.rank < shard_size:
            return f"rank {frag.rank} outside 0..{shard_size - 1}"
        span = frag.param_span
        if span.start != position:
            return f"fragments must tile it in order; expected one starting at {position}, got {span}"
        if span.stop == position and spec.numel:
            return f"empty fragment {span} (only zero-size parameters have one)"
        position = span.stop
    if position != spec.numel:
        return f"fragments cover {position} of {spec.numel} elements"
    return None


def _build_spaces(plan: PartitionPlan) -> tuple[Space, ...]:
    dtypes: list[str] = []
    for spec in plan.specs:
        if spec.trainable and spec.dtype not in dtypes:
            dtypes.append(spec.dtype)
    return tuple(_build_space(plan, i, dtype) for i, dtype in enumerate(dtypes))


def _build_space(plan: PartitionPlan, index: int, dtype: str) -> Space:
    n = plan.shard_size
    params = tuple(s.index for s in plan.specs if s.trainable and s.dtype == dtype)
    param_offsets: list[int] = []
    total = 0
    for p in params:
        param_offsets.append(total)
        total += plan.specs[p].numel

    # Shard packing: each rank's fragments, in parameter order, tile [0, owned).
    owned = [0] * n
    for p in params:
        for frag in plan.fragments[p]:
            if frag.shard_offset != owned[frag.rank]:  # (hot loop: no message unless it fails)
                raise PlanInvariantError(
                    f"parameter {p} ({plan.specs[p].name!r}): fragment {frag.param_span} on rank "
                    f"{frag.rank} starts at shard offset {frag.shard_offset}, expected "
                    f"{owned[frag.rank]}; each rank's fragments must be packed in parameter order "
                    "(build plans with plan_from_assignment)"
                )
            owned[frag.rank] += frag.param_span.numel
    region_offsets = [0] * n
    for r in range(1, n):
        region_offsets[r] = region_offsets[r - 1] + owned[r - 1]

    buffer_offsets: list[int] = []
    for p in params:
        frags = plan.fragments[p]
        start = region_offsets[frags[0].rank] + frags[0].shard_offset
        position = start
        for frag in frags:
            at = region_offsets[frag.rank] + frag.shard_offset
            if at != position:  # (hot loop: no message unless it fails)
                raise PlanInvariantError(
                    f"parameter {p} ({plan.specs[p].name!r}) would not be contiguous in the "
                    f"rank-major buffer: its fragment on rank {frag.rank} starts at {at}, expected "
                    f"{position}. Split parameters must end one rank's shard and start the next "
                    "ranks' shards, in order (see [Note: layout])"
                )
            position += frag.param_span.numel
        buffer_offsets.append(start)

    # Parameters in index order, fragments in span order: already space order.
    runs = tuple(f for p in params for f in plan.fragments[p])
    by_rank: list[list[Fragment]] = [[] for _ in range(n)]
    for frag in runs:
        by_rank[frag.rank].append(frag)
    shard_numel = tuple(round_up(o, plan.alignment) for o in owned)
    gather = Collective.ALL_GATHER if len(set(owned)) == 1 else Collective.BROADCAST
    return Space(
        index=index,
        dtype=dtype,
        params=params,
        param_offsets=tuple(param_offsets),
        numel=total,
        owned=tuple(owned),
        shard_numel=shard_numel,
        region_offsets=tuple(region_offsets),
        buffer_offsets=tuple(buffer_offsets),
        runs=runs,
        by_rank=tuple(tuple(frags) for frags in by_rank),
        gather=gather,
    )


def plan_from_assignment(
    specs: Sequence[ParamSpec],
    shard_size: int,
    alignment: int,
    strategy: str,
    pieces: Iterable[tuple[int, Span, int]],
) -> PartitionPlan:
    """Build a plan from ownership decisions, deriving every offset.

    Args:
        specs: the parameters.
        shard_size: ranks in the shard group.
        alignment: shard allocation multiple, in elements.
        strategy: name recorded in the plan.
        pieces: ``(param index, span of the flattened param, rank)`` triples;
            together they must tile every trainable parameter exactly once.

    Returns:
        The validated plan.

    Example:
        >>> from zeroplan.core.specs import specs_from_shapes
        >>> specs = specs_from_shapes([(4,), (6,)])
        >>> plan = plan_from_assignment(specs, 2, 1, "mine", [(0, Span(0, 4), 1), (1, Span(0, 6), 0)])
        >>> plan.spaces[0].owned
        (6, 4)
    """
    specs = check_specs(specs)
    by_param: list[list[tuple[Span, int]]] = [[] for _ in specs]
    count = len(specs)
    for param, span, rank in pieces:
        if not 0 <= param < count:  # (hot loop: no message unless it fails)
            raise ConfigError(f"assignment names parameter {param}, outside 0..{count - 1}")
        by_param[param].append((span, rank))
    offsets: dict[tuple[str, int], int] = {}
    fragments: list[tuple[Fragment, ...]] = []
    for spec, owned in zip(specs, by_param, strict=True):
        if len(owned) > 1:
            owned.sort(key=lambda item: item[0].start)
        frags = []
        for span, rank in owned:
            key = (spec.dtype, rank)
            offset = offsets.get(key, 0)
            frags.append(Fragment(spec.index, rank, span, offset))
            offsets[key] = offset + span.numel
        fragments.append(tuple(frags))
    return PartitionPlan(
        specs=specs,
        shard_size=shard_size,
        alignment=alignment,
        strategy=strategy,
        fragments=tuple(fragments),
    )
