"""``zeroplan demo`` end to end, through subprocesses, as a user runs it (plus its verdict logic)."""

from __future__ import annotations

import io
import math
import os
import re
import subprocess
import sys

import pytest
from cli_runs import LazyRuns, run_cli

from zeroplan.core import Collective, CommCost
from zeroplan.facade import MeasuredMemory
from zeroplan.facade.cli.demo.outcome import CONTROL_FACTOR, FLOOR, Outcome, RankRecord, agreement, tolerance
from zeroplan.facade.cli.demo.report import print_report, problems
from zeroplan.facade.cli.demo.settings import DemoSettings

_ENV = {**os.environ, "COLUMNS": "120", "PYTHONWARNINGS": "ignore"}


def zeroplan(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``zeroplan demo ARGS`` in a fresh interpreter.

    Not in process: rank 0's worker prints the report, and the demo's forkserver (started once per
    interpreter) would keep writing to whatever the first demo's standard output was."""
    command = [sys.executable, "-m", "zeroplan.facade.cli", "demo", *args]
    return subprocess.run(command, capture_output=True, text=True, env=_ENV, timeout=timeout)


def zeroplan_many(runs: dict[str, tuple[str, ...]]) -> LazyRuns:
    """Several ``zeroplan demo`` commands by key, each run when a test first reads it, one at a time
    (a demo's workers already use every core)."""
    return LazyRuns(runs, zeroplan)


# ----------------------------------------------------------------- real runs
RUNS = {
    "world2": ("--world", "2", "--steps", "20"),
    "mics": ("--world", "4", "--shard-size", "2", "--steps", "10", "--collectives", "min_bytes"),
    "bf16": ("--world", "2", "--steps", "10", "--dtype", "bf16", "--stage", "1"),
    "nodes": (
        *("--world", "4", "--shard-size", "4", "--ranks-per-node", "2"),
        *("--steps", "10", "--collectives", "min_bytes"),
    ),
    "stage3": ("--world", "2", "--steps", "10", "--stage", "3"),
    "stage3_keep": (
        *("--world", "2", "--steps", "10", "--stage", "3"),
        *("--collectives", "min_bytes", "--no-reshard-after-forward"),
    ),
}


@pytest.fixture(scope="module")
def runs():
    """The demo runs, each run when a test first reads it."""
    return zeroplan_many(RUNS)


def _losses(stdout: str) -> tuple[float, float, float, float]:
    match = re.search(r"loss, first → last step\s+([\d.]+) → ([\d.]+)\s+([\d.]+) → ([\d.]+)", stdout)
    assert match, stdout
    zero_first, zero_last, ref_first, ref_last = (float(g) for g in match.groups())
    return zero_first, zero_last, ref_first, ref_last


def _rank_rows(stdout: str) -> dict[int, tuple[list[str], list[str]]]:
    """Per rank: the measured and the planned cells of the memory table."""
    rows = {}
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"\s*(\d+) measured\s+(.*)$", line)
        if match:
            planned = re.match(r"\s*planned\s+(.*)$", lines[i + 1])
            assert planned, lines[i + 1]
            rows[int(match.group(1))] = (match.group(2).split(), planned.group(1).split())
    return rows


def _text(out: subprocess.CompletedProcess[str]) -> str:
    """stdout with every run of whitespace made one space (rich wraps long lines)."""
    return " ".join(out.stdout.split())


def _assert_success(out: subprocess.CompletedProcess[str], world: int) -> None:
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "✓ the runs agree" in _text(out)
    assert "✓ measured memory and traffic equal the plan on every rank, byte for byte" in _text(out)
    assert "✓ every rank holds the same parameters" in _text(out)
    assert "✗" not in out.stdout and "!" not in out.stdout.split("sharded vs unsharded")[1]
    rows = _rank_rows(out.stdout)
    assert sorted(rows) == list(range(world))
    for measured, planned in rows.values():
        assert len(measured) == 7 and measured == planned
    zero_first, zero_last, ref_first, ref_last = _losses(out.stdout)
    assert zero_first == ref_first  # the same model on the same batches
    assert zero_last < zero_first and ref_last < ref_first  # the task is learnable
    assert abs(zero_last - ref_last) <= 1e-3
    assert re.search(r"parameter difference from AdamW\s+\S+\s+\S+ \(control\)", out.stdout), out.stdout


def test_two_ranks_agree_with_adamw_and_with_the_plan(runs):
    out = runs["world2"]
    _assert_success(out, world=2)
    assert "20 steps, fp32, 2 processes on" in _text(out)
    assert "stage 2 on 2 ranks in shard groups of 2" in _text(out)
    assert "collectives gloo" in _text(out)  # "auto" on gloo


