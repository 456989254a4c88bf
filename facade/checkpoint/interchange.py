"""Checkpoints the ecosystem reads: a model's state for ``torch.distributed.checkpoint``, its masters.

[Note: DCP interchange]
``torch.distributed.checkpoint`` (DCP) saves what each rank holds and loads
into what each rank asks for, resharding between any two layouts. A
``ZeroOptimizer`` takes part as FSDP2 does:

* the optimizer: torch's ``get_optimizer_state_dict(model, opt)`` /
  ``set_optimizer_state_dict`` work on it as they are ([Note: torch layout of
  shard state] in ``state.torch_view``), but for ``full_state_dict=True``, whose
  gather torch does only for DTensors: :func:`get_optimizer_state_dict` here takes
  torch's arguments and gathers ([Note: full state dicts] in ``checkpoint.full_dicts``);
* the model: :func:`model_state_dict` / :func:`load_model_state_dict`. Each
  trainable parameter is the rank's pieces of its *master* (fp32 for bf16/fp16
  parameters), shaped like the parameter, which is what FSDP2 keeps as its
  sharded parameters under a ``MixedPrecisionPolicy``: a zeroplan checkpoint
  loads into FSDP2 with the masters as FSDP2's parameters, and FSDP2's fp32
  parameters load into zeroplan's masters (the bf16 parameters are their cast),
  both bit for bit. Buffers and frozen parameters are whole, as
  ``model.state_dict()`` has them (DCP writes one copy).

Nothing is gathered: at stage 3 the rank's shard is all it reads or writes.
Loading the model is collective (the parameters are published from the masters
as after a step); a dict that lacks a key or holds another shape raises on every
rank before anything changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions

from zeroplan.core import ConfigError, IncompatiblePlanError
from zeroplan.facade.checkpoint.full_dicts import broadcast_from_rank0, gather_full
from zeroplan.facade.mechanisms.agreement import verdicts
from zeroplan.facade.mechanisms.flat_pieces import FlatPieces, flat_values
from zeroplan.facade.state.dicts import Shards

__all__ = ["get_optimizer_state_dict", "load_model_state_dict", "model_state_dict"]


def get_optimizer_state_dict(
    model: torch.nn.Module, opt: Any, *, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """torch's ``get_optimizer_state_dict(model, opt, options=...)``, with ``full_state_dict=True``
    giving whole tensors (on rank 0 alone, in host memory, with ``cpu_offload``; ``{}`` elsewhere).

    Collective with ``full_state_dict``. Without it, torch's function as it is.
    """
    options = options or StateDictOptions()
    sh = _shards(opt)
    if not options.full_state_dict:
        return torch_state_dict.get_optimizer_state_dict(model, opt, options=options)
    local = dataclasses.replace(options, full_state_dict=False, cpu_offload=False)
    sharded = torch_state_dict.get_optimizer_state_dict(model, opt, options=local)
    return gather_full(sharded, sh, _destination(options), cpu_offload=options.cpu_offload)


def _shards(opt: Any) -> Shards:
    """``opt``'s one domain.

    Raises:
        ConfigError: ``opt`` has expert groups, whose parameters have the same names on ranks holding
            other experts: DCP would keep one rank's values under each name.
    """
    if len(opt.domains) > 1:
        raise ConfigError(
            "torch.distributed.checkpoint interchange does not cover expert groups yet: each rank's "
            "experts share their parameter names with other ranks' experts, and DCP would keep one "
            "rank's values under each name. Save with zeroplan.facade.checkpoint.save"
        )
    return opt.shards()


def _destination(options: StateDictOptions) -> int | None:
    """Who receives a full dict: rank 0 with ``cpu_offload``, every rank without (torch's rule)."""
    return 0 if options.cpu_offload else None


def model_state_dict(
    model: torch.nn.Module, opt: Any, *, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """``model``'s state for DCP: trainable parameters as this rank's pieces of their masters (copies).

    Args:
        model: the module whose parameters ``opt`` (a ``ZeroOptimizer``) steps.
        opt: the optimizer.
        options: torch's; ``full_state_dict=True`` gives whole tensors (collective; with
            ``cpu_offload`` on rank 0 alone, in host memory, ``{}`` elsewhere).
    """
    sh = _shards(opt)
    out = _pieces_dict(model, sh)
    if options is not None and options.full_state_dict:
        return gather_full(out, sh, _destination(options), cpu_offload=options.cpu_offload)
    return out


def _pieces_dict(model: torch.nn.Module, sh: Shards) -> dict[str, Any]:
    """The model's dict: trainable parameters as this rank's pieces of their masters, the rest whole."""
    own = model.state_dict(keep_vars=True)
    names = _trainable_names(own, sh)
    trainable = _all_names(names)
    out: dict[str, Any] = {name: tensor.detach() for name, tensor in own.items() if name not in trainable}
    values = {b.space.dtype: _master_values(b).clone() for b in sh.buffers}
    for index, frags in sh.zp.partition.held_fragments(sh.groups.shard_rank).items():
        spec = sh.zp.specs[index]
        held = [(f.param_span, values[spec.dtype][f.shard_span.as_slice()]) for f in frags]
        buf = sh.buffers[_space_index(sh, spec.dtype)]
        pieces = FlatPieces(spec.shape, held, dtype=buf.master_dtype, device=buf.master_device)
        for name in names[index]:
            out[name] = pieces
    return out


@torch.no_grad()
def load_model_state_dict(
    model: torch.nn.Module, opt: Any, state_dict: dict[str, Any], *, options: StateDictOptions | None = None
) -> None:
    """Install a model dict: :func:`model_state_dict`'s after ``dcp.load`` filled it, or whole tensors.

    The masters take the values; the parameters take their cast (collective:
    call on every rank). With ``options.broadcast_from_rank0`` only rank 0's
    dict (whole tensors) is read; the other ranks may pass ``{}``.

    Raises:
        IncompatiblePlanError: on every rank, if any rank's dict lacks a key, holds another shape or
            pieces this rank does not hold; nothing changed.
    """
    sh = _shards(opt)
    if options is not None and options.broadcast_from_rank0:
        state_dict = broadcast_from_rank0(state_dict, sh)
    own = model.state_dict(keep_vars=True)
    problem: Exception | None = None
    masters: dict[str, torch.Tensor] = {}
    trainable: set[str] = set()
    try:
        names = _trainable_names(own, sh)
        trainable = _all_names(names)
        masters = _read(own, names, sh, state_dict)
    except Exception as exc:  # a failure on any rank must reach every rank before anything changes
        problem = exc
    verdicts(
        problem, sh.groups.world, failed="could not read the model state dict", error=IncompatiblePlanError
    )
    for name, tensor in own.items():
        if name not in trainable:
            tensor.detach().copy_(state_dict[name])
    opt.restore_masters(masters)


def _read(
    own: dict[str, Any], names: dict[int, list[str]], sh: Shards, state_dict: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Per dtype space, this rank's master values from ``state_dict`` (checked against ``own``)."""
    missing = sorted(set(own) - set(state_dict))
    if missing:
        raise IncompatiblePlanError(f"the model state dict lacks {missing[:5]} ({len(missing)} keys)")
    for name, tensor in own.items():
        if torch.is_tensor(state_dict[name]) and tuple(state_dict[name].shape) != tuple(tensor.shape):
            raise IncompatiblePlanError(
                f"{name!r} has shape {tuple(state_dict[name].shape)} in the dict, "
                f"{tuple(tensor.shape)} in the model"
            )
    out = {
        b.space.dtype: torch.zeros(b.extent, dtype=b.master_dtype, device=b.master_device) for b in sh.buffers
    }
    for index, frags in sh.zp.partition.held_fragments(sh.groups.shard_rank).items():
        value, target = state_dict[names[index][0]], out[sh.zp.specs[index].dtype]
        for f in frags:
            target[f.shard_span.as_slice()] = flat_values(value, f.param_span)
    return out


def _master_values(buf: Any) -> torch.Tensor:
    """The rank's master values of a space: its fp32 master, or the parameters' own shard."""
    return buf.master_copy[: buf.extent] if buf.carries_master else buf.shard_values()


def _space_index(sh: Shards, dtype: str) -> int:
    return next(space.index for space in sh.zp.partition.spaces if space.dtype == dtype)


def _trainable_names(own: dict[str, Any], sh: Shards) -> dict[int, list[str]]:
    """Per trainable parameter of ``sh``, its names in the model's ``state_dict(keep_vars=True)``
    (``own``; tied ones have several).

    Raises:
        ConfigError: a trainable parameter is not in the model.
    """
    position = {id(p): i for i, p in enumerate(sh.params)}
    names: dict[int, list[str]] = {}
    for name, tensor in own.items():
        index = position.get(id(tensor))
        if index is not None and sh.zp.specs[index].trainable:
            names.setdefault(index, []).append(name)
    lost = [s.name for s in sh.zp.specs if s.trainable and s.index not in names]
    if lost:
        raise ConfigError(f"parameters {lost[:5]} of the optimizer are not in the model's state_dict()")
    return names


def _all_names(names: dict[int, list[str]]) -> set[str]:
    return {n for group in names.values() for n in group}
