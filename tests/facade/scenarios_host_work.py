"""What a step's host does per parameter: the tensor operations it dispatches and zeroplan's Python calls.

[Note: gradient path] in ``facade/runtime/grad_sync.py`` keeps the gradient hooks' work per bucket:
an arrival only counts down its buckets. Counted here on two models that differ only in how many
parameters they have (every parameter in one bucket either way), so the difference per added
parameter is what each parameter costs: the operations (each a kernel launch on a GPU) and the
Python frames zeroplan enters, during backward and during the whole step.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zeroplan
from zeroplan.facade import ZeroOptimizer

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(zeroplan.facade.__file__)))
_OURS = tuple(os.path.join(_PACKAGE, part) + os.sep for part in ("core", "facade"))


class Ops(TorchDispatchMode):
    """Counts the aten operations dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


class Calls:
    """Counts the Python frames entered in zeroplan's code (``core/``, ``facade/``) while active,
    generator resumptions included."""

    def __init__(self) -> None:
        self.where: Counter[str] = Counter()

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        del arg
        if event == "call" and frame.f_code.co_filename.startswith(_OURS):
            name = frame.f_code.co_name
            if name in ("<genexpr>", "__torch_function__"):  # which one: by where it is called from
                name += f" in {frame.f_back.f_code.co_name}"
            self.where[name] += 1

    def __enter__(self) -> Calls:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


def _counted(run: Callable[[], None]) -> tuple[int, Counter[str]]:
    with Ops() as ops, Calls() as calls:
        run()
    return ops.count, calls.where


def per_parameter(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Operations and zeroplan calls of one step's backward and of the whole step, per model size."""
    stage = cfg["stage"]
    out: dict[str, Any] = {}
    for layers in cfg["layers"]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
        plain = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, foreach=True, stage=stage)
        if stage == 3:
            opt.attach(model)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))

        def step(opt: ZeroOptimizer = opt, model: torch.nn.Module = model, x: torch.Tensor = x) -> None:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            opt.wait_for_params()

        for _ in range(2):
            step()
        loss = model(x).square().mean()
        backward = _counted(loss.backward)
        opt.step()
        opt.zero_grad()
        opt.wait_for_params()
        whole = _counted(step)
        plain_loss = plain(x).square().mean()
        plain_backward = _counted(plain_loss.backward)
        out[str(layers)] = {
            "params": 2 * layers,
            "buckets": len(opt.plan.buckets.buckets),
            "backward_ops": backward[0],
            "plain_backward_ops": plain_backward[0],
            "backward_calls": sum(backward[1].values()),
            "step_ops": whole[0],
            "step_calls": sum(whole[1].values()),
            "step_calls_where": dict(whole[1]),
        }
    return out
