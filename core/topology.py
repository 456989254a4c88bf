# zeroplan.core — pure planning: no torch, no I/O.
# Rank enters only as an argument; groups are lists of ranks, never process groups.
"""``Topology``: world size, shard-group size and ranks per node.

[Note: shard and replica groups]
The data-parallel world is a ``replica x shard`` grid. Ranks ``g*k .. g*k+k-1``
(``k`` = shard size) form shard group ``g``: they split one copy of the optimizer
state. The ranks holding the same shard in different shard groups form a
replica group: ``{s, s+k, s+2k, ...}`` for shard rank ``s``. ``k == world`` is
plain ZeRO; ``k < world`` is MiCS. A plan's ranks are shard ranks ``0..k-1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroplan.core.errors import check_config

__all__ = ["Topology"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Data-parallel topology.

    Attributes:
        world_size: number of data-parallel ranks.
        shard_size: ranks per shard group (divides ``world_size``); defaults to
            the world (plain ZeRO).
        ranks_per_node: ranks sharing a node (fast links); defaults to the world.
        replica_size: ``world_size // shard_size`` (derived).

    Example:
        >>> t = Topology(world_size=8, shard_size=4)
        >>> t.replica_size, t.shard_group(5), t.replica_group(5)
        (2, (4, 5, 6, 7), (1, 5))
    """

    world_size: int
    shard_size: int | None = None
    ranks_per_node: int | None = None
    replica_size: int = field(init=False)

    def __post_init__(self) -> None:
        check_config(
            type(self.world_size) is int and self.world_size >= 1,
            f"world size must be an int >= 1, got {self.world_size!r}",
        )
        if self.shard_size is None:
            object.__setattr__(self, "shard_size", self.world_size)
        if self.ranks_per_node is None:
            object.__setattr__(self, "ranks_per_node", self.world_size)
        check_config(
            type(self.shard_size) is int and self.shard_size >= 1,
            f"shard size must be an int >= 1, got {self.shard_size!r}",
        )
        check_config(
            self.world_size % self.shard_size == 0,
            f"shard size {self.shard_size} does not divide world size {self.world_size}; "
            f"pick a divisor of {self.world_size} (world = shard x replica)",
        )
        check_config(
            type(self.ranks_per_node) is int and self.ranks_per_node >= 1,
            f"ranks per node must be an int >= 1, got {self.ranks_per_node!r}",
        )
        check_config(
            self.world_size % self.ranks_per_node == 0 or self.ranks_per_node >= self.world_size,
            f"ranks per node {self.ranks_per_node} does not divide world size {self.world_size}",
        )
        object.__setattr__(self, "replica_size", self.world_size // self.shard_size)

    def _check_rank(self, rank: int) -> None:
        check_config(0 <= rank < self.world_size, f"rank {rank} is outside world of size {self.world_size}")

    def shard_rank(self, rank: int) -> int:
        """Position of ``rank`` inside its shard group."""
        self._check_rank(rank)
        return rank % self.shard_size

    def replica_rank(self, rank: int) -> int:
        """Index of the shard group ``rank`` belongs to (its position in its replica group)."""
        self._check_rank(rank)
        return rank // self.shard_size

    def shard_group(self, rank: int) -> tuple[int, ...]:
        """Ranks of the shard group containing ``rank``."""
        first = self.replica_rank(rank) * self.shard_size
        return tuple(range(first, first + self.shard_size))

    def replica_group(self, rank: int) -> tuple[int, ...]:
        """Ranks of the replica group containing ``rank``."""
        return tuple(range(self.shard_rank(rank), self.world_size, self.shard_size))

    def shard_groups(self) -> tuple[tuple[int, ...], ...]:
        """All shard groups, in order (what every rank must create, in this order)."""
        return tuple(self.shard_group(g * self.shard_size) for g in range(self.replica_size))

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """All replica groups, in order."""
        return tuple(self.replica_group(s) for s in range(self.shard_size))

    def spans_nodes(self, ranks: tuple[int, ...]) -> bool:
        """Whether the group ``ranks`` crosses a node boundary."""
        return len({r // self.ranks_per_node for r in ranks}) > 1
