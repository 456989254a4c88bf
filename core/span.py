# zeroplan.core — pure planning: no torch, no I/O.
# A half-open element range; every offset in a plan is a Span or an int.
"""``Span``: a half-open range ``[start, stop)`` of element positions."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from zeroplan.core.errors import require

__all__ = ["Span", "round_up"]


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= value``.

    Example:
        >>> round_up(10, 4)
        12
        >>> round_up(0, 4)
        0
    """
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class Span:
    """Half-open range of element positions ``[start, stop)``.

    Example:
        >>> Span(2, 10).intersect(Span(8, 20))
        Span(start=8, stop=10)
        >>> Span(2, 10).shift(-2)
        Span(start=0, stop=8)
        >>> Span(3, 3).numel
        0
        >>> list(Span(0, 10).chunks(4))
        [Span(start=0, stop=4), Span(start=4, stop=8), Span(start=8, stop=10)]
    """

    start: int
    stop: int

    def __post_init__(self) -> None:
        start, stop = self.start, self.stop
        if type(start) is int and type(stop) is int and 0 <= start <= stop:
            return  # hot path (plans build Spans by the hundred thousand): no message formatting
        require(
            type(self.start) is int and type(self.stop) is int,
            f"Span bounds must be ints, got {self.start!r}, {self.stop!r}",
        )
        require(
            0 <= self.start <= self.stop,
            f"Span needs 0 <= start <= stop, got [{self.start}, {self.stop})",
        )

    @property
    def numel(self) -> int:
        """Number of elements in the range."""
        return self.stop - self.start

    def shift(self, delta: int) -> Span:
        """The same range moved by ``delta`` positions."""
        return Span(self.start + delta, self.stop + delta)

    def intersect(self, other: Span) -> Span | None:
        """Overlap with ``other``; ``None`` when they share no element."""
        start, stop = max(self.start, other.start), min(self.stop, other.stop)
        return Span(start, stop) if start < stop else None

    def contains(self, other: Span) -> bool:
        """Whether ``other`` lies entirely inside this range."""
        return self.start <= other.start and other.stop <= self.stop

    def chunks(self, size: int) -> Iterator[Span]:
        """Consecutive sub-ranges of ``size`` elements tiling this range (the last may be shorter).

        An empty range has no chunks.
        """
        require(type(size) is int and size >= 1, f"chunk size must be an int >= 1, got {size!r}")
        stop = self.stop
        return (Span(start, min(start + size, stop)) for start in range(self.start, stop, size))

    def as_slice(self) -> slice:
        """A ``slice`` selecting this range from a flat sequence or tensor."""
        return slice(self.start, self.stop)
