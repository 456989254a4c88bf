"""``zeroplan plan --device-memory … --recommend``: does it fit, end to end, as a user runs it."""

from __future__ import annotations

import json
import subprocess

import pytest
from cli_runs import needs_transformers, zeroplan, zeroplan_many

from zeroplan.core import (
    ConfigError,
    Topology,
    activation_memory,
    describe_optimizer,
    fit_report,
    memory_report,
    plan,
    preset_dims,
    preset_specs,
    recommend,
    specs_from_shapes,
)
from zeroplan.facade.cli.fit_command import parse_size
from zeroplan.facade.cli.model_sources import dims_from_hf_config

GiB = 2**30


def flat(text: str) -> str:
    """``text`` with every run of whitespace (rich's line wrapping included) made one space."""
    return " ".join(text.split())


def llama_activations(recompute: str = "none") -> int:
    dims = preset_dims("llama-7b")
    return activation_memory(dims, micro_batch=1, seq_len=4096, recompute=recompute).total_bytes


LLAMA = ("--preset", "llama-7b", "--world", "64", "--device-memory", "80GiB", "--micro-batch", "1")
LLAMA += ("--seq-len", "4096", "--recommend")


@pytest.fixture(scope="module")
def llama_runs():
    """The llama-7b runs (a few seconds each), started together."""
    runs = {
        "none": LLAMA,
        "selective": (*LLAMA, "--recompute", "selective"),
        "json": (*LLAMA, "--recompute", "selective", "--json"),
    }
    return zeroplan_many(runs)


# ----------------------------------------------------------------- the recommender on a preset
def test_llama_7b_at_4096_tokens_without_recomputation_fits_nowhere(llama_runs):
    out = llama_runs["none"]
    assert out.returncode == 1, out.stderr  # nothing fits: status 1, not a usage error
    assert out.stderr == ""
    expected = recommend(
        preset_specs("llama-7b", "bf16"), 64, device_bytes=80 * GiB, activation_bytes=llama_activations()
    )
    assert expected.best is None
    text = flat(out.stdout)
    assert f"recommendation: {flat(expected.reason)}" in text
    assert "nothing fits in 80.00 GiB: the least any configuration needs is" in text
    assert "to fit: --recompute selective or full, a smaller --micro-batch or --seq-len" in text
    assert "activations: 97.57 GiB per rank (micro-batch 1 x 4,096 tokens, recompute none;" in text


def test_llama_7b_with_selective_recomputation_gets_stage_2(llama_runs):
    out = llama_runs["selective"]
    assert out.returncode == 0, out.stderr
    expected = recommend(
        preset_specs("llama-7b", "bf16"),
        64,
        device_bytes=80 * GiB,
        activation_bytes=llama_activations("selective"),
    )
    assert (expected.best.fit.stage, expected.best.fit.shard_size) == (2, 64)
    text = flat(out.stdout)
    assert f"recommendation: {flat(expected.reason)}" in text
    assert "recommendation: stage 2 with shard groups of 64: fits with 47.99 GiB to spare" in text
    assert "stage 3 fits but sends" in text
    # The table of the planned configuration gains the need and whether it fits; the grid covers
    # every stage and shard size.
    assert "need at" in out.stdout and "fits" in out.stdout
    assert "fit in 80.00 GiB: stage 2, shard groups of 64: every rank fits" in text
    assert "by stage and shard size, device 80.00 GiB" in text
    assert "stage 3 ┃" in out.stdout
    after = out.stdout.split("stage 3 ┃")[1].splitlines()
    grid = [line for line in after if line.startswith("│") and line.count("│") == 5]
    assert [line.split("│")[1].strip() for line in grid] == ["1", "2", "4", "8", "16", "32", "64"]


