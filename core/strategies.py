# zeroplan.core — pure planning: no torch, no I/O.
# Partition strategies: pure functions (specs, shard_size, alignment) -> PartitionPlan.
"""Partition strategies and their registry.

A strategy decides which shard rank owns which elements. It is any callable
matching :class:`PartitionStrategy`; the simplest way to write one is to compute
``(param, span, rank)`` ownership and hand it to
:func:`~zeroplan.core.partition.plan_from_assignment`, which derives offsets and
validates the result::

    from zeroplan.core import Span, plan_from_assignment, register_strategy

    def round_robin(specs, shard_size, alignment):
        pieces = [(s.index, Span(0, s.numel), s.index % shard_size)
                  for s in specs if s.trainable]
        return plan_from_assignment(specs, shard_size, alignment, "round_robin", pieces)

    register_strategy("round_robin", round_robin)

``pytest property_tests --strategy mypkg.mymod:round_robin`` then runs the whole
property suite (exact cover, buckets, equivalence with ``torch.optim``) on it.

Built-in strategies partition each dtype space independently:

* ``flat_even`` — concatenate, cut into alignment units, give every rank a
  contiguous run of ``floor`` or ``ceil`` of ``units / N`` units (the larger
  runs last, where the final partial unit falls): owned sizes differ by at most
  one alignment unit. Parameters are split (apex / Megatron / DeepSpeed ZeRO-2).
* ``greedy_whole`` — whole parameters in the given order, each to the least
  loaded rank (fairscale OSS).
* ``lpt_whole`` — whole parameters largest first (longest processing time),
  each to the least loaded rank (InternLM).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Protocol

from zeroplan.core.errors import ConfigError, check_config
from zeroplan.core.partition import PartitionPlan, plan_from_assignment
from zeroplan.core.span import Span
from zeroplan.core.specs import ParamSpec, check_specs

__all__ = [
    "PartitionStrategy",
    "flat_even",
    "get_strategy",
    "greedy_whole",
    "lpt_whole",
    "register_strategy",
    "strategy_names",
]


class PartitionStrategy(Protocol):
    """A pure function from parameter specs to a partition plan.

    Args:
        specs: the parameters (frozen ones must be left unowned).
        shard_size: ranks in the shard group (``>= 1``).
        alignment: shard allocation multiple, in elements (``>= 1``).

    Returns:
        A :class:`PartitionPlan` owning every trainable element exactly once.
    """

    def __call__(self, specs: Sequence[ParamSpec], shard_size: int, alignment: int) -> PartitionPlan: ...


_REGISTRY: dict[str, PartitionStrategy] = {}


def register_strategy(name: str, strategy: PartitionStrategy, *, replace: bool = False) -> None:
    """Register ``strategy`` under ``name`` (the CLI and facade look names up here).

    Raises:
        ConfigError: ``name`` is taken and ``replace`` is false.
    """
    if name in _REGISTRY and not replace and _REGISTRY[name] is not strategy:
        raise ConfigError(f"strategy {name!r} is already registered; pass replace=True to override it")
    _REGISTRY[name] = strategy


def get_strategy(name: str) -> PartitionStrategy:
    """The strategy registered as ``name``.

    Raises:
        ConfigError: no strategy has that name (the message lists the known ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown partition strategy {name!r}; registered: {', '.join(strategy_names())}"
        ) from None


def strategy_names() -> tuple[str, ...]:
    """Names of the registered strategies, in registration order."""
    return tuple(_REGISTRY)


def _check_args(specs: Sequence[ParamSpec], shard_size: int, alignment: int) -> tuple[ParamSpec, ...]:
    check_config(
        type(shard_size) is int and shard_size >= 1, f"shard size must be an int >= 1, got {shard_size!r}"
    )
    check_config(
        type(alignment) is int and alignment >= 1,
        f"alignment must be an int >= 1 (elements), got {alignment!r}",
    )
    return check_specs(specs)


