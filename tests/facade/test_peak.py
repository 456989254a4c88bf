"""The plan's ``peak_bytes`` against torch's ``MemTracker``: within 1% for stages 1, 2 and 3, every dtype,
foreach and fused AdamW, SGD, at world 1, 2 and 4 (MiCS shard groups of 2), stage 3 with and without
``reshard_after_forward``. The model is a Linear stack whose activations stay under 1% of its
parameters; at stage 3 each layer is a block of its own, gathered and freed as [Note: stage 3] says."""

from __future__ import annotations

import pytest
import scenarios_peak

ADAMW_FOREACH = {"optimizer": "adamw", "hyper": {"lr": 1e-3, "weight_decay": 0.01, "foreach": True}}
ADAMW_FUSED = {"optimizer": "adamw", "hyper": {"lr": 1e-3, "fused": True}}
SGD = {"optimizer": "sgd", "hyper": {"lr": 1e-2, "momentum": 0.9}}

CASES = (
    [
        (world, {"stage": stage, "dtype": dtype, **inner, **extra})
        for world, extra in [(1, {}), (2, {}), (2, {"collectives": "min_bytes"}), (4, {"shard": 2})]
        for stage in (1, 2)
        for dtype in ("fp32", "bf16", "fp16")
        for inner in (ADAMW_FOREACH, ADAMW_FUSED, SGD)
        if world != 4 or dtype != "fp16"
    ]
    + [
        (
            4,
            {
                "stage": 2,
                "dtype": "bf16",
                "shard": 2,
                "collectives": "min_bytes",
                "clip": True,
                **ADAMW_FOREACH,
            },
        ),
        (2, {"stage": 2, "dtype": "fp32", "overlap": False, **ADAMW_FUSED}),
    ]
    + [
        (world, {"stage": 3, "dtype": dtype, **inner, **extra})
        for world, extra in [
            (1, {}),
            (2, {}),
            (2, {"reshard": False}),
            (4, {"shard": 2, "collectives": "min_bytes"}),
        ]
        for dtype in ("fp32", "bf16", "fp16")
        for inner in (ADAMW_FOREACH, SGD)
        if world != 4 or dtype != "fp16"
    ]
    + [  # deterministic mode: room for every peer's piece (and the replicas' sums), the exact norm
        (2, {"stage": 2, "dtype": "bf16", "deterministic": True, "clip": True, **ADAMW_FOREACH}),
        (4, {"stage": 2, "dtype": "fp32", "shard": 2, "deterministic": True, **ADAMW_FUSED}),
        (4, {"stage": 3, "dtype": "bf16", "shard": 2, "deterministic": True, **ADAMW_FOREACH}),
    ]
    + [  # gradient wire formats: the encoded rooms and the fp32 slots ([Note: wire formats])
        (2, {"stage": 2, "dtype": "bf16", "wire": "int8", **ADAMW_FOREACH}),
        (4, {"stage": 2, "dtype": "fp32", "shard": 2, "wire": "fp8", **ADAMW_FUSED}),
        (2, {"stage": 3, "dtype": "bf16", "wire": "bf16", **SGD}),
    ]
    + [  # CPU offload: host buffers of their own, landing rooms, the step unit by unit
        (2, {"stage": 1, "dtype": "bf16", "offload": "optimizer", **ADAMW_FUSED}),
        (2, {"stage": 2, "dtype": "fp32", "offload": "optimizer", "clip": True, **ADAMW_FOREACH}),
        (2, {"stage": 2, "dtype": "bf16", "offload": "optimizer", **SGD}),
        (2, {"stage": 3, "dtype": "bf16", "offload": "all", **ADAMW_FOREACH}),
        (4, {"stage": 3, "dtype": "fp32", "shard": 2, "offload": "optimizer", **ADAMW_FUSED}),
        # a partial offload: the kept part stepped on the device first, then the units
        (2, {"stage": 2, "dtype": "bf16", "offload": "optimizer", "fraction": 0.5, **ADAMW_FOREACH}),
        (2, {"stage": 3, "dtype": "fp32", "offload": "optimizer", "fraction": 0.3, **ADAMW_FUSED}),
    ]
    + [  # parameter wire formats: every block's encoded gather holds a room until it is decoded
        (2, {"stage": 2, "dtype": "bf16", "gather": "int8", **ADAMW_FOREACH}),
        (4, {"stage": 1, "dtype": "bf16", "shard": 2, "gather": "fp8", **SGD}),
        (2, {"stage": 3, "dtype": "fp32", "gather": "int8", **ADAMW_FOREACH}),
        (2, {"stage": 3, "dtype": "bf16", "gather": "int8", "reshard": False, **SGD}),
    ]
)


def _id(case):
    world, cfg = case
    inner = "sgd" if cfg["optimizer"] == "sgd" else "fused" if cfg["hyper"].get("fused") else "foreach"
    keys = (
        "shard",
        "collectives",
        "clip",
        "overlap",
        "reshard",
        "deterministic",
        "wire",
        "gather",
        "offload",
        "fraction",
    )
    named = ("wire", "gather", "offload", "fraction")
    extras = [f"{k}={cfg[k]}" if k in named else k for k in keys if k in cfg]
    return "-".join([f"w{world}", f"s{cfg['stage']}", cfg["dtype"], inner, *extras])


@pytest.mark.parametrize(("world", "cfg"), CASES, ids=[_id(c) for c in CASES])
def test_step_peak_equals_plan_within_one_percent(pools, world, cfg):
    for r in pools(world).run(scenarios_peak.step_peak, cfg):
        steady = r["measured"][-1]
        assert r["measured"][1] == steady, r  # the peak is the same every step
        assert abs(steady / r["planned"] - 1) <= 0.01, r


@pytest.mark.parametrize("stage", [1, 2])
def test_the_plan_follows_the_order_gradients_arrived_in(pools, stage):
    # The forward applies the layers last-registered first, so gradients arrive in increasing parameter
    # order: at stage 2 each waits for the window to reach its bucket. The optimizer's report replays the
    # order it saw; the planner's default (decreasing order) would be too low at stage 2.
    cfg = {"stage": stage, "dtype": "fp32", "reverse_forward": True, **ADAMW_FUSED}
    for r in pools(2).run(scenarios_peak.step_peak, cfg):
        assert abs(r["measured"][-1] / r["planned"] - 1) <= 0.01, r
        if stage == 2:
            assert r["planned_in_reverse_order"] < 0.95 * r["planned"], r


def test_stage_3_construction_holds_the_shards_and_one_block_beyond_the_model(pools):
    """Issue 32: building stage 3 used to allocate every block before the parameters moved (the model
    twice: 1,334,016 bytes above the model here). It now builds block by block: the peak above the
    model is the parameter shard plus one block (the rest is allocated once the model's old storage
    is gone)."""
    for r in pools(2).run(scenarios_peak.construction_peak, {"bucket_bytes": 192 * 193 * 4}):
        assert r["blocks"] >= 4, r
        assert r["extra"] <= r["shard"] + r["largest_block"] + 4096, r  # a few small tensors
