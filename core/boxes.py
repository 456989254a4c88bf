# zeroplan.core — pure planning: no torch, no I/O.
# A flat range of an N-D tensor as the few N-D boxes torch's checkpoint protocol names.
"""``span_boxes``: the N-D boxes a flat element range of a row-major tensor is made of.

[Note: pieces as boxes]
A rank's shard holds flat ranges of each parameter ([Note: flat buffers]); torch's
distributed checkpoint (DCP) names what a rank holds as N-D boxes (an offset and
a size per dimension). A flat range ``[a, b)`` of a row-major tensor is at most
``2 * ndim - 1`` boxes, each contiguous in the flat order: the tail of the first
partial row at every depth, the whole rows between, the head of the last partial
row at every depth. Each box is therefore a view of the rank's flat values
(``Box.start`` elements after the range's first), so DCP reads and writes the
shard in place, with no gather and no copy; DCP reshards between any two box
layouts (FSDP2's dim-0 chunks included).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from zeroplan.core.errors import require
from zeroplan.core.span import Span

__all__ = ["Box", "span_boxes"]


@dataclass(frozen=True, slots=True)
class Box:
    """An N-D box of a tensor: ``sizes`` elements from ``offsets``, ``start`` elements into its flat range.

    Example:
        >>> Box(offsets=(1, 0), sizes=(2, 4), start=3).numel
        8
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    def __post_init__(self) -> None:
        require(len(self.offsets) == len(self.sizes), f"box of offsets {self.offsets} and sizes {self.sizes}")
        require(self.start >= 0 and all(s > 0 for s in self.sizes), f"empty or misplaced box {self}")

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return prod(self.sizes)


def span_boxes(shape: tuple[int, ...], span: Span) -> tuple[Box, ...]:
    """The boxes (in flat order) that make elements ``span`` of a row-major tensor of ``shape``.

    Example:
        >>> [(b.offsets, b.sizes, b.start) for b in span_boxes((3, 4), Span(2, 11))]
        [((0, 2), (1, 2), 0), ((1, 0), (1, 4), 2), ((2, 0), (1, 3), 6)]
        >>> [(b.offsets, b.sizes) for b in span_boxes((3, 4), Span(4, 12))]
        [((1, 0), (2, 4))]
        >>> span_boxes((), Span(0, 1))[0].sizes
        ()
    """
    numel = prod(shape)
    require(
        0 <= span.start <= span.stop <= numel,
        f"elements {span} are not inside a tensor of shape {shape} ({numel} elements)",
    )
    return tuple(_boxes(tuple(shape), span.start, span.stop, span.start))


def _boxes(shape: tuple[int, ...], start: int, stop: int, origin: int) -> list[Box]:
    """Boxes of ``[start, stop)`` (coordinates of ``shape``); ``origin`` is the flat position of the range."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [Box(offsets=(start,) * len(shape), sizes=(stop - start,) * len(shape), start=start - origin)]
    row = prod(shape[1:])
    first_full, last_full = -(-start // row), stop // row  # whole rows [first_full, last_full)
    if first_full > last_full:  # inside one row
        r = start // row
        return _prefixed(r, _boxes(shape[1:], start - r * row, stop - r * row, origin - r * row))
    out: list[Box] = []
    if start % row:
        r = start // row
        out += _prefixed(r, _boxes(shape[1:], start - r * row, row, origin - r * row))
    if last_full > first_full:
        offsets = (first_full,) + (0,) * (len(shape) - 1)
        sizes = (last_full - first_full, *shape[1:])
        out.append(Box(offsets=offsets, sizes=sizes, start=first_full * row - origin))
    if stop % row:
        out += _prefixed(last_full, _boxes(shape[1:], 0, stop - last_full * row, origin - last_full * row))
    return out


def _prefixed(row: int, boxes: list[Box]) -> list[Box]:
    """``boxes`` of one row, as boxes of the tensor the row belongs to."""
    return [Box(offsets=(row, *b.offsets), sizes=(1, *b.sizes), start=b.start) for b in boxes]
