"""Checking what a user passes as ``params`` and describing it for the planner.

Everything is validated before any tensor is touched, so a bad argument
leaves the model exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from zeroplan.core import ConfigError, ConfigTypeError, ParamSpec, canonical_dtype
from zeroplan.facade.params.gather import DeferredParameter
from zeroplan.facade.params.local_shards import is_dtensor, local_tensor, placement_of, placement_problem

__all__ = ["ParamList", "collect_params", "describe_params"]


class ParamList(NamedTuple):
    """The user's parameters, flattened in group order.

    Attributes:
        params: every parameter; its position is its plan index.
        names: a name per parameter (from named parameters, else synthesised).
        groups: the user's param groups, ``params`` replaced by index lists.
        device: the single device all parameters live on.
        user_params: per parameter, the user's tensor: itself, or the ``DTensor`` whose local tensor is in
            ``params`` ([Note: tensor-parallel parameters] in ``zeroplan.core.tensor_parallel``).
    """

    params: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    groups: tuple[dict[str, Any], ...]
    device: torch.device
    user_params: tuple[torch.Tensor, ...]


def _group_dicts(params: Any) -> list[dict[str, Any]]:
    if isinstance(params, torch.Tensor):
        raise ConfigTypeError(
            "params must be an iterable of tensors or of param-group dicts, got a single tensor; "
            "pass [tensor] or model.parameters()"
        )
    try:
        items = list(params)
    except TypeError:
        raise ConfigTypeError(
            f"params must be an iterable of tensors or of param-group dicts, got {type(params).__name__}; "
            "pass model.parameters()"
        ) from None
    if not items:
        raise ConfigError("ZeroOptimizer got an empty parameter list; pass model.parameters()")
    if not isinstance(items[0], dict):
        return [{"params": items}]
    for i, group in enumerate(items):
        if not isinstance(group, dict) or "params" not in group:
            raise ConfigError(f"param group {i} must be a dict with a 'params' entry, got {group!r:.80}")
    return [dict(group) for group in items]


#: The parameter classes ZeroOptimizer shards (besides its own ``DeferredParameter`` classes, which a
#: parameter another ZeroOptimizer manages may hold for a while): plain tensors, whose spec is plain.
_PLAIN = (torch.Tensor, torch.nn.Parameter)

_DTENSOR = "{where}: is a DTensor (placements {placements} on mesh dimensions {mesh}): {problem}"
_SUBCLASS = (
    "{where}: is a {cls}, a torch.Tensor subclass; ZeroOptimizer shards plain tensors and nn.Parameter "
    "only (stage 3 swaps a parameter's class, and a subclass's own data would not be sharded). Pass the "
    "plain tensor it wraps, or leave this parameter to another optimizer"
)


def _subclass_error(where: str, tensor: torch.Tensor) -> str:
    """Why ``tensor``, of a class ZeroOptimizer does not handle, is refused (the message names it)."""
    cls = type(tensor)
    return _SUBCLASS.format(where=where, cls=f"{cls.__module__}.{cls.__qualname__}")


def _managed(where: str, tensor: torch.Tensor, tensor_mesh: Any) -> torch.Tensor:
    """The tensor zeroplan shards for the user's ``tensor``: itself, or a DTensor's local tensor.

    Raises:
        ConfigError: a tensor subclass, or a DTensor zeroplan cannot shard (named by the message).
    """
    if is_dtensor(tensor):
        problem = placement_problem(tensor, tensor_mesh)
        if problem is not None:
            mesh = tensor.device_mesh.mesh_dim_names
            raise ConfigError(
                _DTENSOR.format(where=where, placements=tuple(tensor.placements), mesh=mesh, problem=problem)
            )
        return local_tensor(tensor)
    if type(tensor) not in _PLAIN and not isinstance(tensor, DeferredParameter):
        raise ConfigError(_subclass_error(where, tensor))
    return tensor


def collect_params(
    params: Any,
    start: int = 0,
    seen: Iterable[tuple[torch.Tensor, str]] = (),
    tensor_mesh: Any = None,
    first_group: int = 0,
) -> ParamList:
    """Validate ``params`` (what ``torch.optim`` accepts) and flatten it.

    Args:
        params: an iterable of tensors, of ``(name, tensor)`` pairs, or of
            param-group dicts.
        start: index of the first new parameter (for ``add_param_group``).
        seen: parameters already listed (the user's tensors, of any domain) and where, e.g.
            ``"param group 1, position 0"``; listing one again is an error.
        first_group: the index the first group of ``params`` gets among the optimizer's
            ``param_groups`` (for messages).
        tensor_mesh: the mesh DTensor parameters must be placed on (the optimizer mesh's ``tp``
            dimension); ``None``: DTensor parameters are refused.

    Raises:
        ConfigError: empty list, a parameter listed twice, a non-floating or
            sparse tensor, a non-leaf tensor, a tensor subclass (a ``DTensor``
            off ``tensor_mesh``, or with a ``Partial`` or strided placement), or
            parameters on several devices.
    """
    flat: list[torch.Tensor] = []
    user_params: list[torch.Tensor] = []
    names: list[str] = []
    groups: list[dict[str, Any]] = []
    listed = list(seen)
    position = {id(p): where for p, where in listed}
    for local, group in enumerate(_group_dicts(params)):
        g = first_group + local  # its index in param_groups, for messages
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        indices = []
        for i, item in enumerate(members):
            name, tensor = item if isinstance(item, tuple) and len(item) == 2 else (None, item)
            where = f"param group {g}, position {i}" + (f" ({name})" if name else "")
            if not isinstance(tensor, torch.Tensor):
                raise ConfigTypeError(f"{where}: expected a tensor, got {type(tensor).__name__}")
            managed = _managed(where, tensor, tensor_mesh)
            if tensor.is_sparse or tensor.layout is not torch.strided:
                raise ConfigError(
                    f"{where}: sparse tensors ({tensor.layout}) cannot be sharded; use dense parameters"
                )
            if not tensor.is_floating_point():
                raise ConfigError(
                    f"{where}: dtype {tensor.dtype} is not floating point; only float parameters train"
                )
            canonical_dtype(str(tensor.dtype))  # raises ConfigError for unsupported float types
            if not tensor.is_leaf:
                raise ConfigError(
                    f"{where}: is not a leaf tensor; optimise the nn.Parameter, not a computed tensor"
                )
            if id(tensor) in position:
                raise ConfigError(
                    f"{where}: this parameter is already listed at {position[id(tensor)]}; "
                    "list each parameter once"
                )
            index = start + len(flat)
            position[id(tensor)] = f"param group {g}, position {i}"
            flat.append(managed)
            user_params.append(tensor)
            names.append(name or f"group{local}.param{i}")  # unnamed: as saved before (checkpoints)
            indices.append(index)
        if not indices:
            raise ConfigError(f"param group {g} has no parameters")
        groups.append({**group, "params": indices})
    devices = {p.device for p in flat} | {p.device for p, _ in listed}
    if len(devices) > 1:
        raise ConfigError(
            f"parameters live on several devices ({', '.join(sorted(map(str, devices)))}); "
            "ZeroOptimizer needs every parameter on one device"
        )
    return ParamList(
        params=tuple(flat),
        names=tuple(names),
        groups=tuple(groups),
        device=devices.pop(),
        user_params=tuple(user_params),
    )


def describe_params(
    params: tuple[torch.Tensor, ...],
    names: tuple[str, ...],
    groups: tuple[dict[str, Any], ...],
    cohorts: tuple[int, ...],
    user_params: tuple[torch.Tensor, ...] | None = None,
) -> tuple[ParamSpec, ...]:
    """Planner specs of ``params`` (trainability read from ``requires_grad`` now, of ``user_params``: the
    user's tensors; a DTensor's spec has its local shape, global shape and placement)."""
    group_of = {i: g for g, group in enumerate(groups) for i in group["params"]}
    user_params = params if user_params is None else user_params
    return tuple(
        ParamSpec(
            index=i,
            name=names[i],
            shape=tuple(p.shape),
            dtype=str(p.dtype),
            group=group_of[i],
            trainable=bool(owner.requires_grad),
            cohort=cohorts[i],
            global_shape=tuple(owner.shape),
            placement=placement_of(owner) if is_dtensor(owner) else (),
        )
        for i, (p, owner) in enumerate(zip(params, user_params, strict=True))
    )
