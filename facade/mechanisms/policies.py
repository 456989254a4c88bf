"""The one place the facade asks which mode a plan runs in: its reduction and gather policies.

[Note: policies chosen once]
A mode (default, wire-encoded, deterministic; next: offload, tensor-parallel
reduction) is a policy object picked here from the plan (``ZeroPlan.reduction``,
``ZeroPlan.gather``, which core derives from ``deterministic``, ``grad_wire``
and ``param_wire``), then asked by the modules that run a step. No other
facade module branches on ``deterministic`` or a wire codec (a test reads
the source to keep it so). A new mode is a new policy class and one row of a
table below.
"""

from __future__ import annotations

from zeroplan.core import GatherKind, ReductionKind, ZeroPlan
from zeroplan.facade.mechanisms.collectives import CommLog
from zeroplan.facade.mechanisms.gathering import EncodedGather, Gather, PlainGather
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.mechanisms.reduction import (
    CanonicalReduction,
    DefaultReduction,
    EncodedReduction,
    Reduction,
)

__all__ = ["check_reduction", "gather_for", "reduction_for"]

_REDUCTIONS: dict[ReductionKind, type[DefaultReduction]] = {
    ReductionKind.DEFAULT: DefaultReduction,
    ReductionKind.ENCODED: EncodedReduction,
    ReductionKind.CANONICAL: CanonicalReduction,
}
_GATHERS: dict[GatherKind, type[PlainGather]] = {
    GatherKind.PLAIN: PlainGather,
    GatherKind.ENCODED: EncodedGather,
}


def reduction_for(zp: ZeroPlan, groups: ProcessGroups, log: CommLog) -> Reduction:
    """The reduction policy of ``zp`` ([Note: reduction policy]), logging its collectives in ``log``."""
    return _REDUCTIONS[zp.reduction](zp, groups, log)


def check_reduction(zp: ZeroPlan, *, backend: str, devices: set[str], domains: int) -> None:
    """Refuse a plan its reduction policy cannot run: on ``backend`` with parameters on ``devices``,
    in an optimizer of ``domains`` data-parallel domains (expert groups).

    Raises:
        ConfigError: the policy's own refusal, naming the option and the fix.
    """
    _REDUCTIONS[zp.reduction].check(zp, backend=backend, devices=devices, domains=domains)


def gather_for(zp: ZeroPlan) -> Gather:
    """The gather policy of ``zp``'s updated parameters ([Note: gather policy])."""
    return _GATHERS[zp.gather](zp)
