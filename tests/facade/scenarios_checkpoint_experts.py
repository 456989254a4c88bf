"""Checkpoint directories of optimizers with expert groups: the MoE model of ``moe`` at world 4.

The dense parameters form the data domain (elastic, as without experts); each rank also saves
its expert group's shard of the expert domain into ``experts-experts-<rank>.pt`` of the same
snapshot (see [Note: checkpoint layout]), which loads only at the same world and expert groups.
"""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path
from typing import Any

import moe
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from factory import make_optimizer
from models import DTYPES
from scenarios_checkpoint import _same
from scenarios_experts import OPTIMIZERS, _groups, _loss, _optimizer
from torch.distributed.checkpoint.state_dict import StateDictOptions

from zeroplan.core import ZeroplanError
from zeroplan.facade import ZeroOptimizer, checkpoint
from zeroplan.facade.checkpoint import interchange
from zeroplan.facade.checkpoint import loading as checkpoint_load
from zeroplan.facade.checkpoint.manifest import read_manifest

EXTRA = {"step": 2, "note": ("tuple", 1.5), "schedule": {"warmup": [1, 2.5]}}


def _build(rank: int, world: int, cfg: dict[str, Any], seed: int = 0) -> tuple[moe.MoELM, ZeroOptimizer]:
    """The rank's MoE model (from ``seed``) and its optimizer; ``cfg["groups"]``: expert groups.

    ``"groups": "single"`` gives every rank an expert group of its own (other group sizes than
    ``moe``'s); ``"dense_only"`` builds an optimizer over the dense parameters alone (no experts);
    ``"optimizer"``: ``"adamw"``, ``"sgd"`` or ``"adafactor"``.
    """
    ep, ep_dp = moe.expert_groups(world)
    if cfg.get("groups") == "single":
        singles = [dist.new_group([r]) for r in range(world)]
        ep_dp = singles[rank]
    model = moe.rank_model(moe.full_model(seed=seed, dtype=DTYPES[cfg.get("dtype", "fp32")]), rank, ep)
    if cfg.get("freeze_expert"):  # a frozen expert parameter: saved whole in its group's first file
        model.experts[0].up.bias.requires_grad_(False)
    if cfg.get("dense_only"):
        name = cfg.get("optimizer", "adamw")
        opt = make_optimizer(
            [{"params": model.dense_parameters()}], optimizer=name, hyper=OPTIMIZERS[name][1]
        )
        return model, opt
    if cfg.get("optimizer") == "adafactor":  # whole-parameter state ([Note: state codec]: whole/ leaves)
        return model, make_optimizer(_groups(model, ep_dp, cfg), optimizer="adafactor", hyper={"lr": 1e-2})
    opt, _, _ = _optimizer(model, ep_dp, cfg)
    return model, opt


def _train(model: moe.MoELM, opt: ZeroOptimizer, rank: int, steps: range) -> None:
    for step in steps:
        opt.backward(_loss(model, step, rank))
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def _state(model: moe.MoELM, opt: ZeroOptimizer) -> dict[str, Any]:
    """Everything a load may change, every domain's, bit for bit (this rank's view)."""
    with opt.gathered_params():  # stage 3: whole values to compare
        params = [p.detach().clone() for p in model.parameters()]
    return {
        "params": params,
        # Spaces stepped in place have no master of their own: the parameters are it.
        "masters": [
            [b.master.clone() for b in d.installed.buffers if b.master is not None] for d in opt.domains
        ],
        "inner": [copy.deepcopy(d.installed.inner.optimizer.state_dict()) for d in opt.domains],
        "fingerprints": [d.installed.zp.fingerprint() for d in opt.domains],
        "scale": opt.loss_scale,
        "scaler": opt.scaler_state,
        "groups": [
            copy.deepcopy({k: v for k, v in g.items() if k not in ("params", "process_group")})
            for g in opt.param_groups
        ],
    }


def _await_cleanup() -> None:
    """Wait for the background deletion of old snapshots."""
    for thread in threading.enumerate():
        if thread.name.startswith("zeroplan-checkpoint-cleanup"):
            thread.join()


def round_trip(rank: int, world: int, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    """Save after 2 steps, train 2 more; a fresh model and optimizer loading it train them bit for bit."""
    model, opt = _build(rank, world, cfg)
    _train(model, opt, rank, range(2))
    snapshot = checkpoint.save(opt, root, extra=EXTRA)
    saved = _state(model, opt)["params"]
    _train(model, opt, rank, range(2, 4))
    again, fresh = _build(rank, world, cfg, seed=1)  # other initial values everywhere
    extra = checkpoint.load(fresh, root)
    loaded = all(torch.equal(a, b) for a, b in zip(saved, _state(again, fresh)["params"], strict=True))
    _train(again, fresh, rank, range(2, 4))
    result: dict[str, Any] = {
        "extra": extra,
        "loaded": loaded,
        "same": _same(_state(model, opt), _state(again, fresh)),
    }
    if rank == 0:
        manifest = read_manifest(Path(snapshot))
        result["files"] = sorted(os.listdir(snapshot))
        result["listed"] = sorted(manifest.names)
        result["format"] = manifest.format
        result["experts"] = {d.name: [list(g.ranks) for g in d.groups] for d in manifest.expert_domains}
    return result


def data_domain_is_elastic(rank: int, world: int, root: str) -> dict[str, Any]:
    """Saved with shard groups of 4 for the dense parameters, loaded with shard groups of 2."""
    model, opt = _build(rank, world, {})
    _train(model, opt, rank, range(2))
    checkpoint.save(opt, root)
    again, fresh = _build(rank, world, {"shard": 2}, seed=1)
    checkpoint.load(fresh, root)
    loaded = all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    _train(model, opt, rank, range(2, 4))
    _train(again, fresh, rank, range(2, 4))  # the sums of the gradients may be ordered differently
    close = all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    return {"loaded": loaded, "close": close, "shard_size": fresh.plan.topology.shard_size}


def rotation(rank: int, world: int, root: str) -> dict[str, Any]:
    """Three saves with ``keep=1``: only the last snapshot, with its expert files, remains."""
    model, opt = _build(rank, world, {})
    snapshots = []
    for step in range(3):
        _train(model, opt, rank, range(step, step + 1))
        snapshots.append(str(checkpoint.save(opt, root, keep=1)))
    _await_cleanup()
    dist.barrier()
    again, fresh = _build(rank, world, {}, seed=1)
    checkpoint.load(fresh, root)
    loaded = all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    found = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())
    return {"snapshots": snapshots, "found": found, "loaded": loaded}


