"""Built-in partition strategies, checked by hand, and the strategy registry."""

from __future__ import annotations

import itertools

import pytest

from zeroplan.core import (
    ConfigError,
    Fragment,
    ParamSpec,
    PlanInvariantError,
    Span,
    Topology,
    flat_even,
    get_strategy,
    greedy_whole,
    lpt_whole,
    plan,
    plan_from_assignment,
    register_strategy,
    specs_from_shapes,
    strategy_names,
)
from zeroplan.core import strategies as strategies_module

STRATEGIES = [flat_even, greedy_whole, lpt_whole]


def _layout(p):
    """(rank, param, start, stop, shard_offset) of every fragment, in parameter order."""
    return [
        (f.rank, f.param, f.param_span.start, f.param_span.stop, f.shard_offset)
        for fr in p.fragments
        for f in fr
    ]


# ----------------------------------------------------------------- flat_even by hand
def test_flat_even_odd_matrix_over_four_ranks():
    p = flat_even(specs_from_shapes([(17, 257)]), 4, 128)
    (space,) = p.spaces
    # 4369 elements = 35 units of 128 (the last partial): 8, 9, 9, 9 units, larger runs last.
    assert space.owned == (1024, 1152, 1152, 1041)
    assert space.shard_numel == (1024, 1152, 1152, 1152)
    assert _layout(p) == [
        (0, 0, 0, 1024, 0),
        (1, 0, 1024, 2176, 0),
        (2, 0, 2176, 3328, 0),
        (3, 0, 3328, 4369, 0),
    ]
    assert p.splits_params and p.strategy == "flat_even"


def test_flat_even_splits_a_parameter_at_the_shard_boundary():
    p = flat_even(specs_from_shapes([(10,), (7,)]), 2, 4)
    # 17 elements = 5 units of 4: rank 0 gets 2 units, rank 1 gets 3 (the last one partial).
    assert p.spaces[0].owned == (8, 9) and p.spaces[0].shard_numel == (8, 12)
    assert _layout(p) == [(0, 0, 0, 8, 0), (1, 0, 8, 10, 0), (1, 1, 0, 7, 2)]


def test_flat_even_with_fewer_units_than_ranks_leaves_leading_ranks_empty():
    p = flat_even(specs_from_shapes([(3,), (2,)]), 4, 4)
    assert p.spaces[0].owned == (0, 0, 4, 1)
    assert p.spaces[0].shard_numel == (0, 0, 4, 4)
    assert _layout(p) == [(2, 0, 0, 3, 0), (2, 1, 0, 1, 3), (3, 1, 1, 2, 0)]
    assert p.rank_fragments(0, 0) == () and p.rank_fragments(0, 1) == ()


def test_flat_even_places_zero_size_parameters_with_the_owner_of_their_position():
    p = flat_even(specs_from_shapes([(0,), (5,), (0,), (3,), (0,)]), 3, 2)
    assert p.spaces[0].owned == (2, 2, 4)
    assert _layout(p) == [
        (0, 0, 0, 0, 0),  # at position 0: rank 0
        (0, 1, 0, 2, 0),
        (1, 1, 2, 4, 0),
        (2, 1, 4, 5, 0),
        (2, 2, 0, 0, 1),  # at position 5: rank 2
        (2, 3, 0, 3, 1),
        (2, 4, 0, 0, 4),  # at the end: the last element's owner
    ]


def test_flat_even_ignores_frozen_parameters_and_splits_each_dtype_space_separately():
    specs = (
        ParamSpec(index=0, name="a", shape=(8,), dtype="bf16"),
        ParamSpec(index=1, name="frozen", shape=(100,), trainable=False),
        ParamSpec(index=2, name="b", shape=(8,), dtype="bf16"),
        ParamSpec(index=3, name="c", shape=(6,), dtype="fp32"),
    )
    p = flat_even(specs, 2, 1)
    assert [(s.dtype, s.owned) for s in p.spaces] == [("bfloat16", (8, 8)), ("float32", (3, 3))]
    assert p.fragments[1] == ()
    assert _layout(p) == [(0, 0, 0, 8, 0), (1, 2, 0, 8, 0), (0, 3, 0, 3, 0), (1, 3, 3, 6, 0)]


