"""Training scenarios run on every rank of a worker pool (see dist_worker.py).

Each function takes ``(rank, world, ...)`` and returns plain data for the test
to assert on. The single-process reference runs on rank 0 only.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from factory import OPTIMIZERS, make_optimizer
from models import DTYPES, Reference, averaged_grads, batch, loss_of, make_model, rel_err

from zeroplan.core import ScalerConfig


def train(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train TinyGPT with ZeroOptimizer for ``cfg['steps']`` and compare with the reference every step."""
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    optimizer = cfg.get("optimizer", "adamw")
    cls = OPTIMIZERS[optimizer].cls
    hyper = {**OPTIMIZERS[optimizer].hyper, **cfg.get("hyper", {})}
    steps, accumulate = cfg.get("steps", 4), cfg.get("accumulate", 1)
    same_grads = cfg.get("same_grads", True)
    clip, norm_type = cfg.get("clip"), cfg.get("norm_type", 2.0)
    model = make_model(dtype=dtype)
    opt = make_optimizer(
        model,
        optimizer=optimizer,
        hyper=hyper,
        stage=cfg.get("stage", 2),
        shard=cfg.get("shard"),
        bucket_bytes=cfg.get("bucket_bytes", 2048),
        alignment=cfg.get("alignment", 16),
        strategy=cfg.get("strategy", "auto"),
        overlap_grad_reduce=cfg.get("overlap", True),
        loss_scale=cfg.get("loss_scale"),
        collectives=cfg.get("collectives", "auto"),
    )
    scheduler = _scheduler(cfg.get("scheduler"), opt, steps)
    ref = ref_sched = None
    if rank == 0:
        ref = Reference(make_model(dtype=dtype), cls, **hyper)
        ref_sched = _scheduler(cfg.get("scheduler"), ref.optimizer, steps)
    errors, grad_errors, norms, ref_norms, lrs = [], [], [], [], []
    sync = opt.installed.sync
    for step in range(steps):
        if cfg.get("poison_arena"):  # garbage left in the staging arena (0xFF bytes: NaN) must not leak
            sync.arena.fill_(255)
        for micro in range(accumulate):
            tokens, targets = batch(step * accumulate + micro, rank)
            loss = loss_of(model, tokens, targets) / accumulate
            context = opt.no_sync() if micro < accumulate - 1 else _null()
            with context:
                opt.backward(loss)
        reduced = opt.averaged_gradients() if same_grads else None
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip, norm_type)))
        opt.step()
        assert not opt.last_step_skipped
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
            lrs.append(opt.param_groups[0]["lr"])
        if ref is not None:

            def grads(m: torch.nn.Module, w: int, s: int) -> list[torch.Tensor]:
                parts = [averaged_grads(m, w, s * accumulate + k) for k in range(accumulate)]
                return [sum(p[i] for p in parts) / accumulate for i in range(len(parts[0]))]

            expected = grads(ref.model, world, step)
            if reduced is not None:
                # The reduction is checked against the exact average; the step then runs on the very
                # same gradients, so the optimizer math is compared without the rounding of the sum
                # (to which Adam's normalised update is sensitive where gradients nearly cancel).
                grad_errors.append(max(rel_err(a, b) for a, b in zip(reduced, expected, strict=True)))

                def grads(m: torch.nn.Module, w: int, s: int, reduced=reduced) -> list[torch.Tensor]:
                    del m, w, s
                    return reduced

            norm = ref.step(world, step, clip=clip, norm_type=norm_type, grad_fn=grads)
            if norm is not None:
                ref_norms.append(float(norm))
            if ref_sched is not None:
                ref_sched.step()
            errors.append(
                max(rel_err(a, b) for a, b in zip(model.parameters(), ref.model.parameters(), strict=True))
            )
    return {
        "errors": errors,
        "grad_errors": grad_errors,
        "norms": norms,
        "ref_norms": ref_norms,
        "lrs": lrs,
        "params": [p.detach().clone() for p in model.parameters()],
        "strategy": opt.plan.partition.strategy,
        "padded_buckets": sum(b.padded for b in opt.plan.buckets.buckets),
        "buckets": len(opt.plan.buckets.buckets),
        "inflight": opt.plan.max_inflight_buckets,
    }


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _scheduler(kind: str | None, optimizer: torch.optim.Optimizer, steps: int) -> Any:
    if kind is None:
        return None
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    if kind == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=steps + 1)
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    raise ValueError(kind)


def overflow(rank: int, world: int, stage: int) -> dict[str, Any]:
    """fp16 with a dynamic scale: an inf on one rank skips the step everywhere and changes nothing."""
    model = make_model(dtype=torch.float16)
    opt = make_optimizer(
        model,
        hyper={"lr": 1e-3},
        stage=stage,
        bucket_bytes=1024,
        alignment=16,
        loss_scale="dynamic",
        scaler=ScalerConfig(initial_scale=2.0**12, growth_interval=1000),
    )
    opt.backward(loss_of(model, *batch(0, rank)))
    opt.step()
    first = not opt.last_step_skipped
    opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    masters = [b.master.clone() for b in opt.buffers if b.master is not None]  # else: the parameters
    state = copy.deepcopy(opt.inner_optimizer.state_dict())
    scale = opt.loss_scale
    loss = loss_of(model, *batch(1, rank))
    if rank == world - 1:
        loss = loss * math.inf
    opt.backward(loss)
    opt.step()
    applied = not opt.last_step_skipped
    opt.zero_grad()
    unchanged = all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    now = [b.master for b in opt.buffers if b.master is not None]
    masters_same = all(torch.equal(a, b) for a, b in zip(masters, now, strict=True))
    after = opt.inner_optimizer.state_dict()
    state_same = all(
        torch.equal(v, after["state"][k][name]) if torch.is_tensor(v) else v == after["state"][k][name]
        for k, entry in state["state"].items()
        for name, v in entry.items()
    )
    backed_off = opt.loss_scale
    opt.backward(loss_of(model, *batch(2, rank)))
    opt.step()
    third = not opt.last_step_skipped
    return {
        "first": first,
        "applied": applied,
        "third": third,
        "params_same": unchanged,
        "masters_same": masters_same,
        "state_same": state_same,
        "scale_before": scale,
        "scale_after": backed_off,
        "changed_after": not all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True)),
    }
