"""Execute plans on virtual ranks in one process, with real tensors.

Each function does what the facade does with collectives, but on lists indexed by rank:

* :func:`make_plan` — a partition of a registered strategy, rank-major (what the strategy
  returns) or laid out by :func:`~zeroplan.core.build_partition` (``layout=``);
* :func:`shard` — cut full parameters into each rank's flat shard (fragments at their shard
  offsets, padding filled with NaN so that reading it anywhere poisons the result);
* :func:`gather` — rebuild full parameters from the shards through the full buffer of
  [Note: layout], block by block (each rank's piece of each block copied to its place in the
  buffer, padding included, each parameter a view at ``Space.buffer_offsets``);
* :func:`reduce_buckets` — reduce per-rank gradients bucket by bucket as [Note: buckets] says
  (staging buffers filled by the bucket's copies, padding left NaN, summed, each rank keeping
  its piece);
* :func:`average` — the reduction itself: sum over each shard group in rank order, then over
  the shard groups (the MiCS replica all-reduce), then divide by the world size. Reference
  and sharded runs both reduce with it, so their gradients agree bit for bit.
"""

from __future__ import annotations

import torch

from zeroplan.core import (
    BucketLayout,
    ConfigError,
    PartitionPlan,
    Space,
    Span,
    Topology,
    build_partition,
    get_strategy,
)


def make_plan(
    strategy_name: str,
    specs,
    shard_size: int,
    alignment: int,
    layout: str | None = None,
    bucket_bytes: int = 4096,
) -> PartitionPlan:
    """The registered strategy's plan (``layout=None``), or ``build_partition``'s in ``layout``.

    With ``layout="interleaved"`` a strategy that splits parameters (which keeps its rank-major
    layout) is laid out by ``"auto"`` instead.
    """
    if layout is None:
        plan = get_strategy(strategy_name)(specs, shard_size, alignment)
    else:
        try:
            plan = build_partition(specs, shard_size, alignment, bucket_bytes, strategy_name, layout)
        except ConfigError:
            if layout != "interleaved":
                raise
            plan = build_partition(specs, shard_size, alignment, bucket_bytes, strategy_name, "auto")
            assert plan.layout == "rank_major" and plan.splits_params
    assert isinstance(plan, PartitionPlan), f"{strategy_name} returned {type(plan).__name__}"
    assert plan.specs == tuple(specs), f"{strategy_name} returned a plan for other specs"
    assert plan.shard_size == shard_size and plan.alignment == alignment
    return plan


def held(space: Space, rank: int, flat: torch.Tensor) -> torch.Tensor:
    """The parameter elements of rank ``rank``'s shard ``flat``, in shard order (padding left out)."""
    parts = [flat[f.shard_span.as_slice()] for f in space.by_rank[rank]]
    return torch.cat(parts) if parts else flat[:0]


def assert_tiles(spans, total: int, what: str) -> None:
    """The non-empty ``spans`` cover ``[0, total)`` exactly once (no gap, no overlap)."""
    position = 0
    for span in sorted((s for s in spans if s.numel), key=lambda s: s.start):
        assert isinstance(span, Span)
        assert span.start == position, (
            f"{what}: {'overlap' if span.start < position else 'gap'} at {position} ({span})"
        )
        position = span.stop
    assert position == total, f"{what}: covers [0, {position}) of [0, {total})"


__all__ = ["assert_tiles", "average", "gather", "held", "make_plan", "reduce_buckets", "shard"]


def shard(plan: PartitionPlan, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``shards[space][rank]``: the rank's flat shard (``shard_numel`` long, NaN padding)."""
    shards = []
    for space in plan.spaces:
        dtype = params[space.params[0]].dtype
        per_rank = []
        for rank in range(plan.shard_size):
            flat = torch.full((space.shard_numel[rank],), float("nan"), dtype=dtype)
            for frag in space.by_rank[rank]:
                flat[frag.shard_span.as_slice()] = params[frag.param].reshape(-1)[frag.param_span.as_slice()]
            per_rank.append(flat)
        shards.append(per_rank)
    return shards


def gather(plan: PartitionPlan, shards: list[list[torch.Tensor]], params: list[torch.Tensor]) -> list:
    """Full parameters rebuilt from ``shards``; frozen ones are taken from ``params``.

    Every block of the full buffer is gathered whole, padding included (as the facade's
    collectives do), so a parameter view that reaches into padding reads NaN.
    """
    out = list(params)
    for space, per_rank in zip(plan.spaces, shards, strict=True):
        buffer = torch.full((space.buffer_numel,), float("inf"), dtype=per_rank[0].dtype)
        for block in space.blocks:
            for rank in range(plan.shard_size):
                piece = block.piece(rank)
                buffer[piece.buffer_span.as_slice()] = per_rank[rank][piece.shard_span.as_slice()]
        assert not torch.isinf(buffer).any(), "the blocks do not tile the full buffer"
        for param, offset in zip(space.params, space.buffer_offsets, strict=True):
            spec = plan.specs[param]
            out[param] = buffer[offset : offset + spec.numel].view(spec.shape).clone()
    return out


def average(tensors: list[torch.Tensor], topology: Topology) -> torch.Tensor:
    """Mean over world ranks: shard groups in rank order, then across groups, then ``/ world``."""
    partial = []
    for group in topology.shard_groups():
        acc = tensors[group[0]].clone()
        for rank in group[1:]:
            acc += tensors[rank]
        partial.append(acc)
    total = partial[0]
    for acc in partial[1:]:
        total += acc
    return total / topology.world_size


def reduce_buckets(
    plan: PartitionPlan,
    layout: BucketLayout,
    topology: Topology,
    grads: list[list[torch.Tensor]],
) -> list[list[torch.Tensor]]:
    """Reduced gradient shards ``[space][rank]`` from per-world-rank gradients ``grads[w][param]``.

    Unfilled staging or shard elements stay NaN, so a bucket that misses an element (or a
    rank whose pieces do not tile its shard) shows up as a mismatch; padding (interleaved
    layouts) stays NaN too, so an element read from it poisons whatever uses it.
    """
    out = []
    for space in plan.spaces:
        dtype = grads[0][space.params[0]].dtype
        out.append([torch.full((n,), float("nan"), dtype=dtype) for n in space.shard_numel])
    for bucket in layout.buckets:
        dtype = out[bucket.space][0].dtype
        staging = []
        for rank_grads in grads:
            buf = torch.full((bucket.numel,), float("nan"), dtype=dtype)
            for copy in bucket.copies:
                source = rank_grads[copy.param].reshape(-1)[copy.param_span.as_slice()]
                buf[copy.staging_offset : copy.staging_offset + source.numel()] = source
            staging.append(buf)
        reduced = average(staging, topology)
        for piece in bucket.pieces:
            shard_of_rank = out[bucket.space][piece.rank]
            shard_of_rank[piece.shard_span.as_slice()] = reduced[piece.staging_span.as_slice()]
    return out
