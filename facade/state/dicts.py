"""State dicts of a ``ZeroOptimizer``: the rank-local sharded form and plain ``torch.optim`` dicts.

[Note: state dict forms]
* **Sharded** (``state_dict()``): this rank's fp32 master fragments and inner
  optimizer state in shard coordinates (``"zeroplan_state"``), the scaler state,
  the hyper-parameters and the plan fingerprint. It loads back only on the same
  plan (same world, shard size, strategy and parameters) and restores training
  bit for bit. Its ``"state"`` holds the same values in torch's layout, pieces
  per parameter ([Note: torch layout of shard state] in ``state.torch_view``):
  what torch's ``get_optimizer_state_dict`` and DCP read, and what loads back
  through ``set_optimizer_state_dict`` once DCP filled it.
* **Plain** (what ``torch.optim.AdamW().state_dict()`` returns, or
  ``consolidated_state_dict()``): integer parameter ids, per-parameter state
  shaped like the parameter, ``param_groups``. Every rank slices the fragments
  it owns out of it; ZeroOptimizer's consolidated dicts add the fp32 masters
  under ``"zeroplan_master"`` so no precision is lost on the way round.

Loading validates everything first and copies only then, so a rejected dict
leaves the optimizer exactly as it was. A plain dict's state is read as
``torch.optim.Optimizer.load_state_dict`` reads it ([Note: loaded state as
kept]); an entry whose ``step`` is 0 is a parameter that never stepped and
loads as no state ([Note: fresh entries] in ``state.torch_view``).

[Note: loaded state as kept]
``torch.optim`` casts a parameter's floating state to the parameter's dtype on
load (not ``step``) and makes a Python-number ``step`` (torch before 1.12) a
scalar tensor. The inner optimizer's parameters are the fp32 masters, so a
bf16 run's dict (bf16 moments) loads as fp32 moments: kept in the dict's dtype,
the step would fail beside the masters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zeroplan.core import (
    ConfigError,
    IncompatiblePlanError,
    Span,
    ZeroPlan,
    chunk_rows,
    master_dtype,
    tensor_split,
)
from zeroplan.facade.mechanisms.flat_pieces import FlatPieces, flat_values
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype
from zeroplan.facade.state.parts import Shards
from zeroplan.facade.state.shards import export_state
from zeroplan.facade.state.torch_view import torch_state
from zeroplan.facade.state.tree import (
    MASTER,
    ParkedParam,
    ShardState,
    decode_state,
    encode_parked,
    encode_state,
    tree_clone,
)

__all__ = [
    "SHARDED_FORMAT",
    "Shards",
    "check_plain",
    "cohorts_of_plain",
    "current_masters",
    "params_follow_masters",
    "named_scalars",
    "with_scalars",
    "holds_pieces",
    "tensor_slices",
    "torch_param_groups",
    "is_sharded",
    "shard_state_from_plain",
    "parked_from_plain",
    "sharded_state_dict",
    "shard_state_from_sharded",
]

SHARDED_FORMAT = "zeroplan.sharded/v3"
#: Sharded formats this version reads (v2 kept the shard state under ``"state"``).
_READS = ("zeroplan.sharded/v2", SHARDED_FORMAT)
MASTER_KEY = "zeroplan_master"


def torch_param_groups(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Groups without their tensors, ``params`` as the integer ids torch uses."""
    out, start = [], 0
    for group in param_groups:
        count = len(group["params"])
        out.append(
            {
                **{k: v for k, v in group.items() if k not in ("params", "process_group")},
                "params": list(range(start, start + count)),
            }
        )
        start += count
    return out


def is_sharded(state_dict: dict[str, Any]) -> bool:
    """Whether ``state_dict`` is the sharded form, of any version (else it must be a plain torch dict)."""
    return str(state_dict.get("format", "")).startswith(SHARDED_FORMAT.split("/")[0] + "/")


