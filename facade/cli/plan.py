"""``zeroplan plan``: print the memory per rank and traffic of a plan, as a table or JSON.

[Note: expert parallel plans]
``--expert-parallel E`` (default 1: none) plans a mixture-of-experts model as
``ZeroOptimizer`` runs it with an expert param group: :func:`zeroplan.core.expert_domains`
keeps what one rank holds (every dense parameter, ``1/E`` of every MoE layer's
experts; see [Note: one rank's experts] in ``zeroplan.core.experts``) and makes two
domains, ``"data"`` (the world, with ``--shard-size`` and ``--ranks-per-node``) and
``"experts"`` (expert-data-parallel groups of ``world / E``), which
:func:`zeroplan.core.plan_domains` plans. The table shows each domain as a plain plan
is shown, then every rank's total (rank ``r`` is rank ``r // E`` of its
expert-data-parallel group); ``--json`` prints :meth:`DomainsReport.as_dict` with
``per_rank_total``. The fit options of [Note: fit options], which plan one domain,
are refused. With ``--ranks-per-node`` the experts domain is planned on its nodes
(two-hop gathers where its groups span nodes), which ``ZeroOptimizer`` does not
execute yet: it gathers expert blocks in one hop.
Without ``--expert-parallel`` the output is what it always was.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from zeroplan.core import (
    AUTO_MAX_PIECES,
    LAYOUTS,
    CommCost,
    ConfigError,
    DomainPlans,
    DomainsReport,
    FitReport,
    MemoryReport,
    Offload,
    ParamSpec,
    RankReport,
    Recommendation,
    Stage,
    Topology,
    ZeroPlan,
    accumulation_bytes,
    describe_optimizer,
    domains_report,
    expert_domains,
    known_optimizers,
    memory_report,
    pipeline_stages,
    pipeline_traffic,
    plan,
    plan_domains,
    preset_names,
    strategy_names,
    tensor_parallel_specs,
    tensor_replicas,
    tensor_traffic,
)
from zeroplan.core.sizing.fit import gib
from zeroplan.core.sizing.trace import ActivationTrace, TracedPeak, traced_step_peak
from zeroplan.core.wire import WireCodec
from zeroplan.facade.cli import fit_command as fitting
from zeroplan.facade.cli.model_sources import (
    specs_from_hf_config,
    specs_from_json,
    specs_from_preset,
)

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
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="plan deterministic mode: buckets exchanged all-to-all and added in rank order, replica "
        "sums gathered, the exact clip norm (a power-of-two world)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=["param", "fp32", "bf16", "int8", "fp8"],
        default="param",
        help="what gradients travel as ([Note: wire formats]): the parameter dtype (default), fp32, "
        "bf16 added in fp32, or blockwise-scaled int8 / fp8 added in fp32",
    )
    p.add_argument(
        "--gather-dtype",
        choices=["param", "bf16", "int8", "fp8"],
        default="param",
        help="what updated parameters travel as in their gathers ([Note: wire formats]): the "
        "parameter dtype (default), bf16, or blockwise-scaled int8 / fp8 (bf16/fp16 parameters at "
        "stages 1-2, any at stage 3)",
    )
    p.add_argument(
        "--wire-block", type=int, default=128, help="elements per scale of int8 / fp8 (default 128)"
    )
    p.add_argument(
        "--grad-accumulation",
        type=int,
        default=1,
        metavar="N",
        help="backward passes per rank per step (G/W with --deterministic): report the gradients "
        "held between them (default 1)",
    )
    p.add_argument(
        "--offload",
        choices=[m.value for m in Offload],
        default="none",
        help="CPU offload, planned ([Note: offload, planned]): optimizer puts the fp32 masters, the "
        "optimizer state and the fp32 gradient shard in host memory (stages 1-3); all puts the "
        "parameter shards there too (stage 3). Shows device and host bytes, the device peak and "
        "bytes per step over the host link (default none)",
    )
    p.add_argument(
        "--offload-fraction",
        type=float,
        default=None,
        metavar="F",
        help="with --offload optimizer: the share of each rank's optimizer elements in host memory; "
        "the plan keeps the rest (the buckets launched last) on the device, which steps them "
        "([Note: kept on the device]; default: all of them)",
    )
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON document")
    p.add_argument("--rows", type=int, default=16, help="most rank rows in the table (default 16)")
    p.add_argument(
        "--expert-parallel",
        type=int,
        default=1,
        metavar="E",
        help="ranks splitting each MoE layer's experts: plan the dense parameters over the world and "
        "the experts over expert-data-parallel groups of world/E (default 1: no expert domain)",
    )
    p.add_argument(
        "--pipeline-parallel",
        type=int,
        default=1,
        metavar="P",
        help="pipeline stages: cut the model's blocks into P stages (embeddings in the first, the "
        "head in the last) and plan each stage's optimizer over --world data-parallel ranks, the job "
        "holding P x world ranks (default 1)",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="T",
        help="tensor-parallel ranks: plan one rank's local shards of Megatron's split (column- and "
        "row-parallel linears, vocabulary-parallel embeddings and head; norms replicated), the job "
        "holding T x world ranks (default 1)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tensor-parallel: sequence parallelism, whose replicated parameters (norms, row-parallel "
        "biases) get partial gradients: zeroplan all-reduces them "
        "over the tensor-parallel group each step (counted)",
    )
    fitting.add_arguments(p)
    p.set_defaults(run=run)


def _plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's keywords from the command line (every domain is planned with the same)."""
    return {
        "stage": args.stage,
        "strategy": args.strategy,
        "optimizer": describe_optimizer(args.optimizer),
        "alignment": args.alignment,
        "bucket_bytes": max(1, int(args.bucket_mb * 2**20)),
        "loss_scaling": args.loss_scaling,
        "layout": args.layout,
        "deterministic": args.deterministic,
        "grad_wire": None
        if args.reduce_dtype == "param"
        else WireCodec(args.reduce_dtype, block=args.wire_block),
        "param_wire": None
        if args.gather_dtype == "param"
        else WireCodec(args.gather_dtype, block=args.wire_block),
        **({} if args.offload == Offload.NONE.value else {"offload": args.offload}),
        **({} if args.offload_fraction is None else {"offload_fraction": args.offload_fraction}),
    }


