"""A training step's peak memory measured by torch's ``MemTracker``, next to the plan's ``peak_bytes``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from zeroplan.core import memory_report
from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.diagnostics.meter import step_peaks, tracked_bytes

#: A Linear stack: activations (batch x width per layer) are under 1% of the parameters' bytes.
WIDTH, DEPTH, BATCH = 192, 6, 2


def step_peak(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The tracker is entered before the model exists, so it sees every storage of the rank; it is
    re-entered around each whole step (forward, backward, ``step()``, ``zero_grad()``), which
    restarts its peak. The third step's peak is compared: by then optimizer state exists."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg["dtype"]]
    inner = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[cfg["optimizer"]]
    tracker = MemTracker()
    with tracker:
        torch.manual_seed(0)
        layers = [nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]
        if cfg.get("reverse_forward"):  # registered first, used last: gradients arrive in plan order
            model = _Reversed(layers).to(dtype)
        else:
            model = nn.Sequential(*layers).to(dtype)
        opt = ZeroOptimizer(
            model.parameters(),
            inner,
            stage=cfg["stage"],
            shard_group_size=cfg.get("shard"),
            bucket_bytes=cfg.get("bucket_bytes", 40_000),
            alignment=16,
            collectives=cfg.get("collectives", "auto"),
            overlap_grad_reduce=cfg.get("overlap", True),
            loss_scale="dynamic" if dtype == torch.float16 else None,
            reshard_after_forward=cfg.get("reshard", True),
            deterministic=cfg.get("deterministic", False),
            reduce_dtype=cfg.get("wire"),
            gather_dtype=cfg.get("gather"),
            wire_block=16,
            offload=cfg.get("offload"),
            offload_fraction=cfg.get("fraction"),
            **cfg.get("hyper", {"lr": 1e-3}),
        )
        opt.attach(model)  # stage 3: the forward gathers what it uses (a no-op at stages 1 and 2)
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank)).to(dtype)

    def step() -> None:
        loss = model(x).float().square().mean()
        opt.backward(loss)
        del loss
        if cfg.get("clip"):
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    peaks = step_peaks(tracker, step, 3)
    report = opt.memory_report(clipping=bool(cfg.get("clip"))).ranks[opt.process_groups.rank]
    assumed = memory_report(opt.plan).ranks[opt.process_groups.rank]  # the plan holds its options
    return {
        "measured": peaks,
        "planned": report.peak_bytes,
        "phase": report.peak_phase.value,
        "persistent": tracked_bytes(tracker),
        "planned_in_reverse_order": assumed.peak_bytes,
    }


class _Reversed(nn.Module):
    """Linear layers applied in the reverse of their registration order."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = layer(x)
        return x


def construction_peak(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Stage 3's construction, measured: the tracker's peak while ``ZeroOptimizer`` is built, above
    what the model held just before, next to the plan's parameter shard and its largest block.

    The tracker is entered before the model exists (it sees every storage) and re-entered around the
    construction (which restarts its peak)."""
    tracker = MemTracker()
    with tracker:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))
    before = tracked_bytes(tracker, "current")
    with tracker:
        opt = ZeroOptimizer(
            model.parameters(), torch.optim.AdamW, stage=3, bucket_bytes=cfg["bucket_bytes"], alignment=16
        )
        peak = tracked_bytes(tracker, "peak")
    report = opt.memory_report().ranks[opt.process_groups.rank]
    blocks = [b.numel * 4 for s in opt.plan.partition.spaces for b in s.blocks]
    return {
        "model_bytes": sum(p.numel() * 4 for p in model.parameters()),
        "before": before,
        "extra": peak - before,
        "shard": report.params_bytes,
        "largest_block": max(blocks),
        "blocks": len(blocks),
    }
