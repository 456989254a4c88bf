"""``span_boxes``: a flat range of a row-major tensor as the N-D boxes DCP names ([Note: pieces as boxes])."""

from __future__ import annotations

from math import prod

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zeroplan.core import PlanInvariantError, Span
from zeroplan.core.boxes import span_boxes


@st.composite
def shapes_and_spans(draw: st.DrawFn) -> tuple[tuple[int, ...], Span]:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    numel = prod(shape)
    start = draw(st.integers(0, numel))
    return shape, Span(start, draw(st.integers(start, numel)))


@given(shapes_and_spans())
def test_boxes_cover_the_range_once_each_contiguous_in_flat_order(case):
    shape, span = case
    boxes = span_boxes(shape, span)
    strides = [prod(shape[d + 1 :]) for d in range(len(shape))]
    covered = []
    for box in boxes:
        first = sum(o * s for o, s in zip(box.offsets, strides, strict=True))
        assert first == span.start + box.start  # each box starts where its flat run does
        cells = [[]]
        for o, n in zip(box.offsets, box.sizes, strict=True):
            cells = [[*c, i] for c in cells for i in range(o, o + n)]
        flat = [sum(i * s for i, s in zip(c, strides, strict=True)) for c in cells]
        assert flat == list(range(first, first + box.numel))  # contiguous: a view of the flat values
        covered += flat
    assert covered == list(range(span.start, span.stop))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_a_range_outside_the_tensor_is_refused():
    with pytest.raises(PlanInvariantError, match="not inside a tensor of shape"):
        span_boxes((2, 3), Span(4, 7))
