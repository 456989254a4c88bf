"""``zeroplan plan --expert-parallel E``: dense and expert domains, end to end, through a subprocess."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from cli_runs import needs_transformers, plan_in_process, zeroplan, zeroplan_many

from zeroplan.core import (
    Topology,
    describe_optimizer,
    domains_report,
    expert_domains,
    memory_report,
    plan,
    plan_domains,
    preset_specs,
    specs_from_shapes,
)

MIXTRAL = ("--preset", "mixtral-8x7b", "--world", "64", "--expert-parallel", "8")
ADAMW = describe_optimizer("AdamW")


def expected(specs, *, world, e, shard=None, per_node=None, stage=2):
    """The rank's specs, the domain plans and their report, as the CLI must compute them."""
    split = expert_domains(
        specs, world_size=world, expert_parallel=e, shard_size=shard, ranks_per_node=per_node
    )
    dp = plan_domains(split.specs, split.domains, stage=stage, optimizer=ADAMW, bucket_bytes=25 * 2**20)
    return split, dp, domains_report(dp)


def check_document(document, dp, report, *, world, e):
    """The ``--json`` document is the in-process report: every domain, and every rank's total."""
    assert [d["name"] for d in document["domains"]] == [d.name for d in dp.domains]
    for got, want, zp in zip(document["domains"], report.as_dict()["domains"], dp.plans, strict=True):
        assert {key: got[key] for key in want} == json.loads(json.dumps(want))
        assert (got["buckets"], got["layout"]) == (len(zp.buckets.buckets), zp.partition.layout)
    assert document["fingerprint"] == dp.fingerprint()
    assert (document["world"], document["expert_parallel"], document["stage"]) == (world, e, int(dp.stage))
    assert len(document["per_rank_total"]) == world
    for r, total in enumerate(document["per_rank_total"]):
        assert total == {"positions": [r, r // e], **report.rank((r, r // e)).as_dict()}


def assert_one_line_error(out: subprocess.CompletedProcess[str], needle: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == "" and "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if not line.startswith("[transformers]")]
    assert len(lines) == 1 and lines[0].startswith("zeroplan: error: "), out.stderr
    assert needle in lines[0], lines[0]


def dense_only(specs):
    """The dense parameters alone, as a plain model."""
    dense = [s for s in specs if ".experts." not in s.name]
    return specs_from_shapes([s.shape for s in dense], names=[s.name for s in dense], dtype=dense[0].dtype)


@pytest.fixture(scope="module")
def runs():
    return zeroplan_many(
        {
            "table": MIXTRAL,
            "json": (*MIXTRAL, "--json"),
            "mics": (
                *("--preset", "mixtral-8x7b", "--world", "32", "--expert-parallel", "4"),
                *("--shard-size", "8", "--ranks-per-node", "8", "--stage", "1", "--json"),
            ),
            "stage3": (*MIXTRAL, "--stage", "3", "--json"),
            "plain": ("--preset", "gpt2", "--world", "8", "--json"),
            "one": ("--preset", "gpt2", "--world", "8", "--expert-parallel", "1", "--json"),
        }
    )


# ----------------------------------------------------------------- JSON
def test_mixtral_json_has_both_domains(runs):
    out = runs["json"]
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    specs = preset_specs("mixtral-8x7b", "bf16")
    split, dp, report = expected(specs, world=64, e=8)
    check_document(document, dp, report, world=64, e=8)
    assert [d["world"] for d in document["domains"]] == [64, 8]
    assert document["total_params"] == sum(s.numel for s in specs) == 46_702_792_704
    assert document["params_per_rank"] == sum(s.numel for s in split.specs)
    experts = sum(s.numel for s in split.specs if s.group == 1)
    assert experts == 32 * 3 * 14336 * 4096  # one expert of each of the 32 MoE layers
    slack = 12 * 128 + ADAMW.state_bytes((0,), 4)  # alignment, and AdamW's step counter
    for rank in document["domains"][1]["report"]["ranks"]:
        # bf16 parameters: fp32 master and AdamW's two fp32 states, 12 bytes per element, over 8 ranks.
        assert 0 <= rank["master_bytes"] + rank["optimizer_state_bytes"] - experts * 12 // 8 <= slack
        assert rank["params_bytes"] == 2 * experts


def test_the_data_domain_is_the_plan_of_the_dense_params_alone(runs):
    document = json.loads(runs["json"].stdout)
    zp = plan(
        dense_only(preset_specs("mixtral-8x7b", "bf16")), Topology(world_size=64), stage=2, optimizer=ADAMW
    )
    assert document["domains"][0]["report"] == json.loads(json.dumps(memory_report(zp).as_dict()))


def test_shard_groups_and_nodes(runs):
    out = runs["mics"]
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    _, dp, report = expected(
        preset_specs("mixtral-8x7b", "bf16"), world=32, e=4, shard=8, per_node=8, stage=1
    )
    check_document(document, dp, report, world=32, e=4)
    data, experts = document["domains"]
    assert (data["world"], data["shard_size"], experts["world"], experts["shard_size"]) == (32, 8, 8, 8)
    # A node of 8 holds 2 expert-parallel groups of 4: the expert-data group of 8 spans 4 nodes.
    assert dp.domains[1].topology.ranks_per_node == 2
    links = {(c["group"], c["link"]) for c in document["per_rank_total"][0]["comm"]}
    assert ("experts/shard", "inter") in links and ("replica", "inter") in links


def test_expert_parallel_one_is_the_plain_plan(runs):
    plain, one = (json.loads(runs[key].stdout) for key in ("plain", "one"))
    del plain["planning_seconds"], one["planning_seconds"]
    assert one == plain


# ----------------------------------------------------------------- table
def test_mixtral_table_has_a_table_per_domain_and_the_totals(runs):
    out = runs["table"]
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    split, dp, report = expected(preset_specs("mixtral-8x7b", "bf16"), world=64, e=8)
    text = " ".join(out.stdout.split())  # rich wraps long lines at the terminal width
    assert "mixtral-8x7b: 46,702,792,704 parameters in 995 tensors" in text
    assert f"expert parallel 8: a rank holds {sum(s.numel for s in split.specs):,} parameters" in text
    for zp in (*dp.plans, dp):
        assert zp.fingerprint() in text
    assert "data domain (dense parameters)" in text and "world 64, shard groups of 64" in text
    assert "experts domain (1/8 of the experts)" in text and "world 8, shard groups of 8" in text
    assert "memory per rank of an expert-data-parallel group of 8" in text
    assert "per rank total, data + experts" in text
    tables = re.split(r"per rank total", out.stdout)
    assert re.search(r"│\s+0-63\s+│", tables[0]) and re.search(r"│\s+0-7\s+│", tables[0])
    total = report.rank((0, 0))
    assert f"{total.total_bytes / 2**30:,.3f}" in tables[1] and re.search(r"│\s+0-63\s+│", tables[1])


# ----------------------------------------------------------------- models
def test_shapes_file_with_named_experts(tmp_path):
    entries = [{"name": "embed", "shape": [97, 17]}]
    entries += [{"name": f"moe.experts.{e}.w", "shape": [17, 33]} for e in range(4)]
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(entries))
    out = zeroplan("--shapes", str(path), "--world", "4", "--expert-parallel", "2", "--json")
    assert out.returncode == 0, out.stderr
    specs = specs_from_shapes([e["shape"] for e in entries], names=[e["name"] for e in entries], dtype="bf16")
    _, dp, report = expected(specs, world=4, e=2)
    check_document(json.loads(out.stdout), dp, report, world=4, e=2)
    three = tmp_path / "three.json"
    three.write_text(json.dumps(entries[:4]))  # 3 experts
    out = zeroplan("--shapes", str(three), "--world", "4", "--expert-parallel", "2")
    assert_one_line_error(out, "MoE layer 'moe.experts' has 3 experts, which expert parallel size 2 does not")


MIXTRAL_CONFIG = {
    "model_type": "mixtral",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 100,
}


@needs_transformers
def test_hf_mixtral_config(tmp_path):
    """Whatever form transformers gives the experts (one module each, or stacked in one tensor)."""
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_CONFIG))
    out = zeroplan("--hf-config", str(tmp_path), "--world", "8", "--expert-parallel", "2", "--json")
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    experts, dense = document["domains"][1]["report"], document["domains"][0]["report"]
    # Per layer and expert: gate and up (128 x 64 each), down (64 x 128); 2 layers of 4 experts, halved.
    assert experts["total_params"] == 2 * 4 * 3 * 128 * 64 // 2 == 98_304
    assert experts["world"] == 4
    assert dense["total_params"] + 2 * experts["total_params"] == document["total_params"]


