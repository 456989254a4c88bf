"""``zeroplan plan``: print the memory per rank and traffic of a plan, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from zeroplan.core import (
    AUTO_MAX_PIECES,
    LAYOUTS,
    ConfigError,
    FitReport,
    MemoryReport,
    ParamSpec,
    RankReport,
    Recommendation,
    Topology,
    describe_optimizer,
    known_optimizers,
    memory_report,
    plan,
    preset_names,
    strategy_names,
)
from zeroplan.facade.cli import fit as fitting
from zeroplan.facade.cli.model_sources import specs_from_hf_config, specs_from_json, specs_from_preset

__all__ = ["register", "run"]


def register(sub: Any) -> None:
    """Add the ``plan`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser(
        "plan",
        help="plan a sharded optimizer and report memory per rank",
        description="Plan a sharded optimizer: memory per rank and bytes sent per step.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", help=f"model preset: {', '.join(preset_names())} (default gpt2)")
    source.add_argument("--shapes", metavar="FILE", help="JSON list of parameter shapes")
    source.add_argument("--hf-config", metavar="PATH", help="Hugging Face config.json (needs transformers)")
    p.add_argument("--world", type=int, default=8, help="data-parallel ranks (default 8)")
    p.add_argument("--shard-size", type=int, default=None, help="ranks per shard group (default: world)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: world)")
    p.add_argument("--stage", type=int, default=2, help="0 (DDP), 1, 2 or 3 (default 2)")
    p.add_argument("--dtype", default="bf16", help="parameter dtype: fp32, bf16, fp16 (default bf16)")
    p.add_argument("--optimizer", default="AdamW", help=f"one of {', '.join(known_optimizers())}")
    p.add_argument("--strategy", default="auto", help=f"auto or one of {', '.join(strategy_names())}")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="auto",
        help="parameter layout: interleaved (every bucket cut across the shard group: one "
        "reduce_scatter and one all_gather each with flat_even), rank_major (one region per rank), "
        f"or auto: interleaved up to {AUTO_MAX_PIECES:,} pieces, buckets x ranks (default auto)",
    )
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket cap in MiB (default 25)")
    p.add_argument("--alignment", type=int, default=128, help="alignment in elements (default 128)")
    p.add_argument("--loss-scaling", action="store_true", help="plan the fp16 overflow check")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON document")
    p.add_argument("--rows", type=int, default=16, help="most rank rows in the table (default 16)")
    fitting.add_arguments(p)
    p.set_defaults(run=run)


def _specs(args: argparse.Namespace) -> tuple[tuple[ParamSpec, ...], str]:
    if args.shapes:
        return specs_from_json(args.shapes, args.dtype), args.shapes
    if args.hf_config:
        return specs_from_hf_config(args.hf_config, args.dtype), args.hf_config
    name = args.preset or "gpt2"
    return specs_from_preset(name, args.dtype), name


def run(args: argparse.Namespace) -> int:
    """Execute ``zeroplan plan`` with parsed ``args``; returns the exit code."""
    if not (math.isfinite(args.bucket_mb) and args.bucket_mb > 0):
        raise ConfigError(f"--bucket-mb must be a finite number > 0, got {args.bucket_mb}")
    if args.rows < 1:
        raise ConfigError(f"--rows must be >= 1, got {args.rows}")
    settings = fitting.fit_settings(args)  # checked before planning: see [Note: fit options]
    specs, source = _specs(args)
    topology = Topology(
        world_size=args.world,
        shard_size=args.world if args.shard_size is None else args.shard_size,
        ranks_per_node=args.ranks_per_node,
    )
    started = time.perf_counter()
    zp = plan(
        specs,
        topology,
        stage=args.stage,
        strategy=args.strategy,
        optimizer=describe_optimizer(args.optimizer),
        alignment=args.alignment,
        bucket_bytes=max(1, int(args.bucket_mb * 2**20)),
        loss_scaling=args.loss_scaling,
        layout=args.layout,
    )
    report = memory_report(zp)
    elapsed = time.perf_counter() - started
    fit = fitting.assess(report, settings)
    advice = fitting.recommendation(args, specs, settings)
    status = 1 if advice is not None and advice.best is None else 0
    if args.json:
        document = report.as_dict()
        document.update(
            model=source,
            dtype=specs[0].dtype if specs else None,
            optimizer=zp.optimizers[0].name,
            buckets=len(zp.buckets.buckets),
            layout=zp.partition.layout,
            layout_requested=args.layout,
            splits_params=zp.partition.splits_params,
            planning_seconds=round(elapsed, 4),
        )
        fitting.update_document(document, settings, fit, advice)
        json.dump(document, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return status
    layout = zp.partition.layout + (" (auto)" if args.layout == "auto" else "")
    _print_table(
        report, zp.optimizers[0].name, source, specs, len(zp.buckets.buckets), layout, elapsed, args.rows, fit
    )
    if settings.active or advice is not None:
        _print_fit(settings, fit, advice)
    return status


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.3f}"


def _groups(ranks: tuple[RankReport, ...], fit: FitReport | None = None) -> list[tuple[int, int, RankReport]]:
    """Consecutive ranks with identical figures (their fit's too), as (first, last, report)."""

    def key(r: RankReport) -> tuple[object, ...]:
        need = () if fit is None else (fit.ranks[r.rank].need_bytes, fit.ranks[r.rank].phase)
        return (
            *need,
            r.params_bytes,
            r.grads_bytes,
            r.master_bytes,
            r.optimizer_state_bytes,
            r.buffer_bytes,
            r.peak_bytes,
            r.comm_bytes_per_step,
        )

    groups: list[tuple[int, int, RankReport]] = []
    for r in ranks:
        if groups and key(groups[-1][2]) == key(r):
            groups[-1] = (groups[-1][0], r.rank, groups[-1][2])
        else:
            groups.append((r.rank, r.rank, r))
    return groups


def _print_table(
    report: MemoryReport,
    optimizer: str,
    source: str,
    specs: tuple[ParamSpec, ...],
    buckets: int,
    layout: str,
    elapsed: float,
    rows: int,
    fit: FitReport | None = None,
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{source}[/]: {report.total_params:,} parameters in {len(specs)} tensors, "
        f"{specs[0].dtype if specs else '-'}, {optimizer}\n"
        f"world {report.world}, shard groups of {report.shard_size}, stage {report.stage}, "
        f"strategy {report.strategy}, layout {layout}, {buckets} buckets, fingerprint {report.fingerprint} "
        f"(planned in {elapsed:.3f} s)"
    )
    table = Table(title="memory per rank (GiB) and traffic per step (GiB sent)")
    columns = ("ranks", "params", "grads", "master", "optim state", "buffers", "total")
    columns += ("peak", "at")
    columns += ("need", "need at", "fits") if fit is not None else ()
    columns += ("sent/step",)
    for column in columns:
        table.add_column(column, justify="right")
    groups = _groups(report.ranks, fit)
    shown = groups if len(groups) <= rows else [*groups[: rows - 1], groups[-1]]
    for i, (first, last, r) in enumerate(shown):
        if len(groups) > rows and i == rows - 1:
            table.add_row("…", *[""] * (len(columns) - 1))
        need: tuple[str, ...] = ()
        if fit is not None:
            f = fit.ranks[first]  # a group shares its need
            need = (_gib(f.need_bytes), f.phase.value, "yes" if f.fits else "no")
        table.add_row(
            str(first) if first == last else f"{first}-{last}",
            _gib(r.params_bytes),
            _gib(r.grads_bytes),
            _gib(r.master_bytes),
            _gib(r.optimizer_state_bytes),
            _gib(r.buffer_bytes),
            _gib(r.total_bytes),
            _gib(r.peak_bytes),
            r.peak_phase.value,
            *need,
            _gib(r.comm_bytes_per_step),
        )
    console.print(table)
    comm = Table(title="traffic of rank 0 per step")
    for column in ("group", "collective", "link", "calls", "GiB sent"):
        comm.add_column(column, justify="right")
    for c in report.ranks[0].comm:
        comm.add_row(c.group, c.collective.value, c.link.value, f"{c.calls:,}", _gib(c.bytes))
    console.print(comm)


def _print_fit(settings: fitting.FitSettings, fit: FitReport | None, advice: Recommendation | None) -> None:
    """The activations, whether the plan fits, and the recommendation (see [Note: fit options])."""
    from rich.console import Console

    console = Console(highlight=False)
    console.print(fitting.activations_line(settings))
    if fit is not None:
        console.print(f"fit in {fitting.gib(fit.device_bytes)}: {fit.summary()}")
    if advice is None:
        return
    console.print(fitting.grid(advice))
    console.print(f"[bold]recommendation[/]: {advice.reason}")
    if advice.best is None:
        console.print(fitting.hint(settings))
