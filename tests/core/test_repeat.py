"""A repeated block's timeline replicated from short traces ([Note: repeated blocks traced once])."""

from __future__ import annotations

import pytest

from zeroplan.core import ConfigError
from zeroplan.core.sizing.repeat import ShortTrace, TraceMark, replicate_trace
from zeroplan.core.sizing.trace import TracePhase

F, B = TracePhase.FORWARD, TracePhase.BACKWARD


def _short(k: int, *, kink: int = 0) -> ShortTrace:
    """An embedding, ``k`` blocks of 10 bytes each (the last feeding a head of 7), and a backward
    that frees them, a gradient per block; ``kink`` adds bytes to block 3 only (not affine)."""
    marks = [TraceMark(F, "enter", -1, "embed", 4, stretch_total=4, stretch_bytes=4)]
    held = 4
    for j in range(k):
        held += 10 + (kink if j == 3 else 0)
        marks += [TraceMark(F, "enter", j, "", held - 10, stretch_total=held - 10),
                  TraceMark(F, "exit", j, "", held, stretch_total=held, stretch_bytes=held,
                            stretch_module=(j, "", F))]  # fmt: skip
    marks += [TraceMark(F, "exit", -1, "head", held + 7, stretch_total=held + 7, stretch_bytes=held + 7,
                  stretch_module=(-1, "head", F)),
              TraceMark(F, "cut", -1, "", stretch_total=held + 7)]  # fmt: skip
    for j in reversed(range(k)):
        marks.append(TraceMark(B, "enter", j, "", held, stretch_total=held))
        held -= 10 + (kink if j == 3 else 0)
        marks.append(TraceMark(B, "grad", j, ".weight", held, stretch_total=held + 10))
    marks.append(TraceMark(B, "cut", -1, "", stretch_total=held))
    return ShortTrace(k, tuple(marks), 0)


def test_an_affine_timeline_is_replicated_to_any_count_of_blocks():
    params = tuple(f"layers.{j}.weight" for j in range(80))
    trace = replicate_trace([_short(k) for k in (3, 4, 5)], blocks=80, prefix="layers", params=params)
    assert trace is not None
    assert trace.peak_bytes == trace.forward_peak_bytes == 4 + 800 + 7
    assert trace.peak_module == "head" and trace.peak_phase is F
    assert [p.bytes for p in trace.points if p.module == "layers.79"] == [4 + 790, 4 + 800, 4 + 800]
    assert [p.module for p in trace.points if p.event == "grad"] == list(reversed(params))
    assert sum(p.event == "enter" and p.module.startswith("layers.") for p in trace.points) == 160


def test_a_trace_of_5_blocks_other_than_predicted_is_refused():
    shorts = [_short(3), _short(4), _short(5, kink=3)]
    params = tuple(f"layers.{j}.weight" for j in range(8))
    assert replicate_trace(shorts, blocks=8, prefix="layers", params=params) is None
    assert (
        replicate_trace([_short(k) for k in (3, 4, 5)], blocks=8, prefix="layers", params=params[:7]) is None
    )


def test_the_short_traces_and_marks_are_checked():
    with pytest.raises(ConfigError, match="short traces of"):
        replicate_trace([_short(k) for k in (3, 4, 6)], blocks=8, prefix="layers", params=())
    with pytest.raises(ConfigError, match="blocks must be an int"):
        replicate_trace([_short(k) for k in (3, 4, 5)], blocks=4, prefix="layers", params=())
    with pytest.raises(ConfigError, match="gathered must be within"):
        TraceMark(F, "enter", 0, "", 1, 2)
    with pytest.raises(ConfigError, match="one cut ending the forward"):
        ShortTrace(3, (TraceMark(F, "enter", 0, ""),), 0)