def sharded_state_dict(sh: Shards) -> dict[str, Any]:
    """This rank's sharded state dict (see [Note: state dict forms]); tensors are copies.

    ``"state"`` is torch's layout of the same copies ([Note: torch layout of shard state]), what
    ``torch.distributed.checkpoint`` reads; loading the dict itself reads ``"zeroplan_state"``.
    """
    state = tree_clone(export_state(sh.zp, sh.inner, sh.buffers))
    parked = tree_clone(sh.parked)
    return {
        "format": SHARDED_FORMAT,
        "fingerprint": sh.zp.fingerprint(),
        "world_size": sh.zp.topology.world_size,
        "shard_size": sh.zp.topology.shard_size,
        "shard_rank": sh.groups.shard_rank,
        "optimizer": sh.optimizer_name,
        "scaler": None if sh.scaler is None else sh.scaler.as_dict(),
        "param_groups": torch_param_groups(sh.param_groups),
        "cohorts": [s.cohort for s in sh.zp.specs],
        "master": current_masters(sh),
        "zeroplan_state": encode_state(state, sh.zp.partition.spaces),  # [Note: state codec]
        "parked": encode_parked(parked),  # [Note: parked state]
        "state": torch_state(sh, state, parked),
    }


def shard_state_from_sharded(
    state_dict: dict[str, Any], sh: Shards
) -> tuple[ShardState, set[tuple[int, int]], dict[str, torch.Tensor]]:
    """Validate a sharded dict against this optimizer; return its state, stateful cohorts and masters.

    Raises:
        IncompatiblePlanError: it was saved under another plan, rank or optimizer class.
    """
    zp = sh.zp
    if state_dict["format"] not in _READS:
        raise IncompatiblePlanError(
            f"sharded state dict of format {state_dict['format']!r}, this version reads {_READS}"
        )
    if state_dict.get("optimizer") != sh.optimizer_name:
        raise IncompatiblePlanError(
            f"state dict is of optimizer {state_dict.get('optimizer')!r}, this one runs {sh.optimizer_name!r}"
        )
    if state_dict.get("fingerprint") != zp.fingerprint():
        saved = (state_dict.get("world_size"), state_dict.get("shard_size"))
        here = (zp.topology.world_size, zp.topology.shard_size)
        detail = (
            f"saved at world/shard {saved}, running {here}" if saved != here else "same sizes, other plan"
        )
        raise IncompatiblePlanError(
            f"sharded state dict belongs to another plan ({detail}: parameters, strategy, stage or bucket "
            "settings differ); load a consolidated_state_dict() or use zeroplan.facade.checkpoint to change "
            "topology"
        )
    if state_dict.get("shard_rank") != sh.groups.shard_rank:
        raise IncompatiblePlanError(
            f"sharded state dict is of shard rank {state_dict.get('shard_rank')}, this is shard rank "
            f"{sh.groups.shard_rank}: load each rank's own state dict"
        )
    encoded = state_dict["zeroplan_state" if state_dict["format"] == SHARDED_FORMAT else "state"]
    state = decode_state(encoded, zp.partition.spaces)
    for (space, key), tensor in state.flat.items():
        expected = sh.buffers[space].extent
        if tensor.shape != (expected,):
            raise IncompatiblePlanError(
                f"state {key!r} has shape {tuple(tensor.shape)}, expected ({expected},)"
            )
    return state, set(state.scalars), state_dict["master"]


def check_plain(state_dict: dict[str, Any], sh: Shards) -> None:
    """Validate a plain torch optimizer dict against this optimizer's parameters.

    Raises:
        IncompatiblePlanError: group or parameter counts, state shapes or the
            masters do not match (the message names the parameter and key).
    """
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ConfigError(
            "expected a ZeroOptimizer.state_dict() or a torch.optim state dict "
            "with 'state' and 'param_groups'"
        )
    saved = state_dict["param_groups"]
    if len(saved) != len(sh.param_groups):
        raise IncompatiblePlanError(
            f"state dict has {len(saved)} param groups, the optimizer has {len(sh.param_groups)}"
        )
    for g, (a, b) in enumerate(zip(saved, sh.param_groups, strict=True)):
        if len(a["params"]) != len(b["params"]):
            raise IncompatiblePlanError(
                f"param group {g} has {len(a['params'])} parameters in the state dict, "
                f"{len(b['params'])} in the optimizer"
            )
    position = _positions(saved)
    for saved_id, entry in state_dict["state"].items():
        if saved_id not in position:
            raise IncompatiblePlanError(f"state for parameter id {saved_id!r}, which no param group lists")
        param = sh.params[position[saved_id]]
        for key, value in entry.items():
            if not _per_element(value) or not sh.zp.elementwise:
                continue  # scalars (a Python-number step); whole-parameter optimizers keep any shapes
            shape = value.local_shape if isinstance(value, FlatPieces) else value.shape  # a tp slice's
            if shape != param.shape:
                raise IncompatiblePlanError(
                    f"state {key!r} of parameter {position[saved_id]} has shape {tuple(value.shape)}, the "
                    f"parameter has {tuple(param.shape)}: a state dict of another model?"
                )
    for saved_id, master in state_dict.get(MASTER_KEY, {}).items():
        param = sh.params[position[saved_id]]
        if master.shape != param.shape:
            raise IncompatiblePlanError(
                f"master of parameter {position[saved_id]} has shape {tuple(master.shape)}"
            )


