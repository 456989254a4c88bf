"""Execute plans on virtual ranks in one process, with real tensors.

Each function does what the facade does with collectives, but on lists indexed by rank:

* :func:`shard` — cut full parameters into each rank's flat shard (fragments in shard order,
  padding filled with NaN so that reading it anywhere poisons the result);
* :func:`gather` — rebuild full parameters from the shards through the rank-major buffer of
  [Note: layout] (each rank's region at ``Space.region``, each parameter a view at
  ``Space.buffer_offsets``);
* :func:`reduce_buckets` — reduce per-rank gradients bucket by bucket as [Note: buckets] says
  (staging buffers filled by the bucket's copies, summed, each rank keeping its piece);
* :func:`average` — the reduction itself: sum over each shard group in rank order, then over
  the shard groups (the MiCS replica all-reduce), then divide by the world size. Reference
  and sharded runs both reduce with it, so their gradients agree bit for bit.
"""

from __future__ import annotations

import torch

from zeroplan.core import BucketLayout, PartitionPlan, Span, Topology, get_strategy


def make_plan(strategy_name: str, specs, shard_size: int, alignment: int) -> PartitionPlan:
    """Run the registered strategy and check it answered for the question asked."""
    plan = get_strategy(strategy_name)(specs, shard_size, alignment)
    assert isinstance(plan, PartitionPlan), f"{strategy_name} returned {type(plan).__name__}"
    assert plan.specs == tuple(specs), f"{strategy_name} returned a plan for other specs"
    assert plan.shard_size == shard_size and plan.alignment == alignment
    return plan


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


__all__ = ["assert_tiles", "average", "gather", "make_plan", "reduce_buckets", "shard"]


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
    """Full parameters rebuilt from ``shards``; frozen ones are taken from ``params``."""
    out = list(params)
    for space, per_rank in zip(plan.spaces, shards, strict=True):
        buffer = torch.full((space.numel,), float("nan"), dtype=per_rank[0].dtype)
        for rank in range(plan.shard_size):
            buffer[space.region(rank).as_slice()] = per_rank[rank][: space.owned[rank]]
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
    rank whose pieces do not tile its shard) shows up as a mismatch.
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