def test_mics_shard_groups_reduce_over_the_replica_group(runs):
    out = runs["mics"]
    _assert_success(out, world=4)
    assert "stage 2 on 4 ranks in shard groups of 2" in _text(out) and "collectives min_bytes" in _text(out)
    assert re.search(r"replica\s+all_reduce\s+intra\s+\d+", out.stdout), (
        out.stdout
    )  # MiCS: shard, then replica


def test_two_simulated_nodes_gather_parameters_in_two_hops(runs):
    out = runs["nodes"]
    _assert_success(out, world=4)
    assert "stage 2 on 4 ranks in shard groups of 4 on nodes of 2" in _text(out)
    for link in ("inter", "intra"):  # measured and planned alike (the verdict compares them)
        assert re.search(rf"shard\s+all_gather\s+{link}\s+\d+", out.stdout), out.stdout


def test_bf16_keeps_fp32_masters_and_agrees_within_bf16(runs):
    out = runs["bf16"]
    _assert_success(out, world=2)
    assert "10 steps, bf16, 2 processes on" in _text(out) and "stage 1" in _text(out)
    for measured, _ in _rank_rows(out.stdout).values():
        params, grads, master = (float(cell.replace(",", "")) for cell in measured[:3])
        assert master == pytest.approx(params, rel=0.01)  # fp32 master of half the bf16 parameters
        assert grads == params  # stage 1: the full gradient buffer; the rank reduces into its own region


def _sent(stdout: str, group: str, collective: str) -> tuple[int, float, float]:
    """Calls, KiB measured and KiB planned of one row of the traffic table."""
    match = re.search(rf"{group}\s+{collective}\s+\w+\s+(\d+)\s+([\d,.]+)\s+([\d,.]+)", stdout)
    assert match, stdout
    calls, measured, planned = match.groups()
    return int(calls), float(measured.replace(",", "")), float(planned.replace(",", ""))


def test_stage_3_shards_parameters_and_agrees_with_adamw_and_with_the_plan(runs):
    out, stage2 = runs["stage3"], runs["world2"]
    _assert_success(out, world=2)
    assert "stage 3 (parameters resharded after forward, gathered again in backward) on 2 ranks" in _text(out)
    rows, whole_rows = _rank_rows(out.stdout), _rank_rows(stage2.stdout)
    for (measured, _), (whole, _) in zip(rows.values(), whole_rows.values(), strict=True):
        params, grads = (float(cell.replace(",", "")) for cell in measured[:2])
        assert params == grads  # the rank's shard of each
        assert params == pytest.approx(float(whole[0].replace(",", "")) / 2, rel=0.01)  # stage 2 holds all
    # the transient gathered blocks are the plan's estimate, said so, and outside the verdict
    assert re.search(r"gathered blocks, [\d,.]+ KiB at once in backward by the plan's estimate", _text(out))
    assert "not by this demo: not in the table or the verdict" in _text(out)


def test_stage_3_without_resharding_gathers_once_per_step(runs):
    resharded, kept = runs["stage3"], runs["stage3_keep"]
    _assert_success(kept, world=2)
    assert "stage 3 (parameters kept from forward to backward) on 2 ranks in shard groups of 2" in _text(kept)
    _, once, _ = _sent(kept.stdout, "shard", "all_gather")  # min_bytes: one all-gather per block
    _, twice, _ = _sent(resharded.stdout, "shard", "all_gather")  # gloo: exchanged, same bytes
    assert twice == 2 * once  # the same blocks of the same model, gathered in forward and in backward


