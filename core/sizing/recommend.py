# zeroplan.core — pure planning: no torch, no I/O.
# Which configuration is the cheapest that fits a device?
"""The cheapest configuration that fits each rank's device (see :mod:`zeroplan.core.sizing.fit` for the fit).

[Note: the cheapest configuration]
:func:`recommend` plans stages 1, 2 and 3 at every shard size that divides the
world (all divisors: each is a valid :class:`~zeroplan.core.topology.Topology`
and a world has few), with the inner optimizer as given and, where torch has a
fused kernel for it, with ``fused=True`` added (no step temporaries). Among the
configurations in which every rank fits, the cheapest sends the fewest bytes
per step (the busiest rank's ``comm_bytes_per_step``; within
:data:`TRAFFIC_TOLERANCE` of the fewest counts as fewest, because stages 1 and
2 send ``2M(1 - 1/world)`` at every shard size, up to a few bytes of padding),
then needs the least memory (the busiest rank), then has the lower stage, the
optimizer as given, and the smaller shard group. Stage 3 sends more than
stages 1 and 2, so it is chosen only when they do not fit.

When nothing fits on the device, it assesses CPU offload too
([Note: offload, planned]): ``offload="optimizer"`` at every stage and ``offload="all"`` at
stage 3, the masters, optimizer state and gradient shard (and the parameter
shards) in host memory. These options come after every other: among them, the
one that moves fewer bytes over the host link (``"optimizer"``) first. Where
``"optimizer"`` fits, a partial offload may too ([Note: kept on the device]):
the smallest of :data:`OFFLOAD_FRACTIONS` that fits (the most kept on the
device) is an option of its own, which moves fewer bytes over the host link
and so comes first.

With traced activations (``trace``: [Note: traced activations]) each
configuration's need is its step's timeline ([Note: one timeline],
:func:`~zeroplan.core.sizing.trace.traced_fit`), not the activations' peak added
to the backward's. The trace is made once, without a plan, for every
configuration: where gradients arrive out of bucket order, and at stage 3, the
timeline is then an estimate (over, or at stage 3 with activation
checkpointing possibly under), so ``confirm`` traces the cheapest that fits
again with its own plan, which is exact, and replaces its fit, until the
cheapest is exact (one that no longer fits makes way for the next;
configurations whose estimate does not fit are not traced again, which is
conservative). :func:`recommend_micro_batch` also chooses the
micro-batch: the largest of the one asked for and its halvings at which some
configuration fits, traced as it goes (a smaller micro-batch keeps the batch
with gradient accumulation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from zeroplan.core.errors import ConfigError, check_config, require
from zeroplan.core.memory import MemoryReport, memory_report
from zeroplan.core.offload import Offload
from zeroplan.core.optim.implementations import Implementation
from zeroplan.core.optim.optimizers import OptimizerSpec, describe_optimizer
from zeroplan.core.planner import Stage, ZeroPlan, plan
from zeroplan.core.sizing.fit import FitReport, fit_report, gib, stage_label
from zeroplan.core.sizing.trace import ActivationTrace, traced_fit
from zeroplan.core.specs import ParamSpec
from zeroplan.core.topology import Topology

__all__ = [
    "OFFLOAD_FRACTIONS",
    "TRAFFIC_TOLERANCE",
    "Option",
    "Recommendation",
    "option_plan",
    "recommend",
    "recommend_micro_batch",
    "shard_sizes",
]

#: Relative difference in bytes per step below which two configurations count as sending the same.
TRAFFIC_TOLERANCE = 1e-3


def shard_sizes(world_size: int) -> tuple[int, ...]:
    """Every shard-group size of ``world_size`` ranks: its divisors, ascending.

    Example:
        >>> shard_sizes(24)
        (1, 2, 3, 4, 6, 8, 12, 24)
    """
    check_config(
        type(world_size) is int and world_size >= 1, f"world size must be an int >= 1, got {world_size!r}"
    )
    small = [d for d in range(1, int(world_size**0.5) + 1) if world_size % d == 0]
    return tuple(sorted({*small, *(world_size // d for d in small)}))


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """One configuration the recommender assessed.

    Attributes:
        fit: its fit (stage, shard size, need, traffic).
        optimizer: the inner optimizer's name.
        implementation: how torch steps it.
        fused: whether the recommender added ``fused=True`` to the optimizer's settings.
        exact: its fit is exact: read off a step traced with its own plan, or off one traced
            without a plan where that is exact (with the formula or given activation bytes: the
            backward's transient and the activations are added, an estimate, ``False``).
        offload: its CPU offload mode (``"none"``, ``"optimizer"``, ``"all"``; [Note: offload, planned]).
        host_link_bytes: with offload, the busiest rank's bytes per step over the host link, both ways.
        offload_fraction: with ``"optimizer"``, the share of the optimizer's elements in host memory
            (``None``: all; [Note: kept on the device]).
    """

    fit: FitReport
    optimizer: str
    implementation: Implementation
    fused: bool = False
    exact: bool = False
    offload: str = Offload.NONE.value
    host_link_bytes: int = 0
    offload_fraction: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload", Offload.parse(self.offload).value)
        require(
            self.offload_fraction is None or self.offload == Offload.OPTIMIZER.value,
            f"an option with offload_fraction={self.offload_fraction} offloads 'optimizer', "
            f"not {self.offload!r}",
        )

    @property
    def label(self) -> str:
        """``"stage 2 with shard groups of 8"``, with ``AdamW(fused=True)`` when fused was added,
        ``offload optimizer`` with CPU offload and ``(offload_fraction=0.5)`` with a partial one."""
        text = f"{stage_label(self.fit.stage)} with shard groups of {self.fit.shard_size}"
        text = f"{text}, {self.optimizer}(fused=True)" if self.fused else text
        text = text if self.offload == Offload.NONE.value else f"{text}, offload {self.offload}"
        return (
            text if self.offload_fraction is None else f"{text} (offload_fraction={self.offload_fraction:g})"
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (``offload`` only for an option with offload)."""
        record = {
            **self.fit.as_dict(),
            "optimizer": self.optimizer,
            "implementation": self.implementation.value,
            "fused": self.fused,
            "exact": self.exact,
        }
        if self.offload != Offload.NONE.value:
            record["offload"] = self.offload
            record["host_link_bytes"] = self.host_link_bytes
        if self.offload_fraction is not None:
            record["offload_fraction"] = self.offload_fraction
        return record


#: The partial offloads assessed where ``offload="optimizer"`` fits, the most kept on the device first
#: ([Note: kept on the device]).
OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75)

