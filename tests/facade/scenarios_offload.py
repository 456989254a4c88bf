"""Scenarios of CPU offload ([Note: offload, executed] in ``zeroplan.core.host_step``).

Run on every rank of a worker pool (see dist_worker.py); each returns plain data. On the CPU host
memory is the device's: an offloaded run takes the path it takes beside a GPU (reduced into device
rooms, copied into the host shard, stepped unit by unit, copied back) and must equal the run
without offload bit for bit.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from factory import make_optimizer
from models import DTYPES, batch, loss_of, make_model

from zeroplan.core import Residence, memory_report, step_units
from zeroplan.facade.diagnostics.accounting import measure_residences

#: Settings a case may carry besides ``stage``, ``dtype``, ``offload``, ``clip`` and ``steps``.
_SETTINGS = ("loss_scale", "deterministic", "shard", "layout", "optimizer", "reshard_after_forward")


def _pair(cfg: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The same model twice: an optimizer without offload, and one with ``cfg["offload"]``."""
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    models = [make_model(dtype=dtype) for _ in range(2)]
    settings = {k: cfg[k] for k in _SETTINGS if k in cfg}
    opts = [
        make_optimizer(models[0], stage=cfg["stage"], **settings),
        make_optimizer(models[1], stage=cfg["stage"], offload=cfg.get("offload", "optimizer"), **settings),
    ]
    if cfg["stage"] == 3:
        for m, opt in zip(models, opts, strict=True):
            opt.attach(m)
    return models, opts


def _train(rank: int, models: list[Any], opts: list[Any], cfg: dict[str, Any]) -> list[bool]:
    """Train both side by side; per step, whether their parameters are bit-identical."""
    equal = []
    for step in range(cfg.get("steps", 3)):
        tokens, targets = batch(step, rank)
        for m, opt in zip(models, opts, strict=True):
            opt.backward(loss_of(m, tokens, targets))
            if cfg.get("clip"):
                opt.clip_grad_norm_(cfg["clip"])
            opt.step()
            opt.zero_grad()
        with opts[0].gathered_params(), opts[1].gathered_params():
            pairs = zip(models[0].parameters(), models[1].parameters(), strict=True)
            equal.append(all(torch.equal(a.detach(), b.detach()) for a, b in pairs))
    return equal


def _state_equal(opts: list[Any]) -> bool:
    """Both optimizers' state dicts, leaf for leaf (tensors bit for bit)."""
    leaves, specs = zip(*(optree.tree_flatten(opt.state_dict()["state"]) for opt in opts), strict=True)
    if specs[0] != specs[1]:
        return False
    return all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(*leaves, strict=True))


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
                "units": len(step_units(opts[1].plan, installed.groups.shard_rank)),
                "host": [role.value for role in opts[1].plan.residences.host],
                "stepping": type(installed.stepping).__name__,
                "scales": [opt.loss_scale for opt in opts],
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
