# zeroplan.core — pure planning: no torch, no I/O.
# Which implementation torch 2.13 runs for an optimizer's step: for-loop, foreach or fused.
"""``Implementation`` and :func:`resolve_implementation`, mirroring torch 2.13.

[Note: implementation resolution]
``torch.optim`` optimizers step a param group with one of three implementations:
a Python *for-loop* over the tensors ("single tensor"), *foreach* kernels over
all of them at once ("multi tensor"), or one *fused* kernel. Which one runs is
decided per param group from its ``foreach`` and ``fused`` settings (``None``
meaning "torch's default") and the parameters' device, by
``torch.optim.optimizer._default_to_fused_or_foreach`` and the functional API of
each optimizer. In torch 2.13:

* ``fused=True`` is accepted by Adam, AdamW, SGD and Adagrad only, never
  together with ``foreach=True`` or ``differentiable=True``, on the devices of
  ``_get_fused_kernels_supported_devices`` (CPU and CUDA among them).
* ``foreach=True`` runs foreach kernels on any device (on CPU they fall back to a
  loop over the tensors, with the same outputs); Muon has no foreach
  implementation, and only SGD's foreach path works with ``differentiable=True``.
* Otherwise (``foreach`` is ``None``, and ``fused`` too for the four optimizers
  that have it) torch picks foreach on the devices of
  ``_get_foreach_kernels_supported_devices`` (CUDA, XPU, MTIA), and the for-loop
  elsewhere (CPU) or when ``differentiable=True`` (SGD ignores that flag here).
  Fused is never the default, not even for Adam and AdamW on CUDA. Adam and
  AdamW also keep the for-loop for a tensor ``lr`` without ``capturable``.
* ``foreach=False`` or ``fused=False`` given explicitly selects the for-loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from zeroplan.core.errors import ConfigError, ConfigTypeError

__all__ = ["FOREACH_DEVICES", "FUSED_DEVICES", "Implementation", "resolve_implementation"]


class Implementation(str, Enum):
    """How a ``torch.optim`` optimizer steps one param group."""

    FOR_LOOP = "for_loop"
    """A Python loop over the tensors, one tensor at a time (``foreach=False``)."""
    FOREACH = "foreach"
    """``torch._foreach_*`` kernels over all tensors of one device and dtype at once."""
    FUSED = "fused"
    """One fused kernel per device and dtype (``fused=True``)."""

    def __str__(self) -> str:
        return self.value


#: Device types on which torch 2.13 defaults to foreach (``_get_foreach_kernels_supported_devices``).
FOREACH_DEVICES = frozenset({"cuda", "xpu", "mtia"})
#: Device types with fused optimizer kernels in torch 2.13 (``_get_fused_kernels_supported_devices``).
FUSED_DEVICES = frozenset({"cpu", "cuda", "hpu", "mps", "mtia", "xpu"})

#: Optimizers whose constructor takes ``fused`` (torch 2.13).
_HAS_FUSED = frozenset({"Adam", "AdamW", "SGD", "Adagrad"})
#: Optimizers of torch 2.13 whose constructor does not take ``fused``.
_NO_FUSED = frozenset(
    {"RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop", "ASGD", "Adafactor", "Muon"}
)
#: Optimizers without a foreach implementation.
_NO_FOREACH = frozenset({"Muon"})
#: Optimizers whose default ignores ``differentiable`` (SGD passes ``differentiable=False``).
_DEFAULT_IGNORES_DIFFERENTIABLE = frozenset({"SGD"})
#: Optimizers that keep the for-loop by default for a tensor ``lr`` without ``capturable``.
_TENSOR_LR_FOR_LOOP = frozenset({"Adam", "AdamW"})


def _flag(settings: Mapping[str, Any], key: str) -> bool | None:
    value = settings.get(key)
    if value is not None and not isinstance(value, bool):
        raise ConfigTypeError(f"{key} must be True, False or None, got {value!r}")
    return value


def _device_type(device: str) -> str:
    if not isinstance(device, str) or not device.split(":")[0]:
        raise ConfigTypeError(f"device must be a device type such as 'cpu' or 'cuda', got {device!r}")
    return device.split(":")[0]


def resolve_implementation(
    name: str, settings: Mapping[str, Any] | None = None, *, device: str = "cuda"
) -> Implementation:
    """The implementation torch 2.13 runs for optimizer ``name`` with ``settings`` on ``device``.

    See [Note: implementation resolution]. Names outside torch (an unknown
    optimizer) follow the same rules, with ``fused`` and ``foreach`` taken as
    supported.

    Args:
        name: the optimizer's class name, as spelled by torch (``"AdamW"``).
        settings: the param group's settings; ``foreach``, ``fused``,
            ``differentiable``, ``capturable`` and ``lr`` are read.
        device: the parameters' device type (``"cpu"``, ``"cuda"``, ...; an
            index such as ``"cuda:1"`` is ignored).

    Raises:
        ConfigError: a combination torch refuses (``fused`` with ``foreach`` or
            ``differentiable``, ``fused`` for an optimizer or device without
            fused kernels, ``foreach`` for Muon or with ``differentiable``).
        ConfigTypeError: ``foreach``/``fused`` not a bool or ``None``, or a
            ``device`` that is not a device type string.

    Example:
        >>> resolve_implementation("AdamW", device="cpu")
        <Implementation.FOR_LOOP: 'for_loop'>
        >>> resolve_implementation("AdamW", device="cuda")
        <Implementation.FOREACH: 'foreach'>
        >>> str(resolve_implementation("AdamW", {"fused": True}, device="cuda"))
        'fused'
        >>> resolve_implementation("SGD", {"foreach": True, "fused": True})
        Traceback (most recent call last):
        ...
        zeroplan.core.errors.ConfigError: SGD: `fused` and `foreach` cannot be True together ...
    """
    settings = settings or {}
    device = _device_type(device)
    foreach, fused = _flag(settings, "foreach"), _flag(settings, "fused")
    differentiable = bool(settings.get("differentiable", False))
    if fused and foreach:
        raise ConfigError(
            f"{name}: `fused` and `foreach` cannot be True together (torch raises RuntimeError); "
            "set one of them"
        )
    if fused:
        if name in _NO_FUSED:
            raise ConfigError(
                f"{name} has no fused implementation in torch 2.13 (only {', '.join(sorted(_HAS_FUSED))} "
                "have one); drop fused=True"
            )
        if differentiable:
            raise ConfigError(
                f"{name}: `fused` does not support `differentiable` (torch raises RuntimeError)"
            )
        if device not in FUSED_DEVICES:
            raise ConfigError(
                f"{name}: fused=True needs parameters on {', '.join(sorted(FUSED_DEVICES))}, not {device!r}"
            )
        return Implementation.FUSED
    if foreach:
        if name in _NO_FOREACH:
            raise ConfigError(f"{name} has no foreach implementation in torch 2.13; drop foreach=True")
        if differentiable and name not in _DEFAULT_IGNORES_DIFFERENTIABLE:
            raise ConfigError(
                f"{name}: foreach=True does not support differentiable=True (torch's foreach ops do not "
                "support autograd); drop one of them"
            )
        return Implementation.FOREACH
    explicit = foreach is False or (fused is False and name in _HAS_FUSED)
    if explicit or name in _NO_FOREACH or device not in FOREACH_DEVICES:
        return Implementation.FOR_LOOP
    if differentiable and name not in _DEFAULT_IGNORES_DIFFERENTIABLE:
        return Implementation.FOR_LOOP
    lr = settings.get("lr", 0.0)
    if name in _TENSOR_LR_FOR_LOOP and not isinstance(lr, (int, float)) and not settings.get("capturable"):
        return Implementation.FOR_LOOP
    return Implementation.FOREACH
