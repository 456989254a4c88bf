"""Step lifecycle scenarios: calls out of order are refused on every rank and change nothing.

See [Note: step lifecycle] in ``zeroplan.facade.runtime.lifecycle``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from factory import OPTIMIZERS, make_optimizer
from models import DTYPES, Reference, batch, loss_of, make_model, rel_err

from zeroplan.core import StepOrderError
from zeroplan.facade import ZeroOptimizer


def _snapshot(opt: ZeroOptimizer, model: torch.nn.Module) -> list[torch.Tensor]:
    """Clones of everything a refused call must leave bit-identical."""
    state = [
        value.clone()
        for entry in opt.inner_optimizer.state.values()
        for value in entry.values()
        if torch.is_tensor(value)
    ]
    masters = [b.master.clone() for b in opt.buffers if b.master is not None]  # else: the parameters
    return [p.detach().clone() for p in model.parameters()] + masters + state


def _refused(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except StepOrderError as exc:
        return str(exc)
    return None


def _accepted_step(
    opt: ZeroOptimizer,
    model: torch.nn.Module,
    ref: Reference | None,
    step: int,
    rank: int,
    world: int,
    clip: float | None,
) -> None:
    """One normal step, mirrored by the reference on the very same reduced gradients."""
    opt.backward(loss_of(model, *batch(step, rank)))
    reduced = opt.averaged_gradients()
    if clip is not None:
        opt.clip_grad_norm_(clip)
    opt.step()
    assert not opt.last_step_skipped
    opt.zero_grad()
    if ref is not None:
        ref.step(world, step, clip=clip, grad_fn=lambda m, w, s: reduced)


def out_of_order(rank: int, world: int, stage: int, dtype: str) -> dict[str, Any]:
    """Each misuse raises StepOrderError, leaves every tensor as it was, and training then continues
    exactly as the unsharded optimizer's (the reference steps once per accepted step)."""
    model = make_model(dtype=DTYPES[dtype])
    opt = make_optimizer(model, stage=stage)
    adamw = OPTIMIZERS["adamw"]
    ref = Reference(make_model(dtype=DTYPES[dtype]), adamw.cls, **adamw.hyper) if rank == 0 else None
    messages: dict[str, str | None] = {}
    unchanged: dict[str, bool] = {}

    def check(name: str, call: Callable[[], Any]) -> None:
        before = _snapshot(opt, model)
        messages[name] = _refused(call)
        after = _snapshot(opt, model)
        unchanged[name] = len(before) == len(after) and all(
            torch.equal(a, b) for a, b in zip(before, after, strict=True)
        )

    # Before any backward: nothing to apply.
    check("step_before_backward", opt.step)
    check("clip_before_backward", lambda: opt.clip_grad_norm_(1.0))
    check("averaged_before_backward", opt.averaged_gradients)
    _accepted_step(opt, model, ref, 0, rank, world, clip=None)  # the optimizer is still usable

    # Clipping twice in one step: the second call is refused, the step goes on with one clip.
    opt.backward(loss_of(model, *batch(1, rank)))
    reduced = opt.averaged_gradients()
    opt.clip_grad_norm_(0.5)
    check("clip_twice", lambda: opt.clip_grad_norm_(0.5))
    opt.step()
    assert not opt.last_step_skipped
    opt.zero_grad()
    if ref is not None:
        ref.step(world, 1, clip=0.5, grad_fn=lambda m, w, s: reduced)

    # A backward between clipping and step(): refused from the gradient hook.
    opt.backward(loss_of(model, *batch(2, rank)))
    opt.clip_grad_norm_(0.5)
    check("backward_after_clip", lambda: opt.backward(loss_of(model, *batch(3, rank))))
    opt.zero_grad()  # drops this step: back to IDLE
    check("step_after_zero_grad", opt.step)
    _accepted_step(opt, model, ref, 2, rank, world, clip=0.5)

    # step() twice without a backward in between: the second has nothing to apply.
    opt.backward(loss_of(model, *batch(3, rank)))
    reduced = opt.averaged_gradients()
    opt.step()
    assert not opt.last_step_skipped
    check("second_step", opt.step)
    opt.zero_grad()
    if ref is not None:
        ref.step(world, 3, grad_fn=lambda m, w, s: reduced)

    errors = []
    if ref is not None:
        errors = [rel_err(a, b) for a, b in zip(model.parameters(), ref.model.parameters(), strict=True)]
    return {"messages": messages, "unchanged": unchanged, "errors": errors}


def frozen_model_steps_quietly(rank: int, world: int) -> bool:
    """A plan without trainable parameters has nothing to apply: step() is a no-op, not an error."""
    model = make_model()
    for p in model.parameters():
        p.requires_grad_(False)
    opt = make_optimizer(model)
    opt.step()
    return not opt.last_step_skipped


def parameter_writes(rank: int, world: int, stage: int, dtype: str, overlap: bool) -> dict[str, Any]:
    """Writes into the parameters between steps are kept ([Note: parameter writes]).

    Trains a step, then switches to ``lr=0`` and no weight decay (AdamW then
    changes no parameter) and, on every rank: clamps one element in place and
    steps (the element keeps its value, and every other master element keeps
    its fp32 bits), then loads another model's weights with
    ``model.load_state_dict`` and steps (the model keeps them). Also: an alias
    taken before ``step()`` (``w = p.data``) is current once
    ``opt.wait_for_params()`` returned.
    """
    torch_dtype = DTYPES[dtype]
    model = make_model(dtype=torch_dtype)
    opt = ZeroOptimizer(
        model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2, overlap_param_gather=overlap
    )
    alias = next(model.parameters()).data
    tokens, targets = batch(rank, 0)

    def step() -> None:
        loss_of(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        opt.wait_for_params()

    step()
    alias_current = torch.equal(alias, next(model.parameters()))
    for group in opt.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    masters = [b for b in opt.buffers if b.carries_master]
    before = [b.master_copy[: b.extent].clone() for b in masters]
    first = next(model.parameters())
    with torch.no_grad():
        first.view(-1)[:1].clamp_(max=-3.0)
    clamped = first.detach().clone()
    step()
    # Only the clamped element's master may have changed (on the rank that owns it).
    changed = sum(
        int((b.master_copy[: b.extent] != old).sum()) for b, old in zip(masters, before, strict=True)
    )
    clamp_kept = torch.equal(first, clamped)
    loaded = make_model(seed=1, dtype=torch_dtype).state_dict()
    model.load_state_dict(loaded)
    step()
    kept = all(torch.equal(value, loaded[key]) for key, value in model.state_dict().items())
    return {"alias_current": alias_current, "clamp_kept": clamp_kept, "changed": changed, "kept": kept}
