"""Whole tensors from a dict of ``FlatPieces``: torch's ``full_state_dict=True`` for zeroplan's dicts.

[Note: full state dicts]
torch's ``get_optimizer_state_dict(..., options=StateDictOptions(full_state_dict=True))``
gathers the DTensors and (dim-0) ShardedTensors of a dict and passes other tensors
through; a ``FlatPieces`` is neither, so torch alone would hand rank 0 a tensor
holding only rank 0's elements. :func:`gather_full` does the gather for
zeroplan's dicts: every rank of a shard group describes its leaves (the pieces'
ranges; scalars and small values themselves), then each rank in turn broadcasts
its pieces, one buffer per dtype, and the destinations copy every range into the
whole tensor. Replica groups hold the same pieces and gather among themselves;
scalars named only by ranks that hold some of a parameter ([Note: torch layout of
shard state]) reach every destination. Memory: the whole dict on each
destination, plus one rank's pieces of one dtype in flight. A tensor-parallel
optimizer's pieces are its slice's (global coordinates on top): each slice is
gathered over its data-parallel ranks first, then the slices are joined over
tp, each tp rank in turn broadcasting its slices into the global tensors
(:func:`_join_slices`); replicas are taken as tp rank 0 holds them.

``checkpoint.interchange.get_optimizer_state_dict`` and ``model_state_dict`` take
torch's ``StateDictOptions`` and use it when ``full_state_dict`` is set; with
``cpu_offload`` only rank 0 receives (in host memory) and the others get ``{}``,
as torch does. The way back: torch's ``set_optimizer_state_dict`` takes whole
tensors as they are (``broadcast_from_rank0`` included: torch broadcasts plain
tensors itself); ``load_model_state_dict`` takes them on every rank, or rank 0's
through :func:`broadcast_from_rank0`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from zeroplan.core import ConfigError, IncompatiblePlanError, Span
from zeroplan.facade.mechanisms.agreement import verdicts
from zeroplan.facade.mechanisms.collectives import broadcast
from zeroplan.facade.mechanisms.flat_pieces import FlatPieces
from zeroplan.facade.mechanisms.torch_dtypes import dtype_name, torch_dtype
from zeroplan.facade.state.dicts import Shards

__all__ = ["broadcast_from_rank0", "gather_full"]

Path = tuple[Any, ...]


class _Pieces(NamedTuple):
    """A leaf that is a ``FlatPieces``: the whole tensor's shape and dtype, the ranges this rank holds;
    for a tp slice's pieces ``shape`` is the slice's (the ranges' coordinates), ``whole`` the global
    shape and ``origin`` where the slice starts in it."""

    shape: tuple[int, ...]
    dtype: str
    spans: tuple[tuple[int, int], ...]
    whole: tuple[int, ...] | None = None
    origin: tuple[int, ...] | None = None


class _Value(NamedTuple):
    """A leaf sent as it is (scalars, small tensors, anything not a tensor)."""

    value: Any


class _Whole(NamedTuple):
    """A whole tensor rank 0 broadcasts: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: str


class _Own(NamedTuple):
    """A larger plain tensor: each destination keeps its own (buffers and frozen parameters, whole)."""


def _flatten(tree: dict[Any, Any], prefix: Path = ()) -> dict[Path, Any]:
    out: dict[Path, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def _describe(leaf: Any) -> _Pieces | _Value | _Own:
    if isinstance(leaf, FlatPieces):
        spans = tuple((s.start, s.stop) for s, _ in leaf.parts)
        whole = None if leaf.origin is None else tuple(leaf.shape)
        return _Pieces(tuple(leaf.local_shape), dtype_name(leaf.dtype), spans, whole, leaf.origin)
    if torch.is_tensor(leaf) and leaf.numel() > 1:
        return _Own()
    return _Value(leaf)


def gather_full(
    tree: dict[str, Any], sh: Shards, to_rank: int | None, *, cpu_offload: bool
) -> dict[str, Any]:
    """``tree`` with every ``FlatPieces`` whole, on ``to_rank`` (every rank with ``None``); collective.

    Ranks that are not a destination return ``{}``. Tensors are in host memory with
    ``cpu_offload``, else on the pieces' device. With tensor parallelism, ``to_rank`` is a rank of
    the data-parallel world of each tp slice (``None``: all of them): there each slice's tensors are
    whole, then :func:`_join_slices` joins the slices into the global tensors (on tp rank 0 of
    those ranks, or on all with ``None``).

    Raises:
        IncompatiblePlanError: the ranks' pieces of a tensor do not cover it (on every rank).
    """
    flat = _flatten(tree)
    group = sh.groups.shard
    mine, problem = None, None
    try:
        mine = {path: _describe(leaf) for path, leaf in flat.items()}
    except Exception as exc:  # before any tensor moves, on every rank
        problem = exc
    described = verdicts(problem, group, failed="could not describe its dict", facts=mine, error=ConfigError)
    dest = to_rank is None or sh.groups.rank == to_rank
    where = torch.device("cpu") if cpu_offload else sh.device
    merged: dict[Path, _Pieces | _Value | _Own] = {}
    for mine in described:
        for path, what in mine.items():
            merged.setdefault(path, what)
    _check_cover(described, merged)
    whole: dict[Path, torch.Tensor] = {}
    if dest:
        for path, what in merged.items():
            if isinstance(what, _Pieces):
                whole[path] = torch.empty(what.shape, dtype=torch_dtype(what.dtype), device=where)
    for q, theirs in enumerate(described):
        _receive(q, theirs, flat, whole, sh, dest)
    if not dest:
        return {}
    if sh.tensor_group is not None:
        placed = {path: what for path, what in merged.items() if isinstance(what, _Pieces) and what.origin}
        whole = _join_slices(whole, placed, sh, everywhere=to_rank is None, where=where)
        if whole is None:
            return {}
    out: dict[str, Any] = {}
    for path, what in merged.items():
        if isinstance(what, _Pieces):
            value = whole[path]
        elif isinstance(what, _Value):
            value = flat.get(path, what.value)
            value = value.to(where) if torch.is_tensor(value) and cpu_offload else value
        else:
            value = flat[path].detach().to(where)
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _check_cover(described: list[dict[Path, Any]], merged: dict[Path, Any]) -> None:
    """Every ``FlatPieces`` leaf is covered exactly by the shard group's ranges, and a larger plain
    tensor is held by every rank (the same checks on every rank, from the same descriptions)."""
    for path, what in merged.items():
        if isinstance(what, _Own) and not all(isinstance(mine.get(path), _Own) for mine in described):
            raise IncompatiblePlanError(
                f"{'/'.join(map(str, path))!r} is held whole by some ranks only (state a non-elementwise "
                "optimizer keeps per parameter): whole-tensor dicts of it are not gathered yet; use "
                "zeroplan.facade.checkpoint.save, or the sharded dict (full_state_dict=False)"
            )
        if not isinstance(what, _Pieces):
            continue
        held = sorted(
            span for mine in described if isinstance(mine.get(path), _Pieces) for span in mine[path].spans
        )
        covered = 0
        for start, stop in held:
            if start != covered:
                break
            covered = stop
        if covered != math.prod(what.shape):
            raise IncompatiblePlanError(
                f"the shard group's pieces of {'/'.join(map(str, path))!r} are {held}, which do not cover "
                f"its {math.prod(what.shape)} elements once: the ranks' dicts come from different optimizers"
            )


def _receive(
    q: int,
    theirs: dict[Path, Any],
    flat: dict[Path, Any],
    whole: dict[Path, torch.Tensor],
    sh: Shards,
    dest: bool,
) -> None:
    """Shard-group rank ``q`` broadcasts its pieces, one buffer per dtype; destinations place them."""
    by_dtype: dict[str, list[tuple[Path, Span]]] = {}
    for path, what in theirs.items():
        if isinstance(what, _Pieces):
            by_dtype.setdefault(what.dtype, []).extend((path, Span(a, b)) for a, b in what.spans)
    for name, ranges in by_dtype.items():
        total = sum(span.numel for _, span in ranges)
        if total == 0:
            continue
        if q == sh.groups.shard_rank:
            buf = torch.cat([flat[path].read(span) for path, span in ranges]).to(sh.device)
        else:
            buf = torch.empty(total, dtype=torch_dtype(name), device=sh.device)
        if sh.zp.topology.shard_size > 1:
            broadcast(buf, q, sh.groups.shard)
        if not dest:
            continue
        at = 0
        for path, span in ranges:
            whole[path].view(-1)[span.as_slice()].copy_(buf[at : at + span.numel])
            at += span.numel


def _join_slices(
    slices: dict[Path, torch.Tensor],
    placed: dict[Path, _Pieces],
    sh: Shards,
    *,
    everywhere: bool,
    where: torch.device,
) -> dict[Path, torch.Tensor] | None:
    """The tp slices' whole local tensors ``slices`` joined over the tp group: each ``placed`` one
    into its global tensor, at its origin; the others (replicas) as this rank holds them. Collective
    over ``sh.tensor_group``; ``None`` on ranks that are not a destination (tp rank 0 is, or every
    rank with ``everywhere``). Each tp rank in turn broadcasts its slices, one buffer per dtype.

    Raises:
        IncompatiblePlanError: the tp ranks' dicts name other tensors, or slices that do not tile
            their global tensors (on every rank).
    """
    group = sh.tensor_group
    mine = {path: (what.whole, what.origin, what.shape, what.dtype) for path, what in placed.items()}
    described = verdicts(None, group, failed="could not describe its tp slice", facts=mine, error=ConfigError)
    for theirs in described:
        if set(theirs) != set(mine) or any(t[0] != mine[p][0] for p, t in theirs.items()):
            raise IncompatiblePlanError(
                "the tp ranks' optimizer dicts name other tensors or global shapes: they come from "
                "different optimizers"
            )
    for path, (global_shape, *_) in mine.items():
        if sum(math.prod(theirs[path][2]) for theirs in described) != math.prod(global_shape):
            raise IncompatiblePlanError(
                f"the tp slices of {'/'.join(map(str, path))!r} do not tile its global shape {global_shape}"
            )
    dest = everywhere or sh.tensor_slice[0] == 0
    out = dict(slices)
    if dest:
        for path, (global_shape, _, _, dtype) in mine.items():
            out[path] = torch.empty(global_shape, dtype=torch_dtype(dtype), device=where)
    for q, theirs in enumerate(described):
        by_dtype: dict[str, list[Path]] = {}
        for path in sorted(theirs, key=str):
            by_dtype.setdefault(theirs[path][3], []).append(path)
        for name, paths in by_dtype.items():
            total = sum(math.prod(theirs[path][2]) for path in paths)
            if total == 0:
                continue
            if q == sh.tensor_slice[0]:
                buf = torch.cat([slices[path].reshape(-1) for path in paths]).to(sh.device)
            else:
                buf = torch.empty(total, dtype=torch_dtype(name), device=sh.device)
            broadcast(buf, q, group)
            if not dest:
                continue
            at = 0
            for path in paths:
                _, origin, shape, _ = theirs[path]
                n = math.prod(shape)
                box = tuple(slice(o, o + k) for o, k in zip(origin, shape, strict=True))
                out[path][box].copy_(buf[at : at + n].view(shape))
                at += n
    return out if dest else None


def broadcast_from_rank0(state_dict: dict[str, Any], sh: Shards) -> dict[str, Any]:
    """Rank 0's flat dict of whole tensors (and other values) on every rank; collective over the world.

    Rank 0 describes its entries, then broadcasts each tensor from where it is (its device must be the
    collectives' device or the host), one at a time.
    """
    world = sh.groups.world
    mine, problem = None, None
    if sh.groups.rank == 0:
        try:
            mine = {k: _whole_or_value(k, v) for k, v in state_dict.items()}
        except Exception as exc:  # rank 0's dict is every rank's: its error is every rank's
            problem = exc
    failed = "could not read the dict it broadcasts"
    described: dict[str, Any] = verdicts(problem, world, failed=failed, facts=mine, error=ConfigError)[0]
    out: dict[str, Any] = {}
    for key, what in described.items():
        if isinstance(what, _Value):
            out[key] = what.value
            continue
        if sh.groups.rank == 0:
            buf = state_dict[key].detach().to(sh.device).contiguous()
        else:
            buf = torch.empty(what.shape, dtype=torch_dtype(what.dtype), device=sh.device)
        if sh.groups.topology.world_size > 1:
            broadcast(buf, 0, world)
        out[key] = buf
    return out


def _whole_or_value(key: str, value: Any) -> _Whole | _Value:
    """How rank 0 sends one entry: a plain whole tensor's shape and dtype, or the value itself.

    Raises:
        ConfigError: a tensor subclass (pieces, a DTensor): not a whole tensor.
    """
    if not torch.is_tensor(value):
        return _Value(value)
    if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
        raise ConfigError(
            f"{key!r} is a {type(value).__name__}, not a whole tensor: broadcast_from_rank0 "
            "reads whole tensors (torch.load of a full dict)"
        )
    return _Whole(tuple(value.shape), dtype_name(value.dtype))
