"""``plan`` and ``ZeroPlan``: settings, validation, inner tensors and fingerprints."""

from __future__ import annotations

import dataclasses

import pytest

from zeroplan.core import (
    ConfigError,
    InnerTensor,
    ParamSpec,
    Span,
    Stage,
    Topology,
    ZeroPlan,
    auto_strategy,
    describe_optimizer,
    flat_even,
    plan,
    plan_buckets,
    specs_from_shapes,
)

ODD = specs_from_shapes([(17, 257), (3,), (257, 17)], dtype="bf16")

#: Two param groups in two dtype spaces (fp32: p0, p2, p4; bf16: p1, p3).
GROUPED = (
    ParamSpec(index=0, name="p0", shape=(2, 3), dtype="fp32", group=0),
    ParamSpec(index=1, name="p1", shape=(4,), dtype="bf16", group=0),
    ParamSpec(index=2, name="p2", shape=(5, 1), dtype="fp32", group=1),
    ParamSpec(index=3, name="p3", shape=(3,), dtype="bf16", group=1),
    ParamSpec(index=4, name="p4", shape=(2,), dtype="fp32", group=1),
)


def rank_major_plan(*args, **kwargs):
    """``plan`` with the rank-major layout, whose numbers these tests compute by hand."""
    return plan(*args, layout="rank_major", **kwargs)


def test_defaults():
    zp = plan(ODD, Topology(world_size=4))
    assert zp.stage is Stage.GRADIENTS and zp.partition.strategy == "flat_even"
    assert zp.partition.alignment == 128 and zp.buckets.bucket_bytes == 25 * 2**20
    assert [o.name for o in zp.optimizers] == ["AdamW"] and zp.elementwise
    assert not zp.loss_scaling and zp.max_inflight_buckets == 2


def test_auto_strategy_follows_the_optimizer():
    assert auto_strategy(describe_optimizer("AdamW")) == "flat_even"
    assert auto_strategy(describe_optimizer("Adafactor")) == "lpt_whole"
    zp = plan(ODD, Topology(world_size=4), optimizer="Adafactor")
    assert zp.partition.strategy == "lpt_whole" and not zp.partition.splits_params and not zp.elementwise


