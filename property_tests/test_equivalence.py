"""The plan executed on virtual ranks equals the unsharded ``torch.optim`` optimizer, bit for bit.

One process plays every rank. Each step:

1. every world rank gets its own random fp32 gradients (from a Hypothesis-drawn seed);
2. the reference averages them (:func:`~property_tests.virtual.average`) and steps the real
   ``torch.optim`` class on the full parameters, one param group per spec group;
3. the sharded run reduces the same gradients through the plan's buckets (staging copies, sum,
   pieces), so each shard rank receives exactly its shard of the mean; it steps the same
   ``torch.optim`` class, with the same per-group hyper-parameters and ``foreach`` setting, on
   the tensors ``ZeroPlan.inner_tensors(rank)`` describes — views of the rank's flat shard (one
   window per run of a param group for elementwise optimizers, whole parameters otherwise);
4. the shards are gathered block by block through the full buffer and compared with ``torch.equal``.

Both layouts run ([Note: layout]): ``"auto"`` interleaves the built-in strategies (equal pieces of
every block for ``flat_even``, whole parameters balanced per block otherwise, padding between and
inside the pieces), ``"rank_major"`` keeps one region per rank. Padding starts as NaN, is stepped
with the NaN gradients its staging padding reduces to, and is gathered, so a parameter that
reached into it would differ.

Dtypes: specs are drawn with several dtype names so the plans have several dtype spaces, but
every tensor is float32 — what the facade steps for bf16/fp16 spaces is their fp32 master shard,
so an fp32 run of each space is exactly the optimizer's arithmetic.

Also checked on the way: the reduced gradient shards equal the mean sliced by the plan, the
optimizer state of every shard equals the reference's state sliced the same way, and the bytes
of state torch really allocates equal ``memory_report(...).optimizer_state_bytes``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, example, given, note
from hypothesis import strategies as st

from property_tests.strategies import (
    ELEMENTWISE,
    alignments,
    bucket_caps,
    budget,
    optimizer_setups,
    param_specs,
    seeds,
    small_shapes,
    topologies,
)
from property_tests.virtual import average, gather, held, make_plan, reduce_buckets, shard
from zeroplan.core import ConfigError, Topology, describe_optimizer, memory_report, plan, specs_from_shapes

STEPS = 3


def _groups(specs) -> int:
    return 1 + max((s.group for s in specs), default=0)


def _difference(a, b):
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if not a.numel():
        return "empty tensors"
    return f"max abs difference {(a - b).abs().max().item():.3g} over {int((a != b).sum())} elements"


def _state_tensors(state: dict) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor)]


def run_equivalence(zp, name, hyper, foreach, seed):
    """Step reference and sharded optimizers side by side; assert bit-exact agreement."""
    specs, topology, part = zp.specs, zp.topology, zp.partition
    cls = getattr(torch.optim, name)
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s.shape, generator=generator) for s in specs]

    # Reference: the full parameters, one group per spec group (trainable only).
    reference = [p.clone() for p in params]
    ref_groups = []
    for g, options in enumerate(hyper):
        members = [reference[s.index] for s in specs if s.trainable and s.group == g]
        if members:
            ref_groups.append({"params": members, **options})
    ref_opt = cls(ref_groups, foreach=foreach) if ref_groups else None

    # Sharded: per rank, its flat shards and the inner tensors as views of them.
    shards = shard(part, params)
    ranks = []
    for rank in range(part.shard_size):
        views, groups = [], {}
        for tensor in zp.inner_tensors(rank):
            view = shards[tensor.space][rank][tensor.shard_span.as_slice()].view(tensor.shape)
            views.append((tensor, view))
            groups.setdefault(tensor.group, []).append(view)
        opt_groups = [{"params": views_, **hyper[g]} for g, views_ in sorted(groups.items())]
        ranks.append((views, cls(opt_groups, foreach=foreach) if opt_groups else None))

    def usable(spec):  # torch's Adafactor divides by numel: zero-size parameters get no gradient
        return name != "Adafactor" or spec.numel > 0

    for step in range(STEPS):
        grads = [
            [torch.randn(s.shape, generator=generator) for s in specs] for _ in range(topology.world_size)
        ]
        # Reference step on the averaged gradients.
        for s in specs:
            if s.trainable:
                reference[s.index].grad = (
                    average([g[s.index] for g in grads], topology) if usable(s) else None
                )
        if ref_opt is not None:
            ref_opt.step()
        # Sharded step on the bucket-reduced gradients.
        grad_shards = reduce_buckets(part, zp.buckets, topology, grads)
        mean = [average([g[i] for g in grads], topology) for i in range(len(specs))]
        for space, got, want in zip(part.spaces, grad_shards, shard(part, mean), strict=True):
            for rank in range(part.shard_size):
                mine, expected = held(space, rank, got[rank]), held(space, rank, want[rank])
                assert torch.equal(mine, expected), f"reduced grads of rank {rank}"
        for rank, (views, opt) in enumerate(ranks):
            for tensor, view in views:
                grad = grad_shards[tensor.space][rank][tensor.shard_span.as_slice()].view(tensor.shape)
                whole = tensor.param is None or usable(specs[tensor.param])
                view.grad = grad if whole else None
            if opt is not None:
                opt.step()
        gathered = gather(part, shards, params)
        for s in specs:
            if s.trainable:
                assert torch.equal(gathered[s.index], reference[s.index]), (
                    f"step {step}: parameter {s.name} (shape {s.shape}) differs from torch.optim.{name}: "
                    f"{_difference(gathered[s.index], reference[s.index])}"
                )
            else:
                assert torch.equal(gathered[s.index], params[s.index]), f"frozen {s.name} changed"

    _compare_state(zp, ranks, ref_opt, reference)


def _compare_state(zp, ranks, ref_opt, reference):
    """Sharded optimizer state equals the reference's, and its size equals the memory report."""
    report = memory_report(zp)
    part = zp.partition
    for rank, (views, opt) in enumerate(ranks):
        allocated = 0
        for tensor, view in views:
            state = opt.state.get(view, {}) if opt is not None else {}
            allocated += sum(v.numel() * v.element_size() for v in _state_tensors(state))
            if tensor.param is not None:  # whole parameter: the states are the same tensors
                ref_state = ref_opt.state.get(reference[tensor.param], {})
                assert state.keys() == ref_state.keys()
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        assert torch.equal(value, ref_state[key]), f"state {key} of parameter {tensor.param}"
                continue
            # Window: every per-element state, cut at the fragments, equals the reference's slices.
            frags = [
                f
                for f in part.spaces[tensor.space].by_rank[rank]
                if tensor.shard_span.contains(f.shard_span) and f.param_span.numel
            ]
            for key, value in state.items():
                if not isinstance(value, torch.Tensor) or value.shape != view.shape:
                    continue
                for f in frags:
                    mine = value[f.shard_span.shift(-tensor.shard_span.start).as_slice()]
                    theirs = ref_opt.state[reference[f.param]][key].reshape(-1)[f.param_span.as_slice()]
                    assert torch.equal(mine, theirs), f"state {key} of parameter {f.param} on rank {rank}"
        if all(v.grad is not None for _, v in views):
            expected = report.ranks[rank].optimizer_state_bytes
            assert allocated == expected, (
                f"rank {rank}: torch allocated {allocated} B of state, report says {expected}"
            )


