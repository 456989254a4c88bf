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

[Note: consolidating tensor-parallel slices]
A tensor-parallel optimizer's ranks hold their tp slice's local tensors; a dict
of them under the global parameter ids would load silently into another slice
of the same local shape. So each slice is consolidated over its data-parallel
ranks as above, then the slices are joined over tp into the global tensors
(:func:`_join_slices`): the whole model's dict, on tp rank 0 of data-parallel
rank ``to_rank`` (every rank with ``None``), what ``interchange``'s
``full_state_dict=True`` gives and what ``load_state_dict`` cuts back to each
slice. Each tp rank in turn broadcasts its slice of one tensor in chunks of
``chunk_bytes``; a destination assembles it in host memory (one slice of one
tensor beyond the result) and copies it into its place. A non-elementwise
optimizer's state of a tp-split parameter is computed on the slice (factored
moments of the local tensor) and has no global form: refused. Pipeline stages
each consolidate their own parameters; the dict records the stage
(``"zeroplan_pipeline_stage"``) and :func:`check_consolidated` refuses it in
another stage, whose parameters may have the same ids and shapes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zeroplan.core import (
    ConfigError,
    IncompatiblePlanError,
    Space,
    Span,
    chunk_rows,
    tensor_split,
    windows_in,
)
from zeroplan.facade.mechanisms.agreement import first_differing, verdicts
from zeroplan.facade.mechanisms.collectives import HostStaging, all_gather_objects, broadcast
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype
from zeroplan.facade.state.dicts import MASTER_KEY, Shards, is_sharded, torch_param_groups
from zeroplan.facade.state.parked import gather_parked
from zeroplan.facade.state.tree import MASTER, TensorMeta, describe_state, tree_clone

__all__ = ["PIPELINE_STAGE_KEY", "check_consolidated", "consolidated_state_dict"]

#: Where a consolidated dict records ``[stage, stages]`` of the pipeline stage it holds.
PIPELINE_STAGE_KEY = "zeroplan_pipeline_stage"

_NOT_WHOLE = (
    "a dict of one tp slice's local tensors cannot say which slice it holds (consolidated_state_dict() "
    "of zeroplan before the slices were joined gave tp slice 0's); load a dict of whole tensors "
    "(consolidated_state_dict(), or interchange.get_optimizer_state_dict(..., "
    "options=StateDictOptions(full_state_dict=True))), or each slice's zeroplan.facade.checkpoint root"
)


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


def consolidated_state_dict(
    sh: Shards, to_rank: int | None, chunk_bytes: int, *, pipeline_stage: tuple[int, int] | None = None
) -> dict[str, Any] | None:
    """Gather a plain torch state dict on ``to_rank`` (all with ``None``): [Note: bounded consolidation].

    Collective over the shard group, and over tp with tensor parallelism ([Note: consolidating
    tensor-parallel slices]: the slices joined, on tp rank 0 of data-parallel rank ``to_rank``);
    ranks that are not a destination return ``None``. ``pipeline_stage`` (``(stage, stages)``) is
    recorded under ``"zeroplan_pipeline_stage"``.

    Raises:
        ConfigError: a bad argument, or a non-elementwise optimizer of tp-split parameters (on every
            rank, nothing gathered).
    """
    world = sh.zp.topology.world_size
    if to_rank is not None and not (type(to_rank) is int and 0 <= to_rank < world):
        raise ConfigError(f"to_rank must be None or a rank in 0..{world - 1}, got {to_rank!r}")
    if not (type(chunk_bytes) is int and chunk_bytes >= 1):
        raise ConfigError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    split = [s.name for s in sh.zp.specs if sh.tensor_slice[1] > 1 and tensor_split(s) is not None]
    if split and not sh.zp.elementwise:
        raise ConfigError(
            f"consolidated_state_dict(): {sh.optimizer_name} is not elementwise, and its state of the "
            f"tp-split parameters {split[:3]} is computed on each tp slice, with no global form: save "
            "with zeroplan.facade.checkpoint.save (each slice's root) or the sharded state_dict()"
        )
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
    if pipeline_stage is not None:
        state_dict[PIPELINE_STAGE_KEY] = list(pipeline_stage)
    if sh.tensor_group is not None and split:
        return _join_slices(state_dict, sh, everywhere=to_rank is None, chunk_bytes=chunk_bytes)
    return state_dict