def tensor_slices(state_dict: dict[str, Any], sh: Shards) -> dict[str, Any]:
    """A plain dict whose whole tensors of tp-split parameters (global shape: a whole-tensor dict,
    torch's ``full_state_dict``) are cut to this rank's tp slice, as views; anything else as it is
    ([Note: tensor-parallel parameters] in ``zeroplan.core.tensor_parallel``). The caller's dict is not
    changed."""
    if sh.tensor_slice[1] == 1 or is_sharded(state_dict) or not isinstance(state_dict.get("state"), dict):
        return state_dict
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
        return state_dict  # check_plain says what is wrong
    position = _positions(groups)

    def cut(saved_id: Any, value: Any) -> Any:
        index = position.get(saved_id)
        if (
            index is None
            or index >= len(sh.zp.specs)
            or not _per_element(value)
            or isinstance(value, FlatPieces)
        ):
            return value
        spec = sh.zp.specs[index]
        d = tensor_split(spec)
        if d is None or spec.global_shape is None or tuple(value.shape) != tuple(spec.global_shape):
            return value
        rows = chunk_rows(spec.global_shape[d], *sh.tensor_slice)
        return value.narrow(d, rows.start, rows.numel)

    state = {
        k: {n: cut(k, v) for n, v in entry.items()} if isinstance(entry, dict) else entry
        for k, entry in state_dict["state"].items()
    }
    out = {**state_dict, "state": state}
    if isinstance(state_dict.get(MASTER_KEY), dict):
        out[MASTER_KEY] = {k: cut(k, v) for k, v in state_dict[MASTER_KEY].items()}
    return out


def _positions(param_groups: Sequence[dict[str, Any]]) -> dict[Any, int]:
    """Each saved parameter id's position: its index in the groups' ``params``, in order."""
    return {saved_id: i for i, saved_id in enumerate(i for group in param_groups for i in group["params"])}


def _by_position(state_dict: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], dict[int, torch.Tensor]]:
    """Per position, the dict's state (fresh entries left out: those parameters start fresh) and masters."""
    position = _positions(state_dict["param_groups"])
    state = {position[k]: v for k, v in state_dict["state"].items() if not _is_fresh(v)}
    masters = {position[k]: v for k, v in state_dict.get(MASTER_KEY, {}).items()}
    return state, masters


def holds_pieces(state_dict: dict[str, Any]) -> bool:
    """Whether a torch-layout dict holds this rank's pieces (``state_dict()["state"]``, filled by DCP)
    rather than whole tensors."""
    return any(isinstance(v, FlatPieces) for entry in state_dict["state"].values() for v in entry.values())


def named_scalars(state_dict: Any) -> dict[Any, dict[str, Any]]:
    """Per parameter id, the scalar state this rank's dict names (none for sharded dicts).

    Raises:
        ConfigError: not a state dict.
    """
    if not isinstance(state_dict, dict):
        raise ConfigError(f"expected a state dict, got {type(state_dict).__name__}")
    if is_sharded(state_dict) or not isinstance(state_dict.get("state"), dict):
        return {}
    return {
        k: {n: v.cpu() if torch.is_tensor(v) else v for n, v in entry.items() if not _per_element(v)}
        for k, entry in state_dict["state"].items()
        if isinstance(entry, dict) and any(not _per_element(v) for v in entry.values())
    }


