"""A rank's optimizer state in shard coordinates, and moving it between plans.

[Note: shard state]
Per-element state of an elementwise optimizer (``exp_avg``, ``momentum_buffer``,
…) lives in per-window tensors of the inner optimizer; exported, it becomes one
flat tensor per (space, key) over the rank's shard, which a reshard plan can
cut and move like the master weights. Scalar state (``step``) is the same for
every window of a (param group, cohort) and travels as a small object. State of
non-elementwise optimizers is kept per whole parameter.

:func:`move_shards` rebuilds the state under a new plan on the same shard
group: each old rank broadcasts its shard of one tensor kind in turn and every
rank copies the pieces the reshard plan assigns it (memory: one shard at a
time). It serves ``refresh_trainable`` and ``add_param_group``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from zeroplan.core import BufferRole, ReshardPlan, Space, Span, ZeroPlan
from zeroplan.facade.mechanisms.assembly import Assembly
from zeroplan.facade.mechanisms.buffer_devices import device_for
from zeroplan.facade.mechanisms.collectives import all_gather_objects, broadcast
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype
from zeroplan.facade.params.buffers import SpaceBuffers
from zeroplan.facade.state.inner import Inner
from zeroplan.facade.state.tree import ShardState, is_per_element, tree_clone

__all__ = ["ShardState", "export_state", "import_state", "move_shards", "state_beside"]


def export_state(
    zp: ZeroPlan, inner: Inner, buffers: Sequence[SpaceBuffers], *, assemble: bool = True
) -> ShardState:
    """This rank's inner optimizer state, in shard coordinates.

    A flat tensor may alias the optimizer's own state (when one window covers
    the whole shard); callers that keep it past the next step must copy it.
    With ``assemble=False`` a flat tensor of several windows is an
    :class:`Assembly` of them, not yet copied ([Note: assembled file tensors]).
    """
    parts: dict[tuple[int, str], list[tuple[Span, torch.Tensor]]] = {}
    like: dict[tuple[int, str], torch.Tensor] = {}
    scalars: dict[tuple[int, int], dict[str, Any]] = {}
    whole: dict[int, dict[str, Any]] = {}
    for spec, tensor in zip(inner.specs, inner.tensors, strict=True):
        state = inner.optimizer.state.get(tensor)
        if not state:
            continue
        if not zp.elementwise:
            whole[spec.param] = dict(state)  # type: ignore[index]
            continue
        shared = scalars.setdefault((spec.group, spec.cohort), {})
        for key, value in state.items():
            if is_per_element(value, tensor):
                parts.setdefault((spec.space, key), []).append((spec.shard_span, value))
                like.setdefault((spec.space, key), value)
            else:
                shared[key] = value
    flat: dict[tuple[int, str], Any] = {}
    for (space, key), views in parts.items():
        owned, value = buffers[space].extent, like[space, key]
        if len(views) == 1 and views[0][0].numel == owned:  # one window is the whole shard: no copy
            flat[space, key] = value
        elif is_traceable_wrapper_subclass(value):  # low-bit state: assembled by its own copies
            flat[space, key] = value.new_zeros(owned)
            for span, view in views:
                flat[space, key][span.as_slice()] = view
        else:
            assembly = Assembly(owned, value.dtype, value.device, tuple(views))
            flat[space, key] = assembly.into() if assemble else assembly
    return ShardState(flat=flat, scalars=scalars, whole=whole)


def import_state(zp: ZeroPlan, inner: Inner, state: ShardState, stateful: set[tuple[int, int]]) -> None:
    """Install ``state`` (already in the new plan's shard coordinates) into ``inner``.

    Windows of a (group, cohort) absent from ``stateful`` get no state: the inner
    optimizer initialises them on its first step, as for new parameters.
    """
    for spec, tensor in zip(inner.specs, inner.tensors, strict=True):
        group = inner.optimizer.param_groups[spec.group]
        if not zp.elementwise:
            if spec.param in state.whole:
                inner.optimizer.state[tensor] = state_beside(state.whole[spec.param], tensor, group)
            continue
        if (spec.group, spec.cohort) not in stateful:
            continue
        entry: dict[str, Any] = {}
        for (space, key), value in state.flat.items():
            if space == spec.space:
                entry[key] = value[spec.shard_span.as_slice()]
        for key, value in state.scalars.get((spec.group, spec.cohort), {}).items():
            entry[key] = tree_clone(value)
        inner.optimizer.state[tensor] = state_beside(entry, tensor, group)


def state_beside(state: Any, tensor: torch.Tensor, group: Mapping[str, Any]) -> Any:
    """``state`` where the inner optimizer of ``group`` steps ``tensor`` (a master) with it.

    In host memory where the master is stepped there (CPU offload, [Note: offload, executed]):
    loaded or moved state may come from the parameters' device. Beside a master on the device (a
    partial offload's kept part, [Note: kept on the device], whose state comes from host memory),
    its per-element state moves there; its scalars too where the group is ``fused`` or
    ``capturable`` (their kernels read ``step`` on the device, as ``torch.optim``'s loading puts
    it), and stay where they are otherwise (torch keeps ``step`` on the host on purpose).
    """
    if tensor.device.type == "cpu":
        return optree.tree_map(lambda t: t.cpu() if torch.is_tensor(t) else t, state, none_is_leaf=True)
    scalars_too = bool(group.get("fused") or group.get("capturable"))

    def place(value: Any) -> Any:
        if torch.is_tensor(value) and (scalars_too or _shaped_like(value, tensor)):
            return value.to(tensor.device)
        return value

    return optree.tree_map(place, state, none_is_leaf=True)


def _shaped_like(value: Any, tensor: torch.Tensor) -> bool:
    """Whether ``value`` is per-element state of ``tensor`` (one element per element of it)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == tensor.numel()


def _extents(space: Space) -> list[int]:
    """Per shard rank, the length of its flat shard (its pieces, padding included)."""
    return [space.extent(q) for q in range(len(space.owned))]


def _move_flat(
    source: torch.Tensor | None,
    target: torch.Tensor,
    reshard: ReshardPlan,
    dtype_name: str,
    old_extents: Sequence[int],
    groups: ProcessGroups,
    device: torch.device,
) -> None:
    """Fill ``target`` (this rank's new shard) from every old rank's ``source`` shard; each shard
    travels on ``device`` (the collectives' device: shards in host memory beside a GPU, CPU offload,
    are copied there and back)."""
    n, s = groups.topology.shard_size, groups.shard_rank
    mine = [c for c in reshard.copies if c.dtype == dtype_name and c.dst_rank == s]
    for q in range(n):
        if n == 1:
            buf = source
        elif q == s:
            if source is None:
                buf = torch.zeros(old_extents[q], dtype=target.dtype, device=device)
            else:
                buf = source.to(device)
            if old_extents[q]:
                broadcast(buf, q, groups.shard)
        else:
            buf = torch.empty(old_extents[q], dtype=target.dtype, device=device)
            if old_extents[q]:
                broadcast(buf, q, groups.shard)
        for c in mine:
            if c.src_rank == q and c.dst_span.numel:
                target[c.dst_span.as_slice()] = buf[c.src_span.as_slice()]  # type: ignore[index]


def move_shards(
    *,
    old_zp: ZeroPlan,
    old_buffers: Sequence[SpaceBuffers],
    old_state: ShardState,
    new_zp: ZeroPlan,
    new_buffers: Sequence[SpaceBuffers],
    reshard: ReshardPlan,
    groups: ProcessGroups,
    device: torch.device,
) -> tuple[ShardState, set[tuple[int, int]]]:
    """Move master weights and optimizer state from the old plan to the new one.

    Collective over the shard group (on ``device``, the parameters'). Master weights of the parameters' own
    dtype hold the (replicated) parameters' values and need no move. Returns the state in the new shard
    coordinates, where the new plan keeps its optimizer state ([Note: residences]), and the (group,
    cohort) pairs that carry state.
    """
    home = device_for(new_zp, BufferRole.OPTIMIZER_STATE, device).device
    old_spaces = {s.dtype: s for s in old_zp.partition.spaces}
    for new in new_buffers:
        old_space = old_spaces.get(new.space.dtype)
        if not new.carries_master or old_space is None:
            continue  # parameters of the master dtype are their own master: nothing to move
        old = next(b for b in old_buffers if b.space.dtype == new.space.dtype)
        # Start from the new masters (the parameters' values, loaded at install): elements no
        # reshard copy writes belong to parameters new to the plan, whose masters are their values.
        target = new.master_values()
        _move_flat(old.master_values(), target, reshard, new.space.dtype, _extents(old_space), groups, device)
        new.write_master(target)

    meta = {
        "flat": {
            (old_zp.partition.spaces[space].dtype, key): str(t.dtype)
            for (space, key), t in old_state.flat.items()
        },
        "scalars": tree_clone(old_state.scalars, torch.device("cpu")),
    }
    everyone = all_gather_objects(meta, groups.shard)
    flat_kinds = sorted({kind for m in everyone for kind in m["flat"].items()})
    scalars: dict[tuple[int, int], dict[str, Any]] = {}
    for m in everyone:
        for key, value in m["scalars"].items():
            scalars.setdefault(key, tree_clone(value, home))
    flat: dict[tuple[int, str], torch.Tensor] = {}
    new_index = {b.space.dtype: i for i, b in enumerate(new_buffers)}
    for (dtype_name, key), state_dtype in flat_kinds:
        old_space = old_spaces[dtype_name]
        dtype = torch_dtype(state_dtype)
        source = old_state.flat.get((old_space.index, key))
        if dtype_name not in new_index:
            target = torch.empty(0, dtype=dtype, device=home)
        else:
            target = torch.zeros(new_buffers[new_index[dtype_name]].extent, dtype=dtype, device=home)
        _move_flat(source, target, reshard, dtype_name, _extents(old_space), groups, device)
        if dtype_name in new_index:
            flat[new_index[dtype_name], key] = target

    whole: dict[int, dict[str, Any]] = {}
    if not new_zp.elementwise:
        mine = {t.param for t in new_zp.inner_tensors(groups.shard_rank)}
        offered = all_gather_objects(tree_clone(old_state.whole, torch.device("cpu")), groups.shard)
        for part in offered:
            for p, st in part.items():
                if p in mine and new_zp.specs[p].trainable:
                    whole[p] = tree_clone(st, home)
    return ShardState(flat=flat, scalars=scalars, whole=whole), set(scalars) | {
        (new_zp.specs[p].group, new_zp.specs[p].cohort) for p in whole
    }
