"""``consolidated_state_dict``: a plain ``torch.optim`` state dict gathered in bounded chunks.

[Note: bounded consolidation]
Each owner broadcasts its shard of one state tensor in chunks of at most
``chunk_bytes`` (assembled on the fly from its per-window state tensors, never
as a whole-shard copy), and the destination copies every chunk straight into
the parameter-shaped output tensors. Beyond the output itself, no rank holds
more than one chunk, so the extra memory is set by ``chunk_bytes`` and not by
the model. Scalar state and shapes travel as small objects first.

The output is on the CPU whatever the parameters' device: with AdamW it holds
12 bytes per parameter (fp32 master, two moments), 84 GB for a 7B model, which
no GPU beside the model could take. Chunks travel on the parameters' device (NCCL
carries no CPU tensor) and each is copied to the host once, through one pinned
staging chunk, before it is scattered into the outputs.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroplan.core import ConfigError, Space, Span, windows_in
from zeroplan.facade.mechanisms.collectives import HostStaging, all_gather_objects, broadcast
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype
from zeroplan.facade.state.dicts import MASTER_KEY, Shards, torch_param_groups
from zeroplan.facade.state.parked import gather_parked
from zeroplan.facade.state.tree import MASTER, TensorMeta, describe_state, tree_clone

__all__ = ["consolidated_state_dict"]


def _broadcast(buf: torch.Tensor, owner: int, sh: Shards) -> None:
    if sh.zp.topology.shard_size > 1 and buf.numel():
        broadcast(buf, owner, sh.groups.shard)


def _window_chunk(sh: Shards, space: int, key: str | None, chunk: Span, out: torch.Tensor) -> None:
    """Fill ``out`` with elements ``chunk`` of this rank's shard of ``key`` (``None``: master)."""
    if key is None:
        out.copy_(sh.buffers[space].read_master(chunk))
        return
    for part in windows_in(sh.inner.specs, space, chunk):
        entry = sh.inner.optimizer.state.get(sh.inner.tensors[part.tensor])
        if not entry or key not in entry:  # a window that starts fresh: nobody reads these elements
            out[part.chunk_span.as_slice()] = 0
            continue
        out[part.chunk_span.as_slice()] = entry[key][part.window_span.as_slice()]


def _scatter_chunk(
    chunk: torch.Tensor, at: Span, space: Space, owner: int, outputs: dict[int, torch.Tensor]
) -> None:
    """Copy chunk ``at`` of ``owner``'s shard into the parameter-shaped outputs."""
    for part in space.fragments_in(owner, at):
        if part.param in outputs:
            outputs[part.param].view(-1)[part.param_span.as_slice()] = chunk[part.chunk_span.as_slice()]


