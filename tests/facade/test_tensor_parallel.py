"""DTensor parameters from torch's tensor parallel, sharded over data parallelism ([Note: tensor-parallel
parameters] in ``zeroplan.core.tensor_parallel``), gloo, world 4: a ``("dp", "tp")`` mesh of 2 x 2.

Against one process holding the plain model and stepping ``torch.optim.AdamW`` on both data-parallel
batches: parameters within test_equivalence's fp32 tolerance, the clip norm of the whole model on
every rank, an overflow on one tp rank skipping the step everywhere, and uneven local shards.
"""

from __future__ import annotations

import pytest
import scenarios_tensor

#: fp32 against one process: the sums run in another order (test_equivalence's tolerance).
TOL = 1e-5

CASES = [
    {"stage": 2, "clip": 0.05},  # sequence-parallel norms: their gradients arrive Partial over tp
    {"stage": 1, "clip": 0.05, "norm_type": float("inf")},
    {"stage": 2, "clip": 10.0, "loss_scale": "dynamic", "inf_at": 1},  # tp rank 1 alone overflows
    {"stage": 2, "clip": 0.05, "hidden": 5},  # uneven: local shards of 3 and 2 rows
    {"stage": 3, "clip": 0.05, "hidden": 5},  # local shards sharded over dp, gathered around each use
]


def _check(cases, rows):
    for rank_rows in rows:
        for case, r in zip(cases, rank_rows, strict=True):
            assert r["param_err"] < TOL, (case, r)
            assert r["norm_err"] < TOL, (case, r)  # the whole model's norm, on every rank
            expected = [step == case.get("inf_at") for step in range(3)]
            assert r["skipped"] == expected, (case, r)


def test_tensor_parallel_parameters_train_as_one_process(pools):
    rows = pools(4).run(scenarios_tensor.tensor_against_one_process, CASES)
    _check(CASES, rows)
    shapes = [r["local_shapes"][2] for r in (rank_rows[3] for rank_rows in rows)]
    assert sorted(set(shapes)) == [(2, 8), (3, 8)]  # the uneven case's column-split weight


@pytest.mark.parametrize(
    "case",
    [
        {"stage": 1, "clip": 0.05, "deterministic": True},
        {"stage": 2, "clip": 0.05, "mesh": "mics"},  # ("dp_replicate", "dp_shard", "tp") of 2 x 1 x 2
        {"stage": 1, "clip": 0.05, "norm_type": 1.0, "hidden": 5},
        {
            "stage": 2,
            "clip": 0.05,
            "offload": "optimizer",
        },  # masters and state of the local shards on the host
        {"stage": 2, "clip": 0.05, "add_group": True},  # DTensors brought by add_param_group
        {"stage": 3, "clip": 0.05, "offload": "all", "deterministic": True},  # shards on the host too
        {"stage": 3, "clip": 0.05, "mesh": "mics", "add_group": True},
        {"stage": 3, "clip": 0.05, "recompute": True},  # activation checkpointing over the whole model
        {"stage": 3, "clip": 0.05, "reshard_after_forward": False, "recompute": True},
    ],
)
def test_tensor_parallel_with_other_settings(pools, case):
    _check([case], pools(4).run(scenarios_tensor.tensor_against_one_process, [case]))


def test_tensor_parallel_alone_trains_as_one_process(pools):
    """tp=2 x dp=1 (world 2): the data-parallel dimension of one rank, stage 3 and a dynamic scale."""
    cases = [{"stage": 3, "clip": 0.05}, {"stage": 2, "clip": 10.0, "loss_scale": "dynamic", "inf_at": 1}]
    _check(cases, pools(2).run(scenarios_tensor.tensor_against_one_process, cases))


@pytest.mark.parametrize("stage", [2, 3])
def test_deterministic_mode_at_a_fixed_tp_degree_is_bit_identical_across_dp_sizes(pools, stage):
    """tp=2 x dp=2 and tp=2 x dp=1 (4 micro-batches split 2 + 2, or 4 on each rank): the same bits."""
    two, one = (pools(w).run(scenarios_tensor.tensor_deterministic, {"stage": stage}) for w in (4, 2))
    assert len({r["params"] for r in two + one}) == 1, (two, one)
    assert len({tuple(r["norms"]) for r in two + one}) == 1, (two, one)


