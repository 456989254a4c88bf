"""The tables of [Note: test tiers] (``tests/conftest.py``): which tests start interpreters, which of
those the fast tier keeps, which execute notebooks. Node ids are relative to the repository root."""

from __future__ import annotations

#: Tests that start fresh interpreters (node-id prefixes, relative to the repository root).
STARTS_INTERPRETERS = (
    "tests/test_demo.py::test_two_ranks_agree_with_adamw_and_with_the_plan",
    "tests/test_demo.py::test_mics_shard_groups_reduce_over_the_replica_group",
    "tests/test_demo.py::test_two_simulated_nodes_gather_parameters_in_two_hops",
    "tests/test_demo.py::test_bf16_keeps_fp32_masters_and_agrees_within_bf16",
    "tests/test_demo.py::test_stage_3_shards_parameters_and_agrees_with_adamw_and_with_the_plan",
    "tests/test_demo.py::test_stage_3_without_resharding_gathers_once_per_step",
    "tests/test_examples.py",
    "tests/test_example_tensor.py",
    "tests/facade/test_hf.py",
    "tests/facade/test_export_hf.py",
    "tests/facade/test_hf_compile.py",
    "tests/facade/test_export.py::test_the_console_script_prints_one_line_for_a_missing_checkpoint",
    "tests/facade/test_export.py::test_export_keeps_about_one_tensor_resident_above_the_import",
    "tests/facade/test_faults.py",
    "tests/facade/test_exit.py",
    "tests/facade/test_checkpoint_failures.py::test_a_save_killed_midway_leaves_the_previous_checkpoint",
    "tests/facade/test_checkpoint_root.py::test_a_job_that_died_mid_save_leaves_no_lock_and_its_partial_goes",
    "tests/facade/test_checkpoint_root.py::test_without_flock_a_dead_writers_lock_is_taken_over",
    "tests/facade/test_interop.py::test_the_facade_package_stays_torch_free_until_broadcast_buffers_is_used",
    "tests/core/test_import_without_torch.py::test_core_works_with_torch_unimportable",
    "tests/core/test_import_without_torch.py::test_the_blocker_really_blocks",
    "tests/core/test_partition.py::test_fingerprints_are_identical_in_another_process_with_another_hash_seed",
    "tests/test_cli_plan.py::test_missing_subcommand_is_a_one_line_error",
    "tests/test_cli_plan.py::test_console_script_matches_the_module_entry_point",
    "tests/test_cli_plan.py::test_plan_never_imports_torch",
    "tests/test_cli_experts.py::test_plan_with_experts_never_imports_torch",
    "tests/cuda/",  # the GPU suite: every test runs its scenario in a fresh process (skipped on CPU)
)

#: Interpreter-starting tests kept in the fast tier: one of each kind a user meets first.
FAST_REPRESENTATIVES = (
    "tests/test_cli_plan.py::test_console_script_matches_the_module_entry_point",
    "tests/test_demo.py::test_two_ranks_agree_with_adamw_and_with_the_plan",
    "tests/facade/test_hf.py::test_fp32_training_is_bit_identical_to_ddp_with_adamw[zero-ddp]",
    "tests/core/test_import_without_torch.py",
    "tests/test_cli_plan.py::test_plan_never_imports_torch[args0]",
)

NOTEBOOKS = ("tests/test_notebooks.py::test_notebook_executes",)