def _topology(args: argparse.Namespace) -> Topology:
    """The data-parallel topology the command line describes (per pipeline stage with stages)."""
    return Topology(
        world_size=args.world,
        shard_size=args.world if args.shard_size is None else args.shard_size,
        ranks_per_node=args.ranks_per_node,
    )


def _specs(args: argparse.Namespace) -> tuple[tuple[ParamSpec, ...], str]:
    """The model's specs; with ``--tensor-parallel``, tensor-parallel rank 0's local shards (the largest)."""
    if args.shapes:
        specs, source = specs_from_json(args.shapes, args.dtype), args.shapes
    elif args.hf_config:
        specs, source = specs_from_hf_config(args.hf_config, args.dtype), args.hf_config
    else:
        source = args.preset or "gpt2"
        specs = specs_from_preset(source, args.dtype)
    if args.tensor_parallel != 1:
        specs = tensor_parallel_specs(specs, args.tensor_parallel)
    return specs, source


def _check_tensor_parallel(args: argparse.Namespace) -> None:
    """Refuse what ``--tensor-parallel`` does not combine with yet (one-line errors)."""
    if args.tensor_parallel < 1:
        raise ConfigError(
            f"--tensor-parallel must be >= 1 (1: no tensor parallelism), got {args.tensor_parallel}"
        )
    if args.sequence_parallel and args.tensor_parallel == 1:
        raise ConfigError("--sequence-parallel needs --tensor-parallel T with T > 1")
    if args.tensor_parallel == 1:
        return
    given = [
        flag for flag, key in (*_FIT_FLAGS, ("--trace", "trace")) if getattr(args, key) not in (None, False)
    ]
    if args.expert_parallel != 1:
        given.insert(0, "--expert-parallel")
    if given:
        raise ConfigError(
            f"{given[0]} does not take --tensor-parallel into account yet (activations and experts are "
            f"planned for whole layers); drop {given[0]}, or plan without --tensor-parallel"
        )