def test_tensor_parameters_zeroplan_cannot_shard_raise_on_every_rank(pools):
    for r in pools(4).run(scenarios_tensor.bad_tensor_parameters):
        assert "needs ZeroOptimizer(..., device_mesh=mesh) with a 'tp' dimension" in r["no_mesh"], r
        assert "Partial" in r["partial"], r
        assert "not on the optimizer mesh's 'tp'" in r["elsewhere"], r
        assert "Partial" in r["alone"], r  # tp rank 1 alone, heard by every rank
        assert r["plain_optimizer_ok"] is None, r


def test_tensor_checkpoints_load_at_another_dp_size_and_another_tp_degree(pools, tmp_path):
    for r in pools(4).run(scenarios_tensor.tensor_checkpoints, str(tmp_path)):
        assert r == {"same": True}, r
    # tp=2 x dp=1 (world 2): each slice's root saved at dp=2, stage 2 -> 1
    for r in pools(2).run(scenarios_tensor.tensor_checkpoint_elsewhere, str(tmp_path)):
        assert r["param_err"] < TOL, r
    # tp 2 -> 1 ([Note: reslicing tensor-parallel checkpoints]): a plain model at dp=2 and at world 1
    for world in (2, 1):
        for r in pools(world).run(scenarios_tensor.tensor_checkpoint_resliced, str(tmp_path)):
            assert r["param_err"] < TOL, (world, r)
    for r in pools(4).run(scenarios_tensor.tensor_checkpoint_sliced, str(tmp_path)):  # tp 1 -> 2
        assert r["param_err"] < TOL, r
    for r in pools(2).run(scenarios_tensor.tensor_checkpoint_bad_slices, str(tmp_path)):
        assert "CheckpointError" in r["missing"] and "pass every slice's root" in r["missing"], r
        assert "CheckpointError" in r["reversed"] and "in tp order" in r["reversed"], r
        assert "was saved by tp slice 0 of 2" in r["one_slice"], r
        assert r["unchanged"], r


def test_slices_holding_different_saves_refuse_to_load_on_every_rank(pools, tmp_path):
    # [Note: one save across slices]: slice 1's second save failed, slice 0's committed
    for r in pools(4).run(scenarios_tensor.tensor_slices_commit_apart, str(tmp_path)):
        assert r["save1"] is None, r
        assert (r["save2"] is None) == (r["rank"] % 2 == 0), r
        assert r["latest"] is not None and r["latest"].startswith("CheckpointError"), r
        assert "tp slice 0 has snapshot-00000002" in r["latest"], r
        assert "tp slice 1 has snapshot-00000001" in r["latest"], r
        assert "'snapshot-00000001'" in r["latest"], r  # the newest snapshot both roots hold
        assert r["unchanged"] and r["no_state"], r
        assert "CheckpointError" in r["resliced"] and "hold different saves" in r["resliced"], r
        assert r["older"] == {"step": 1}, r


@pytest.mark.parametrize("stage", [2, 1, 3])
def test_planned_memory_of_the_local_shards_is_what_memtracker_measures(pools, stage):
    for r in pools(4).run(scenarios_tensor.tensor_step_peak, {"stage": stage}):
        assert r["local_params"] == 2 * 256 + 512 * 256 + 512 + 256 * 512 + 256 + 2 * 256, r
        assert abs(r["measured"][-1] / r["planned"] - 1) <= 0.01, r


@pytest.mark.parametrize("stage", [2, 1, 3])
def test_the_same_numbers_as_fsdp2_with_the_same_tensor_parallel_plan(pools, stage):
    for r in pools(4).run(scenarios_tensor.against_fsdp2, {"stage": stage}):
        assert r["fsdp2_mesh"] == ("dp", "tp"), r  # FSDP2 sharded the tp-local tensors over dp
        assert r["param_err"] < TOL, r  # bit for bit on this machine (0.0), the tolerance as elsewhere


