"""Gradient wire formats ([Note: wire formats] in ``zeroplan.core.wire``): each codec's reduction
against the exact average, within the codec's bound; traffic and memory equal to the plan; refusals.

The bound of a reduction: every rank's piece is encoded once (and, with replicas, the shard group's
sum once more), each element within :func:`~zeroplan.core.wire.round_trip_bound` of its value, so the
averaged gradient is off by at most that bound of the largest gradient of any rank per encoding
(plus the rounding of a bf16 gradient shard at stage 1). fp32 and bf16 wires add in fp32: at stages
2 and 3 the bf16 gradients of two ranks are summed exactly, where the default bf16 sum rounds.
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
    (4, {"stage": 2, "wire": "int8", "shard": 2}),  # MiCS: the group's sum is encoded again
    (4, {"stage": 3, "wire": "fp8"}),
    (2, {"stage": 1, "wire": "int8"}),  # rank-major: pieces need not be whole blocks
    (4, {"stage": 1, "wire": "bf16", "shard": 2}),
    (2, {"stage": 2, "wire": "int8", "dtype": "fp32", "block": 8}),
]


@pytest.mark.parametrize(("world", "cfg"), CASES)
def test_reduction_is_within_the_codec_bound_and_as_planned(pools, world, cfg):
    encodings = 2 if cfg.get("shard") else 1
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


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({"reduce_dtype": "int4"}, "reduce_dtype='int4' is not a gradient wire format"),
        (
            {"reduce_dtype": "int8", "wire_block": 24},
            "block of 24 elements does not divide the alignment (16)",
        ),
        ({"reduce_dtype": "bf16", "deterministic": True}, "cannot be combined yet"),
        (
            {"per_rank": [{"reduce_dtype": "int8"}, {"reduce_dtype": "fp8"}]},
            "",  # different wires on different ranks: the plans differ
        ),
    ],
)
def test_bad_wire_settings_fail_on_every_rank(pools, cfg, needle):
    with pytest.raises(AssertionError) as info:
        pools(2).run(scenarios_wire.with_wire, cfg)
    message = str(info.value)
    assert message.count("--- rank") == 2, message  # both ranks raised
    assert needle in message
