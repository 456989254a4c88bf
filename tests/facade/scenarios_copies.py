"""Copy kernels a step launches (``copy_``, ``_foreach_copy_``, ``zero_``), counted by a dispatch mode."""

from __future__ import annotations

from collections import Counter
from typing import Any

from factory import make_optimizer
from models import batch, loss_of, make_model
from torch.utils._python_dispatch import TorchDispatchMode

COPIES = ("copy_", "_foreach_copy_", "zero_", "_foreach_zero_")


class CopyCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in COPIES:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def copies_per_step(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The copies of the second step's backward and ``step()`` (the first creates optimizer state)."""
    model = make_model()
    opt = make_optimizer(
        model, stage=cfg["stage"], bucket_bytes=cfg["bucket_bytes"], collectives="min_bytes", alignment=8
    )
    for step in range(2):
        loss = loss_of(model, *batch(step, rank))
        counter = CopyCounter()
        with counter:
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        opt.wait_for_params()
    pieces = sum(len(space.pieces_of(opt.process_groups.shard_rank)) for space in opt.plan.partition.spaces)
    return {
        "calls": dict(counter.calls),
        "params": len(list(model.parameters())),
        "buckets": len(opt.plan.buckets.buckets),
        "pieces": pieces,
        "param_buckets": sum(len(b.params) for b in opt.plan.buckets.buckets),
    }