def test_json_fields(llama_runs):
    out = llama_runs["json"]
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    activations = llama_activations("selective")
    assert document["activations"]["source"] == "korthikanti2022"
    assert document["activations"]["total_bytes"] == activations
    assert document["activations"]["recompute"] == "selective"
    assert document["device_bytes"] == 80 * GiB
    zp = plan(
        preset_specs("llama-7b", "bf16"), Topology(world_size=64), optimizer=describe_optimizer("AdamW")
    )
    fit = fit_report(memory_report(zp), activation_bytes=activations, device_bytes=80 * GiB)
    assert document["fit"] == fit.as_dict()
    for record, rank in zip(document["ranks"], fit.ranks, strict=True):
        assert {k: record[k] for k in ("need_bytes", "need_phase", "spare_bytes", "fits")} == rank.as_dict()
    advice = document["recommendation"]
    expected = recommend(
        preset_specs("llama-7b", "bf16"), 64, device_bytes=80 * GiB, activation_bytes=activations
    )
    assert advice == json.loads(json.dumps(expected.as_dict()))
    assert len(advice["options"]) == 3 * 7 * 2  # stages x divisors of 64 x (foreach, fused)
    assert advice["best"]["stage"] == 2


# ----------------------------------------------------------------- other sources and options
def test_the_recommender_plans_the_layout_asked_for(tmp_path):
    # fp32, 1 MiB buckets: an interleaved stage-1 shard reduces into a gradient shard of its own beside
    # the full gradients; a rank-major one reduces into its region of them.
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps([[1024, 1024]] * 4))
    needs = {}
    for layout in ("interleaved", "rank_major"):
        out = zeroplan(
            "--shapes", str(path), "--dtype", "fp32", "--world", "4", "--layout", layout, "--bucket-mb", "1",
            "--device-memory", "1GiB", "--activation-bytes", "1M", "--recommend", "--json",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        advice = json.loads(out.stdout)["recommendation"]
        specs = specs_from_shapes([(1024, 1024)] * 4, dtype="fp32")
        expected = recommend(
            specs, 4, device_bytes=2**30, activation_bytes=2**20, layout=layout, bucket_bytes=2**20
        )
        assert advice == json.loads(json.dumps(expected.as_dict()))
        needs[layout] = [o["need_bytes"] for o in advice["options"]]
    assert needs["interleaved"] != needs["rank_major"]


def test_activation_bytes_with_a_shapes_file(tmp_path):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps([[1024, 1024], [17, 257]]))
    out = zeroplan(
        "--shapes", str(path), "--world", "2", "--device-memory", "16MiB", "--activation-bytes", "4M"
    )
    assert out.returncode == 0, out.stderr
    assert "activations: 4.0 MiB per rank (--activation-bytes)" in out.stdout
    assert "of 16.0 MiB at the backward" in flat(out.stdout)
    document = json.loads(
        zeroplan(
            "--shapes",
            str(path),
            "--world",
            "2",
            "--device-memory",
            "1MiB",
            "--activation-bytes",
            "0",
            "--json",
        ).stdout
    )
    assert document["activations"] == {"source": "--activation-bytes", "total_bytes": 0}
    assert document["fit"]["fits"] is False and document["fit"]["activation_bytes"] == 0


def test_seq_len_alone_reports_the_activations_and_keeps_the_table():
    out = zeroplan("--preset", "gpt2", "--seq-len", "1024", "--micro-batch", "8", "--recompute", "selective")
    assert out.returncode == 0, out.stderr
    assert "activations: 3.95 GiB per rank (micro-batch 8 x 1,024 tokens, recompute selective;" in out.stdout
    assert "need at" not in out.stdout and "recommendation" not in out.stdout
    plain = zeroplan("--preset", "gpt2")
    assert plain.stdout.splitlines()[2:] == out.stdout.splitlines()[2 : len(plain.stdout.splitlines())]


GPT2_CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000}


def test_dims_of_a_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CONFIG))
    dims = dims_from_hf_config(tmp_path)
    assert (dims.layers, dims.hidden, dims.heads, dims.vocab) == (2, 64, 2, 1000)


