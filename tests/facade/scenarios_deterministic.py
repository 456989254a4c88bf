"""Deterministic mode: canonical micro-batches on W ranks, the final state's exact bits for rank 0."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from factory import make_optimizer
from models import DTYPES, batch, loss_of, make_model

from zeroplan.facade import ZeroOptimizer


def _digest(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order (the same digest only for the same bits)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu", copy=True).reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _state_tensors(opt: ZeroOptimizer) -> list[torch.Tensor]:
    """Every tensor of the consolidated optimizer state (masters included), in a fixed order."""
    state = opt.consolidated_state_dict(None)
    assert state is not None
    out: list[torch.Tensor] = []
    for index in sorted(state["state"]):
        entry = state["state"][index]
        out += [entry[k] for k in sorted(entry) if isinstance(entry[k], torch.Tensor)]
    return out


def train(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg["steps"]`` steps over ``cfg["G"]`` canonical micro-batches; digests of the final state.

    Rank ``r`` runs micro-batches ``r*G/W .. (r+1)*G/W - 1`` with ``no_sync()``
    around all but its last backward, each loss divided by the G/W it runs.
    """
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    model = make_model(dtype=dtype)
    settings = {
        k: cfg[k]
        for k in (
            "layout",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "collectives",
            "strategy",
            "ranks_per_node",
        )
        if k in cfg
    }
    optimizer = cfg.get("optimizer", "adamw")
    hyper = {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)} if optimizer == "adamw" else None
    opt = make_optimizer(
        model,
        optimizer=optimizer,
        hyper=hyper,
        stage=cfg.get("stage", 2),
        shard=cfg.get("shard"),
        bucket_bytes=cfg.get("bucket_bytes", 2048),
        loss_scale="dynamic" if dtype == torch.float16 else None,
        deterministic=cfg.get("deterministic", True),
        **settings,
    )
    if cfg.get("stage", 2) == 3:
        opt.attach(model)
    first = 0
    if cfg.get("load_from"):  # resume a run saved at another world size, stage or layout
        from zeroplan.facade import checkpoint

        first = int(checkpoint.load(opt, cfg["load_from"])["step"])
    G = cfg.get("G", 4)
    mine = G // world
    norms, scales = [], []
    for step in range(first, cfg.get("steps", 3)):
        for k in range(rank * mine, (rank + 1) * mine):
            loss = loss_of(model, *batch(step, k, size=2)) / mine
            if cfg.get("fp16_overflow_step") == step and k == 0:
                loss = loss * 1e30  # an overflow: the step is skipped everywhere
            if k < (rank + 1) * mine - 1:
                with opt.no_sync():
                    opt.backward(loss)
            else:
                opt.backward(loss)
        if cfg.get("clip", True):
            norms.append(opt.clip_grad_norm_(1.0).item())
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
    if cfg.get("save_to"):
        from zeroplan.facade import checkpoint

        checkpoint.save(opt, cfg["save_to"], extra={"step": cfg.get("steps", 3)})
    if cfg.get("stage", 2) == 3:
        with opt.gathered_params():
            params = _digest(list(model.parameters()))
    else:
        params = _digest(list(model.parameters()))
    norms = [repr(n) for n in norms]  # nan (an overflow step's norm) equals itself as text
    return {"params": params, "state": _digest(_state_tensors(opt)), "norms": norms, "scales": scales}


def with_expert_group(rank: int, world: int) -> None:
    """Deterministic mode with a param group on its own process group (refused on every rank)."""
    import torch.distributed as dist

    model = make_model()
    params = list(model.parameters())
    own = [dist.new_group([r]) for r in range(world)][rank]  # each rank's experts its own
    ZeroOptimizer(
        [{"params": params[:-2]}, {"params": params[-2:], "process_group": own}],
        torch.optim.AdamW,
        lr=1e-3,
        deterministic=True,
    )


def held_between_micro_batches(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """MemTracker's bytes after each ``no_sync()`` backward of a step, above those before its first.

    A Linear stack (nothing else survives a backward: its activations are freed); the second step
    is measured, so optimizer state and buffers already exist.
    """
    from torch import nn
    from torch.distributed._tools.mem_tracker import MemTracker

    from zeroplan.core import accumulation_bytes
    from zeroplan.facade.diagnostics.meter import tracked_bytes

    dtype = DTYPES[cfg.get("dtype", "fp32")]
    tracker = MemTracker()
    with tracker:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))).to(dtype)
        opt = ZeroOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            lr=1e-3,
            stage=cfg["stage"],
            bucket_bytes=4096,
            deterministic=cfg["deterministic"],
        )
        opt.attach(model)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank)).to(dtype)
    mine = cfg["micro_batches"]
    held = []
    for step in range(2):
        tracker.reset_mod_stats()
        with tracker:  # re-entered per backward pass: it refuses a module's second forward otherwise
            before = tracked_bytes(tracker)
        for k in range(mine):
            tracker.reset_mod_stats()
            with tracker:
                loss = model(x * (k + 1)).float().square().mean() / mine
                if k < mine - 1:
                    with opt.no_sync():
                        opt.backward(loss)
                    del loss
                    if step == 1:
                        held.append(tracked_bytes(tracker) - before)
                else:
                    opt.backward(loss)
                    del loss
                    opt.step()
                    opt.zero_grad()
    return {"held": max(held, default=0), "planned": accumulation_bytes(opt.plan, mine)}


def uneven_micro_batches(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 runs 3 backward passes (not a power of two), the others 2: step() must raise on every
    rank and change nothing."""
    model = make_model()
    opt = make_optimizer(model, hyper={"lr": 1e-2}, deterministic=True)
    before = _digest(list(model.parameters()))
    passes = 3 if rank == 0 else 2
    for k in range(passes):
        loss = loss_of(model, *batch(0, rank * 4 + k, size=2)) / passes
        if k < passes - 1:
            with opt.no_sync():
                opt.backward(loss)
        else:
            opt.backward(loss)
    try:
        opt.step()
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    else:
        raised = None
    return {"raised": raised, "unchanged": _digest(list(model.parameters())) == before}
