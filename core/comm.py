# zeroplan.core — pure planning: no torch, no I/O.
# The communication cost model: bytes a rank sends for one collective call.
"""Collectives and the cost model both the planner and the facade use.

[Note: cost model]
Bytes are counted as a bandwidth-optimal ring or chain implementation sends
them, per rank, so planned and measured traffic are computed by one function:

* ``reduce_scatter`` with per-rank pieces ``p`` (total ``M``): rank ``r`` sends
  ``M - p[r]`` (every element it does not own leaves it once). For equal pieces
  this is the ring's ``(N-1)/N * M``.
* ``reduce`` of ``M`` elements to a root: a chain ending at the root, every
  other rank sends ``M`` (the reduce-scatter rule with one non-empty piece).
* ``all_gather`` with pieces ``p``: rank ``r`` sends ``M - p[(r+1) % N]`` (the
  ring forwards every piece except its successor's). ``broadcast`` from ``q``
  is a chain ``q, q+1, ...``: everyone but ``q``'s predecessor sends ``M``; so
  one broadcast per rank costs the same as the ring all-gather.
* ``all_reduce`` of ``M``: a ring reduce-scatter then all-gather over the
  near-even split of ``M`` into ``N`` chunks.

Groups of one rank send nothing.

Every call is also labelled with the link its group uses, ``intra`` when the
group sits on one node and ``inter`` otherwise ([Note: nodes and links] in
``zeroplan.core.topology``). On a hierarchical topology the all-gather of
equal pieces is two hops, each an all-gather costed by the rule above on its
own group ([Note: hierarchical all-gather] in ``zeroplan.core.hierarchy``);
together they send what the one-hop ring sends.

[Note: control calls]
Besides moving gradients and parameters, a step makes small all-reduces that
keep the ranks in agreement; the plan lists them with the rest, so a report's
calls are every call a step makes (on NCCL each is a launch and a latency):

* the step agreement, every step at stages 1-3: ``STEP_AGREEMENT_ELEMENTS``
  integers of ``STEP_AGREEMENT_ITEMSIZE`` bytes over the world (a detached
  parameter, a gradient written back, the hyper-parameters' digest);
* the overflow verdict with loss scaling, and the clip norm when clipping:
  one fp32 scalar each over the shard group (over the world at stage 0);
* with several domains, the joint verdict and norm: one fp32 scalar each
  over domain 0's world (``DomainsReport.controls``).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from zeroplan.core.errors import ConfigError, check_config

__all__ = [
    "GATHERING",
    "REDUCING",
    "STEP_AGREEMENT_ELEMENTS",
    "STEP_AGREEMENT_ITEMSIZE",
    "Collective",
    "CollectivePolicy",
    "all_reduce_send",
    "even_split",
    "send_elements",
]


class Collective(str, Enum):
    """A collective operation, as named in plans and reports."""

    REDUCE_SCATTER = "reduce_scatter"
    """Equal pieces on every rank of the group (``reduce_scatter_tensor``)."""
    REDUCE_SCATTER_V = "reduce_scatter_v"
    """Uneven pieces, some possibly empty (list ``reduce_scatter``)."""
    REDUCE = "reduce"
    """A single rank owns the whole payload (``reduce`` to that rank)."""
    ALL_GATHER = "all_gather"
    """Equal pieces gathered onto every rank (``all_gather_into_tensor``)."""
    BROADCAST = "broadcast"
    """Uneven pieces gathered by one broadcast from each owning rank."""
    ALL_REDUCE = "all_reduce"
    """Sum of the whole payload on every rank."""
    ALL_TO_ALL = "all_to_all"
    """Each rank sends every peer the peer's piece; the receiver adds them in rank order
    (deterministic mode, [Note: deterministic mode]): a reduce-scatter's bytes."""

    def __str__(self) -> str:
        return self.value


