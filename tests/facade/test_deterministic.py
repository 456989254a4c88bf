"""Deterministic mode: bit-identical to world 1 at any world, stage, layout, buckets and overlap.

See [Note: deterministic mode] in ``zeroplan.core.deterministic``. Each case trains the same G
canonical micro-batches at world 1 and at world W, and compares sha256 digests of the final
parameters and of the whole consolidated optimizer state (fp32 masters included), the clip norms
of every step and the loss scales: equal digests mean equal bits.
"""

from __future__ import annotations

import pytest
import scenarios_deterministic

CASES = [
    # (world, cfg): each is compared with world 1 at the same G and dtype
    (2, {"stage": 2}),
    (4, {"stage": 2, "G": 8}),
    (2, {"stage": 1, "dtype": "bf16"}),
    (4, {"stage": 1, "layout": "interleaved"}),
    (2, {"stage": 3, "dtype": "bf16"}),
    (4, {"stage": 3, "overlap_param_gather": False}),
    (4, {"stage": 2, "shard": 2, "dtype": "bf16"}),  # MiCS: replica sums gathered and added in order
    (4, {"stage": 2, "layout": "rank_major", "bucket_bytes": 512}),
    (4, {"stage": 2, "overlap_grad_reduce": False, "collectives": "min_bytes"}),
    (2, {"stage": 2, "strategy": "greedy_whole"}),
    (2, {"stage": 2, "dtype": "fp16", "fp16_overflow_step": 1}),  # an overflow skip is part of the run
    (4, {"stage": 3, "ranks_per_node": 2, "collectives": "min_bytes", "dtype": "bf16"}),  # two-hop gathers
    (4, {"stage": 2, "optimizer": "adafactor"}),  # a whole-parameter optimizer: parameters kept whole
]


def _reference(pools, cfg):
    keep = {k: cfg[k] for k in ("dtype", "G", "fp16_overflow_step", "optimizer") if k in cfg}
    return pools(1).run(scenarios_deterministic.train, {"stage": 2, **keep})[0]


@pytest.mark.parametrize(("world", "cfg"), CASES)
def test_bit_identical_to_world_1(pools, world, cfg):
    ref = _reference(pools, cfg)
    for got in pools(world).run(scenarios_deterministic.train, cfg):
        assert got == ref


def test_default_mode_is_not_bit_identical(pools):
    """The negative control: the same comparison without the mode differs (so the test can fail)."""
    cfg = {"stage": 2, "G": 8, "deterministic": False}
    ref = pools(1).run(scenarios_deterministic.train, cfg)[0]
    got = pools(4).run(scenarios_deterministic.train, cfg)[0]
    assert got["params"] != ref["params"] or got["norms"] != ref["norms"]


def test_a_world_that_is_not_a_power_of_two_is_refused(pools):
    refused = "ConfigError: deterministic=True needs a power-of-two world size, got 3"
    with pytest.raises(AssertionError, match=refused):
        pools(3).run(scenarios_deterministic.train, {"stage": 2, "G": 3})


def test_expert_groups_are_refused_on_every_rank(pools):
    with pytest.raises(AssertionError, match="does not support expert groups") as info:
        pools(2).run(scenarios_deterministic.with_expert_group)
    assert str(info.value).count("does not support expert groups") >= 2  # both ranks raised


@pytest.mark.parametrize(
    ("stage", "deterministic", "micro_batches"),
    [(2, True, 8), (2, True, 4), (1, True, 4), (3, True, 4), (2, False, 4), (1, False, 4)],
)
def test_gradients_held_between_micro_batches_are_planned(pools, stage, deterministic, micro_batches):
    """``accumulation_bytes`` against MemTracker: the tree's partial sums (log2 of the micro-batches
    in gradients) in deterministic mode, autograd's one ``.grad`` (stage 2) or none (stage 1) otherwise."""
    cfg = {"stage": stage, "deterministic": deterministic, "micro_batches": micro_batches}
    for r in pools(2).run(scenarios_deterministic.held_between_micro_batches, cfg):
        assert r["held"] == r["planned"]


def test_a_count_of_micro_batches_that_is_not_a_power_of_two_raises_on_every_rank(pools):
    first, other = pools(2).run(scenarios_deterministic.uneven_micro_batches)
    assert first["raised"] and "this rank ran 3 backward passes" in first["raised"]
    assert other["raised"] and "count of micro-batches that is not a power of two" in other["raised"]
    assert first["unchanged"] and other["unchanged"]


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ((4, {"stage": 3, "shard": 2, "dtype": "bf16"}), (2, {"stage": 2, "dtype": "bf16"})),
        ((2, {"stage": 1}), (4, {"stage": 2, "layout": "rank_major"})),
    ],
)
def test_a_checkpoint_resumed_at_another_world_continues_the_same_bits(pools, tmp_path, saved, resumed):
    """Two steps at one world size, saved; the third resumed at another (and at another stage): the
    final state is the uninterrupted world-1 run's ([Note: deterministic mode], item 2 of issue 27)."""
    keep = {k: resumed[1][k] for k in ("dtype",) if k in resumed[1]}
    whole = pools(1).run(scenarios_deterministic.train, {"stage": 2, "G": 4, "steps": 3, **keep})[0]
    world, cfg = saved
    pools(world).run(scenarios_deterministic.train, {**cfg, "G": 4, "steps": 2, "save_to": str(tmp_path)})
    world, cfg = resumed
    finals = pools(world).run(
        scenarios_deterministic.train, {**cfg, "G": 4, "steps": 3, "load_from": str(tmp_path)}
    )
    for final in finals:
        assert final["params"] == whole["params"]
        assert final["state"] == whole["state"]
        assert final["norms"] == whole["norms"][-1:]
