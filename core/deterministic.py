# zeroplan.core — pure planning: no torch, no I/O.
# Deterministic mode: the orders in which a step adds, fixed so that the split of work cannot change a bit.
"""Deterministic mode: sums in canonical orders, independent of world, stage, layout and buckets.

[Note: deterministic mode]
``ZeroOptimizer(deterministic=True)`` promises: split a step's global batch
into G canonical micro-batches (G a power of two, fixed for the run); rank
``r`` of W (W a power of two dividing G) runs micro-batches
``r*G/W ... (r+1)*G/W - 1`` in order, ``no_sync()`` around all but its last
backward, each loss divided by the G/W micro-batches it runs. Then after
every step the parameters, fp32 masters, optimizer state, the norm
``clip_grad_norm_`` returns and the loss scale are bit-identical to one
process running all G micro-batches, at any stage, shard group size, layout,
bucket size, overlap setting and collective policy.

Every floating-point sum of a step is made canonical:

* **Micro-batches.** Autograd folds gradients into ``.grad`` left to right;
  the optimizer instead takes each micro-batch's gradient from its hook and
  adds them as a complete binary tree over micro-batch indices. A rank's
  micro-batches are a whole subtree, so a stack of partial sums (a binary
  counter, :func:`merges_after`) computes its root; a parameter that got no
  gradient in a micro-batch contributes ``+0``.
* **Ranks.** A bucket is reduced by an all-to-all exchange (each rank sends
  each peer the peer's piece, :attr:`Collective.ALL_TO_ALL`, the bytes of a
  reduce-scatter) and the receiver adds the W pieces as a binary tree in rank
  order (:func:`tree_steps`); shard groups are contiguous ranks, so a shard
  group's sum is a subtree and the replicas' sums (MiCS) are gathered and
  added as the tree's top levels. Each leaf of the rank tree is W times the
  world-1 leaf (the loss is divided by G/W, not G: a power of two, exact), and
  the sum is divided by W afterwards, exactly, as in the default mode. With a
  loss scale (fp16) ``opt.backward`` multiplies by scale/W instead, so the
  backward itself computes the world-1 values (a gradient subnormal in fp16
  there is here too) and the sum is divided by the scale only.
* **The clip norm.** ``|g|^p`` is summed exactly, so in any order: each value
  (fp64) is cut into three integer limbs of :data:`NORM_LIMB_BITS` bits below
  the largest value's power of two (one all-reduce, ``MAX``), the limbs are
  summed as int64 (associative), over ranks by one all-reduce, and the root is
  taken of the total. It agrees with ``torch.linalg.vector_norm`` within its
  rounding, and is the same bits whatever holds which element.

Parameter gathers copy and need nothing. What the mode needs from the user:
deterministic forward and backward kernels (on CUDA,
``torch.use_deterministic_algorithms(True)``; on CPU the same intra-op thread
count in every run, since kernels split their sums by thread: torchrun sets
``OMP_NUM_THREADS=1`` for several processes and not for one), the same G
micro-batches in the same order, and a power-of-two world: a non-power-of-two
world (so shard or replica group) is refused at construction, because its
ranks' micro-batches cannot be whole subtrees of the canonical tree. A rank
whose count of backward passes in a step is not a power of two, or ranks whose
counts differ, make the step agreement raise on every rank (that the count is
G/W is the user's part); fp16 needs a loss scale.
Expert groups are refused: with expert parallelism an expert's backward adds
the tokens of several ranks' micro-batches inside one matmul, an order the
model's dispatch decides, so its gradient is no sum of per-micro-batch
gradients the optimizer could order. The cost is the exchange in
place of a reduce-scatter (the same bytes) with room for every peer's piece
(:func:`~zeroplan.core.arena.staging_layout`), the replica sums gathered
rather than all-reduced, up to ``log2(G/W)`` partial sums of the gradients
while accumulating (:func:`~zeroplan.core.memory.accumulation_bytes`), and the exact norm's passes
over one chunk at a time (:func:`exact_norm_transient`), all planned. The
default mode is unchanged.
"""

from __future__ import annotations

from zeroplan.core.errors import ConfigError