@needs_transformers
def test_hf_config_activations(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**GPT2_CONFIG, "bos_token_id": 0, "eos_token_id": 0}))
    args = ("--hf-config", str(tmp_path), "--world", "2", "--device-memory", "1GiB", "--seq-len", "128")
    out = zeroplan(*args, "--json")
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    expected = activation_memory(dims_from_hf_config(tmp_path), micro_batch=1, seq_len=128)
    assert document["activations"]["total_bytes"] == expected.total_bytes
    assert document["activations"]["layers"] == 2 and document["fit"]["fits"] is True


LLAMA_SMALL = {
    "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 344,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
}  # fmt: skip


@needs_transformers
def test_trace_gives_the_whole_step_and_the_verdict(tmp_path):
    """``--trace``: the activations traced under fake tensors ([Note: traced activations]) and the
    whole step per rank ([Note: one timeline]), equal to ``traced_step_peak`` of the same plan."""
    from zeroplan.core import Topology, plan
    from zeroplan.core.sizing.trace import traced_step_peak
    from zeroplan.facade.cli.model_sources import specs_from_hf_config, trace_hf_config

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_SMALL))
    args = ("--hf-config", str(tmp_path), "--world", "2", "--dtype", "fp32", "--seq-len", "128")
    args += ("--micro-batch", "2", "--trace")
    document = json.loads(zeroplan(*args, "--device-memory", "1GiB", "--json").stdout)
    trace = trace_hf_config(tmp_path, "fp32", seq_len=128, micro_batch=2, recompute=False)
    assert document["activations"]["source"] == "trace"
    assert document["activations"]["total_bytes"] == trace.peak_bytes > 0
    zp = plan(specs_from_hf_config(tmp_path, "fp32"), Topology(world_size=2), stage=2)
    # Stage 2 holds each gradient until its bucket is staged: traced again with the plan, exactly.
    assert not all(p.exact for p in traced_step_peak(zp, trace))
    held = trace_hf_config(tmp_path, "fp32", seq_len=128, micro_batch=2, recompute=False, plan=zp)
    expected = traced_step_peak(zp, held)
    assert all(p.exact for p in expected)
    assert [r["peak_bytes"] for r in document["traced_step"]] == [p.peak_bytes for p in expected]
    small = zeroplan(*args, "--device-memory", "8MiB")
    assert small.returncode == 0, small.stderr
    assert "whole step, traced:" in flat(small.stdout) and "does not fit by" in flat(small.stdout)
    recomputed = json.loads(zeroplan(*args, "--recompute", "full", "--json").stdout)
    assert recomputed["activations"]["total_bytes"] < trace.peak_bytes


@needs_transformers
def test_trace_at_stage_3_holds_the_gathered_blocks(tmp_path):
    """At stage 3 ``--trace`` traces again with the plan: its hooks hold the gathered blocks where a
    step holds them ([Note: stage 3 traced]), and the step is exact, below the bound traced alone."""
    from zeroplan.core import Topology, plan
    from zeroplan.core.sizing.trace import traced_step_peak
    from zeroplan.facade.cli.model_sources import specs_from_hf_config, trace_hf_config

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_SMALL))
    args = (
        "--hf-config",
        str(tmp_path),
        "--world",
        "2",
        "--dtype",
        "fp32",
        "--seq-len",
        "128",
        "--stage",
        "3",
    )
    document = json.loads(zeroplan(*args, "--trace", "--json").stdout)
    zp = plan(specs_from_hf_config(tmp_path, "fp32"), Topology(world_size=2), stage=3)
    held = traced_step_peak(
        zp, trace_hf_config(tmp_path, "fp32", seq_len=128, micro_batch=1, recompute=False, plan=zp)
    )
    alone = traced_step_peak(
        zp, trace_hf_config(tmp_path, "fp32", seq_len=128, micro_batch=1, recompute=False)
    )
    assert [r["peak_bytes"] for r in document["traced_step"]] == [p.peak_bytes for p in held]
    assert all(r["exact"] and r["traced_blocks"] for r in document["traced_step"])
    assert all(not a.exact and a.peak_bytes > h.peak_bytes for a, h in zip(alone, held, strict=True))
    out = zeroplan(*args, "--trace")
    assert "activations, gradients and gathered blocks" in flat(out.stdout), out.stdout


