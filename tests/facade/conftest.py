"""Fixtures for multi-process facade tests (gloo, one thread per process)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_worker import DistPool


class Pools:
    """One reusable worker pool per world size; a pool that failed, or whose workers hold too many
    process groups (``DistPool.worn``), is replaced."""

    def __init__(self) -> None:
        self._pools: dict[int, DistPool] = {}

    def __call__(self, world: int) -> DistPool:
        pool = self._pools.get(world)
        if pool is None or pool.broken or pool.worn:
            if pool is not None:
                pool.close()
            pool = self._pools[world] = DistPool(world)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    """``pools(world).run(scenarios_train.train, *args)`` -> per-rank results."""
    p = Pools()
    yield p
    p.close()
