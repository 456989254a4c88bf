# zeroplan.core — pure planning: no torch, no I/O.
# A traced timeline of one micro-batch's activations (the facade records it under fake tensors).
"""The activation timeline of one forward and backward, as traced (see [Note: traced activations]).

[Note: traced activations]
The formula of [Note: activation memory] describes the paper's transformer
layer; what a given model keeps depends on its code: its attention kernel,
its MLP, autocast, activation checkpointing. ``zeroplan.facade.diagnostics.trace``
runs the model once, forward, loss and backward on one micro-batch, under
torch's fake tensors (nothing is allocated), and counts with torch's
``MemTracker`` the bytes autograd keeps and the backward's temporaries, at
every module's entry and exit in forward and backward and at every
parameter's gradient. Each parameter's gradient is dropped as it arrives, as
stage 2 does once it is staged (the plan counts gradients and staging), so a
point's ``bytes`` are the activations and autograd temporaries alone. This
module holds the result: the points in time order, the peak and where it
happens. Nothing here knows torch.

Example:
    >>> points = (TracePoint(TracePhase.FORWARD, "layer", "exit", 100),
    ...           TracePoint(TracePhase.BACKWARD, "layer", "exit", 40))
    >>> trace = ActivationTrace(points=points, peak_bytes=120, peak_phase=TracePhase.BACKWARD,
    ...                         peak_module="layer")
    >>> trace.phase_peak(TracePhase.FORWARD)
    100
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from zeroplan.core.errors import check_config

__all__ = ["ActivationTrace", "TracePhase", "TracePoint"]


class TracePhase(str, Enum):
    """The pass a point belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class TracePoint:
    """Activation bytes alive at one moment of the traced pass.

    Attributes:
        phase: forward (the loss included) or backward.
        module: the module's qualified name (``""``: the root; a parameter's name for ``"grad"``).
        event: ``"enter"`` or ``"exit"`` of the module, or ``"grad"`` (that parameter's gradient
            arrived and was dropped).
        bytes: activations and autograd temporaries alive then.
    """

    phase: TracePhase
    module: str
    event: str
    bytes: int

    def __post_init__(self) -> None:
        check_config(
            isinstance(self.phase, TracePhase), f"TracePoint.phase must be a TracePhase, got {self.phase!r}"
        )
        check_config(self.event in ("enter", "exit", "grad"), f"TracePoint.event: bad {self.event!r}")
        check_config(type(self.bytes) is int and self.bytes >= 0, f"TracePoint.bytes: bad {self.bytes!r}")


@dataclass(frozen=True, slots=True)
class ActivationTrace:
    """One micro-batch's activation timeline and its peak.

    Attributes:
        points: every module boundary and gradient arrival, in time order.
        peak_bytes: the most activation and temporary bytes alive at once (the meter's peak, which
            can fall inside a module, between two points).
        peak_phase: the pass where it happens.
        peak_module: the innermost module running then (``""``: the root or the loss).
    """

    points: tuple[TracePoint, ...]
    peak_bytes: int
    peak_phase: TracePhase
    peak_module: str

    def __post_init__(self) -> None:
        check_config(bool(self.points), "ActivationTrace needs at least one point")
        check_config(
            self.peak_bytes >= max(p.bytes for p in self.points),
            f"ActivationTrace.peak_bytes {self.peak_bytes} is below a point of the trace",
        )

    def phase_peak(self, phase: TracePhase) -> int:
        """The most bytes at the points of ``phase`` (0 if none)."""
        return max((p.bytes for p in self.points if p.phase is phase), default=0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "peak_bytes": self.peak_bytes,
            "peak_phase": str(self.peak_phase),
            "peak_module": self.peak_module,
            "points": [[str(p.phase), p.module, p.event, p.bytes] for p in self.points],
        }
