# zeroplan.core — pure planning: no torch, no I/O.
# A model's repeated blocks traced once: the timeline of N blocks from those of 3, 4 and 5.
"""The traced timeline of a model whose blocks repeat, replicated from short traces.

[Note: repeated blocks traced once]
A transformer repeats one block 32 or 80 times; tracing every block costs a
minute at 4,096 tokens ([Note: traced activations]). The facade traces the
same model cut to 3, 4 and 5 blocks instead (the blocks of one ``ModuleList``
of the same class, parameter shapes and dtypes; the rest of the model as it
is) and :func:`replicate_trace` builds the timeline of ``N`` blocks from them:

* Each short trace is a sequence of :class:`TraceMark`: every trace point,
  the block its module or parameter is in (``block``, -1 outside the blocks)
  and, for the stretch of the pass since the previous mark, what the meter
  read at its most (the total, the activation bytes then, the modules whose
  peak snapshots hold it: [Note: the trace's meter] in the facade); two cuts
  without a point close the forward and the backward.
* The first and the last block are marks like the embedding's or the head's
  (they may differ: the first block's input comes from the embedding, the
  last block feeds the head); the blocks between are *runs* of marks. Every
  value (``bytes``, ``gathered``, the stretch's total and activations) is
  taken to be affine in the model's block count ``n`` and, within a run, in
  the block's index ``j``: ``v(n, j) = a + b j + c n``, with ``a``, ``b``,
  ``c`` read off the traces of 3 and 4 blocks (the middle block of 3, the two
  of 4); a mark outside the runs gets ``v(n) = v3 + (n - 3)(v4 - v3)``. A
  block named in a mark (its own, or a module of its stretch) counts from the
  start (the first block), from the end (the last) or, inside a run, from the
  run's own block.
* The trace of 5 blocks is then predicted the same way and must equal the
  one traced, mark for mark and byte for byte (names, order, values, the
  stretches' modules); otherwise, or if a block's marks are not one run of
  the same names in every block, :func:`replicate_trace` answers ``None`` and
  the facade traces the whole model.
* The peaks are read off the marks as ``_finish`` reads the meter
  (:func:`trace_of_marks`): the largest stretch total, the activations when it
  was first reached, and among the modules holding that total the deepest,
  in the order they first ran (the forward's before the backward's); the
  facade checks that reading against its own on the trace of 5 blocks.

A trace without a plan is replicated as it is. A stage-1 or stage-2 plan
keeps each gradient until its schedule releases it, by buckets that cut
across the model's blocks at byte offsets (they repeat with another period,
or none): the short traces count each gradient until it arrives and drop it
then, and the replicated marks are then given the gradients
the full plan's schedule holds (:func:`~zeroplan.core.peak.grads_alive` over
the replicated arrival order). Between two points that does not change (a
gradient stays, or goes, at its own hook, which is a point), so each stretch's
most and each point gain what is held then, and the peaks are read as before.
The meter counts a gradient's storage, its spec's bytes on the CPU (the facade
replicates a stage-1 or stage-2 trace only there, the dtypes matching the specs). A
stage-3 plan gathers blocks at module hooks by its own rules ([Note: stage 3
traced]): those traces run whole. The tests compare the replicated trace with
the whole one.

Example:
    >>> from zeroplan.core.sizing.trace import TracePhase
    >>> def marks(k):   # one block of 10 bytes each, entered and left, then a cut
    ...     out = [TraceMark(TracePhase.FORWARD, "enter", j, "", 10 * j, stretch_total=10 * j)
    ...            for j in range(k)]
    ...     cuts = tuple(TraceMark(phase, "cut", -1, "") for phase in TracePhase)
    ...     return ShortTrace(k, (*out, *cuts), 0)
    >>> trace = replicate_trace(tuple(marks(k) for k in (3, 4, 5)), blocks=8, prefix="layers", params=())
    >>> [p.bytes for p in trace.points], trace.points[-1].module
    ([0, 10, 20, 30, 40, 50, 60, 70], 'layers.7')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import NamedTuple

from zeroplan.core.errors import check_config
from zeroplan.core.peak import grads_alive
from zeroplan.core.planner import Stage, ZeroPlan
from zeroplan.core.sizing.trace import ActivationTrace, TracePhase, TracePoint

__all__ = ["SHORT_BLOCKS", "ShortTrace", "TraceMark", "replicate_trace", "trace_of_marks"]

#: The block counts of the short traces (the last one checks the others' extrapolation).
SHORT_BLOCKS = (3, 4, 5)

_EVENTS = ("enter", "exit", "grad", "cut")

StretchModule = tuple[int, str, TracePhase]  # (block or -1, name less the block's prefix, pass)


@dataclass(frozen=True, slots=True)
class TraceMark:
    """One trace point (or a cut without one), and the meter's most over the stretch before it.

    Attributes:
        phase: the pass.
        event: ``"enter"``, ``"exit"``, ``"grad"`` (as :class:`TracePoint`), or ``"cut"``: no point
            (the end of the forward, the end of the backward).
        block: the repeated block its module or parameter is in; -1: none.
        name: its module's or parameter's name, less ``prefix.<block>`` when in a block.
        bytes: the point's bytes (0 for a cut).
        gathered: the point's gathered blocks.
        stretch_total: the meter's most (all it counts, parameters included) since the previous mark.
        stretch_bytes: the activation bytes when the stretch first reached it.
        stretch_module: of the modules whose peak snapshot of a pass holds it, the one the meter's
            reading would name (the deepest, then the first to run, its forward first), as
            ``(block, name, pass)``; ``None``: none.
    """

    phase: TracePhase
    event: str
    block: int
    name: str
    bytes: int = 0
    gathered: int = 0
    stretch_total: int = 0
    stretch_bytes: int = 0
    stretch_module: StretchModule | None = None

    def __post_init__(self) -> None:
        check_config(isinstance(self.phase, TracePhase), f"TraceMark.phase: bad {self.phase!r}")
        check_config(self.event in _EVENTS, f"TraceMark.event must be one of {_EVENTS}, got {self.event!r}")
        check_config(type(self.block) is int and self.block >= -1, f"TraceMark.block: bad {self.block!r}")
        check_config(self.block < 0 or self.name[:1] in ("", "."), f"TraceMark.name: bad {self.name!r}")
        for value in (self.bytes, self.gathered, self.stretch_total, self.stretch_bytes):
            check_config(type(value) is int and value >= 0, f"TraceMark: a byte count is {value!r}")
        check_config(self.gathered <= self.bytes, "TraceMark.gathered must be within its bytes")
        check_config(
            self.stretch_module is None
            or (type(self.stretch_module[0]) is int and isinstance(self.stretch_module[2], TracePhase)),
            f"TraceMark.stretch_module: bad {self.stretch_module!r}",
        )


@dataclass(frozen=True, slots=True)
class ShortTrace:
    """The marks of one trace of the model cut to ``blocks`` repeated blocks, and its buffers' bytes."""

    blocks: int
    marks: tuple[TraceMark, ...]
    buffer_bytes: int

    def __post_init__(self) -> None:
        check_config(type(self.blocks) is int and self.blocks >= 3, f"ShortTrace.blocks: bad {self.blocks!r}")
        check_config(
            all(m.block < self.blocks for m in self.marks),
            "ShortTrace: a mark names a block it does not have",
        )
        check_config(
            [m.phase for m in self.marks if m.event == "cut"] == [TracePhase.FORWARD, TracePhase.BACKWARD],
            "ShortTrace: the marks must hold one cut ending the forward and one ending the backward",
        )


