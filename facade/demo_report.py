"""The end of ``zeroplan demo``: the comparison tables and the verdict (exit code)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from zeroplan.core import CommCost
from zeroplan.facade.demo import Outcome, RankRecord
from zeroplan.facade.optimizer import MeasuredMemory

__all__ = ["comm_rows", "print_report", "problems"]

_CATEGORIES = ("params", "grads", "master", "optim state", "buffers")


def comm_rows(costs: tuple[CommCost, ...]) -> list[tuple[str, str, int, int]]:
    """Traffic as sorted ``(group, collective, calls, bytes)`` rows (comparable across sources)."""
    return sorted((c.group, c.collective.value, c.calls, c.bytes) for c in costs)


def _sent(costs: tuple[CommCost, ...]) -> int:
    return sum(c.bytes for c in costs)


def problems(outcome: Outcome) -> list[str]:
    """Why the demo failed: the runs disagree, or a rank's bytes differ from the plan; empty if fine."""
    found = []
    s = outcome.settings
    if not outcome.max_rel_diff <= s.tolerance:  # also catches NaN
        found.append(
            f"the sharded and the unsharded runs disagree: largest relative parameter difference "
            f"{outcome.max_rel_diff:.3g} (in {outcome.worst_param}) > tolerance {s.tolerance:g} for {s.dtype}"
        )
    for r in outcome.records:
        for name, got, want in zip(_CATEGORIES, r.measured, r.planned, strict=True):
            if got != want:
                found.append(f"rank {r.rank}: {name} measured {got:,} bytes, planned {want:,}")
        if comm_rows(r.comm) != comm_rows(r.planned_comm):
            found.append(
                f"rank {r.rank}: traffic of the last step {comm_rows(r.comm)} differs from the plan's "
                f"{comm_rows(r.planned_comm)}"
            )
    return found


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:,.1f}"


def _summary(outcome: Outcome) -> Table:
    s = outcome.settings
    (zero_first, ref_first), (zero_last, ref_last) = outcome.losses[0], outcome.losses[-1]
    table = Table(title="sharded vs unsharded, step by step on the same batches")
    table.add_column("")
    table.add_column(f"ZeroOptimizer(AdamW)\nstage {s.stage}, {s.world} processes", justify="right")
    table.add_column("torch.optim.AdamW\n1 process", justify="right")
    table.add_row(
        "loss, first → final step", f"{zero_first:.4f} → {zero_last:.4f}", f"{ref_first:.4f} → {ref_last:.4f}"
    )
    step = max(r.step_ms for r in outcome.records)
    optimizer = max(r.optimizer_ms for r in outcome.records)
    table.add_row(
        "train step, median ms",
        f"{step:,.1f} (1 batch per rank)",
        f"{outcome.ref_step_ms:,.1f} ({s.world} batches)",
    )
    table.add_row("optimizer.step(), median ms", f"{optimizer:,.2f}", f"{outcome.ref_optimizer_ms:,.2f}")
    ok = outcome.max_rel_diff <= s.tolerance
    table.add_row(
        "largest parameter difference",
        f"[{'green' if ok else 'red'}]{outcome.max_rel_diff:.2e}[/] (relative, in {outcome.worst_param})",
        f"tolerance {s.tolerance:g} ({s.dtype})",
    )
    return table


def _cells(values: MeasuredMemory, planned: MeasuredMemory, sent: int, sent_ok: bool) -> list[str]:
    """Row cells in KiB; a value that differs from the plan is shown in red."""

    def cell(value: int, ok: bool) -> str:
        return _kib(value) if ok else f"[red]{_kib(value)}[/]"

    cells = [cell(v, v == w) for v, w in zip(values, planned, strict=True)]
    return [*cells, cell(sum(values), sum(values) == sum(planned)), cell(sent, sent_ok)]


def _ranks(records: tuple[RankRecord, ...]) -> Table:
    table = Table(title="memory per rank and traffic per step (KiB): measured / planned")
    table.add_column("rank", justify="right")
    table.add_column("")
    for column in (*_CATEGORIES, "total", "sent/step"):
        table.add_column(column, justify="right")
    for r in records:
        comm_ok = comm_rows(r.comm) == comm_rows(r.planned_comm)
        table.add_row(str(r.rank), "measured", *_cells(r.measured, r.planned, _sent(r.comm), comm_ok))
        planned = _cells(r.planned, r.planned, _sent(r.planned_comm), True)
        table.add_row("", "planned", *planned, end_section=True)
    return table


def print_report(outcome: Outcome, console: Console | None = None) -> int:
    """Print the tables and the verdict; returns the exit code (0 when everything agrees)."""
    console = console or Console()
    s = outcome.settings
    console.print(_summary(outcome))
    console.print(_ranks(outcome.records))
    found = problems(outcome)
    for line in found:
        console.print(f"[red]✗[/] {line}")
    if not found:
        console.print(
            f"[green]✓[/] the runs agree (largest relative parameter difference {outcome.max_rel_diff:.2e} "
            f"≤ {s.tolerance:g} for {s.dtype})"
        )
        console.print("[green]✓[/] measured memory and traffic equal the plan on every rank, byte for byte")
    console.print(f"done in {outcome.seconds:.1f} s; plan fingerprint {outcome.fingerprint}")
    return 0 if not found else 1