@pytest.mark.parametrize(
    ("shapes", "n", "alignment"),
    [
        ([(17, 257)], 4, 128),
        ([(17, 257), (257, 17), (3,), (1,)], 7, 128),
        ([(1,)] * 13, 5, 1),
        ([(1000,), (3,)], 3, 16),
        ([(2,)], 8, 4),
    ],
)
def test_flat_even_owned_sizes_differ_by_at_most_one_alignment_unit(shapes, n, alignment):
    (space,) = flat_even(specs_from_shapes(shapes), n, alignment).spaces
    assert max(space.owned) - min(space.owned) <= alignment
    assert sum(space.owned) == space.numel
    assert all(s % alignment == 0 and s >= o for s, o in zip(space.shard_numel, space.owned, strict=True))


# ----------------------------------------------------------------- whole-parameter strategies
def test_greedy_whole_takes_parameters_in_order_to_the_least_loaded_rank():
    # fairscale OSS: rank = sizes.index(min(sizes)), i.e. the lowest rank on ties.
    p = greedy_whole(specs_from_shapes([(10,), (1,), (1,), (1,), (8,)]), 3, 1)
    # 10 -> r0; 1 -> r1; 1 -> r2; 1 -> r1 (1 < 10, tie 1 vs 1 broken low); 8 -> r2 (load 1)
    assert p.owner_ranks(0) + p.owner_ranks(1) + p.owner_ranks(2) + p.owner_ranks(3) + p.owner_ranks(4) == (
        0,
        1,
        2,
        1,
        2,
    )
    assert p.spaces[0].owned == (10, 2, 9)
    assert not p.splits_params and p.strategy == "greedy_whole"


def test_greedy_whole_docstring_case():
    assert greedy_whole(specs_from_shapes([(3,), (5,), (2,)]), 2, 1).spaces[0].owned == (5, 5)


def test_lpt_whole_takes_the_largest_first_ties_in_index_order():
    # InternLM: sorted(params, key=numel, reverse=True) (stable), then the least-loaded rank.
    p = lpt_whole(specs_from_shapes([(10,), (1,), (1,), (1,), (8,)]), 3, 1)
    # 10 -> r0; 8 -> r1; then the three 1s all go to r2 (loads 1, 2 < 8).
    assert [p.owner_ranks(i)[0] for i in range(5)] == [0, 2, 2, 2, 1]
    assert p.spaces[0].owned == (10, 8, 3)
    # Shards are packed in parameter order whatever the assignment order was.
    assert [(f.param, f.shard_offset) for f in p.rank_fragments(0, 2)] == [(1, 0), (2, 1), (3, 2)]
    assert p.strategy == "lpt_whole" and not p.splits_params


def test_lpt_whole_balances_better_than_greedy_on_an_adversarial_order():
    specs = specs_from_shapes([(1,), (1,), (2,)])
    assert greedy_whole(specs, 2, 1).spaces[0].owned == (3, 1)
    assert lpt_whole(specs, 2, 1).spaces[0].owned == (2, 2)


@pytest.mark.parametrize("strategy", [greedy_whole, lpt_whole])
def test_whole_strategies_leave_extra_ranks_empty(strategy):
    p = strategy(specs_from_shapes([(17, 257), (3,)]), 4, 128)
    assert sorted(p.spaces[0].owned) == [0, 0, 3, 4369]
    assert sum(1 for frags in p.spaces[0].by_rank if not frags) == 2
    assert p.spaces[0].shard_numel.count(0) == 2


@pytest.mark.parametrize("strategy", [greedy_whole, lpt_whole])
def test_whole_strategies_balance_each_dtype_space_separately(strategy):
    specs = (
        ParamSpec(index=0, name="a", shape=(4,), dtype="bf16"),
        ParamSpec(index=1, name="b", shape=(4,), dtype="fp32"),
        ParamSpec(index=2, name="c", shape=(2,), dtype="bf16"),
    )
    p = strategy(specs, 2, 1)
    assert [(s.dtype, s.owned) for s in p.spaces] == [("bfloat16", (4, 2)), ("float32", (4, 0))]
    assert p.fragments[2] == (Fragment(2, 1, Span(0, 2), 0),)


