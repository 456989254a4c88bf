"""``zeroplan plan --pipeline-parallel P``: one plan per pipeline stage ([Note: mesh roles])."""

from __future__ import annotations

import json

from cli_runs import zeroplan

from zeroplan.core import (
    Topology,
    describe_optimizer,
    memory_report,
    pipeline_stages,
    pipeline_traffic,
    plan,
    preset_specs,
)

ARGS = ("--preset", "llama-7b", "--world", "8", "--stage", "2", "--pipeline-parallel", "4")


def test_each_stage_is_the_plan_of_its_blocks():
    out = zeroplan(*ARGS, "--json")
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    specs = preset_specs("llama-7b", "bf16")
    parts = pipeline_stages(specs, 4)
    assert document["pipeline_parallel"] == 4 and document["total_params"] == sum(s.numel for s in specs)
    assert [s["first"] for s in document["stages"]][:2] == ["model.embed_tokens.weight", parts[1][0].name]
    optimizer = describe_optimizer("AdamW")
    for k, (got, part) in enumerate(zip(document["stages"], parts, strict=True)):
        want = memory_report(plan(part, Topology(world_size=8), stage=2, optimizer=optimizer))
        assert {k: got[k] for k in want.as_dict()} == json.loads(json.dumps(want.as_dict()))
        assert got["world"] == 8
        (norm,) = pipeline_traffic(4, clipping=True, loss_scaling=False, rank=k)  # its float32 scalar
        assert got["pipeline_comm"] == [
            {"group": "pipeline", "collective": "all_reduce", "calls": 1, "bytes": norm.bytes}
        ]
    scaled = json.loads(zeroplan(*ARGS, "--json", "--loss-scaling").stdout)["stages"][0]["pipeline_comm"]
    assert [(c["calls"], c["bytes"]) for c in scaled] == [(2, 8)]  # and the overflow verdict


def test_table_names_every_stage_and_the_busiest():
    out = zeroplan(*ARGS)
    assert out.returncode == 0, out.stderr
    assert all(f"pipeline stage {k} of 4" in out.stdout for k in range(4))
    assert "the busiest stage is" in out.stdout and "4 x 8 ranks" in out.stdout
    assert (
        "1 scalar all-reduce(s) over the pipeline group (the norm (clipping)), 8 B sent per rank at most"
        in out.stdout
    )


def test_what_it_cannot_combine_is_a_one_line_error():
    for extra, needle in (
        (("--expert-parallel", "2"), "--expert-parallel does not take --pipeline-parallel"),
        (("--recommend",), "--recommend does not take --pipeline-parallel"),
        (("--pipeline-parallel", "40"), "at least as many blocks"),
    ):
        out = zeroplan(*ARGS, *extra)
        assert out.returncode == 2 and "zeroplan: error:" in out.stderr and needle in out.stderr, out.stderr