def depth(name: str) -> int:
    """A module's depth as the meter counts it (its names start with the root's class)."""
    return name.count(".") + 1 if name else 0


def full_name(prefix: str, block: int, name: str) -> str:
    """A mark's module or parameter name in the model (``prefix.<block><name>`` in a block)."""
    return name if block < 0 else f"{prefix}.{block}{name}"


def trace_of_marks(
    marks: Sequence[TraceMark],
    *,
    prefix: str,
    params: tuple[str, ...],
    plan_fingerprint: str = "",
    buffer_bytes: int = 0,
) -> ActivationTrace:
    """The trace the marks describe, its peaks read as the meter's (see [Note: repeated blocks
    traced once])."""
    points = tuple(
        TracePoint(m.phase, full_name(prefix, m.block, m.name), m.event, m.bytes, m.gathered)
        for m in marks
        if m.event != "cut"
    )
    check_config(bool(points), "trace_of_marks: no points")
    switch = next(i for i, m in enumerate(marks) if m.event == "cut")
    total = max(m.stretch_total for m in marks)
    first = next(m for m in marks if m.stretch_total == total)
    peak = max(first.stretch_bytes, *(p.bytes for p in points))
    forward_total = max(m.stretch_total for m in marks[: switch + 1])
    at_forward = next(m for m in marks if m.stretch_total == forward_total).stretch_bytes
    forward = max(at_forward, *(p.bytes for p in points if p.phase is TracePhase.FORWARD))
    order = {name: i for i, name in enumerate(dict.fromkeys(p.module for p in points if p.event == "enter"))}
    phase, module, best = TracePhase.FORWARD, "", None
    for m in marks:
        if m.stretch_total != total or m.stretch_module is None:
            continue
        block, name, where = m.stretch_module
        name = full_name(prefix, block, name)
        rank = (-depth(name), order.get(name, len(order)), where is TracePhase.BACKWARD)
        if best is None or rank < best:
            phase, module, best = where, name, rank
    return ActivationTrace(
        points=points,
        peak_bytes=peak,
        peak_phase=phase,
        peak_module=module,
        forward_peak_bytes=min(forward, peak),
        params=params,
        plan_fingerprint=plan_fingerprint,
        buffer_bytes=buffer_bytes,
    )