@pytest.mark.parametrize("stage", [0, 1, 2, 3, Stage.PARAMETERS])
def test_stages(stage):
    zp = plan(ODD, Topology(world_size=4), stage=stage)
    assert zp.stage is Stage(stage) and isinstance(zp.stage, Stage)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"stage": 4}, "stage must be 0, 1, 2 or 3, got 4"),
        ({"stage": -1}, "stage must be 0, 1, 2 or 3, got -1"),
        ({"stage": "2"}, "stage must be 0, 1, 2 or 3, got '2'"),
        ({"strategy": "zigzag"}, "unknown partition strategy 'zigzag'"),
        ({"optimizer": "Lion"}, "unknown optimizer 'Lion'"),
        ({"optimizer": []}, "optimizer: pass a name, a spec or one spec per param group"),
        ({"alignment": 0}, "alignment must be an int >= 1 (elements), got 0"),
        ({"alignment": -128}, "got -128"),
        ({"bucket_bytes": 0}, "bucket size must be a positive number of bytes, got 0"),
        ({"bucket_bytes": -1}, "got -1"),
        ({"max_inflight_buckets": 0}, "max_inflight_buckets must be an int >= 1, got 0"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_value(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        plan(ODD, Topology(world_size=4), **kwargs)
    assert needle in str(info.value)


def test_a_splitting_plan_is_refused_for_a_non_elementwise_optimizer():
    with pytest.raises(ConfigError) as info:
        plan(ODD, Topology(world_size=4), optimizer="Adafactor", strategy="flat_even")
    message = str(info.value)
    assert "Adafactor is not elementwise" in message and "'flat_even' splits parameter 'p0'" in message
    assert "ranks (0, 1, 2)" in message and "lpt_whole" in message
    # A whole-parameter plan is fine, and so is flat_even when it happens not to split.
    plan(ODD, Topology(world_size=4), optimizer="Adafactor", strategy="greedy_whole")
    plan(specs_from_shapes([(128,), (128,)]), Topology(world_size=2), optimizer="Muon", strategy="flat_even")


def test_one_optimizer_per_param_group():
    amsgrad = describe_optimizer("AdamW", amsgrad=True)
    zp = plan(GROUPED, Topology(world_size=2), optimizer=[describe_optimizer("AdamW"), amsgrad], alignment=1)
    assert zp.optimizers[1].per_element == 3
    with pytest.raises(ConfigError, match="for each of 2 param groups, got 1"):
        plan(GROUPED, Topology(world_size=2), optimizer=[amsgrad])
    with pytest.raises(ConfigError, match="same inner optimizer"):
        plan(
            GROUPED,
            Topology(world_size=2),
            optimizer=[amsgrad, describe_optimizer("Adafactor")],
            strategy="lpt_whole",
        )


def test_zero_plan_checks_the_partition_matches_the_topology():
    p = flat_even(ODD, 4, 128)
    with pytest.raises(ConfigError, match="partition is for 4 shard ranks but the topology has shard size 2"):
        ZeroPlan(
            topology=Topology(world_size=4, shard_size=2),
            stage=Stage.GRADIENTS,
            partition=p,
            buckets=plan_buckets(p, 1024),
            optimizers=(describe_optimizer("AdamW"),),
        )
    with pytest.raises(ConfigError, match="stage must be 0, 1, 2 or 3, got 7"):
        ZeroPlan(
            topology=Topology(world_size=4),
            stage=7,  # type: ignore[arg-type]
            partition=p,
            buckets=plan_buckets(p, 1024),
            optimizers=(describe_optimizer("AdamW"),),
        )


def test_zero_plan_is_frozen_and_reports_frozen_bytes():
    specs = specs_from_shapes([(17, 257), (3,)], dtype="bf16", trainable=[True, False])
    zp = plan(specs, Topology(world_size=2))
    assert zp.frozen_bytes == 6 and zp.specs == specs
    with pytest.raises(dataclasses.FrozenInstanceError):
        zp.stage = Stage.DDP  # type: ignore[misc]


@pytest.mark.parametrize("strategy", ["flat_even", "lpt_whole", "greedy_whole"])
def test_trainable_indices_are_the_parameters_of_the_spaces(strategy):
    specs = (
        ParamSpec(index=0, name="a", shape=(17, 257)),
        ParamSpec(index=1, name="frozen", shape=(3,), trainable=False),
        ParamSpec(index=2, name="empty", shape=(0,), dtype="bf16"),
        ParamSpec(index=3, name="b", shape=(5,), dtype="bf16"),
        ParamSpec(index=4, name="frozen_empty", shape=(0,), trainable=False),
    )
    zp = plan(specs, Topology(world_size=3), strategy=strategy, alignment=8)
    assert zp.trainable_indices == zp.partition.trainable_indices == frozenset({0, 2, 3})
    assert zp.trainable_indices == {p for space in zp.partition.spaces for p in space.params}
    assert zp.trainable_indices == {s.index for s in zp.specs if s.trainable}
    assert isinstance(zp.trainable_indices, frozenset)
    assert "trainable_indices" not in repr(zp.partition)  # derived, kept out of the repr


def test_a_fully_frozen_plan_manages_nothing():
    zp = plan(specs_from_shapes([(4,), (2,)], trainable=[False, False]), Topology(world_size=2))
    assert zp.trainable_indices == frozenset() and zp.partition.spaces == ()


# ----------------------------------------------------------------- inner tensors
def test_elementwise_inner_tensors_are_one_window_per_space_and_group():
    zp = rank_major_plan(GROUPED, Topology(world_size=2), alignment=1)
    # fp32 space [p0*6 p2*5 p4*2] -> 6 | 7; bf16 space [p1*4 p3*3] -> 3 | 4.
    assert zp.partition.spaces[0].owned == (6, 7) and zp.partition.spaces[1].owned == (3, 4)
    assert zp.inner_tensors(0) == (
        InnerTensor(space=0, group=0, shard_span=Span(0, 6), shape=(6,)),
        InnerTensor(space=1, group=0, shard_span=Span(0, 3), shape=(3,)),
    )
    assert zp.inner_tensors(1) == (
        InnerTensor(space=0, group=1, shard_span=Span(0, 7), shape=(7,)),  # p2 and p4: one window
        InnerTensor(space=1, group=0, shard_span=Span(0, 1), shape=(1,)),  # p1's tail
        InnerTensor(space=1, group=1, shard_span=Span(1, 4), shape=(3,)),  # p3
    )


def test_non_elementwise_inner_tensors_are_whole_parameters():
    zp = plan(GROUPED, Topology(world_size=2), optimizer="Adafactor", alignment=1)
    assert zp.partition.strategy == "lpt_whole"
    # fp32: p0 (6) -> r0, p2 (5) -> r1, p4 (2) -> r1; bf16: p1 (4) -> r0, p3 (3) -> r1.
    assert zp.inner_tensors(0) == (
        InnerTensor(space=0, group=0, shard_span=Span(0, 6), shape=(2, 3), param=0),
        InnerTensor(space=1, group=0, shard_span=Span(0, 4), shape=(4,), param=1),
    )
    assert zp.inner_tensors(1) == (
        InnerTensor(space=0, group=1, shard_span=Span(0, 5), shape=(5, 1), param=2),
        InnerTensor(space=0, group=1, shard_span=Span(5, 7), shape=(2,), param=4),
        InnerTensor(space=1, group=1, shard_span=Span(0, 3), shape=(3,), param=3),
    )


def test_a_rank_that_owns_nothing_steps_nothing():
    zp = plan(specs_from_shapes([(3,)]), Topology(world_size=4), alignment=4)
    assert zp.partition.spaces[0].owned == (0, 0, 0, 3)
    assert zp.inner_tensors(0) == () and len(zp.inner_tensors(3)) == 1


@pytest.mark.parametrize("rank", [-1, 4])
def test_inner_tensors_reject_ranks_outside_the_shard_group(rank):
    zp = plan(ODD, Topology(world_size=8, shard_size=4))
    with pytest.raises(ConfigError, match=f"shard rank {rank} outside 0..3"):
        zp.inner_tensors(rank)


# ----------------------------------------------------------------- fingerprints
def test_fingerprint_covers_everything_ranks_must_agree_on():
    base = {"stage": 2, "alignment": 128, "bucket_bytes": 4096}
    topo = Topology(world_size=8, shard_size=4)
    variants = {
        "base": plan(ODD, topo, **base),
        "stage": plan(ODD, topo, **{**base, "stage": 1}),
        "world": plan(ODD, Topology(world_size=4, shard_size=4), **base),
        "strategy": plan(ODD, topo, **base, strategy="lpt_whole"),
        "optimizer": plan(ODD, topo, **base, optimizer="SGD"),
        "alignment": plan(ODD, topo, **{**base, "alignment": 64}),
        "buckets": plan(ODD, topo, **{**base, "bucket_bytes": 8192}),
        "loss_scaling": plan(ODD, topo, **base, loss_scaling=True),
        "inflight": plan(ODD, topo, **base, max_inflight_buckets=3),
        "specs": plan(specs_from_shapes([(17, 257), (3,), (257, 17)]), topo, **base),
    }
    prints = {name: zp.fingerprint() for name, zp in variants.items()}
    assert len(set(prints.values())) == len(prints), prints
    assert plan(ODD, topo, **base).fingerprint() == prints["base"]
