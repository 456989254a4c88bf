"""Checkpoint scenarios: round trips, elastic loads, plain torch dicts, failures, bounded consolidation."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from factory import OPTIMIZERS, make_optimizer
from models import DTYPES, batch, loss_of, make_model
from torch.distributed._tools.mem_tracker import MemTracker

from zeroplan.core import DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES, ScalerConfig, ZeroplanError
from zeroplan.facade import ZeroOptimizer, checkpoint
from zeroplan.facade.checkpoint import loading as checkpoint_load
from zeroplan.facade.diagnostics.meter import tracked_bytes


def _optimizer(model: torch.nn.Module, cfg: dict[str, Any]) -> ZeroOptimizer:
    if cfg.get("frozen"):
        # Frozen parameters are saved and loaded too; they keep their own storage, which need
        # not be contiguous (same values, transposed layout).
        frozen = model.pos.weight.detach()
        model.pos.weight = torch.nn.Parameter(frozen.t().contiguous().t(), requires_grad=False)
        assert not model.pos.weight.is_contiguous()
    optimizer = cfg.get("optimizer", "adamw")
    return make_optimizer(
        model,
        optimizer=optimizer,
        hyper=OPTIMIZERS[optimizer].plain,
        stage=cfg.get("stage", 2),
        shard=cfg.get("shard"),
        bucket_bytes=1024,
        alignment=cfg.get("alignment", 8),
        strategy=cfg.get("strategy", "auto"),
        loss_scale="dynamic" if cfg.get("dtype") == "fp16" else None,
        scaler=ScalerConfig(initial_scale=2.0**10, growth_interval=2),
    )


def _train(model: torch.nn.Module, opt: ZeroOptimizer, rank: int, steps: range) -> None:
    for step in steps:
        opt.backward(loss_of(model, *batch(step, rank)))
        opt.step()
        opt.zero_grad()


def _snapshot(model: torch.nn.Module, opt: ZeroOptimizer) -> dict[str, Any]:
    """Everything that must survive a failed load, bit for bit (local view)."""
    inner = opt.inner_optimizer
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [b.master.clone() for b in opt.buffers if b.master is not None],  # else: the parameters
        "state": copy.deepcopy(inner.state_dict()),
        "inner_state": [
            copy.deepcopy(dict(inner.state.get(t, {}))) for g in inner.param_groups for t in g["params"]
        ],
        "scale": opt.loss_scale,
        "scaler": opt.scaler_state,
        "groups": copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if torch.is_tensor(x):
            # bitwise: -0.0 differs from 0.0 and NaN equals itself
            return (
                torch.is_tensor(y)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and bool(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
            )
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y, strict=True))
        return x == y

    return eq(a, b)


def sharded_round_trip(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """state_dict() after 2 steps, load into a fresh optimizer: the next steps are bit-identical."""
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    model = make_model(dtype=dtype)
    opt = _optimizer(model, cfg)
    _train(model, opt, rank, range(3))
    sd = opt.state_dict()
    model_sd = copy.deepcopy(model.state_dict())
    scale = opt.loss_scale
    _train(model, opt, rank, range(3, 6))
    twin = make_model(dtype=dtype)
    twin.load_state_dict(model_sd)
    opt2 = _optimizer(twin, cfg)
    opt2.load_state_dict(sd)
    restored_scale = opt2.loss_scale
    _train(twin, opt2, rank, range(3, 6))
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    return {
        "same": same,
        "scale": scale,
        "restored_scale": restored_scale,
        "final_scale": opt.loss_scale,
        "twin_final_scale": opt2.loss_scale,
    }


def save_reference(rank: int, world: int, cfg: dict[str, Any], root: str) -> None:
    """Train and save a checkpoint; rank 0 also keeps the consolidated state and parameters."""
    model = make_model(dtype=DTYPES[cfg.get("dtype", "fp32")])
    opt = _optimizer(model, cfg)
    _train(model, opt, rank, range(3))
    checkpoint.save(opt, root, extra={"step": 3, "note": ("tuple", 1.5)})
    consolidated = opt.consolidated_state_dict(to_rank=0)
    if rank == 0:
        torch.save(
            {"consolidated": consolidated, "params": [p.detach() for p in model.parameters()]},
            os.path.join(root, "reference.pt"),
        )


def load_and_compare(rank: int, world: int, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    """Load at this world/shard/strategy; the consolidated state equals the saved one bit for bit."""
    model = make_model(dtype=DTYPES[cfg.get("dtype", "fp32")], seed=123)  # other initial values
    opt = _optimizer(model, cfg)
    extra = checkpoint.load(opt, root)
    consolidated = opt.consolidated_state_dict(to_rank=0)
    result: dict[str, Any] = {"extra": extra, "strategy": opt.plan.partition.strategy}
    if rank == 0:
        reference = torch.load(os.path.join(root, "reference.pt"), weights_only=True)
        result["state_same"] = _same(reference["consolidated"], consolidated)
        result["params_same"] = all(
            torch.equal(a, b) for a, b in zip(reference["params"], model.parameters(), strict=True)
        )
    _train(model, opt, rank, range(3, 5))  # and training goes on
    return result


def plain_torch_round_trip(rank: int, world: int, dtype_name: str) -> dict[str, Any]:
    """torch.optim.AdamW -> ZeroOptimizer -> torch.optim.AdamW keeps every state tensor."""
    dtype = DTYPES[dtype_name]
    torch_model = make_model()
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    for step in range(2):  # an unsharded run (the same on every rank)
        loss_of(torch_model, *batch(step, 0)).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    plain = torch_opt.state_dict()
    model = make_model(dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in torch_model.state_dict().items()})
    opt = make_optimizer(model, hyper={"lr": 1e-2}, bucket_bytes=1024, alignment=8)
    opt.load_state_dict(plain)
    back = opt.consolidated_state_dict(to_rank=None)
    state_same = all(
        torch.equal(plain["state"][i][k].to(back["state"][i][k].dtype), back["state"][i][k])
        for i in plain["state"]
        for k in plain["state"][i]
    )
    groups_same = [{k: v for k, v in g.items()} for g in plain["param_groups"]] == back["param_groups"]
    reloaded = torch.optim.AdamW(make_model().parameters(), lr=5.0)
    reloaded.load_state_dict(back)
    return {
        "state_same": state_same,
        "groups_same": groups_same,
        "lr": reloaded.param_groups[0]["lr"],
        "masters": "zeroplan_master" in back,
    }


def _fail_on_rank_one(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected failure while reading on rank 1 only")


def failed_loads(
    rank: int, world: int, root: str, case: str, cfg: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A load that must fail: the error is clear and nothing changes, bit for bit.

    ``cfg``: the optimizer that loads (default: bf16 AdamW, as ``save_reference`` saved it).
    """
    cfg = dict(cfg or {"dtype": "bf16"})
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    model = make_model(dtype=dtype, width=32 if case == "other_model" else 24)
    if case == "other_optimizer":
        cfg["optimizer"] = "sgd"
    opt = _optimizer(model, cfg)
    _train(model, opt, rank, range(2))
    before = _snapshot(model, opt)
    target = root
    if case == "partial":
        target = next(str(p) for p in Path(root).glob("*.partial"))
    # A failure that is no ZeroplanError, on one rank only, in the middle of reading.
    patched = case == "fault_on_one_rank" and rank == 1
    original = checkpoint_load.plan_reshard
    if patched:
        checkpoint_load.plan_reshard = _fail_on_rank_one
    try:
        checkpoint.load(opt, target)
        error = None
    except ZeroplanError as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        checkpoint_load.plan_reshard = original
    after = _snapshot(model, opt)
    _train(model, opt, rank, range(2, 3))  # still trains
    return {"error": error, "unchanged": _same(before, after)}