@needs_transformers
def test_recommend_with_traced_activations_chooses_the_micro_batch_too(tmp_path):
    """``--recommend --trace``: each configuration's need is its step's timeline, the micro-batch is
    the largest of ``--micro-batch`` and its halvings at which one fits, and the choice is exact
    (traced again with its plan where the trace without one was not: [Note: the cheapest
    configuration])."""
    from zeroplan.core import Topology, plan
    from zeroplan.core.sizing.recommend import recommend_micro_batch
    from zeroplan.core.sizing.trace import traced_step_peak
    from zeroplan.facade.cli.model_sources import specs_from_hf_config, trace_hf_config

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_SMALL))
    args = ("--hf-config", str(tmp_path), "--world", "2", "--dtype", "fp32", "--seq-len", "128", "--trace")
    args += ("--micro-batch", "4", "--device-memory", "16MiB", "--recommend")
    out = zeroplan(*args, "--json")
    assert out.returncode == 0, out.stderr
    advice = json.loads(out.stdout)["recommendation"]
    specs = specs_from_hf_config(tmp_path, "fp32")

    def trace_of(micro_batch: int, zp):
        return trace_hf_config(
            tmp_path, "fp32", seq_len=128, micro_batch=micro_batch, recompute=False, plan=zp
        )

    expected = recommend_micro_batch(specs, 2, device_bytes=16 * 2**20, micro_batch=4, trace_of=trace_of)
    assert (advice["micro_batch"], advice["tried_micro_batches"], advice["traced"]) == (2, [4], True)
    assert advice["best"] == json.loads(json.dumps(expected.best.as_dict()))
    assert advice["reason"].startswith(f"micro-batch 2: {expected.best.label}")
    assert "(nothing fits at micro-batch 4)" in advice["reason"]
    chosen = expected.best.fit
    best = plan(specs, Topology(world_size=2, shard_size=chosen.shard_size), stage=chosen.stage)
    exact = traced_step_peak(best, trace_of(2, best))
    assert advice["best"]["exact"] and advice["best"]["need_bytes"] == max(p.peak_bytes for p in exact)
    tight = zeroplan(*args[:-3], "--device-memory", "9MiB", "--recommend", "--json")
    assert tight.returncode == 0  # nothing fits on the device even at micro-batch 1: CPU offload does
    offloaded = json.loads(tight.stdout)["recommendation"]
    assert (offloaded["micro_batch"], offloaded["tried_micro_batches"]) == (1, [4, 2])
    assert (
        offloaded["best"]["offload"] == "optimizer" and "nothing fits without offload" in offloaded["reason"]
    )
    tighter = zeroplan(*args[:-3], "--device-memory", "2MiB", "--recommend", "--json")
    assert tighter.returncode == 1  # nothing fits even at micro-batch 1 with offload
    assert json.loads(tighter.stdout)["recommendation"]["tried_micro_batches"] == [4, 2]


@needs_transformers
def test_a_choice_that_fits_only_traced_without_its_plan_is_dropped(tmp_path):
    """GPT-2 with gradient checkpointing at stage 3: traced without a plan the step is 7% under (the
    recomputed forward gathers its blocks again), so stage 3 seems to fit; traced with its plan it
    does not, and the recommender says nothing fits rather than recommend it."""
    gpt2 = {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_embd": 128,
        "n_head": 4,
        "vocab_size": 512,
        "n_positions": 256,
    }
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    args = ("--hf-config", str(tmp_path), "--world", "2", "--dtype", "fp32", "--seq-len", "128", "--trace")
    args += ("--recompute", "full", "--bucket-mb", "0.0625", "--device-memory", "8900000", "--recommend")
    out = zeroplan(*args, "--json")
    assert out.returncode == 1, out.stderr
    advice = json.loads(out.stdout)["recommendation"]
    assert advice["best"] is None and advice["reason"].startswith("micro-batch 1: nothing fits"), advice
    stage3 = next(o for o in advice["options"] if (o["stage"], o["shard_size"], o["fused"]) == (3, 2, False))
    assert stage3["exact"] and stage3["need_bytes"] > 8_900_000  # confirmed: it does not fit