@pytest.mark.parametrize("cfg", [{"stage": 2}, {"stage": 1}, {"stage": 3}, {"stage": 3, "plain_last": True}])
def test_pipeline_stages_of_tensor_parallel_modules_step_as_one_model(pools, cfg):
    """``plain_last``: a stage without DTensors (replicated over tp) beside a tp-split one."""
    for rank, r in enumerate(
        pools(4).run(scenarios_tensor.pipeline_with_tensor_parallel, {**cfg, "clip": 0.05})
    ):
        assert r["param_err"] < TOL and r["norm_err"] < TOL, r
        assert r["placed"] == (rank < 2 or not cfg.get("plain_last")), r  # pp-major: ranks 2, 3 stage 1


@pytest.mark.parametrize(
    "cfg",
    [{"stage": 2}, {"stage": 1}, {"stage": 3}, {"stage": 3, "dtype": "fp16"}, {"stage": 2, "dtype": "fp16"}],
)
def test_low_precision_parameters_step_as_fp32_masters_of_the_averaged_local_gradients(pools, cfg):
    """bf16/fp16 DTensor parameters: bit for bit what a hand-written step does with fp32 copies of the
    local tensors and their gradients (in the parameter's placement) averaged over dp; fp16 with a
    dynamic loss scale, an overflow on tp rank 1 alone skipping the step on every rank."""
    for r in pools(4).run(scenarios_tensor.low_precision_against_masters, cfg):
        assert all(r["equal"]), r
        assert r["skipped"] == r["theirs_skipped"], r
        if cfg.get("dtype") == "fp16":
            assert r["skipped"] == [False, True, False], r


def test_dcp_round_trip_of_tensor_parallel_state_into_zeroplan_and_fsdp2(pools, tmp_path):
    """The optimizer's pieces carry global coordinates: DCP's boxes of the tp slices do not overlap.
    At stage 3 the model's pieces do too (the rank's elements of its local tensors)."""
    for stage in (2, 3):
        for r in pools(4).run(scenarios_tensor.tensor_dcp_round_trip, str(tmp_path / f"s{stage}"), stage):
            assert r["zeroplan"] < TOL and r["fsdp2"] < TOL, (stage, r)  # 0.0 on this machine


@pytest.mark.parametrize("stage", [2, 3])
def test_whole_tensor_optimizer_dicts_equal_fsdp2s_and_load_from_them(pools, stage):
    for r in pools(4).run(scenarios_tensor.tensor_whole_dicts, stage):
        assert r["keys"] and r["plain"] and r["rank0_only"], r
        assert r["shapes"] == [(5,), (5, 8), (8,), (8, 5)], r  # the global shapes
        assert r["state_err"] < TOL and r["resumed_err"] < TOL and r["broadcast_err"] < TOL, r
        assert r["one_rank"] is not None and r["unchanged"], r  # one rank's bad dict: no slice loads
        assert "param groups" in r["one_rank"], r


def test_dtensor_parameters_gather_on_use_stage3_holding_no_block_between_steps(pools):
    for r in pools(4).run(scenarios_tensor.tensor_stage3_uses, {}):
        assert all(r["raised"].values()), r  # values: gathered inside a forward or gathered_params only
        assert r["meta"] == ((6, 8), True, True, True), r  # the global shape, placement, grad, flag
        assert r["held_at_rest"] == r["held_after_forward"] == r["held_after_backward"] == 0, r
        assert r["dict"] == ("FlatPieces", True), r  # the rank's pieces, in global coordinates
        assert r["kept"], r
        assert (r["in_flight"], r["arrived"]) == ("GatheringDTensor", "DTensor"), r  # stage 2's overlap


def test_consolidated_dicts_hold_the_whole_model_and_refuse_one_slices_tensors(pools, tmp_path):
    for rank, r in enumerate(pools(4).run(scenarios_tensor.tensor_consolidated_dicts, str(tmp_path))):
        assert r["rank0_only"], r
        assert r["shapes"] == [(6,), (6, 8), (8,), (8, 6)], r  # the global shapes
        assert r["state_err"] == 0.0, r  # the same values as interchange's whole-tensor dict
        assert r["unchanged_by_load"] and r["unchanged_by_refusal"], r
        assert r["one_slice"].startswith("IncompatiblePlanError"), r  # on every rank
        assert "cannot say which slice it holds" in r["one_slice"], r
        assert ("rejected the state dict" in r["one_slice"]) == (rank != 3), r  # rank 3's dict, heard
        assert r["one_group"] is not None and r["unchanged_by_one_group"], r  # no slice loads alone
        assert "param group" in r["one_group"], r
