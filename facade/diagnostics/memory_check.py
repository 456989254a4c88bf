"""Does the plan's peak fit the device? Checked once, at construction, before any buffer is allocated.

[Note: device memory check]
On CUDA, ``ZeroOptimizer`` compares the device's share of the plan's peak for
this rank (``device_peak_bytes``: what the plan places in host memory, CPU
offload, is not the device's; see [Note: the step's peak] in ``zeroplan.core.peak``) with what the rank
can use: the device's free memory, plus what torch's caching allocator holds
unused, plus the bytes its parameters already hold (the flat buffers take their
place). Activations are not planned, so a plan that fits here may still run out
of memory in the forward; one that does not fit here certainly will. The
message names the largest part of the peak and the cheapest other
configuration that fits (stage, shard group size, a fused
inner optimizer; offload where nothing fits without it). It is a warning, or, with ``strict_memory=True``, a
``ConfigError`` raised on every rank (inside the plan agreement). CPU memory
is shared by the ranks of a host and is not checked.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from zeroplan.core import ConfigError, RankReport, ZeroPlan, memory_report
from zeroplan.core.sizing.fit import gib
from zeroplan.core.sizing.recommend import recommend
from zeroplan.facade.runtime.registry import Configured

__all__ = ["check_device_memory", "device_memory_problem", "free_bytes"]


def free_bytes(device: torch.device) -> int | None:
    """Memory of ``device`` this process can still allocate, in bytes; ``None`` where not checked (CPU).

    The driver's free memory plus what torch's caching allocator holds but no tensor uses (reserved
    minus allocated): the allocator hands that out again before it asks the driver for more.
    """
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + int(cached)


def _largest_part(r: RankReport) -> tuple[str, int]:
    parts = {
        "parameters": r.params_bytes,
        "gradients": r.grads_bytes,
        "fp32 master weights": r.master_bytes,
        "optimizer state": r.optimizer_state_bytes,
        "staging arena": r.buffer_bytes,
        f"{r.peak_phase.value} transients": max(r.backward_transient_bytes, r.step_transient_bytes),
    }
    name = max(parts, key=parts.__getitem__)
    return name, parts[name]


def _advice(configured: Configured, available: int) -> str:
    """The cheapest executed configuration that fits ``available`` bytes (``core.recommend.recommend``)."""
    settings, groups = configured.settings, configured.groups
    try:
        recommendation = recommend(
            configured.registry.specs(),
            settings.topology.world_size,
            device_bytes=available,
            optimizer=settings.optimizer_name,
            settings=groups[0] if groups else None,  # the implementation (fused, foreach) of the first group
            stages=(1, 2),
            # Offload is advised where nothing fits without it ([Note: offload, executed]).
            **{k: v for k, v in settings.plan_options().items() if k not in ("offload", "offload_fraction")},
        )
    except ConfigError as exc:  # e.g. an optimizer zeroplan has no description of
        return f"no advice on other configurations ({exc})"
    best = recommendation.best
    if best is None:
        return "no stage 1 or 2 configuration fits; use more ranks or a smaller model"
    return f"{best.label} would fit, with a planned peak of {gib(best.fit.need_bytes)}"


def device_memory_problem(zp: ZeroPlan, configured: Configured, rank: int) -> str | None:
    """What is wrong when ``rank``'s planned peak does not fit its device ([Note: device memory check])."""
    registry = configured.registry
    device = registry.device
    free = free_bytes(device)
    if free is None:
        return None
    held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in registry.params}
    available = free + sum(held.values())
    report = memory_report(zp).ranks[rank]
    if report.device_peak_bytes <= available:  # what the plan places in host memory is not the device's
        return None
    part, nbytes = _largest_part(report)
    advice = _advice(configured, available)
    peak, phase = gib(report.device_peak_bytes), report.peak_phase.value
    return (
        f"rank {rank}: the plan's peak is {peak} (in the {phase}, before activations), but "
        f"{gib(available)} of {device} are available to it; the largest part is the {part} "
        f"({gib(nbytes)}). {advice}"
    )


def check_device_memory(
    zp: ZeroPlan, configured: Configured, world: dist.ProcessGroup, *, strict: bool
) -> None:
    """Warn, or raise ``ConfigError`` with ``strict``, when ``zp``'s peak does not fit this rank's device.

    See [Note: device memory check]; ``world`` is the data-parallel group.
    """
    problem = device_memory_problem(zp, configured, dist.get_rank(world))
    if problem is None:
        return
    if strict:
        raise ConfigError(f"{problem} (strict_memory=True)")
    warnings.warn(problem, ResourceWarning, stacklevel=5)
