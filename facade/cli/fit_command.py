"""``zeroplan plan``'s "does it fit?" options: device memory, activations, and the recommender.

[Note: fit options]
``--device-memory SIZE`` checks every rank's need against one device (see
[Note: does it fit] in :mod:`zeroplan.core.sizing.fit`), so it needs the activations,
given one of two ways:

* ``--seq-len N`` (with ``--micro-batch N``, default 1, and ``--recompute
  none|selective|full``, default none): the formula of [Note: activation
  memory] (:mod:`zeroplan.core.sizing.activations`) on the model's dimensions, which
  a ``--preset`` or an ``--hf-config`` gives; a ``--shapes`` file does not, and
  ``--seq-len`` with it is refused;
* ``--activation-bytes SIZE``: measured or estimated elsewhere (``0`` plans
  without them, knowingly).

Neither is assumed: ``--device-memory`` alone is refused rather than answering
"fits" for a step whose largest part was left out. ``--seq-len`` without
``--device-memory`` only reports the activations. ``--recommend`` (needs
``--device-memory``) plans every stage and shard size and prints the cheapest
configuration that fits with its reason; it exits with status 1 when nothing
fits. With ``--trace`` each configuration's need is its step's timeline, the
micro-batch is chosen too (``--micro-batch`` and its halvings, the largest at
which something fits, traced as needed), and the cheapest that fits is traced
again with its plan until that is exact ([Note: the cheapest configuration]). Sizes are a
number and an optional unit: ``B``, ``K``/``KiB``, ``M``/``MiB``, ``G``/``GiB``,
``T``/``TiB`` (powers of 1024; a bare letter too, as ``dd`` and ``free`` read
it) or ``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000); case does not matter.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, NamedTuple

from zeroplan.core import (
    ActivationMemory,
    ConfigError,
    FitReport,
    MemoryReport,
    ParamSpec,
    Recommendation,
    Recompute,
    ZeroPlan,
    activation_memory,
    fit_report,
    preset_dims,
    recommend,
)
from zeroplan.core.sizing.fit import gib
from zeroplan.core.sizing.recommend import recommend_micro_batch
from zeroplan.core.sizing.trace import ActivationTrace, traced_fit
from zeroplan.facade.cli.model_sources import dims_from_hf_config

__all__ = ["FitSettings", "add_arguments", "fit_settings", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}{suffix}": 1024 ** (i + 1) for i, p in enumerate("kmgt") for suffix in ("", "i", "ib")},
    **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")},
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number and an optional unit (see [Note: fit options]).

    Raises:
        ConfigError: not a size.

    Example:
        >>> [parse_size(s) for s in ("80GiB", "80GB", "40G", "81920MiB", "1024", "1.5k")]
        [85899345920, 80000000000, 42949672960, 85899345920, 1024, 1536]
    """
    match = _SIZE.fullmatch(text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ConfigError(
            f"invalid size {text!r}: use a number and a unit such as 80GiB, 80GB, 40G, 81920MiB or bytes"
        )
    return int(float(match.group(1)) * unit)


def _size(text: str) -> int:
    """``parse_size`` for argparse (its error becomes ``argument --flag: …``, exit code 2)."""
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the options of [Note: fit options] to the ``plan`` parser."""
    group = p.add_argument_group("does it fit? (activations: Korthikanti et al. 2022)")
    group.add_argument(
        "--device-memory", type=_size, metavar="SIZE", help="memory of one device: 80GiB, 80GB, 40G, …"
    )
    group.add_argument(
        "--seq-len", type=int, metavar="N", help="tokens per sequence (needs a preset or HF config)"
    )
    group.add_argument("--micro-batch", type=int, metavar="N", help="sequences per rank per step (default 1)")
    group.add_argument(
        "--recompute",
        choices=[r.value for r in Recompute],
        help="activation recomputation (default none; selective keeps what FlashAttention keeps)",
    )
    group.add_argument(
        "--activation-bytes", type=_size, metavar="SIZE", help="activations per rank, instead of --seq-len"
    )
    group.add_argument(
        "--recommend",
        action="store_true",
        help="the cheapest stage and shard size that fit --device-memory (exit status 1: none)",
    )
    group.add_argument(
        "--activations",
        choices=["formula", "trace"],
        help="how --seq-len's activations are planned: formula (the default, an estimate) or trace (--trace)",
    )
    group.add_argument(
        "--trace",
        action="store_true",
        help="trace the --hf-config model's activations under fake tensors (forward and backward of one "
        "micro-batch, nothing allocated) instead of the formula: the whole step's peak per rank",
    )


class FitSettings(NamedTuple):
    """What the fit options ask for, checked (see [Note: fit options]).

    Attributes:
        device_bytes: the device's memory, or ``None``: no fit asked.
        activation_bytes: activations per rank, or ``None``: unknown.
        activations: the formula's breakdown, when ``--seq-len`` gave them.
        recommend: whether to run the recommender.
        trace: the traced activations (``--trace``), an ``ActivationTrace``.
        trace_seconds: how long tracing took.
    """

    device_bytes: int | None
    activation_bytes: int | None
    activations: ActivationMemory | None
    recommend: bool
    trace: Any = None
    trace_seconds: float = 0.0

    @property
    def active(self) -> bool:
        """Whether any fit option was given (otherwise the output is the plain plan)."""
        return self.activation_bytes is not None or self.device_bytes is not None


_NEED_ACTIVATIONS = (
    "--device-memory needs the activations: pass --seq-len N (with --micro-batch N, default 1, and "
    "--recompute) for a --preset or --hf-config, or --activation-bytes SIZE (0 to leave them out)"
)


def fit_settings(args: argparse.Namespace) -> FitSettings:
    """Check the fit options of ``args`` and compute the activations (before anything is planned).

    Raises:
        ConfigError: options that contradict or miss each other, or bad sizes.
    """
    if args.recommend and args.device_memory is None:
        raise ConfigError("--recommend needs --device-memory SIZE (the memory of one device)")
    if args.device_memory is not None and args.device_memory < 1:
        raise ConfigError(f"--device-memory must be at least 1 byte, got {args.device_memory}")
    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    formula = [f for f, v in (("--micro-batch", args.micro_batch), ("--recompute", args.recompute)) if v]
    if args.activation_bytes is not None and (formula or args.seq_len is not None):
        raise ConfigError(
            "--activation-bytes replaces --seq-len, --micro-batch and --recompute; pass one or the other"
        )
    if formula and args.seq_len is None:
        raise ConfigError(f"{formula[0]} needs --seq-len N: the activations depend on both")
    if args.trace and args.activations == "formula":
        raise ConfigError("--trace is --activations trace: pass one of --trace and --activations formula")
    if args.activations is not None and args.seq_len is None:
        raise ConfigError(f"--activations {args.activations} needs --seq-len N")
    if args.trace or args.activations == "trace":
        return _traced(args)
    activations = None
    if args.seq_len is not None:
        if args.shapes:
            raise ConfigError(
                "--seq-len needs the model's layers, hidden size, heads and vocabulary, which a shapes "
                "file does not give: use --preset or --hf-config, or pass --activation-bytes SIZE"
            )
        dims = dims_from_hf_config(args.hf_config) if args.hf_config else preset_dims(args.preset or "gpt2")
        activations = activation_memory(
            dims,
            micro_batch=args.micro_batch or 1,
            seq_len=args.seq_len,
            recompute=args.recompute or Recompute.NONE,
        )
    activation_bytes = activations.total_bytes if activations else args.activation_bytes
    if args.device_memory is not None and activation_bytes is None:
        raise ConfigError(_NEED_ACTIVATIONS)
    return FitSettings(args.device_memory, activation_bytes, activations, args.recommend)


def _traced(args: argparse.Namespace) -> FitSettings:
    """``--trace``: the activations of the ``--hf-config`` model, traced (see [Note: traced activations])."""
    if not args.hf_config or args.seq_len is None:
        raise ConfigError(
            "--trace needs --hf-config PATH and --seq-len N: it runs that model on a micro-batch of "
            "--micro-batch N sequences under fake tensors"
        )
    if args.activation_bytes is not None:
        raise ConfigError("--trace measures the activations: drop --activation-bytes")
    if args.recompute == Recompute.SELECTIVE.value:
        raise ConfigError(
            "--trace runs the model's own code: --recompute full (gradient_checkpointing_enable) or none; "
            "selective recomputation is the formula's assumption (drop --trace for it)"
        )
    import time

    started = time.perf_counter()
    trace = trace_args(args, args.micro_batch or 1)
    return FitSettings(
        args.device_memory, trace.peak_bytes, None, args.recommend, trace, time.perf_counter() - started
    )


def activations_line(settings: FitSettings) -> str:
    """One line saying what the activations are and where they come from."""
    t = settings.trace
    if t is not None:
        where = f"in {t.peak_module!r}" if t.peak_module else "outside the model's modules"
        return (
            f"activations: {gib(t.peak_bytes)} per rank at the most, traced under fake tensors in "
            f"{settings.trace_seconds:.1f} s ({t.peak_phase}, {where})"
        )
    a = settings.activations
    if a is None:
        return f"activations: {gib(settings.activation_bytes or 0)} per rank (--activation-bytes)"
    return (
        f"activations: {gib(a.total_bytes)} per rank (micro-batch {a.micro_batch} x {a.seq_len:,} tokens, "
        f"recompute {a.recompute.value}; Korthikanti et al. 2022), an estimate by formula; --trace "
        "measures a --hf-config model's"
    )


def assess(
    zp: ZeroPlan, report: MemoryReport, settings: FitSettings, trace: ActivationTrace | None = None
) -> FitReport | None:
    """The planned configuration's fit, when ``--device-memory`` was given: with ``trace`` (``--trace``,
    made with ``zp`` where that is exact) the step's timeline, else the activations added."""
    if settings.device_bytes is None:
        return None
    if trace is not None:
        return traced_fit(zp, trace, device_bytes=settings.device_bytes).fit
    return fit_report(
        report, activation_bytes=settings.activation_bytes or 0, device_bytes=settings.device_bytes
    )


