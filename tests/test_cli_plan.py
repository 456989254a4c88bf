"""``zeroplan plan`` end to end, through a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from cli_runs import ENV, needs_transformers, plan_in_process, zeroplan, zeroplan_many

from zeroplan.core import (
    ParamSpec,
    Topology,
    accumulation_bytes,
    describe_optimizer,
    host_link,
    memory_report,
    plan,
    preset_specs,
    specs_from_shapes,
)
from zeroplan.core.wire import WireCodec

RANK_KEYS = {
    "params_bytes",
    "grads_bytes",
    "master_bytes",
    "optimizer_state_bytes",
    "buffer_bytes",
    "total_bytes",
    "comm_bytes_per_step",
}
TOP_KEYS = {"fingerprint", "world", "shard_size", "stage", "strategy"}


def expected_report(
    specs, *, world, shard=None, stage=2, strategy="auto", optimizer="AdamW", per_node=None, **kwargs
):
    """What the CLI must print, computed in this process."""
    zp = plan(
        specs,
        Topology(world_size=world, shard_size=shard or world, ranks_per_node=per_node),
        stage=stage,
        strategy=strategy,
        optimizer=describe_optimizer(optimizer),
        alignment=kwargs.get("alignment", 128),
        bucket_bytes=int(kwargs.get("bucket_mb", 25.0) * 2**20),
        loss_scaling=kwargs.get("loss_scaling", False),
        layout=kwargs.get("layout", "auto"),
        deterministic=kwargs.get("deterministic", False),
        grad_wire=kwargs.get("grad_wire"),
        param_wire=kwargs.get("param_wire"),
    )
    return zp, memory_report(zp)


def settings_accumulation(args):
    return int(args[args.index("--grad-accumulation") + 1]) if "--grad-accumulation" in args else 1


def check_document(document, report):
    assert TOP_KEYS <= set(document)
    expected = report.as_dict()
    for key in TOP_KEYS | {"total_params"}:
        assert document[key] == expected[key], key
    assert len(document["ranks"]) == report.world
    for got, want in zip(document["ranks"], expected["ranks"], strict=True):
        assert RANK_KEYS <= set(got)
        assert got == want


# ----------------------------------------------------------------- tables
PRESETS = {
    "gpt2": "124,439,808",
    "gpt2-xl": "1,557,611,200",
    "llama-7b": "6,738,415,616",
    "llama-70b": "68,976,648,192",
    "mixtral-8x7b": "46,702,792,704",
}


@pytest.mark.parametrize(("preset", "count"), PRESETS.items())
def test_table_for_each_preset(preset, count):
    out = zeroplan(
        "--preset", preset, "--world", "64", "--shard-size", "8", "--stage", "2", "--dtype", "bf16"
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    zp, report = expected_report(preset_specs(preset, "bf16"), world=64, shard=8)
    assert f"{preset}: {count} parameters" in out.stdout
    assert zp.fingerprint() in out.stdout
    assert "memory per rank" in out.stdout and "traffic of rank 0 per step" in out.stdout
    assert re.search(r"│\s+63\s+│|-63\s+│", out.stdout)  # the last rank has a row
    total_gib = f"{report.ranks[0].total_bytes / 2**30:,.3f}"
    assert total_gib in out.stdout


def test_table_rows_are_capped():
    # lpt_whole gives uneven shards, so every rank is its own row.
    out = zeroplan("--preset", "gpt2", "--world", "32", "--strategy", "lpt_whole", "--rows", "4")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if re.match(r"│\s+(\d+(-\d+)?|…)\s+│", line)]
    assert len(rows) == 4 + 1  # 3 first groups, the ellipsis, the last rank
    assert "…" in rows[3] and re.match(r"│\s+31\s+│", rows[4])


# ----------------------------------------------------------------- JSON
@pytest.mark.parametrize(
    ("args", "settings"),
    [
        (
            ["--preset", "gpt2", "--world", "16", "--shard-size", "4", "--stage", "1", "--dtype", "fp16"],
            {"world": 16, "shard": 4, "stage": 1, "dtype": "fp16", "preset": "gpt2"},
        ),
        (
            [
                *("--preset", "llama-70b", "--world", "32", "--stage", "3", "--strategy", "lpt_whole"),
                *("--optimizer", "sgd", "--bucket-mb", "7.5", "--alignment", "64", "--loss-scaling"),
            ],
            {
                "world": 32,
                "stage": 3,
                "strategy": "lpt_whole",
                "optimizer": "sgd",
                "bucket_mb": 7.5,
                "alignment": 64,
                "loss_scaling": True,
                "preset": "llama-70b",
            },
        ),
        (
            ["--preset", "mixtral-8x7b", "--world", "8", "--stage", "0", "--dtype", "fp32"],
            {"world": 8, "stage": 0, "dtype": "fp32", "preset": "mixtral-8x7b"},
        ),
        (  # gradients sent as int8 with a scale per 64 elements, added in fp32 ([Note: wire formats])
            [
                "--preset",
                "gpt2",
                "--world",
                "8",
                "--shard-size",
                "4",
                "--reduce-dtype",
                "int8",
                "--wire-block",
                "64",
            ],
            {"world": 8, "shard": 4, "grad_wire": WireCodec("int8", block=64), "preset": "gpt2"},
        ),
        (  # stage 3 parameters gathered as fp8 and gradients as bf16, per link, over two nodes
            [
                "--preset",
                "gpt2",
                "--world",
                "8",
                "--ranks-per-node",
                "4",
                "--stage",
                "3",
                "--reduce-dtype",
                "bf16",
                "--gather-dtype",
                "fp8",
            ],
            {
                "world": 8,
                "stage": 3,
                "per_node": 4,
                "grad_wire": WireCodec("bf16"),
                "param_wire": WireCodec("fp8"),
                "preset": "gpt2",
            },
        ),
        (  # deterministic mode: all-to-all exchanges, replica gathers, room for every piece
            [
                "--preset",
                "gpt2",
                "--world",
                "8",
                "--shard-size",
                "4",
                "--deterministic",
                "--grad-accumulation",
                "4",
            ],
            {"world": 8, "shard": 4, "deterministic": True, "preset": "gpt2"},
        ),
    ],
)
def test_json_document_matches_the_in_process_report(args, settings):
    out = zeroplan(*args, "--json")
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    settings = dict(settings)
    specs = preset_specs(settings.pop("preset"), settings.pop("dtype", "bf16"))
    zp, report = expected_report(specs, **settings)
    check_document(document, report)
    assert document["buckets"] == len(zp.buckets.buckets)
    assert document["strategy"] == zp.partition.strategy
    assert document["deterministic"] == zp.deterministic
    if zp.grad_wire or zp.param_wire:  # rank 0's bytes per link, next to the same plan without wires
        _, default = expected_report(specs, **{**settings, "grad_wire": None, "param_wire": None})
        rows = document["wire_per_link"]
        assert sum(r["bytes"] for r in rows) == report.ranks[0].comm_bytes_per_step
        assert sum(r["default_bytes"] for r in rows) == default.ranks[0].comm_bytes_per_step
        wires = {"gradients": zp.grad_wire, "parameters": zp.param_wire}
        assert document["wires"] == {k: c.summary(specs[0].dtype) for k, c in wires.items() if c}
    assert document["accumulation_bytes"] == accumulation_bytes(zp, settings_accumulation(args))


def test_json_defaults():
    out = zeroplan("--json")
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    _, report = expected_report(preset_specs("gpt2", "bf16"), world=8)
    check_document(document, report)
    assert (document["world"], document["shard_size"], document["stage"]) == (8, 8, 2)
    assert document["strategy"] == "flat_even" and document["model"] == "gpt2"
    assert (document["layout"], document["layout_requested"]) == ("interleaved", "auto")


# ----------------------------------------------------------------- layouts
LAYOUT_RUNS = {
    "rank_major": ("--preset", "gpt2", "--world", "8", "--layout", "rank_major", "--json"),
    "interleaved": (
        *("--preset", "gpt2", "--world", "8", "--shard-size", "4", "--strategy", "lpt_whole"),
        *("--layout", "interleaved", "--bucket-mb", "4", "--json"),
    ),
    # 723 tensors in 25 MiB buckets over 4,096 ranks: beyond AUTO_MAX_PIECES, auto stays rank-major.
    "auto-70b": ("--preset", "llama-70b", "--world", "4096", "--json"),
    "table": ("--preset", "gpt2", "--world", "8"),
    "table-rank-major": ("--preset", "gpt2", "--world", "8", "--layout", "rank_major"),
}


@pytest.fixture(scope="module")
def layout_runs():
    return zeroplan_many(LAYOUT_RUNS)


@pytest.mark.parametrize(
    ("key", "settings", "layout"),
    [
        ("rank_major", {"world": 8, "layout": "rank_major"}, "rank_major"),
        (
            "interleaved",
            {"world": 8, "shard": 4, "strategy": "lpt_whole", "layout": "interleaved", "bucket_mb": 4.0},
            "interleaved",
        ),
        ("auto-70b", {"world": 4096, "preset": "llama-70b"}, "rank_major"),
    ],
)
def test_layout_option_is_planned_and_reported(layout_runs, key, settings, layout):
    out = layout_runs[key]
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    settings = dict(settings)
    zp, report = expected_report(preset_specs(settings.pop("preset", "gpt2"), "bf16"), **settings)
    check_document(document, report)
    assert document["layout"] == zp.partition.layout == layout
    assert document["layout_requested"] == settings.get("layout", "auto")
    assert document["buckets"] == len(zp.buckets.buckets)


def test_layout_in_the_table_header(layout_runs):
    auto, rank_major = layout_runs["table"], layout_runs["table-rank-major"]
    assert auto.returncode == rank_major.returncode == 0, (auto.stderr, rank_major.stderr)
    header = " ".join(auto.stdout.split())  # rich wraps the header at the terminal width
    assert "strategy flat_even, layout interleaved (auto), 10 buckets" in header
    assert "layout rank_major, 10 buckets" in " ".join(rank_major.stdout.split())
    # Interleaved, every bucket is a reduce_scatter and every block an all_gather.
    assert re.search(r"shard\s+│\s+reduce_scatter\s+│\s+intra\s+│\s+10\s+│", auto.stdout), auto.stdout
    assert re.search(r"shard\s+│\s+all_gather\s+│\s+intra\s+│\s+10\s+│", auto.stdout), auto.stdout


def test_where_each_buffer_lives_in_the_table_and_json(layout_runs):
    """[Note: residences]: every role on the device by default; the host total is 0."""
    table, document = layout_runs["table-rank-major"], json.loads(layout_runs["rank_major"].stdout)
    where = {"full_params", "full_grads", "grad_shard", "master", "staging", "optimizer_state"}
    assert document["residences"] == dict.fromkeys(sorted(where - {"full_grads"}), "device")
    for rank in document["ranks"]:
        assert (rank["host_bytes"], rank["device_bytes"]) == (0, rank["total_bytes"])
    assert "where buffers live" in table.stdout
    for role in where - {"full_grads"}:
        assert re.search(rf"{role.replace('_', ' ')}\s+│\s+device", table.stdout), role
    device = f"{document['ranks'][0]['device_bytes'] / 2**30:,.3f}"
    assert re.search(rf"rank 0 device GiB\s+│\s+{device}", table.stdout)
    assert re.search(r"rank 0 host GiB\s+│\s+0\.000", table.stdout)


# ----------------------------------------------------------------- nodes
NODE_RUNS = {
    "json": ("--preset", "gpt2", "--world", "16", "--shard-size", "8", "--ranks-per-node", "4", "--json"),
    "table": ("--preset", "gpt2", "--world", "16", "--shard-size", "8", "--ranks-per-node", "4"),
    "one-hop": ("--preset", "gpt2", "--world", "16", "--shard-size", "4", "--ranks-per-node", "4", "--json"),
}


@pytest.fixture(scope="module")
def node_runs():
    return zeroplan_many(NODE_RUNS)


def test_ranks_per_node_reports_bytes_per_hop_and_link(node_runs):
    out = node_runs["json"]
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    zp, report = expected_report(preset_specs("gpt2", "bf16"), world=16, shard=8, per_node=4)
    check_document(document, report)
    blocks = sum(len(space.blocks) for space in zp.partition.spaces)
    for record in document["ranks"]:
        gathers = {c["link"]: c for c in record["comm"] if c["collective"] == "all_gather"}
        assert set(gathers) == {"inter", "intra"}
        # 2 nodes of 4 per shard group: one gather across nodes and two inside per block
        assert (gathers["inter"]["calls"], gathers["intra"]["calls"]) == (blocks, 2 * blocks)
        assert gathers["intra"]["bytes"] == 2 * 3 * gathers["inter"]["bytes"]  # a*(m-1)p vs (a-1)p
        assert {c["link"] for c in record["comm"] if c["group"] == "replica"} == {"inter"}
    flat = memory_report(expected_report(preset_specs("gpt2", "bf16"), world=16, shard=8)[0])
    assert [r.comm_bytes_per_step for r in flat.ranks] == [
        r["comm_bytes_per_step"] for r in document["ranks"]
    ]


def test_ranks_per_node_in_the_table_and_one_hop_on_one_node(node_runs):
    table = node_runs["table"]
    assert table.returncode == 0, table.stderr
    for link, calls in (("inter", 10), ("intra", 20)):
        pattern = rf"shard\s+│\s+all_gather\s+│\s+{link}\s+│\s+{calls}\s+│"
        assert re.search(pattern, table.stdout), table.stdout
    one_hop = json.loads(node_runs["one-hop"].stdout)  # shard groups of 4 on nodes of 4
    for record in one_hop["ranks"]:
        links = {(c["group"], c["collective"], c["link"]) for c in record["comm"]}
        assert ("shard", "all_gather", "intra") in links and ("shard", "all_gather", "inter") not in links
        assert {link for group, _, link in links if group == "replica"} == {"inter"}


# ----------------------------------------------------------------- shapes files
def test_shapes_file_as_a_list_of_shapes(tmp_path):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps([[17, 257], [3], [], [257, 17], [0]]))
    out = zeroplan("--shapes", str(path), "--world", "6", "--shard-size", "3", "--json")
    assert out.returncode == 0, out.stderr
    specs = specs_from_shapes([(17, 257), (3,), (), (257, 17), (0,)], dtype="bf16")
    _, report = expected_report(specs, world=6, shard=3)
    check_document(json.loads(out.stdout), report)


@pytest.mark.parametrize("wrapped", [False, True])
def test_shapes_file_as_a_list_of_objects(tmp_path, wrapped):
    entries = [
        {"name": "emb", "shape": [17, 257]},
        {"name": "frozen", "shape": [5, 5], "trainable": False},
        {"name": "gain", "shape": [31], "dtype": "fp32"},
    ]
    path = tmp_path / "params.json"
    path.write_text(json.dumps({"params": entries} if wrapped else entries))
    out = zeroplan("--shapes", str(path), "--world", "4", "--stage", "1", "--json")
    assert out.returncode == 0, out.stderr
    specs = (
        ParamSpec(index=0, name="emb", shape=(17, 257), dtype="bf16"),
        ParamSpec(index=1, name="frozen", shape=(5, 5), dtype="bf16", trainable=False),
        ParamSpec(index=2, name="gain", shape=(31,), dtype="fp32"),
    )
    _, report = expected_report(specs, world=4, stage=1)
    check_document(json.loads(out.stdout), report)

    table = zeroplan("--shapes", str(path), "--world", "4")
    assert table.returncode == 0 and "4,425 parameters in 3 tensors" in table.stdout


# ----------------------------------------------------------------- Hugging Face configs
GPT2_CONFIG = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    "vocab_size": 1000,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def _gpt2_specs(layers: int, width: int, vocab: int, positions: int = 1024) -> tuple[ParamSpec, ...]:
    """``GPT2LMHeadModel.named_parameters()`` written out (``lm_head`` is tied to ``wte``)."""
    d = width
    named = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (positions, d))]
    for i in range(layers):
        h = f"transformer.h.{i}"
        named += [
            (f"{h}.ln_1.weight", (d,)),
            (f"{h}.ln_1.bias", (d,)),
            (f"{h}.attn.c_attn.weight", (d, 3 * d)),
            (f"{h}.attn.c_attn.bias", (3 * d,)),
            (f"{h}.attn.c_proj.weight", (d, d)),
            (f"{h}.attn.c_proj.bias", (d,)),
            (f"{h}.ln_2.weight", (d,)),
            (f"{h}.ln_2.bias", (d,)),
            (f"{h}.mlp.c_fc.weight", (d, 4 * d)),
            (f"{h}.mlp.c_fc.bias", (4 * d,)),
            (f"{h}.mlp.c_proj.weight", (4 * d, d)),
            (f"{h}.mlp.c_proj.bias", (d,)),
        ]
    named += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    return specs_from_shapes([shape for _, shape in named], names=[name for name, _ in named], dtype="bf16")


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """The runs that import torch and transformers (seconds each), started together."""
    configs = {
        "gpt2": GPT2_CONFIG,
        "indivisible": {**GPT2_CONFIG, "n_embd": 65},
    }
    runs = {}
    for key, config in configs.items():
        folder = tmp_path_factory.mktemp(key)
        (folder / "config.json").write_text(json.dumps(config))
        runs[key] = ("--hf-config", str(folder), "--world", "4", "--json")  # a directory works
    return zeroplan_many(runs)


@needs_transformers
def test_hf_config_builds_the_model_on_the_meta_device(hf_runs):
    out = hf_runs["gpt2"]
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    # wte 1000x64 + wpe 1024x64 + 2 blocks of 49,984 + ln_f 128; lm_head is tied to wte.
    assert document["total_params"] == 64_000 + 65_536 + 2 * 49_984 + 128 == 229_632
    _, report = expected_report(_gpt2_specs(layers=2, width=64, vocab=1000), world=4)
    check_document(document, report)  # names, shapes and order included (via the fingerprint)


@needs_transformers
def test_a_config_transformers_rejects_is_a_one_line_error(hf_runs):
    assert_one_line_error(hf_runs["indivisible"], "cannot build a causal LM from")
    assert "divisible" in hf_runs["indivisible"].stderr


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("[1, 2]", "must be a JSON object with a string 'model_type'"),
        ('{"n_layer": 2}', "must be a JSON object with a string 'model_type'"),
        ("{not json", "cannot read config file"),
        (None, "does not exist"),
    ],
)
def test_unreadable_hf_configs_are_one_line_errors(tmp_path, content, needle):
    # Checked before transformers is imported, so these run (fast) without it.
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    assert_one_line_error(zeroplan("--hf-config", str(path)), needle)


def test_hf_config_with_a_bad_dtype_fails_before_importing_transformers(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2_CONFIG))
    assert_one_line_error(
        zeroplan("--hf-config", str(path), "--dtype", "int4"), "dtype 'int4' is not supported"
    )


# ----------------------------------------------------------------- bad arguments
def assert_one_line_error(out: subprocess.CompletedProcess[str], needle: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    # transformers may log warnings of its own; ours is exactly one line, the last.
    lines = [line for line in out.stderr.splitlines() if not line.startswith("[transformers]")]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("zeroplan: error: "), lines[0]
    assert needle in lines[0], lines[0]


BAD = [
    (["--world", "8", "--shard-size", "3"], "shard size 3 does not divide world size 8"),
    (["--world", "4", "--shard-size", "8"], "shard size 8 does not divide world size 4"),
    (["--preset", "llama-8b"], "unknown preset 'llama-8b'"),
    (["--stage", "4"], "stage must be 0, 1, 2 or 3, got 4"),
    (["--stage", "-1"], "got -1"),
    (["--world", "-1"], "world size must be an int >= 1, got -1"),
    (["--world", "0"], "world size must be an int >= 1, got 0"),
    (["--shard-size", "-2"], "shard size must be an int >= 1, got -2"),
    (["--shard-size", "0"], "shard size must be an int >= 1, got 0"),
    (["--bucket-mb", "-1"], "--bucket-mb must be a finite number > 0, got -1.0"),
    (["--bucket-mb", "0"], "--bucket-mb must be a finite number > 0, got 0.0"),
    (["--bucket-mb", "nan"], "got nan"),
    (["--bucket-mb", "inf"], "got inf"),
    (["--alignment", "-1"], "alignment must be an int >= 1 (elements), got -1"),
    (["--alignment", "0"], "got 0"),
    (["--strategy", "zigzag"], "unknown partition strategy 'zigzag'"),
    (["--optimizer", "Lion"], "unknown optimizer 'Lion'"),
    (["--optimizer", "Adafactor", "--strategy", "flat_even"], "Adafactor is not elementwise"),
    (["--dtype", "int8"], "dtype 'int8' is not supported"),
    (["--ranks-per-node", "3"], "ranks per node 3 does not divide world size 8"),
    (["--rows", "0"], "--rows must be >= 1, got 0"),
    (["--world", "eight"], "argument --world: invalid int value: 'eight'"),
    (["--world", "2.5"], "invalid int value: '2.5'"),
    (["--stage", "two"], "argument --stage: invalid int value: 'two'"),
    (["--preset", "gpt2", "--shapes", "x.json"], "not allowed with argument"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--layout", "columns"], "argument --layout: invalid choice: 'columns'"),
]


@pytest.fixture(scope="module")
def bad_runs():
    return zeroplan_many({" ".join(args): tuple(args) for args, _ in BAD})


@pytest.mark.parametrize(("args", "needle"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_are_one_line_errors_with_exit_code_2(bad_runs, args, needle):
    assert_one_line_error(bad_runs[" ".join(args)], needle)


SHAPES_FILES = [
    ("malformed.json", "[[17, 257], [3]", "cannot read shapes file"),
    ("negative.json", "[[17, 257], [3, -1]]", "entry 1: shape [3, -1] has a negative size"),
    ("negative-object.json", '[{"name": "w", "shape": [-4]}]', "entry 0: shape [-4] has a negative size"),
    ("floats.json", "[[17.5, 2]]", "entry 0: shape must be a list of integers, got [17.5, 2]"),
    ("empty.json", "[]", "must hold a non-empty list"),
    ("object.json", '{"layers": 3}', "must hold a non-empty list"),
    ("trainable.json", '[{"shape": [3], "trainable": "no"}]', "'trainable' must be true or false, got 'no'"),
    ("dtype.json", '[{"shape": [3], "dtype": "int8"}]', "dtype 'int8' is not supported"),
]


@pytest.mark.parametrize(("name", "content", "needle"), SHAPES_FILES, ids=[n for n, _, _ in SHAPES_FILES])
def test_bad_shapes_files_are_one_line_errors(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_text(content)
    assert_one_line_error(zeroplan("--shapes", str(path)), needle)


def test_missing_and_unreadable_shapes_files(tmp_path):
    missing = tmp_path / "missing.json"
    assert_one_line_error(zeroplan("--shapes", str(missing)), f"shapes file {str(missing)!r} does not exist")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00[")
    assert_one_line_error(zeroplan("--shapes", str(binary)), "cannot read shapes file")
    assert_one_line_error(zeroplan("--shapes", str(tmp_path)), "cannot read shapes file")


def test_missing_subcommand_is_a_one_line_error():
    out = subprocess.run(
        [sys.executable, "-m", "zeroplan.facade.cli"], capture_output=True, text=True, timeout=60
    )
    assert_one_line_error(out, "required")


def test_console_script_matches_the_module_entry_point():
    script = os.path.join(os.path.dirname(sys.executable), "zeroplan")
    if not os.path.exists(script):
        pytest.skip("the zeroplan console script is not installed next to this interpreter")
    args = ("plan", "--preset", "gpt2", "--world", "4", "--json")
    out = subprocess.run([script, *args], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    _, report = expected_report(preset_specs("gpt2", "bf16"), world=4)
    check_document(json.loads(out.stdout), report)
    bad = subprocess.run(
        [script, "plan", "--stage", "4"], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert_one_line_error(bad, "stage must be 0, 1, 2 or 3, got 4")


@pytest.mark.parametrize(
    "args",
    [
        ["--preset", "gpt2"],
        ["--preset", "gpt2", "--device-memory", "8GiB", "--seq-len", "256", "--recommend"],
    ],
    ids=["plan", "recommend"],
)
def test_plan_never_imports_torch(args):
    """``zeroplan plan`` (table and JSON, with the recommender too) starts in a fraction of a second:
    no torch, no optimizer."""
    out = plan_in_process(args)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 0] []"


# ----------------------------------------------------------------- offload, planned
def test_offload_optimizer_shows_device_and_host_bytes_and_the_host_link():
    """[Note: offload, planned]: the table and the JSON give what ``memory_report`` plans."""
    args = ("--preset", "gpt2", "--world", "4", "--stage", "2", "--dtype", "bf16", "--offload", "optimizer")
    table, document = zeroplan(*args), json.loads(zeroplan(*args, "--json").stdout)
    assert table.returncode == 0, table.stderr
    specs = preset_specs("gpt2", dtype="bf16")
    expected = memory_report(plan(specs, Topology(world_size=4), stage=2, offload="optimizer")).ranks[0]
    rank = document["ranks"][0]
    assert document["offload"] == "optimizer"
    assert {
        k: document["residences"][k] for k in ("grad_shard", "master", "optimizer_state")
    } == dict.fromkeys(("grad_shard", "master", "optimizer_state"), "host")
    assert (rank["device_bytes"], rank["host_bytes"]) == (expected.device_bytes, expected.host_bytes)
    assert rank["device_peak_bytes"] == expected.device_peak_bytes and rank["step_on_host"]
    assert rank["host_link"] == expected.host_link._asdict()
    text = " ".join(table.stdout.split())
    assert "offload optimizer" in text
    for label, value in (
        ("rank 0 host GiB", expected.host_bytes),
        ("step's device peak GiB", expected.device_peak_bytes),
        (f"to host per step GiB ({expected.host_link.to_host_copies:,} copies)", expected.host_link.to_host),
        (
            f"to device per step GiB ({expected.host_link.to_device_copies:,} copies)",
            expected.host_link.to_device,
        ),
    ):
        assert re.search(rf"{re.escape(label)}\s+│\s+{value / 2**30:,.3f}", table.stdout), label


def test_offload_without_it_leaves_the_document_as_it_was():
    args = ("--preset", "gpt2", "--world", "4", "--json")
    plain, none = json.loads(zeroplan(*args).stdout), json.loads(zeroplan(*args, "--offload", "none").stdout)
    assert "offload" not in plain and "host_link" not in plain["ranks"][0]
    plain.pop("planning_seconds"), none.pop("planning_seconds")
    assert plain == none


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--stage", "2", "--offload", "all"), "offload='all' needs stage 3"),
        (("--stage", "0", "--offload", "optimizer"), "needs stage 1, 2 or 3"),
    ],
)
def test_offload_that_cannot_work_is_refused(extra, message):
    out = zeroplan("--preset", "gpt2", "--world", "4", *extra)
    assert out.returncode != 0 and message in out.stderr


def test_offload_fraction_keeps_the_planned_part_on_the_device():
    """[Note: kept on the device]: the table and the JSON give the split ``memory_report`` plans."""
    args = ("--preset", "gpt2", "--world", "4", "--stage", "2", "--dtype", "bf16", "--offload", "optimizer")
    partial = (*args, "--offload-fraction", "0.5")
    table, document = zeroplan(*partial), json.loads(zeroplan(*partial, "--json").stdout)
    assert table.returncode == 0, table.stderr
    whole = json.loads(zeroplan(*args, "--json").stdout)["ranks"][0]
    zp = plan(
        preset_specs("gpt2", dtype="bf16"),
        Topology(world_size=4),
        stage=2,
        offload="optimizer",
        offload_fraction=0.5,
    )
    expected = memory_report(zp).ranks[0]
    rank = document["ranks"][0]
    assert document["offload_fraction"] == 0.5
    assert document["kept_on_device"] == [[zp.kept_numel(0, s) for s in range(4)]]
    assert {document["residences"][f"kept_{k}"] for k in ("grad_shard", "master", "optimizer_state")} == {
        "device"
    }
    assert (rank["device_bytes"], rank["host_bytes"]) == (expected.device_bytes, expected.host_bytes)
    assert rank["kept_step_transient_bytes"] == expected.kept_step_transient_bytes > 0
    assert rank["total_bytes"] == whole["total_bytes"] and rank["host_bytes"] < whole["host_bytes"]
    assert rank["host_link"]["to_host"] < whole["host_link"]["to_host"]
    text = " ".join(table.stdout.split())
    assert "offload optimizer (0.5 of the state)" in text and "kept master │ device" in text
    refused = zeroplan("--preset", "gpt2", "--world", "4", "--offload-fraction", "0.5")
    assert refused.returncode != 0 and "needs offload='optimizer'" in refused.stderr


def test_offload_all_at_stage_3_moves_the_parameter_shards_too():
    document = json.loads(
        zeroplan("--preset", "gpt2", "--world", "4", "--stage", "3", "--offload", "all", "--json").stdout
    )
    assert document["residences"]["param_shard"] == "host" and document["residences"]["block"] == "device"
    zp = plan(preset_specs("gpt2", dtype="bf16"), Topology(world_size=4), stage=3, offload="all")
    assert document["ranks"][0]["host_link"] == host_link(zp, 0)._asdict()  # the shard, twice a step
