# zeroplan.core — pure planning: no torch, no I/O.
# Compact fragments: a parameter's fragments over the equal pieces of one block, computed when read.
"""``FragmentRun``: the fragments of one parameter laid across the equal pieces of one block.

[Note: compact plans]
An interleaved ``flat_even`` plan cuts every block into equal pieces, one per
rank, so a parameter is split at every piece boundary it crosses: llama-70b at
world 4096 has 2.3 million fragments and 2.6 million bucket pieces at stage 3
(blocks of whole parameters), 21.5 million fragments at stages 1-2 (blocks that
cut parameters). Each is a function of a few numbers: the parameter's place in
its block, the piece size and the block's shard offset. Such a plan holds, per
parameter, a :class:`FragmentRun`: a read-only sequence of fragments computed
when read, a tuple in all but type (:class:`ComputedTuple`, in
:mod:`zeroplan.core.computed`: it compares equal to the tuple of its items,
hashes, indexes and slices like it); a parameter that block boundaries cut
(stages 1-2) holds a :class:`RunChain` of one run per block, each run knowing
its first element in the parameter (``start``). Blocks of equal pieces hold
their shard starts as one repeated number (``Repeated``). A space made of
them (:func:`compact_space`) derives its offsets and checks its invariants
from those numbers; its ``by_rank`` computes a rank's fragments when first
read (:class:`RankFragments`), and its buckets' pieces and copies are
computed sequences too (``zeroplan.core.buckets``). What needs every rank
reads the numbers, never the fragments: fingerprints write the text the
tuples would (:meth:`FragmentRun.digest_text`, each bound written once and
joined in C; that text, 650 MB for llama-70b at stage 2 and 4,096 ranks, is
most of such a plan's cost, and saved checkpoints carry its digest), memory
reports compute each distinct rank's inner tensors once
(:func:`rank_windows`), traffic and staging arenas count a bucket of equal
pieces once for all ranks. Every value is the one a plan of
tuples has (the plan snapshot pins fingerprints, reports and plan values, and
the runs' tests compare with the tuples: docs/testing.md).
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from functools import lru_cache
from itertools import accumulate, chain
from typing import NamedTuple

from zeroplan.core.computed import ComputedTuple
from zeroplan.core.errors import PlanInvariantError, require
from zeroplan.core.space import Block, Fragment, Space, blocks_of
from zeroplan.core.span import Span, round_up
from zeroplan.core.specs import ParamSpec

__all__ = [
    "ComputedTuple",
    "FragmentRun",
    "RankFragments",
    "RunChain",
    "Window",
    "compact_space",
    "rank_windows",
]


class FragmentRun(ComputedTuple[Fragment]):
    """The fragments of one parameter placed in one block of equal pieces (see [Note: compact plans]).

    The run holds elements ``[start, start + numel)`` of the parameter (all
    of it unless a block boundary cuts the parameter: then it is one run per
    block, a :class:`RunChain`) at ``[position, position + numel)`` of the
    block; rank ``r``'s piece is ``[r * piece, (r + 1) * piece)`` of it and
    starts at ``base`` in every rank's shard, so the run has one fragment on
    each rank from ``first`` to ``last``. A zero-size parameter has one empty
    fragment, on the rank whose piece holds its place (the last rank at the
    block's end, or with pieces of zero elements).

    Example:
        >>> run = FragmentRun(param=3, numel=10, block=0, position=6, piece=4, base=8, shard_size=4)
        >>> [(f.rank, f.param_span, f.shard_offset) for f in run][:2]
        [(1, Span(start=0, stop=2), 10), (2, Span(start=2, stop=6), 8)]
        >>> len(run), run.first, run.last, run[-1].param_span
        (3, 1, 3, Span(start=6, stop=10))
    """

    __slots__ = (
        "base",
        "block",
        "first",
        "last",
        "numel",
        "param",
        "piece",
        "position",
        "shard_size",
        "start",
    )
    param: int
    numel: int
    block: int
    position: int
    piece: int
    base: int
    shard_size: int
    start: int
    first: int
    last: int

    def __init__(
        self,
        *,
        param: int,
        numel: int,
        block: int,
        position: int,
        piece: int,
        base: int,
        shard_size: int,
        start: int = 0,
    ) -> None:
        values = (param, numel, block, position, piece, base, shard_size, start)
        if not (all(type(v) is int and v >= 0 for v in values) and shard_size and (piece or not numel)):
            raise PlanInvariantError(f"invalid fragment run of parameter {param!r}: {values}")
        if numel:
            first, last = position // piece, (position + numel - 1) // piece
        else:
            first = last = min(position // piece, shard_size - 1) if piece else shard_size - 1
        names = (
            "param",
            "numel",
            "block",
            "position",
            "piece",
            "base",
            "shard_size",
            "start",
            "first",
            "last",
        )
        for name, value in zip(names, (*values, first, last), strict=True):
            object.__setattr__(self, name, value)

    def __len__(self) -> int:
        return self.last - self.first + 1

    def _numbers(self, rank: int) -> tuple[int, int, int]:
        """Rank ``rank``'s fragment as numbers: its start and stop in the parameter, its shard offset."""
        start, position = rank * self.piece, self.position
        if not self.numel:
            return self.start, self.start, self.base + position - start
        at, stop = max(position, start), min(position + self.numel, start + self.piece)
        shift = position - self.start  # a parameter's element e lies at e + shift of the block
        return at - shift, stop - shift, self.base + at - start

    def _item(self, i: int) -> Fragment:
        rank = self.first + i
        a, b, offset = self._numbers(rank)
        return Fragment(self.param, rank, Span(a, b), offset)

    def __iter__(self) -> Iterator[Fragment]:
        if not self.numel:
            yield self._item(0)
            return
        param, piece, position, base = self.param, self.piece, self.position, self.base
        end, shift = position + self.numel, position - self.start
        for rank in range(self.first, self.last + 1):
            start = rank * piece
            at, stop = max(position, start), min(end, start + piece)
            yield Fragment(param, rank, Span(at - shift, stop - shift), base + at - start)

    def __eq__(self, other: object) -> bool:
        if type(other) is FragmentRun and self._key() == other._key():
            return True
        return super().__eq__(other)

    def __hash__(self) -> int:
        return super().__hash__()

    def _key(self) -> tuple[int, ...]:
        return (self.param, self.numel, self.position, self.piece, self.base, self.first, self.start)

    def cover_problem(self, spec: ParamSpec, shard_size: int) -> str | None:
        """Why the run does not tile ``spec`` exactly once on ranks ``0..shard_size-1``, or ``None``."""
        if not spec.trainable:
            return f"is frozen but the plan gives it {len(self)} fragment(s)"
        if self.param != spec.index:
            return f"lists a fragment of parameter {self.param!r}"
        if self.numel != spec.numel or self.start:
            return f"fragments cover {self.numel} of {spec.numel} elements from element {self.start}"
        if self.last >= shard_size:
            return f"rank {self.last} outside 0..{shard_size - 1}"
        return None

    def digest_text(self) -> str:
        """``"\\x1f" + repr((param, rank, start, stop, shard_offset))`` of every fragment, joined.

        The text ``PartitionPlan.fingerprint`` hashes for these fragments, written
        without a tuple per fragment: the fragments between the first and the last
        fill their pieces, so their bounds are one arithmetic sequence, written
        once each and joined in C (see [Note: compact plans]).
        """
        first, last, param = self.first, self.last, self.param
        ends = [(rank, *self._numbers(rank)) for rank in ((first, last) if last > first else (first,))]
        head, tail = (f"\x1f({param}, {r}, {a}, {b}, {offset})" for r, a, b, offset in (ends[0], ends[-1]))
        if last - first <= 1:
            return head if last == first else head + tail
        shift = self.position - self.start
        middle = _full_pieces_text(param, self.base, self.piece, shift, first + 1, last - 1, self.shard_size)
        return "".join((head, middle, tail))


def _full_pieces_text(param: int, base: int, piece: int, position: int, first: int, last: int, n: int) -> str:
    """Digest text of the fragments filling the pieces of ranks ``first..last`` (one at least) of ``n``.

    ``position``: where the parameter's element 0 lies in the block (negative for the run
    of a later block); ``base``: the block's shard offset. Rank ``r``'s fragment is
    ``"\\x1f(param, r, a_r, a_r+1, base)"`` with ``a_r = r * piece - position``: each bound is
    written once and the text joined in C (a plan of 4,096 ranks writes tens of millions).
    """
    count = last - first + 1
    low = first * piece - position
    bounds = list(map(str, range(low, low + (count + 1) * piece, piece)))
    after = f"{base})\x1f({param}"  # a fragment's end and the next one's start
    items: list[str] = [after] * (4 * count)
    items[0::4] = _numerals(n)[first : last + 1]
    items[1::4] = bounds[:-1]
    items[2::4] = bounds[1:]
    return f"\x1f({param}, " + ", ".join(items)[: -len(after) + len(str(base)) + 1]


@lru_cache(maxsize=8)
def _numerals(n: int) -> tuple[str, ...]:
    """``str`` of ``0..n-1`` (rank numbers, written in every digest text)."""
    return tuple(map(str, range(n)))


class RunChain(ComputedTuple[Fragment]):
    """The fragments of several runs, one after the other: a compact space's ``runs``, or the
    fragments of a parameter that block boundaries cut, one run per block (``interleave_even``).

    Example:
        >>> head = FragmentRun(param=0, numel=6, block=0, position=2, piece=4, base=0, shard_size=2)
        >>> tail = FragmentRun(param=0, numel=3, block=1, position=0, piece=2, base=4, shard_size=2, start=6)
        >>> parts = [head, tail]
        >>> [(f.rank, f.param_span.start, f.param_span.stop, f.shard_offset) for f in RunChain(parts)]
        [(0, 0, 2, 2), (1, 2, 6, 0), (0, 6, 8, 4), (1, 8, 9, 4)]
    """

    __slots__ = ("ends", "parts")
    parts: tuple[FragmentRun, ...]
    ends: tuple[int, ...]

    def __init__(self, parts: Sequence[FragmentRun]) -> None:
        object.__setattr__(self, "parts", tuple(parts))
        object.__setattr__(self, "ends", tuple(accumulate(len(p) for p in self.parts)))

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def _item(self, i: int) -> Fragment:
        k = bisect_left(self.ends, i + 1)
        return self.parts[k][i - (self.ends[k - 1] if k else 0)]

    def __iter__(self) -> Iterator[Fragment]:
        return chain.from_iterable(self.parts)

    def __eq__(self, other: object) -> bool:
        return (type(other) is RunChain and self.parts == other.parts) or super().__eq__(other)

    def cover_problem(self, spec: ParamSpec, shard_size: int) -> str | None:
        """Why the runs do not tile ``spec`` exactly once, in order, or ``None`` (as
        :meth:`FragmentRun.cover_problem`, for a parameter cut into runs)."""
        if not spec.trainable:
            return f"is frozen but the plan gives it {len(self)} fragment(s)"
        position = 0
        for run in self.parts:
            if type(run) is not FragmentRun or run.param != spec.index:
                return f"lists a fragment of parameter {getattr(run, 'param', run)!r}"
            if run.start != position or not run.numel:
                return f"runs must tile it in order; expected one starting at {position}, got {run.start}"
            if run.last >= shard_size:
                return f"rank {run.last} outside 0..{shard_size - 1}"
            position += run.numel
        if position != spec.numel:
            return f"fragments cover {position} of {spec.numel} elements"
        return None

    def digest_text(self) -> str:
        """The digest text of its fragments (:meth:`FragmentRun.digest_text` of each run, joined)."""
        return "".join(run.digest_text() for run in self.parts)

    def __hash__(self) -> int:
        return super().__hash__()


class _BlockRuns(NamedTuple):
    """The runs of one block of a compact space, in buffer order."""

    runs: tuple[FragmentRun, ...]
    lasts: tuple[int, ...]  # each run's last rank (non-decreasing)


class RankFragments(ComputedTuple[Fragment]):
    """One rank's fragments of a compact space, in shard order, computed when first read and kept."""

    __slots__ = ("_items", "blocks", "rank")
    blocks: tuple[_BlockRuns, ...]
    rank: int
    _items: tuple[Fragment, ...] | None

    def __init__(self, blocks: tuple[_BlockRuns, ...], rank: int) -> None:
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "_items", None)

    def _tuple(self) -> tuple[Fragment, ...]:
        items = self._items
        if items is None:
            rank, found = self.rank, []
            for block in self.blocks:
                runs = block.runs
                k = bisect_left(block.lasts, rank)
                while k < len(runs) and runs[k].first <= rank:
                    found.append(runs[k]._item(rank - runs[k].first))
                    k += 1
            items = tuple(found)
            object.__setattr__(self, "_items", items)  # (a cache: the value never changes)
        return items

    def __len__(self) -> int:
        return len(self._tuple())

    def _item(self, i: int) -> Fragment:
        return self._tuple()[i]

    def __iter__(self) -> Iterator[Fragment]:
        return iter(self._tuple())

    def __eq__(self, other: object) -> bool:
        same = type(other) is RankFragments and self.rank == other.rank and self.blocks == other.blocks
        return same or super().__eq__(other)

    def __hash__(self) -> int:
        return super().__hash__()


