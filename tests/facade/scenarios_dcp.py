"""Scenarios for ``test_dcp``: torch.distributed.checkpoint between zeroplan and FSDP2, both ways.

zeroplan's recipe: ``{"model": interchange.model_state_dict(model, opt), "optim":
get_optimizer_state_dict(model, opt)}``; FSDP2's: torch's own. Each side trains, saves with
``dcp.save``, and the other side's fresh run loads with ``dcp.load``.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from factory import make_optimizer
from models import DTYPES, Reference, averaged_grads, batch, loss_of, make_model, rel_err
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from zeroplan.core import ZeroplanError
from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.checkpoint import interchange

LR = 0.01


def _zeroplan(cfg: dict[str, Any]) -> tuple[Any, Any]:
    model = make_model(seed=0, dtype=DTYPES[cfg.get("dtype", "fp32")])
    opt = make_optimizer(model, stage=cfg["stage"], hyper={"lr": LR}, **cfg.get("settings", {}))
    if cfg["stage"] == 3:
        opt.attach(model)
    return model, opt


def _fsdp2(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """FSDP2 on the same model: fp32 parameters, computing in the zeroplan run's dtype."""
    model = make_model(seed=0, dtype=torch.float32)
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _train(model: Any, opt: Any, rank: int, steps: range) -> None:
    for step in steps:
        loss = loss_of(model, *batch(step, rank))
        opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
        opt.step()
        opt.zero_grad()


def _maybe_compiled(model: Any, cfg: dict[str, Any]) -> Any:
    """``torch.compile(model)`` for a ``"compiled"`` case (its names gain ``_orig_mod.``; no forward
    runs through it, so nothing compiles), else ``model``."""
    return torch.compile(model) if cfg.get("compiled") else model


def _ours(model: Any, opt: Any) -> dict[str, Any]:
    return {"model": interchange.model_state_dict(model, opt), "optim": get_optimizer_state_dict(model, opt)}


