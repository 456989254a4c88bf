"""Frozen parameters, refresh_trainable and add_param_group against torch.optim."""

from __future__ import annotations

from typing import Any

import torch
from factory import OPTIMIZERS, make_optimizer
from models import DTYPES, Reference, averaged_grads, batch, loss_of, make_model, rel_err

from zeroplan.core import DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES


def _reference_step(ref_model: torch.nn.Module, ref_opt: torch.optim.Optimizer, grads: list[Any]) -> None:
    """Unsharded step: frozen parameters get no gradient (torch.optim skips them)."""
    for p, g in zip(ref_model.parameters(), grads, strict=True):
        p.grad = None if (g is None or not p.requires_grad) else g.clone()
    ref_opt.step()
    ref_opt.zero_grad()


def freeze_and_unfreeze(rank: int, world: int, stage: int, dtype_name: str, optimizer: str) -> dict[str, Any]:
    """Train with frozen layers, freeze one more and unfreeze one mid-run; compare with torch.optim."""
    cls, hyper = OPTIMIZERS[optimizer].cls, OPTIMIZERS[optimizer].plain
    model = make_model()
    ref_model = make_model()
    names = [n for n, _ in model.named_parameters()]
    frozen_at_start = {"pos.weight", "blocks.0.ln1.weight"}
    for (n, p), rp in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        p.requires_grad_(n not in frozen_at_start)
        rp.requires_grad_(n not in frozen_at_start)
    opt = make_optimizer(model, optimizer=optimizer, hyper=hyper, stage=stage, bucket_bytes=1024, alignment=8)
    ref_opt = cls(ref_model.parameters(), **hyper)
    errors, states = [], []
    for step in range(6):
        if step == 2:  # freeze a trained layer
            for m in (model, ref_model):
                m.blocks[1].fc.weight.requires_grad_(False)
            opt.refresh_trainable()
        if step == 4:  # unfreeze a layer frozen from the start: fresh optimizer state
            for m in (model, ref_model):
                m.pos.weight.requires_grad_(True)
            opt.refresh_trainable()
        loss_of(model, *batch(step, rank)).backward()
        grads = opt.averaged_gradients()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            _reference_step(ref_model, ref_opt, grads)
            errors.append(
                max(rel_err(a, b) for a, b in zip(model.parameters(), ref_model.parameters(), strict=True))
            )
        states.append(sum(1 for _ in opt.inner_optimizer.state))
    frozen_unchanged = None
    if rank == 0:
        frozen_unchanged = bool(torch.equal(model.blocks[0].ln1.weight, make_model().blocks[0].ln1.weight))
    return {
        "errors": errors,
        "names": names,
        "frozen_unchanged": frozen_unchanged,
        "trainable": sum(s.trainable for s in opt.plan.specs),
    }


