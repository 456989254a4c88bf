"""The construction-time device memory check, with the free-memory probe replaced (no GPU here)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from models import make_model

from zeroplan.core import ConfigError
from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.diagnostics import memory_check


def construct(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank ``cfg["short_rank"]`` sees ``cfg["free"]`` bytes free (the device's memory); others see plenty."""
    model = make_model()
    free = cfg["free"] if rank == cfg["short_rank"] else 2**40
    probe = memory_check.free_bytes

    def fake_probe(device: torch.device) -> int:
        if free == "raise":
            raise RuntimeError("the free-memory probe failed")
        return free

    memory_check.free_bytes = fake_probe
    before = [p.detach().clone() for p in model.parameters()]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ZeroOptimizer(
                model.parameters(),
                torch.optim.AdamW,
                stage=cfg.get("stage", 1),
                strict_memory=cfg["strict"],
                bucket_bytes=4096,
                alignment=8,
                lr=1e-3,
                **cfg.get("settings", {}),
            )
        error = None
    except (ConfigError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        memory_check.free_bytes = probe
    return {
        "error": error,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)],
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)),
    }