def compact_space(
    specs: Sequence[ParamSpec],
    fragments: Sequence[Sequence[Fragment]],
    shard_size: int,
    alignment: int,
    index: int,
    dtype: str,
    pieces: Sequence[Sequence[int]] | None,
) -> Space | None:
    """The ``dtype`` space derived from :class:`FragmentRun` s alone; ``None`` unless every one of its
    parameters has one (then ``build_space`` derives it from the fragments).

    Checks, from the runs' numbers, what ``build_space`` checks fragment by
    fragment: every block has equal pieces starting at one shard offset, each
    run lies inside its block with that piece and offset, and the runs follow
    each other in the buffer without overlapping, in parameter order.

    Raises:
        PlanInvariantError: the runs do not form a valid layout.
    """
    if pieces is None:  # rank-major
        return None
    n = shard_size
    params = tuple(s.index for s in specs if s.trainable and s.dtype == dtype)
    runs: list[FragmentRun] = []
    heads: list[FragmentRun] = []  # each parameter's first run
    for p in params:
        frags = fragments[p]
        if type(frags) is FragmentRun:
            runs.append(frags)
            heads.append(frags)
        elif type(frags) is RunChain and frags.parts:
            runs.extend(frags.parts)
            heads.append(frags.parts[0])
        else:
            return None
    if not params:
        return None
    blocks = blocks_of(pieces, (), n, dtype)
    by_block: list[list[FragmentRun]] = [[] for _ in blocks]
    at = (0, 0)  # (block, position) where the previous run ended
    follows = -1
    for run in runs:
        require(0 <= run.block < len(blocks), f"parameter {run.param}: block {run.block} is not in the space")
        block = blocks[run.block]
        fine = (
            run.shard_size == n
            and block.pieces[0] == run.piece
            and block.shard_starts[0] == run.base
            and run.position + run.numel <= block.numel
            and (run.block, run.position) >= at
        )
        if not fine:  # (hot loop: no message unless it fails)
            raise PlanInvariantError(
                f"parameter {run.param} ({specs[run.param].name!r}): its run (block {run.block}, place "
                f"{run.position}, {run.numel} elements, pieces of {run.piece} from shard offset {run.base}) "
                f"does not lie in its block after the previous parameter ({dtype} space)"
            )
        if run.start and (run.block, run.position, run.start) != (at[0] + 1, 0, follows):
            raise PlanInvariantError(
                f"parameter {run.param} ({specs[run.param].name!r}): its run from element {run.start} "
                f"(block {run.block}, place {run.position}) does not start the block after the end of "
                f"its previous run ({dtype} space)"
            )
        at = (run.block, run.position + run.numel)
        # Where the parameter's next run must start: a run that ends its block may be followed by one.
        follows = run.start + run.numel if at[1] == block.numel else -1
        by_block[run.block].append(run)
    for k, block in enumerate(blocks):
        if by_block[k] and not (_uniform(block.pieces) and _uniform(block.shard_starts)):
            raise PlanInvariantError(f"block {k} of the {dtype} space holds parameter runs but uneven pieces")
    block_runs = tuple(tuple(b) for b in by_block)
    # Per rank, the elements it owns: whole pieces between a run's first and last rank, partial ends.
    step = [0] * (n + 1)
    owned = [0] * n
    for run in runs:
        if not run.numel:
            continue
        head = (run.first + 1) * run.piece - run.position
        if run.first == run.last:
            owned[run.first] += run.numel
            continue
        owned[run.first] += head
        owned[run.last] += run.numel - head - (run.last - run.first - 1) * run.piece
        step[run.first + 1] += run.piece
        step[run.last] -= run.piece
    owned = list(map(operator.add, owned, accumulate(step[:n])))
    extents = map(operator.add, blocks[-1].shard_starts, blocks[-1].pieces)  # (a run checked a block)
    indexed = tuple(_BlockRuns(r, tuple(x.last for x in r)) for r in block_runs)
    numels = [specs[p].numel for p in params]
    return Space(
        index=index,
        dtype=dtype,
        params=params,
        param_offsets=tuple(accumulate(numels, initial=0))[:-1],
        numel=sum(numels),
        owned=tuple(owned),
        shard_numel=tuple(round_up(e, alignment) for e in extents),
        blocks=blocks,
        buffer_numel=sum(b.numel for b in blocks),
        buffer_offsets=tuple(blocks[run.block].start + run.position for run in heads),
        runs=RunChain(runs),  # type: ignore[arg-type]
        by_rank=tuple(RankFragments(indexed, r) for r in range(n)),  # type: ignore[arg-type]
        block_runs=block_runs,
    )


