"""``zeroplan plan --tensor-parallel T``: one tensor-parallel rank's local shards ([Note: tensor-parallel
parameters])."""

from __future__ import annotations

import json

from cli_runs import zeroplan

from zeroplan.core import (
    Topology,
    describe_optimizer,
    memory_report,
    pipeline_stages,
    plan,
    preset_specs,
    tensor_parallel_specs,
    tensor_replicas,
)

ARGS = ("--preset", "llama-7b", "--world", "8", "--stage", "2", "--tensor-parallel", "4")


def test_the_plan_is_the_plan_of_the_local_shards():
    out = zeroplan(*ARGS, "--json", "--sequence-parallel")
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    local = tensor_parallel_specs(preset_specs("llama-7b", "bf16"), 4)
    want = memory_report(plan(local, Topology(world_size=8), stage=2, optimizer=describe_optimizer("AdamW")))
    assert document["ranks"][0] == json.loads(json.dumps(want.ranks[0].as_dict()))
    whole = memory_report(plan(preset_specs("llama-7b", "bf16"), Topology(world_size=8), stage=2))
    assert whole.ranks[0].total_bytes > 3.5 * want.ranks[0].total_bytes  # a quarter, and the replicas
    tensor = document["tensor_parallel"]
    replicas = [s for s in local if s.index in tensor_replicas(local)]
    assert tensor["degree"] == 4 and tensor["replicated_params"] == len(replicas) == 65
    grads, norm = tensor["planned_comm"]
    assert grads["calls"] == 65 and (norm["calls"], norm["bytes"]) == (
        1,
        4,
    )  # one float32 scalar (ring model)
    # a ring all-reduce sends 2 (T - 1) / T of each replica's bytes
    assert abs(grads["bytes"] - 1.5 * sum(s.numel * 2 for s in replicas)) < 65 * 8
    assert "not zeroplan's" in tensor["not_planned"]


def test_the_table_says_what_one_rank_holds_and_sends_over_tp():
    out = zeroplan(*ARGS, "--pipeline-parallel", "2")
    assert out.returncode == 0, out.stderr
    assert "tensor parallel 4:" in out.stdout and "4 x 8 ranks per pipeline stage" in out.stdout
    assert "not planned" in out.stdout


def test_with_pipeline_stages_each_stage_sends_its_own_replicas_over_tp():
    document = json.loads(zeroplan(*ARGS, "--pipeline-parallel", "2", "--sequence-parallel", "--json").stdout)
    local = tensor_parallel_specs(preset_specs("llama-7b", "bf16"), 4)
    for got, part in zip(document["stages"], pipeline_stages(local, 2), strict=True):
        replicas = len(tensor_replicas(part))
        assert got["tensor_parallel"]["replicated_params"] == replicas, got["tensor_parallel"]
        assert got["tensor_parallel"]["planned_comm"][0]["calls"] == replicas
    assert sum(s["tensor_parallel"]["replicated_params"] for s in document["stages"]) == 65


def test_what_it_cannot_combine_is_a_one_line_error():
    for extra, needle in (
        (("--expert-parallel", "2"), "--expert-parallel does not take --tensor-parallel"),
        (("--recommend", "--device-memory", "80GiB"), "does not take --tensor-parallel"),
        (("--tensor-parallel", "0"), "--tensor-parallel must be >= 1"),
    ):
        out = zeroplan(*ARGS, *extra)
        assert out.returncode == 2 and "zeroplan: error:" in out.stderr and needle in out.stderr, out.stderr
    out = zeroplan("--preset", "gpt2", "--sequence-parallel")
    assert out.returncode == 2 and "--sequence-parallel needs --tensor-parallel" in out.stderr