def _plan(specs, topology, strategy_name, name, hyper, alignment, bucket_bytes, stage, layout):
    optimizers = tuple(describe_optimizer(name, **options) for options in hyper)
    zp = plan(
        specs,
        topology,
        stage=stage,
        strategy=strategy_name,
        optimizer=optimizers,
        alignment=alignment,
        bucket_bytes=bucket_bytes,
        layout=layout,
    )
    return zp


#: ``"auto"`` interleaves every built-in strategy (and user strategies that keep parameters whole).
layouts = st.sampled_from(["auto", "rank_major"])


@st.composite
def cases(draw, name):
    """Specs (several dtype spaces, groups, cohorts, frozen and zero-size parameters) and hyper-parameters."""
    specs = draw(param_specs(shape=small_shapes(), min_size=1, max_size=6, many=False, cohorts=True))
    return specs, draw(optimizer_setups(name, _groups(specs)))


@pytest.mark.parametrize("name", ELEMENTWISE)
@budget(1.5)
@given(
    data=st.data(),
    topology=topologies(max_shard=5, max_replica=2),
    alignment=alignments,
    bucket_bytes=bucket_caps,
    stage=st.sampled_from([1, 2]),
    foreach=st.booleans(),
    seed=seeds,
    layout=layouts,
)
def test_elementwise_optimizers_match_torch(
    strategy_name, name, data, topology, alignment, bucket_bytes, stage, foreach, seed, layout
):
    """SGD / Adam / AdamW / Adagrad / RMSprop on the plan equal torch.optim on full parameters."""
    specs, hyper = data.draw(cases(name), label="specs and hyper-parameters")
    note(f"torch.optim.{name} groups={hyper} foreach={foreach}")
    zp = _plan(specs, topology, strategy_name, name, hyper, alignment, bucket_bytes, stage, layout)
    event(f"{zp.partition.layout}, parameters split: {zp.partition.splits_params}")
    run_equivalence(zp, name, hyper, foreach, seed)


