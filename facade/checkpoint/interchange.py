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

With expert groups the ranks of different expert groups hold different
experts under the same parameter names, so each expert domain's entries are
named ``<domain>/<k>/<name>``, ``k`` the expert group's index (its groups
ordered by their first rank): DCP then keeps every expert, and a checkpoint
loads at any size of the expert groups, stage or shard size with the same
number of expert groups. The optimizer's dict is :func:`get_optimizer_state_dict`'s
and loads with :func:`set_optimizer_state_dict` (torch's functions read one
plan); whole-tensor dicts are refused (no rank holds every expert).

Nothing is gathered: at stage 3 the rank's shard is all it reads or writes.
Loading the model is collective (the parameters are published from the masters
as after a step); a dict that lacks a key or holds another shape raises on every
rank before anything changes.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions

from zeroplan.core import ConfigError, IncompatiblePlanError
from zeroplan.facade.checkpoint.full_dicts import broadcast_from_rank0, gather_full
from zeroplan.facade.checkpoint.loading import domain_shards
from zeroplan.facade.mechanisms.agreement import verdicts_across
from zeroplan.facade.mechanisms.assembly import Assembly
from zeroplan.facade.mechanisms.collectives import all_gather_objects
from zeroplan.facade.mechanisms.flat_pieces import FlatPieces, flat_values
from zeroplan.facade.params.local_shards import dcp_refusal, is_dtensor, local_tensor
from zeroplan.facade.runtime.domain_states import DOMAINS_FORMAT
from zeroplan.facade.state.dicts import Shards, torch_param_groups

__all__ = [
    "get_optimizer_state_dict",
    "load_model_state_dict",
    "model_state_dict",
    "set_optimizer_state_dict",
]


class _Domain(NamedTuple):
    """One domain of the optimizer as the interchange dicts name it.

    Attributes:
        sh: what its state functions read.
        runtime: the domain (``opt.domains[d]``).
        prefix: before its parameters' names: ``""`` for the data domain, ``<domain>/<k>/`` for an
            expert domain (``k``: this rank's expert group among the domain's groups).
    """

    sh: Shards
    runtime: Any
    prefix: str


def _domains(opt: Any) -> list[_Domain]:
    """``opt``'s domains, the data domain first (collective with expert groups: the groups' order)."""
    if len(opt.domains) == 1:
        return [_Domain(opt.shards(), opt.domains[0], "")]
    data, experts = domain_shards(opt)
    out = [_Domain(data, opt.domains[0], "")]
    for runtime, esh in zip(opt.domains[1:], experts, strict=True):
        first = min(dist.get_process_group_ranks(esh.groups.world))
        firsts = sorted(set(all_gather_objects(first, data.groups.world)))
        out.append(_Domain(esh, runtime, f"{runtime.name}/{firsts.index(first)}/"))
    return out


def _one_plan(domains: list[_Domain], what: str, *, tensor_parallel: bool = False) -> Shards:
    """The one domain's shards, for whole-tensor dicts (of a tensor-parallel optimizer too, where
    ``tensor_parallel``: its slices are joined over tp).

    Raises:
        ConfigError: expert groups (no rank holds every expert), or tensor parallelism where the
            slices are not joined (a rank holds its tp slice's local tensors, not the global ones).
    """
    if len(domains) > 1:
        raise ConfigError(
            f"{what}: this optimizer has expert groups, and no rank holds every expert; save its "
            "pieces (full_state_dict=False) with DCP, or use zeroplan.facade.checkpoint.save"
        )
    if domains[0].sh.tensor_slice[1] > 1 and not tensor_parallel:
        raise ConfigError(
            f"{what}: this optimizer is tensor-parallel, and a rank holds its tp slice's local tensors, "
            "not the global ones; save the model with torch's get_model_state_dict (its DTensors), the "
            "optimizer with interchange.get_optimizer_state_dict, or use zeroplan.facade.checkpoint.save"
        )
    return domains[0].sh


