"""``PartitionPlan`` and ``plan_from_assignment``: offsets derived, invariants enforced."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from zeroplan.core import (
    Collective,
    ConfigError,
    Fragment,
    ParamSpec,
    PartitionPlan,
    PlanInvariantError,
    Span,
    plan_from_assignment,
    specs_from_shapes,
)

SPECS = specs_from_shapes([(10,), (6,), (4,)], names=["w", "v", "b"])

#: rank 3 owns nothing; p0 is split across ranks 1 and 2 (end of 1, start of 2).
GOOD = [(0, Span(0, 7), 1), (0, Span(7, 10), 2), (1, Span(0, 6), 2), (2, Span(0, 4), 0)]


def test_hand_built_plan_derives_every_offset():
    p = plan_from_assignment(SPECS, 4, 4, "hand", GOOD)
    assert p.strategy == "hand" and p.splits_params
    assert p.fragments == (
        (Fragment(0, 1, Span(0, 7), 0), Fragment(0, 2, Span(7, 10), 0)),
        (Fragment(1, 2, Span(0, 6), 3),),
        (Fragment(2, 0, Span(0, 4), 0),),
    )
    (space,) = p.spaces
    assert space.dtype == "float32" and space.params == (0, 1, 2)
    assert space.param_offsets == (0, 10, 16) and space.numel == 20
    assert space.owned == (4, 7, 9, 0)  # rank 3 owns nothing and still appears
    assert space.shard_numel == (4, 8, 12, 0)
    assert [b.piece(r).buffer_span.start for b in space.blocks for r in range(4)] == [0, 4, 11, 20]
    # rank-major buffer: [b | w[0:7] | w[7:10] v | ]
    assert space.buffer_offsets == (4, 14, 0)
    assert space.buffer_offset(0) == 4 and space.param_offset(2) == 16
    assert space.region(2) == Span(11, 20) and space.region(3) == Span(20, 20)
    assert space.by_rank[3] == () and p.rank_fragments(0, 3) == ()
    assert [f.param for f in space.by_rank[2]] == [0, 1]
    assert space.blocks[0].gather is Collective.BROADCAST  # uneven regions
    assert p.owner_ranks(0) == (1, 2) and p.owner_ranks(2) == (0,)
    assert p.space_of(1) is space
    assert Fragment(1, 2, Span(0, 6), 3).shard_span == Span(3, 9)


def test_pieces_may_come_in_any_order():
    shuffled = [GOOD[3], GOOD[1], GOOD[2], GOOD[0]]
    assert plan_from_assignment(SPECS, 4, 4, "hand", shuffled) == plan_from_assignment(
        SPECS, 4, 4, "hand", GOOD
    )


def test_more_ranks_than_parameters_leave_ranks_empty():
    specs = specs_from_shapes([(17, 257), (3,)])
    p = plan_from_assignment(specs, 8, 128, "two", [(0, Span(0, 4369), 5), (1, Span(0, 3), 2)])
    (space,) = p.spaces
    assert space.owned == (0, 0, 3, 0, 0, 4369, 0, 0)
    assert space.shard_numel == (0, 0, 128, 0, 0, 4480, 0, 0)
    assert len(space.by_rank) == 8 and sum(1 for f in space.by_rank if f) == 2


def test_frozen_parameters_have_no_fragments_and_no_space():
    specs = specs_from_shapes([(4,), (6,)], trainable=[True, False])
    p = plan_from_assignment(specs, 2, 1, "x", [(0, Span(0, 4), 1)])
    assert p.fragments[1] == () and p.owner_ranks(1) == () and p.space_of(1) is None
    assert p.spaces[0].params == (0,)


def test_one_space_per_dtype_in_first_use_order():
    specs = (
        ParamSpec(index=0, name="a", shape=(3,), dtype="bf16"),
        ParamSpec(index=1, name="b", shape=(5,), dtype="fp32"),
        ParamSpec(index=2, name="c", shape=(2,), dtype="bf16"),
    )
    p = plan_from_assignment(specs, 2, 1, "x", [(0, Span(0, 3), 0), (1, Span(0, 5), 1), (2, Span(0, 2), 0)])
    assert [(s.dtype, s.params, s.owned) for s in p.spaces] == [
        ("bfloat16", (0, 2), (5, 0)),
        ("float32", (1,), (0, 5)),
    ]
    # Shard offsets count per (dtype, rank): c follows a on rank 0 of the bf16 space.
    assert p.fragments[2][0].shard_offset == 3 and p.fragments[1][0].shard_offset == 0
    assert p.spaces[0].blocks[0].gather is Collective.BROADCAST


def test_equal_regions_gather_with_one_all_gather():
    p = plan_from_assignment(SPECS, 2, 1, "x", [(0, Span(0, 10), 0), (1, Span(0, 6), 1), (2, Span(0, 4), 1)])
    assert p.spaces[0].owned == (10, 10) and p.spaces[0].blocks[0].gather is Collective.ALL_GATHER
    assert not p.splits_params


# ----------------------------------------------------------------- bad assignments
@pytest.mark.parametrize(
    ("pieces", "needles"),
    [
        pytest.param(
            [(0, Span(0, 6), 0), (0, Span(4, 10), 1), (1, Span(0, 6), 1), (2, Span(0, 4), 1)],
            ["parameter 0 ('w'", "expected one starting at 6", "Span(start=4, stop=10)"],
            id="overlap",
        ),
        pytest.param(
            [(0, Span(0, 4), 0), (0, Span(5, 10), 1), (1, Span(0, 6), 1), (2, Span(0, 4), 1)],
            ["parameter 0 ('w'", "expected one starting at 4", "Span(start=5, stop=10)"],
            id="gap",
        ),
        pytest.param(
            [(0, Span(0, 8), 0), (1, Span(0, 6), 1), (2, Span(0, 4), 1)],
            ["parameter 0 ('w'", "cover 8 of 10 elements"],
            id="short",
        ),
        pytest.param(
            [(0, Span(0, 10), 0), (1, Span(0, 6), 1), (2, Span(0, 4), 1), (2, Span(0, 4), 0)],
            ["parameter 2 ('b'", "expected one starting at 4", "Span(start=0, stop=4)"],
            id="duplicate",
        ),
        pytest.param(
            [(0, Span(0, 10), 0), (2, Span(0, 4), 1)],
            ["parameter 1 ('v'", "trainable but no rank owns it"],
            id="unowned",
        ),
        pytest.param(
            [(0, Span(0, 0), 0), (0, Span(0, 10), 1), (1, Span(0, 6), 1), (2, Span(0, 4), 1)],
            ["parameter 0 ('w'", "empty fragment Span(start=0, stop=0)"],
            id="empty-fragment",
        ),
        pytest.param(
            [(0, Span(0, 10), 2), (1, Span(0, 6), 1), (2, Span(0, 4), 1)],
            ["parameter 0 ('w'", "rank 2 outside 0..1"],
            id="rank-too-large",
        ),
        pytest.param(
            [(0, Span(0, 10), -1), (1, Span(0, 6), 1), (2, Span(0, 4), 1)],
            ["parameter 0 ('w'", "rank -1 outside 0..1"],
            id="negative-rank",
        ),
    ],
)
def test_bad_assignments_are_rejected_naming_the_parameter(pieces, needles):
    with pytest.raises(PlanInvariantError) as info:
        plan_from_assignment(SPECS, 2, 1, "x", pieces)
    for needle in needles:
        assert needle in str(info.value)


def test_non_contiguous_split_is_rejected():
    # w's first half ends rank 0's shard, but rank 1 holds v before w's second half on rank 2.
    pieces = [(0, Span(0, 5), 0), (0, Span(5, 10), 2), (1, Span(0, 6), 1), (2, Span(0, 4), 2)]
    with pytest.raises(PlanInvariantError) as info:
        plan_from_assignment(SPECS, 3, 1, "x", pieces)
    message = str(info.value)
    assert "parameter 0 ('w')" in message and "would not be contiguous" in message
    assert "rank 2 starts at 11, expected 5" in message


def test_split_that_does_not_end_the_first_shard_is_rejected():
    control = [(0, Span(0, 5), 0), (0, Span(5, 10), 1), (1, Span(0, 6), 1), (2, Span(0, 4), 1)]
    assert plan_from_assignment(SPECS, 2, 1, "x", control).splits_params  # [w[:5]] [w[5:] v b]
    # rank 0 = [w[:5] v b], rank 1 = [w[5:]]: w[5:] sits at 15 in the buffer, not at 5.
    bad = [(0, Span(0, 5), 0), (0, Span(5, 10), 1), (1, Span(0, 6), 0), (2, Span(0, 4), 0)]
    with pytest.raises(PlanInvariantError, match="rank 1 starts at 15, expected 5"):
        plan_from_assignment(SPECS, 2, 1, "x", bad)


def test_frozen_parameter_with_a_fragment_is_rejected():
    specs = specs_from_shapes([(4,), (6,)], trainable=[True, False], names=["a", "frozen"])
    with pytest.raises(PlanInvariantError, match=r"parameter 1 \('frozen'.*is frozen but .* 1 fragment"):
        plan_from_assignment(specs, 2, 1, "x", [(0, Span(0, 4), 0), (1, Span(0, 6), 1)])


def test_zero_size_parameter_owned_twice_is_rejected():
    specs = specs_from_shapes([(0,), (3,)], names=["empty", "x"])
    ok = plan_from_assignment(specs, 2, 1, "x", [(0, Span(0, 0), 1), (1, Span(0, 3), 0)])
    assert ok.fragments[0] == (Fragment(0, 1, Span(0, 0), 0),) and not ok.splits_params
    with pytest.raises(PlanInvariantError, match=r"'empty'.*zero-size.*exactly one.*got 2"):
        plan_from_assignment(specs, 2, 1, "x", [(0, Span(0, 0), 0), (0, Span(0, 0), 1), (1, Span(0, 3), 0)])


@pytest.mark.parametrize("param", [3, -1])
def test_assignment_naming_an_unknown_parameter_is_a_config_error(param):
    with pytest.raises(ConfigError, match=f"parameter {param}, outside 0..2"):
        plan_from_assignment(SPECS, 2, 1, "x", [(param, Span(0, 1), 0)])


@pytest.mark.parametrize(
    ("shard_size", "alignment", "needle"),
    [(0, 1, "shard size must be an int >= 1, got 0"), (2, 0, "alignment must be an int >= 1")],
)
def test_bad_sizes_are_config_errors(shard_size, alignment, needle):
    with pytest.raises(ConfigError, match=needle):
        plan_from_assignment(SPECS, shard_size, alignment, "x", [])


def test_direct_construction_checks_fragment_count_and_offsets():
    good = plan_from_assignment(SPECS, 4, 4, "hand", GOOD)
    with pytest.raises(PlanInvariantError, match="fragments for 2 parameters but 3 specs"):
        PartitionPlan(specs=SPECS, shard_size=4, alignment=4, strategy="x", fragments=good.fragments[:2])
    shifted = (good.fragments[0], (Fragment(1, 2, Span(0, 6), 4),), good.fragments[2])
    with pytest.raises(PlanInvariantError, match="starts at shard offset 4, expected 3"):
        PartitionPlan(specs=SPECS, shard_size=4, alignment=4, strategy="x", fragments=shifted)
    foreign = (good.fragments[0], (Fragment(2, 2, Span(0, 6), 3),), good.fragments[2])
    with pytest.raises(PlanInvariantError, match="lists a fragment of parameter 2"):
        PartitionPlan(specs=SPECS, shard_size=4, alignment=4, strategy="x", fragments=foreign)


def test_plan_values_are_frozen():
    p = plan_from_assignment(SPECS, 4, 4, "hand", GOOD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.shard_size = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.spaces[0].owned = (0, 0, 0, 0)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.fragments[0][0].rank = 0  # type: ignore[misc]
    assert isinstance(p.fragments, tuple) and isinstance(p.spaces[0].owned, tuple)


# ----------------------------------------------------------------- fingerprints
def _variants() -> dict[str, PartitionPlan]:
    renamed = specs_from_shapes([(10,), (6,), (4,)], names=["w", "v", "bias"])
    bf16 = specs_from_shapes([(10,), (6,), (4,)], names=["w", "v", "b"], dtype="bf16")
    frozen = specs_from_shapes([(10,), (6,), (4,)], names=["w", "v", "b"], trainable=[1, 1, 0])
    return {
        "base": plan_from_assignment(SPECS, 4, 4, "hand", GOOD),
        "moved-fragment": plan_from_assignment(
            SPECS, 4, 4, "hand", [GOOD[0], GOOD[1], GOOD[2], (2, Span(0, 4), 3)]
        ),
        "moved-split": plan_from_assignment(
            SPECS, 4, 4, "hand", [(0, Span(0, 6), 1), (0, Span(6, 10), 2), GOOD[2], GOOD[3]]
        ),
        "alignment": plan_from_assignment(SPECS, 4, 8, "hand", GOOD),
        "shard-size": plan_from_assignment(SPECS, 5, 4, "hand", GOOD),
        "name": plan_from_assignment(renamed, 4, 4, "hand", GOOD),
        "dtype": plan_from_assignment(bf16, 4, 4, "hand", GOOD),
        "trainable": plan_from_assignment(frozen, 4, 4, "hand", GOOD[:3]),
    }


def test_fingerprint_changes_with_any_fragment_or_spec_and_ignores_the_strategy_name():
    prints = {name: p.fingerprint() for name, p in _variants().items()}
    assert len(set(prints.values())) == len(prints), prints
    base = prints["base"]
    assert len(base) == 16 and int(base, 16) >= 0
    assert plan_from_assignment(SPECS, 4, 4, "other name", GOOD).fingerprint() == base


_FINGERPRINT_SCRIPT = textwrap.dedent(
    """
    from zeroplan.core import Span, Topology, flat_even, lpt_whole, memory_report, plan, plan_reshard
    from zeroplan.core import plan_from_assignment, specs_from_shapes

    def fingerprints():
        specs = specs_from_shapes([(10,), (6,), (4,)], names=["w", "v", "b"])
        good = [(0, Span(0, 7), 1), (0, Span(7, 10), 2), (1, Span(0, 6), 2), (2, Span(0, 4), 0)]
        odd = specs_from_shapes([(17, 257), (3,), (257, 17), (0,)], dtype="bf16")
        zp = plan(odd, Topology(world_size=6, shard_size=3), stage=2, alignment=8, bucket_bytes=1000)
        return [
            plan_from_assignment(specs, 4, 4, "hand", good).fingerprint(),
            zp.partition.fingerprint(),
            zp.buckets.fingerprint(),
            zp.fingerprint(),
            memory_report(zp).fingerprint,
            plan_reshard(flat_even(odd, 3, 8), lpt_whole(odd, 2, 4)).fingerprint(),
        ]
    """
)


@pytest.mark.parametrize("seed", ["0", "4242"])
def test_fingerprints_are_identical_in_another_process_with_another_hash_seed(seed):
    namespace: dict[str, object] = {}
    exec(_FINGERPRINT_SCRIPT, namespace)
    expected = namespace["fingerprints"]()  # type: ignore[operator]
    assert len(expected) == 6 and all(len(f) == 16 for f in expected)
    assert expected[4] == expected[3]  # a report carries its plan's fingerprint
    assert len(set(expected)) == 5
    env = {**os.environ, "PYTHONHASHSEED": seed}
    script = _FINGERPRINT_SCRIPT + "\nprint(' '.join(fingerprints()))\n"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == expected
