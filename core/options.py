# zeroplan.core — pure planning: no torch, no I/O.
# The execution options a plan carries: what is alive and sent when, beyond the layout.
"""``StepOptions``: the settings that change when buffers are alive and collectives run.

[Note: plan options]
A plan holds every setting that changes what a rank allocates, sends or when:
the layout's settings are fields of :class:`~zeroplan.core.planner.ZeroPlan`
(stage, buckets, wire formats, deterministic mode), and the execution flags of
``ZeroOptimizer`` live in one :class:`StepOptions` value the plan holds
(``ZeroPlan.options``). Memory, peak, traffic, the staging schedule and the
trace read them from the plan, never from an argument passed beside it, so a
report cannot describe another run than the one the facade executes, and ranks
that disagree are told which field differs (``ZeroPlan.settings``). The
options change no buffer's layout, so ``ZeroPlan.fingerprint`` leaves them out:
state saved under one overlap setting loads under another.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from zeroplan.core.errors import check_config

__all__ = ["StepOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOptions:
    """How a plan executes in a step (``ZeroOptimizer``'s flags of the same names).

    Attributes:
        overlap_grad_reduce: buckets are staged and reduced during backward as
            they complete; ``False``: all at the end of backward (changes the
            backward's peak, not the result).
        overlap_param_gather: updated parameters are gathered block by block
            while the next forward runs; ``False``: inside ``step()``.
        reshard_after_forward: stage 3 frees a block after its forward and
            gathers it again in backward; ``False``: keeps it until its
            gradients arrived (more memory, half the gathers).

    Example:
        >>> StepOptions(reshard_after_forward=False).changed()
        {'reshard_after_forward': False}
    """

    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            check_config(type(value) is bool, f"{f.name} must be True or False, got {value!r}")

    def changed(self) -> dict[str, bool]:
        """The options that differ from their defaults, by name (what a report mentions)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
