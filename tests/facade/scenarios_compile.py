"""``torch.compile`` with ``ZeroOptimizer`` ([Note: hooks under torch.compile]): a model compiled whole
or per block trains at stages 1-3 as DDP + AdamW does on the same compiled model, and compiles no new
frame after its second step."""

from __future__ import annotations

from typing import Any

import torch
from factory import make_optimizer
from models import batch, loss_of, make_model, rel_err
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel

HYPER = {"lr": 1e-2, "weight_decay": 0.1}
STEPS = 4


def _compiled(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """``model`` compiled whole, or each transformer block on its own (as torchtitan does)."""
    if mode == "whole":
        return torch.compile(model)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block)
    return model


def compiled(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """``STEPS`` steps of a compiled model with ZeroOptimizer, then with DDP + AdamW from the same start."""
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    opt = make_optimizer(
        model,
        hyper=HYPER,
        stage=cfg["stage"],
        overlap_param_gather=cfg.get("overlap", True),
    )
    opt.attach(model)  # stage 3: module hooks, run between the compiled graphs
    run = _compiled(model, cfg["mode"])
    frames, losses = [], []
    for step in range(STEPS):
        loss = loss_of(run, *batch(step, rank))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        frames.append(counters["frames"]["total"])
        losses.append(loss.item())
    breaks = sum(counters["graph_break"].values())
    with opt.gathered_params():
        mine = [p.detach().clone() for p in model.parameters()]

    reference = make_model()
    ddp = _compiled(DistributedDataParallel(reference), "whole") if cfg["mode"] == "whole" else None
    if ddp is None:
        _compiled(reference, "block")
        ddp = DistributedDataParallel(reference)
    _train_ddp(ddp, reference)
    eager = make_model()  # DDP not compiled: how far compiling alone moves the same training
    _train_ddp(DistributedDataParallel(eager), eager)
    return {
        "param_err": max(rel_err(a, b) for a, b in zip(mine, reference.parameters(), strict=True)),
        "compile_noise": max(
            rel_err(a, b) for a, b in zip(reference.parameters(), eager.parameters(), strict=True)
        ),
        "frames": frames,
        "breaks": breaks,
        "losses": losses,
    }


def _train_ddp(ddp: torch.nn.Module, model: torch.nn.Module) -> None:
    adamw = torch.optim.AdamW(model.parameters(), **HYPER)
    for step in range(STEPS):
        loss_of(ddp, *batch(step, torch.distributed.get_rank())).backward()
        adamw.step()
        adamw.zero_grad()
