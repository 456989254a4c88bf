"""zeroplan's imperative shell: the sharded optimizer, collectives and checkpoints.

The command line (``zeroplan plan``, ``zeroplan demo`` and the demo's GPT) is the
subpackage :mod:`zeroplan.facade.cli`; the Hugging Face ``ZeroTrainer`` is
:mod:`zeroplan.facade.hf` (needs ``transformers``). ``ZeroOptimizer`` and friends
import torch; they are loaded on first access so that ``zeroplan plan``, which
imports this package, starts quickly.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MeasuredMemory", "ZeroOptimizer", "broadcast_buffers"]


def __getattr__(name: str) -> Any:
    if name in ("ZeroOptimizer", "MeasuredMemory"):
        from zeroplan.facade.runtime import optimizer

        return getattr(optimizer, name)
    if name == "broadcast_buffers":
        from zeroplan.facade.params import module_buffers

        return module_buffers.broadcast_buffers
    raise AttributeError(f"module 'zeroplan.facade' has no attribute {name!r}")
