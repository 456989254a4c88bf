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
    if cfg["mode"] == "block" and not cfg.get("attach_first"):  # torchtitan's order: compile, attach
        run = _compiled(model, "block")
        opt.attach(model)
    else:
        opt.attach(model)  # module hooks (stage 3) run between the compiled graphs
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


#: The reductions of gradients, as ``collectives="min_bytes"`` issues them (one call per bucket).
_REDUCTIONS = ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")


def _compute_nodes(loss: torch.Tensor) -> list[Any]:
    """Every node of ``loss``'s autograd graph that computes (not the leaves' ``AccumulateGrad``)."""
    seen: dict[int, Any] = {}
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(next_node for next_node, _ in node.next_functions)
    return [n for n in seen.values() if type(n).__name__ != "AccumulateGrad"]


def overlap(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Which gradient reductions start while backward still has graphs to run, compiled or not.

    Every computing node of the fourth step's autograd graph (each compiled region's backward is one
    node) records when it starts, and ``torch.distributed``'s reductions, wrapped outside zeroplan,
    record when they are called: a reduction called before some node starts overlaps that node."""
    torch._dynamo.reset()
    counters.clear()
    model = make_model(width=64)
    opt = make_optimizer(
        model,
        hyper=HYPER,
        stage=cfg["stage"],
        collectives="min_bytes",
        bucket_bytes=16_384,
        layout=cfg.get("layout", "auto"),
        overlap_param_gather=cfg.get("gather_overlap", True),
    )
    run = model if cfg["mode"] == "eager" else _compiled(model, cfg["mode"])
    opt.attach(model)
    for step in range(3):
        opt.backward(loss_of(run, *batch(step, rank)))
        opt.step()
        opt.zero_grad()
    events: list[str] = []
    loss = loss_of(run, *batch(3, rank))
    for node in _compute_nodes(loss):
        node.register_prehook(lambda *_: events.append("compute"))
    real = {name: getattr(torch.distributed, name) for name in _REDUCTIONS}

    def recording(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            events.append("reduce")
            return real[name](*args, **kwargs)

        return call

    try:
        for name in _REDUCTIONS:
            setattr(torch.distributed, name, recording(name))
        opt.backward(loss)
    finally:
        for name, function in real.items():
            setattr(torch.distributed, name, function)
    opt.step()
    last_compute = max(i for i, e in enumerate(events) if e == "compute")
    return {
        "reductions": events.count("reduce"),
        "overlapped": events[:last_compute].count("reduce"),
        "graphs": events.count("compute"),
        "buckets": len(opt.plan.buckets.buckets),
        "breaks": sum(counters["graph_break"].values()),
    }


def fullgraph(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """``fullgraph=True``: compiled whole, the first step that meets a zeroplan hook fails with the
    reason zeroplan gives dynamo; blocks compiled with it, then attached, train."""
    torch._dynamo.reset()
    model = make_model()
    opt = make_optimizer(model, hyper=HYPER, stage=cfg["stage"])
    opt.attach(model)
    whole = torch.compile(model, fullgraph=True)
    error = ""
    try:
        for step in range(3):
            opt.backward(loss_of(whole, *batch(step, rank)))
            opt.step()
            opt.zero_grad()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        opt.wait_for_params()
    torch._dynamo.reset()
    model = make_model()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, fullgraph=True)
    opt = make_optimizer(model, hyper=HYPER, stage=cfg["stage"])
    opt.attach(model)
    for step in range(3):
        opt.backward(loss_of(model, *batch(step, rank)))
        opt.step()
        opt.zero_grad()
    return {"error": error}
