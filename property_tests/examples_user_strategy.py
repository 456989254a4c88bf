"""Example user partition strategies, for ``--strategy`` (not registered on import).

Run the whole property suite against one::

    python -m pytest property_tests --strategy property_tests.examples_user_strategy:round_robin

* :func:`round_robin` — whole parameters, largest first, dealt to ranks 0, 1, ..., N-1, 0, ...
  per dtype space. Each round gives every rank one parameter no larger than the previous
  round's, so loads differ by at most the largest parameter: it passes the whole-parameter
  balance bound and the rest of the suite.
* :func:`round_robin_by_index` — whole parameters dealt in index order. Loads can differ by
  far more than the largest parameter (sizes ``100, 1, 100, 1, ...`` on two ranks put every
  100 on rank 0), so the suite's balance property rejects it: a demonstration that the suite
  catches a bad strategy, not a strategy to use.
"""

from __future__ import annotations

from zeroplan.core import ParamSpec, PartitionPlan, Span, plan_from_assignment


def _deal(specs, shard_size, alignment, name, order) -> PartitionPlan:
    pieces = []
    dtypes = dict.fromkeys(s.dtype for s in specs if s.trainable)
    for dtype in dtypes:
        members = order([s for s in specs if s.trainable and s.dtype == dtype])
        for position, spec in enumerate(members):
            pieces.append((spec.index, Span(0, spec.numel), position % shard_size))
    return plan_from_assignment(specs, shard_size, alignment, name, pieces)


def round_robin(specs: tuple[ParamSpec, ...], shard_size: int, alignment: int) -> PartitionPlan:
    """Whole parameters, largest first (ties by index), dealt round-robin over the shard ranks."""
    return _deal(
        specs, shard_size, alignment, "round_robin", lambda m: sorted(m, key=lambda s: (-s.numel, s.index))
    )


def round_robin_by_index(specs: tuple[ParamSpec, ...], shard_size: int, alignment: int) -> PartitionPlan:
    """Whole parameters dealt round-robin in index order (unbalanced; fails the balance property)."""
    return _deal(specs, shard_size, alignment, "round_robin_by_index", list)
