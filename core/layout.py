# zeroplan.core — pure planning: no torch, no I/O.
# Interleaved layouts: blocks cut in backward order, one piece per rank each, every offset derived.
"""Building partition plans with the ``interleaved`` layout (see [Note: layout]).

[Note: interleaved layout]
A space's full buffer is cut into blocks in backward readiness order (the
last parameters first), each capped like a gradient bucket; a block is one
bucket, reduced by one collective and gathered by one collective.

* ``flat_even``: every block but the first (in buffer order) holds exactly
  ``cap`` elements, a multiple of ``shard_size * alignment``, and every rank
  gets an equal piece of it. The first block is padded at its front to such a
  multiple, so the buffer is the space coordinate shifted by that padding and
  parameters stay contiguous even when a block boundary cuts one. Each block
  is one ``reduce_scatter`` and one ``all_gather`` of equal pieces.
* whole-parameter strategies: parameters are packed whole into blocks of at
  most ``cap`` elements (a larger parameter gets a block of its own). Within a
  block, ``lpt_whole`` (largest first) and ``greedy_whole`` (index order) give
  each parameter to the rank with the least of that block, ties broken by the
  least overall, so pieces are as even as the sizes allow (Megatron's
  layer-wise optimizer packs Muon's parameters the same way); a user's
  whole-parameter strategy keeps its owners. Pieces are padded to the
  alignment; the plan names each block's collective (``reduce_scatter`` when
  the pieces happen to be equal, else ``reduce_scatter_v`` or ``reduce``).
* A user strategy that splits parameters keeps the ``rank_major`` layout.

At stage 1 ``plan(layout="auto")`` keeps ``rank_major``: stage 1 holds full gradient
buffers anyway and reduces into the rank's region of them in place, where an
interleaved shard would need a reduced-gradient shard of its own (4 bytes x shard).
Either layout steps fp32 parameters in place at stages 1-2, with no master copy:
an interleaved shard's elementwise windows are cut at its piece boundaries, so
each is a view of one piece of the full buffer (``ZeroPlan.master_in_params``).

The number of pieces grows as blocks times ranks. ``layout="auto"`` (the
default) therefore interleaves unless that product exceeds
:data:`AUTO_MAX_PIECES` (e.g. a 70B model in 25 MiB buckets over 4096 ranks,
where the pieces would be a few KiB each; shard groups, MiCS, are the cure),
and uses ``rank_major`` then; the plan's ``partition.layout`` says which.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from zeroplan.core.errors import ConfigError, check_config, require
from zeroplan.core.partition import PartitionPlan
from zeroplan.core.runs import FragmentRun, RunChain
from zeroplan.core.space import Fragment
from zeroplan.core.span import Span, round_up
from zeroplan.core.specs import ParamSpec, check_specs
from zeroplan.core.strategies import flat_even, get_strategy, greedy_whole, lpt_whole

__all__ = ["AUTO_MAX_PIECES", "LAYOUTS", "build_partition", "interleave_even", "interleave_whole"]

#: The layouts ``plan(layout=...)`` accepts.
LAYOUTS = ("auto", "interleaved", "rank_major")
#: ``layout="auto"`` interleaves while blocks x ranks stays at or below this.
AUTO_MAX_PIECES = 2**18

_Fragments = dict[int, Sequence[Fragment]]


def _spaces(specs: Sequence[ParamSpec]) -> list[list[ParamSpec]]:
    """Trainable specs grouped by dtype (first appearance order), in index order."""
    spaces: dict[str, list[ParamSpec]] = {}
    for spec in specs:
        if spec.trainable:
            spaces.setdefault(spec.dtype, []).append(spec)
    return list(spaces.values())


def _cap(members: Sequence[ParamSpec], bucket_bytes: int, unit: int) -> int:
    """Elements of a full block: the byte cap in elements, rounded down to ``unit`` (at least one)."""
    return max(unit, bucket_bytes // members[0].itemsize // unit * unit)


def _finish(
    specs: tuple[ParamSpec, ...],
    shard_size: int,
    alignment: int,
    strategy: str,
    fragments: _Fragments,
    pieces: list[tuple[tuple[int, ...], ...]],
) -> PartitionPlan:
    return PartitionPlan(
        specs=specs,
        shard_size=shard_size,
        alignment=alignment,
        strategy=strategy,
        fragments=tuple(_kept(fragments.get(s.index, ())) for s in specs),
        block_pieces=tuple(pieces),
    )


def _kept(frags: Sequence[Fragment]) -> Sequence[Fragment]:
    """A parameter's fragments as the plan holds them: runs stay runs ([Note: compact plans])."""
    return frags if type(frags) is FragmentRun or type(frags) is RunChain else tuple(frags)


