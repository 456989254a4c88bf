"""What a run of ``zeroplan demo`` produced, and the verdict on it.

Rank 0 of :mod:`~zeroplan.facade.cli.demo.train` gathers one :class:`RankRecord`
per rank into an :class:`Outcome`; :func:`agreement` decides by [Note: tolerance]
whether the sharded run agrees with the unsharded reference, and
:mod:`~zeroplan.facade.cli.demo.report` prints the tables. Both import these
records from here, so neither imports the other's module at load time.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

from zeroplan.core import CommCost
from zeroplan.facade import MeasuredMemory
from zeroplan.facade.cli.demo.settings import DemoSettings

__all__ = [
    "CONTROL_FACTOR",
    "DECORRELATED",
    "FLOOR",
    "LOSS_FACTOR",
    "LOSS_FLOOR",
    "Agreement",
    "Outcome",
    "RankRecord",
    "agreement",
    "tolerance",
]

# [Note: tolerance]
# The sharded run and the reference compute the same steps; they differ only in rounding (the
# order of the gradient sum, the grouping of the clipping norm). Training amplifies rounding: Adam's
# first step normalises each element by its own gradient, so near-zero gradients turn a last-bit
# difference into a visible one, and later the two trajectories drift apart exponentially (measured
# on the default task with lr 1e-3: ~1e-5 relative after 200 steps, then doubling every ~10 steps
# past step 250, ~0.3 by step 600; bf16 runs get there within ~100 steps). No fixed threshold can be
# both tight and safe for every length. So the demo measures the amplification: a *control* run, the
# same unsharded AdamW with the gradient summed in reverse rank order and the clipping norm taken
# over one flat vector, i.e. the same mathematics with another rounding, as a DDP with other
# buckets would compute. The sharded run passes if its largest relative parameter difference from
# the reference is at most CONTROL_FACTOR times the control's, or at most FLOOR[dtype]: about one
# rounding of the dtype (bf16 keeps 8 significant bits: 2**-8 of the largest element).
# Once the control differs by more than DECORRELATED, the runs are no longer comparable parameter
# by parameter (any two valid runs differ as much); the verdict then compares what they still
# share, the loss: the mean over the last tenth of the steps (at least 5) of the sharded run must
# be within LOSS_FACTOR times the control's distance from the reference, or LOSS_FLOOR relative.
# Defects injected into the optimizer (world 4, shard groups of 2, collectives min_bytes) fall far
# outside both bounds. fp32, 50 steps (tolerance 3.9e-4; the sharded run 8.3e-6): no replica
# all-reduce 0.56, one bucket never reduced 1.0, no all-gather after the step 1.2, gradients averaged
# with a wrong divisor (x2) 0.27. bf16, 100 steps (decorrelated: mean loss of the last 10 steps, ref
# 0.504, control 0.505, sharded 0.504, bound 0.010): no replica all-reduce 0.657, one bucket never
# reduced 1.735, wrong divisor 0.537. Independently of the reference, every rank must end with
# bit-identical parameters (a missing replica all-reduce or all-gather breaks that at once), and
# the measured bytes must equal the plan's.
CONTROL_FACTOR = 10.0
FLOOR = {"fp32": 1e-6, "bf16": 2.0**-8}
DECORRELATED = 1e-2
LOSS_FACTOR = 3.0
LOSS_FLOOR = 0.02


def tolerance(dtype: str, control_diff: float) -> float:
    """The largest accepted relative parameter difference (see [Note: tolerance]).

    Example:
        >>> tolerance("fp32", 0.0), tolerance("fp32", 2e-5)
        (1e-06, 0.0002)
    """
    return max(CONTROL_FACTOR * control_diff, FLOOR[dtype])


class Agreement(NamedTuple):
    """Whether the sharded run agrees with the reference, and why (one line)."""

    ok: bool
    by_parameters: bool
    reason: str


def agreement(outcome: Outcome) -> Agreement:
    """The verdict of [Note: tolerance] on ``outcome``."""
    control = outcome.control_diff
    if not control > DECORRELATED:  # NaN (a broken control) fails the parameter test below
        limit = tolerance(outcome.settings.dtype, control)
        ok = outcome.max_rel_diff <= limit
        where = f" (in {outcome.worst_param})" if outcome.max_rel_diff else ""
        return Agreement(
            ok,
            True,
            f"largest relative parameter difference {outcome.max_rel_diff:.1e}{where} {'≤' if ok else '>'} "
            f"{limit:.1e} = max({CONTROL_FACTOR:g} x the control's {control:.1e}, "
            f"{outcome.settings.dtype} floor)",
        )
    window = max(5, len(outcome.losses) // 10)
    zero, ref = (statistics.fmean(row[i] for row in outcome.losses[-window:]) for i in (0, 1))
    ctrl = statistics.fmean(outcome.control_losses[-window:])
    limit = max(LOSS_FACTOR * abs(ctrl - ref), LOSS_FLOOR * abs(ref))
    ok = abs(zero - ref) <= limit
    return Agreement(
        ok,
        False,
        f"the control differs by {control:.1e} in parameters, so runs compare by loss: mean of the last "
        f"{window} steps {zero:.4f} vs {ref:.4f} (control {ctrl:.4f}), |difference| {abs(zero - ref):.4f} "
        f"{'≤' if ok else '>'} {limit:.4f} = max({LOSS_FACTOR:g} x control's, {LOSS_FLOOR:.0%})",
    )


class RankRecord(NamedTuple):
    """What one rank measured, next to what the plan says for it."""

    rank: int
    shard_rank: int
    measured: MeasuredMemory
    planned: MeasuredMemory
    comm: tuple[CommCost, ...]
    planned_comm: tuple[CommCost, ...]
    step_ms: float
    optimizer_ms: float
    params_digest: str
    """sha256 of the rank's whole parameters after the last step (stage 3: gathered); equal on all ranks."""


class Outcome(NamedTuple):
    """Everything rank 0 reports at the end (see ``report``)."""

    settings: DemoSettings
    fingerprint: str
    losses: tuple[tuple[float, float], ...]
    """(sharded, reference) mean loss over all ranks' batches, per step."""
    max_rel_diff: float
    """Largest relative parameter difference of the sharded run from the reference."""
    worst_param: str
    control_diff: float
    """The same for the control run (see [Note: tolerance])."""
    control_losses: tuple[float, ...]
    """The control's mean loss per step."""
    ref_step_ms: float
    ref_optimizer_ms: float
    records: tuple[RankRecord, ...]
    seconds: float
    gathered_estimate: int | None = None
    """Stage 3: the plan's bytes of gathered blocks alive at once in backward, an estimate no meter
    checks yet (``core.peak.gathered_bytes``); ``None`` at stages 1-2."""
