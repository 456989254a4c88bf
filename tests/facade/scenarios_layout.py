"""Scenarios of the interleaved layout and the overlapped parameter gather (issue 12).

Run on every rank of a worker pool (see dist_worker.py); each returns plain data.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist
from factory import make_optimizer
from models import DTYPES, batch, loss_of, make_model

from zeroplan.facade import checkpoint
from zeroplan.facade.params.gather import GatheringParameter


def _values(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters' values, read the way an EMA or a logger reads them (no forward first)."""
    return [p.detach().clone() for p in model.parameters()]


def overlap_against_waiting(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Two identical models, one with ``overlap_param_gather`` and one without, trained side by side.

    After every ``step()`` the overlapped model is read before any forward, in a different way each
    step (raw values, ``state_dict()``, an EMA update, a forward), and compared with the waiting one.
    """
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    models = [make_model(dtype=dtype) for _ in range(2)]
    settings = {k: cfg[k] for k in ("stage", "shard", "layout", "collectives", "strategy") if k in cfg}
    opts = [
        make_optimizer(
            m, overlap_param_gather=overlap, bucket_bytes=cfg.get("bucket_bytes", 2048), **settings
        )
        for m, overlap in zip(models, (True, False), strict=True)
    ]
    emas = [[p.detach().clone().float() for p in m.parameters()] for m in models]
    deferred, equal, losses = [], [], []
    comm: list[tuple[str, str]] = []
    for step in range(cfg.get("steps", 4)):
        tokens, targets = batch(step, rank)
        step_losses = []
        for m, opt in zip(models, opts, strict=True):
            loss = loss_of(m, tokens, targets)
            step_losses.append(float(loss))
            opt.backward(loss)
            opt.step()
            opt.zero_grad()  # metadata only: does not wait for the gathers
        losses.append(step_losses[0] == step_losses[1])
        comm = sorted({(c.group, str(c.collective)) for c in opts[0].last_step_comm()})
        deferred.append(any(type(p) is GatheringParameter for p in models[0].parameters()))
        way = step % 3
        if way == 0:
            equal.append(all(torch.equal(a, b) for a, b in zip(*map(_values, models), strict=True)))
        elif way == 1:
            first, second = (m.state_dict() for m in models)
            equal.append(all(torch.equal(first[k], second[k]) for k in first))
        else:
            for ema, m in zip(emas, models, strict=True):
                for e, p in zip(ema, m.parameters(), strict=True):
                    e.mul_(0.9).add_(p, alpha=0.1)  # a raw read, as an EMA of the weights does
            equal.append(all(torch.equal(a, b) for a, b in zip(*emas, strict=True)))
    in_flight_after_forward = None
    if cfg.get("steps", 4) > 0:
        loss_of(models[0], *batch(99, rank))
        in_flight_after_forward = any(type(p) is GatheringParameter for p in models[0].parameters())
    return {
        "deferred": deferred,
        "equal": equal,
        "losses_equal": losses,
        "comm": comm,
        "after_forward": in_flight_after_forward,
        "layout": opts[0].plan.partition.layout,
        "collectives": sorted({str(b.collective) for b in opts[0].plan.buckets.buckets}),
    }


def across_layouts(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Save with one layout, load into another (and another shard size): state and values bit-exact."""
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    model = make_model(dtype=dtype)
    opt = make_optimizer(model, layout=cfg["save_layout"], shard=cfg.get("save_shard"))
    for step in range(2):
        loss = loss_of(model, *batch(step, rank))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    checkpoint.save(opt, root[0])
    expected_state = opt.consolidated_state_dict(None)
    expected_values = _values(model)
    other_model = make_model(dtype=dtype, seed=7)
    other = make_optimizer(other_model, layout=cfg["load_layout"], shard=cfg.get("load_shard"))
    checkpoint.load(other, root[0])
    state = other.consolidated_state_dict(None)
    values_equal = all(torch.equal(a, b) for a, b in zip(expected_values, _values(other_model), strict=True))
    state_equal = all(
        torch.equal(a, b)
        for p in expected_state["state"]
        for k, a in expected_state["state"][p].items()
        if torch.is_tensor(a)
        for b in [state["state"][p][k]]
    )
    # One more step on each: they stay identical.
    for m, o in ((model, opt), (other_model, other)):
        loss = loss_of(m, *batch(5, rank))
        o.backward(loss)
        o.step()
        o.zero_grad()
    after = max(
        float((a.float() - b.float()).abs().max())
        for a, b in zip(_values(model), _values(other_model), strict=True)
    )
    return {
        "layouts": (opt.plan.partition.layout, other.plan.partition.layout),
        "values_equal": values_equal,
        "state_equal": state_equal,
        "after_step_diff": after,
    }


def first_read_waits_for_its_chunk_only(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """After ``step()``, reading the first parameter completes its own gather, not the whole model's
    ([Note: gather blocks]): the parameters of later chunks are still in flight."""
    model = make_model()
    settings = {k: cfg[k] for k in ("stage", "layout", "collectives") if k in cfg}
    opt = make_optimizer(model, bucket_bytes=cfg.get("bucket_bytes", 2048), **settings)
    opt.backward(loss_of(model, *batch(0, rank)))
    opt.step()
    params = list(model.parameters())
    in_flight_before = sum(type(p) is GatheringParameter for p in params)
    params[0].sum()  # a first read of the first parameter (as the forward's first layer does)
    in_flight_after = sum(type(p) is GatheringParameter for p in params)
    opt.wait_for_params()
    return {
        "layout": opt.plan.partition.layout,
        "chunks": [len(opt.plan.gather_blocks(space)) for space in opt.plan.partition.spaces],
        "in_flight_before": in_flight_before,
        "in_flight_after": in_flight_after,
        "first_waiting_after": type(params[0]) is GatheringParameter,
        "params": len(params),
    }


def tensor_attributes(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """What a few steps leave written onto the user's parameters (``p.__dict__``): nothing of ours."""
    model = make_model()
    opt = make_optimizer(model, stage=cfg["stage"])
    opt.attach(model)
    seen: set[str] = set()
    for step in range(2):
        opt.backward(loss_of(model, *batch(step, rank)))
        opt.step()  # stages 1-2: the gathers in flight; stage 3: every block sharded
        seen |= {name for p in model.parameters() for name in vars(p)}
        opt.zero_grad()
    return {"attributes": sorted(seen)}
