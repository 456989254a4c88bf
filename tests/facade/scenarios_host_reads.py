"""Host reads of tensors (``item``, ``tolist``, ``bool``, ``int``, ``float``) made during a step.

On a GPU each read waits for every kernel queued before it, so a read inside backward or ``step()``
stalls the pipeline; the tests hold zeroplan to a budget per step. Counted on CPU with a
``TorchFunctionMode``, which sees every such call on any tensor, attributed to the line in
zeroplan's code that made the call: the user's own reads are not counted, nor those the inner
``torch.optim`` optimizer makes of its step counters (kept on the host unless ``capturable``/``fused``).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from typing import Any

import moe
import torch
import torch.distributed as dist
from factory import make_optimizer
from models import DTYPES, batch, loss_of, make_model
from torch.overrides import TorchFunctionMode

import zeroplan
from zeroplan.facade.mechanisms.collectives import all_gather_objects

READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__"})
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(zeroplan.facade.__file__)))


class HostReads(TorchFunctionMode):
    """Counts host reads by the zeroplan line that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.where: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in READS:
            caller = traceback.extract_stack()[-2]  # who called item()/bool()/...: zeroplan, or not
            if _ours(caller.filename):
                self.where[
                    f"{os.path.relpath(caller.filename, _PACKAGE)}:{caller.lineno} {func.__name__}"
                ] += 1
        return func(*args, **(kwargs or {}))


def _ours(filename: str) -> bool:
    path = os.path.abspath(filename)
    return any(path.startswith(os.path.join(_PACKAGE, part) + os.sep) for part in ("core", "facade"))


def per_step(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Host reads zeroplan makes in each of two steps (backward, clip, step, the next forward)."""
    torch.manual_seed(0)
    experts = cfg.get("experts", False)
    if experts:
        ep, ep_dp = moe.expert_groups(world)
        model = moe.rank_model(moe.full_model(), rank, ep)
        params: Any = [
            {"params": model.dense_parameters()},
            {"params": model.expert_parameters(), "process_group": ep_dp},
        ]
    else:
        model = make_model(dtype=DTYPES[cfg.get("dtype", "fp32")])
        params = model
    settings = {k: cfg[k] for k in ("loss_scale",) if k in cfg}
    opt = make_optimizer(params, stage=cfg.get("stage", 2), hyper={"lr": 1e-3}, **settings)
    opt.attach(model)

    def loss(step: int) -> torch.Tensor:
        if experts:
            tokens = torch.randint(
                0, moe.VOCAB, (4, 8), generator=torch.Generator().manual_seed(step * 7 + rank)
            )
            return model(tokens).float().logsumexp(-1).mean()
        return loss_of(model, *batch(step, rank))

    counts = []
    current = loss(0)
    for step in range(3):
        mode = HostReads() if step else contextlib.nullcontext()  # step 0 warms up (first-use work)
        with mode:
            opt.backward(current)
            if cfg.get("clip"):
                opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            if cfg.get("write"):  # the user writes a parameter between steps ([Note: parameter writes])
                with torch.no_grad():
                    next(model.parameters()).mul_(1.5)
            current = loss(step + 1)  # the next forward: it waits for the gathered parameters
        if step:
            counts.append(dict(mode.where))  # type: ignore[union-attr]
    return {"counts": counts, "skipped": opt.last_step_skipped}


def control(rank: int, world: int) -> dict[str, int]:
    """The counter sees reads made in zeroplan's code: an object all-gather reads the sizes it gathered."""
    del rank, world
    with HostReads() as reads:
        all_gather_objects("hello", dist.group.WORLD)
    return dict(reads.where)