@pytest.mark.parametrize("name", ELEMENTWISE)
@pytest.mark.parametrize(("foreach", "layout"), [(False, "rank_major"), (True, "auto")])
def test_odd_shapes_on_mics_match_torch(strategy_name, name, foreach, layout):
    """A fixed case: (17, 3) split by flat_even, a zero-size and a scalar parameter, 2 x 2 ranks.

    Interleaved (``"auto"``), the 40-byte cap makes blocks of 8 elements, 4 per rank: (17, 3) is
    cut at every piece, and the first block is padded at its front.
    """
    specs = specs_from_shapes([(17, 3), (0,), (), (5,)])
    hyper = [{"lr": 0.05, "weight_decay": 0.01}]
    zp = _plan(specs, Topology(world_size=4, shard_size=2), strategy_name, name, hyper, 4, 40, 2, layout)
    run_equivalence(zp, name, hyper, foreach, seed=0)


@budget(1.0)
@given(
    case=cases("Adafactor"),
    topology=topologies(max_shard=5, max_replica=2),
    alignment=alignments,
    bucket_bytes=bucket_caps,
    foreach=st.booleans(),
    seed=seeds,
    layout=layouts,
)
@example(  # flat_even splits (17, 3) here; the whole-parameter strategies do not
    case=(specs_from_shapes([(17, 3), (5,), (2, 2)]), [{"lr": 0.01}]),
    topology=Topology(world_size=2),
    alignment=1,
    bucket_bytes=64,
    foreach=False,
    seed=1,
    layout="auto",
)
def test_adafactor_needs_whole_parameters(
    strategy_name, case, topology, alignment, bucket_bytes, foreach, seed, layout
):
    """Adafactor (non-elementwise): equal to torch on whole-parameter plans, refused on splitting ones."""
    specs, hyper = case
    partition = make_plan(strategy_name, specs, topology.shard_size, alignment, layout, bucket_bytes)
    event(f"{partition.layout}, {'splits' if partition.splits_params else 'whole'} parameters")
    if partition.splits_params:
        split = next(s for s in specs if len(partition.fragments[s.index]) > 1)
        attempts = (
            lambda: plan(
                specs,
                topology,
                strategy=strategy_name,
                optimizer="Adafactor",
                alignment=alignment,
                bucket_bytes=bucket_bytes,
                layout=layout,
            ),
            lambda: _plan(
                specs, topology, strategy_name, "Adafactor", hyper, alignment, bucket_bytes, 2, layout
            ),
        )
        for attempt in attempts:
            with pytest.raises(ConfigError) as refused:
                attempt()
            message = str(refused.value)
            assert repr(split.name) in message, f"error does not name {split.name!r}: {message}"
            assert "whole-parameter strategy" in message and "lpt_whole" in message, message
        return
    zp = _plan(specs, topology, strategy_name, "Adafactor", hyper, alignment, bucket_bytes, 2, layout)
    assert not zp.elementwise
    run_equivalence(zp, "Adafactor", hyper, foreach, seed)
