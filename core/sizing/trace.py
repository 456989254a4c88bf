# zeroplan.core — pure planning: no torch, no I/O.
# A traced timeline of one micro-batch's activations (the facade records it under fake tensors).
"""The activation timeline of one forward and backward, as traced (see [Note: traced activations]).

[Note: traced activations]
The formula of [Note: activation memory] describes the paper's transformer
layer; what a given model keeps depends on its code: its attention kernel,
its MLP, autocast, activation checkpointing. ``zeroplan.facade.diagnostics.activation_trace``
runs the model once, forward, loss and backward on one micro-batch, under
torch's fake tensors (nothing is allocated), and counts with torch's
``MemTracker`` the bytes autograd keeps and the backward's temporaries, at
every module's entry and exit in forward and backward and at every
parameter's gradient. Each parameter's gradient is dropped as it arrives, as
stage 2 does once it is staged (the plan counts gradients and staging), so a
point's ``bytes`` are the activations and autograd temporaries alone; traced
with a plan, they also hold the gradients its schedule keeps and, at stage 3,
the blocks its hooks gather ([Note: one timeline]). This
module holds the result: the points in time order, the peak and where it
happens. Nothing here knows torch. A model whose blocks repeat is traced
with 3, 4 and 5 of them and its timeline replicated ([Note: repeated blocks
traced once] in ``zeroplan.core.sizing.repeat``).

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
from typing import Any, NamedTuple

from zeroplan.core.errors import check_config
from zeroplan.core.memory import MemoryReport, memory_report
from zeroplan.core.peak import gathered_bytes, grads_alive
from zeroplan.core.planner import Stage, ZeroPlan
from zeroplan.core.sizing.fit import FitReport, RankFit, check_device_bytes

__all__ = [
    "ActivationTrace",
    "TimelinePoint",
    "TracePhase",
    "TracePoint",
    "TracedFit",
    "TracedPeak",
    "step_timeline",
    "traced_fit",
    "traced_step_peak",
]


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
        bytes: activations and autograd temporaries alive then (traced with a plan: and the
            gradients its schedule keeps, and at stage 3 its gathered blocks).
        gathered: stage 3's gathered blocks among ``bytes`` (traced with a stage-3 plan).
    """

    phase: TracePhase
    module: str
    event: str
    bytes: int
    gathered: int = 0

    def __post_init__(self) -> None:
        check_config(
            isinstance(self.phase, TracePhase), f"TracePoint.phase must be a TracePhase, got {self.phase!r}"
        )
        check_config(self.event in ("enter", "exit", "grad"), f"TracePoint.event: bad {self.event!r}")
        check_config(type(self.bytes) is int and self.bytes >= 0, f"TracePoint.bytes: bad {self.bytes!r}")
        check_config(
            type(self.gathered) is int and 0 <= self.gathered <= self.bytes,
            f"TracePoint.gathered must be within its bytes ({self.bytes}), got {self.gathered!r}",
        )


