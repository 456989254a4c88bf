"""``ZeroOptimizer(..., device_mesh=mesh)`` ([Note: mesh roles] in ``zeroplan.core.mesh``), gloo, world 4.

Two pipeline stages of two data-parallel ranks each, one ``ZeroOptimizer`` per stage, against one
process with the whole model: parameters within test_equivalence's fp32 tolerance, the clip norm of
the whole model equal on every rank, and an overflow on one stage skipping the step on both.
"""

from __future__ import annotations

import scenarios_mesh

#: fp32 against one process: the sums run in another order (test_equivalence's tolerance).
TOL = 1e-5

CASES = [
    {"stage": 2, "clip": 0.05},
    {"stage": 1, "clip": 0.05, "norm_type": float("inf")},
    {"stage": 3, "clip": 0.05},
    {"stage": 2, "clip": 10.0, "loss_scale": "dynamic", "inf_at": 1},
    {"stage": 2, "clip": 0.05, "mesh": "mics"},  # shard groups made for every stage by every rank
]


def test_pipeline_stages_step_as_one_model(pools):
    rows = pools(4).run(scenarios_mesh.pipeline_against_one_process, CASES)
    for rank_rows in rows:
        for case, r in zip(CASES, rank_rows, strict=True):
            assert r["param_err"] < TOL, (case, r)
            assert r["norm_err"] < TOL, (case, r)  # the whole model's norm, on every stage
            expected = [step == case.get("inf_at") for step in range(3)]
            assert r["skipped"] == expected, (case, r)  # stage 0 skips stage 1's overflow too


def test_meshes_zeroplan_cannot_use_raise_on_every_rank(pools):
    for r in pools(4).run(scenarios_mesh.bad_meshes):
        assert "mesh_dim_names" in r["no_names"], r
        assert "no data-parallel dimension" in r["no_dp"], r
        assert "tensor-parallel dimension" in r["tp"] and "no parameter of any pipeline stage" in r["tp"], r
        assert r["tp_one"] is None, r
        assert "not both" in r["both"], r
        assert "different device meshes or settings" in r["differ"], r
        assert "expert groups" in r["experts"], r
        assert r["divisor"].startswith("ConfigError") and r["late"].startswith("StepOrderError"), r


SCHEDULE_CASES = [
    {"stage": 2, "clip": 0.05},
    {"stage": 3, "clip": 0.05},
    {"stage": 2, "clip": 0.05, "loss_scale": "dynamic"},  # loss_fn multiplies by opt.loss_scale
    {"stage": 2, "clip": 0.05, "scale_grads": True},  # torch divides: the optimizer does it
    # opt.backward_scale is the loss scale / world here: loss_fn times opt.loss_scale made W x gradients
    {"stage": 2, "clip": 0.05, "loss_scale": 1024.0, "deterministic": True},
]


def test_torch_pipelining_schedules_accumulate_micro_batches_and_reduce_once(pools):
    rows = pools(4).run(scenarios_mesh.schedule_against_one_process, SCHEDULE_CASES)
    for rank_rows in rows:
        for case, r in zip(SCHEDULE_CASES, rank_rows, strict=True):
            assert r["param_err"] < TOL and r["norm_err"] < TOL, (case, r)
            assert "one stage per optimizer" in r["second_stage"], (case, r)


def test_each_stage_saves_and_loads_its_own_checkpoint_in_the_background_too(pools, tmp_path):
    for r in pools(4).run(scenarios_mesh.stage_checkpoints, str(tmp_path)):
        assert r == {"blocking": True, "background": True}, r


def test_stages_holding_different_saves_refuse_to_load_on_every_rank(pools, tmp_path):
    for r in pools(4).run(scenarios_mesh.stage_roots_apart, str(tmp_path)):
        assert r["save1"] is None and (r["save2"] is None) == (r["stage"] == 0), r
        assert r["latest"] is not None and r["latest"].startswith("CheckpointError"), r
        assert "pp stage 0 has snapshot-00000002" in r["latest"], r
        assert "pp stage 1 has snapshot-00000001" in r["latest"], r
        assert r["unchanged"] and r["older"] == {"step": 1}, r


def test_a_stages_consolidated_dict_is_refused_by_the_other_stage(pools, tmp_path):
    for r in pools(4).run(scenarios_mesh.stage_consolidated_dicts, str(tmp_path)):
        assert r["recorded"] and r["unchanged"], r
        assert r["refused"].startswith("IncompatiblePlanError") and "holds pipeline stage" in r["refused"], r
        assert r["one_stage"] is not None and "holds pipeline stage" in r["one_stage"], r  # every rank