def recommendation(
    args: argparse.Namespace,
    specs: tuple[ParamSpec, ...],
    settings: FitSettings,
    known: ActivationTrace | None = None,
) -> Recommendation | None:
    """Run the recommender with the plan options of ``args``, when ``--recommend`` was given (with
    ``--trace``: over the micro-batch too, see [Note: fit options]). ``known``: a trace of
    ``--micro-batch`` already made with some plan, used again if that plan is to be confirmed."""
    if not settings.recommend or settings.device_bytes is None:
        return None
    if settings.trace is None:
        return recommend(
            specs,
            args.world,
            device_bytes=settings.device_bytes,
            activation_bytes=settings.activation_bytes or 0,
            **recommend_options(args),
        )
    asked = args.micro_batch or 1

    def trace_of(micro_batch: int, plan: ZeroPlan | None) -> ActivationTrace:
        if micro_batch == asked and plan is None:
            return settings.trace
        if micro_batch == asked and known is not None and known.plan_fingerprint == plan.fingerprint():
            return known
        return trace_args(args, micro_batch, plan)

    return recommend_micro_batch(
        specs,
        args.world,
        device_bytes=settings.device_bytes,
        micro_batch=asked,
        trace_of=trace_of,
        **recommend_options(args),
    )


def recommend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The recommender's arguments from ``args`` besides the device and activations (the optimizer,
    the topology's nodes, the plan options): also what plans one of its options again."""
    return {
        "optimizer": args.optimizer,
        "ranks_per_node": args.ranks_per_node,
        "strategy": args.strategy,
        "alignment": args.alignment,
        "bucket_bytes": max(1, int(args.bucket_mb * 2**20)),
        "loss_scaling": args.loss_scaling,
        "layout": args.layout,
    }