def _uniform(values: tuple[int, ...]) -> bool:
    return not values or values.count(values[0]) == len(values)


#: One elementwise window of a rank: ``(group, cohort, start, stop)`` in its shard.
Window = tuple[int, int, int, int]


def rank_windows(space: Space, specs: Sequence[ParamSpec]) -> tuple[tuple[Window, ...], ...]:
    """Per rank of a compact space, its elementwise windows, computed for all ranks at once.

    The windows ``ZeroPlan.inner_tensors`` cuts without in-place cuts: maximal
    runs of the rank's non-empty fragments with one (group, cohort), each
    ending where its last fragment ends and starting where the previous
    window ended (at 0 for the first). The parameters of the space form
    *segments* of one (group, cohort) in buffer order; a rank's last element of
    a segment is found by painting ranks from the segment's last block back, so
    the cost is blocks plus ranks per segment, not fragments. Ranks with equal
    windows share one tuple.
    """
    n = len(space.owned)
    segments: list[tuple[tuple[int, int], list[tuple[int, int, int]]]] = []  # key, [(block, lo, hi)]
    for k, runs in enumerate(space.block_runs):
        for run in runs:
            if not run.numel:
                continue
            spec = specs[run.param]
            key, lo, hi = (spec.group, spec.cohort), run.position, run.position + run.numel
            if segments and segments[-1][0] == key:
                parts = segments[-1][1]
                if parts[-1][0] == k and parts[-1][2] == lo:
                    parts[-1] = (k, parts[-1][1], hi)
                else:
                    parts.append((k, lo, hi))
            else:
                segments.append((key, [(k, lo, hi)]))
    current: list[tuple[int, int] | None] = [None] * n  # per rank: the key of its open window
    stops = [0] * n  # ... where its open window ends so far
    starts = [0] * n  # ... where its open window starts
    closed: list[list[Window]] = [[] for _ in range(n)]
    blocks = space.blocks
    for key, parts in segments:
        last = _last_stops(parts, blocks, n)
        for r, stop in last.items():
            open_key = current[r]
            if open_key is not None and open_key != key:
                closed[r].append((*open_key, starts[r], stops[r]))
                starts[r] = stops[r]
            current[r], stops[r] = key, stop
    shared: dict[tuple[Window, ...], tuple[Window, ...]] = {}
    result = []
    for r in range(n):
        key = current[r]
        windows = (*closed[r], (*key, starts[r], stops[r])) if key is not None else ()
        result.append(shared.setdefault(windows, windows))
    return tuple(result)


def _last_stops(parts: list[tuple[int, int, int]], blocks: tuple[Block, ...], n: int) -> dict[int, int]:
    """Per rank holding part of a segment, where its last element of it ends in its shard.

    ``parts``: the segment's ``(block, lo, hi)`` ranges, in buffer order. Ranks
    are painted from the last part back, each rank once; ``following[r]`` is the
    first rank at or after ``r`` not painted yet (path halving).
    """
    following = list(range(n + 1))

    def unpainted(r: int) -> int:
        while following[r] != r:
            following[r] = following[following[r]]
            r = following[r]
        return r

    last: dict[int, int] = {}
    for k, lo, hi in reversed(parts):
        block = blocks[k]
        piece, base = block.pieces[0], block.shard_starts[0]
        r, z = unpainted(lo // piece), (hi - 1) // piece
        while r <= z:
            last[r] = base + min(hi - r * piece, piece)
            following[r] = r + 1
            r = unpainted(r + 1)
    return last
