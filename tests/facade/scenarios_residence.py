"""Scenarios of buffer residences ([Note: residences] in ``zeroplan.core.residence``).

Run on every rank of a worker pool (see dist_worker.py); each returns plain data.
"""

from __future__ import annotations

from functools import partial
from typing import Any
from unittest import mock

import torch
from factory import make_optimizer
from models import DTYPES, batch, loss_of, make_model

from zeroplan.core import Residences, memory_report, plan
from zeroplan.facade.runtime import registry


def placed_on_host_against_default(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Two identical models, one planned with ``cfg["host"]`` in host memory (the CPU's own memory
    here), trained side by side: the buffers are where the plan says and the steps are bit-identical."""
    dtype = DTYPES[cfg.get("dtype", "bf16")]
    models = [make_model(dtype=dtype) for _ in range(2)]
    opts = [make_optimizer(models[0], stage=cfg["stage"])]
    where = Residences(host=tuple(cfg["host"]))
    with mock.patch.object(registry, "plan", partial(plan, residences=where)):  # no user setting yet
        opts.append(make_optimizer(models[1], stage=cfg["stage"]))
    if cfg["stage"] == 3:
        for m, opt in zip(models, opts, strict=True):
            opt.attach(m)
    equal = []
    for step in range(cfg.get("steps", 3)):
        tokens, targets = batch(step, rank)
        for m, opt in zip(models, opts, strict=True):
            opt.backward(loss_of(m, tokens, targets))
            opt.step()
            opt.zero_grad()
        with opts[0].gathered_params(), opts[1].gathered_params():
            pairs = zip(models[0].parameters(), models[1].parameters(), strict=True)
            equal.append(all(torch.equal(a.detach(), b.detach()) for a, b in pairs))
    zp = opts[1].plan
    report = memory_report(zp).ranks[rank]
    installed = opts[1]._data.installed
    devices = {
        t.device.type for buf in installed.buffers for t in (buf.grad_shard, buf.master) if t is not None
    }
    return {
        "equal": equal,
        "host": [role.value for role in zp.residences.host],
        "host_bytes": report.host_bytes,
        "device_bytes": report.device_bytes,
        "default_device_bytes": memory_report(opts[0].plan).ranks[rank].device_bytes,
        # Stepped in host memory, the inner optimizer's windows are cut where buckets start
        # ([Note: offload, executed]): a few more scalars of state (AdamW's step) than the default's.
        "more_state_bytes": report.optimizer_state_bytes
        - memory_report(opts[0].plan).ranks[rank].optimizer_state_bytes,
        "devices": sorted(devices | {installed.sync.arena.device.type}),
    }
