"""Optimizer state of parameters frozen after training, kept until they train again.

[Note: parked state]
``torch.optim`` keeps a parameter's state while it gets no gradient, and a
parameter unfrozen later continues with its moments and its own ``step``.
zeroplan re-plans when trainability changes (see [Note: re-planning]), and a
frozen parameter leaves the flat buffers, so its state is *parked* instead:
each rank keeps the pieces it owned (per-element state and fp32 master, in
the parameter's coordinates, so they survive any later re-plan), and the
scalar state of the parameter's cohort (Adam's ``step``). Parked state costs
what it cost before, still sharded, and nothing steps it.

When the parameter becomes trainable again it joins a cohort of its own
carrying the parked scalars; once the new plan is installed the shard group
exchanges the parked pieces (one ``all_gather_object``) and every rank fills
the fragments it now owns. A parameter frozen before it ever had state has
nothing to park and starts fresh when unfrozen.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping

import torch

from zeroplan.core import Fragment, Span, ZeroPlan
from zeroplan.facade.mechanisms.collectives import all_gather_objects
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.params.buffers import SpaceBuffers
from zeroplan.facade.state.tree import MASTER, ParkedParam, ShardState, tree_clone

__all__ = ["MASTER", "ParkedParam", "park", "unpark"]


def park(
    zp: ZeroPlan,
    buffers: tuple[SpaceBuffers, ...],
    state: ShardState,
    frozen: Collection[int],
    shard_rank: int,
) -> dict[int, ParkedParam]:
    """This rank's parked state of ``frozen`` (trainable in ``zp``), copied out of ``state`` and masters.

    Parameters whose cohort has no state yet (never stepped) are not parked.
    """
    parked: dict[int, ParkedParam] = {}
    for p in sorted(frozen):
        spec = zp.specs[p]
        if not zp.elementwise:
            whole = state.whole.get(p)
            parked[p] = ParkedParam(scalars={}, pieces={}, whole=None if whole is None else tree_clone(whole))
            continue
        scalars = state.scalars.get((spec.group, spec.cohort))
        if scalars is None:
            continue
        space = zp.partition.space_of(p)
        if space is None:
            continue
        buf = buffers[space.index]
        pieces: dict[str, list[tuple[Span, torch.Tensor]]] = {}
        for frag in zp.partition.fragments[p]:
            if frag.rank != shard_rank or frag.param_span.numel == 0:
                continue
            window = frag.shard_span.as_slice()
            for (index, key), values in state.flat.items():
                if index == space.index:
                    pieces.setdefault(key, []).append((frag.param_span, values[window].clone()))
            if buf.carries_master:
                pieces.setdefault(MASTER, []).append(
                    (frag.param_span, buf.read_master(frag.shard_span).clone())
                )
        parked[p] = ParkedParam(scalars=tree_clone(scalars), pieces=pieces)
    return parked


def gather_parked(
    parked: Mapping[int, ParkedParam], wanted: Collection[int], groups: ProcessGroups
) -> dict[int, ParkedParam]:
    """Every shard rank's parked state of ``wanted``, merged (collective over the shard group)."""
    mine = {p: tree_clone(parked[p], torch.device("cpu")) for p in sorted(wanted) if p in parked}
    merged: dict[int, ParkedParam] = {}
    for theirs in all_gather_objects(mine, groups.shard):
        for p, part in theirs.items():
            known = merged.get(p, ParkedParam(scalars={}, pieces={}))
            pieces = dict(known.pieces)
            for key, more in part.pieces.items():
                pieces[key] = [*pieces.get(key, []), *more]
            merged[p] = ParkedParam(
                scalars=known.scalars or dict(part.scalars),
                pieces=pieces,
                whole=part.whole if part.whole is not None else known.whole,
            )
    return merged


def _placed(pieces: list[tuple[Span, torch.Tensor]], frag: Fragment) -> Iterator[tuple[Span, torch.Tensor]]:
    """Where parked ``pieces`` land in fragment ``frag``: (span of the shard, values)."""
    for span, values in pieces:
        overlap = span.intersect(frag.param_span)
        if overlap is not None:
            yield frag.shard_span_of(overlap), values[overlap.shift(-span.start).as_slice()]


def unpark(
    zp: ZeroPlan,
    buffers: tuple[SpaceBuffers, ...],
    state: ShardState,
    stateful: set[tuple[int, int]],
    gathered: Mapping[int, ParkedParam],
    shard_rank: int,
    device: torch.device,
) -> None:
    """Write the gathered parked state of parameters trainable again in ``zp`` into ``state`` and masters.

    ``state`` is in ``zp``'s shard coordinates; each unparked parameter has a
    cohort of its own, which receives its parked scalars.
    """
    for p, part in gathered.items():
        spec = zp.specs[p]
        if not zp.elementwise:
            mine = {t.param for t in zp.inner_tensors(shard_rank)}
            if part.whole is not None and p in mine:
                state.whole[p] = tree_clone(part.whole, device)
                stateful.add((spec.group, spec.cohort))
            continue
        space = zp.partition.space_of(p)
        if space is None:
            continue
        owned, buf = space.extent(shard_rank), buffers[space.index]
        for frag in (f for f in zp.partition.fragments[p] if f.rank == shard_rank):
            for key, pieces in part.pieces.items():
                if key != MASTER and (space.index, key) not in state.flat:
                    dtype = pieces[0][1].dtype
                    state.flat[space.index, key] = torch.zeros(owned, dtype=dtype, device=device)
                for shard_span, values in _placed(pieces, frag):
                    if key == MASTER:
                        buf.write_master(values, shard_span)
                    else:
                        state.flat[space.index, key][shard_span.as_slice()] = values.to(device)
        state.scalars[spec.group, spec.cohort] = tree_clone(part.scalars, device)
        stateful.add((spec.group, spec.cohort))
