"""The optimizer's measured memory and traffic equal the planner's report."""

from __future__ import annotations

import pytest
import scenarios_accounting

BASE = [
    (2, {"stage": 2}),
    (2, {"stage": 1, "dtype": "bf16"}),
    (4, {"stage": 2, "shard": 2, "dtype": "bf16", "clip": True}),
    (4, {"stage": 1, "shard": 2, "optimizer": "sgd"}),
    (4, {"stage": 2, "dtype": "fp16"}),
    (3, {"stage": 2, "optimizer": "adafactor"}),
    (4, {"stage": 2, "strategy": "greedy_whole", "bucket_bytes": 4096}),
]
CASES = [(world, {**cfg, "collectives": c}) for world, cfg in BASE for c in ("gloo", "min_bytes")]
# Deterministic mode ([Note: deterministic mode]): all-to-all exchanges, replica gathers, the exact norm.
CASES += [
    (4, {"stage": 2, "shard": 2, "dtype": "bf16", "clip": True, "deterministic": True}),
    (2, {"stage": 1, "deterministic": True, "clip": True}),
    (4, {"stage": 2, "strategy": "greedy_whole", "bucket_bytes": 4096, "deterministic": True}),
]


@pytest.mark.parametrize(("world", "cfg"), CASES)
def test_measured_equals_planned(pools, world, cfg):
    for r in pools(world).run(scenarios_accounting.measured_vs_planned, cfg):
        assert r["measured"] == r["planned"]
        assert r["comm"] == r["planned_comm"]
        assert r["state_bytes"] > 0 or r["planned"][3] == 0
