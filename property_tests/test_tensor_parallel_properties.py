"""Tensor-parallel slices planned and stepped on virtual ranks equal the unsharded model, bit for bit.

[Note: tensor-parallel parameters] in ``zeroplan.core.tensor_parallel``. One process plays every
rank of a tp x dp job: global parameters of drawn shapes, each split along a drawn dimension or
replicated over a drawn tp degree (uneven splits and empty slices included: torch's ``chunk`` cuts
the test's tensors, ``core.tensor_parallel_specs`` the plan's shapes, so the two must agree). Each tp
rank's local tensors are planned over the dp ranks and stepped through the plan's buckets with the
slices of every dp rank's global gradients; joined back along their split dimension (a replica: every
tp rank's copy equal), they equal ``torch.optim`` stepping the global parameters on the averaged
gradients, bit for bit. The norm's windows ([``core.norm_windows``]) count every global element once:
the tp ranks' sums of squares add up to the global one.
"""

from __future__ import annotations

import torch
from hypothesis import given, note
from hypothesis import strategies as st

from property_tests.strategies import budget, seeds, small_shapes, topologies
from property_tests.virtual import average, gather, reduce_buckets, shard
from zeroplan.core import (
    describe_optimizer,
    norm_windows,
    plan,
    specs_from_shapes,
    tensor_parallel_specs,
    tensor_replicas,
)

STEPS = 2
HYPER = {"lr": 0.05, "weight_decay": 0.01}


@st.composite
def placed_models(draw):
    """Global shapes, a tp degree, and per parameter the dimension split over tp (or ``None``)."""
    shapes = draw(st.lists(small_shapes(), min_size=1, max_size=4))
    degree = draw(st.integers(1, 3))
    dims = [draw(st.one_of(st.none(), st.integers(0, len(s) - 1))) if s else None for s in shapes]
    return shapes, degree, dims


def _slice(tensor: torch.Tensor, dim: int | None, rank: int, degree: int) -> torch.Tensor:
    """torch's own cut of ``tensor``: chunk ``rank`` of ``degree`` along ``dim`` (empty past the last)."""
    if dim is None:
        return tensor.clone()
    chunks = tensor.chunk(degree, dim=dim)
    if rank < len(chunks):
        return chunks[rank].clone()
    shape = list(tensor.shape)
    shape[dim] = 0
    return tensor.new_empty(shape)


def _step_local(zp, params, grads_per_step, foreach):
    """The plan's virtual dp ranks stepping ``params`` (this tp rank's local tensors); the result gathered."""
    part = zp.partition
    shards = shard(part, params)
    ranks = []
    for rank in range(part.shard_size):
        views = []
        for tensor in zp.inner_tensors(rank):
            views.append(
                (tensor, shards[tensor.space][rank][tensor.shard_span.as_slice()].view(tensor.shape))
            )
        opt = torch.optim.AdamW([v for _, v in views], foreach=foreach, **HYPER) if views else None
        ranks.append((views, opt))
    for grads in grads_per_step:
        grad_shards = reduce_buckets(part, zp.buckets, zp.topology, grads)
        for rank, (views, opt) in enumerate(ranks):
            for tensor, view in views:
                view.grad = grad_shards[tensor.space][rank][tensor.shard_span.as_slice()].view(tensor.shape)
            if opt is not None:
                opt.step()
    return gather(part, shards, params), grad_shards


@budget(1.0)
@given(
    model=placed_models(),
    topology=topologies(max_shard=3, max_replica=2),
    seed=seeds,
    foreach=st.booleans(),
    stage=st.sampled_from([2, 3]),
)
def test_tensor_parallel_slices_step_as_the_global_model(model, topology, seed, foreach, stage):
    shapes, degree, dims = model
    note(f"shapes {shapes}, tp {degree}, split dims {dims}, stage {stage}")
    whole = specs_from_shapes(shapes)
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [
        [[torch.randn(s, generator=gen) for s in shapes] for _ in range(topology.world_size)]
        for _ in range(STEPS)
    ]
    reference = [p.clone() for p in params]
    ref_opt = torch.optim.AdamW(reference, foreach=foreach, **HYPER)
    for step in range(STEPS):
        for i, p in enumerate(reference):
            p.grad = average([g[i] for g in grads[step]], topology)
        ref_opt.step()

    locals_: list[list[torch.Tensor]] = []
    squares = 0.0
    for t in range(degree):
        specs = tensor_parallel_specs(whole, degree, t, dims)
        mine = [_slice(p, d, t, degree) for p, d in zip(params, dims, strict=True)]
        assert [tuple(m.shape) for m in mine] == [s.shape for s in specs]  # core's chunk rule is torch's
        zp = plan(specs, topology, stage=stage, optimizer=describe_optimizer("AdamW", **HYPER))
        my_grads = [
            [
                [_slice(g, d, t, degree) for g, d in zip(rank_grads, dims, strict=True)]
                for rank_grads in step_grads
            ]
            for step_grads in grads
        ]
        stepped, grad_shards = _step_local(zp, mine, my_grads, foreach)
        locals_.append(stepped)
        # The last step's averaged gradient, counted through the norm's windows on every dp shard rank.
        skip = tensor_replicas(specs) if t else frozenset()
        for s, space in enumerate(zp.partition.spaces):
            for rank in range(zp.partition.shard_size):
                windows = norm_windows(zp.partition, rank, [space.extent(rank)], skip)[0]
                flat = torch.zeros_like(grad_shards[s][rank])  # padding as the facade holds it: zeros
                for f in space.by_rank[rank]:
                    flat[f.shard_span.as_slice()] = grad_shards[s][rank][f.shard_span.as_slice()]
                squares += sum(float(flat[w.as_slice()].double().square().sum()) for w in windows)
    for i, d in enumerate(dims):
        joined = locals_[0][i] if d is None else torch.cat([m[i] for m in locals_], dim=d)
        if d is None:
            assert all(torch.equal(m[i], joined) for m in locals_), f"replica {i} differs between tp ranks"
        assert torch.equal(joined, reference[i]), f"parameter {i} (shape {shapes[i]}, split {d}) differs"
    mean = [average([g[i] for g in grads[-1]], topology) for i in range(len(shapes))]
    expected = sum(float(m.double().square().sum()) for m in mean)
    assert abs(squares - expected) <= 1e-9 * max(1.0, expected), (squares, expected)
