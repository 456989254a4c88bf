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

The number of pieces grows as blocks times ranks. ``layout="auto"`` (the
default) therefore interleaves unless that product exceeds
:data:`AUTO_MAX_PIECES` (e.g. a 70B model in 25 MiB buckets over 4096 ranks,
where the pieces would be a few KiB each; shard groups, MiCS, are the cure),
and uses ``rank_major`` then; the plan's ``partition.layout`` says which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from zeroplan.core.errors import ConfigError, check_config, require
from zeroplan.core.partition import PartitionPlan
from zeroplan.core.space import Fragment
from zeroplan.core.span import Span, round_up
from zeroplan.core.specs import ParamSpec, check_specs
from zeroplan.core.strategies import get_strategy

__all__ = ["AUTO_MAX_PIECES", "LAYOUTS", "build_partition", "interleave_even", "interleave_whole"]

#: The layouts ``plan(layout=...)`` accepts.
LAYOUTS = ("auto", "interleaved", "rank_major")
#: ``layout="auto"`` interleaves while blocks x ranks stays at or below this.
AUTO_MAX_PIECES = 2**18

_Fragments = dict[int, list[Fragment]]


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
        fragments=tuple(tuple(fragments.get(s.index, ())) for s in specs),
        block_pieces=tuple(pieces),
    )


def interleave_even(
    specs: Sequence[ParamSpec], shard_size: int, alignment: int, bucket_bytes: int
) -> PartitionPlan:
    """``flat_even`` with the interleaved layout: equal pieces of every block (see the Note).

    Example:
        >>> from zeroplan.core.specs import specs_from_shapes
        >>> p = interleave_even(specs_from_shapes([(10,), (7,)]), 2, 2, 32)
        >>> p.block_pieces, [b.start for b in p.spaces[0].blocks], p.spaces[0].owned
        ((((2, 2), (4, 4), (4, 4)),), [0, 4, 12], (8, 9))
    """
    specs = check_specs(specs)
    n = shard_size
    fragments: _Fragments = {}
    pieces = []
    for members in _spaces(specs):
        unit = n * alignment
        cap = _cap(members, bucket_bytes, unit)
        total = sum(s.numel for s in members)
        count = max(1, -(-total // cap))
        first = round_up(max(total - (count - 1) * cap, 1), unit)
        pad = first - (total - (count - 1) * cap)
        sizes = [first] + [cap] * (count - 1)
        pieces.append(tuple((size // n,) * n for size in sizes))
        # Walk the parameters through the blocks; block k starts at `start` in the buffer and at
        # `base` in every rank's shard.
        k, start, base = 0, 0, 0
        position = pad
        for spec in members:
            end = position + spec.numel
            at = position
            while True:
                while k + 1 < count and at >= start + sizes[k]:
                    start, base, k = start + sizes[k], base + sizes[k] // n, k + 1
                piece = sizes[k] // n
                rank = min((at - start) // piece, n - 1)
                piece_start = start + rank * piece
                stop = min(end, piece_start + piece)
                fragments.setdefault(spec.index, []).append(
                    Fragment(spec.index, rank, Span(at - position, stop - position), base + at - piece_start)
                )
                at = stop
                if at >= end:
                    break
            position = end
    return _finish(specs, shard_size, alignment, "flat_even", fragments, pieces)


def _balanced(members: Sequence[ParamSpec], n: int, totals: list[int], largest_first: bool) -> list[int]:
    """Owners of one block's parameters: each to the rank with the least of the block, then overall."""
    loads = [0] * n
    owners = [0] * len(members)
    order = range(len(members))
    if largest_first:
        order = sorted(order, key=lambda i: (-members[i].numel, members[i].index))
    for i in order:
        rank = min(range(n), key=lambda r: (loads[r], totals[r], r))
        owners[i] = rank
        loads[rank] += members[i].numel
        totals[rank] += members[i].numel
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
        cap = _cap(members, bucket_bytes, alignment)
        blocks: list[list[ParamSpec]] = []  # built from the last parameter down
        current: list[ParamSpec] = []
        size = 0
        for spec in reversed(members):
            if current and size + spec.numel > cap:
                blocks.append(current[::-1])
                current, size = [], 0
            current.append(spec)
            size += spec.numel
        blocks.append(current[::-1])
        blocks.reverse()  # buffer order
        totals = [0] * n
        owners: dict[int, list[int]] = {}
        # Balance the largest blocks first, so the smaller ones even out the totals (LPT over blocks).
        for b in sorted(range(len(blocks)), key=lambda b: -sum(s.numel for s in blocks[b])):
            block = blocks[b]
            owners[b] = (
                [owner(s) for s in block] if owner is not None else _balanced(block, n, totals, largest_first)
            )
        base = [0] * n
        space_pieces = []
        for b, block in enumerate(blocks):
            fill = [0] * n
            for spec, rank in zip(block, owners[b], strict=True):
                fragments[spec.index] = [Fragment(spec.index, rank, Span(0, spec.numel), base[rank] + fill[rank])]
                fill[rank] += spec.numel
            sizes = tuple(round_up(f, alignment) for f in fill)
            space_pieces.append(sizes)
            base = [b + s for b, s in zip(base, sizes, strict=True)]
        pieces.append(tuple(space_pieces))
    return _finish(specs, shard_size, alignment, strategy, fragments, pieces)


def _even_pieces(specs: Sequence[ParamSpec], shard_size: int, alignment: int, bucket_bytes: int) -> int:
    """Blocks x ranks of ``interleave_even``, without building it."""
    total = 0
    for members in _spaces(specs):
        cap = _cap(members, bucket_bytes, shard_size * alignment)
        total += max(1, -(-sum(s.numel for s in members) // cap)) * shard_size
    return total


def build_partition(
    specs: Sequence[ParamSpec],
    shard_size: int,
    alignment: int,
    bucket_bytes: int,
    strategy: str,
    layout: str = "auto",
) -> PartitionPlan:
    """The partition of ``strategy`` in ``layout`` (``"auto"``, ``"interleaved"`` or ``"rank_major"``).

    Raises:
        ConfigError: an unknown layout, or ``"interleaved"`` for a user
            strategy that splits parameters (it decides the layout itself).
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
    if strategy == "flat_even" and layout != "rank_major":
        if layout == "interleaved" or _even_pieces(specs, shard_size, alignment, bucket_bytes) <= AUTO_MAX_PIECES:
            return interleave_even(specs, shard_size, alignment, bucket_bytes)
    ownership = get_strategy(strategy)(specs, shard_size, alignment)
    require(
        isinstance(ownership, PartitionPlan),
        f"strategy {strategy!r} returned {type(ownership).__name__}, expected a PartitionPlan",
    )
    require(
        ownership.specs == specs and ownership.shard_size == shard_size,
        f"strategy {strategy!r} returned a plan for other specs or another shard size",
    )
    if layout == "rank_major" or strategy == "flat_even":
        return ownership
    if ownership.splits_params:
        if layout == "interleaved":
            raise ConfigError(
                f"strategy {strategy!r} splits parameters, so it lays out shards itself; use "
                "layout='rank_major' (or 'auto'), or a whole-parameter strategy"
            )
        return ownership
    if strategy in ("lpt_whole", "greedy_whole"):
        return interleave_whole(
            specs, shard_size, alignment, bucket_bytes, strategy, largest_first=strategy == "lpt_whole"
        )
    owners = {s.index: ownership.fragments[s.index][0].rank for s in specs if s.trainable}
    return interleave_whole(specs, shard_size, alignment, bucket_bytes, strategy, owner=lambda s: owners[s.index])