def save(rank: int, world: int, cfg: dict[str, Any], root: str) -> None:
    """Train 2 steps and save (``cfg`` as in ``_build``)."""
    model, opt = _build(rank, world, cfg)
    _train(model, opt, rank, range(2))
    checkpoint.save(opt, root, extra=EXTRA)


def _fail(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected failure while reading expert state on rank 3 only")


def failed_load(rank: int, world: int, root: str, cfg: dict[str, Any], fault: bool = False) -> dict[str, Any]:
    """A load that must fail on every rank: the error, and whether anything changed (bit for bit).

    ``fault``: rank 3 fails with an error that is no ``ZeroplanError`` while reading its expert group.
    """
    model, opt = _build(rank, world, cfg, seed=1)
    _train(model, opt, rank, range(1))
    before = _state(model, opt)
    original = checkpoint_load.check_expert_domain
    if fault and rank == 3:
        checkpoint_load.check_expert_domain = _fail
    try:
        checkpoint.load(opt, root)
        error = None
    except ZeroplanError as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        checkpoint_load.check_expert_domain = original
    unchanged = _same(before, _state(model, opt))
    _train(model, opt, rank, range(1, 2))  # every rank is still in step
    return {"error": error, "unchanged": unchanged}


def _fail_expert_writes(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    if path.name.startswith("experts-"):
        raise OSError(28, "No space left on device (injected on rank 3)")
    return _write_tensors(path, tensors)


_write_tensors = checkpoint.write_tensors


def failed_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 3 cannot write its expert file: the save fails on every rank, the last snapshot stays."""
    model, opt = _build(rank, world, {})
    _train(model, opt, rank, range(1))
    first = checkpoint.save(opt, root)
    saved = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, rank, range(1, 2))
    if rank == 3:
        checkpoint.write_tensors = _fail_expert_writes
    try:
        checkpoint.save(opt, root)
        error = None
    except ZeroplanError as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        checkpoint.write_tensors = _write_tensors
    dist.barrier()
    latest = checkpoint.latest(root)
    again, fresh = _build(rank, world, {}, seed=1)
    checkpoint.load(fresh, root)
    loaded = all(torch.equal(a, b) for a, b in zip(saved, again.parameters(), strict=True))
    left = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
    return {"error": error, "latest": str(latest), "first": str(first), "loaded": loaded, "left": left}


def _dcp_state(model: moe.MoELM, opt: ZeroOptimizer) -> dict[str, Any]:
    return {
        "model": interchange.model_state_dict(model, opt),
        "optim": interchange.get_optimizer_state_dict(model, opt),
    }


def dcp_round_trip(rank: int, world: int, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    """Saved with DCP after 2 steps; a fresh run of ``cfg["load"]`` (another stage or group size) loads
    it bit for bit and trains on like the saving run; whole-tensor dicts are refused on every rank."""
    model, opt = _build(rank, world, cfg)
    _train(model, opt, rank, range(2))
    dcp.save(_dcp_state(model, opt), checkpoint_id=root)
    saved = _state(model, opt)
    again, fresh = _build(rank, world, {**cfg, **cfg.get("load", {})}, seed=1)
    state = _dcp_state(again, fresh)
    dcp.load(state, checkpoint_id=root)
    interchange.load_model_state_dict(again, fresh, state["model"])
    interchange.set_optimizer_state_dict(again, fresh, state["optim"])
    loaded = _state(again, fresh)
    out: dict[str, Any] = {
        "params": all(torch.equal(a, b) for a, b in zip(saved["params"], loaded["params"], strict=True)),
        "same": _same(saved, loaded) if not cfg.get("load") else None,
    }
    _train(model, opt, rank, range(2, 4))
    _train(again, fresh, rank, range(2, 4))
    after, after_loaded = _state(model, opt), _state(again, fresh)
    out["trained_alike"] = all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        for a, b in zip(after["params"], after_loaded["params"], strict=True)
    )
    out["bit_for_bit"] = all(
        torch.equal(a, b) for a, b in zip(after["params"], after_loaded["params"], strict=True)
    )
    full = StateDictOptions(full_state_dict=True)
    calls = {
        "model": lambda: interchange.model_state_dict(model, opt, options=full),
        "optim": lambda: interchange.get_optimizer_state_dict(model, opt, options=full),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ZeroplanError as exc:
            out[name] = str(exc)
    return out
