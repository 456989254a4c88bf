"""Wire formats ([Note: wire formats] in ``zeroplan.core.wire``): each gradient codec's reduction
against the exact average, within the codec's bound; gathered parameters alike on every rank within
the codec's bound, masters exact; traffic and memory equal to the plan; refusals.

The bound of a reduction: every rank's piece is encoded once (and, with replicas, the shard group's
sum twice more: its parts, then each part's sum), each element within
:func:`~zeroplan.core.wire.round_trip_bound` of its value, so the averaged gradient is off by at most
that bound of the largest gradient of any rank per encoding (plus the rounding of a bf16 gradient
shard at stage 1). fp32 and bf16 wires add in fp32: at stages 2 and 3 the bf16 gradients of two
ranks are summed exactly, where the default bf16 sum rounds.
"""

from __future__ import annotations

import pytest
import scenarios_wire

#: Per encoding, the most a codec moves a value, relative to its block's largest (half a quantum).
RELATIVE = {"fp32": 0.0, "bf16": 2**-8, "int8": 1 / 254, "fp8": 2**-4}
BF16_OUTPUT = 2**-8  # a bf16 gradient shard (stage 1) rounds the fp32 sum once

CASES = [
    (2, {"stage": 2, "wire": "bf16"}),
    (2, {"stage": 2, "wire": "fp32"}),
    (2, {"stage": 2, "wire": "int8"}),
    (2, {"stage": 2, "wire": "fp8"}),
    (4, {"stage": 2, "wire": "int8"}),
    (4, {"stage": 2, "wire": "int8", "shard": 2}),  # MiCS: the group's sum is encoded again
    (8, {"stage": 2, "wire": "fp8", "shard": 2}),  # four replicas: parts exchanged, then gathered
    (4, {"stage": 3, "wire": "fp8"}),
    (2, {"stage": 1, "wire": "int8"}),  # rank-major: pieces need not be whole blocks
    (4, {"stage": 1, "wire": "bf16", "shard": 2}),
    (2, {"stage": 2, "wire": "int8", "dtype": "fp32", "block": 8}),
]


@pytest.mark.parametrize(("world", "cfg"), CASES)
def test_reduction_is_within_the_codec_bound_and_as_planned(pools, world, cfg):
    encodings = 3 if cfg.get("shard") else 1  # MiCS: the group's sum in parts, then each part's sum
    for r in pools(world).run(scenarios_wire.reduced_error, cfg):
        bound = r["largest"] * (encodings * RELATIVE[cfg["wire"]] + (BF16_OUTPUT if cfg["stage"] == 1 else 0))
        assert r["error"] <= bound * (1 + 1e-6) + 1e-12, (r["error"], bound)
        assert r["comm"] == r["planned_comm"]
        assert r["measured"] == r["planned"]


def test_a_bf16_wire_sums_in_fp32_where_the_default_rounds_to_bf16(pools):
    default = pools(4).run(scenarios_wire.reduced_error, {"stage": 2})
    wire = pools(4).run(scenarios_wire.reduced_error, {"stage": 2, "wire": "bf16"})
    assert all(r["error"] == 0.0 for r in wire)  # bf16 values of 4 ranks: an fp32 sum is exact
    assert max(r["error"] for r in default) > 0.0


REFUSED = [
    ({"reduce_dtype": "int4"}, "reduce_dtype='int4' is not a gradient wire format"),
    ({"reduce_dtype": "int8", "wire_block": 24}, "block of 24 elements does not divide the alignment (16)"),
    ({"reduce_dtype": "bf16", "deterministic": True}, "cannot be combined yet"),
    ({"per_rank": [{"reduce_dtype": "int8"}, {"reduce_dtype": "fp8"}]}, ""),  # plans differ by rank
    ({"gather_dtype": "int4"}, "gather_dtype='int4' is not a parameter wire format"),
    ({"gather_dtype": "fp32"}, "sends at least the parameters' bytes and changes nothing"),
    ({"gather_dtype": "int8"}, "needs fp32 masters apart from the parameters"),  # fp32, stage 2
    ({"gather_dtype": "int8", "stage": 3, "wire_block": 24}, "does not divide the alignment"),
    ({"gather_dtype": "fp8", "stage": 3, "deterministic": True}, "cannot be combined"),
    ({"per_rank": [{"stage": 3, "gather_dtype": "int8"}, {"stage": 3, "gather_dtype": "fp8"}]}, ""),
]