# ----------------------------------------------------------------- bad arguments
BAD = [
    (["--world", "0"], "--world must be an integer from 1 to 64, got 0"),
    (["--world", "65"], "got 65"),
    (["--world", "3", "--shard-size", "2"], "--shard-size must divide --world 3, got 2; pick one of 1, 3"),
    (["--world", "4", "--shard-size", "0"], "--shard-size must divide --world 4, got 0"),
    (["--world", "4", "--ranks-per-node", "3"], "--ranks-per-node must divide --world 4, got 3"),
    (["--stage", "4"], "--stage must be 1, 2 or 3, got 4"),
    (["--stage", "0"], "--stage must be 1, 2 or 3, got 0"),
    (["--no-reshard-after-forward"], "--no-reshard-after-forward applies to --stage 3 only, got --stage 2"),
    (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["--bucket-mb", "-1"], "--bucket-mb must be a finite number > 0, got -1.0"),
    (["--bucket-mb", "nan"], "got nan"),
    (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--collectives", "nccl"], "argument --collectives: invalid choice: 'nccl'"),
    (["--world", "two"], "argument --world: invalid int value: 'two'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
]


def _demo_in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """``zeroplan demo ARGS`` in this process: for arguments refused before any worker starts."""
    return run_cli("demo", *args, columns=120)


@pytest.fixture(scope="module")
def bad_runs():
    return LazyRuns({" ".join(args): tuple(args) for args, _ in BAD}, _demo_in_process)


def assert_one_line_error(out: subprocess.CompletedProcess[str], needle: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("zeroplan: error: "), lines[0]
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize(("args", "needle"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_are_one_line_errors_with_exit_code_2(bad_runs, args, needle):
    assert_one_line_error(bad_runs[" ".join(args)], needle)


def test_cuda_without_gpus_is_a_one_line_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = _demo_in_process("--device", "cuda", "--world", "2")
    assert_one_line_error(out, "--device cuda needs one GPU per rank: --world 2, but 0 CUDA device(s)")


# ----------------------------------------------------------------- the verdict
def _outcome(**changes) -> Outcome:
    memory = MeasuredMemory(1024, 512, 0, 2048, 256)
    comm = (CommCost(group="shard", collective=Collective.ALL_GATHER, calls=2, bytes=4096),)
    record = RankRecord(
        rank=0,
        shard_rank=0,
        measured=memory,
        planned=memory,
        comm=comm,
        planned_comm=comm,
        step_ms=1.0,
        optimizer_ms=0.5,
        params_digest="0123",
    )
    fields = {
        "settings": DemoSettings(world=1),
        "fingerprint": "f",
        "losses": ((3.0, 3.0), (1.0, 1.0)),
        "max_rel_diff": 1e-6,
        "worst_param": "w",
        "control_diff": 1e-6,
        "control_losses": (3.0, 1.0),
        "ref_step_ms": 1.0,
        "ref_optimizer_ms": 0.5,
        "records": (record,),
        "seconds": 1.0,
    }
    fields.update(changes)
    return Outcome(**fields)


def test_tolerance_is_a_multiple_of_the_control_with_a_floor_of_one_rounding():
    assert tolerance("fp32", 0.0) == FLOOR["fp32"]
    assert tolerance("bf16", 0.0) == 2.0**-8
    assert tolerance("fp32", 1e-4) == pytest.approx(CONTROL_FACTOR * 1e-4)
    assert math.isnan(tolerance("fp32", math.nan))


def test_verdict_accepts_agreement_and_rejects_each_kind_of_disagreement():
    assert problems(_outcome()) == []
    assert "disagree" in problems(_outcome(max_rel_diff=1e-3))[0]
    assert "disagree" in problems(_outcome(max_rel_diff=math.nan))[0]
    assert "disagree" in problems(_outcome(control_diff=math.nan))[0]
    good = _outcome().records[0]
    leaky = good._replace(measured=good.measured._replace(buffer_bytes=257))
    assert problems(_outcome(records=(leaky,))) == ["rank 0: buffers measured 257 bytes, planned 256"]
    forked = good._replace(rank=1, params_digest="4567")
    assert "the ranks hold different parameters" in problems(_outcome(records=(good, forked)))[0]
    chatty = good._replace(
        comm=(CommCost(group="shard", collective=Collective.ALL_GATHER, calls=3, bytes=4096),)
    )
    assert "traffic of the last step" in problems(_outcome(records=(chatty,)))[0]


def test_docstring_examples():
    import doctest

    from zeroplan.facade.cli.demo import model, outcome, settings, train

    for module in (model, outcome, settings, train):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_decorrelated_runs_are_compared_by_their_losses():
    steps = [(2.0, 2.0)] * 40 + [(0.50, 0.48)] * 10  # the last tenth (at least 5 steps) counts
    control = (2.0,) * 40 + (0.47,) * 10
    chaotic = {"max_rel_diff": 0.3, "control_diff": 0.2, "losses": tuple(steps)}
    verdict = agreement(_outcome(**chaotic, control_losses=control))
    assert verdict.ok and not verdict.by_parameters  # |0.50 - 0.48| <= max(3 x 0.01, 2% of 0.48)
    assert "mean of the last 5 steps" in verdict.reason
    worse = (*steps[:40], *[(0.6, 0.48)] * 10)
    assert not agreement(_outcome(**{**chaotic, "losses": worse}, control_losses=control)).ok


def test_report_exit_code_follows_the_verdict():
    from rich.console import Console

    good, bad = io.StringIO(), io.StringIO()
    assert print_report(_outcome(), Console(file=good, width=100)) == 0
    assert "✓ the runs agree" in good.getvalue() and "no traffic" not in good.getvalue()
    assert print_report(_outcome(max_rel_diff=0.5), Console(file=bad, width=100)) == 1
    assert "✗ the sharded and the unsharded runs disagree" in bad.getvalue()
    assert "plan's estimate" not in good.getvalue()


def test_report_calls_the_stage_3_gathered_blocks_an_estimate():
    from rich.console import Console

    out = io.StringIO()
    stage3 = DemoSettings(world=2, stage=3, reshard_after_forward=False)
    assert print_report(_outcome(settings=stage3, gathered_estimate=3072), Console(file=out, width=400)) == 0
    assert "gathered blocks, 3.0 KiB at once in backward by the plan's estimate" in out.getvalue()
