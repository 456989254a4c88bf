"""At 80 columns no table of ``zeroplan`` cuts a figure or a header (see [Note: narrow terminals]
in ``zeroplan.facade.cli.tables``); where a table fits, it is printed as it always was.

The CLI runs in this process (``main(argv)``); rich reads the width from ``COLUMNS`` when it makes
its console, which ``plan`` does for every table, so ``monkeypatch.setenv`` before ``main`` is enough.
"""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console
from rich.table import Table

from zeroplan.core import Collective, CommCost
from zeroplan.facade import MeasuredMemory
from zeroplan.facade.cli import main
from zeroplan.facade.cli.demo.outcome import Outcome, RankRecord
from zeroplan.facade.cli.demo.report import print_report
from zeroplan.facade.cli.demo.settings import DemoSettings
from zeroplan.facade.cli.tables import split_table

NARROW, WIDE = 80, 160

#: Ellipses the CLI prints on purpose (not a cut): the expert-data-parallel group of rank r.
LITERAL_ELLIPSES = (re.compile(r"\{r % \d+, r % \d+ \+ \d+, …\}"),)

PLANS = {
    name: args.split()
    for name, args in {
        "stage 2": "--preset llama-7b --world 64 --shard-size 8 --stage 2",
        "stage 3": "--preset llama-7b --world 64 --shard-size 8 --stage 3",
        "MiCS": "--preset llama-70b --world 64 --shard-size 16 --ranks-per-node 8 --stage 3",
        "stage 0 largest figures": "--preset llama-70b --world 8 --stage 0",
        "several rank rows": "--preset gpt2-medium --world 7 --stage 1 --layout rank_major",
        "fit": "--preset llama-70b --world 8 --stage 0 --device-memory 80GiB --seq-len 4096",
        "recommend": "--preset llama-13b --world 16 --stage 1 --device-memory 80GB --activation-bytes 10GiB "
        "--recommend",
        "expert parallel": "--preset mixtral-8x7b --world 64 --expert-parallel 8",
        "expert parallel MiCS": "--preset mixtral-8x7b --world 64 --expert-parallel 8 --shard-size 16 "
        "--ranks-per-node 8 --stage 3",
    }.items()
}


def plan_output(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], width: int
) -> str:
    """What ``zeroplan plan ARGS`` prints in a terminal ``width`` columns wide (its timing masked)."""
    monkeypatch.setenv("COLUMNS", str(width))
    main(["plan", *args])
    return re.sub(r"planned in [\d.]+ s", "planned in - s", capsys.readouterr().out)


def words(text: str) -> set[str]:
    """Every word and figure of ``text``, table borders left out (wrapping moves words, never cuts them)."""
    return set(re.split(r"[\s\u2500-\u257f]+", text)) - {""}


def assert_readable(narrow: str, wide: str) -> None:
    """``narrow`` fits 80 columns, cuts nothing, and holds every word and figure of ``wide``."""
    lines = narrow.splitlines()
    assert max(len(line) for line in lines) <= NARROW, max(lines, key=len)
    cut = [line for line in lines if "…" in line and not any(p.search(line) for p in LITERAL_ELLIPSES)]
    assert not cut, cut
    missing = words(wide) - words(narrow)
    assert not missing, missing


@pytest.mark.parametrize("args", PLANS.values(), ids=PLANS.keys())
def test_plan_at_80_columns_cuts_no_figure(monkeypatch, capsys, args):
    narrow = plan_output(monkeypatch, capsys, args, NARROW)
    wide = plan_output(monkeypatch, capsys, args, WIDE)
    assert_readable(narrow, wide)
    monkeypatch.setenv("COLUMNS", str(NARROW))
    main(["plan", *args, "--json"])
    document = json.loads(capsys.readouterr().out)
    first = document["per_rank_total"][0] if "per_rank_total" in document else document["ranks"][0]
    for key in ("params_bytes", "total_bytes", "comm_bytes_per_step"):
        assert f"{first[key] / 2**30:,.3f}" in words(narrow), key


def test_plan_tables_that_fit_are_printed_as_before(monkeypatch, capsys):
    """A table as wide as the terminal or narrower is rich's own, unsplit."""
    table = Table(title="t")
    for header in ("ranks", "a", "b"):
        table.add_column(header, justify="right")
    table.add_row("0-7", "1.000", "2.000")
    console = Console(width=80, file=io.StringIO())
    assert split_table(table, 80, console) == [table]
    parts = split_table(table, 14, console)
    assert [[c.header for c in p.columns] for p in parts] == [["ranks", "a"], ["ranks", "b"]]
    assert [p.title for p in parts] == ["t (1/2)", "t (2/2)"]


def test_help_at_80_columns(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(NARROW))
    for argv in (["--help"], ["plan", "--help"], ["demo", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        lines = capsys.readouterr().out.splitlines()
        assert max(len(line) for line in lines) <= NARROW, argv


def _outcome() -> Outcome:
    """A demo's outcome with figures as wide as a large model's (two ranks, three collectives)."""
    memory = MeasuredMemory(13_474_836_480, 6_737_418_240, 26_949_672_960, 53_899_345_920, 1_073_741_824)
    comm = (
        CommCost(group="shard", collective=Collective.REDUCE_SCATTER, calls=1_515, bytes=12_884_901_888),
        CommCost(group="shard", collective=Collective.ALL_GATHER, calls=3_030, bytes=25_769_803_776),
        CommCost(group="replica", collective=Collective.ALL_REDUCE, calls=1_515, bytes=3_221_225_472),
    )
    records = tuple(
        RankRecord(
            rank=rank,
            shard_rank=rank,
            measured=memory,
            planned=memory,
            comm=comm,
            planned_comm=comm,
            step_ms=12_345.6,
            optimizer_ms=1_234.56,
            params_digest="0123456789abcdef",
        )
        for rank in range(2)
    )
    return Outcome(
        settings=DemoSettings(world=2),
        fingerprint="fedcba9876543210",
        losses=((3.4728, 3.4728), (3.3261, 3.3261)),
        max_rel_diff=1.3e-7,
        worst_param="ln.bias",
        control_diff=2.3e-7,
        control_losses=(3.4728, 3.3261),
        ref_step_ms=23_456.7,
        ref_optimizer_ms=2_345.67,
        records=records,
        seconds=1.0,
    )


def _report(width: int) -> str:
    out = io.StringIO()
    assert print_report(_outcome(), Console(width=width, file=out)) == 0
    return out.getvalue()


def test_demo_report_at_80_columns_cuts_no_figure():
    assert_readable(_report(NARROW), _report(WIDE))