def with_scalars(state_dict: dict[str, Any], named: Sequence[dict[Any, dict[str, Any]]]) -> dict[str, Any]:
    """``state_dict`` with the scalars other ranks named for parameters this rank holds none of.

    A piece dict names a parameter's scalars (``step``) only on the ranks that
    hold some of it ([Note: torch layout of shard state]); every rank needs them
    to agree on the cohorts. The caller's dict is not changed.
    """
    if is_sharded(state_dict) or not isinstance(state_dict.get("state"), dict):
        return state_dict
    state = dict(state_dict["state"])
    for k, entry in state.items():
        if isinstance(entry, dict) and not any(not _per_element(v) for v in entry.values()):
            known = next((rank[k] for rank in named if k in rank), None)
            if known is not None:
                state[k] = {**tree_clone(known), **entry}
    return {**state_dict, "state": state}


def _is_fresh(entry: Any) -> bool:
    """Whether a torch-layout entry is the state of a parameter that never stepped: ``step`` 0 (every
    torch optimizer with a ``step`` counts it up before its first update), [Note: fresh entries] in
    ``state.torch_view``."""
    step = entry.get("step") if isinstance(entry, dict) else None
    counted = (torch.is_tensor(step) and step.numel() == 1) or isinstance(step, int | float)
    return counted and float(step) == 0


def _kept_dtype(value: Any, dtype: torch.dtype) -> torch.dtype:
    """The dtype a loaded per-element value is kept in: floating state in ``dtype``, the state's
    (the master's), anything else in its own ([Note: loaded state as kept])."""
    return dtype if value.dtype.is_floating_point else value.dtype


def _kept_scalar(key: str, value: Any) -> Any:
    """A loaded scalar as torch keeps it: a Python-number ``step`` as a scalar tensor, as torch's
    optimizers' ``__setstate__`` makes it ([Note: loaded state as kept])."""
    if key == "step" and isinstance(value, int | float) and not isinstance(value, bool):
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return torch.tensor(float(value), dtype=scalar)
    return value