def trace_args(args: argparse.Namespace, micro_batch: int, plan: ZeroPlan | None = None) -> ActivationTrace:
    """The ``--hf-config`` model's activations on ``micro_batch`` sequences of ``--seq-len``, traced
    (with ``plan``: as that plan's step holds gradients and blocks)."""
    from zeroplan.facade.cli.model_sources import trace_hf_config

    return trace_hf_config(
        args.hf_config,
        args.dtype,
        seq_len=args.seq_len,
        micro_batch=micro_batch,
        recompute=args.recompute == Recompute.FULL.value,
        plan=plan,
    )


def hint(settings: FitSettings) -> str:
    """What would help when nothing fits."""
    a = settings.activations
    if settings.trace is not None:
        smaller = "a smaller --seq-len, or --recompute full"
    elif a is None:
        smaller = "fewer --activation-bytes"
    elif a.recompute is Recompute.FULL:
        smaller = "a smaller --micro-batch or --seq-len"
    else:
        smaller = "--recompute selective or full, a smaller --micro-batch or --seq-len"
    return f"to fit: {smaller} (activations are per rank), or more ranks (--world) to shard the model over"


def update_document(
    document: dict[str, Any], settings: FitSettings, fit: FitReport | None, advice: Recommendation | None
) -> None:
    """Add the fit fields to the ``--json`` document (see the field list in docs/planner.md)."""
    if not settings.active:
        return
    if settings.trace is not None:
        trace = settings.trace.as_dict()
        del trace["points"]
        document["activations"] = {"source": "trace", "total_bytes": settings.trace.peak_bytes, **trace}
    elif settings.activations is not None:
        document["activations"] = {"source": "korthikanti2022", **settings.activations.as_dict()}
    else:
        document["activations"] = {"source": "--activation-bytes", "total_bytes": settings.activation_bytes}
    if fit is None:
        return
    document["device_bytes"] = fit.device_bytes
    document["fit"] = fit.as_dict()
    for record, rank in zip(document["ranks"], fit.ranks, strict=True):
        record.update(rank.as_dict())
    if advice is not None:
        document["recommendation"] = advice.as_dict()