# ----------------------------------------------------------------- shared behaviour
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_owns_every_trainable_element_once(strategy):
    specs = specs_from_shapes(
        [(17, 257), (0,), (3,), (), (257, 17), (1,)], trainable=[True, True, False, True, True, True]
    )
    p = strategy(specs, 5, 8)
    for spec, frags in zip(specs, p.fragments, strict=True):
        if not spec.trainable:
            assert frags == ()
            continue
        assert frags[0].param_span.start == 0 and frags[-1].param_span.stop == spec.numel
        assert all(a.param_span.stop == b.param_span.start for a, b in itertools.pairwise(frags))
    assert sum(p.spaces[0].owned) == 4369 * 2 + 1 + 1


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("shard_size", "alignment", "needle"),
    [
        (0, 1, "shard size must be an int >= 1, got 0"),
        (-3, 1, "shard size must be an int >= 1, got -3"),
        (2.0, 1, "shard size must be an int >= 1, got 2.0"),
        (2, 0, "alignment must be an int >= 1 (elements), got 0"),
        (2, -128, "alignment must be an int >= 1 (elements), got -128"),
    ],
)
def test_strategies_reject_bad_sizes_naming_the_value(strategy, shard_size, alignment, needle):
    with pytest.raises(ConfigError) as info:
        strategy(specs_from_shapes([(17, 257)]), shard_size, alignment)
    assert needle in str(info.value)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_validate_specs(strategy):
    bad = [ParamSpec(index=1, name="a", shape=(3,))]
    with pytest.raises(ConfigError, match=r"specs\[0\] has index 1"):
        strategy(bad, 2, 1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_handle_an_empty_model(strategy):
    p = strategy((), 3, 128)
    assert p.spaces == () and p.fragments == () and not p.splits_params


# ----------------------------------------------------------------- registry
@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry, so registrations do not leak between tests."""
    monkeypatch.setattr(strategies_module, "_REGISTRY", dict(strategies_module._REGISTRY))
    return strategies_module._REGISTRY


def _round_robin(specs, shard_size, alignment):
    pieces = [(s.index, Span(0, s.numel), s.index % shard_size) for s in specs if s.trainable]
    return plan_from_assignment(specs, shard_size, alignment, "round_robin", pieces)


def test_builtin_strategies_are_registered():
    assert strategy_names()[:3] == ("flat_even", "greedy_whole", "lpt_whole")
    assert get_strategy("flat_even") is flat_even
    assert get_strategy("greedy_whole") is greedy_whole
    assert get_strategy("lpt_whole") is lpt_whole


def test_unknown_strategy_is_a_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError) as info:
        get_strategy("round_robbin")
    assert "'round_robbin'" in str(info.value) and "flat_even, greedy_whole, lpt_whole" in str(info.value)


def test_a_user_strategy_registers_and_plans(registry):
    register_strategy("round_robin", _round_robin)
    register_strategy("round_robin", _round_robin)  # the same function again is fine
    assert "round_robin" in strategy_names()
    zp = plan(
        specs_from_shapes([(3,), (4,), (5,)]), Topology(world_size=2), strategy="round_robin", alignment=1
    )
    assert zp.partition.strategy == "round_robin"
    assert zp.partition.spaces[0].owned == (8, 4)


def test_registering_a_taken_name_needs_replace(registry):
    with pytest.raises(ConfigError, match="'flat_even' is already registered; pass replace=True"):
        register_strategy("flat_even", _round_robin)
    register_strategy("flat_even", _round_robin, replace=True)
    assert get_strategy("flat_even") is _round_robin


def test_a_strategy_returning_garbage_is_a_plan_invariant_error(registry):
    register_strategy("garbage", lambda specs, shard_size, alignment: {"not": "a plan"})
    with pytest.raises(PlanInvariantError, match="'garbage' returned dict, expected a PartitionPlan"):
        plan(specs_from_shapes([(3,)]), Topology(world_size=2), strategy="garbage")
    register_strategy(
        "wrong_size", lambda specs, shard_size, alignment: flat_even(specs, shard_size + 1, alignment)
    )
    with pytest.raises(
        PlanInvariantError, match="'wrong_size' returned a plan for other specs or another shard"
    ):
        plan(specs_from_shapes([(3,)]), Topology(world_size=2), strategy="wrong_size")