def _tensor_document(args: argparse.Namespace, specs: Sequence[ParamSpec]) -> dict[str, Any] | None:
    """``--json``'s ``"tensor_parallel"``: the degree, the split, and the calls over ``tp`` per step."""
    if args.tensor_parallel == 1:
        return None
    costs = _tensor_costs(args, specs)
    return {
        "degree": args.tensor_parallel,
        "sequence_parallel": args.sequence_parallel,
        "sharded_params": sum(1 for s in specs if s.index not in tensor_replicas(specs)),
        "replicated_params": len(tensor_replicas(specs)),
        "planned_comm": [_comm_entry(c) for c in costs],
        "not_planned": "the model's own tensor-parallel collectives (activations and their gradients, "
        "sequence-parallel gathers and reduce-scatters) are the model's, not zeroplan's",
    }


def _tensor_costs(args: argparse.Namespace, specs: Sequence[ParamSpec]) -> tuple[CommCost, ...]:
    """What zeroplan sends over ``tp`` per step (the norm with clipping, as the report assumes)."""
    return tensor_traffic(
        specs,
        args.tensor_parallel,
        clipping=True,
        loss_scaling=args.loss_scaling,
        sequence_parallel=args.sequence_parallel,
    )


def _tensor_line(args: argparse.Namespace, specs: Sequence[ParamSpec]) -> str | None:
    """The table's footnote with ``--tensor-parallel``: what one rank holds and sends over ``tp``."""
    if args.tensor_parallel == 1:
        return None
    costs = _tensor_costs(args, specs)
    sent = sum(c.bytes for c in costs)
    calls = sum(c.calls for c in costs)
    replicas = len(tensor_replicas(specs))
    what = [
        name
        for name, present in (
            ("the replicated parameters' gradients", args.sequence_parallel),
            ("the norm (clipping)", True),
            ("the overflow verdict", args.loss_scaling),
        )
        if present
    ]
    return (
        f"tensor parallel {args.tensor_parallel}: the rows above are one tensor-parallel rank's local "
        f"shards ({len(specs) - replicas} parameters split, {replicas} replicated; the job holds "
        f"{args.tensor_parallel} x {args.world} ranks per pipeline stage). zeroplan adds {calls} "
        f"all-reduce(s) over the tensor-parallel group per step ({', '.join(what)}), "
        f"{sent / 2**20:.3f} MiB sent; the model's own tensor-parallel collectives are not planned"
    )