def grid(advice: Recommendation) -> Any:
    """A rich table: for each shard size (rows) and stage (columns), the need and whether it fits."""
    from rich.table import Table

    # Stages without offload first, then (only when nothing fitted without it) each offload mode's.
    modes = ("none", "optimizer", "all")
    columns = sorted({(modes.index(o.offload), o.fit.stage) for o in advice.options})
    device = gib(advice.device_bytes)
    unit, scale = ("GiB", 2**30) if advice.device_bytes >= 2**30 else ("MiB", 2**20)
    what = "the traced step" if advice.traced else "activations"
    batch = f", micro-batch {advice.micro_batch}" if advice.micro_batch is not None else ""
    table = Table(title=f"need per rank with {what} ({unit}) by stage and shard size, device {device}{batch}")
    table.add_column("shard size", justify="right")
    for mode, stage in columns:
        offload = f", offload {modes[mode]}" if mode else ""
        table.add_column(f"stage {stage}{offload}", justify="right")
    cells: dict[tuple[int, int, int], str] = {}
    for o in advice.options:
        if not o.fused and o.offload_fraction is None:  # as given; fused=True and a partial offload: reason
            mark = "fits" if o.fit.fits else "no"
            cells[o.fit.shard_size, modes.index(o.offload), o.fit.stage] = (
                f"{o.fit.need_bytes / scale:,.2f} {mark}"
            )
    for shard in sorted({k for k, _, _ in cells}):
        table.add_row(str(shard), *(cells.get((shard, m, s), "") for m, s in columns))
    return table
