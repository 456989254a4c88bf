"""Does the plan's peak fit the device? Checked once, at construction, before any buffer is allocated.

[Note: device memory check]
On CUDA, ``ZeroOptimizer`` compares the plan's ``peak_bytes`` for this rank
(see [Note: the step's peak] in ``zeroplan.core.peak``) with what the rank
can use: the device's free memory plus the bytes its parameters already hold
(the flat buffers take their place). Activations are not planned, so a plan
that fits here may still run out of memory in the forward; one that does not
fit here certainly will. The message names the largest part of the peak and
the cheapest other configuration that fits (stage, shard group size, a fused
inner optimizer). It is a warning, or, with ``strict_memory=True``, a
``ConfigError`` raised on every rank (inside the plan agreement). CPU memory
is shared by the ranks of a host and is not checked.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from zeroplan.core import (
    ConfigError,
    Implementation,
    RankReport,
    Topology,
    ZeroPlan,
    describe_optimizer,
    memory_report,
)
from zeroplan.facade.registry import Configured

__all__ = ["check_device_memory", "device_memory_problem", "free_bytes"]


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` in bytes, or ``None`` where it is not checked (CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def _largest_part(r: RankReport) -> tuple[str, int]:
    parts = {
        "parameters": r.params_bytes,
        "gradients": r.grads_bytes,
        "fp32 master weights": r.master_bytes,
        "optimizer state": r.optimizer_state_bytes,
        f"{r.peak_phase.value} transients": max(r.backward_transient_bytes, r.step_transient_bytes),
    }
    name = max(parts, key=parts.__getitem__)
    return name, parts[name]


def _fused(groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**g, "fused": True, "foreach": None} for g in groups]


def _alternatives(configured: Configured, rank: int, overlap: bool) -> list[tuple[str, int, int]]:
    """(description, peak bytes of ``rank``, bytes it sends per step) of other configurations."""
    settings, registry, groups = configured.settings, configured.registry, configured.groups
    world = settings.topology.world_size
    name, device = settings.optimizer_name, registry.device.type
    try:
        fused = [describe_optimizer(name, g, strict=False, device=device) for g in _fused(groups)]
        current = [describe_optimizer(name, g, strict=False, device=device) for g in groups]
        can_fuse = all(f.implementation is Implementation.FUSED for f in fused) and any(
            c.implementation is not Implementation.FUSED for c in current
        )
    except ConfigError:  # no fused implementation of this optimizer on this device
        can_fuse = False
    options = []
    for stage in (1, 2):
        for shard in sorted({d for d in range(1, world + 1) if world % d == 0}):
            for fused in (False, True) if can_fuse else (False,):
                topology = Topology(world_size=world, shard_size=shard)
                changed = dataclasses.replace(settings, stage=stage, topology=topology)
                zp = changed.plan(registry, _fused(groups) if fused else groups)
                r = memory_report(zp, overlap=overlap).ranks[rank]
                label = f"stage={stage}, shard_group_size={shard}" + (", fused=True" if fused else "")
                options.append((label, r.peak_bytes, r.comm_bytes_per_step))
    return options


def device_memory_problem(zp: ZeroPlan, configured: Configured, rank: int, *, overlap: bool) -> str | None:
    """What is wrong when ``rank``'s planned peak does not fit its device ([Note: device memory check])."""
    registry = configured.registry
    device = registry.device
    free = free_bytes(device)
    if free is None:
        return None
    held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in registry.params}
    available = free + sum(held.values())
    report = memory_report(zp, overlap=overlap).ranks[rank]
    if report.peak_bytes <= available:
        return None
    part, nbytes = _largest_part(report)
    fitting = [o for o in _alternatives(configured, rank, overlap) if o[1] <= available]
    if fitting:
        label, best, _ = min(fitting, key=lambda o: (o[2], o[1]))  # least traffic, then least memory
        advice = f"{label} would fit, with a planned peak of {_size(best)}"
    else:
        advice = "no stage, shard group size or fused optimizer fits; use more ranks or a smaller model"
    peak, phase = _size(report.peak_bytes), report.peak_phase.value
    return (
        f"rank {rank}: the plan's peak is {peak} (in the {phase}, before activations), but "
        f"{_size(available)} of {device} are available to it; the largest part is the {part} "
        f"({_size(nbytes)}). {advice}"
    )


def check_device_memory(
    zp: ZeroPlan, configured: Configured, world: dist.ProcessGroup, *, overlap: bool, strict: bool
) -> None:
    """Warn, or raise ``ConfigError`` with ``strict``, when ``zp``'s peak does not fit this rank's device.

    See [Note: device memory check]; ``world`` is the data-parallel group.
    """
    problem = device_memory_problem(zp, configured, dist.get_rank(world), overlap=overlap)
    if problem is None:
        return
    if strict:
        raise ConfigError(f"{problem} (strict_memory=True)")
    warnings.warn(problem, ResourceWarning, stacklevel=5)
