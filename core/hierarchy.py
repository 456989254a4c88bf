# zeroplan.core — pure planning: no torch, no I/O.
# The two-hop parameter gather of a hierarchical topology (MiCS): across nodes, then inside each.
"""Which buffer spans each hop of a hierarchical all-gather moves, and what it sends.

[Note: hierarchical all-gather]
When shard groups span whole nodes (``Topology.hierarchical``: ``k`` shard
ranks on ``a = k / m`` nodes of ``m``), a block of equal pieces ``p`` (one
``all_gather``, see [Note: layout]) is gathered in two hops, as DeepSpeed MiCS
does. Shard rank ``s = j*m + l`` sits at position ``l`` of node ``j``; the
block is ``a`` node chunks of ``m`` pieces each.

1. *Across nodes* (cross-node group, ``inter`` link): the ``a`` ranks at
   position ``l`` all-gather their pieces, one per node chunk. Each piece goes
   straight to its own place in the full buffer (a list all-gather: the places
   are ``m*p`` apart). A rank sends ``(a-1)*p``.
2. *Inside each node* (node group, ``intra`` link): one all-gather per node
   chunk ``j``, in place, each rank contributing the piece it received (or
   owns) at position ``l`` of the chunk. ``a`` calls; a rank sends ``a*(m-1)*p``.

Together ``(k-1)*p``: what the one-hop ring sends. The order is MiCS's and it
is chosen for the slow link: going across first, every element enters each
node once, so a rank sends ``(a-1)*p`` over ``inter``. Inside first, every
rank of a node would then fetch the same remote chunks, ``(a-1)*m*p`` over
``inter`` per rank, ``m`` times more (the inter hop would then move whole
contiguous chunks and need no list form, which is all it would buy). Hop 2
reads what hop 1 wrote, on another process group, so the facade waits for
hop 1 and leaves hop 2 in flight (MiCS waits for its inter-node gather too).
A gather moves values and does no arithmetic, so the result is bit-identical
to the one-hop gather. Broadcast gathers (unequal pieces) and the ``gloo``
policy's exchanges keep one hop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from zeroplan.core.errors import check_config, require
from zeroplan.core.space import Block
from zeroplan.core.span import Span
from zeroplan.core.topology import Link, Topology

__all__ = ["GatherCall", "HopSend", "TwoHopGather", "two_hop_gather", "two_hop_send"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GatherCall:
    """One all-gather of a hop: where each member's piece lies in the full buffer.

    Attributes:
        link: the link of the hop's group.
        position: this rank's position in the group.
        pieces: per group member, the span of the full buffer its piece fills;
            this rank's own is its input.
        sizes: per member, the elements of its piece (derived).

    Example:
        >>> call = GatherCall(link=Link.INTRA, position=1, pieces=(Span(8, 12), Span(12, 16)))
        >>> call.own, call.sizes, call.contiguous, call.span
        (Span(start=12, stop=16), (4, 4), True, Span(start=8, stop=16))
    """

    link: Link
    position: int
    pieces: tuple[Span, ...]
    sizes: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(s.numel for s in self.pieces))
        require(
            0 <= self.position < len(self.pieces),
            f"position {self.position} outside a gather of {len(self.pieces)} pieces",
        )

    @property
    def own(self) -> Span:
        """This rank's piece: the call's input."""
        return self.pieces[self.position]

    @property
    def contiguous(self) -> bool:
        """Whether the pieces follow each other (one ``all_gather_into_tensor`` fills them)."""
        return all(a.stop == b.start for a, b in zip(self.pieces, self.pieces[1:], strict=False))

    @property
    def span(self) -> Span:
        """The span the pieces fill, when they are contiguous."""
        require(self.contiguous, f"pieces {self.pieces} are not contiguous")
        return Span(self.pieces[0].start, self.pieces[-1].stop)


@dataclass(frozen=True, slots=True, kw_only=True)
class TwoHopGather:
    """The calls one rank makes to gather a block in two hops (see [Note: hierarchical all-gather]).

    Attributes:
        across: hop 1, on the cross-node group: one piece per node chunk.
        within: hop 2, on the node group: one call per node chunk, in chunk order.
    """

    across: GatherCall
    within: tuple[GatherCall, ...]

    def __post_init__(self) -> None:
        require(self.across.link is Link.INTER, "the first hop crosses nodes")
        require(all(c.link is Link.INTRA and c.contiguous for c in self.within), "the second hop is in place")
        require(
            tuple(c.own for c in self.within) == self.across.pieces,
            "each node chunk's gather starts from the piece the first hop delivered",
        )


def two_hop_gather(block: Block, topology: Topology, shard_rank: int) -> TwoHopGather:
    """The two hops shard rank ``shard_rank`` makes to gather ``block`` (equal pieces).

    Raises:
        ConfigError: the topology is not hierarchical or the pieces differ.

    Example:
        >>> t = Topology(world_size=4, ranks_per_node=2)
        >>> hops = two_hop_gather(Block(start=0, pieces=(3, 3, 3, 3), shard_starts=(0,) * 4), t, 1)
        >>> hops.across.pieces   # rank 1 and rank 3: position 1 of nodes 0 and 1
        (Span(start=3, stop=6), Span(start=9, stop=12))
        >>> [c.span for c in hops.within]
        [Span(start=0, stop=6), Span(start=6, stop=12)]
    """
    check_config(topology.hierarchical, f"{topology} does not gather in two hops")
    check_config(block.equal, f"a block of unequal pieces {block.pieces} is gathered by broadcasts")
    m = topology.ranks_per_node
    nodes = topology.shard_size // m
    node, local = divmod(shard_rank, m)

    def place(j: int, i: int) -> Span:
        return block.piece(j * m + i).buffer_span

    across = GatherCall(link=Link.INTER, position=node, pieces=tuple(place(j, local) for j in range(nodes)))
    within = tuple(
        GatherCall(link=Link.INTRA, position=local, pieces=tuple(place(j, i) for i in range(m)))
        for j in range(nodes)
    )
    return TwoHopGather(across=across, within=within)


class HopSend(NamedTuple):
    """Calls of one hop and the elements a rank sends in them."""

    link: Link
    calls: int
    elements: int


def two_hop_send(piece: int, topology: Topology) -> tuple[HopSend, HopSend]:
    """What every rank sends gathering one block of equal pieces of ``piece`` elements in two hops.

    The closed form of the cost model summed over :func:`two_hop_gather`'s
    calls (a test checks it); the same on every rank.

    Example:
        >>> t = Topology(world_size=8, ranks_per_node=2)   # 4 nodes of 2
        >>> [(str(h.link), h.calls, h.elements) for h in two_hop_send(10, t)]
        [('inter', 1, 30), ('intra', 4, 40)]
    """
    check_config(topology.hierarchical, f"{topology} does not gather in two hops")
    m = topology.ranks_per_node
    nodes = topology.shard_size // m
    return (
        HopSend(Link.INTER, 1, (nodes - 1) * piece),
        HopSend(Link.INTRA, nodes, nodes * (m - 1) * piece),
    )
