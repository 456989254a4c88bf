"""Memory measured by torch's ``MemTracker``: the meter the plan's ``peak_bytes`` is checked against.

The tests (``tests/facade/test_peak.py``, ``test_inner_temporaries.py``) and the benchmarks
(``benchmarks/peak_memory.py``, ``optimizer_temporaries.py``) measure through these functions, so they
read the meter one way. ``MemTracker`` counts only storages created (or registered with
``track_external``) while it is entered, and restarts its peak each time it is entered.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

__all__ = ["step_peaks", "step_temporaries", "tracked_bytes"]


def tracked_bytes(tracker: MemTracker, kind: str = "current") -> int:
    """Bytes ``tracker`` counts now (``"current"``) or at its peak (``"peak"``), over all devices."""
    return sum(snap["Total"] for snap in tracker.get_tracker_snapshot(kind).values())


def step_peaks(tracker: MemTracker, step: Callable[[], None], steps: int) -> list[int]:
    """Run ``step`` ``steps`` times, ``tracker`` re-entered around each; the peak of each.

    Enter ``tracker`` before the model is built, so that it sees every storage.
    """
    peaks = []
    for _ in range(steps):
        tracker.reset_mod_stats()  # it refuses a module's second forward otherwise
        with tracker:
            step()
            peaks.append(tracked_bytes(tracker, "peak"))
    return peaks


def step_temporaries(
    cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    shapes: Sequence[tuple[int, ...]],
    *,
    dtype: torch.dtype = torch.float32,
    warmup: int = 2,
) -> int:
    """Bytes of temporaries of one ``step()`` of ``cls(**kwargs)`` on fresh tensors of ``shapes``.

    After ``warmup`` steps (the state exists), parameters, gradients and state are registered with
    the tracker: it counts every tensor an operator *returns*, ``param.add_()`` included, so
    unregistered inputs would count as allocations. The result is the peak of one ``step()`` minus
    what the tracker held on entry.
    """
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Muon: "learning rate adjustment"; MemTracker's own
        opt = cls(params, **kwargs)
        for step in range(warmup + 1):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
            if step < warmup:
                opt.step()
        tracker = MemTracker()
        tracker.track_external(*params, *(p.grad for p in params), opt)
        entry = tracked_bytes(tracker)
        with tracker:
            opt.step()
    return tracked_bytes(tracker, "peak") - entry
