# zeroplan.core — pure planning: no torch, no I/O.
# What the planner needs to know about an inner optimizer: its state and whether it is elementwise.
"""``OptimizerSpec``: the state an optimizer keeps and how it may be sharded.

An *elementwise* optimizer (SGD, Adam, AdamW, ...) updates each element from
that element's gradient and state alone, so any split of a parameter is exact.
A *non-elementwise* one (Adafactor's factored moments, Muon's orthogonalisation)
needs whole parameters on one rank: a plan that splits parameters is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zeroplan.core.errors import ConfigError

__all__ = ["OptimizerSpec", "describe_optimizer", "known_optimizers"]

#: Bytes of a scalar state tensor (torch keeps ``step`` as a float32 scalar).
SCALAR_BYTES = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpec:
    """The state an optimizer keeps per tensor it steps.

    Attributes:
        name: the optimizer's class name.
        elementwise: whether any element split of a parameter is exact.
        per_element: state tensors shaped like the stepped tensor.
        scalars: 0-d state tensors per stepped tensor (``step``, ...).
        factored: Adafactor-style row and column statistics for tensors of two
            or more dimensions (one full-size statistic below that).
        known: whether the description comes from zeroplan's table; unknown
            optimizers are treated as non-elementwise with unknown state size.

    Example:
        >>> spec = describe_optimizer("AdamW")
        >>> spec.state_bytes((10, 10), 4)   # exp_avg + exp_avg_sq + step
        804
    """

    name: str
    elementwise: bool
    per_element: int
    scalars: int = 0
    factored: bool = False
    known: bool = True

    def state_bytes(self, shape: tuple[int, ...], itemsize: int) -> int:
        """Bytes of state for one stepped tensor of ``shape`` (state dtype ``itemsize``)."""
        numel = math.prod(shape)
        full = self.per_element * numel
        if self.factored:
            if len(shape) >= 2:
                full += math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
            else:
                full += numel
        return full * itemsize + self.scalars * SCALAR_BYTES


def _sgd(momentum: float = 0.0, **_: Any) -> tuple[bool, int, int, bool]:
    return True, 1 if momentum else 0, 0, False


def _adam(amsgrad: bool = False, **_: Any) -> tuple[bool, int, int, bool]:
    return True, 3 if amsgrad else 2, 1, False


def _rmsprop(momentum: float = 0.0, centered: bool = False, **_: Any) -> tuple[bool, int, int, bool]:
    return True, 1 + (1 if momentum else 0) + (1 if centered else 0), 1, False


def _fixed(elementwise: bool, per_element: int, scalars: int, factored: bool = False) -> Any:
    def describe(**_: Any) -> tuple[bool, int, int, bool]:
        return elementwise, per_element, scalars, factored

    return describe


_TABLE = {
    "SGD": _sgd,
    "Adam": _adam,
    "AdamW": _adam,
    "RMSprop": _rmsprop,
    "Adagrad": _fixed(True, 1, 1),
    "Adamax": _fixed(True, 2, 1),
    "NAdam": _fixed(True, 2, 2),
    "RAdam": _fixed(True, 2, 1),
    "Adadelta": _fixed(True, 2, 1),
    "Rprop": _fixed(True, 2, 1),
    "ASGD": _fixed(True, 1, 3),
    "Adafactor": _fixed(False, 0, 1, True),
    "Muon": _fixed(False, 1, 0),
}

_ALIASES = {name.lower(): name for name in _TABLE}


def known_optimizers() -> tuple[str, ...]:
    """Names :func:`describe_optimizer` knows."""
    return tuple(_TABLE)


def describe_optimizer(
    name: str, /, settings: Mapping[str, Any] | None = None, *, strict: bool = True, **hyper: Any
) -> OptimizerSpec:
    """The spec of the ``torch.optim`` optimizer called ``name`` with ``hyper`` settings.

    Hyper-parameters that change the state (``momentum``, ``amsgrad``,
    ``centered``) are read; others are ignored.

    Args:
        name: class name, case-insensitive (``"adamw"`` works).
        strict: raise for unknown names; otherwise return a conservative
            non-elementwise spec with ``known=False``.
        settings: the optimizer's keyword arguments as a mapping (a param
            group's settings, which may hold any key, ``name`` and ``strict``
            included).
        **hyper: more keyword arguments.

    Raises:
        ConfigError: unknown ``name`` with ``strict``.

    Example:
        >>> describe_optimizer("sgd", momentum=0.9).per_element
        1
        >>> describe_optimizer("Adafactor").elementwise
        False
    """
    canonical = _ALIASES.get(str(name).lower())
    if canonical is None:
        if strict:
            raise ConfigError(
                f"unknown optimizer {name!r}; known: {', '.join(_TABLE)} "
                "(other optimizers are planned as non-elementwise with unknown state)"
            )
        return OptimizerSpec(name=str(name), elementwise=False, per_element=0, known=False)
    elementwise, per_element, scalars, factored = _TABLE[canonical](**{**(settings or {}), **hyper})
    return OptimizerSpec(
        name=canonical,
        elementwise=elementwise,
        per_element=per_element,
        scalars=scalars,
        factored=factored,
    )
