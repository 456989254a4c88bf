"""``Span`` and ``round_up``: the value type every offset is built from."""

from __future__ import annotations

import dataclasses

import pytest

from zeroplan.core import PlanInvariantError, Span
from zeroplan.core.span import round_up


@pytest.mark.parametrize(
    ("value", "multiple", "expected"),
    [(0, 128, 0), (1, 128, 128), (128, 128, 128), (129, 128, 256), (4369, 128, 4480), (17, 1, 17)],
)
def test_round_up(value, multiple, expected):
    assert round_up(value, multiple) == expected


def test_numel_shift_contains_and_slice():
    span = Span(17, 257)
    assert span.numel == 240
    assert span.shift(-17) == Span(0, 240)
    assert span.shift(3) == Span(20, 260)
    assert span.contains(Span(17, 17)) and span.contains(Span(100, 257))
    assert not span.contains(Span(16, 20)) and not span.contains(Span(250, 258))
    assert list(range(300))[span.as_slice()] == list(range(17, 257))
    assert Span(5, 5).numel == 0


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (Span(0, 10), Span(5, 20), Span(5, 10)),
        (Span(5, 20), Span(0, 10), Span(5, 10)),
        (Span(0, 10), Span(2, 3), Span(2, 3)),
        (Span(0, 10), Span(10, 20), None),  # touching is not overlapping
        (Span(0, 10), Span(11, 20), None),
        (Span(3, 3), Span(0, 10), None),  # empty spans share no element
    ],
)
def test_intersect(a, b, expected):
    assert a.intersect(b) == expected


@pytest.mark.parametrize(
    ("start", "stop", "needle"),
    [(5, 4, "[5, 4)"), (-1, 3, "[-1, 3)"), (-5, -1, "[-5, -1)")],
)
def test_bad_bounds_are_plan_invariant_errors_naming_the_bounds(start, stop, needle):
    with pytest.raises(PlanInvariantError) as info:
        Span(start, stop)
    assert needle in str(info.value)


@pytest.mark.parametrize(("start", "stop"), [(0.0, 3), (0, 3.5), (True, 3), ("0", 3), (None, 1)])
def test_non_int_bounds_are_rejected_naming_the_value(start, stop):
    with pytest.raises(PlanInvariantError, match="must be ints") as info:
        Span(start, stop)
    assert repr(start) in str(info.value) and repr(stop) in str(info.value)


def test_shift_below_zero_is_rejected():
    with pytest.raises(PlanInvariantError, match=r"\[-1, 2\)"):
        Span(0, 3).shift(-1)


def test_span_is_frozen_and_slotted():
    span = Span(1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        span.start = 0  # type: ignore[misc]
    assert not hasattr(span, "__dict__")
    assert hash(span) == hash(Span(1, 2)) and span == Span(1, 2)


def test_chunks_tile_the_span_in_order():
    assert list(Span(3, 13).chunks(4)) == [Span(3, 7), Span(7, 11), Span(11, 13)]
    assert list(Span(0, 8).chunks(4)) == [Span(0, 4), Span(4, 8)]
    assert list(Span(0, 3).chunks(100)) == [Span(0, 3)]
    assert list(Span(5, 5).chunks(2)) == []


@pytest.mark.parametrize("size", [0, -1, 2.0, None])
def test_chunks_reject_a_bad_size_at_once(size):
    with pytest.raises(PlanInvariantError, match="chunk size"):
        Span(0, 4).chunks(size)  # raised when called, not when iterated