def run(args: argparse.Namespace) -> int:
    """Execute ``zeroplan plan`` with parsed ``args``; returns the exit code."""
    if not (math.isfinite(args.bucket_mb) and args.bucket_mb > 0):
        raise ConfigError(f"--bucket-mb must be a finite number > 0, got {args.bucket_mb}")
    if args.grad_accumulation < 1:
        raise ConfigError(f"--grad-accumulation must be >= 1, got {args.grad_accumulation}")
    if args.rows < 1:
        raise ConfigError(f"--rows must be >= 1, got {args.rows}")
    _check_tensor_parallel(args)
    if args.pipeline_parallel != 1:
        return _run_pipeline(args)
    if args.expert_parallel != 1:
        if args.offload != Offload.NONE.value:
            raise ConfigError(
                f"--offload {args.offload} with --expert-parallel is not planned yet: plan the model "
                "without --expert-parallel, or without --offload"
            )
        return _run_experts(args)
    settings = fitting.fit_settings(args)  # checked before planning: see [Note: fit options]
    specs, source = _specs(args)
    topology = _topology(args)
    started = time.perf_counter()
    zp = plan(specs, topology, **_plan_options(args))
    report = memory_report(zp)
    elapsed = time.perf_counter() - started
    step_trace = _step_trace(args, zp, settings)
    fit = fitting.assess(zp, report, settings, step_trace)
    advice = fitting.recommendation(args, specs, settings, step_trace)
    status = 1 if advice is not None and advice.best is None else 0
    per_link = None
    if zp.grad_wire is not None or zp.param_wire is not None:  # the same plan without wires, to compare
        plain = {**_plan_options(args), "grad_wire": None, "param_wire": None}
        default = memory_report(plan(specs, topology, **plain))
        per_link = _bytes_per_link(default.ranks[0].comm, report.ranks[0].comm)
    if args.json:
        document = report.as_dict()
        document.update(
            model=source,
            dtype=specs[0].dtype if specs else None,
            optimizer=zp.optimizers[0].name,
            buckets=len(zp.buckets.buckets),
            layout=zp.partition.layout,
            layout_requested=args.layout,
            deterministic=zp.deterministic,
            reduce_dtype=args.reduce_dtype,
            gather_dtype=args.gather_dtype,
            wire_per_link=None if per_link is None else [row._asdict() for row in per_link],
            wires=_wires(zp, specs),
            accumulation_bytes=accumulation_bytes(zp, args.grad_accumulation),
            splits_params=zp.partition.splits_params,
            planning_seconds=round(elapsed, 4),
        )
        if args.offload != Offload.NONE.value:  # [Note: offload, planned]; absent without offload
            document["offload"] = args.offload
            if zp.residences.partial:  # [Note: kept on the device]
                document["offload_fraction"] = zp.residences.host_fraction
                document["kept_on_device"] = [
                    [zp.kept_numel(space.index, s) for s in range(zp.topology.shard_size)]
                    for space in zp.partition.spaces
                ]
        tensor = _tensor_document(args, specs)
        if tensor is not None:  # [Note: tensor-parallel parameters]; absent without
            document["tensor_parallel"] = tensor
        fitting.update_document(document, settings, fit, advice)
        if step_trace is not None:
            document["traced_step"] = [p._asdict() for p in traced_step_peak(zp, step_trace)]
        sys.stdout.write(json.dumps(document, indent=1))  # one write, not one per token
        sys.stdout.write("\n")
        return status
    layout = zp.partition.layout + (" (auto)" if args.layout == "auto" else "")
    layout += ", deterministic" if zp.deterministic else ""
    layout += f", gradients sent as {args.reduce_dtype}" if zp.grad_wire is not None else ""
    layout += f", parameters gathered as {args.gather_dtype}" if zp.param_wire is not None else ""
    layout += f", offload {args.offload}" if args.offload != Offload.NONE.value else ""
    layout += f" ({args.offload_fraction:g} of the state)" if zp.residences.partial else ""
    _print_table(
        report, zp.optimizers[0].name, source, specs, len(zp.buckets.buckets), layout, elapsed, args.rows, fit
    )
    tensor_line = _tensor_line(args, specs)
    if tensor_line is not None:
        print(tensor_line)
    if per_link is not None:
        _print_per_link(per_link, _wire_label(args))
        for what, wire in _wires(zp, specs).items():
            scales = wire["scale_bytes_per_element"]
            share = f", {scales:g} bytes of fp32 scale per element" if scales else ""
            sent = f"{wire['format']}, {wire['element_bytes']} byte(s) per element{share}"
            received = "added in fp32" if what == "gradients" else "decoded alike on every rank"
            print(f"{what}: {sent}, {received}")
    if args.grad_accumulation > 1:
        held = accumulation_bytes(zp, args.grad_accumulation)
        kind = "partial sums of the micro-batch tree" if zp.deterministic else "autograd's .grad"
        print(
            f"gradients held between the {args.grad_accumulation} backward passes: "
            f"{held / 2**30:.3f} GiB ({kind})"
        )
    if settings.active or advice is not None:
        _print_fit(settings, fit, advice)
    if step_trace is not None:
        print(_traced_line(traced_step_peak(zp, step_trace), settings.device_bytes))
    return status


def _step_trace(
    args: argparse.Namespace, zp: ZeroPlan, settings: fitting.FitSettings
) -> ActivationTrace | None:
    """The trace to read ``zp``'s step from (``--trace``): traced again with the plan when gradients
    wait out of bucket order or at stage 3 (its schedule keeps the gradients, its hooks the gathered
    blocks), which makes the step exact ([Note: one timeline], [Note: stage 3 traced])."""
    if settings.trace is None:
        return None
    if all(p.exact for p in traced_step_peak(zp, settings.trace)) or zp.stage is Stage.DDP:
        return settings.trace
    return fitting.trace_args(args, args.micro_batch or 1, plan=zp)


def _traced_line(peaks: tuple[TracedPeak, ...], device_bytes: int | None) -> str:
    """The whole step's peak with traced activations ([Note: one timeline]), on the busiest rank."""
    worst = max(peaks, key=lambda p: p.peak_bytes)
    kind = "" if worst.exact else " (an upper bound)"
    parts = f"{gib(worst.activations)} activations + {gib(worst.gradients)} gradients not staged"
    if worst.traced_gradients:
        held = (
            "activations, gradients and gathered blocks"
            if worst.traced_blocks
            else "activations and gradients"
        )
        parts = f"{gib(worst.activations)} {held}"
    line = (
        f"whole step, traced: {gib(worst.peak_bytes)} at the most (rank {worst.rank}, in {worst.phase}: "
        f"{gib(worst.persistent)} persistent + {parts}){kind}"
    )
    if device_bytes is not None:
        margin = device_bytes - worst.peak_bytes
        verdict = f"fits with {gib(margin)} to spare" if margin >= 0 else f"does not fit by {gib(-margin)}"
        line += f"; in {gib(device_bytes)}: {verdict}"
    return line