def get_optimizer_state_dict(
    model: torch.nn.Module, opt: Any, *, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """torch's ``get_optimizer_state_dict(model, opt, options=...)``, with ``full_state_dict=True``
    giving whole tensors (on rank 0 alone, in host memory, with ``cpu_offload``; ``{}`` elsewhere),
    and with expert groups each expert domain's state under its own names ([Note: DCP interchange]).

    Collective with ``full_state_dict`` or expert groups. Otherwise torch's function as it is.
    """
    options = options or StateDictOptions()
    domains = _domains(opt)
    if options.full_state_dict:
        sh = _one_plan(domains, "full_state_dict=True", tensor_parallel=True)
        local = dataclasses.replace(options, full_state_dict=False, cpu_offload=False)
        sharded = torch_state_dict.get_optimizer_state_dict(model, opt, options=local)
        return gather_full(sharded, sh, _destination(options), cpu_offload=options.cpu_offload)
    if len(domains) == 1:
        return torch_state_dict.get_optimizer_state_dict(model, opt, options=options)
    names = _names(_model_dict(model), domains)
    parts = opt.state_dict()["domains"]
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for dom, named in zip(domains, names, strict=True):
        part = parts[dom.runtime.name]
        state.update({named[pos][0]: entry for pos, entry in part["state"].items()})
        groups += [{**g, "params": [named[pos][0] for pos in g["params"]]} for g in part["param_groups"]]
    out = {"state": state, "param_groups": groups}
    if options.cpu_offload:
        out["state"] = {k: {n: _to_host(v) for n, v in e.items()} for k, e in state.items()}
    return out


def _to_host(value: Any) -> Any:
    return value.to(torch.device("cpu")) if torch.is_tensor(value) else value


@torch.no_grad()
def set_optimizer_state_dict(
    model: torch.nn.Module, opt: Any, state_dict: dict[str, Any], *, options: StateDictOptions | None = None
) -> None:
    """torch's ``set_optimizer_state_dict``; with expert groups, a dict of :func:`get_optimizer_state_dict`
    (each domain's state by its names, hyper-parameters by group position); with
    ``full_state_dict=True`` (whole tensors on every rank), read by name here: torch's function
    would name a parameter's scalars on ranks whose dict has no entry for it (those holding none of
    its pieces, [Note: torch layout of shard state]) and fail. A tensor-parallel optimizer takes its
    slice of each whole tensor. Collective.

    Raises:
        ConfigError, IncompatiblePlanError: on every rank, if any rank's dict does not fit; nothing
            changed.
    """
    domains = _domains(opt)
    whole = options is not None and options.full_state_dict and not options.broadcast_from_rank0
    if len(domains) == 1 and not whole:
        torch_state_dict.set_optimizer_state_dict(model, opt, state_dict, options=options)
        return
    problem: Exception | None = None
    parts: dict[str, Any] = {}
    try:
        if options is not None and (options.full_state_dict or options.broadcast_from_rank0):
            _one_plan(domains, "a whole-tensor optimizer dict", tensor_parallel=True)
        parts = _split(state_dict, domains, _names(_model_dict(model), domains))
    except Exception as exc:  # a dict one rank cannot split must fail on every rank
        problem = exc
    grid = (*(group for _, group in opt.model_slices), domains[0].sh.groups.world)
    verdicts_across(problem, grid, failed="could not read the optimizer dict", error=ConfigError)
    if len(domains) == 1:  # a whole-tensor dict of one domain: torch's layout, positions as ids
        opt.load_state_dict(parts[domains[0].runtime.name])
        return
    opt.load_state_dict({"format": DOMAINS_FORMAT, "domains": parts})


def _split(
    state_dict: dict[str, Any], domains: list[_Domain], names: list[dict[int, list[str]]]
) -> dict[str, dict[str, Any]]:
    """Per domain, a torch-layout dict of its own ids: its entries by name, its groups by position."""
    theirs, at = list(state_dict["param_groups"]), 0
    parts: dict[str, dict[str, Any]] = {}
    for dom, named in zip(domains, names, strict=True):
        ours = torch_param_groups(dom.sh.param_groups)
        if len(theirs) < at + len(ours):
            raise IncompatiblePlanError(f"the dict has {len(theirs)} param groups, fewer than this optimizer")
        groups = [
            {**t, "params": g["params"]} for g, t in zip(ours, theirs[at : at + len(ours)], strict=True)
        ]
        at += len(ours)
        state = {pos: state_dict["state"][n[0]] for pos, n in named.items() if n[0] in state_dict["state"]}
        parts[dom.runtime.name] = {"state": state, "param_groups": groups}
    if at != len(theirs):
        raise IncompatiblePlanError(f"the dict has {len(theirs)} param groups, this optimizer {at}")
    return parts


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
    domains = _domains(opt)
    if options is not None and options.full_state_dict:
        sh = _one_plan(domains, "full_state_dict=True")
        return gather_full(
            _pieces_dict(model, domains), sh, _destination(options), cpu_offload=options.cpu_offload
        )
    return _pieces_dict(model, domains)


def _pieces_dict(model: torch.nn.Module, domains: list[_Domain]) -> dict[str, Any]:
    """The model's dict: trainable parameters as this rank's pieces of their masters, the rest whole."""
    own = _model_dict(model)
    names = _names(own, domains)
    out = {key: tensor.detach() for key, tensor in _whole(own, domains, names).items()}
    for dom, named in zip(domains, names, strict=True):
        sh = dom.sh
        values = {b.space.dtype: _master_copy(b) for b in sh.buffers}
        for index, frags in sh.zp.partition.held_fragments(sh.groups.shard_rank).items():
            spec = sh.zp.specs[index]
            held = [(f.param_span, values[spec.dtype][f.shard_span.as_slice()]) for f in frags]
            buf = sh.buffers[_space_index(sh, spec.dtype)]
            refusal = dcp_refusal(spec)
            pieces = FlatPieces(
                spec.shape, held, dtype=buf.master_dtype, device=buf.master_device, refusal=refusal
            )
            for name in named[index]:
                out[name] = pieces
        for index in set(named) - set(sh.zp.partition.held_fragments(sh.groups.shard_rank)):
            spec = sh.zp.specs[index]  # trainable, none of it held here: no piece
            if spec.trainable:
                buf = sh.buffers[_space_index(sh, spec.dtype)]
                for name in named[index]:
                    out[name] = FlatPieces(
                        spec.shape,
                        [],
                        dtype=buf.master_dtype,
                        device=buf.master_device,
                        refusal=dcp_refusal(spec),
                    )
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
    domains = _domains(opt)
    world = domains[0].sh.groups.world
    if options is not None and options.broadcast_from_rank0:
        state_dict = broadcast_from_rank0(state_dict, _one_plan(domains, "broadcast_from_rank0"))
    own = _model_dict(model)
    problem: Exception | None = None
    masters: list[dict[str, torch.Tensor]] = []
    whole: dict[str, torch.Tensor] = {}
    try:
        names = _names(own, domains)
        whole = _whole(own, domains, names)
        _check(state_dict, whole, domains, names)
        masters = [_read(dom.sh, named, state_dict) for dom, named in zip(domains, names, strict=True)]
    except Exception as exc:  # a failure on any rank must reach every rank before anything changes
        problem = exc
    grid = (*(group for _, group in opt.model_slices), world)  # no slice or stage loads alone
    verdicts_across(problem, grid, failed="could not read the model state dict", error=IncompatiblePlanError)
    for key, tensor in whole.items():
        tensor.detach().copy_(state_dict[key])
    for dom, values in zip(domains, masters, strict=True):
        dom.runtime.restore_masters(values)


def _check(
    state_dict: dict[str, Any],
    whole: dict[str, torch.Tensor],
    domains: list[_Domain],
    names: list[dict[int, list[str]]],
) -> None:
    """Every key the model's dict has is in ``state_dict``, with the same shape."""
    shapes = {key: tuple(t.shape) for key, t in whole.items()}
    for dom, named in zip(domains, names, strict=True):
        shapes.update({n: tuple(dom.sh.zp.specs[i].shape) for i, group in named.items() for n in group})
    missing = sorted(set(shapes) - set(state_dict))
    if missing:
        raise IncompatiblePlanError(f"the model state dict lacks {missing[:5]} ({len(missing)} keys)")
    for key, shape in shapes.items():
        value = state_dict[key]
        if torch.is_tensor(value) and tuple(value.shape) != shape:
            raise IncompatiblePlanError(
                f"{key!r} has shape {tuple(value.shape)} in the dict, {shape} in the model"
            )


def _read(sh: Shards, named: dict[int, list[str]], state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Per dtype space, this rank's master values from ``state_dict``."""
    out = {
        b.space.dtype: torch.zeros(b.extent, dtype=b.master_dtype, device=b.master_device) for b in sh.buffers
    }
    for index, frags in sh.zp.partition.held_fragments(sh.groups.shard_rank).items():
        value, target = state_dict[named[index][0]], out[sh.zp.specs[index].dtype]
        for f in frags:
            target[f.shard_span.as_slice()] = flat_values(value, f.param_span)
    return out


def _master_copy(buf: Any) -> torch.Tensor:
    """A copy of the rank's master values of a space: its fp32 master, or the parameters' own shard
    (copied once: a shard of pieces is assembled into a tensor of its own)."""
    if buf.carries_master:
        return buf.master_values()
    source = buf.shard_source()
    return source.into() if isinstance(source, Assembly) else source.clone()


def _space_index(sh: Shards, dtype: str) -> int:
    return next(space.index for space in sh.zp.partition.spaces if space.dtype == dtype)


def _model_dict(model: torch.nn.Module) -> dict[str, Any]:
    """``model.state_dict(keep_vars=True)`` under the names torch's ``get_model_state_dict`` and
    ``get_optimizer_state_dict`` give: without the ``_orig_mod`` of a ``torch.compile`` wrapper and
    the ``_checkpoint_wrapped_module`` of an activation-checkpoint wrapper, so that a compiled run's
    checkpoint loads into an uncompiled one (or FSDP2), and the model's entries match the optimizer's."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # nothing is compiled before it loads
    compiled = () if eval_frame is None else (eval_frame.OptimizedModule,)
    out: dict[str, Any] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        kept, module = [], model
        for segment in name.split("."):
            wrapper = segment == "_checkpoint_wrapped_module" or (
                segment == "_orig_mod" and isinstance(module, compiled)
            )
            if not wrapper:
                kept.append(segment)
            module = getattr(module, segment, None)
        out[".".join(kept)] = tensor
    return out


def _names(own: dict[str, Any], domains: list[_Domain]) -> list[dict[int, list[str]]]:
    """Per domain, per parameter of it, its names in the interchange dicts: its names in the model's
    ``state_dict(keep_vars=True)`` (``own``; tied ones have several), after the domain's prefix.

    Raises:
        ConfigError: a trainable parameter is not in the model.
    """
    out = []
    for dom in domains:
        position = {id(p): i for i, p in enumerate(dom.sh.params)}
        names: dict[int, list[str]] = {}
        for name, tensor in own.items():
            index = position.get(id(local_tensor(tensor) if is_dtensor(tensor) else tensor))
            if index is not None:
                names.setdefault(index, []).append(dom.prefix + name)
        lost = [s.name for s in dom.sh.zp.specs if s.trainable and s.index not in names]
        if lost:
            raise ConfigError(f"parameters {lost[:5]} of the optimizer are not in the model's state_dict()")
        out.append(names)
    return out


def _whole(
    own: dict[str, Any], domains: list[_Domain], names: list[dict[int, list[str]]]
) -> dict[str, torch.Tensor]:
    """What the dicts hold whole, by key: buffers and parameters no domain trains (frozen ones of an
    expert domain under its names: they differ between expert groups)."""
    trainable: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    for dom, named in zip(domains, names, strict=True):
        for index, group in named.items():
            if dom.sh.zp.specs[index].trainable:
                trainable.update(n[len(dom.prefix) :] for n in group)
            elif dom.prefix:
                out.update({n: dom.sh.params[index] for n in group})
                trainable.update(n[len(dom.prefix) :] for n in group)
    out.update({name: tensor for name, tensor in own.items() if name not in trainable})
    return out