@dataclass(frozen=True, slots=True)
class ActivationTrace:
    """One micro-batch's activation timeline and its peak.

    Attributes:
        points: every module boundary and gradient arrival, in time order.
        peak_bytes: the most activation and temporary bytes alive at once (the meter's peak, which
            can fall inside a module, between two points).
        forward_peak_bytes: the most during the forward and the loss.
        params: the trainable parameters' names, in the model's order.
        plan_fingerprint: the plan whose staging schedule kept the gradients during the trace
            (their bytes are then in every point and the peaks); ``""``: each was dropped as it
            arrived.
        peak_phase: the pass where it happens.
        peak_module: the innermost module running then (``""``: the root or the loss).
        reshard_after_forward: traced with a stage-3 plan, the setting its gathered blocks were held
            by (they are then in every point and the peaks); ``None``: no blocks were held.
        buffer_bytes: the model's buffers (a rotary embedding's frequencies, normalization
            statistics): held throughout, by no plan; not in the points.
    """

    points: tuple[TracePoint, ...]
    peak_bytes: int
    peak_phase: TracePhase
    peak_module: str
    forward_peak_bytes: int = 0
    params: tuple[str, ...] = ()
    plan_fingerprint: str = ""
    reshard_after_forward: bool | None = None
    buffer_bytes: int = 0

    def __post_init__(self) -> None:
        check_config(bool(self.points), "ActivationTrace needs at least one point")
        check_config(
            type(self.buffer_bytes) is int and self.buffer_bytes >= 0,
            f"ActivationTrace.buffer_bytes must be an int >= 0, got {self.buffer_bytes!r}",
        )
        check_config(
            self.reshard_after_forward is None
            or (isinstance(self.reshard_after_forward, bool) and bool(self.plan_fingerprint)),
            "ActivationTrace.reshard_after_forward is a bool set only for a trace made with a stage-3 plan",
        )
        check_config(
            self.peak_bytes >= max(p.bytes for p in self.points),
            f"ActivationTrace.peak_bytes {self.peak_bytes} is below a point of the trace",
        )
        check_config(
            0 <= self.forward_peak_bytes <= self.peak_bytes,
            f"ActivationTrace.forward_peak_bytes {self.forward_peak_bytes} is not within the peak",
        )

    def arrivals(self) -> tuple[int, ...]:
        """The gradients' arrival order, as indices into :attr:`params` (a plan's parameter indices
        when the plan was made from the same parameters in the same order)."""
        index = {name: i for i, name in enumerate(self.params)}
        return tuple(index[p.module] for p in self.points if p.event == "grad" and p.module in index)

    def phase_peak(self, phase: TracePhase) -> int:
        """The most bytes at the points of ``phase`` (0 if none)."""
        return max((p.bytes for p in self.points if p.phase is phase), default=0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return {
            "peak_bytes": self.peak_bytes,
            "peak_phase": str(self.peak_phase),
            "peak_module": self.peak_module,
            "forward_peak_bytes": self.forward_peak_bytes,
            "params": list(self.params),
            "plan_fingerprint": self.plan_fingerprint,
            "reshard_after_forward": self.reshard_after_forward,
            "buffer_bytes": self.buffer_bytes,
            "points": [[str(p.phase), p.module, p.event, p.bytes, p.gathered] for p in self.points],
        }


class TracedPeak(NamedTuple):
    """One rank's whole step, planned with traced activations (see :func:`traced_step_peak`).

    Attributes:
        rank: the world rank.
        peak_bytes: the most bytes alive at once over the step.
        phase: ``"forward"``, ``"backward"`` or ``"step"``.
        persistent: what the rank holds between steps: the plan's ``device_bytes`` and the model's
            buffers (``ActivationTrace.buffer_bytes``).
        activations: activation bytes alive at the peak.
        gradients: autograd gradients not staged yet at the peak.
        exact: ``False`` where the figure is an estimate: stage 3's gathered blocks added to the
            activations' peak when the trace did not hold them (over, or under where recomputed
            forwards gather again), gradients waiting across a module's backward (over).
        traced_gradients: the trace held the gradients itself (traced with the plan): they are in
            ``activations``, and ``gradients`` is 0.
        traced_blocks: the trace held stage 3's gathered blocks itself: they are in ``activations``.
        passes_bytes: the most of the forward and backward (the peak unless it is the step's).
        step_bytes: ``persistent`` and ``step()``'s transients.
    """

    rank: int
    peak_bytes: int
    phase: str
    persistent: int
    activations: int
    gradients: int
    exact: bool
    traced_gradients: bool = False
    traced_blocks: bool = False
    passes_bytes: int = 0
    step_bytes: int = 0


def traced_step_peak(zp: ZeroPlan, trace: ActivationTrace) -> tuple[TracedPeak, ...]:
    """Per world rank, the peak of one training step: the plan's buffers, the traced activations and
    the gradients autograd holds as they arrive in the traced order, added at each moment.

    [Note: one timeline]
    A step's memory is the plan's persistent buffers and the model's own
    buffers (which no plan holds: the trace counts them) plus, over time: in the
    forward, the activations; in the backward, the activations left and the
    gradients the staging schedule has not taken yet ([Note: the step's peak]),
    replayed in the order the trace saw them arrive; in ``step()``, its
    transients, once the activations are gone. The peak is the largest of these
    sums, not the sum of their largest. Between two gradient arrivals the trace
    knows the activations' largest value, not when it happened, so gradients
    waiting across that stretch (out of bucket order) are added to it whole:
    an upper bound, exact when gradients are staged as they arrive (the default
    order). Traced with the plan (``trace_activations(..., plan=zp)``), the
    trace keeps each gradient until the plan's schedule releases it, so its
    points and peaks already hold them, and the backward is exact in any order;
    at stage 3 it also holds the gathered blocks where the facade's hooks hold
    them ([Note: stage 3 traced] in the facade), and the step is exact.
    Traced without, stage 3's most gathered blocks are added to the
    activations' peak: over, except where activation checkpointing's
    recomputed forwards gather blocks again, which it can miss (GPT-2: 7%
    under), so only a trace made with the plan is exact there.

    Args:
        zp: the plan (its parameters in the traced model's order), with the
            options the step will use ([Note: plan options]).
        trace: :func:`~zeroplan.facade.diagnostics.activation_trace.trace_activations`'s result for one
            micro-batch of one rank.
    """
    return _traced_peaks(zp, trace)[0]


def _traced_peaks(zp: ZeroPlan, trace: ActivationTrace) -> tuple[tuple[TracedPeak, ...], MemoryReport]:
    """:func:`traced_step_peak`, and the memory report it read."""
    check_config(
        len(trace.params) == len(zp.trainable_indices),
        f"the trace has {len(trace.params)} trainable parameters, the plan {len(zp.trainable_indices)}: "
        "trace the model the plan was made for",
    )
    check_config(
        trace.plan_fingerprint in ("", zp.fingerprint()),
        "the trace kept its gradients by another plan's schedule: trace with this plan, or without one",
    )
    reshard_after_forward = zp.options.reshard_after_forward
    check_config(
        trace.reshard_after_forward in (None, reshard_after_forward),
        f"the trace held stage 3's blocks with reshard_after_forward={trace.reshard_after_forward}: "
        "trace with the setting the step will use (the plan's options.reshard_after_forward)",
    )
    trainable = sorted(zp.trainable_indices)
    arrivals = [trainable[i] for i in trace.arrivals()]
    alive = grads_alive(zp, arrivals=arrivals) if zp.stage is not Stage.DDP else ()
    at_grad = [p.bytes for p in trace.points if p.event == "grad"]
    waiting = max((g.after for g in alive), default=0)
    if trace.plan_fingerprint:  # the trace held the gradients itself, as the schedule kept them
        alive, waiting = (), 0
    arrival = max(
        ((a + g.at_arrival, a, g.at_arrival) for a, g in zip(at_grad, alive, strict=False)), default=(0, 0, 0)
    )
    report = memory_report(zp, arrivals=arrivals)
    gathered = 0
    if zp.stage is Stage.PARAMETERS and trace.reshard_after_forward is None:
        gathered = gathered_bytes(zp)
    out = []
    for r in report.ranks:
        persistent = r.device_bytes + trace.buffer_bytes  # host-resident roles: none of it
        candidates = [
            (persistent + trace.forward_peak_bytes + gathered, "forward", trace.forward_peak_bytes, 0),
            (persistent + trace.peak_bytes + waiting + gathered, "backward", trace.peak_bytes, waiting),
            (persistent + arrival[0] + gathered, "backward", arrival[1], arrival[2]),
            (persistent + (0 if r.step_on_host else r.step_transient_bytes), "step", 0, 0),
        ]
        peak, phase, activations, gradients = max(candidates, key=lambda c: c[0])
        exact = gathered == 0 and waiting == 0
        held, blocks = bool(trace.plan_fingerprint), trace.reshard_after_forward is not None
        passes = max(c[0] for c in candidates[:3])
        out.append(
            TracedPeak(
                r.rank,
                peak,
                phase,
                persistent,
                activations,
                gradients,
                exact,
                held,
                blocks,
                passes,
                candidates[3][0],
            )
        )
    return tuple(out), report


class TracedFit(NamedTuple):
    """A plan's fit read off its traced step (:func:`traced_fit`), and whether that is exact."""

    fit: FitReport
    exact: bool


def traced_fit(
    zp: ZeroPlan,
    trace: ActivationTrace,
    *,
    device_bytes: int,
) -> TracedFit:
    """Whether each rank of ``zp`` fits ``device_bytes``, its need read off the step's timeline
    ([Note: one timeline]) rather than the activations' peak added to the backward's ([Note: does
    it fit]): the fit the recommender uses with traced activations.

    Each :class:`~zeroplan.core.sizing.fit.RankFit`'s ``backward_bytes`` is the most of the forward
    and the backward (``TracedPeak.passes_bytes``), and the report's ``activation_bytes`` the trace's
    peak (with what a trace made with the plan held: gradients, stage 3's blocks). ``exact``: every
    rank's :class:`TracedPeak` is (else an estimate: see :func:`traced_step_peak`)."""
    check_device_bytes(device_bytes)
    peaks, report = _traced_peaks(zp, trace)
    ranks = tuple(RankFit(rank=p.rank, backward_bytes=p.passes_bytes, step_bytes=p.step_bytes,
                          device_bytes=device_bytes) for p in peaks)  # fmt: skip
    fit = FitReport(
        stage=int(zp.stage),
        shard_size=zp.topology.shard_size,
        device_bytes=device_bytes,
        activation_bytes=trace.peak_bytes,
        ranks=ranks,
        comm_bytes_per_step=max(r.comm_bytes_per_step for r in report.ranks),
    )
    return TracedFit(fit, all(p.exact for p in peaks))


class TimelinePoint(NamedTuple):
    """One moment of a rank's step: what the plan holds and what the micro-batch adds (bytes)."""

    phase: str
    label: str
    persistent: int
    activations: int
    gradients: int
    gathered: int = 0

    @property
    def total(self) -> int:
        """Everything alive then."""
        return self.persistent + self.activations + self.gradients + self.gathered


def step_timeline(zp: ZeroPlan, trace: ActivationTrace, rank: int = 0) -> tuple[TimelinePoint, ...]:
    """World rank ``rank``'s step at every point of ``trace``, then ``step()``: the plan's persistent
    buffers, the traced activations, the gradients not staged yet after each arrival ([Note: one
    timeline]; held in ``activations`` when the trace was made with the plan) and stage 3's gathered
    blocks (``gathered``, when the trace held them). For plotting: the
    meter's peak can fall between two points (:func:`traced_step_peak` has it);
    ``notebooks/planner_tour.ipynb`` plots one."""
    if trace.reshard_after_forward is not None:  # the setting the trace held its blocks with
        zp = zp.with_options(reshard_after_forward=trace.reshard_after_forward)
    peaks = {p.rank: p for p in traced_step_peak(zp, trace)}
    check_config(rank in peaks, f"rank {rank} is not a rank of the plan (world {len(peaks)})")
    report = next(r for r in memory_report(zp).ranks if r.rank == rank)
    persistent = report.total_bytes + trace.buffer_bytes
    alive: dict[int, int] = {}
    if not trace.plan_fingerprint and zp.stage is not Stage.DDP:
        trainable = sorted(zp.trainable_indices)
        arrivals = [trainable[i] for i in trace.arrivals()]
        after = [g.after for g in grads_alive(zp, arrivals=arrivals)]
        grad_points = [i for i, p in enumerate(trace.points) if p.event == "grad"]
        alive = dict(zip(grad_points, after, strict=False))
    out = []
    waiting = 0
    for i, point in enumerate(trace.points):
        waiting = alive.get(i, waiting)
        label = f"{point.event} {point.module or '(model)'}"
        out.append(
            TimelinePoint(
                str(point.phase), label, persistent, point.bytes - point.gathered, waiting, point.gathered
            )
        )
    out.append(TimelinePoint("step", "step()", persistent, report.step_transient_bytes, 0))
    return tuple(out)
