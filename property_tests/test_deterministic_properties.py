"""Deterministic mode on virtual ranks: every world reduces to world 1's bits ([Note: deterministic mode]).

One process plays every rank, with the pieces the facade runs in deterministic mode:

1. G canonical micro-batch gradients per parameter are drawn (in the parameters' dtype, some of
   them missing: a parameter a micro-batch did not use), as world 1 computes them; on W ranks the
   loss is divided by G/W instead of G, so each rank's leaves are W times larger (exact: a power of
   two);
2. world 1 adds all G leaves with :class:`~zeroplan.facade.mechanisms.accumulation.MicroBatchSums`,
   each world rank its own contiguous G/W;
3. each bucket of the W-rank plan is staged from each rank's sums (its copies), every shard rank
   receives every peer's copy of its piece, adds them in rank order
   (:func:`~zeroplan.core.deterministic.tree_steps`), then the replicas' sums in replica order, and
   divides by W in fp32 (the facade's averaging);
4. the clip norm runs :func:`~zeroplan.facade.mechanisms.exact_norm.exact_norm` on every virtual rank
   at once (threads meeting at a barrier play the all-reduces).

Each rank's reduced piece must equal world 1's gradient at the same elements, bit for bit, and every
rank's norm world 1's norm; both are close to ``torch.linalg.vector_norm``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from property_tests.strategies import budget, seeds, small_shapes
from zeroplan.core import Topology, plan, specs_from_shapes
from zeroplan.core.deterministic import tree_steps
from zeroplan.facade.mechanisms.accumulation import MicroBatchSums
from zeroplan.facade.mechanisms.exact_norm import exact_norm

pytestmark = pytest.mark.property

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _roots(
    leaves: list[list[torch.Tensor | None]], micro_batches: range, scale: float, specs, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Each parameter's tree sum of ``leaves[k][p]`` (times ``scale``) over ``micro_batches``."""
    sums = MicroBatchSums()
    for position, k in enumerate(micro_batches):
        for p, leaf in enumerate(leaves[k]):
            if leaf is not None:
                sums.add(p, leaf * scale, position)
    out = []
    for p, spec in enumerate(specs):
        root = sums.root(p, len(micro_batches))
        out.append(root if root is not None else torch.zeros(spec.shape, dtype=dtype))  # staged as zeros
    return out


def _staged(bucket, grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    staging = torch.zeros(bucket.numel, dtype=dtype)  # padding is reduced as zeros
    for copy in bucket.copies:
        source = grads[copy.param].reshape(-1)[copy.param_span.as_slice()]
        staging[copy.staging_offset : copy.staging_offset + source.numel()] = source
    return staging


def _tree(parts: list[torch.Tensor]) -> torch.Tensor:
    slots = [p.clone() for p in parts]
    for a, b in tree_steps(len(slots)):
        slots[a].add_(slots[b])
    return slots[0]


def _norms_on_virtual_ranks(parts_per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """``exact_norm`` on every rank at once; the all-reduces meet at a barrier (MAX, then SUM)."""
    n = len(parts_per_rank)
    barrier = threading.Barrier(n, timeout=30)  # a rank that raised breaks it for the others
    posted: list[torch.Tensor | None] = [None] * n
    results: list[torch.Tensor | None] = [None] * n

    def combine(rank: int, value: torch.Tensor, op) -> None:
        posted[rank] = value.clone()
        barrier.wait()
        total = posted[0]
        for other in posted[1:]:
            total = op(total, other)
        barrier.wait()
        value.copy_(total)

    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = norm_of(rank)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    def norm_of(rank: int) -> torch.Tensor:
        return exact_norm(
            parts_per_rank[rank],
            2.0,
            torch.device("cpu"),
            lambda v: combine(rank, v, torch.maximum),
            lambda v: combine(rank, v, torch.add),
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


@budget(1.0)
@given(
    shapes=st.lists(small_shapes(), min_size=1, max_size=6),
    world_and_shard=st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 4), (4, 2), (4, 1)]),
    log_g=st.integers(0, 3),
    dtype=st.sampled_from(sorted(DTYPES)),
    stage=st.sampled_from([1, 2, 3]),
    layout=st.sampled_from(["auto", "interleaved", "rank_major"]),
    bucket_bytes=st.sampled_from([16, 64, 256, 4096]),
    missing=st.floats(0.0, 0.5),
    seed=seeds,
)
def test_every_world_reduces_to_world_1s_bits(
    shapes, world_and_shard, log_g, dtype, stage, layout, bucket_bytes, missing, seed
):
    world, shard = world_and_shard
    micro_batches = max(world, 1 << log_g)
    specs = specs_from_shapes(shapes, dtype=dtype)
    topology = Topology(world_size=world, shard_size=shard)
    if layout == "interleaved" and stage == 1:
        layout = "auto"
    zp = plan(
        specs,
        topology,
        stage=stage,
        layout=layout,
        bucket_bytes=bucket_bytes,
        alignment=4,
        deterministic=True,
        loss_scaling=dtype == "float16",  # fp16 needs a loss scale in this mode
    )
    note(f"G={micro_batches} W={world} S={shard} {zp.partition.layout}, {len(zp.buckets.buckets)} buckets")
    torch_dtype = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    leaves: list[list[torch.Tensor | None]] = []
    for _ in range(micro_batches):
        row: list[torch.Tensor | None] = []
        for s in specs:
            value = (torch.randn(s.shape, generator=g) * 1e-2).to(torch_dtype)
            row.append(None if torch.rand((), generator=g).item() < missing else value)
        leaves.append(row)
    reference = _roots(leaves, range(micro_batches), 1.0, specs, torch_dtype)
    mine = micro_batches // world
    # A rank's loss is divided by G/W, not G: its leaves are W times world 1's, divided back after the
    # sum. With a loss scale (fp16) opt.backward divides by W itself: the leaves are world 1's.
    factor = 1 if dtype == "float16" else world
    ranks = [
        _roots(leaves, range(r * mine, (r + 1) * mine), float(factor), specs, torch_dtype)
        for r in range(world)
    ]

    n, replicas = topology.shard_size, topology.replica_size
    reduced: dict[tuple[int, int], torch.Tensor] = {}  # (world rank, bucket) -> the rank's averaged piece
    for bucket in zp.buckets.buckets:
        staged = [_staged(bucket, ranks[w], torch_dtype) for w in range(world)]
        expected = _staged(bucket, reference, torch_dtype).float()
        for s in range(n):
            piece = bucket.piece_of(s)
            if piece is None or piece.shard_span.numel == 0:
                continue
            window = piece.staging_span.as_slice()
            group_sums = [
                _tree([staged[group[q]][window] for q in range(n)]) for group in topology.shard_groups()
            ]
            total = _tree(group_sums) if replicas > 1 else group_sums[0]
            averaged = total.float() / factor
            assert torch.equal(averaged, expected[window]), f"bucket {bucket.index}, shard rank {s}"
            for group in range(replicas):
                reduced[(group * n + s, bucket.index)] = averaged

    full = torch.cat([r.float().reshape(-1) for r in reference])
    parts = [[v for (w, _), v in sorted(reduced.items()) if w == rank] for rank in range(n)]
    norms = _norms_on_virtual_ranks([p or [torch.zeros(0)] for p in parts])
    (alone,) = _norms_on_virtual_ranks([[full]])
    for rank, norm in enumerate(norms):
        assert torch.equal(norm, alone), f"rank {rank}: {norm.item()!r} != {alone.item()!r}"
    torch.testing.assert_close(alone, torch.linalg.vector_norm(full), rtol=1e-6, atol=0.0)