def _load_ours(model: Any, opt: Any, root: str) -> None:
    state = _ours(model, opt)
    dcp.load(state, checkpoint_id=root)
    interchange.load_model_state_dict(model, opt, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _full_zeroplan(model: Any, opt: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name: its fp32 master ("param") and optimizer state, whole (collective)."""
    plain = opt.consolidated_state_dict(to_rank=None)
    with opt.gathered_params():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    out = {}
    for i, name in enumerate(params):
        entry = {
            k: v.float() if torch.is_tensor(v) else torch.tensor(float(v))
            for k, v in plain["state"][i].items()
        }
        out[name] = {"param": plain.get("zeroplan_master", {}).get(i, params[name]), **entry}
    return out


def _full_fsdp2(model: Any, opt: Any) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, p in model.named_parameters():
        state = {k: v.full_tensor() if v.dim() else v.float() for k, v in opt.state[p].items()}
        out[name] = {"param": p.full_tensor().detach().clone(), **state}
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names and keys whose values differ (by bits) between two full states."""
    return [f"{n}/{k}" for n in a for k in a[n] if not torch.equal(a[n][k].float(), b[n][k].float())]


def _drift(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(rel_err(a[n]["param"], b[n]["param"]) for n in a)


def interchange_both_ways(
    rank: int, world: int, cases: list[dict[str, Any]], root: str
) -> list[dict[str, Any]]:
    """zeroplan -> FSDP2 and FSDP2 -> zeroplan, bit for bit; the next steps as the saving side's."""
    rows = []
    for n, cfg in enumerate(cases):
        there, back = os.path.join(root, f"{n}-zeroplan"), os.path.join(root, f"{n}-fsdp2")
        model, opt = _zeroplan(cfg)
        _train(model, opt, rank, range(2))
        # A compiled run saves (and loads) under the uncompiled names, as torch's own helpers do.
        dcp.save(_ours(_maybe_compiled(model, cfg), opt), checkpoint_id=there)
        saved = _full_zeroplan(model, opt)

        fmodel, fopt = _fsdp2(cfg)
        state = {"model": get_model_state_dict(fmodel), "optim": get_optimizer_state_dict(fmodel, fopt)}
        dcp.load(state, checkpoint_id=there)
        set_model_state_dict(fmodel, state["model"])
        set_optimizer_state_dict(fmodel, fopt, state["optim"])
        into_fsdp2 = _same(saved, _full_fsdp2(fmodel, fopt))

        _train(model, opt, rank, range(2, 4))  # each continues: zeroplan where it saved, FSDP2 from the load
        _train(fmodel, fopt, rank, range(2, 4))
        continued = _drift(_full_zeroplan(model, opt), _full_fsdp2(fmodel, fopt))

        dcp.save(
            {"model": get_model_state_dict(fmodel), "optim": get_optimizer_state_dict(fmodel, fopt)},
            checkpoint_id=back,
        )
        fsdp2_saved = _full_fsdp2(fmodel, fopt)
        model2, opt2 = _zeroplan(cfg)  # fresh: torch's recipe initializes no state first
        _load_ours(_maybe_compiled(model2, cfg), opt2, back)
        into_zeroplan = _same(fsdp2_saved, _full_zeroplan(model2, opt2))
        _train(model2, opt2, rank, range(4, 6))
        _train(fmodel, fopt, rank, range(4, 6))
        continued_back = _drift(_full_zeroplan(model2, opt2), _full_fsdp2(fmodel, fopt))
        rows.append(
            {
                "into_fsdp2": into_fsdp2,
                "into_zeroplan": into_zeroplan,
                "continued": continued,
                "continued_back": continued_back,
                "steps": float(saved[next(iter(saved))]["step"]),
            }
        )
    return rows


def save_zeroplan(rank: int, world: int, cfg: dict[str, Any], root: str) -> None:
    """Train 2 steps, save with DCP at this world; rank 0 also writes the whole state (torch.save)."""
    model, opt = _zeroplan(cfg)
    _train(model, opt, rank, range(2))
    dcp.save(_ours(model, opt), checkpoint_id=os.path.join(root, "dcp"))
    full = _full_zeroplan(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(root, "full.pt"))


def load_at_another_world(rank: int, world: int, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    """A fresh zeroplan run (another world and stage) and FSDP2 at this world load the checkpoint;
    ``dcp_to_torch_save`` gives a file a single-process ``AdamW`` loads."""
    model, opt = _zeroplan(cfg)
    _load_ours(model, opt, os.path.join(root, "dcp"))
    expected = torch.load(os.path.join(root, "full.pt"))
    out: dict[str, Any] = {"differ": _same(expected, _full_zeroplan(model, opt))}
    fmodel, fopt = _fsdp2(cfg)  # FSDP2 at this world too
    state = {"model": get_model_state_dict(fmodel), "optim": get_optimizer_state_dict(fmodel, fopt)}
    dcp.load(state, checkpoint_id=os.path.join(root, "dcp"))
    set_model_state_dict(fmodel, state["model"])
    set_optimizer_state_dict(fmodel, fopt, state["optim"])
    out["fsdp2_differ"] = _same(expected, _full_fsdp2(fmodel, fopt))
    if rank == 0:
        dcp_to_torch_save(os.path.join(root, "dcp"), os.path.join(root, "converted.pt"))
        plain = torch.load(os.path.join(root, "converted.pt"))
        ref = make_model(seed=0)
        names = [n for n, _ in ref.named_parameters()]
        ref.load_state_dict(plain["model"])
        adamw = torch.optim.AdamW(ref.parameters(), lr=LR)
        optim = plain["optim"]
        adamw.load_state_dict(
            {
                "state": {names.index(k): v for k, v in optim["state"].items()},
                "param_groups": [
                    {**g, "params": [names.index(k) for k in g["params"]]} for g in optim["param_groups"]
                ],
            }
        )
        got = {n: {"param": p.detach(), **adamw.state[p]} for n, p in ref.named_parameters()}
        out["converted_differ"] = _same(expected, got)
    return out


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _full_differ(expected: dict[str, Any], optim: dict[str, Any], model: dict[str, Any]) -> list[str]:
    """Names and keys of a full dict (torch's layout, whole tensors) that differ from ``expected``."""
    got = {n: {"param": model[n], **optim["state"][n]} for n in expected}
    wrong = [f"{n}/{k}" for n in got for k, v in got[n].items() if type(v) is not torch.Tensor]
    return wrong + _same(expected, got)


def full_state_dicts(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``full_state_dict=True`` (with and without ``cpu_offload``) gives whole plain tensors, which load
    into FSDP2 and into a fresh zeroplan run with ``broadcast_from_rank0`` (and, whole on every rank,
    with ``interchange.set_optimizer_state_dict``), bit for bit."""
    rows = []
    for cfg in cases:
        model, opt = _zeroplan(cfg)
        _train(model, opt, rank, range(2))
        expected = _full_zeroplan(model, opt)
        optim = interchange.get_optimizer_state_dict(model, opt, options=FULL)
        msd = interchange.model_state_dict(model, opt, options=FULL)
        every = StateDictOptions(full_state_dict=True)
        every_optim = interchange.get_optimizer_state_dict(model, opt, options=every)
        every_model = interchange.model_state_dict(model, opt, options=every)
        row: dict[str, Any] = {"everywhere": _full_differ(expected, every_optim, every_model)}
        if rank == 0:
            row["rank0"] = _full_differ(expected, optim, msd)
            tensors = [v for entry in optim["state"].values() for v in entry.values()] + list(msd.values())
            row["host"] = all(t.device.type == "cpu" for t in tensors)
            row["groups"] = [g["params"] for g in optim["param_groups"]]
        else:
            row["empty"] = optim == {} and msd == {}
        fmodel, fopt = _fsdp2(cfg)  # torch's own recipe loads it
        set_model_state_dict(fmodel, copy.deepcopy(msd), options=FROM_RANK0)  # torch's change the dicts
        set_optimizer_state_dict(fmodel, fopt, copy.deepcopy(optim), options=FROM_RANK0)
        row["into_fsdp2"] = _same(expected, _full_fsdp2(fmodel, fopt))
        theirs = get_optimizer_state_dict(fmodel, fopt, options=FULL)  # collective: every rank
        if rank == 0:
            row["fsdp2_groups"] = [g["params"] for g in theirs["param_groups"]]
        model2, opt2 = _zeroplan(cfg)  # fresh
        interchange.load_model_state_dict(model2, opt2, msd, options=FROM_RANK0)
        set_optimizer_state_dict(model2, opt2, optim, options=FROM_RANK0)
        row["into_zeroplan"] = _same(expected, _full_zeroplan(model2, opt2))
        model3, opt3 = _zeroplan(cfg)  # whole tensors on every rank, read by name
        interchange.load_model_state_dict(model3, opt3, every_model)
        interchange.set_optimizer_state_dict(model3, opt3, every_optim, options=every)
        row["everywhere_into_zeroplan"] = _same(expected, _full_zeroplan(model3, opt3))
        rows.append(row)
    return rows


def _params(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Per name, the parameter's values, whole (collective at stage 3)."""
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def torch_model_dicts_at_stage3(rank: int, world: int, cases: list[dict[str, Any]], root: str) -> list[Any]:
    """torch's ``get_model_state_dict`` / ``set_model_state_dict`` on a stage-3 model: the rank's pieces
    of each parameter, through DCP into FSDP2 and a fresh zeroplan run; whole tensors from rank 0."""
    rows = []
    for n, cfg in enumerate(cases):
        where = os.path.join(root, f"stage3-{n}")
        model, opt = _zeroplan(cfg)
        _train(model, opt, rank, range(2))
        sd = get_model_state_dict(model)
        row: dict[str, Any] = {"kinds": sorted({type(v).__name__ for v in sd.values()})}
        dcp.save({"model": sd, "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=where)
        saved = _params(model, opt)

        fmodel, _ = _fsdp2(cfg)
        state = {"model": get_model_state_dict(fmodel)}
        dcp.load(state, checkpoint_id=where)
        set_model_state_dict(fmodel, state["model"])
        row["into_fsdp2"] = [
            k for k, p in fmodel.named_parameters() if not torch.equal(p.full_tensor(), saved[k].float())
        ]

        model2, opt2 = _zeroplan(cfg)  # torch's recipe, unchanged
        state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(state, checkpoint_id=where)
        set_model_state_dict(model2, state["model"])
        set_optimizer_state_dict(model2, opt2, state["optim"])
        row["into_zeroplan"] = [k for k, v in _params(model2, opt2).items() if not torch.equal(v, saved[k])]
        every = StateDictOptions(full_state_dict=True)
        masters = interchange.model_state_dict(model2, opt2, options=every)
        row["masters_are_params"] = [k for k, v in masters.items() if not torch.equal(v, saved[k].float())]
        _train(model, opt, rank, range(2, 4))
        _train(model2, opt2, rank, range(2, 4))
        row["continued"] = _drift(_full_zeroplan(model, opt), _full_zeroplan(model2, opt2))

        full = interchange.model_state_dict(model, opt, options=FULL)  # fp32 masters, rank 0
        model3, opt3 = _zeroplan(cfg)
        set_model_state_dict(model3, full, options=FROM_RANK0)
        mine, theirs = (
            interchange.model_state_dict(m, o, options=every) for m, o in ((model3, opt3), (model, opt))
        )
        row["from_rank0"] = [k for k in mine if not torch.equal(mine[k], theirs[k])]
        mine, theirs = _params(model3, opt3), _params(model, opt)
        row["params_from_rank0"] = [k for k in mine if not torch.equal(mine[k], theirs[k])]
        rows.append(row)
    return rows


def full_dicts_refused(rank: int, world: int) -> dict[str, str | None]:
    """What whole-tensor dicts cannot take raises on every rank, before any tensor moves: state a
    non-elementwise optimizer keeps whole on one rank, and pieces given to ``broadcast_from_rank0``."""
    model = make_model(seed=0)
    opt = make_optimizer(model, stage=2, optimizer="adafactor")
    _train(model, opt, rank, range(1))
    out: dict[str, str | None] = {}
    try:
        interchange.get_optimizer_state_dict(model, opt, options=FULL)
        out["whole_state"] = None
    except ZeroplanError as exc:
        out["whole_state"] = str(exc)
    model2, opt2 = _zeroplan({"stage": 2})
    pieces = interchange.model_state_dict(model2, opt2)  # not whole tensors
    try:
        interchange.load_model_state_dict(model2, opt2, pieces if rank == 0 else {}, options=FROM_RANK0)
        out["pieces_from_rank0"] = None
    except ZeroplanError as exc:
        out["pieces_from_rank0"] = str(exc)
    return out


#: Inner optimizers of the fresh-cohort cases (every elementwise one zeroplan plans), and their settings.
FRESH_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "NAdam": (torch.optim.NAdam, {"lr": 1e-2}),
    "RAdam": (torch.optim.RAdam, {"lr": 1e-2}),
    "Adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 1e-2, "initial_accumulator_value": 0.1}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.9, "centered": True}),
    "Rprop": (torch.optim.Rprop, {"lr": 1e-3}),
    "ASGD": (torch.optim.ASGD, {"lr": 1e-2, "t0": 1.0}),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def _fresh_zeroplan(name: str) -> tuple[Any, Any]:
    cls, hyper = FRESH_OPTIMIZERS[name]
    model = make_model(seed=0)
    return model, ZeroOptimizer(model.parameters(), cls, stage=2, bucket_bytes=2048, alignment=16, **hyper)


def _fresh_run(cfg: dict[str, Any], rank: int, world: int) -> tuple[Any, Any, Reference]:
    """(model, zeroplan optimizer, unsharded reference) at the moment a cohort is fresh: before the first
    step, or right after ``refresh_trainable`` unfroze the last block after two steps."""
    cls, hyper = FRESH_OPTIMIZERS[cfg["optimizer"]]
    model, opt = _fresh_zeroplan(cfg["optimizer"])
    ref = Reference(make_model(seed=0), cls, **hyper)
    if cfg["when"] == "unfrozen":
        frozen = [*model.blocks[-1].parameters(), *ref.model.blocks[-1].parameters()]
        for p in frozen:
            p.requires_grad_(False)
        opt.refresh_trainable()
        _train(model, opt, rank, range(2))
        for step in range(2):
            ref.step(world, step)
        for p in frozen:
            p.requires_grad_(True)
        opt.refresh_trainable()
    return model, opt, ref


def fresh_cohorts_resume_as_they_continue(
    rank: int, world: int, cases: list[dict[str, Any]], root: str
) -> list[dict[str, Any]]:
    """A cohort that has not stepped, saved with DCP: the resumed run equals the continued run bit for
    bit ([Note: fresh entries]), and both the unsharded optimizer on the same data."""
    rows = []
    for n, cfg in enumerate(cases):
        path = os.path.join(root, f"fresh-{n}")
        model, opt, ref = _fresh_run(cfg, rank, world)
        dcp.save(_ours(model, opt), checkpoint_id=path)
        saved = {float(v["step"]) for v in opt.state_dict()["state"].values() if "step" in v}
        start = 2 if cfg["when"] == "unfrozen" else 0
        _train(model, opt, rank, range(start, start + 2))
        for step in range(start, start + 2):
            ref.step(world, step)
        model2, opt2 = _fresh_zeroplan(cfg["optimizer"])
        _load_ours(model2, opt2, path)
        _train(model2, opt2, rank, range(start, start + 2))
        continued, resumed = _params(model, opt), _params(model2, opt2)
        rows.append(
            {
                "saved_steps": sorted(saved),
                "differ": [k for k in continued if not torch.equal(continued[k], resumed[k])],
                "to_reference": max(
                    rel_err(continued[k], m) for k, m in zip(continued, ref.master, strict=True)
                ),
            }
        )
    return rows


def bf16_torch_dicts_load_as_torch_does(rank: int, world: int) -> dict[str, Any]:
    """A plain AdamW run of bf16 parameters (bf16 moments) loads, plain and as a whole-tensor dict, with its
    moments cast to the masters' fp32 as ``torch.optim`` casts them ([Note: loaded state as kept]): equal
    to the unsharded optimizer that loaded the same dict, then stepping as it does."""
    plain = make_model(seed=0, dtype=torch.bfloat16)
    adamw = torch.optim.AdamW(plain.parameters(), lr=LR)
    for step in range(2):
        for p, g in zip(plain.parameters(), averaged_grads(plain, world, step), strict=True):
            p.grad = g.to(p.dtype)
        adamw.step()
    ref = Reference(copy.deepcopy(plain), torch.optim.AdamW, lr=LR)
    ref.optimizer.load_state_dict(adamw.state_dict())  # torch casts the moments to the masters' fp32
    names = [n for n, _ in plain.named_parameters()]
    loaded = {n: dict(ref.optimizer.state[m]) for n, m in zip(names, ref.master, strict=True)}
    full = get_optimizer_state_dict(plain, adamw, options=StateDictOptions(full_state_dict=True))
    old = adamw.state_dict()  # as torch before 1.12 wrote it
    old["state"] = {k: {**v, "step": float(v["step"])} for k, v in old["state"].items()}
    ways = {
        "load_state_dict": lambda model, opt: opt.load_state_dict(old),  # Python-number steps
        "interchange": lambda model, opt: interchange.set_optimizer_state_dict(
            model, opt, full, options=StateDictOptions(full_state_dict=True)
        ),
    }
    runs = {}
    for way, load in ways.items():
        model = copy.deepcopy(plain)
        opt = make_optimizer(model, hyper={"lr": LR})
        load(model, opt)
        state = _full_zeroplan(model, opt)
        kinds = {str(v.dtype) for st in opt.shards().inner.optimizer.state.values() for v in st.values()}
        runs[way] = (
            model,
            opt,
            [
                f"{n}/{k}"
                for n in loaded
                for k, v in loaded[n].items()
                if not torch.equal(state[n][k], v.float())
            ],
            kinds,
        )
    out: dict[str, Any] = {}
    for step in range(2, 4):
        ref.step(world, step)
    for way, (model, opt, differ, kinds) in runs.items():
        try:
            _train(model, opt, rank, range(2, 4))
            with opt.gathered_params():
                drift = max(rel_err(p, m) for p, m in zip(model.parameters(), ref.master, strict=True))
        except Exception as exc:  # before the fix: a dtype mismatch, then a stuck optimizer
            drift = f"{type(exc).__name__}: {exc}"
        out[way] = {"differ": differ, "kinds": sorted(kinds), "drift": drift}
    return out
