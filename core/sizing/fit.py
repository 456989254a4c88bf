# zeroplan.core — pure planning: no torch, no I/O.
# Does a plan fit a device once activations are added?
"""Whether each rank fits a device, activations included (the recommender: ``sizing.recommend``).

[Note: does it fit]
A rank needs, at the most, the larger of two moments of a step (see [Note: the
step's peak] in :mod:`zeroplan.core.peak` for the transients):

* **backward** — its persistent bytes (parameters, gradient buffers, fp32
  masters, optimizer state, staging arena) + the backward's transient
  (:attr:`~zeroplan.core.memory.RankReport.backward_transient_bytes`:
  autograd's gradients) + the activations of its micro-batch (see [Note:
  activation memory] in :mod:`zeroplan.core.sizing.activations`). The activations are
  all alive when the backward starts and are freed layer by layer as it goes,
  while the transient may peak anywhere in it: adding both is an upper bound
  (the forward, persistent + activations, is below it).
* **step** — persistent + the step's transient
  (:attr:`~zeroplan.core.memory.RankReport.step_transient_bytes`: the inner
  optimizer's temporaries). The backward has freed the activations by then.

Buffers the plan places in host memory ([Note: offload, planned]) need none of
the device's, nor does a step that runs on the host. A rank fits when the
larger, its *need*, is at most the device's memory. That memory is what the
allocator may hand out: the CUDA context, NCCL's buffers and fragmentation are
not planned, so leave some room. Stage 0 (DDP) and stage 3
peaks are estimates (see :func:`~zeroplan.core.peak.step_peak`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeroplan.core.errors import check_config, require
from zeroplan.core.memory import MemoryReport
from zeroplan.core.peak import PeakPhase

__all__ = ["FitReport", "RankFit", "check_device_bytes", "fit_report", "gib", "stage_label"]


def gib(nbytes: int) -> str:
    """``nbytes`` for messages: GiB with two decimals, or MiB, KiB or bytes below one GiB, MiB or KiB.

    Example:
        >>> gib(3 * 2**29), gib(-5 * 2**19), gib(1000)
        ('1.50 GiB', '-2.5 MiB', '1,000 bytes')
    """
    for unit, scale, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.{digits}f} {unit}"
    return f"{nbytes:,} bytes"


def stage_label(stage: int) -> str:
    """``"stage 2"``."""
    return f"stage {stage}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankFit:
    """What one rank needs at the backward and at the step (see [Note: does it fit]).

    Attributes:
        rank: world rank.
        backward_bytes: persistent + backward transient + activations.
        step_bytes: persistent + step transient.
        device_bytes: the device's memory.
        need_bytes: the larger of the two (derived).
        phase: where the need is (backward on a tie; derived).
        spare_bytes: ``device_bytes - need_bytes``, negative when it does not fit (derived).
        fits: ``need_bytes <= device_bytes`` (derived).
    """

    rank: int
    backward_bytes: int
    step_bytes: int
    device_bytes: int
    need_bytes: int = field(init=False)
    phase: PeakPhase = field(init=False)
    spare_bytes: int = field(init=False)
    fits: bool = field(init=False)

    def __post_init__(self) -> None:
        require(
            min(self.backward_bytes, self.step_bytes, self.device_bytes) >= 0,
            f"negative byte count in the fit of rank {self.rank}",
        )
        need = max(self.backward_bytes, self.step_bytes)
        phase = PeakPhase.STEP if self.step_bytes > self.backward_bytes else PeakPhase.BACKWARD
        object.__setattr__(self, "need_bytes", need)
        object.__setattr__(self, "phase", phase)
        object.__setattr__(self, "spare_bytes", self.device_bytes - need)
        object.__setattr__(self, "fits", need <= self.device_bytes)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (merged into the CLI's per-rank record)."""
        return {
            "need_bytes": self.need_bytes,
            "need_phase": self.phase.value,
            "spare_bytes": self.spare_bytes,
            "fits": self.fits,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class FitReport:
    """Whether every rank of a plan fits a device (see [Note: does it fit]).

    Attributes:
        stage: the plan's stage.
        shard_size: the plan's shard-group size.
        device_bytes: the device's memory.
        activation_bytes: activations of one rank's micro-batch.
        ranks: one :class:`RankFit` per world rank.
        comm_bytes_per_step: what the busiest rank sends per step.
        worst: the rank that needs the most (derived; the first of equals).
        fits: whether every rank fits (derived).
    """

    stage: int
    shard_size: int
    device_bytes: int
    activation_bytes: int
    ranks: tuple[RankFit, ...]
    comm_bytes_per_step: int
    worst: RankFit = field(init=False)
    fits: bool = field(init=False)

    def __post_init__(self) -> None:
        require(len(self.ranks) >= 1, "a fit report needs at least one rank")
        worst = max(self.ranks, key=lambda r: r.need_bytes)
        object.__setattr__(self, "worst", worst)
        object.__setattr__(self, "fits", worst.fits)

    @property
    def need_bytes(self) -> int:
        """What the busiest rank needs."""
        return self.worst.need_bytes

    def summary(self) -> str:
        """One line: whether it fits, and by how much.

        Example:
            >>> from zeroplan.core import Topology, memory_report, plan, specs_from_shapes
            >>> zp = plan(specs_from_shapes([(1024, 1024)], dtype="bf16"), Topology(world_size=2))
            >>> fit_report(memory_report(zp), activation_bytes=2**21, device_bytes=2**25).summary()
            'stage 2, shard groups of 2: every rank fits, 15.0 MiB to spare (rank 0 needs 17.0 MiB of ...
        """
        worst = self.worst
        where = (
            f"rank {worst.rank} needs {gib(worst.need_bytes)} of {gib(self.device_bytes)} "
            f"at the {worst.phase.value}"
        )
        head = f"{stage_label(self.stage)}, shard groups of {self.shard_size}: "
        if self.fits:
            return f"{head}every rank fits, {gib(worst.spare_bytes)} to spare ({where})"
        short = sum(1 for r in self.ranks if not r.fits)
        return (
            f"{head}{short} of {len(self.ranks)} ranks do not fit, {gib(-worst.spare_bytes)} short ({where})"
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready mapping without the per-rank records."""
        return {
            "stage": self.stage,
            "shard_size": self.shard_size,
            "device_bytes": self.device_bytes,
            "activation_bytes": self.activation_bytes,
            "fits": self.fits,
            "need_bytes": self.need_bytes,
            "need_phase": self.worst.phase.value,
            "spare_bytes": self.worst.spare_bytes,
            "comm_bytes_per_step": self.comm_bytes_per_step,
        }


def check_device_bytes(device_bytes: int) -> None:
    """Refuse device memory that is not an int >= 1 (bytes) (``ConfigError``)."""
    check_config(
        type(device_bytes) is int and device_bytes >= 1,
        f"device memory must be an int >= 1 (bytes), got {device_bytes!r}",
    )


def fit_report(report: MemoryReport, *, activation_bytes: int, device_bytes: int) -> FitReport:
    """Whether each rank of ``report`` fits ``device_bytes`` with ``activation_bytes`` of activations.

    See [Note: does it fit]: the backward needs persistent + backward transient
    + activations, the step persistent + step transient.

    Raises:
        ConfigError: ``activation_bytes`` not an int >= 0 or ``device_bytes`` not an int >= 1.

    Example:
        >>> from zeroplan.core import Topology, memory_report, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(1024, 1024)], dtype="bf16"), Topology(world_size=2))
        >>> fit = fit_report(memory_report(zp), activation_bytes=2**21, device_bytes=2**25)
        >>> fit.fits, fit.worst.phase.value, fit.worst.backward_bytes - fit.worst.step_bytes
        (True, 'backward', 2097152)
    """
    check_config(
        type(activation_bytes) is int and activation_bytes >= 0,
        f"activation bytes must be an int >= 0, got {activation_bytes!r}",
    )
    check_device_bytes(device_bytes)
    ranks = []
    for r in report.ranks:
        persistent = r.device_bytes  # host-resident roles ([Note: offload, planned]) need no device memory
        ranks.append(
            RankFit(
                rank=r.rank,
                backward_bytes=persistent + r.backward_transient_bytes + activation_bytes,
                step_bytes=persistent + (0 if r.step_on_host else r.step_transient_bytes),
                device_bytes=device_bytes,
            )
        )
    return FitReport(
        stage=report.stage,
        shard_size=report.shard_size,
        device_bytes=device_bytes,
        activation_bytes=activation_bytes,
        ranks=tuple(ranks),
        comm_bytes_per_step=max(r.comm_bytes_per_step for r in report.ranks),
    )