def _kept_entry(entry: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """A whole parameter's loaded entry as kept: plain floating tensors of any shape in ``dtype``
    (torch casts them all but ``step``), scalars by :func:`_kept_scalar`."""

    def kept(key: str, value: Any) -> Any:
        if type(value) is torch.Tensor and value.dim() > 0:
            return value.to(_kept_dtype(value, dtype))
        return _kept_scalar(key, value)

    return {key: kept(key, value) for key, value in entry.items()}


def _per_element(value: Any) -> bool:
    """Whether a torch-layout state value is per element (a tensor shaped like its parameter)."""
    return torch.is_tensor(value) and value.dim() > 0


def current_masters(sh: Shards) -> dict[str, torch.Tensor]:
    """Copies of this rank's fp32 masters, per dtype space that keeps them."""
    return {b.space.dtype: b.master_values() for b in sh.buffers if b.carries_master}


def params_follow_masters(sh: Shards) -> bool:
    """Whether this rank's shard of every low-precision parameter is still its masters' cast: nothing
    wrote the parameters since the last step or model load, so the masters hold their values with more
    precision (a whole-tensor optimizer dict then keeps them)."""
    for b in sh.buffers:
        if b.carries_master:
            values = b.shard_values()
            if not torch.equal(b.read_master(Span(0, b.extent)).to(values.dtype), values):
                return False
    return True


def cohorts_of_plain(state_dict: dict[str, Any], zp: ZeroPlan) -> list[int]:
    """Cohorts that give every elementwise window one value of each scalar state (e.g. ``step``).

    Parameters of a group with equal scalar states share a cohort; parameters
    without state get one of their own (they start fresh).
    """
    state, _ = _by_position(state_dict)
    labels: dict[tuple[Any, ...], int] = {}
    cohorts = []
    for spec in zp.specs:
        entry = state.get(spec.index)
        if entry is None:
            key: tuple[Any, ...] = (spec.group, "fresh")
        else:
            scalars = tuple(
                sorted(
                    (k, float(v) if torch.is_tensor(v) else v)
                    for k, v in entry.items()
                    if not _per_element(v)
                )
            )
            key = (spec.group, scalars)
        cohorts.append(labels.setdefault(key, len(labels)))
    return cohorts


def shard_state_from_plain(
    state_dict: dict[str, Any], target: ZeroPlan, sh: Shards
) -> tuple[ShardState, set[tuple[int, int]], dict[str, torch.Tensor]]:
    """This rank's share of a validated plain dict, in ``target``'s shard coordinates.

    ``target`` is this optimizer's plan, possibly with other cohorts
    (:func:`cohorts_of_plain`); it need not be installed yet.
    """
    state, masters = _by_position(state_dict)
    shard_rank = sh.groups.shard_rank
    device = sh.device
    flat: dict[tuple[int, str], torch.Tensor] = {}
    scalars: dict[tuple[int, int], dict[str, Any]] = {}
    whole: dict[int, dict[str, Any]] = {}
    master_out: dict[str, torch.Tensor] = {}
    for space in target.partition.spaces:
        owned = space.extent(shard_rank)
        frags = space.by_rank[shard_rank]
        master = master_dtype(space.dtype)
        if master != space.dtype and any(f.param in masters for f in frags):
            out = torch.zeros(owned, dtype=torch_dtype(master), device=device)
            for f in frags:
                source = masters.get(f.param)
                values = source if source is not None else sh.params[f.param].detach()
                out[f.shard_span.as_slice()] = flat_values(values, f.param_span).to(out.dtype)
            master_out[space.dtype] = out
        for f in frags:
            spec = target.specs[f.param]
            entry = state.get(f.param)
            if entry is None:
                continue
            if not target.elementwise:
                whole[f.param] = tree_clone(_kept_entry(entry, torch_dtype(master)), device)
                continue
            shared = scalars.setdefault((spec.group, spec.cohort), {})
            for key, value in entry.items():
                if _per_element(value):
                    out = flat.get((space.index, key))
                    if out is None:
                        dtype = _kept_dtype(value, torch_dtype(master))  # [Note: loaded state as kept]
                        out = flat[space.index, key] = torch.zeros(owned, dtype=dtype, device=device)
                    out[f.shard_span.as_slice()] = flat_values(value, f.param_span).to(device, out.dtype)
                else:
                    shared[key] = tree_clone(_kept_scalar(key, value), device)
    stateful = {(target.specs[p].group, target.specs[p].cohort) for p in state}
    return ShardState(flat=flat, scalars=scalars, whole=whole), stateful, master_out


def parked_from_plain(state_dict: dict[str, Any], target: ZeroPlan, sh: Shards) -> dict[int, ParkedParam]:
    """This rank's parked share of the state a plain dict holds for parameters frozen here.

    Each such parameter is parked whole on shard rank ``index % shard_size``
    (see [Note: parked state]): it is exchanged when it is unfrozen.
    """
    state, masters = _by_position(state_dict)
    shard_size, shard_rank = target.topology.shard_size, sh.groups.shard_rank
    device = sh.device
    parked: dict[int, ParkedParam] = {}
    for p, entry in state.items():
        if target.specs[p].trainable or p % shard_size != shard_rank:
            continue
        kept = torch_dtype(master_dtype(target.specs[p].dtype))  # [Note: loaded state as kept]
        if not target.elementwise:
            parked[p] = ParkedParam(scalars={}, pieces={}, whole=tree_clone(_kept_entry(entry, kept), device))
            continue
        whole = Span(0, target.specs[p].numel)
        pieces = {
            key: [(whole, flat_values(value.detach(), whole).to(device, _kept_dtype(value, kept), copy=True))]
            for key, value in entry.items()
            if _per_element(value)
        }
        if p in masters:
            pieces[MASTER] = [(whole, flat_values(masters[p].detach(), whole).float().to(device, copy=True))]
        scalars = {k: _kept_scalar(k, v) for k, v in entry.items() if not _per_element(v)}
        parked[p] = ParkedParam(scalars=tree_clone(scalars, device), pieces=pieces)
    return parked
