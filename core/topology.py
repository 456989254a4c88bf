# zeroplan.core — pure planning: no torch, no I/O.
# Rank enters only as an argument; groups are lists of ranks, never process groups.
"""``Topology``: world size, shard-group size and ranks per node.

[Note: shard and replica groups]
The data-parallel world is a ``replica x shard`` grid. Ranks ``g*k .. g*k+k-1``
(``k`` = shard size) form shard group ``g``: they split one copy of the optimizer
state. The ranks holding the same shard in different shard groups form a
replica group: ``{s, s+k, s+2k, ...}`` for shard rank ``s``. ``k == world`` is
plain ZeRO; ``k < world`` is MiCS. A plan's ranks are shard ranks ``0..k-1``.

[Note: nodes and links]
Nodes hold ``ranks_per_node`` consecutive ranks (``m``). A group of ranks talks
over the ``intra`` link when all of them share a node and over the ``inter``
link otherwise; every group zeroplan makes is an increasing run, so its link is
read off its first and last rank in O(1). When a shard group spans whole nodes
(``1 < m < k`` and ``m`` divides ``k``) the topology is *hierarchical*: the
shard group's ``k / m`` nodes each hold ``m`` consecutive shard ranks, and two
more kinds of groups split it (used by the two-hop parameter gather, see
[Note: hierarchical all-gather] in ``zeroplan.core.hierarchy``):

* node group: the shard group's ranks on one node (``m`` ranks, intra);
* cross-node group: the ranks at one position of their node, one per node of
  the shard group (``k / m`` ranks, inter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from zeroplan.core.errors import check_config

__all__ = ["Link", "Topology"]


class Link(str, Enum):
    """The link a group's traffic uses (see [Note: nodes and links])."""

    INTRA = "intra"
    """Every rank of the group is on one node."""
    INTER = "inter"
    """The group crosses a node boundary."""

    def __str__(self) -> str:
        return self.value


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

    def _link(self, first: int, last: int) -> Link:
        """The link of an increasing run of ranks from ``first`` to ``last``."""
        same = first // self.ranks_per_node == last // self.ranks_per_node
        return Link.INTRA if same else Link.INTER

    def shard_link(self, rank: int) -> Link:
        """The link of ``rank``'s shard group.

        Example:
            >>> t = Topology(world_size=12, shard_size=4, ranks_per_node=6)
            >>> [str(t.shard_link(r)) for r in (0, 4, 8)]
            ['intra', 'inter', 'intra']
        """
        first = self.replica_rank(rank) * self.shard_size
        return self._link(first, first + self.shard_size - 1)

    def replica_link(self, rank: int) -> Link:
        """The link of ``rank``'s replica group."""
        s = self.shard_rank(rank)
        return self._link(s, s + (self.replica_size - 1) * self.shard_size)

    @property
    def world_link(self) -> Link:
        """The link of the whole data-parallel group."""
        return self._link(0, self.world_size - 1)

    @property
    def hierarchical(self) -> bool:
        """Whether shard groups span whole nodes, so parameters are gathered in two hops.

        Example:
            >>> Topology(world_size=8, ranks_per_node=2).hierarchical
            True
            >>> Topology(world_size=8, shard_size=2, ranks_per_node=2).hierarchical  # one node each
            False
        """
        m = self.ranks_per_node
        return 1 < m < self.shard_size and self.shard_size % m == 0

    def _check_hierarchical(self) -> None:
        check_config(
            self.hierarchical,
            f"shard groups of {self.shard_size} with {self.ranks_per_node} ranks per node do not span "
            "whole nodes: there are no node and cross-node groups",
        )

    def node_group(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s shard group on its node (hierarchical topologies only)."""
        self._check_hierarchical()
        self._check_rank(rank)
        first = rank - rank % self.ranks_per_node
        return tuple(range(first, first + self.ranks_per_node))

    def cross_node_group(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s shard group at its position of their node, one per node.

        Example:
            >>> t = Topology(world_size=8, shard_size=4, ranks_per_node=2)
            >>> t.node_group(5), t.cross_node_group(5)
            ((4, 5), (5, 7))
        """
        self._check_hierarchical()
        first = self.replica_rank(rank) * self.shard_size
        return tuple(range(first + rank % self.ranks_per_node, first + self.shard_size, self.ranks_per_node))

    def node_position(self, rank: int) -> int:
        """Position of ``rank`` in its node group."""
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def cross_node_position(self, rank: int) -> int:
        """Position of ``rank`` in its cross-node group (which node of its shard group it is on)."""
        return self.shard_rank(rank) // self.ranks_per_node

    def node_groups(self) -> tuple[tuple[int, ...], ...]:
        """All node groups, in order (what every rank must create, in this order)."""
        self._check_hierarchical()
        return tuple(self.node_group(first) for first in range(0, self.world_size, self.ranks_per_node))

    def cross_node_groups(self) -> tuple[tuple[int, ...], ...]:
        """All cross-node groups, in order: by shard group, then by position in the node."""
        self._check_hierarchical()
        return tuple(
            self.cross_node_group(g * self.shard_size + local)
            for g in range(self.replica_size)
            for local in range(self.ranks_per_node)
        )