__all__ = [
    "EXACT_NORM_BYTES_PER_ELEMENT",
    "EXACT_NORM_CHUNK",
    "EXACT_NORM_ELEMENTS",
    "NORM_LIMBS",
    "NORM_LIMB_BITS",
    "check_power_of_two",
    "exact_norm_transient",
    "partial_sums_held",
    "is_power_of_two",
    "merges_after",
    "tree_steps",
]

#: Bits per integer limb of the exact norm: 2**(63 - 22) leaves room for 2**40 elements per sum.
NORM_LIMB_BITS = 22
#: Limbs per value: 66 bits below the largest value's power of two are kept; smaller parts are dropped.
NORM_LIMBS = 3
#: Elements the exact norm converts to fp64 at a time (1 Mi: a few launches per shard on a GPU, 16 MiB
#: transient at most): its transient memory is
#: :data:`EXACT_NORM_BYTES_PER_ELEMENT` bytes for each (an fp64 value and its int64 whole part).
EXACT_NORM_CHUNK = 1 << 20
EXACT_NORM_BYTES_PER_ELEMENT = 16
#: Elements (8 bytes each) of each of the exact norm's two all-reduces: the largest value and NaN and
#: infinity flags (fp64, ``MAX``), then the limbs' sums (int64, ``SUM``).
EXACT_NORM_ELEMENTS = 3


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is 1, 2, 4, ..."""
    return n >= 1 and n & (n - 1) == 0


def check_power_of_two(what: str, n: int) -> None:
    """Raise unless ``n`` is a power of two (the canonical tree needs whole subtrees).

    Raises:
        ConfigError: ``n`` is not a power of two; the message says why and what works.
    """
    if not is_power_of_two(n):
        below, above = 1 << (n.bit_length() - 1), 1 << n.bit_length()
        raise ConfigError(
            f"deterministic=True needs a power-of-two {what}, got {n}: each rank's micro-batches "
            "must be a whole subtree of the canonical summation tree ([Note: deterministic mode]); "
            f"use {below} or {above}, or deterministic=False"
        )


def merges_after(leaf: int) -> int:
    """How many pairs a binary counter adds after pushing 0-based leaf ``leaf``.

    The stack then holds one partial sum per set bit of ``leaf + 1``, each the
    root of a complete subtree; after leaf ``2**k - 1`` it holds one, the root.

    Example:
        >>> [merges_after(k) for k in range(8)]
        [0, 1, 0, 2, 0, 1, 0, 3]
    """
    n = leaf + 1
    return (n & -n).bit_length() - 1


def tree_steps(n: int) -> tuple[tuple[int, int], ...]:
    """The additions of a binary tree over ``n`` slots (``n`` a power of two): ``slot[a] += slot[b]``.

    Level by level, adjacent pairs: the sum ends in slot 0.

    Example:
        >>> tree_steps(4)
        ((0, 1), (2, 3), (0, 2))
    """
    if not is_power_of_two(n):
        raise ConfigError(f"a summation tree needs a power-of-two number of slots, got {n}")
    steps: list[tuple[int, int]] = []
    width = 1
    while width < n:
        steps.extend((a, a + width) for a in range(0, n, 2 * width))
        width *= 2
    return tuple(steps)


def exact_norm_transient(extents: list[int] | tuple[int, ...]) -> int:
    """Bytes the exact norm allocates at once on a rank whose shards have ``extents`` elements.

    Example:
        >>> exact_norm_transient([10, 300_000])   # 16 bytes per element of the largest shard
        4800000
        >>> exact_norm_transient([10, 3_000_000])  # ... up to a chunk
        16777216
    """
    largest = min(EXACT_NORM_CHUNK, max(extents, default=0))
    return EXACT_NORM_BYTES_PER_ELEMENT * largest


def partial_sums_held(micro_batches: int) -> int:
    """The most partial sums per parameter a rank holds between two of its ``micro_batches``
    backward passes in deterministic mode: one per set bit of the count done, at most ``log2``.

    Example:
        >>> [partial_sums_held(m) for m in (1, 2, 4, 8)]
        [0, 1, 2, 3]
    """
    check_power_of_two("number of micro-batches per rank", micro_batches)
    return max((bin(done).count("1") for done in range(1, micro_batches)), default=0)