def _join_slices(
    state_dict: dict[str, Any], sh: Shards, *, everywhere: bool, chunk_bytes: int
) -> dict[str, Any] | None:
    """``state_dict``'s tp slices joined into global tensors ([Note: consolidating tensor-parallel
    slices]); collective over ``sh.tensor_group``, ``None`` on ranks that are not a destination (tp
    rank 0, or every tp rank with ``everywhere``).

    Raises:
        IncompatiblePlanError: the tp ranks consolidated other tensors (on every tp rank).
    """
    mine, degree = sh.tensor_slice
    placed: list[tuple[dict[Any, Any], Any, int, tuple[int, ...], int]] = []  # holder, key, id, shape, dim
    holders = [(entry, key, p) for p, entry in state_dict["state"].items() for key in entry]
    holders += [(state_dict[MASTER_KEY], p, p) for p in state_dict.get(MASTER_KEY, {})]
    for holder, key, p in holders:
        spec, d = sh.zp.specs[p], tensor_split(sh.zp.specs[p])
        if torch.is_tensor(holder[key]) and holder[key].dim() and d is not None and spec.global_shape:
            placed.append((holder, key, p, tuple(spec.global_shape), d))
    described = [(p, str(key), str(holder[key].dtype)) for holder, key, p, _, _ in placed]
    rows = verdicts(None, sh.tensor_group, failed="could not describe its tp slice", facts=described)
    if (rank := first_differing(rows)) is not None:
        raise IncompatiblePlanError(
            f"tp rank {rank} consolidated other tensors than tp rank 0: the tp ranks' optimizers differ"
        )
    dest = everywhere or mine == 0
    home = torch.device("cpu")
    staging = HostStaging(sh.device)
    for holder, key, _, whole, d in placed:
        local: torch.Tensor = holder[key]
        out = torch.empty(whole, dtype=local.dtype, device=home) if dest else None
        step = max(1, chunk_bytes // local.element_size())
        for q in range(degree):
            rows_q = chunk_rows(whole[d], q, degree)
            shape = (*whole[:d], rows_q.numel, *whole[d + 1 :])
            piece = local if q == mine or not dest else torch.empty(shape, dtype=local.dtype, device=home)
            for at in Span(0, math.prod(shape)).chunks(step):
                if q == mine:
                    chunk = local.view(-1)[at.as_slice()].to(sh.device, copy=True)
                else:
                    chunk = torch.empty(at.numel, dtype=local.dtype, device=sh.device)
                broadcast(chunk, q, sh.tensor_group)
                if dest and q != mine:
                    piece.view(-1)[at.as_slice()] = staging.to_host(chunk)
            if out is not None:
                out.narrow(d, rows_q.start, rows_q.numel).copy_(piece)
        holder[key] = out  # the slice's tensor is freed as its global one is made
    return state_dict if dest else None


def check_consolidated(state_dict: Any, sh: Shards, pipeline_stage: tuple[int, int] | None) -> None:
    """Refuse a plain dict that holds another pipeline stage's state, or one tp slice's local tensors
    of tp-split parameters ([Note: consolidating tensor-parallel slices]); local, changes nothing.

    Anything else passes (a malformed dict is for ``load_state_dict``'s own checks to name).

    Raises:
        IncompatiblePlanError: what the dict holds and what to load instead.
    """
    if not isinstance(state_dict, dict) or is_sharded(state_dict):
        return
    saved = state_dict.get(PIPELINE_STAGE_KEY)
    if saved is not None and pipeline_stage is not None and tuple(saved) != pipeline_stage:
        raise IncompatiblePlanError(
            f"the consolidated dict holds pipeline stage {saved[0]} of {saved[1]}, this optimizer steps "
            f"stage {pipeline_stage[0]} of {pipeline_stage[1]}: load each stage's own dict into its "
            "optimizer (consolidate and save one per stage)"
        )
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if sh.tensor_slice[1] == 1 or not isinstance(groups, list) or not isinstance(state, dict):
        return
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return
    position = {saved_id: i for i, saved_id in enumerate(i for g in groups for i in g["params"])}
    entries = [(k, key, v) for k, e in state.items() if isinstance(e, dict) for key, v in e.items()]
    masters = state_dict.get(MASTER_KEY)
    entries += [(k, "master", v) for k, v in masters.items()] if isinstance(masters, dict) else []
    for saved_id, key, value in entries:
        index = position.get(saved_id)
        if index is None or index >= len(sh.zp.specs) or type(value) is not torch.Tensor or not value.dim():
            continue
        spec = sh.zp.specs[index]
        if tensor_split(spec) is None or spec.global_shape is None:
            continue
        shape, whole, local = tuple(value.shape), tuple(spec.global_shape), tuple(spec.shape)
        if shape != whole and (shape == local or sh.zp.elementwise or key == "master"):
            raise IncompatiblePlanError(
                f"state {key!r} of parameter {index} ({spec.name}) has shape {shape}, not the global "
                f"shape {whole} of this tensor-parallel parameter (tp slice {sh.tensor_slice[0]} of "
                f"{sh.tensor_slice[1]} holds {local}): {_NOT_WHOLE}"
            )


def _tensor_of(sh: Shards, param: int) -> torch.Tensor:
    for spec, tensor in zip(sh.inner.specs, sh.inner.tensors, strict=True):
        if spec.param == param:
            return tensor
    raise KeyError(param)
