# zeroplan.core — pure planning: no torch, no I/O.
# Ranks are shard-group ranks 0..k-1 and enter only as values in the plan.
"""``PartitionPlan``: which shard rank owns which elements of which parameter.

The layout each plan implies (shard offsets, the full buffer's blocks) is
derived and checked by :mod:`zeroplan.core.space`; see [Note: layout] there.
Strategies only decide ownership: they return ``(param, span, rank)`` pieces
and :func:`plan_from_assignment` derives every offset of a rank-major layout,
so a strategy cannot produce an inconsistent layout by accident; interleaved
layouts are built by :mod:`zeroplan.core.layout`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain

from zeroplan.core.errors import ConfigError, PlanInvariantError, check_config, require
from zeroplan.core.fingerprint import Rendered, digest, render
from zeroplan.core.runs import FragmentRun, RunChain, compact_space
from zeroplan.core.space import Fragment, FragmentOverlap, ShardPiece, Space, build_space
from zeroplan.core.span import Span
from zeroplan.core.specs import ParamSpec, check_specs

__all__ = ["Fragment", "FragmentOverlap", "PartitionPlan", "ShardPiece", "Space", "plan_from_assignment"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionPlan:
    """Ownership of every trainable element by the ranks of one shard group.

    Attributes:
        specs: the parameters.
        shard_size: ranks in the shard group.
        alignment: elements; shard allocations are multiples of it.
        strategy: name of the strategy that produced the plan.
        fragments: per parameter index, its fragments ordered by ``param_span``
            (empty for frozen parameters): a tuple, or a
            :class:`~zeroplan.core.runs.FragmentRun`, which equals one (see
            [Note: compact plans] in :mod:`zeroplan.core.runs`).
        block_pieces: per space, per block of its full buffer, per rank, the
            elements of that rank's piece (``interleaved`` layouts); empty for
            the ``rank_major`` layout (see [Note: layout]).
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
    fragments: tuple[Sequence[Fragment], ...]
    block_pieces: tuple[tuple[tuple[int, ...], ...], ...] = ()
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
        object.__setattr__(
            self, "block_pieces", tuple(tuple(tuple(b) for b in blocks) for blocks in self.block_pieces)
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
    @property
    def layout(self) -> str:
        """``"interleaved"`` or ``"rank_major"`` (see [Note: layout])."""
        return "interleaved" if self.block_pieces else "rank_major"

    def owner_ranks(self, param: int) -> tuple[int, ...]:
        """Shard ranks owning part of parameter ``param`` (empty if frozen)."""
        return tuple(f.rank for f in self.fragments[param])

    def space_of(self, param: int) -> Space | None:
        """The space holding parameter ``param``; ``None`` when it is frozen."""
        if not self.specs[param].trainable:
            return None
        dtype = self.specs[param].dtype
        return next(s for s in self.spaces if s.dtype == dtype)

    def rank_fragments(self, space: int, rank: int) -> Sequence[Fragment]:
        """Rank ``rank``'s fragments of space ``space``, in shard order."""
        return self.spaces[space].by_rank[rank]

    def held_fragments(self, rank: int) -> dict[int, list[Fragment]]:
        """Each trainable parameter's fragments on shard rank ``rank``, in the parameter's element order
        (none for a parameter the rank holds nothing of)."""
        held: dict[int, list[Fragment]] = {p: [] for p in self.trainable_indices}
        for space in self.spaces:
            for f in space.by_rank[rank]:
                held[f.param].append(f)
        for frags in held.values():
            frags.sort(key=lambda f: f.param_span.start)
        return held

    def fingerprint(self) -> str:
        """Stable digest of the layout (not of the strategy name)."""
        # Each parameter's fragments are written when hashed (a stage-3 plan's are 100 MB of text).
        return digest(
            "partition/v1",
            chain(
                (self.shard_size, self.alignment),
                (s.key() for s in self.specs),
                _fragment_parts(self.fragments),
                # Rank-major plans keep the digest they always had (saved checkpoints carry it).
                (Rendered("\x1f" + render(("blocks", self.block_pieces))),) if self.block_pieces else (),
            ),
        )


def _fragment_parts(fragments: Iterable[Sequence[Fragment]]) -> Iterator[object]:
    """What :meth:`PartitionPlan.fingerprint` hashes of the fragments: a tuple per fragment."""
    for frags in fragments:
        if type(frags) is FragmentRun or type(frags) is RunChain:  # the same text, written per run
            yield Rendered(frags.digest_text())
        else:
            yield from (
                (f.param, f.rank, f.param_span.start, f.param_span.stop, f.shard_offset) for f in frags
            )


def _cover_problem(spec: ParamSpec, frags: Sequence[Fragment], shard_size: int) -> str | None:
    """Why the fragments of ``spec`` fail to tile it exactly once (frozen: own none); ``None`` if they do.

    Runs for every parameter of every plan, so messages are formatted only on failure.
    """
    if type(frags) is FragmentRun or type(frags) is RunChain:
        return frags.cover_problem(spec, shard_size)
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
    if plan.block_pieces:
        require(
            len(plan.block_pieces) == len(dtypes),
            f"the plan gives blocks for {len(plan.block_pieces)} spaces but has {len(dtypes)} "
            f"({', '.join(dtypes)})",
        )
    spaces = []
    for i, dtype in enumerate(dtypes):
        pieces = plan.block_pieces[i] if plan.block_pieces else None
        args = (plan.specs, plan.fragments, plan.shard_size, plan.alignment, i, dtype, pieces)
        spaces.append(compact_space(*args) or build_space(*args))
    return tuple(spaces)


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