TRACE_BAD = [
    (["--trace", "--seq-len", "128"], "--trace needs --hf-config PATH and --seq-len N"),
    (["--trace", "--seq-len", "128", "--recompute", "selective"], "--trace needs --hf-config"),
    (["--activations", "trace", "--seq-len", "128"], "--trace needs --hf-config PATH and --seq-len N"),
    (["--activations", "trace"], "--activations trace needs --seq-len N"),
    (["--trace", "--activations", "formula", "--seq-len", "8"], "--trace is --activations trace"),
]


@pytest.mark.parametrize(("args", "needle"), TRACE_BAD, ids=[" ".join(a) for a, _ in TRACE_BAD])
def test_trace_refuses_what_it_cannot_trace(args, needle):
    assert_one_line_error(zeroplan(*args), needle)


@needs_transformers
def test_a_model_that_cannot_be_traced_is_one_line_and_no_fallback(tmp_path, monkeypatch):
    """A trace that fails says which module and operation, and never falls back to the formula
    silently; ``--activations formula`` (the default) is labelled an estimate."""
    from zeroplan.facade.cli import model_sources
    from zeroplan.facade.diagnostics.activation_trace import TraceError

    def untraceable(*args, **kwargs):
        raise TraceError(
            "cannot trace forward under fake tensors: module 'router' runs operation aten.nonzero"
        )

    monkeypatch.setattr(model_sources, "trace_hf_config", untraceable)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_SMALL))
    args = ("--hf-config", str(tmp_path), "--seq-len", "64")
    assert_one_line_error(zeroplan(*args, "--trace"), "module 'router' runs operation aten.nonzero")
    formula = zeroplan(*args, "--activations", "formula")
    assert formula.returncode == 0 and "an estimate by formula" in flat(formula.stdout)


@needs_transformers
def test_trace_refuses_selective_recomputation(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_SMALL))
    out = zeroplan("--hf-config", str(tmp_path), "--seq-len", "64", "--trace", "--recompute", "selective")
    assert_one_line_error(out, "selective recomputation is the formula's assumption")


# ----------------------------------------------------------------- sizes and bad input
def test_sizes():
    assert (
        parse_size("80GiB") == parse_size("80G") == parse_size("80gib") == parse_size("81920MiB") == 80 * GiB
    )
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("40G") == 40 * GiB
    assert parse_size("123") == parse_size("123B") == 123
    assert parse_size(" 1.5 KiB ") == 1536
    for bad in ("", "GiB", "80XB", "-5GiB", "eighty", "1e9", "80 G B"):
        with pytest.raises(ConfigError, match="invalid size"):
            parse_size(bad)


def assert_one_line_error(out: subprocess.CompletedProcess[str], needle: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == "" and "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zeroplan: error: "), out.stderr
    assert needle in lines[0], lines[0]


