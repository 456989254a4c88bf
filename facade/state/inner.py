"""The inner ``torch.optim`` optimizer that steps this rank's shard.

It sees one tensor per :class:`~zeroplan.core.InnerTensor` of the plan: views
of the rank's master shard (flat windows for elementwise optimizers, whole
parameters otherwise), grouped exactly like the user's param groups, so group
``g`` of the inner optimizer carries the hyper-parameters of the user's group
``g``. ``torch.optim`` makes its state beside the tensors it steps, so the
state lives where the masters do; the plan places both together
([Note: residences]) and :func:`build_inner` checks the masters are where the
plan puts the optimizer state.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from zeroplan.core import (
    BufferRole,
    ConfigError,
    ConfigTypeError,
    InnerTensor,
    PlanInvariantError,
    ZeroPlan,
    kept_tensors,
)
from zeroplan.facade.mechanisms.buffer_devices import device_for
from zeroplan.facade.params.buffers import SpaceBuffers

__all__ = [
    "Inner",
    "build_inner",
    "host_kernel",
    "check_hyperparameters",
    "check_keywords",
    "comparable_hyperparameters",
    "hyperparameter_digest",
    "hyperparameters",
    "split_arguments",
    "sync_hyperparameters",
]


class Inner(NamedTuple):
    """The inner optimizer and the tensors it steps, in plan order."""

    optimizer: torch.optim.Optimizer
    tensors: tuple[torch.Tensor, ...]
    specs: tuple[InnerTensor, ...]


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings: everything but its tensors (``params``), their names and process group.

    An expert group's ``process_group`` (see [Note: expert domains]) says where
    it is reduced, not how it is stepped.
    """
    return {k: v for k, v in group.items() if k not in ("params", "param_names", "process_group")}