def failed_state_dict_loads(rank: int, world: int) -> dict[str, Any]:
    """Sharded dicts of another plan and plain dicts of another model: clear errors, nothing changed."""
    model = make_model()
    opt = _optimizer(model, {})
    _train(model, opt, rank, range(2))
    other = _optimizer(make_model(), {"alignment": 16})
    foreign = other.state_dict()
    bad_plain = opt.consolidated_state_dict(to_rank=None)
    first = next(iter(bad_plain["state"]))
    bad_plain["state"][first]["exp_avg"] = torch.zeros(3, 3)
    before = _snapshot(model, opt)
    errors = {}
    for name, sd in {"other_plan": foreign, "bad_shape": bad_plain, "not_a_dict": {"x": 1}}.items():
        try:
            opt.load_state_dict(sd)
            errors[name] = None
        except ZeroplanError as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return {"errors": errors, "unchanged": _same(before, _snapshot(model, opt))}


def _bad_on_rank_one(case: str, opt: ZeroOptimizer, rank: int) -> dict[str, Any]:
    """The dict each rank loads in ``state_dict_bad_on_one_rank``: valid on rank 0, not on rank 1."""
    if case == "sharded":  # each rank's own dict; rank 1's has a state tensor of the wrong size
        sd = opt.state_dict()
        if rank == 1:
            key = next(k for k in sd["zeroplan_state"] if k.startswith("flat/"))
            sd["zeroplan_state"][key] = torch.zeros(3)
        return sd
    plain = opt.consolidated_state_dict(to_rank=None)
    del plain["state"][0]  # parameter 0 starts fresh: a new cohort, so loading re-plans
    if case == "plain_bad_shape" and rank == 1:
        plain["state"][1]["exp_avg"] = torch.zeros(3, 3)
    if case == "plain_not_a_dict" and rank == 1:
        plain = {"x": 1}
    if case == "plain_other_steps" and rank == 1:  # valid, but another plan than rank 0's dict
        plain["state"][1]["step"] = plain["state"][1]["step"] + 1
    if case == "plain_other_lr" and rank == 1:  # valid, but other hyper-parameters
        plain["param_groups"][0]["lr"] = 0.5
    return plain


