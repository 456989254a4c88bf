"""torch.distributed.checkpoint in both directions with FSDP2 ([Note: DCP interchange]).

A zeroplan run saved with ``dcp.save`` loads into FSDP2 (``fully_shard``, ``torch.optim.AdamW``) and
FSDP2's checkpoint loads into a fresh zeroplan run: masters (FSDP2's fp32 parameters), ``exp_avg``,
``exp_avg_sq`` and ``step`` bit for bit; the next steps as in the framework that saved.
"""

from __future__ import annotations

import scenarios_dcp

CASES = [
    {"stage": 1, "dtype": "bf16"},
    {"stage": 2},
    {"stage": 3, "dtype": "bf16"},
    {"stage": 2, "dtype": "bf16", "settings": {"shard": 1}},  # replicas: DCP writes one copy
    {"stage": 2, "compiled": True},  # torch.compile(model): saved and loaded under the plain names
]
#: Two steps after the move, the loading side's parameters against the saving side's (max-norm relative).
#: fp32: measured 0.0 (the same kernels on CPU), held to test_equivalence's fp32 tolerance. bf16: 0.043
#: and 0.051 at every stage; the frameworks compute bf16 gradients differently (FSDP2 casts fp32
#: parameters per forward, its reduce-scatter divides in its own order), held to test_stage3's bf16
#: tolerance between stages (0.1).
DRIFT = {"fp32": 1e-6, "bf16": 0.1}


def test_checkpoints_move_between_zeroplan_and_fsdp2_both_ways(pools, tmp_path):
    for rows in pools(2).run(scenarios_dcp.interchange_both_ways, CASES, str(tmp_path)):
        for case, r in zip(CASES, rows, strict=True):
            assert r["into_fsdp2"] == [] and r["into_zeroplan"] == [], (case, r)
            assert r["steps"] == 2.0, (case, r)
            tol = DRIFT[case.get("dtype", "fp32")]
            assert r["continued"] < tol and r["continued_back"] < tol, (case, r)


def test_a_dcp_checkpoint_loads_at_another_world_in_both_frameworks_and_converts_for_adamw(pools, tmp_path):
    pools(2).run(scenarios_dcp.save_zeroplan, {"stage": 2, "dtype": "bf16"}, str(tmp_path))
    rows = pools(1).run(scenarios_dcp.load_at_another_world, {"stage": 3, "dtype": "bf16"}, str(tmp_path))
    assert rows[0]["differ"] == [] and rows[0]["fsdp2_differ"] == [], rows
    # dcp_to_torch_save: whole tensors; the fp32 masters are the model's values
    assert rows[0]["converted_differ"] == [], rows


FULL_CASES = [{"stage": 3, "dtype": "bf16"}, {"stage": 2, "settings": {"shard": 1}}]


def test_full_state_dicts_are_whole_plain_tensors_that_load_into_fsdp2_and_zeroplan(pools):
    rows = pools(2).run(scenarios_dcp.full_state_dicts, FULL_CASES)
    for case, r0, r1 in zip(FULL_CASES, *rows, strict=True):
        assert r0["rank0"] == [] and r0["host"] and r1["empty"], (case, r0, r1)
        assert r0["everywhere"] == [] and r1["everywhere"] == [], (case, r0, r1)
        assert r0["groups"] == r0["fsdp2_groups"], (case, r0)
        for r in (r0, r1):
            assert r["into_fsdp2"] == [], (case, r["into_fsdp2"])
            assert r["into_zeroplan"] == [], (case, r["into_zeroplan"])
            assert r["everywhere_into_zeroplan"] == [], (case, r["everywhere_into_zeroplan"])


def test_torch_model_dicts_of_a_stage3_model_hold_its_pieces_and_load_both_ways(pools, tmp_path):
    cases = [{"stage": 3}, {"stage": 3, "dtype": "bf16"}]
    for rows in pools(2).run(scenarios_dcp.torch_model_dicts_at_stage3, cases, str(tmp_path)):
        for case, r in zip(cases, rows, strict=True):
            assert r["kinds"] == ["FlatPieces"], (case, r)
            assert r["into_fsdp2"] == [] and r["into_zeroplan"] == [], (case, r)
            assert r["from_rank0"] == [] and r["params_from_rank0"] == [], (case, r)  # masters too
            # The model dict holds the parameters in their dtype: bf16 masters restart from them (for the
            # masters, interchange.model_state_dict); fp32 ones are the parameters: continued bit for bit.
            assert r["masters_are_params"] == [], (case, r)
            if "dtype" not in case:
                assert r["continued"] == 0.0, (case, r)


def test_what_whole_tensor_dicts_cannot_take_raises_on_every_rank(pools):
    for r in pools(2).run(scenarios_dcp.full_dicts_refused):
        assert "held whole by some ranks only" in r["whole_state"], r
        assert "not a whole tensor" in r["pieces_from_rank0"], r


#: Every elementwise inner optimizer fresh before its first step; the Adam family and SGD also with a
#: cohort fresh after ``refresh_trainable`` unfroze a block.
FRESH_CASES = [{"optimizer": name, "when": "start"} for name in scenarios_dcp.FRESH_OPTIMIZERS] + [
    {"optimizer": name, "when": "unfrozen"} for name in ("AdamW", "NAdam", "SGD")
]


def test_a_cohort_saved_before_its_first_step_resumes_as_it_continues(pools, tmp_path):
    """[Note: fresh entries]: saved as the state before the first update (``step`` 0), loaded as no state."""
    for rows in pools(2).run(scenarios_dcp.fresh_cohorts_resume_as_they_continue, FRESH_CASES, str(tmp_path)):
        for case, r in zip(FRESH_CASES, rows, strict=True):
            assert r["differ"] == [], (case, r)
            assert r["to_reference"] < DRIFT["fp32"], (case, r)  # Adagrad's initial_accumulator_value too
            assert r["saved_steps"] in ([], [0.0]) if case["when"] == "start" else [0.0, 2.0], (case, r)


def test_a_bf16_torch_run_dicts_load_with_fp32_moments_and_step_as_torch(pools):
    """[Note: loaded state as kept]: plain and whole-tensor dicts of bf16 moments load as torch.optim's."""
    for r in pools(2).run(scenarios_dcp.bf16_torch_dicts_load_as_torch_does):
        for way, row in r.items():
            assert row["differ"] == [] and row["kinds"] == ["torch.float32"], (way, row)
            assert isinstance(row["drift"], float) and row["drift"] < DRIFT["bf16"], (way, row)
