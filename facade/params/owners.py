"""Which residency placed a parameter, kept beside the parameters instead of on them.

A parameter of another class (``GatheringParameter``, ``ShardedParameter``) must find the object that
can complete it from inside ``__torch_function__``, where only the tensor is at hand. Writing that
object onto the user's tensor (``p._zeroplan_...``) leaves attributes behind that ``copy.deepcopy``,
pickling and other libraries see; an :class:`Owners` table, keyed by the parameter's identity, keeps
it instead. An entry lives until its owner releases it, or until the parameter itself is collected.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

import torch

__all__ = ["Owners"]

T = TypeVar("T")


class Owners(Generic[T]):
    """Parameter (by identity) -> the value its residency registered (see the module's docstring)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], T]] = {}

    def claim(self, param: torch.Tensor, value: T) -> None:
        """Register ``value`` for ``param`` (replacing any earlier one)."""
        key = id(param)

        def gone(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is ref:  # not a newer parameter at the same address
                del self._entries[key]

        self._entries[key] = (weakref.ref(param, gone), value)

    def get(self, param: torch.Tensor) -> T | None:
        """What was registered for ``param``, or ``None``."""
        entry = self._entries.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]

    def release(self, param: torch.Tensor, value: T) -> None:
        """Forget ``param``'s entry if it is ``value``'s."""
        entry = self._entries.get(id(param))
        if entry is not None and entry[0]() is param and entry[1] is value:
            del self._entries[id(param)]

    def __len__(self) -> int:
        return len(self._entries)