def _spaces(specs: Sequence[ParamSpec]) -> dict[str, list[ParamSpec]]:
    """Trainable specs grouped by dtype, in index order."""
    spaces: dict[str, list[ParamSpec]] = {}
    for spec in specs:
        if spec.trainable:
            spaces.setdefault(spec.dtype, []).append(spec)
    return spaces


def flat_even(specs: Sequence[ParamSpec], shard_size: int, alignment: int) -> PartitionPlan:
    """Contiguous, even split of each dtype space; may split parameters.

    Example:
        >>> from zeroplan.core.specs import specs_from_shapes
        >>> plan = flat_even(specs_from_shapes([(10,), (7,)]), 2, 4)
        >>> plan.spaces[0].owned, plan.splits_params
        ((8, 9), True)
    """
    specs = _check_args(specs, shard_size, alignment)
    pieces: list[tuple[int, Span, int]] = []
    for members in _spaces(specs).values():
        total = sum(s.numel for s in members)
        units = -(-total // alignment)
        base, extra = divmod(units, shard_size)
        bounds = [0]
        for r in range(shard_size):
            run = base + (1 if r >= shard_size - extra else 0)
            bounds.append(min(total, bounds[-1] + run * alignment))
        offset = 0
        for spec in members:
            if spec.numel == 0:
                # Owned by the rank holding the element at its position (the last one at the end).
                rank = bisect_right(bounds, min(offset, total - 1)) - 1 if total else 0
                pieces.append((spec.index, Span(0, 0), rank))
                continue
            start = 0
            while start < spec.numel:
                rank = bisect_right(bounds, offset + start) - 1
                stop = min(spec.numel, bounds[rank + 1] - offset)
                pieces.append((spec.index, Span(start, stop), rank))
                start = stop
            offset += spec.numel
    return plan_from_assignment(specs, shard_size, alignment, "flat_even", pieces)


def _whole(
    name: str,
    order: Callable[[list[ParamSpec]], list[ParamSpec]],
    specs: Sequence[ParamSpec],
    shard_size: int,
    alignment: int,
) -> PartitionPlan:
    """Whole parameters, taken in ``order``, each to the least-loaded rank (lowest on ties)."""
    specs = _check_args(specs, shard_size, alignment)
    pieces: list[tuple[int, Span, int]] = []
    for members in _spaces(specs).values():
        loads = [(0, r) for r in range(shard_size)]  # a heap of (load, rank)
        for spec in order(members):
            load, rank = heapq.heappop(loads)
            pieces.append((spec.index, Span(0, spec.numel), rank))
            heapq.heappush(loads, (load + spec.numel, rank))
    return plan_from_assignment(specs, shard_size, alignment, name, pieces)


def greedy_whole(specs: Sequence[ParamSpec], shard_size: int, alignment: int) -> PartitionPlan:
    """Whole parameters in the given order, each to the least-loaded rank (fairscale OSS).

    Example:
        >>> from zeroplan.core.specs import specs_from_shapes
        >>> greedy_whole(specs_from_shapes([(3,), (5,), (2,)]), 2, 1).spaces[0].owned
        (5, 5)
    """
    return _whole("greedy_whole", list, specs, shard_size, alignment)


def lpt_whole(specs: Sequence[ParamSpec], shard_size: int, alignment: int) -> PartitionPlan:
    """Whole parameters, largest first, each to the least-loaded rank (InternLM).

    Example:
        >>> from zeroplan.core.specs import specs_from_shapes
        >>> lpt_whole(specs_from_shapes([(1,), (1,), (2,)]), 2, 1).spaces[0].owned
        (2, 2)
    """

    def largest_first(members: list[ParamSpec]) -> list[ParamSpec]:
        return sorted(members, key=lambda s: (-s.numel, s.index))

    return _whole("lpt_whole", largest_first, specs, shard_size, alignment)


register_strategy("flat_even", flat_even)
register_strategy("greedy_whole", greedy_whole)
register_strategy("lpt_whole", lpt_whole)