def state_dict_bad_on_one_rank(rank: int, world: int, case: str) -> dict[str, Any]:
    """``load_state_dict`` with a dict only rank 1 rejects (or that differs on rank 1): every rank raises."""
    dtype = "fp16" if case == "sharded" else "bf16"  # fp16: the loss scaler must stay unchanged too
    model = make_model(dtype=DTYPES[dtype])
    opt = _optimizer(model, {"dtype": dtype})
    _train(model, opt, rank, range(2))
    sd = _bad_on_rank_one(case, opt, rank)
    before = _snapshot(model, opt)
    try:
        opt.load_state_dict(sd)
        error = None
    except ZeroplanError as exc:
        error = f"{type(exc).__name__}: {exc}"
    after = _snapshot(model, opt)
    _train(model, opt, rank, range(2, 3))  # still trains, in step on every rank
    return {"error": error, "unchanged": _same(before, after)}


def bounded_consolidation(rank: int, world: int, chunk_bytes: int) -> dict[str, Any]:
    """Tensor bytes consolidated_state_dict adds on each rank at its peak, by torch's ``MemTracker``.

    The tracker is entered before the model is built, so it knows every storage; re-entered around
    the consolidation, its peak minus what it held on entry is what the call allocated (the result
    included). Process RSS would also count allocator and pool-history noise.
    """
    torch.manual_seed(0)
    tracker = MemTracker()
    with tracker:
        # ~2.1M params: 17 MB of AdamW state
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        opt = make_optimizer(
            model, hyper={"lr": 1e-3}, bucket_bytes=DEFAULT_BUCKET_BYTES, alignment=DEFAULT_ALIGNMENT
        )
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        opt.zero_grad()
    state_bytes = sum(p.numel() for p in model.parameters()) * 4 * 2
    entry = tracked_bytes(tracker)
    tracker.reset_mod_stats()
    with tracker:
        result = opt.consolidated_state_dict(to_rank=0, chunk_bytes=chunk_bytes)
        extra = tracked_bytes(tracker, "peak") - entry
    output = (
        0
        if result is None
        else sum(
            v.numel() * v.element_size()
            for e in result["state"].values()
            for v in e.values()
            if torch.is_tensor(v)
        )
    )
    return {"extra": extra, "output": output, "state_bytes": state_bytes}


def latest_snapshot(rank: int, world: int, root: str) -> dict[str, Any]:
    """``checkpoint.latest``: none before the first save, the committed snapshot after it."""
    model = make_model()
    opt = _optimizer(model, {})
    before = checkpoint.latest(root)
    checkpoint.save(opt, root)
    first = checkpoint.latest(root)
    checkpoint.save(opt, root)
    second = checkpoint.latest(root)
    return {"before": before, "first": str(first), "second": str(second)}
