"""Scenarios of CPU offload ([Note: offload, executed] in ``zeroplan.core.host_step``).

Run on every rank of a worker pool (see dist_worker.py); each returns plain data. On the CPU host
memory is the device's: an offloaded run takes the path it takes beside a GPU (reduced into device
rooms, copied into the host shard, stepped unit by unit, copied back) and must equal the run
without offload bit for bit.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import optree
import torch
from factory import OPTIMIZERS, make_optimizer
from models import DTYPES, batch, loss_of, make_model

from zeroplan.core import Residence, memory_report, step_units
from zeroplan.facade import checkpoint
from zeroplan.facade.diagnostics.accounting import measure_residences

#: Settings a case may carry besides ``stage``, ``dtype``, ``offload``, ``clip`` and ``steps``.
_SETTINGS = (
    "loss_scale",
    "deterministic",
    "shard",
    "layout",
    "optimizer",
    "reshard_after_forward",
    "reduce_dtype",
    "gather_dtype",
    "wire_block",
    "offload_fraction",
)


def _pair(cfg: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The same model twice: an optimizer without offload, and one with ``cfg["offload"]``."""
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    models = [make_model(dtype=dtype) for _ in range(2)]
    if cfg.get("fresh_at"):  # frozen until then: unfrozen with no optimizer state yet
        for m in models:
            m.blocks[1].fc.weight.requires_grad_(False)
    settings = {k: cfg[k] for k in _SETTINGS if k in cfg}
    offloaded = make_optimizer(
        models[1], stage=cfg["stage"], offload=cfg.get("offload", "optimizer"), **settings
    )
    # The run without offload steps with the kernel the offloaded one chose (fused on the CPU, where
    # the class has one: state.inner.host_kernel), so that both run the same arithmetic.
    hyper = _same_kernel(offloaded, cfg.get("optimizer", "adamw"))
    plain = {k: v for k, v in settings.items() if k != "offload_fraction"}
    opts = [make_optimizer(models[0], stage=cfg["stage"], hyper=hyper, **plain), offloaded]
    if cfg["stage"] == 3:
        for m, opt in zip(models, opts, strict=True):
            opt.attach(m)
    return models, opts


def _same_kernel(offloaded: Any, optimizer: str) -> dict[str, Any]:
    """The scenarios' hyper-parameters of ``optimizer`` with the kernel the offloaded optimizer chose
    (fused on the CPU where the class has one: ``state.inner.host_kernel``), so that a run without
    offload runs the same arithmetic."""
    chosen = offloaded.param_groups[0]
    kernel = {k: chosen[k] for k in ("fused", "foreach") if chosen.get(k) is not None}
    return {**OPTIMIZERS[optimizer].hyper, **kernel}


def _train(rank: int, models: list[Any], opts: list[Any], cfg: dict[str, Any]) -> list[bool]:
    """Train both side by side; per step, whether their parameters are bit-identical."""
    equal = []
    micro = cfg.get("accumulate", 1)
    for step in range(cfg.get("steps", 3)):
        if cfg.get("replan") and step in (1, 2):  # freeze a trained layer, then unfreeze it: re-planning
            for m, opt in zip(models, opts, strict=True):
                m.blocks[1].fc.weight.requires_grad_(step == 2)
                opt.refresh_trainable()
        if step == cfg.get("fresh_at"):
            for m, opt in zip(models, opts, strict=True):
                m.blocks[1].fc.weight.requires_grad_(True)
                opt.refresh_trainable()
        if cfg.get("load") and step == 1:  # model.load_state_dict outside a forward: the masters take it
            weights = make_model(seed=1, dtype=DTYPES[cfg.get("dtype", "fp32")]).state_dict()
            for m in models:
                m.load_state_dict(weights)
        for m, opt in zip(models, opts, strict=True):
            for k in range(micro):  # no_sync() around all but the last micro-batch
                tokens, targets = batch(step * micro + k, rank)
                with opt.no_sync() if k < micro - 1 else contextlib.nullcontext():
                    opt.backward(loss_of(m, tokens, targets))
            if cfg.get("clip"):
                opt.clip_grad_norm_(cfg["clip"])
            opt.step()
            opt.zero_grad()
        with opts[0].gathered_params(), opts[1].gathered_params():
            pairs = zip(models[0].parameters(), models[1].parameters(), strict=True)
            equal.append(all(torch.equal(a.detach(), b.detach()) for a, b in pairs))
    return equal


def _max_diff(models: list[Any], opts: list[Any]) -> float:
    """The largest difference between the two models' parameters."""
    with opts[0].gathered_params(), opts[1].gathered_params():
        pairs = zip(models[0].parameters(), models[1].parameters(), strict=True)
        return max(float((a.detach().float() - b.detach().float()).abs().max()) for a, b in pairs)


def _state_leaves(opts: list[Any]) -> list[tuple[Any, Any]] | None:
    """Both optimizers' state dicts, leaf beside leaf; ``None`` when their structures differ."""
    leaves, specs = zip(*(optree.tree_flatten(opt.state_dict()["state"]) for opt in opts), strict=True)
    return list(zip(*leaves, strict=True)) if specs[0] == specs[1] else None


def _state_equal(opts: list[Any]) -> bool:
    """Both optimizers' state dicts, leaf for leaf (tensors bit for bit)."""
    pairs = _state_leaves(opts)
    return pairs is not None and all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in pairs)