#: Offload modes in the recommender's order of preference: fewer bytes over the host link first.
_OFFLOADS = tuple(m.value for m in (Offload.NONE, Offload.OPTIMIZER, Offload.ALL))


def _cost(option: Option, least_traffic: int) -> tuple[int, ...]:
    """Sort key of [Note: the cheapest configuration], for options that fit."""
    same = option.fit.comm_bytes_per_step <= least_traffic * (1 + TRAFFIC_TOLERANCE)
    return (
        0 if same else option.fit.comm_bytes_per_step,
        _OFFLOADS.index(option.offload),
        option.host_link_bytes,
        option.fit.need_bytes,
        option.fit.stage,
        int(option.fused),
        option.fit.shard_size,
    )


def _cheapest(options: Sequence[Option]) -> Option | None:
    fitting = [o for o in options if o.fit.fits]
    if not fitting:
        return None
    least = min(o.fit.comm_bytes_per_step for o in fitting)
    return min(fitting, key=lambda o: _cost(o, least))


def _explain(best: Option | None, options: Sequence[Option], device: int, activations: int) -> str:
    """The reason of a recommendation: what the choice needs, and why not each other stage."""
    if best is None:
        least = min(options, key=lambda o: (o.fit.need_bytes, o.fit.comm_bytes_per_step))
        text = (
            f"nothing fits in {gib(device)}: the least any configuration needs is "
            f"{gib(least.fit.need_bytes)} ({least.label}), {gib(least.fit.need_bytes - device)} more"
        )
        if activations:
            text += f"; the activations take {gib(activations)} of it"
        return text
    fit = best.fit
    text = (
        f"{best.label}: fits with {gib(fit.worst.spare_bytes)} to spare (needs {gib(fit.need_bytes)} of "
        f"{gib(device)}, at the {fit.worst.phase.value}), sending {gib(fit.comm_bytes_per_step)} per step"
    )
    same_place = [
        o
        for o in options
        if o.fit.stage == fit.stage and o.fit.shard_size == fit.shard_size and o.fused != best.fused
    ]
    if best.fused and same_place:
        saved = same_place[0].fit.need_bytes - fit.need_bytes
        text += f"; fused=True saves {gib(saved)} over {same_place[0].implementation.value}"
    elif same_place:
        text += f"; fused=True does not lower its peak ({fit.worst.phase.value})"
    if best.offload != Offload.NONE.value:
        text += "; nothing fits without offload"
    options = [o for o in options if o.offload == best.offload]
    least = min(o.fit.comm_bytes_per_step for o in options if o.fit.fits)
    for stage in sorted({o.fit.stage for o in options} - {fit.stage}):
        mine = [o for o in options if o.fit.stage == stage]
        other = _cheapest(mine)
        if other is None:
            smallest = min(mine, key=lambda o: o.fit.need_bytes)
            text += (
                f"; {stage_label(stage)} does not fit (needs {gib(smallest.fit.need_bytes)} at the least, "
                f"with shard groups of {smallest.fit.shard_size})"
            )
        elif _cost(other, least)[0]:
            text += (
                f"; {stage_label(stage)} fits but sends {gib(other.fit.comm_bytes_per_step)} per step "
                f"(shard groups of {other.fit.shard_size})"
            )
        else:
            text += (
                f"; {stage_label(stage)} fits too but needs {gib(other.fit.need_bytes)} "
                f"(shard groups of {other.fit.shard_size})"
            )
    return text