def test_bad_wire_settings_fail_on_every_rank(pools):
    """Every case in one job of one pool (a scenario that raises breaks its pool: a new one is ~10 s)."""
    by_rank = pools(2).run(scenarios_wire.refused_wires, [cfg for cfg, _ in REFUSED])
    refusals = ("ConfigError", "IncompatiblePlanError")
    for k, (cfg, needle) in enumerate(REFUSED):
        errors = [rank[k] for rank in by_rank]
        assert all(e is not None and e.startswith(refusals) and needle in e for e in errors), (cfg, errors)


# The parameter wire ([Note: wire formats]): what updated parameters travel as in their gathers.
GATHER_CASES = [
    (2, {"stage": 2, "gather": "int8"}),
    (2, {"stage": 2, "gather": "fp8", "layout": "rank_major"}),  # chunks broadcast by their owner
    (4, {"stage": 1, "gather": "int8", "shard": 2}),  # MiCS: gathered inside each shard group
    (4, {"stage": 2, "gather": "int8", "ranks_per_node": 2}),  # two hops, both encoded
    (2, {"stage": 2, "gather": "bf16", "dtype": "fp16"}),
    (2, {"stage": 3, "gather": "int8", "dtype": "fp32"}),  # stage 3 keeps an exact fp32 shard
    (4, {"stage": 3, "gather": "fp8", "shard": 2}),
    (2, {"stage": 2, "gather": "int8", "wire": "int8"}),  # both wires
    (2, {"stage": 2, "gather": "int8", "collectives": "min_bytes"}),  # all_gather of equal slots
    (2, {"stage": 1, "gather": "fp8", "overlap": False}),  # decoded inside step()
]


def _gather_id(case: tuple[int, dict]) -> str:
    world, cfg = case
    return f"w{world}-" + "-".join(f"{k}={v}" for k, v in cfg.items())


@pytest.mark.parametrize(("world", "cfg"), GATHER_CASES, ids=[_gather_id(c) for c in GATHER_CASES])
def test_every_rank_holds_the_same_decoded_parameters_within_the_bound(pools, world, cfg):
    results = pools(world).run(scenarios_wire.published_params, cfg)
    shard = cfg.get("shard", world)
    for group in range(world // shard):  # ranks gathering from each other hold the same bits
        assert len({results[group * shard + q]["params"] for q in range(shard)}) == 1
    dtype_rounding = 0.0 if cfg.get("dtype") == "fp32" else 2**-8  # the decoded fp32 value, cast
    for r in results:
        bound = r["largest"] * (RELATIVE[cfg["gather"]] + dtype_rounding)
        assert 0.0 < r["error"] <= bound * (1 + 1e-6), (r["error"], bound)
        assert r["masters_exact"], "the fp32 masters (and optimizer state) must not see the wire"
        assert r["comm"] == r["planned_comm"]
        # Three elements written on every rank: their masters moved, nothing else did. Stage 3
        # gathers them again, through the wire: the block holding them is encoded anew.
        if cfg["stage"] == 3:
            held = zip(r["written_held"], [0.5, -0.25, 2.0], strict=True)
            assert all(abs(a - b) <= 2.0 * (RELATIVE[cfg["gather"]] + dtype_rounding) for a, b in held)
            assert 1 <= r["params_moved"] <= 16  # one wire block
        else:
            assert r["written_held"] == [0.5, -0.25, 2.0]
            assert 1 <= r["params_moved"] <= 3
        if cfg.get("dtype") != "fp32":  # fp32 at stage 3: the shard is the master, in no state dict
            assert 1 <= r["masters_moved"] <= 3


@pytest.mark.parametrize(
    ("world", "cfg"),
    [
        (2, {"stage": 2, "wire": "int8", "gather": "int8"}),
        (4, {"stage": 3, "wire": "fp8", "gather": "fp8", "shard": 2}),  # MiCS: replica parts too
        (4, {"stage": 2, "gather": "int8", "ranks_per_node": 2}),  # two hops
    ],
)
def test_every_call_of_a_step_is_in_its_logged_traffic(pools, world, cfg):
    """Counted outside zeroplan (``torch.distributed`` wrapped), the step's calls are the ones it logs."""
    for r in pools(world).run(scenarios_wire.metered, cfg):
        assert r["metered"] == r["logged"], r