# ----------------------------------------------------------------- refusals
BAD = [
    (
        ["--world", "64", "--expert-parallel", "3"],
        "expert parallel size 3 does not divide the data-parallel world of 64",
    ),
    (["--preset", "gpt2", "--expert-parallel", "2"], "expert parallel size 2 needs expert parameters"),
    (
        ["--world", "64", "--expert-parallel", "16"],
        "has 8 experts, which expert parallel size 16 does not divide",
    ),
    (["--expert-parallel", "0"], "--expert-parallel must be >= 1"),
    (["--expert-parallel", "8", "--stage", "4"], "stage must be 0, 1, 2 or 3, got 4"),
    (
        ["--expert-parallel", "8", "--device-memory", "80GiB", "--seq-len", "4096"],
        "--device-memory does not take",
    ),
    (
        ["--expert-parallel", "8", "--seq-len", "4096"],
        "--seq-len does not take --expert-parallel into account",
    ),
    (["--expert-parallel", "8", "--activation-bytes", "1G"], "--activation-bytes does not take"),
    (["--expert-parallel", "8", "--recommend"], "--recommend does not take"),
    (["--world", "24", "--expert-parallel", "4", "--ranks-per-node", "6"], "one must divide the other"),
    (["--expert-parallel", "two"], "argument --expert-parallel: invalid int value: 'two'"),
]


@pytest.fixture(scope="module")
def bad_runs():
    runs = {" ".join(a): a if "--preset" in a else ["--preset", "mixtral-8x7b", *a] for a, _ in BAD}
    return zeroplan_many({key: tuple(args) for key, args in runs.items()})


@pytest.mark.parametrize(("args", "needle"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_expert_arguments_are_one_line_errors(bad_runs, args, needle):
    assert_one_line_error(bad_runs[" ".join(args)], needle)


def test_plan_with_experts_never_imports_torch():
    out = plan_in_process(list(MIXTRAL))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 0] []"


def test_stage_3_shards_each_domain_over_its_own_group(runs):
    out = runs["stage3"]
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    split, dp, report = expected(preset_specs("mixtral-8x7b", "bf16"), world=64, e=8, stage=3)
    check_document(document, dp, report, world=64, e=8)
    experts = [s for s in split.specs if s.group == 1]
    # between steps a rank holds 1/8 of its experts' parameters (bf16) and 1/64 of the dense ones
    expert_params = report.reports[1].ranks[0].params_bytes
    assert expert_params * 8 >= sum(s.numel for s in experts) * 2
    assert expert_params * 8 <= sum(s.numel for s in experts) * 2 * 1.01
