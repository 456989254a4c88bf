"""torchao's low-bit Adam optimizers inside ``ZeroOptimizer`` ([Note: low-bit optimizer state]).

The model is the demo GPT at width 64: its attention and output matrices (12,288 and 16,384
elements) keep quantized moments, its embedding, MLP (12,352 elements, no multiple of 256) and
vectors keep plain ones, so both kinds of state are sharded, stepped and checkpointed.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from models import DTYPES, Reference, batch, loss_of, make_model
from torch.distributed._tools.mem_tracker import MemTracker

from zeroplan.facade import ZeroOptimizer, checkpoint

WIDTH = 64
HYPER = {"lr": 1e-2, "weight_decay": 0.1}


def low_bit_class(name: str) -> type[torch.optim.Optimizer]:
    """torchao's optimizer class ``name`` (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``)."""
    import torchao.optim

    return getattr(torchao.optim, name)


def _optimizer(model: torch.nn.Module, cfg: dict[str, Any], **settings: Any) -> ZeroOptimizer:
    opt = ZeroOptimizer(
        model.parameters(),
        low_bit_class(cfg["optimizer"]),
        stage=cfg["stage"],
        bucket_bytes=16_384,
        **settings,
        **HYPER,
    )
    opt.attach(model)
    return opt


def _train(model: torch.nn.Module, opt: ZeroOptimizer, rank: int, steps: range) -> None:
    for step in steps:
        opt.backward(loss_of(model, *batch(step, rank)))
        opt.step()
        opt.zero_grad()


def _quantized(optimizer: torch.optim.Optimizer) -> int:
    """How many state tensors of ``optimizer`` are torchao's quantized subclasses."""
    return sum(
        type(v).__module__.startswith("torchao.")
        for state in optimizer.state.values()
        for v in state.values()
    )


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of ``optimizer``'s state as torch's MemTracker counts them (codes, scales, tables)."""
    tracker = MemTracker()
    tracker.track_external(optimizer)
    with tracker:
        pass
    return tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]


def _step_both(
    model: torch.nn.Module, opt: ZeroOptimizer, reference: Reference, rank: int, world: int, step: int
) -> None:
    """One step of ``opt`` and of ``reference`` on the gradients ``opt`` reduced (the same ones)."""
    opt.backward(loss_of(model, *batch(step, rank)))
    reduced = opt.averaged_gradients()
    opt.step()
    opt.zero_grad()
    reference.step(world, step, grad_fn=lambda *_: reduced)


def _differing(opt: ZeroOptimizer, model: torch.nn.Module, other: torch.nn.Module) -> int:
    """How many of ``model``'s parameters (gathered) differ in any bit from ``other``'s."""
    with opt.gathered_params():
        return sum(not torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))


def trains(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Three steps against torchao's optimizer unsharded on fp32 masters, given the same gradients
    (the reduced ones: how a bf16 backward's sum rounds is the equivalence tests' business)."""
    cls = low_bit_class(cfg["optimizer"])
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    model = make_model(dtype=dtype, width=WIDTH)
    opt = _optimizer(model, cfg)
    reference = Reference(make_model(dtype=dtype, width=WIDTH), cls, **HYPER)
    differ = []
    for step in range(3):
        _step_both(model, opt, reference, rank, world, step)
        differ.append(_differing(opt, model, reference.model))
    return {
        "differ": differ,
        "strategy": opt.plan.partition.strategy,
        "quantized": _quantized(opt.inner_optimizer),
        "measured_state": _state_bytes(opt.inner_optimizer),
        "planned_state": next(r.optimizer_state_bytes for r in opt.memory_report().ranks if r.rank == rank),
    }


def save(rank: int, world: int, cfg: dict[str, Any], root: str) -> None:
    """Two steps, then a checkpoint; rank 0 keeps the parameters."""
    model = make_model(width=WIDTH)
    opt = _optimizer(model, cfg)
    _train(model, opt, rank, range(2))
    checkpoint.save(opt, root)
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], os.path.join(root, "params.pt"))


def resume(rank: int, world: int, cfg: dict[str, Any], root: str, saved_world: int) -> dict[str, Any]:
    """Load a checkpoint saved at ``saved_world`` and train two more steps, next to torchao's optimizer
    unsharded: two steps on ``saved_world``'s averaged gradients, then two on the reduced ones."""
    model = make_model(width=WIDTH, seed=123)  # other initial values: the checkpoint must set them
    opt = _optimizer(model, cfg)
    checkpoint.load(opt, root)
    saved = torch.load(os.path.join(root, "params.pt"), weights_only=True)
    with opt.gathered_params():
        loaded_same = all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    reference = Reference(make_model(width=WIDTH), low_bit_class(cfg["optimizer"]), **HYPER)
    for step in range(2):
        reference.step(saved_world, step)
    for step in range(2, 4):
        _step_both(model, opt, reference, rank, world, step)
    differ = _differing(opt, model, reference.model)
    return {"loaded_same": loaded_same, "differ": differ, "quantized": _quantized(opt.inner_optimizer)}


def state_dicts(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """``state_dict()`` into a fresh optimizer, and ``consolidated_state_dict()``."""
    model = make_model(width=WIDTH)
    opt = _optimizer(model, cfg)
    _train(model, opt, rank, range(2))
    twin_model = make_model(width=WIDTH, seed=123)
    with opt.gathered_params():
        twin_model.load_state_dict(model.state_dict())
    twin = _optimizer(twin_model, cfg)
    twin.load_state_dict(opt.state_dict())
    _train(model, opt, rank, range(2, 3))
    _train(twin_model, twin, rank, range(2, 3))
    with twin.gathered_params():
        differ = _differing(opt, model, twin_model)
    consolidated = opt.consolidated_state_dict(to_rank=None)  # on every rank
    inner = opt.inner_optimizer
    dequantized = checked = 0
    for spec, tensor in zip(opt.installed.inner.specs, opt.installed.inner.tensors, strict=True):
        for key, value in inner.state[tensor].items():
            plain = value.dequantize() if hasattr(value, "dequantize") else value
            got = consolidated["state"][spec.param][key]
            assert type(got) is torch.Tensor and torch.equal(got, plain), (spec.param, key)
            dequantized += plain is not value
            checked += 1
    return {"differ": differ, "checked": checked, "dequantized": dequantized}


def refused_split(rank: int, world: int) -> str:
    """What asking for parameters split across ranks raises, on every rank."""
    try:
        _optimizer(make_model(width=WIDTH), {"optimizer": "AdamW8bit", "stage": 2}, strategy="flat_even")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def refreezes(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Freeze the attention matrices for a step and unfreeze them (``refresh_trainable`` both times),
    next to torchao unsharded, whose optimizer skips a parameter without a gradient."""
    cls = low_bit_class(cfg["optimizer"])
    model = make_model(width=WIDTH)
    opt = _optimizer(model, cfg)
    reference = Reference(make_model(width=WIDTH), cls, **HYPER)
    frozen = [n for n, _ in model.named_parameters() if "qkv.weight" in n]
    for step in range(4):
        if step in (1, 2):
            for name, p in (*model.named_parameters(), *reference.model.named_parameters()):
                if name in frozen:
                    p.requires_grad_(step == 2)
            for m, (name, _) in zip(reference.master, model.named_parameters(), strict=True):
                if name in frozen:
                    m.requires_grad_(step == 2)
            opt.refresh_trainable()
        _step_both(model, opt, reference, rank, world, step)
    return {"differ": _differing(opt, model, reference.model), "quantized": _quantized(opt.inner_optimizer)}