@dataclass(frozen=True, slots=True, kw_only=True)
class Recommendation:
    """The cheapest configuration that fits, and every one assessed (see [Note: the cheapest configuration]).

    Attributes:
        device_bytes: the device's memory.
        activation_bytes: activations of one rank's micro-batch.
        options: every configuration assessed.
        traced: whether each need is a traced step's timeline (else the activations are added).
        micro_batch: the micro-batch chosen (:func:`recommend_micro_batch`), or ``None``.
        tried: the micro-batches assessed before it, larger first (nothing fitted at them).
        best: the cheapest that fits, or ``None`` (derived).
        reason: why, in one line (derived).
    """

    device_bytes: int
    activation_bytes: int
    options: tuple[Option, ...]
    traced: bool = False
    micro_batch: int | None = None
    tried: tuple[int, ...] = ()
    best: Option | None = field(init=False)
    reason: str = field(init=False)

    def __post_init__(self) -> None:
        check_config(len(self.options) >= 1, "a recommendation needs at least one option")
        require(
            all(
                o.fit.device_bytes == self.device_bytes and o.fit.activation_bytes == self.activation_bytes
                for o in self.options
            ),
            "the options of a recommendation were assessed for other device memory or activations",
        )
        check_config(
            self.micro_batch is None or (type(self.micro_batch) is int and self.micro_batch >= 1),
            f"Recommendation.micro_batch must be an int >= 1, got {self.micro_batch!r}",
        )
        check_config(
            not self.tried
            or (
                self.micro_batch is not None
                and all(a > b for a, b in zip(self.tried, (*self.tried[1:], self.micro_batch), strict=True))
            ),
            f"Recommendation.tried must be larger micro-batches than {self.micro_batch!r}, largest first, "
            f"got {self.tried!r}",
        )
        best = _cheapest(self.options)
        object.__setattr__(self, "best", best)
        reason = _explain(best, self.options, self.device_bytes, self.activation_bytes)
        if self.micro_batch is not None:
            fits = "fits" if best is not None else "fits either"
            reason = f"micro-batch {self.micro_batch}: {reason}"
            if self.tried:
                reason += f" (nothing {fits} at micro-batch {', '.join(map(str, self.tried))})"
        object.__setattr__(self, "reason", reason)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (the CLI's ``--json`` ``recommendation``)."""
        return {
            "best": None if self.best is None else self.best.as_dict(),
            "reason": self.reason,
            "traced": self.traced,
            "micro_batch": self.micro_batch,
            "tried_micro_batches": list(self.tried),
            "options": [o.as_dict() for o in self.options],
        }


def recommend(
    specs: Sequence[ParamSpec],
    world_size: int,
    *,
    device_bytes: int,
    activation_bytes: int = 0,
    optimizer: str = "AdamW",
    settings: Mapping[str, Any] | None = None,
    ranks_per_node: int | None = None,
    stages: Sequence[int] = (1, 2, 3),
    trace: ActivationTrace | None = None,
    confirm: Callable[[ZeroPlan], ActivationTrace] | None = None,
    offload: bool = True,
    **plan_options: Any,
) -> Recommendation:
    """The cheapest configuration of ``specs`` on ``world_size`` ranks that fits each device.

    See [Note: the cheapest configuration].

    Args:
        specs: the parameters.
        world_size: data-parallel ranks.
        device_bytes: memory of each rank's device.
        activation_bytes: activations of one rank's micro-batch (see
            :func:`~zeroplan.core.sizing.activations.activation_memory`).
        optimizer: the inner optimizer's name.
        settings: its settings (read by :func:`~zeroplan.core.optim.optimizers.describe_optimizer`).
        ranks_per_node: for the topology.
        stages: the stages to assess.
        trace: traced activations of one micro-batch, made without a plan: each configuration's need
            is then its step's timeline, and ``activation_bytes`` is the trace's peak.
        confirm: with ``trace``, traces the same micro-batch with a configuration's plan: called
            for the cheapest that fits while its fit is not exact, until the cheapest is (a fit
            traced without a plan may be under at stage 3: [Note: the cheapest configuration]).
        offload: when nothing fits, assess CPU offload too ([Note: offload, planned]).
        **plan_options: more arguments of :func:`~zeroplan.core.planner.plan`
            (``strategy``, ``alignment``, ``bucket_bytes``, ``loss_scaling``, ...).

    Raises:
        ConfigError: a bad argument (as :func:`~zeroplan.core.planner.plan` raises).

    Example:
        >>> from zeroplan.core import specs_from_shapes
        >>> specs = specs_from_shapes([(4096, 4096)] * 8, dtype="bf16")
        >>> r = recommend(specs, 4, device_bytes=1000 * 2**20)
        >>> r.best.label
        'stage 2 with shard groups of 4, AdamW(fused=True)'
        >>> print(r.reason.replace("; ", ";\\n"))
        stage 2 with shard groups of 4, AdamW(fused=True): fits with 105.5 MiB to spare (needs 894.5 MiB ...
        fused=True saves 64.0 MiB over foreach;
        stage 1 does not fit (needs 1.05 GiB at the least, with shard groups of 4);
        stage 3 fits but sends 576.0 MiB per step (shard groups of 4)
        >>> recommend(specs, 4, device_bytes=2**29, activation_bytes=2**26, offload=False).reason
        'nothing fits in 512.0 MiB: the least any configuration needs is 816.0 MiB (stage 3 ...'
        >>> recommend(specs, 4, device_bytes=2**29, activation_bytes=2**26).best.label
        'stage 2 with shard groups of 4, offload optimizer'
        >>> recommend(specs, 4, device_bytes=800 * 2**20, activation_bytes=2**26).best.label
        'stage 2 with shard groups of 4, offload optimizer (offload_fraction=0.5)'
    """
    check_config(
        all(s in (Stage.OPTIMIZER, Stage.GRADIENTS, Stage.PARAMETERS) for s in stages) and stages,
        f"the recommender assesses stages 1, 2 and 3, got {tuple(stages)!r}",
    )
    check_config(confirm is None or trace is not None, "confirm needs a trace: it confirms traced fits")
    if trace is not None:
        check_config(
            not trace.plan_fingerprint,
            "the recommender needs activations traced without a plan (each configuration is its own plan)",
        )
        check_config(
            activation_bytes == 0,
            "pass activation_bytes or a trace, not both: the trace gives the activations",
        )
        activation_bytes = trace.peak_bytes
    variants = [(describe_optimizer(optimizer, settings), False)]
    if variants[0][0].implementation is not Implementation.FUSED:
        try:
            variants.append((describe_optimizer(optimizer, {**(settings or {}), "fused": True}), True))
        except ConfigError:
            pass  # no fused kernel for this optimizer (or settings that exclude it)
    options: list[Option] = []
    modes = [Offload.NONE]
    while modes:
        mode = modes.pop(0)
        for stage in stages:
            if mode is Offload.ALL and stage != Stage.PARAMETERS:
                continue
            for shard in shard_sizes(world_size):
                for spec, fused in variants:
                    zp = _plan_of(specs, world_size, stage, shard, spec, ranks_per_node, plan_options, mode)
                    exact = False
                    report = memory_report(zp) if trace is None or mode is not Offload.NONE else None
                    if report is not None and trace is None:
                        fit = fit_report(report, activation_bytes=activation_bytes, device_bytes=device_bytes)
                    else:
                        fit, exact = traced_fit(zp, trace, device_bytes=device_bytes)
                    option = Option(
                        fit=fit,
                        optimizer=spec.name,
                        implementation=spec.implementation,
                        fused=fused,
                        exact=exact,
                        offload=mode.value,
                        host_link_bytes=0 if report is None else _host_link_bytes(report),
                    )
                    options.append(option)
                    if mode is Offload.OPTIMIZER and fit.fits:  # [Note: kept on the device]
                        assess = partial(_assessed, activation_bytes, device_bytes, trace)
                        plan_of = partial(_plan_of, specs, world_size, stage, shard, spec, ranks_per_node)
                        kept = _partial_offload(option, plan_of, plan_options, assess)
                        options += [kept] if kept is not None else []
        if mode is Offload.NONE and offload and not any(o.fit.fits for o in options):
            modes = [Offload.OPTIMIZER, Offload.ALL]  # nothing fits on the device: [Note: offload, planned]
    if trace is not None and confirm is not None:
        _confirm(options, confirm, specs, world_size, settings, ranks_per_node, plan_options)
    return Recommendation(
        device_bytes=device_bytes,
        activation_bytes=activation_bytes,
        options=tuple(options),
        traced=trace is not None,
    )


def _assessed(
    activation_bytes: int, device_bytes: int, trace: ActivationTrace | None, zp: ZeroPlan
) -> tuple[FitReport, bool, int]:
    """An offloaded plan's fit, whether it is exact, and its busiest rank's bytes over the host link."""
    report = memory_report(zp)
    if trace is None:
        fit, exact = fit_report(report, activation_bytes=activation_bytes, device_bytes=device_bytes), False
    else:
        fit, exact = traced_fit(zp, trace, device_bytes=device_bytes)
    return fit, exact, _host_link_bytes(report)


def _partial_offload(
    full: Option,
    plan_of: Callable[..., ZeroPlan],
    plan_options: Mapping[str, Any],
    assess: Callable[[ZeroPlan], tuple[FitReport, bool, int]],
) -> Option | None:
    """The partial offload of ``full``'s configuration that keeps the most on the device and fits (the
    smallest of :data:`OFFLOAD_FRACTIONS`), or ``None``."""
    for fraction in OFFLOAD_FRACTIONS:
        zp = plan_of({**plan_options, "offload_fraction": fraction}, Offload.OPTIMIZER)
        fit, exact, link = assess(zp)
        if fit.fits:
            return replace(full, fit=fit, exact=exact, host_link_bytes=link, offload_fraction=fraction)
    return None


def _host_link_bytes(report: MemoryReport) -> int:
    """The busiest rank's bytes per step over the host link, both ways (0 with nothing offloaded)."""
    return max((sum(r.host_link[:2]) for r in report.ranks if r.host_link is not None), default=0)


def _confirm(
    options: list[Option],
    confirm: Callable[[ZeroPlan], ActivationTrace],
    specs: Sequence[ParamSpec],
    world_size: int,
    settings: Mapping[str, Any] | None,
    ranks_per_node: int | None,
    plan_options: Mapping[str, Any],
) -> None:
    """Trace the cheapest fitting option again with its plan while it is not exact, once each, and
    replace its fit (in place, keeping the activations every other option was read off)."""
    confirmed: set[int] = set()
    traces: dict[str, ActivationTrace] = {}  # by plan fingerprint: fused twins share their trace
    while (best := _cheapest(options)) is not None and not best.exact:
        at = options.index(best)
        if at in confirmed:  # traced with its plan and still not exact
            return
        confirmed.add(at)
        zp = option_plan(
            specs, world_size, best, settings=settings, ranks_per_node=ranks_per_node, **plan_options
        )
        fingerprint = zp.fingerprint()
        if fingerprint not in traces:
            traces[fingerprint] = confirm(zp)
            check_config(
                traces[fingerprint].plan_fingerprint == fingerprint,
                "confirm(plan) must trace with that plan (trace_activations(..., plan=plan))",
            )
        fit, exact = traced_fit(zp, traces[fingerprint], device_bytes=best.fit.device_bytes)
        options[at] = replace(best, fit=replace(fit, activation_bytes=best.fit.activation_bytes), exact=exact)


def _plan_of(
    specs: Sequence[ParamSpec],
    world_size: int,
    stage: int,
    shard: int,
    spec: OptimizerSpec,
    ranks_per_node: int | None,
    plan_options: Mapping[str, Any],
    offload: Offload = Offload.NONE,
) -> ZeroPlan:
    topology = Topology(world_size=world_size, shard_size=shard, ranks_per_node=ranks_per_node)
    extra = {} if offload is Offload.NONE else {"offload": offload}
    return plan(specs, topology, stage=stage, optimizer=spec, **plan_options, **extra)


def option_plan(
    specs: Sequence[ParamSpec],
    world_size: int,
    option: Option,
    *,
    settings: Mapping[str, Any] | None = None,
    ranks_per_node: int | None = None,
    **plan_options: Any,
) -> ZeroPlan:
    """The plan of one configuration :func:`recommend` assessed (the same ``specs``, ``world_size``,
    optimizer ``settings`` and ``plan_options``): to check it further, or to run it."""
    extra = {"fused": True} if option.fused else {}
    spec = describe_optimizer(option.optimizer, {**(settings or {}), **extra})
    fraction = {} if option.offload_fraction is None else {"offload_fraction": option.offload_fraction}
    return _plan_of(
        specs,
        world_size,
        option.fit.stage,
        option.fit.shard_size,
        spec,
        ranks_per_node,
        {**plan_options, **fraction},
        Offload(option.offload),
    )


def recommend_micro_batch(
    specs: Sequence[ParamSpec],
    world_size: int,
    *,
    device_bytes: int,
    micro_batch: int,
    trace_of: Callable[[int, ZeroPlan | None], ActivationTrace],
    **options: Any,
) -> Recommendation:
    """:func:`recommend` with traced activations at ``micro_batch``, then at its halvings down to 1
    until some configuration fits: the largest micro-batch that fits, and the cheapest configuration
    at it (see [Note: the cheapest configuration]).

    Args:
        micro_batch: the most sequences per rank wanted.
        trace_of: traces the activations of a micro-batch of that many sequences, without a plan
            (``None``: once per micro-batch assessed, largest first) or with one (to confirm the
            cheapest configuration that fits, as :func:`recommend`'s ``confirm``).
        **options: :func:`recommend`'s other arguments (``offload`` is assessed at micro-batch 1
            only: a smaller micro-batch is preferred to CPU offload).

    Example:
        >>> from zeroplan.core import specs_from_shapes
        >>> from zeroplan.core.sizing.trace import ActivationTrace, TracePhase, TracePoint
        >>> specs = specs_from_shapes([(1024, 1024)] * 4, dtype="bf16")
        >>> names = tuple(s.name for s in specs)
        >>> def trace_of(batch, plan):   # a stand-in: 4 MiB per sequence, freed as gradients arrive
        ...     a = batch * 2**22
        ...     grads = (TracePoint(TracePhase.BACKWARD, n, "grad", a * i // 4) for i, n in enumerate(names))
        ...     points = (TracePoint(TracePhase.FORWARD, "", "exit", a), *grads)
        ...     held = "" if plan is None else plan.fingerprint()   # "traced with the plan" (the same here)
        ...     return ActivationTrace(points=points, peak_bytes=a, peak_phase=TracePhase.FORWARD,
        ...                            peak_module="", forward_peak_bytes=a, params=names,
        ...                            plan_fingerprint=held)
        >>> r = recommend_micro_batch(specs, 2, device_bytes=64 * 2**20, micro_batch=8, trace_of=trace_of)
        >>> r.micro_batch, r.tried, r.best.label
        (2, (8, 4), 'stage 1 with shard groups of 2, AdamW(fused=True)')
    """
    check_config(
        type(micro_batch) is int and micro_batch >= 1, f"micro_batch must be an int >= 1, got {micro_batch!r}"
    )
    tried: list[int] = []
    batch = micro_batch
    offload = options.pop("offload", True)  # a last resort, after the halvings: at micro-batch 1
    while True:
        advice = recommend(
            specs, world_size, device_bytes=device_bytes, trace=trace_of(batch, None),
            confirm=partial(trace_of, batch), offload=offload and batch == 1, **options,
        )  # fmt: skip
        if advice.best is not None or batch == 1:
            return replace(advice, micro_batch=batch, tried=tuple(tried))
        tried.append(batch)
        batch //= 2