def interleave_even(
    specs: Sequence[ParamSpec],
    shard_size: int,
    alignment: int,
    bucket_bytes: int,
    *,
    whole_blocks: bool = False,
) -> PartitionPlan:
    """``flat_even`` with the interleaved layout: equal pieces of every block (see the Note).

    ``whole_blocks`` (stage 3) cuts blocks at parameter boundaries instead.

    Example:
        >>> from zeroplan.core.specs import specs_from_shapes
        >>> p = interleave_even(specs_from_shapes([(10,), (7,)]), 2, 2, 32)
        >>> p.block_pieces, [b.start for b in p.spaces[0].blocks], p.spaces[0].owned
        ((((2, 2), (4, 4), (4, 4)),), [0, 4, 12], (8, 9))
    """
    specs = check_specs(specs)
    n = shard_size
    if whole_blocks:
        return _even_whole_blocks(specs, n, alignment, bucket_bytes)
    fragments: _Fragments = {}
    pieces = []
    for members in _spaces(specs):
        unit = n * alignment
        cap = _cap(members, bucket_bytes, unit)
        total = sum(s.numel for s in members)
        count = max(1, -(-total // cap))
        # The first block (in buffer order) takes the remainder, padded at its front to a whole unit;
        # a space of zero-size parameters only is one empty block, as in the rank-major layout.
        rest = total - (count - 1) * cap
        first = round_up(rest, unit)
        pad = first - rest
        pieces.append(((first // n,) * n, *(((cap // n,) * n,) * (count - 1))))
        first_piece, piece = first // n, cap // n
        end_of_buffer = first + (count - 1) * cap
        position = pad  # the buffer coordinate: the space coordinate shifted by the padding
        for spec in members:
            # Its fragments by rule, one run per block it crosses ([Note: compact plans] in core.runs).
            runs = []
            at, end = position, position + spec.numel
            while True:
                if at < first or at == end_of_buffer == first:  # block 0: pieces of first_piece from 0
                    k, inside, base, size, block_numel = 0, at, 0, first_piece, first
                elif at == end_of_buffer:  # a zero-size parameter at the very end: the last block's end
                    k, inside, block_numel = count - 1, cap, cap
                    base, size = first_piece + (k - 1) * piece, piece
                else:  # block k >= 1: pieces of `piece`, after block 0's and k - 1 full pieces
                    k, inside = divmod(at - first, cap)
                    k += 1
                    base, size, block_numel = first_piece + (k - 1) * piece, piece, cap
                stop = min(end, at - inside + block_numel)
                runs.append(
                    FragmentRun(
                        param=spec.index,
                        numel=stop - at,
                        block=k,
                        position=inside,
                        piece=size,
                        base=base,
                        shard_size=n,
                        start=at - position,
                    )
                )
                at = stop
                if at >= end:
                    break
            fragments[spec.index] = runs[0] if len(runs) == 1 else RunChain(runs)
            position = end
    return _finish(specs, shard_size, alignment, "flat_even", fragments, pieces)


def _even_whole_blocks(
    specs: tuple[ParamSpec, ...], n: int, alignment: int, bucket_bytes: int
) -> PartitionPlan:
    """Whole parameters packed into blocks (as ``interleave_whole``), each block split evenly.

    Every block is padded at its end to a multiple of ``n * alignment`` and every
    rank gets an equal piece of it, so a block is one ``reduce_scatter`` and one
    ``all_gather``, and no parameter crosses a block boundary: stage 3 gathers
    and frees each block on its own (see [Note: stage 3] in ``zeroplan.facade``).
    """
    fragments: dict[int, FragmentRun] = {}
    pieces = []
    unit = n * alignment
    equal: dict[int, tuple[int, ...]] = {}
    for members in _spaces(specs):
        space_pieces = []
        base = 0  # every rank's shard offset of the block's piece (all pieces are equal)
        for k, block in enumerate(_pack(members, _cap(members, bucket_bytes, unit))):
            size = round_up(sum(s.numel for s in block), unit)
            piece = size // n
            position = 0
            for spec in block:
                # Its fragments, one per piece it crosses (a zero-size one: an empty fragment where it
                # sits), computed when read: see [Note: compact plans] in zeroplan.core.runs.
                fragments[spec.index] = FragmentRun(
                    param=spec.index,
                    numel=spec.numel,
                    block=k,
                    position=position,
                    piece=piece,
                    base=base,
                    shard_size=n,
                )
                position += spec.numel
            space_pieces.append(equal.setdefault(piece, (piece,) * n))  # blocks of a size share a tuple
            base += piece
        pieces.append(tuple(space_pieces))
    return PartitionPlan(
        specs=specs,
        shard_size=n,
        alignment=alignment,
        strategy="flat_even",
        fragments=tuple(fragments.get(s.index, ()) for s in specs),
        block_pieces=tuple(pieces),
    )


def _pack(members: Sequence[ParamSpec], cap: int) -> list[list[ParamSpec]]:
    """Whole parameters packed into blocks of at most ``cap`` elements from the last one down.

    A parameter larger than ``cap`` gets a block of its own; zero-size ones join the block
    being filled (never one of their own, which would be an empty collective per step).
    Blocks come back in buffer order.
    """
    blocks: list[list[ParamSpec]] = []
    current: list[ParamSpec] = []
    size = 0
    for spec in reversed(members):
        if spec.numel and size and size + spec.numel > cap:
            blocks.append(current[::-1])
            current, size = [], 0
        current.append(spec)
        size += spec.numel
    blocks.append(current[::-1])
    blocks.reverse()
    return blocks


def _balanced(members: Sequence[ParamSpec], idle: list[tuple[int, int]], largest_first: bool) -> list[int]:
    """Owners of one block's parameters: each to the rank with the least of the block, then overall.

    ``idle``: a heap of ``(total, rank)`` of every rank, shared by the blocks of a space (updated
    here). A rank given elements of the block moves to a heap of ``(block load, total, rank)``,
    whose keys are all larger, until the block ends; so a block costs its parameters, not its ranks.
    """
    owners = [0] * len(members)
    order: Sequence[int] = range(len(members))
    if largest_first:
        order = sorted(order, key=lambda i: (-members[i].numel, members[i].index))
    busy: list[tuple[int, int, int]] = []  # (block load > 0, total, rank)
    for i in order:
        if idle:
            load, (total, rank) = 0, heapq.heappop(idle)
        else:
            load, total, rank = heapq.heappop(busy)
        numel = members[i].numel
        owners[i] = rank
        if load + numel:
            heapq.heappush(busy, (load + numel, total + numel, rank))
        else:  # a zero-size parameter leaves an idle rank idle
            heapq.heappush(idle, (total, rank))
    for _, total, rank in busy:
        heapq.heappush(idle, (total, rank))
    return owners


def interleave_whole(
    specs: Sequence[ParamSpec],
    shard_size: int,
    alignment: int,
    bucket_bytes: int,
    strategy: str,
    owner: Callable[[ParamSpec], int] | None = None,
    largest_first: bool = True,
) -> PartitionPlan:
    """Whole parameters packed into blocks in backward order (see the Note).

    Args:
        owner: the rank owning each parameter (a user strategy's choice);
            ``None`` balances each block, largest first or in index order.

    Example:
        >>> from zeroplan.core.specs import specs_from_shapes
        >>> p = interleave_whole(specs_from_shapes([(3,), (5,), (2,), (6,)]), 2, 1, 32, "lpt_whole")
        >>> p.block_pieces, [p.owner_ranks(i) for i in range(4)]
        ((((5, 3), (2, 6)),), [(1,), (0,), (0,), (1,)])
    """
    specs = check_specs(specs)
    n = shard_size
    fragments: _Fragments = {}
    pieces = []
    for members in _spaces(specs):
        blocks = _pack(members, _cap(members, bucket_bytes, alignment))
        idle = [(0, rank) for rank in range(n)]  # (total, rank): a heap already
        owners: dict[int, list[int]] = {}
        # Balance the largest blocks first, so the smaller ones even out the totals (LPT over blocks).
        for b in sorted(range(len(blocks)), key=lambda b: -sum(s.numel for s in blocks[b])):
            block = blocks[b]
            owners[b] = (
                [owner(s) for s in block] if owner is not None else _balanced(block, idle, largest_first)
            )
        base = [0] * n
        space_pieces = []
        for b, block in enumerate(blocks):
            fill: dict[int, int] = {}  # the ranks given parameters of the block: their elements
            for spec, rank in zip(block, owners[b], strict=True):
                at = fill.get(rank, 0)
                fragments[spec.index] = [Fragment(spec.index, rank, Span(0, spec.numel), base[rank] + at)]
                fill[rank] = at + spec.numel
            sizes = [0] * n
            for rank, numel in fill.items():
                sizes[rank] = round_up(numel, alignment)
                base[rank] += sizes[rank]
            space_pieces.append(tuple(sizes))
        pieces.append(tuple(space_pieces))
    return _finish(specs, shard_size, alignment, strategy, fragments, pieces)


def _even_pieces(specs: Sequence[ParamSpec], shard_size: int, alignment: int, bucket_bytes: int) -> int:
    """Blocks x ranks of ``interleave_even``, without building it."""
    total = 0
    for members in _spaces(specs):
        cap = _cap(members, bucket_bytes, shard_size * alignment)
        total += max(1, -(-sum(s.numel for s in members) // cap)) * shard_size
    return total


def _whole_pieces(specs: Sequence[ParamSpec], shard_size: int, alignment: int, bucket_bytes: int) -> int:
    """Blocks x ranks of ``interleave_whole``, without balancing them."""
    return sum(
        len(_pack(members, _cap(members, bucket_bytes, alignment))) * shard_size for members in _spaces(specs)
    )


def build_partition(
    specs: Sequence[ParamSpec],
    shard_size: int,
    alignment: int,
    bucket_bytes: int,
    strategy: str,
    layout: str = "auto",
    *,
    whole_blocks: bool = False,
) -> PartitionPlan:
    """The partition of ``strategy`` in ``layout`` (``"auto"``, ``"interleaved"`` or ``"rank_major"``).

    ``"auto"`` interleaves while blocks x ranks stays at or below
    :data:`AUTO_MAX_PIECES` (see [Note: interleaved layout]). ``whole_blocks``
    (stage 3): ``flat_even`` blocks end at parameter boundaries, and ``"auto"``
    always interleaves (a rank-major plan is one block: stage 3 would gather the
    whole model at once; only an explicit ``"rank_major"`` asks for that).

    Raises:
        ConfigError: an unknown layout or strategy, or ``"interleaved"`` for a
            user strategy that splits parameters (it decides the layout itself).

    Example:
        >>> from zeroplan.core.specs import specs_from_shapes
        >>> specs = specs_from_shapes([(1000,)] * 8)
        >>> build_partition(specs, 4, 8, 8000, "lpt_whole").layout
        'interleaved'
        >>> build_partition(specs, 2**17, 8, 8000, "lpt_whole").layout   # 4 blocks x 2**17 ranks
        'rank_major'
    """
    check_config(layout in LAYOUTS, f"unknown layout {layout!r}; use one of {', '.join(map(repr, LAYOUTS))}")
    check_config(
        type(bucket_bytes) is int and bucket_bytes >= 1,
        f"bucket size must be a positive number of bytes, got {bucket_bytes!r}",
    )
    check_config(
        type(shard_size) is int and shard_size >= 1, f"shard size must be an int >= 1, got {shard_size!r}"
    )
    check_config(
        type(alignment) is int and alignment >= 1,
        f"alignment must be an int >= 1 (elements), got {alignment!r}",
    )
    specs = check_specs(specs)
    function = get_strategy(strategy)
    interleave = layout == "interleaved" or (whole_blocks and layout == "auto")
    if function is flat_even and layout != "rank_major":
        if whole_blocks:  # blocks of whole parameters, each a multiple of shard_size x alignment
            pieces = _whole_pieces(specs, shard_size, shard_size * alignment, bucket_bytes)
        else:
            pieces = _even_pieces(specs, shard_size, alignment, bucket_bytes)
        interleave = interleave or pieces <= AUTO_MAX_PIECES
        if interleave:
            return interleave_even(specs, shard_size, alignment, bucket_bytes, whole_blocks=whole_blocks)
    if function in (lpt_whole, greedy_whole) and layout != "rank_major":
        interleave = (
            interleave or _whole_pieces(specs, shard_size, alignment, bucket_bytes) <= AUTO_MAX_PIECES
        )
        if interleave:
            return interleave_whole(
                specs, shard_size, alignment, bucket_bytes, strategy, largest_first=function is lpt_whole
            )
    ownership = function(specs, shard_size, alignment)
    require(
        isinstance(ownership, PartitionPlan),
        f"strategy {strategy!r} returned {type(ownership).__name__}, expected a PartitionPlan",
    )
    require(
        ownership.specs == specs and ownership.shard_size == shard_size,
        f"strategy {strategy!r} returned a plan for other specs or another shard size",
    )
    if layout == "rank_major" or function in (flat_even, lpt_whole, greedy_whole):
        return ownership
    if ownership.splits_params:
        if whole_blocks and layout == "auto":
            raise ConfigError(
                f"strategy {strategy!r} splits parameters, so its plan is one block per dtype: stage 3 "
                "would gather the whole model at once. Use flat_even or a whole-parameter strategy, or "
                "layout='rank_major' to accept one block"
            )
        if layout == "interleaved":
            raise ConfigError(
                f"strategy {strategy!r} splits parameters, so it lays out shards itself; use "
                "layout='rank_major' (or 'auto'), or a whole-parameter strategy"
            )
        return ownership
    if not interleave and _whole_pieces(specs, shard_size, alignment, bucket_bytes) > AUTO_MAX_PIECES:
        return ownership
    owners = {s.index: ownership.fragments[s.index][0].rank for s in specs if s.trainable}
    return interleave_whole(
        specs, shard_size, alignment, bucket_bytes, strategy, owner=lambda s: owners[s.index]
    )