BAD = [
    (["--device-memory", "80XB"], "argument --device-memory: invalid size '80XB'"),
    (["--device-memory=-5GiB"], "invalid size '-5GiB'"),
    (["--device-memory", "0", "--activation-bytes", "0"], "--device-memory must be at least 1 byte, got 0"),
    (["--seq-len", "128", "--micro-batch", "-1"], "--micro-batch must be >= 1, got -1"),
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--seq-len", "1.5"], "argument --seq-len: invalid int value: '1.5'"),
    (["--recommend"], "--recommend needs --device-memory SIZE"),
    (["--recommend", "--seq-len", "128"], "--recommend needs --device-memory SIZE"),
    (["--device-memory", "80GiB"], "--device-memory needs the activations: pass --seq-len N"),
    (["--micro-batch", "4"], "--micro-batch needs --seq-len N"),
    (["--recompute", "selective"], "--recompute needs --seq-len N"),
    (["--seq-len", "128", "--recompute", "some"], "argument --recompute: invalid choice: 'some'"),
    (["--seq-len", "128", "--activation-bytes", "1G"], "--activation-bytes replaces --seq-len"),
    (["--activation-bytes", "lots"], "argument --activation-bytes: invalid size 'lots'"),
]


@pytest.fixture(scope="module")
def bad_runs():
    return zeroplan_many({" ".join(args): args for args, _ in BAD})


@pytest.mark.parametrize(("args", "needle"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_fit_arguments_are_one_line_errors(bad_runs, args, needle):
    assert_one_line_error(bad_runs[" ".join(args)], needle)


def test_seq_len_needs_model_dimensions(tmp_path):
    shapes = tmp_path / "shapes.json"
    shapes.write_text("[[4, 4]]")
    assert_one_line_error(
        zeroplan("--shapes", str(shapes), "--seq-len", "128"), "which a shapes file does not give"
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "vocab_size": 10}))
    # Read before transformers is imported, so this runs (fast) without it.
    assert_one_line_error(
        zeroplan("--hf-config", str(config), "--seq-len", "128"),
        "the config has no num_attention_heads / n_head / num_heads",
    )


#: GPT-2 at world 2 in bf16 with 100M of activations: the recommender's offload cases, by device size.
GPT2_ADVICE = (
    "--preset",
    "gpt2",
    "--world",
    "2",
    "--dtype",
    "bf16",
    "--activation-bytes",
    "100M",
    "--recommend",
)


def test_the_recommender_considers_offload_only_when_nothing_fits_on_the_device():
    """[Note: offload, planned]: columns of offload after the stages', and a choice with offload."""
    args = GPT2_ADVICE
    roomy = zeroplan(*args, "--device-memory", "2GiB", "--json")
    assert all("offload" not in o for o in json.loads(roomy.stdout)["recommendation"]["options"])
    table = zeroplan(*args, "--device-memory", "400MiB")
    document = json.loads(zeroplan(*args, "--device-memory", "400MiB", "--json").stdout)["recommendation"]
    assert table.returncode == 0, table.stderr
    assert document["best"]["offload"] == "all" and document["best"]["stage"] == 3
    assert {o.get("offload", "none") for o in document["options"]} == {"none", "optimizer", "all"}
    assert not any(o["fits"] for o in document["options"] if "offload" not in o)
    text = " ".join(table.stdout.split())
    assert "stage 3, offload optimizer" in text and "stage 3, offload all" in text
    assert "offload all: fits with" in text and "nothing fits without offload" in text


def test_the_recommender_keeps_on_the_device_what_fits_there():
    """[Note: kept on the device]: where offload optimizer fits with room, the partial offload that
    keeps the most on the device and fits is the choice: fewer bytes over the host link."""
    args = GPT2_ADVICE
    document = json.loads(zeroplan(*args, "--device-memory", "1000MiB", "--json").stdout)["recommendation"]
    best = document["best"]
    assert (best["stage"], best["offload"], best["offload_fraction"]) == (2, "optimizer", 0.5), best
    assert "offload optimizer (offload_fraction=0.5): fits with" in document["reason"]
    full = [
        o
        for o in document["options"]
        if o.get("offload") == "optimizer" and "offload_fraction" not in o and o["stage"] == 2
    ]
    assert full and all(o["host_link_bytes"] > best["host_link_bytes"] for o in full)
    table = zeroplan(*args, "--device-memory", "1000MiB")
    assert table.returncode == 0 and "offload_fraction=0.5" in " ".join(table.stdout.split())