def _comparable(value: Any) -> Any:
    """``value`` with tensors replaced by their values, so equal settings compare and print equal."""
    if torch.is_tensor(value):
        return ("tensor", str(value.dtype), tuple(value.detach().cpu().reshape(-1).tolist()))
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_comparable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _comparable(v)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    # Other objects may print their address, which differs between processes: compare their type.
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def comparable_hyperparameters(groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every group's settings in a form that compares by value across ranks (tensors as tuples)."""
    return [{k: _comparable(v) for k, v in sorted(hyperparameters(g).items())} for g in groups]


def hyperparameter_digest(groups: Sequence[dict[str, Any]]) -> int:
    """A 62-bit digest of every group's settings, equal on ranks that hold equal settings."""
    text = repr(comparable_hyperparameters(groups)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 2


def split_arguments(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A group's hyper-parameters as (the constructor's keyword arguments, other keys that ride along
    in the group): the class validates the first, torch lets groups carry the others."""
    accepted = set(inspect.signature(optimizer_class.__init__).parameters) - {"self", "params"}
    hyper = hyperparameters(group)
    kwargs = {k: v for k, v in hyper.items() if k in accepted}
    return kwargs, {k: v for k, v in hyper.items() if k not in accepted}


def check_hyperparameters(
    optimizer_class: type[torch.optim.Optimizer], groups: Sequence[dict[str, Any]]
) -> None:
    """Construct ``optimizer_class`` on a dummy tensor per group to validate hyper-parameters early.

    Raises:
        ConfigError: the class rejects a group's settings (its message is kept).
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ConfigError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    for g, group in enumerate(groups):
        kwargs, extra = split_arguments(optimizer_class, group)
        try:
            optimizer_class([{"params": [torch.zeros(2, 2)], **extra}], **kwargs)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"{optimizer_class.__name__} rejects param group {g}: {exc}") from None


def host_kernel(optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> None:
    """Give groups that chose no kernel ``fused=True`` where ``optimizer_class`` has one for the CPU.

    For an inner optimizer that steps in host memory ([Note: offload, executed]): torch's CPU
    default is the for-loop, one tensor at a time, scalar by scalar; its fused CPU kernels (Adam,
    AdamW, SGD, Adagrad) are vectorised and multi-threaded, about 5x faster on AdamW (measured in
    ``benchmarks/offload_step.py``). A group that sets ``fused`` or ``foreach`` keeps its choice.

    The probe steps a tensor, then that tensor beside a fresh one, as after ``refresh_trainable``
    unfreezes a parameter of the group: a kernel that cannot take state present for some tensors and
    missing for others (fused SGD's momentum buffers) is not chosen, since it would fail mid-step.
    """
    if "fused" not in inspect.signature(optimizer_class.__init__).parameters:
        return
    for group in groups:
        if group.get("fused") is not None or group.get("foreach") is not None:
            continue
        kwargs, extra = split_arguments(optimizer_class, group)
        stepped, fresh = (torch.zeros(2, requires_grad=True) for _ in range(2))
        try:
            probe = optimizer_class([{"params": [stepped], **extra}], **{**kwargs, "fused": True})
            stepped.grad = torch.ones(2)
            probe.step()
            probe.param_groups[0]["params"].append(fresh)
            fresh.grad = torch.ones(2)
            probe.step()
        except (TypeError, ValueError, RuntimeError):  # no fused kernel for these settings on the CPU
            continue
        group["fused"] = True


def check_keywords(optimizer_class: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> None:
    """Refuse keyword arguments ``optimizer_class`` does not take (``weight_decya=0.1``), as torch does.

    Keys inside param-group dicts are not checked: torch lets groups carry extra keys.

    Raises:
        ConfigTypeError: a keyword the class's constructor does not accept.
    """
    signature = inspect.signature(optimizer_class.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values()):
        return
    unknown = sorted(set(defaults) - (set(signature) - {"self", "params"}))
    if unknown:
        raise ConfigTypeError(
            f"{optimizer_class.__name__} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"it accepts {', '.join(sorted(set(signature) - {'self', 'params'}))}"
        )


def build_inner(
    zp: ZeroPlan,
    buffers: Sequence[SpaceBuffers],
    shard_rank: int,
    optimizer_class: type[torch.optim.Optimizer],
    groups: Sequence[dict[str, Any]],
    device: torch.device,
    optimizer_kwargs: Mapping[str, Any] | None = None,
) -> Inner:
    """Create the inner optimizer over views of this rank's master shards (parameters on ``device``).

    ``optimizer_kwargs`` (the user's keyword arguments) go to its constructor as well as into every
    group, as ``torch.optim`` users pass them: state made at construction reads the constructor's
    (Adagrad's ``initial_accumulator_value``), not the group's.

    Raises:
        PlanInvariantError: a master is not where the plan places the optimizer state (which
            ``torch.optim`` makes beside it).
    """
    specs = zp.inner_tensors(shard_rank)
    tensors = tuple(buffers[t.space].master_window(t.shard_span).view(t.shape) for t in specs)
    state = device_for(zp, BufferRole.OPTIMIZER_STATE, device).device
    kept = set(kept_tensors(zp, shard_rank, specs))  # [Note: kept on the device]
    for i, tensor in enumerate(tensors):
        home = device_for(zp, BufferRole.KEPT_MASTER, device).device if i in kept else state
        if tensor.device != home:
            raise PlanInvariantError(f"a master on {tensor.device} would keep its optimizer state off {home}")
    per_group: list[list[torch.Tensor]] = [[] for _ in groups]
    for spec, tensor in zip(specs, tensors, strict=True):
        per_group[spec.group].append(tensor)
    optimizer = optimizer_class(
        [
            {"params": members, **hyperparameters(group)}
            for members, group in zip(per_group, groups, strict=True)
        ],
        **(optimizer_kwargs or {}),
    )
    return Inner(optimizer=optimizer, tensors=tensors, specs=specs)


def _is_number(value: Any) -> bool:
    """An ``int`` or ``float`` setting (not a ``bool``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _holds(tensor: torch.Tensor, number: float) -> bool:
    """Whether ``tensor`` holds ``number`` already, as closely as its dtype can."""
    return bool((tensor.detach() == number).all())


def sync_hyperparameters(source: Sequence[dict[str, Any]], target: Sequence[dict[str, Any]]) -> None:
    """Give the ``target`` groups every setting but ``params`` that the ``source`` groups hold.

    Runs user -> inner groups before the inner step (the user's value wins), inner -> user after it
    (what the step changed comes back), and loaded -> user groups on restore. A number meets a tensor
    where torchao's low-bit optimizers turn ``lr`` into a tensor and refuse a number in its place, and
    where a user holds ``lr=torch.tensor(...)`` (torch.compile's advice), which torch's LR schedulers
    write into in place. So a number is written into a tensor in place, as those schedulers do; a
    tensor replaces a number, as it replaces another tensor (torch.optim steps the tensor a user
    assigns or loads), unless it holds that number already: the inner optimizer's own tensor of the
    user's number, which must not come back. The inner thus steps the user's own tensor, and no
    stale value goes back into it.
    """
    for src, dst in zip(source, target, strict=True):
        for key, value in hyperparameters(src).items():
            held = dst.get(key)
            if held is value:
                continue
            if torch.is_tensor(held) and _is_number(value):
                held.fill_(value)
            elif not (torch.is_tensor(value) and _is_number(held) and _holds(value, held)):
                dst[key] = value