def consolidated_state_dict(sh: Shards, to_rank: int | None, chunk_bytes: int) -> dict[str, Any] | None:
    """Gather a plain torch state dict on ``to_rank`` (all with ``None``): [Note: bounded consolidation].

    Collective over the shard group; ranks that are not a destination return ``None``.
    """
    world = sh.zp.topology.world_size
    if to_rank is not None and not (type(to_rank) is int and 0 <= to_rank < world):
        raise ConfigError(f"to_rank must be None or a rank in 0..{world - 1}, got {to_rank!r}")
    if not (type(chunk_bytes) is int and chunk_bytes >= 1):
        raise ConfigError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    dest = to_rank is None or sh.groups.rank == to_rank
    zp, shard_rank = sh.zp, sh.groups.shard_rank
    # Every rank's state leaves, described ([Note: state codec]): which per-element keys and dtypes
    # exist per space, the scalar state per cohort, who holds which whole-parameter state.
    everyone = all_gather_objects(describe_state(zp, sh.inner, shard_rank), sh.groups.shard)
    keys: dict[int, list[tuple[str, str]]] = {}
    scalars: dict[tuple[int, int], dict[str, Any]] = {}
    order: dict[tuple[int, int], list[str]] = {}
    whole: dict[int, tuple[int, dict[str, Any]]] = {}
    space_of = {space.dtype: space.index for space in zp.partition.spaces}
    for q, described in enumerate(everyone):
        for leaf_path, leaf in described.leaves.items():
            kind, first, rest = leaf_path.split("/", 2)
            if kind == "flat":
                pair = (rest, leaf.dtype)
                if pair not in keys.setdefault(space_of[first], []):
                    keys[space_of[first]].append(pair)
            elif kind == "scalars":
                scalars.setdefault((int(first), int(rest)), leaf)
            else:
                whole.setdefault(int(first), (q, {}))[1][rest] = leaf
        for cohort, names in described.order.items():
            order.setdefault(cohort, names)
    stateful = set(order)
    device = sh.device  # where chunks travel
    home = torch.device("cpu")  # where the result is built
    staging = HostStaging(device)
    result: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}

    for space in zp.partition.spaces:
        buf = sh.buffers[space.index]
        members = [p for p in space.params if (zp.specs[p].group, zp.specs[p].cohort) in stateful]
        kinds: list[tuple[str | None, str]] = [(k, d) for k, d in keys.get(space.index, [])]
        if buf.carries_master:
            kinds.insert(0, (None, str(buf.master_dtype)))
        for key, dtype_name in kinds:
            dtype = torch_dtype(dtype_name)
            wanted = space.params if key is None else members
            outputs = (
                {p: torch.empty(zp.specs[p].shape, dtype=dtype, device=home) for p in wanted} if dest else {}
            )
            step = max(1, chunk_bytes // torch.empty((), dtype=dtype).element_size())
            for q in range(zp.topology.shard_size):
                for at in Span(0, space.extent(q)).chunks(step):
                    chunk = torch.empty(at.numel, dtype=dtype, device=device)
                    if q == shard_rank:
                        _window_chunk(sh, space.index, key, at, chunk)
                    _broadcast(chunk, q, sh)
                    if dest:
                        _scatter_chunk(staging.to_host(chunk), at, space, q, outputs)
                    del chunk
            if dest and key is None:
                masters.update(outputs)
            elif dest:
                for p, tensor in outputs.items():
                    result.setdefault(p, {})[key] = tensor

    for p in sorted(whole):
        owner, entry = whole[p]
        owned_state = sh.inner.optimizer.state.get(_tensor_of(sh, p)) if owner == shard_rank else None
        for key, described in entry.items():
            if not isinstance(described, TensorMeta):
                if dest:
                    result.setdefault(p, {})[key] = described
                continue
            shape, dtype = described.shape, torch_dtype(described.dtype)
            out = torch.empty(shape, dtype=dtype, device=home) if dest else None
            flat = out.view(-1) if out is not None else None
            numel = int(torch.Size(shape).numel())
            step = max(1, chunk_bytes // torch.empty((), dtype=dtype).element_size())
            for at in Span(0, numel).chunks(step):
                chunk = torch.empty(at.numel, dtype=dtype, device=device)
                if owned_state is not None:
                    chunk.copy_(owned_state[key].reshape(-1)[at.as_slice()])
                _broadcast(chunk, owner, sh)
                if flat is not None:
                    flat[at.as_slice()] = staging.to_host(chunk)
            if dest:
                result.setdefault(p, {})[key] = out
    # Parked state of frozen parameters ([Note: parked state]) comes whole, not in bounded chunks.
    frozen = frozenset(range(len(zp.specs))) - zp.trainable_indices
    parked = gather_parked(sh.parked, frozen, sh.groups)
    if not dest:
        return None
    for p, part in parked.items():
        entry = result[p] = tree_clone(part.scalars, home) | tree_clone(part.whole or {}, home)
        for key, pieces in part.pieces.items():
            full = torch.empty(zp.specs[p].shape, dtype=pieces[0][1].dtype, device=home)
            for span, values in pieces:
                full.view(-1)[span.as_slice()] = values.to(home)
            if key == MASTER:
                masters[p] = full
            else:
                entry[key] = full
    for p in list(result):
        if p in parked:
            continue
        spec = zp.specs[p]
        cohort = (spec.group, spec.cohort)
        entry = result[p]
        entry.update(tree_clone(scalars.get(cohort, {}), home))
        names = order.get(cohort)
        if names:
            result[p] = {k: entry[k] for k in names if k in entry} | {
                k: v for k, v in entry.items() if k not in names
            }
    state_dict: dict[str, Any] = {
        "state": {p: result[p] for p in sorted(result)},
        "param_groups": torch_param_groups(sh.param_groups),
    }
    if masters:
        state_dict[MASTER_KEY] = {p: masters[p] for p in sorted(masters)}
    return state_dict


def _tensor_of(sh: Shards, param: int) -> torch.Tensor:
    for spec, tensor in zip(sh.inner.specs, sh.inner.tensors, strict=True):
        if spec.param == param:
            return tensor
    raise KeyError(param)