def _units(marks: Sequence[TraceMark]) -> list[int]:
    """Each mark's unit: the block last entered in its pass (-1: none yet). A block's backward starts
    before the previous one's has ended, so its unit holds the end of that one too."""
    units, unit, phase = [], -1, None
    for m in marks:
        if m.phase is not phase:
            unit, phase = -1, m.phase
        if m.event == "enter" and m.block >= 0 and m.name == "":
            unit = m.block
        units.append(unit)
    return units


def _near(block: int, unit: int) -> object:
    """A block as the alignment sees it: its unit's, the one before or after, or one further away."""
    if block < 0:
        return "-"
    if unit >= 0 and abs(block - unit) <= 1:
        return block - unit
    return "far"


def _keys(marks: Sequence[TraceMark]) -> list[tuple]:
    """What a mark must be in every copy of a block: its names and its blocks near its unit."""
    return [
        (m.phase.value, m.event, m.name, _near(m.block, u),
         None if m.stretch_module is None else
         (_near(m.stretch_module[0], u), m.stretch_module[1], m.stretch_module[2].value))
        for m, u in zip(marks, _units(marks), strict=True)
    ]  # fmt: skip


def _numbers(m: TraceMark) -> tuple[int, ...]:
    """The mark's values and blocks, in an order the same in every copy (its modules' by name)."""
    module = -1 if m.stretch_module is None else m.stretch_module[0]
    return (m.bytes, m.gathered, m.stretch_total, m.stretch_bytes, m.block, module)