def _state_rel_diff(opts: list[Any]) -> float:
    """The largest difference between the two optimizers' state tensors, relative to the larger
    value (0.0: bit for bit; ``inf``: their structures differ)."""
    pairs = _state_leaves(opts)
    if pairs is None:
        return float("inf")
    most = 0.0
    for a, b in pairs:
        if not torch.is_tensor(a):
            most = max(most, 0.0 if a == b else float("inf"))
            continue
        parts = zip(a.parts, b.parts, strict=True) if hasattr(a, "parts") else [((None, a), (None, b))]
        for (_, x), (_, y) in parts:
            x, y = x.double(), y.double()
            scale = torch.maximum(x.abs(), y.abs()).clamp_min(torch.finfo(torch.float32).tiny)
            if x.numel():
                most = max(most, float(((x - y).abs() / scale).max()))
    return most


def offloaded_against_default(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Each case of ``cfg["cases"]`` trained with and without offload side by side."""
    results = []
    for case in cfg["cases"]:
        models, opts = _pair(case)
        equal = _train(rank, models, opts, case)
        installed = opts[1].installed
        results.append(
            {
                "equal": equal,
                "state": _state_equal(opts),
                "state_rel_diff": _state_rel_diff(opts),
                "units": len(step_units(opts[1].plan, installed.groups.shard_rank)),
                "host": [role.value for role in opts[1].plan.residences.host],
                "stepping": type(installed.stepping).__name__,
                "scales": [opt.loss_scale for opt in opts],
                "fused": opts[1].installed.inner.optimizer.param_groups[0].get("fused"),
                "kept": [buf.kept for buf in installed.buffers],
                "extent": [buf.extent for buf in installed.buffers],
                "max_diff": _max_diff(models, opts),
            }
        )
    return results


def host_bytes_measured(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case, planned host and device bytes of the offloaded optimizer against the bytes its live
    buffers hold, counted by the residence of each buffer's role, after a step (state exists)."""
    results = []
    for case in cfg["cases"]:
        models, opts = _pair(case)
        _train(rank, models, opts, {**case, "steps": 1})
        opt = opts[1]
        shard_rank = opt.installed.groups.shard_rank
        report = next(r for r in memory_report(opt.plan).ranks if r.shard_rank == shard_rank)
        held = measure_residences(opt.installed, opt._data.registry.params)
        results.append(
            {
                "planned": [report.host_bytes, report.device_bytes],
                "held": [held[Residence.HOST], held[Residence.DEVICE]],
            }
        )
    return results


def _consolidated(opt: Any) -> dict[str, Any]:
    return opt.consolidated_state_dict(to_rank=0)


def save_offloaded(rank: int, world: int, cfg: dict[str, Any], root: str) -> None:
    """Train an offloaded optimizer 3 steps and save a checkpoint; rank 0 keeps the consolidated
    state and the parameters beside it."""
    model = make_model(dtype=DTYPES[cfg.get("dtype", "fp32")])
    opt = make_optimizer(
        model,
        stage=cfg["stage"],
        offload=cfg.get("offload", "optimizer"),
        offload_fraction=cfg.get("fraction"),
    )
    if cfg["stage"] == 3:
        opt.attach(model)
    for step in range(3):
        opt.backward(loss_of(model, *batch(step, rank)))
        opt.step()
        opt.zero_grad()
    checkpoint.save(opt, root)
    consolidated = _consolidated(opt)
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    if rank == 0:
        torch.save({"consolidated": consolidated, "params": params}, os.path.join(root, "reference.pt"))


def load_with_and_without_offload(rank: int, world: int, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    """Load the checkpoint at this world into an optimizer without offload and one with it: both
    hold the saved state bit for bit, and train on bit-identically."""
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    models = [make_model(dtype=dtype, seed=123) for _ in range(2)]
    offloaded = make_optimizer(
        models[1],
        stage=cfg["load_stage"],
        offload=cfg.get("load_offload", "optimizer"),
        offload_fraction=cfg.get("load_fraction"),
    )
    opts = [
        make_optimizer(models[0], stage=cfg["load_stage"], hyper=_same_kernel(offloaded, "adamw")),
        offloaded,
    ]
    for m, opt in zip(models, opts, strict=True):
        if cfg["load_stage"] == 3:
            opt.attach(m)
        checkpoint.load(opt, root)
    states = [_consolidated(opt) for opt in opts]
    result: dict[str, Any] = {}
    if rank == 0:
        reference = torch.load(os.path.join(root, "reference.pt"), weights_only=True)
        result["state_same"] = [_tree_equal(reference["consolidated"], s) for s in states]
        gathered = []
        for m, opt in zip(models, opts, strict=True):
            with opt.gathered_params():
                gathered.append([p.detach().clone() for p in m.parameters()])
        result["params_same"] = [_tree_equal(reference["params"], g) for g in gathered]
    result["equal"] = _train(rank, models, opts, {"steps": 2})
    return result


def _tree_equal(a: Any, b: Any) -> bool:
    """Two trees of the same structure, tensors bit for bit."""
    leaves_a, spec_a = optree.tree_flatten(a)
    leaves_b, spec_b = optree.tree_flatten(b)
    return spec_a == spec_b and all(
        torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def refused(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Construct with ``case`` (its ``one_rank`` setting on rank 1 only): the error, and whether the
    parameters kept their values and storage."""
    model = make_model()
    before = [(p.detach().clone(), p.data_ptr()) for p in model.parameters()]
    settings = {k: v for k, v in case.items() if k != "one_rank"}
    if case.get("one_rank") and rank != 1:
        settings.pop(case["one_rank"], None)
    try:
        make_optimizer(model, **settings)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    unchanged = all(
        torch.equal(p.detach(), v) and p.data_ptr() == ptr
        for p, (v, ptr) in zip(model.parameters(), before, strict=True)
    )
    return {"error": error, "unchanged": unchanged}
