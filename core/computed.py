# zeroplan.core — pure planning: no torch, no I/O.
# Sequences computed on demand that are, in all but type, the tuples of their items.
"""``ComputedTuple``: a read-only sequence computed when read, equal to the tuple of its items.

Plans of thousands of ranks describe per-rank values by rule ([Note: compact plans] in
:mod:`zeroplan.core.runs`, [Note: gather blocks] in :mod:`zeroplan.core.planner`); these
sequences stand for the tuples a plan of tuples holds, so every reader sees the same values.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import FrozenInstanceError
from itertools import repeat
from typing import Any, TypeVar, overload

from zeroplan.core.errors import PlanInvariantError

__all__ = ["ComputedTuple", "Repeated"]

T = TypeVar("T")


class ComputedTuple(Sequence[T]):
    """A read-only sequence computed on demand that behaves as the tuple of its items.

    It equals (and hashes as) the tuple of its items and any ``ComputedTuple``
    of the same items; a slice is a tuple. Subclasses define ``__len__`` and
    ``_item`` (and a faster ``__iter__`` where they can) and set their slots
    in ``__init__`` with ``object.__setattr__``: instances are immutable.
    """

    __slots__ = ()

    def _item(self, i: int) -> T:
        """Item ``i``, ``0 <= i < len(self)``."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[T, ...]: ...

    def __getitem__(self, i: int | slice) -> T | tuple[T, ...]:
        if isinstance(i, slice):
            return tuple(self._item(j) for j in range(*i.indices(len(self))))
        n = len(self)
        i = operator.index(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} items")
        return self._item(i)

    def __iter__(self) -> Iterator[T]:
        return (self._item(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, ComputedTuple)):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __add__(self, other: object) -> tuple[Any, ...]:
        if isinstance(other, (tuple, ComputedTuple)):
            return (*self, *other)
        return NotImplemented

    def __radd__(self, other: object) -> tuple[Any, ...]:
        if isinstance(other, tuple):
            return (*other, *self)
        return NotImplemented

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __getstate__(self) -> dict[str, Any]:
        slots = (name for cls in type(self).__mro__ for name in getattr(cls, "__slots__", ()))
        return {name: getattr(self, name) for name in slots}

    def __setstate__(self, state: dict[str, Any]) -> None:  # (pickle and copy)
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")


class Repeated(ComputedTuple[int]):
    """``count`` copies of one int: the shard starts of a block of equal pieces ([Note: layout]).

    Example:
        >>> starts = Repeated(count=3, value=8)
        >>> starts == (8, 8, 8), starts.count(8), starts[1], hash(starts) == hash((8, 8, 8))
        (True, 3, 8, True)
    """

    __slots__ = ("length", "value")
    length: int
    value: int

    def __init__(self, *, count: int, value: int) -> None:
        if not (type(count) is int and type(value) is int and count >= 0):
            raise PlanInvariantError(f"invalid repeated value: {count!r} copies of {value!r}")
        object.__setattr__(self, "length", count)
        object.__setattr__(self, "value", value)

    def __len__(self) -> int:
        return self.length

    def _item(self, i: int) -> int:
        return self.value

    def __iter__(self) -> Iterator[int]:
        return repeat(self.value, self.length)

    def count(self, value: object) -> int:
        """How many items equal ``value`` (as ``tuple.count``, in O(1))."""
        return self.length if value == self.value else 0

    def __eq__(self, other: object) -> bool:
        if type(other) is Repeated:
            return self.length == other.length and (self.value == other.value or not self.length)
        return super().__eq__(other)

    def __hash__(self) -> int:
        return super().__hash__()
