# zeroplan.core — pure planning: no torch, no I/O.
# Errors raised by the planner; every message names the bad value and the fix.
"""Error hierarchy of zeroplan.

All errors derive from :class:`ZeroplanError`, so callers can catch one type.

* :class:`ConfigError` — a user-supplied value is wrong (a bad world size, an
  unknown strategy, ...). The message names the field, the value and the fix.
  It also derives from :class:`ValueError` so generic callers still work.
* :class:`ConfigTypeError` — a ``ConfigError`` that is also a ``TypeError``:
  an argument of the wrong kind, where ``torch.optim`` raises ``TypeError``.
* :class:`StepOrderError` — a ``ConfigError`` for optimizer calls out of order
  (``step()`` before any backward, clipping twice, a backward after the
  reduction); see [Note: step lifecycle] in ``zeroplan.facade.runtime.lifecycle``.
* :class:`PlanInvariantError` — a plan violates one of its own invariants. Built-in
  strategies never trigger it; a user strategy that produces an inconsistent
  assignment does, and the message says which invariant broke.
* :class:`IncompatiblePlanError` — two plans (two ranks, or a checkpoint and the
  running job) disagree where they must agree.
* :class:`CheckpointError` — a checkpoint is missing, incomplete, truncated or
  corrupted (the message names the file and what is wrong).
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ConfigTypeError",
    "check_config",
    "IncompatiblePlanError",
    "PlanInvariantError",
    "StepOrderError",
    "ZeroplanError",
    "require",
]


class ZeroplanError(Exception):
    """Base class of every error zeroplan raises on purpose."""


class ConfigError(ZeroplanError, ValueError):
    """A user-supplied argument is invalid; the message says how to fix it."""


class ConfigTypeError(ConfigError, TypeError):
    """A user-supplied argument is of the wrong kind (where ``torch.optim`` raises ``TypeError``)."""


class StepOrderError(ConfigError):
    """An optimizer method was called out of order within a step; the message says what to call."""


class PlanInvariantError(ZeroplanError, ValueError):
    """A plan value violates an invariant it promises to hold."""


class IncompatiblePlanError(ZeroplanError, ValueError):
    """Two plans or a plan and a checkpoint disagree where they must match."""


class CheckpointError(ZeroplanError):
    """A checkpoint cannot be read: missing, incomplete, truncated or corrupted."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`PlanInvariantError` with ``message`` unless ``condition`` holds.

    The single helper through which plan invariants are checked (never bare
    ``assert``, which ``python -O`` strips).
    """
    if not condition:
        raise PlanInvariantError(message)


def check_config(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)
