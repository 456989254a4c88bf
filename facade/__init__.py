"""zeroplan's imperative shell: the sharded optimizer, collectives and checkpoints.

The command line (``zeroplan plan``, ``zeroplan demo`` and the demo's GPT) is the
subpackage :mod:`zeroplan.facade.cli`; the Hugging Face ``ZeroTrainer`` is
:mod:`zeroplan.facade.hf` (needs ``transformers``); the stage for torch's pipeline schedules is
:mod:`zeroplan.facade.pipelining`. ``ZeroOptimizer`` and friends
import torch; they are loaded on first access so that ``zeroplan plan``, which
imports this package, starts quickly.

[Note: facade layers]
The facade is layered, every import pointing down (a test fails on one that
points up, ``TYPE_CHECKING`` imports included):

0. ``mechanisms``: collectives and streams, the wire codec, process groups,
   torch dtypes, dynamo guards, the agreement of ranks, micro-batch sums and
   the exact norm. They know tensors and process groups, not the optimizer.
1. ``params``: the flat buffers parameters view, the gather after ``step()``,
   stage 3's blocks and module hooks.
2. ``state``: the inner optimizer over the shards and its state, state dicts,
   parked state, restoring validated state.
3. ``runtime`` (the step: ``ZeroOptimizer``, domains, the joint step, the
   lifecycle, gradient sync, construction), with its services ``checkpoint``
   and ``diagnostics``, which may import each other.
4. the entry points: ``cli``, ``hf``, ``pipelining`` and this package.

A new module goes in the lowest layer whose modules it needs.
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