class CollectivePolicy(str, Enum):
    """Which collectives a plan uses to reduce gradients and gather parameters.

    [Note: collective policy]
    ``MIN_BYTES`` (NCCL): each bucket is reduce-scattered (or reduced to its
    single owner) in the shard group, then all-reduced over the replica group;
    parameters are all-gathered (one broadcast per rank when shards differ in
    size). It sends the fewest bytes. ``GLOO``: a bucket of equal pieces (the
    interleaved layout) is reduce-scattered and a block of equal pieces is
    all-gathered too, sending the same bytes, but as a *point-to-point
    exchange*: every rank sends each peer the piece that peer owns (and, to
    gather, its own piece to every peer) with ``isend``/``irecv``, all in
    flight at once, and sums the pieces it received in rank order. gloo's own
    ``reduce_scatter``/``all_gather`` take two to three times as long as that
    exchange and its ``all_reduce`` as long as exchanging and gathering
    together (28 MiB, 2 and 4 processes on 2 cores, measured). The price is
    room for the ``N - 1`` received pieces after the bucket's gradients in
    each staging buffer (``StagingLayout.received``, planned in the peak). A
    bucket of uneven pieces is all-reduced over the whole data-parallel group
    (every rank keeps its piece) and a block of uneven pieces is broadcast by
    its owners: uneven exchanges would make some rank receive more. Exchanges
    gather in one hop on a hierarchical topology.
    """

    MIN_BYTES = "min_bytes"
    GLOO = "gloo"

    @property
    def point_to_point(self) -> bool:
        """Whether equal pieces move by point-to-point exchange (``GLOO``) rather than collectives."""
        return self is CollectivePolicy.GLOO

    def __str__(self) -> str:
        return self.value


#: Collectives where rank ``r`` sends ``total - pieces[r]``.
REDUCING = frozenset(
    {Collective.REDUCE_SCATTER, Collective.REDUCE_SCATTER_V, Collective.REDUCE, Collective.ALL_TO_ALL}
)
#: Collectives where rank ``r`` sends ``total - pieces[(r + 1) % N]``.
GATHERING = frozenset({Collective.ALL_GATHER, Collective.BROADCAST})


def even_split(total: int, parts: int) -> tuple[int, ...]:
    """Near-even split of ``total`` into ``parts`` chunks (first ones larger).

    Example:
        >>> even_split(10, 4)
        (3, 3, 2, 2)
    """
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def send_elements(collective: Collective, pieces: Sequence[int], rank: int) -> int:
    """Elements ``rank`` sends in one call of ``collective`` (see the cost model note).

    Args:
        collective: which collective.
        pieces: per group rank, the elements that rank owns (reduce-scatter,
            reduce, all-gather, broadcast); for all-reduce, the payload of
            every rank (all equal).
        rank: the sender's position in the group.

    Example:
        >>> send_elements(Collective.REDUCE_SCATTER, [4, 4, 4, 4], 0)
        12
        >>> send_elements(Collective.REDUCE, [0, 10, 0], 1), send_elements(Collective.REDUCE, [0, 10, 0], 0)
        (0, 10)
        >>> send_elements(Collective.ALL_REDUCE, [10, 10, 10, 10], 0)
        14
    """
    n = len(pieces)
    check_config(n >= 1 and 0 <= rank < n, f"rank {rank} is outside a group of {n} ranks")
    if n == 1:
        return 0
    if collective in REDUCING:
        return sum(pieces) - pieces[rank]
    if collective in GATHERING:
        return sum(pieces) - pieces[(rank + 1) % n]
    if collective is Collective.ALL_REDUCE:
        return all_reduce_send(pieces[rank], n, rank)
    raise ConfigError(f"unknown collective {collective!r}; pass a Collective member")


STEP_AGREEMENT_ELEMENTS = 4
"""Integers the step agreement all-reduces over the world each step ([Note: control calls])."""
STEP_AGREEMENT_ITEMSIZE = 8
"""Bytes of each (int64: the hyper-parameters' digest needs 64 bits)."""


def all_reduce_send(total: int, n: int, rank: int) -> int:
    """Elements ``rank`` sends in a ring all-reduce of ``total`` elements over ``n`` ranks.

    Example:
        >>> all_reduce_send(10, 4, 0), all_reduce_send(10, 4, 3)
        (14, 15)
    """
    if n == 1:
        return 0
    base, extra = divmod(total, n)
    own = base + (1 if rank < extra else 0)
    successor = base + (1 if (rank + 1) % n < extra else 0)
    return 2 * total - own - successor