def add_group(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Start with the blocks, add the embeddings and head as a second group with its own lr."""
    model = make_model()
    ref_model = make_model()
    first = [p for n, p in model.named_parameters() if n.startswith("blocks")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks")]
    ref_first = [p for n, p in ref_model.named_parameters() if n.startswith("blocks")]
    ref_rest = [p for n, p in ref_model.named_parameters() if not n.startswith("blocks")]
    for p in rest + ref_rest:
        p.requires_grad_(False)
    opt = make_optimizer(first, hyper={"lr": 1e-2}, stage=stage, bucket_bytes=1024, alignment=8)
    ref_opt = torch.optim.AdamW(ref_first, lr=1e-2)
    errors, groups = [], []
    order = first
    for step in range(5):
        if step == 2:
            for p in rest + ref_rest:
                p.requires_grad_(True)
            opt.add_param_group({"params": rest, "lr": 3e-3})
            ref_opt.add_param_group({"params": ref_rest, "lr": 3e-3})
            order = first + rest
        loss_of(model, *batch(step, rank)).backward()
        grads = opt.averaged_gradients()
        opt.step()
        opt.zero_grad()
        groups.append([g["lr"] for g in opt.param_groups])
        if rank == 0:
            ref_params = ref_first + (ref_rest if step >= 2 else [])
            for p, g in zip(ref_params, grads, strict=True):
                p.grad = g.clone()
            ref_opt.step()
            ref_opt.zero_grad()
            errors.append(
                max(rel_err(a, b) for a, b in zip(model.parameters(), ref_model.parameters(), strict=True))
            )
    del order
    return {"errors": errors, "groups": groups}


def new_bf16_params_keep_their_values(rank: int, world: int) -> dict[str, Any]:
    """bf16 parameters new to the plan (``add_param_group``; unfrozen before they ever stepped) start
    their fp32 masters from their own values: a step with ``lr=0`` changes no parameter, at stages 1-3,
    with and without offload. Freed memory is first filled with 3e30, which an uninitialised master
    would pick up."""
    changes: dict[str, float] = {}
    for stage in (1, 2, 3):
        for offload in (None, "optimizer"):
            for how in ("add_param_group", "refresh_trainable"):
                model = make_model(dtype=torch.bfloat16)
                params = list(model.parameters())
                first, head = params[:-2], params[-2:]
                if how == "refresh_trainable":
                    for p in head:
                        p.requires_grad_(False)
                opt = make_optimizer(
                    params if how == "refresh_trainable" else first,
                    hyper={"lr": 0.0, "weight_decay": 0.0},
                    stage=stage,
                    offload=offload,
                )
                if stage == 3:
                    opt.attach(model)
                with opt.gathered_params():
                    before = [p.detach().clone() for p in params]
                for step in range(2):
                    if step == 1:
                        junk = torch.full((1 << 16,), 3.0e30)
                        del junk
                        if how == "add_param_group":
                            opt.add_param_group({"params": head})
                        else:
                            for p in head:
                                p.requires_grad_(True)
                            opt.refresh_trainable()
                        if stage == 3:
                            opt.attach(model)
                    opt.backward(loss_of(model, *batch(step, rank)))
                    opt.step()
                    opt.zero_grad()
                with opt.gathered_params():
                    after = [p.detach().clone() for p in params]
                changes[f"stage {stage} offload {offload} {how}"] = max(
                    float((a.float() - b.float()).abs().max()) for a, b in zip(before, after, strict=True)
                )
    return {"changes": changes}


def bad_add_group(rank: int, world: int) -> dict[str, Any]:
    """A bad add_param_group raises everywhere and leaves the optimizer working as before."""
    model = make_model()
    params = list(model.parameters())
    opt = make_optimizer(
        params[:-1], hyper={"lr": 1e-2}, bucket_bytes=DEFAULT_BUCKET_BYTES, alignment=DEFAULT_ALIGNMENT
    )
    fingerprint = opt.plan.fingerprint()
    try:
        opt.add_param_group({"params": [params[0]]})  # already managed
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    same = opt.plan.fingerprint() == fingerprint and len(opt.param_groups) == 1
    loss_of(model, *batch(0, rank)).backward()
    opt.step()
    applied = not opt.last_step_skipped
    return {"error": error, "same": same, "applied": applied}


def unfrozen_without_refresh(rank: int, world: int, stage: int) -> dict[str, Any]:
    """A parameter frozen at construction whose ``requires_grad`` the last rank turns on without
    ``refresh_trainable()``: its gradient would never reach the step, so ``step()`` raises on every
    rank and changes nothing; frozen again, the next step trains."""
    model = make_model()
    model.pos.weight.requires_grad_(False)
    opt = make_optimizer(model, hyper={"lr": 1e-2}, stage=stage, bucket_bytes=1024, alignment=8)
    if stage == 3:
        opt.attach(model)
    loss_of(model, *batch(0, rank)).backward()
    opt.step()
    opt.zero_grad()
    if rank == world - 1:
        model.pos.weight.requires_grad_(True)
    with opt.gathered_params():
        before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, *batch(1, rank)).backward()
    try:
        opt.step()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    with opt.gathered_params():
        same = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    model.pos.weight.requires_grad_(False)
    model.pos.weight.grad = None
    opt.zero_grad()
    loss_of(model, *batch(2, rank)).backward()
    opt.step()
    return {"error": error, "same": same, "applied": not opt.last_step_skipped}


def reference_grads(model: torch.nn.Module, world: int, step: int) -> list[torch.Tensor]:
    return averaged_grads(model, world, step)


def freeze_then_unfreeze(
    rank: int, world: int, stage: int, dtype_name: str, optimizer: str, shard: int | None
) -> dict[str, Any]:
    """A trained parameter frozen for two steps and unfrozen keeps its moments and its own step
    (torch.optim semantics), with fp32 masters in bf16; compared with torch.optim every step."""
    cls, hyper = OPTIMIZERS[optimizer].cls, OPTIMIZERS[optimizer].hyper
    dtype = DTYPES[dtype_name]
    model, ref = make_model(dtype=dtype), Reference(make_model(dtype=dtype), cls, **hyper)
    opt = make_optimizer(model, optimizer=optimizer, stage=stage, shard=shard, bucket_bytes=1024, alignment=8)
    toggled = [model.blocks[1].fc.weight, model.head.weight]
    ref_toggled = [ref.model.blocks[1].fc.weight, ref.model.head.weight]
    errors = []
    for step in range(7):
        if step in (2, 4):  # freeze two trained layers, then unfreeze them
            for p, rp in zip(toggled, ref_toggled, strict=True):  # the reference skips frozen ones
                p.requires_grad_(step == 4)
                rp.requires_grad_(step == 4)
            opt.refresh_trainable()
        loss_of(model, *batch(step, rank)).backward()
        grads = opt.averaged_gradients()
        opt.step()
        opt.zero_grad()
        ref.step(world, step, grad_fn=lambda m, w, s, g=grads: g)
        errors.append(
            max(rel_err(a, b) for a, b in zip(model.parameters(), ref.model.parameters(), strict=True))
        )
    return {"errors": errors}


def parked_state_survives_state_dicts(rank: int, world: int, form: str) -> dict[str, Any]:
    """Freeze a trained layer, save (sharded or consolidated), load into a new optimizer (another
    strategy for the consolidated form), unfreeze: the same as never having saved."""
    model = make_model()
    opt = make_optimizer(model, stage=2)
    toggled = lambda m: m.blocks[1].fc.weight  # noqa: E731

    def train(m: torch.nn.Module, o: Any, steps: range) -> None:
        for step in steps:
            loss_of(m, *batch(step, rank)).backward()
            o.step()
            o.zero_grad()

    train(model, opt, range(2))
    toggled(model).requires_grad_(False)
    opt.refresh_trainable()
    train(model, opt, range(2, 3))
    saved = opt.state_dict() if form == "sharded" else opt.consolidated_state_dict(to_rank=None)
    copy = make_model()
    copy.load_state_dict(model.state_dict())
    toggled(copy).requires_grad_(False)
    strategy = "auto" if form == "sharded" else "greedy_whole"
    restored = make_optimizer(copy, stage=2, strategy=strategy)
    restored.load_state_dict(saved)
    for m, o in ((model, opt), (copy, restored)):
        toggled(m).requires_grad_(True)
        o.refresh_trainable()
        train(m, o, range(3, 5))
    pairs = zip(model.parameters(), copy.parameters(), strict=True)
    return {"errors": [rel_err(a, b) for a, b in pairs], "parked_in_dict": _has_parked(saved, form)}


def _has_parked(saved: dict[str, Any], form: str) -> bool:
    if form == "sharded":
        return any(path.startswith("parked/") for path in saved["parked"])
    return bool(saved) and all("exp_avg" in entry for entry in saved["state"].values())


def parked_state_survives_checkpoints(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    """Save with a trained layer frozen at one world size; load at another (``phase``), unfreeze and
    train: the same as a run that never stopped (recorded by the save phase in ``root``)."""
    from zeroplan.facade import checkpoint

    def train(m: torch.nn.Module, o: Any, steps: range) -> None:
        for step in steps:
            loss_of(m, *batch(step, 0)).backward()  # every rank the same batch: any world gives one result
            o.step()
            o.zero_grad()

    model = make_model()
    if phase == "save":
        opt = make_optimizer(model, stage=2)
        train(model, opt, range(2))
        model.blocks[1].fc.weight.requires_grad_(False)
        opt.refresh_trainable()
        train(model, opt, range(2, 3))
        checkpoint.save(opt, root)
        if rank == 0:
            torch.save(model.state_dict(), f"{root}/model.pt")
        model.blocks[1].fc.weight.requires_grad_(True)
        opt.refresh_trainable()
        train(model, opt, range(3, 5))
        return {"params": [p.detach().clone() for p in model.parameters()]}
    model.load_state_dict(torch.load(f"{root}/model.pt"))
    model.blocks[1].fc.weight.requires_grad_(False)
    opt = make_optimizer(model, stage=2, strategy="greedy_whole")
    checkpoint.load(opt, root)
    model.blocks[1].fc.weight.requires_grad_(True)
    opt.refresh_trainable()
    train(model, opt, range(3, 5))
    return {"params": [p.detach().clone() for p in model.parameters()]}