#: Options of [Note: fit options] that ``--expert-parallel`` does not support: they plan one domain.
_FIT_FLAGS = (
    ("--device-memory", "device_memory"),
    ("--seq-len", "seq_len"),
    ("--micro-batch", "micro_batch"),
    ("--recompute", "recompute"),
    ("--activation-bytes", "activation_bytes"),
    ("--recommend", "recommend"),
)


def _run_experts(args: argparse.Namespace) -> int:
    """``zeroplan plan --expert-parallel E`` (see [Note: expert parallel plans])."""
    e = args.expert_parallel
    if e < 1:
        raise ConfigError(f"--expert-parallel must be >= 1 (1: no expert parallelism), got {e}")
    given = [flag for flag, key in _FIT_FLAGS if getattr(args, key) not in (None, False)]
    if given:
        raise ConfigError(
            f"{given[0]} does not take --expert-parallel into account yet (the fit and the recommender "
            f"plan a single domain); drop {given[0]}, or plan without --expert-parallel"
        )
    specs, source = _specs(args)
    started = time.perf_counter()
    split = expert_domains(
        specs,
        world_size=args.world,
        expert_parallel=e,
        shard_size=args.shard_size,
        ranks_per_node=args.ranks_per_node,
    )
    dp = plan_domains(split.specs, split.domains, **_plan_options(args))
    dr = domains_report(dp)
    totals = tuple(dr.rank((r, r // e)) for r in range(args.world))
    elapsed = time.perf_counter() - started
    optimizer = dp.plans[0].optimizers[0].name
    if args.json:
        document: dict[str, Any] = {
            "model": source,
            "dtype": specs[0].dtype,
            "optimizer": optimizer,
            "world": args.world,
            "expert_parallel": e,
            "stage": int(dp.stage),
            "total_params": sum(s.numel for s in specs),
            "params_per_rank": sum(s.numel for s in split.specs),
            "fingerprint": dp.fingerprint(),
            "layout_requested": args.layout,
            "planning_seconds": round(elapsed, 4),
            **dr.as_dict(),
            "per_rank_total": [{"positions": [r, r // e], **t.as_dict()} for r, t in enumerate(totals)],
        }
        for entry, zp in zip(document["domains"], dp.plans, strict=True):
            entry.update(
                buckets=len(zp.buckets.buckets),
                layout=zp.partition.layout,
                splits_params=zp.partition.splits_params,
            )
        sys.stdout.write(json.dumps(document, indent=1))  # one write, not one per token
        sys.stdout.write("\n")
        return 0
    _print_experts(args, source, specs, dp, dr, totals, elapsed)
    return 0


def _run_pipeline(args: argparse.Namespace) -> int:
    """``zeroplan plan --pipeline-parallel P``: each stage's optimizer over ``--world`` ranks.

    Every stage is an optimizer of its own ([Note: mesh roles]); the norm and the overflow verdict
    add one scalar all-reduce each over the ``pp`` group per step (with clipping, a loss scale:
    ``core.pipeline_traffic``), and with ``--tensor-parallel`` each stage's own calls over ``tp``.
    """
    stages = args.pipeline_parallel
    if stages < 1:
        raise ConfigError(f"--pipeline-parallel must be >= 1 (1: no pipeline), got {stages}")
    given = [flag for flag, key in _FIT_FLAGS if getattr(args, key) not in (None, False)]
    if args.expert_parallel != 1:
        given.insert(0, "--expert-parallel")
    if given:
        raise ConfigError(
            f"{given[0]} does not take --pipeline-parallel into account yet; drop {given[0]}, or plan "
            "without --pipeline-parallel"
        )
    specs, source = _specs(args)
    started = time.perf_counter()
    topology = _topology(args)
    parts = pipeline_stages(specs, stages)
    plans = [plan(part, topology, **_plan_options(args)) for part in parts]
    reports = [memory_report(zp) for zp in plans]
    pipeline_comm = [
        pipeline_traffic(stages, clipping=True, loss_scaling=args.loss_scaling, rank=k) for k in range(stages)
    ]
    elapsed = time.perf_counter() - started
    if args.json:
        document: dict[str, Any] = {
            "model": source,
            "dtype": specs[0].dtype,
            "optimizer": plans[0].optimizers[0].name,
            "world": args.world,
            "pipeline_parallel": stages,
            "total_params": sum(s.numel for s in specs),
            "planning_seconds": round(elapsed, 4),
            "stages": [
                {
                    "stage": k,
                    "first": part[0].name,
                    "last": part[-1].name,
                    "buckets": len(zp.buckets.buckets),
                    "layout": zp.partition.layout,
                    **report.as_dict(),
                    "pipeline_comm": [_comm_entry(c) for c in pipeline_comm[k]],
                    **(
                        {} if args.tensor_parallel == 1 else {"tensor_parallel": _tensor_document(args, part)}
                    ),
                }
                for k, (part, zp, report) in enumerate(zip(parts, plans, reports, strict=True))
            ],
        }
        sys.stdout.write(json.dumps(document, indent=1))  # one write, not one per token
        sys.stdout.write("\n")
        return 0
    layout = "" if args.layout != "auto" else " (auto)"
    for k, (part, zp, report) in enumerate(zip(parts, plans, reports, strict=True)):
        _print_table(
            report,
            zp.optimizers[0].name,
            f"pipeline stage {k} of {stages} ({part[0].name} .. {part[-1].name})",
            part,
            len(zp.buckets.buckets),
            zp.partition.layout + layout,
            elapsed,
            args.rows,
        )
        tensor_line = _tensor_line(args, part)
        if tensor_line is not None:
            print(tensor_line)
    worst = max(range(stages), key=lambda k: max(r.peak_bytes for r in reports[k].ranks))
    controls = ["the norm (clipping)"] + (["the overflow verdict"] if args.loss_scaling else [])
    print(
        f"the job holds {stages} x {args.world} ranks; the busiest stage is {worst} (peak "
        f"{gib(max(r.peak_bytes for r in reports[worst].ranks))} per rank). Each step adds "
        f"{sum(c.calls for c in pipeline_comm[0])} scalar all-reduce(s) over the pipeline group "
        f"({', '.join(controls)}), {max(sum(c.bytes for c in comm) for comm in pipeline_comm)} B sent "
        "per rank at most"
    )
    return 0


def _comm_entry(cost: CommCost) -> dict[str, Any]:
    """One planned call of ``--json``'s traffic lists."""
    return {
        "group": cost.group,
        "collective": cost.collective.value,
        "calls": cost.calls,
        "bytes": cost.bytes,
    }


def _print_experts(
    args: argparse.Namespace,
    source: str,
    specs: tuple[ParamSpec, ...],
    dp: DomainPlans,
    dr: DomainsReport,
    totals: tuple[RankReport, ...],
    elapsed: float,
) -> None:
    """The model, one table per domain, then every rank's total."""
    from rich.console import Console

    from zeroplan.facade.cli.tables import print_table

    e, world = args.expert_parallel, args.world
    group = world // e
    optimizer = dp.plans[0].optimizers[0].name
    dense, experts = (sum(s.numel for s in zp.specs) for zp in dp.plans)
    console = Console()
    console.print(
        f"[bold]{source}[/]: {sum(s.numel for s in specs):,} parameters in {len(specs)} tensors, "
        f"{specs[0].dtype}, {optimizer}\n"
        f"expert parallel {e}: a rank holds {dense + experts:,} parameters: {dense:,} dense (data domain, "
        f"world {world})\nand {experts:,} of experts, 1/{e} of every MoE layer's (experts domain, "
        f"expert-data-parallel groups of {group}); fingerprint {dp.fingerprint()}"
    )
    layout = "" if args.layout != "auto" else " (auto)"
    names = {"data": "data domain (dense parameters)", "experts": f"experts domain (1/{e} of the experts)"}
    for domain, zp, report in zip(dp.domains, dp.plans, dr.reports, strict=True):
        titles = {}
        if domain.name == "experts":
            titles = {
                "title": f"memory per rank of an expert-data-parallel group of {group} (GiB) "
                "and traffic per step (GiB sent)",
                "comm_title": "traffic of its rank 0 per step",
            }
        _print_table(
            report,
            optimizer,
            names[domain.name],
            zp.specs,
            len(zp.buckets.buckets),
            zp.partition.layout + layout,
            elapsed,
            args.rows,
            **titles,
        )
    print_table(
        console,
        _memory_table(
            "per rank total, data + experts (GiB; peak: the domains' peaks added, an upper bound)",
            totals,
            args.rows,
        ),
        sections=_SECTIONS,
    )
    console.print(
        f"rank r is expert-parallel rank r % {e} (expert-parallel groups are {e} consecutive ranks) and rank "
        f"r // {e} of its expert-data-parallel group {{r % {e}, r % {e} + {e}, …}}"
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.3f}"


def _cells(r: RankReport, fit: FitReport | None) -> tuple[str, ...]:
    """The memory table's figures of rank ``r``, as printed (ranks the first column)."""
    need: tuple[str, ...] = ()
    if fit is not None:
        f = fit.ranks[r.rank]
        need = (_gib(f.need_bytes), f.phase.value, "yes" if f.fits else "no")
    return (
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


_Group = tuple[int, int, tuple[str, ...]]
"""Consecutive ranks printed as one row: first, last, the row's figures."""


def _groups(ranks: tuple[RankReport, ...], fit: FitReport | None = None) -> list[_Group]:
    """Consecutive ranks whose printed figures are identical, as (first, last, cells).

    Grouped as printed, not by exact bytes: a control all-reduce of a few scalars costs ranks a
    few bytes more or less ([Note: control calls] in ``zeroplan.core.comm``), which ``--json``
    keeps per rank and the table, in GiB, cannot show.
    """
    groups: list[_Group] = []
    for r in ranks:
        cells = _cells(r, fit)
        if groups and groups[-1][2] == cells:
            groups[-1] = (groups[-1][0], r.rank, cells)
        else:
            groups.append((r.rank, r.rank, cells))
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
    *,
    title: str = "memory per rank (GiB) and traffic per step (GiB sent)",
    comm_title: str = "traffic of rank 0 per step",
) -> None:
    from rich.console import Console
    from rich.table import Table

    from zeroplan.facade.cli.tables import print_table

    console = Console()
    console.print(
        f"[bold]{source}[/]: {report.total_params:,} parameters in {len(specs)} tensors, "
        f"{specs[0].dtype if specs else '-'}, {optimizer}\n"
        f"world {report.world}, shard groups of {report.shard_size}, stage {report.stage}, "
        f"strategy {report.strategy}, layout {layout}, {buckets} buckets, fingerprint {report.fingerprint} "
        f"(planned in {elapsed:.3f} s)"
    )
    print_table(console, _memory_table(title, report.ranks, rows, fit), sections=_SECTIONS)
    if report.residences:
        print_table(console, _where_table(report))
    comm = Table(title=comm_title)
    for column in ("group", "collective", "link", "calls", "GiB sent"):
        comm.add_column(column, justify="right")
    for c in report.ranks[0].comm:
        comm.add_row(c.group, c.collective.value, c.link.value, f"{c.calls:,}", _gib(c.bytes))
    print_table(console, comm, key=3)


class LinkBytes(NamedTuple):
    """Rank 0's bytes per step on one link of one group, by default and with the wire format."""

    group: str
    link: str
    default_bytes: int
    bytes: int


def _bytes_per_link(default: Sequence[CommCost], chosen: Sequence[CommCost]) -> list[LinkBytes]:
    """Both traffics summed per (group, link), in the order the links first appear."""
    totals: dict[tuple[str, str], list[int]] = {}
    for column, costs in enumerate((default, chosen)):
        for c in costs:
            totals.setdefault((c.group, c.link.value), [0, 0])[column] += c.bytes
    return [LinkBytes(group, link, a, b) for (group, link), (a, b) in totals.items()]


def _wires(zp: ZeroPlan, specs: Sequence[ParamSpec]) -> dict[str, dict[str, object]]:
    """The plan's wire formats ([Note: wire formats]): what gradients and parameters travel as."""
    dtype = specs[0].dtype if specs else "float32"
    wires = {"gradients": zp.grad_wire, "parameters": zp.param_wire}
    return {what: codec.summary(dtype) for what, codec in wires.items() if codec is not None}


def _wire_label(args: argparse.Namespace) -> str:
    """What the wires send, for the per-link table: ``"grads int8, params fp8"``."""
    wires = [("grads", args.reduce_dtype), ("params", args.gather_dtype)]
    return ", ".join(f"{what} {wire}" for what, wire in wires if wire != "param")


def _print_per_link(rows: list[LinkBytes], wire: str) -> None:
    """The traffic of rank 0 per group and link under the wires ``wire`` names, next to the default."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rank 0's traffic per step, {wire} against the parameter dtype")
    for column in ("group", "link", "default GiB", f"{wire} GiB", "ratio"):
        table.add_column(column, justify="right")
    for row in rows:
        ratio = f"{row.bytes / row.default_bytes:.2f}" if row.default_bytes else "-"
        table.add_row(row.group, row.link, _gib(row.default_bytes), _gib(row.bytes), ratio)
    Console().print(table)


#: Where the memory table splits in a narrow terminal: memory held | peak, need and traffic
#: (see [Note: narrow terminals] in ``zeroplan.facade.cli.tables``).
_SECTIONS = ("params", "peak")


def _where_table(report: MemoryReport) -> Any:
    """Where each buffer role of a rank lives ([Note: residences] in ``zeroplan.core.residence``)."""
    from rich.table import Table

    r = report.ranks[0]
    table = Table(title="where buffers live")
    table.add_column("buffer")
    table.add_column("where", justify="right")
    for role, where in report.residences:
        table.add_row(role.replace("_", " "), where)
    table.add_section()
    table.add_row("rank 0 device GiB", _gib(r.device_bytes))
    table.add_row("rank 0 host GiB", _gib(r.host_bytes))
    table.add_row("rank 0 background-save staging GiB (host)", _gib(r.save_staging_bytes))
    if r.host_link is not None:  # [Note: offload, planned] in zeroplan.core.offload
        table.add_section()
        table.add_row("step's device peak GiB", _gib(r.device_peak_bytes))
        table.add_row("host memory at the step GiB", _gib(r.host_peak_bytes))
        table.add_row("host memory pinned on a GPU", "yes")
        table.add_row("step runs on", "host" if r.step_on_host else "device")
        if r.kept_step_transient_bytes:  # [Note: kept on the device]
            table.add_row("step of the kept part on the device GiB", _gib(r.kept_step_transient_bytes))
        link = r.host_link
        table.add_row(f"to host per step GiB ({link.to_host_copies:,} copies)", _gib(link.to_host))
        table.add_row(f"to device per step GiB ({link.to_device_copies:,} copies)", _gib(link.to_device))
    return table


def _memory_table(title: str, ranks: tuple[RankReport, ...], rows: int, fit: FitReport | None = None) -> Any:
    """A rich table of ``ranks``' memory and traffic, consecutive ranks printed alike in one row."""
    from rich.table import Table

    table = Table(title=title)
    columns = ("ranks", "params", "grads", "master", "optim state", "buffers", "total")
    columns += ("peak", "at")
    columns += ("need", "need at", "fits") if fit is not None else ()
    columns += ("sent/step",)
    for column in columns:
        table.add_column(column, justify="right")
    groups = _groups(ranks, fit)
    shown = groups if len(groups) <= rows else [*groups[: rows - 1], groups[-1]]
    for i, (first, last, cells) in enumerate(shown):
        if len(groups) > rows and i == rows - 1:
            table.add_row("…", *[""] * (len(columns) - 1))
        table.add_row(str(first) if first == last else f"{first}-{last}", *cells)
    return table


def _print_fit(settings: fitting.FitSettings, fit: FitReport | None, advice: Recommendation | None) -> None:
    """The activations, whether the plan fits, and the recommendation (see [Note: fit options])."""
    from rich.console import Console

    from zeroplan.facade.cli.tables import print_table

    console = Console(highlight=False)
    console.print(fitting.activations_line(settings))
    if fit is not None:
        console.print(f"fit in {fitting.gib(fit.device_bytes)}: {fit.summary()}")
    if advice is None:
        return
    print_table(console, fitting.grid(advice))
    console.print(f"[bold]recommendation[/]: {advice.reason}")
    if advice.best is None:
        console.print(fitting.hint(settings))