def _rebuilt(like: TraceMark, numbers: Sequence[int]) -> TraceMark | None:
    """``like`` with ``numbers``; ``None`` where one went below zero (not affine after all)."""
    nbytes, gathered, total, at_total, block, ref = numbers
    if min(nbytes, gathered, total, at_total) < 0 or gathered > nbytes or min(block, ref) < -1:
        return None
    module = None if like.stretch_module is None else (ref, *like.stretch_module[1:])
    return TraceMark(like.phase, like.event, block, like.name, nbytes, gathered, total, at_total, module)


class _Site(NamedTuple):
    """Where the trace of one more block has one more copy of a stretch of marks: after
    ``[at - size, at)`` of the trace of 3, which is copy 0."""

    at: int
    size: int


def _sites(three: ShortTrace, four: ShortTrace) -> list[_Site] | None:
    """The copies the trace of 4 blocks adds to the trace of 3, each placed after a copy of itself
    that holds the most of block 1 (the middle one: the first and the last may differ)."""
    k3, k4 = _keys(three.marks), _keys(four.marks)
    sites: list[_Site] = []
    for tag, i1, _, j1, j2 in SequenceMatcher(None, k3, k4, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag != "insert":
            return None
        size, chunk = j2 - j1, k4[j1:j2]
        best: tuple[int, int] | None = None
        for at in range(max(size, i1 - 4 * size), min(len(k3), i1 + 4 * size) + 1):
            lo, hi = min(at, i1), max(at, i1)
            if k3[lo:at] + k3[at - size : at] + k3[at:hi] != k3[lo:i1] + chunk + k3[i1:hi]:
                continue
            middle = sum(m.block == 1 for m in three.marks[at - size : at])
            if best is None or middle > best[0]:
                best = (middle, at)
        if best is None or (sites and best[1] - size < sites[-1].at):
            return None
        sites.append(_Site(best[1], size))
    return sites


class _Slot(NamedTuple):
    """A mark of the trace of ``n`` blocks: from the trace of 3's mark ``at``, copy ``copy``
    (-1: not in a copied stretch)."""

    at: int
    copy: int


def _slots(sites: list[_Site], length: int, n: int) -> list[_Slot]:
    slots: list[_Slot] = []
    copy_of = {}
    for site in sites:
        for at in range(site.at - site.size, site.at):
            copy_of[at] = site
    ends = {site.at: site for site in sites}
    for at in range(length + 1):
        site = ends.get(at)
        if site is not None:
            slots.extend(_Slot(a, c) for c in range(1, n - 2) for a in range(site.at - site.size, site.at))
        if at < length:
            slots.append(_Slot(at, 0 if at in copy_of else -1))
    return slots


def _expand(three: ShortTrace, four: ShortTrace, sites: list[_Site], n: int) -> list[TraceMark] | None:
    """The marks of ``n`` blocks: outside the copies ``v3 + (n - 3)(v4 - v3)``, copy ``c`` of a
    copied stretch ``v(3, 0) + (n - 3)(v(4, 0) - v(3, 0)) + c (v(4, 1) - v(4, 0))``."""
    into_four = {slot: i for i, slot in enumerate(_slots(sites, len(three.marks), 4))}
    out = []
    for slot in _slots(sites, len(three.marks), n):
        like = three.marks[slot.at]
        v3 = _numbers(like)
        if slot.copy < 0:
            v4 = _numbers(four.marks[into_four[slot]])
            numbers = [a + (n - 3) * (b - a) for a, b in zip(v3, v4, strict=True)]
        else:
            v40 = _numbers(four.marks[into_four[_Slot(slot.at, 0)]])
            v41 = _numbers(four.marks[into_four[_Slot(slot.at, 1)]])
            numbers = [
                a + (n - 3) * (b - a) + slot.copy * (c - b) for a, b, c in zip(v3, v40, v41, strict=True)
            ]
        mark = _rebuilt(like, numbers)
        if mark is None:
            return None
        out.append(mark)
    return out


def _held(
    marks: Sequence[TraceMark], zp: ZeroPlan, *, prefix: str, params: tuple[str, ...]
) -> list[TraceMark]:
    """The marks of a trace whose gradients were dropped as they arrived, with them held instead until
    ``zp``'s schedule releases them. Between two points what is held does not change (a gradient is
    kept, or released, at its hook, at a point): each stretch's most and each point gain what is held
    then ([Note: repeated blocks traced once])."""
    trainable = sorted(zp.trainable_indices)
    check_config(len(trainable) == len(params), "replicate_trace: the plan is not the model's")
    index = {name: trainable[i] for i, name in enumerate(params)}
    arrivals = [index[full_name(prefix, m.block, m.name)] for m in marks if m.event == "grad"]
    after = iter(g.after for g in grads_alive(zp, arrivals=arrivals))
    out, held = [], 0
    for m in marks:
        before = held
        if m.event == "grad":
            held = next(after)
        out.append(
            TraceMark(m.phase, m.event, m.block, m.name, m.bytes + held, m.gathered, m.stretch_total + before,
                      m.stretch_bytes + before, m.stretch_module)
        )  # fmt: skip
    return out


def replicate_trace(
    shorts: Sequence[ShortTrace],
    *,
    blocks: int,
    prefix: str,
    params: tuple[str, ...],
    plan: ZeroPlan | None = None,
) -> ActivationTrace | None:
    """The trace of the model with ``blocks`` repeated blocks, from its traces cut to 3, 4 and 5
    ([Note: repeated blocks traced once]); ``None`` when they are not affine in the block count.

    Args:
        shorts: the short traces, of :data:`SHORT_BLOCKS` blocks in that order.
        blocks: the model's repeated blocks (at least the last short trace's).
        prefix: the blocks' ``ModuleList`` name (``model.layers``).
        params: the model's trainable parameters, in its order (the gradients' points must name
            each once).
        plan: the plan the trace is made for, of stage 1 or 2, the short traces having counted each
            gradient until it arrived; each is then held until the plan's staging schedule releases
            it (:func:`~zeroplan.core.peak.grads_alive`, with its options: freed at stage 2, moved
            into the gradient buffer at stage 1), its gradients' bytes those of its specs.
    """
    check_config(
        plan is None or plan.stage in (Stage.OPTIMIZER, Stage.GRADIENTS),
        "replicate_trace: a stage-3 (or DDP) plan's trace is not replicated; trace the model whole",
    )
    check_config(
        tuple(s.blocks for s in shorts) == SHORT_BLOCKS,
        f"replicate_trace needs short traces of {SHORT_BLOCKS} blocks, got {tuple(s.blocks for s in shorts)}",
    )
    check_config(
        type(blocks) is int and blocks >= SHORT_BLOCKS[-1],
        f"replicate_trace: blocks must be an int >= {SHORT_BLOCKS[-1]}, got {blocks!r}",
    )
    three, four, five = shorts
    sites = _sites(three, four)
    if sites is None or len(four.marks) != len(_slots(sites, len(three.marks), 4)):
        return None
    if _keys(four.marks) != [_keys(three.marks)[s.at] for s in _slots(sites, len(three.marks), 4)]:
        return None
    if _expand(three, four, sites, five.blocks) != list(five.marks):
        return None
    step = four.buffer_bytes - three.buffer_bytes
    if five.buffer_bytes != three.buffer_bytes + 2 * step:
        return None
    marks = _expand(three, four, sites, blocks)
    if marks is None:
        return None
    names = [full_name(prefix, m.block, m.name) for m in marks if m.event == "grad"]
    if sorted(names) != sorted(params) or len(set(params)) != len(params):
        return None
    if plan is not None:  # stages 1 and 2 (checked above): each gradient held until its release
        marks = _held(marks, plan, prefix=prefix, params=params)
    return trace_of_marks(
        marks,
        prefix=prefix,
        params=params,
        plan_fingerprint="" if plan is None else plan.fingerprint(),
        buffer_bytes=three.buffer_bytes + (blocks - three.blocks) * step,
    )
