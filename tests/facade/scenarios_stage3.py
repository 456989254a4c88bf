"""Scenarios of stage 3 (issue 13): parameters sharded between steps, gathered around forward and backward.

Run on every rank of a worker pool (see dist_worker.py); each returns plain data.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist
from factory import OPTIMIZERS, make_optimizer
from models import DTYPES, Reference, batch, loss_of, make_model, rel_err

from zeroplan.core import ConfigError, StepOrderError
from zeroplan.facade import ZeroOptimizer, checkpoint
from zeroplan.facade.params.blocks import ShardedParameter


def _model(cfg: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    model = make_model(seed=seed, dtype=DTYPES[cfg.get("dtype", "fp32")])
    if cfg.get("tied"):
        model.head.weight = model.tok.weight  # GPT-2's tied embedding: one parameter, two modules
    return model


def _settings(cfg: dict[str, Any], stage: int) -> dict[str, Any]:
    keys = (
        "shard",
        "collectives",
        "strategy",
        "layout",
        "reshard_after_forward",
        "loss_scale",
        "ranks_per_node",
        "optimizer",
    )
    return {
        "stage": stage,
        "bucket_bytes": cfg.get("bucket_bytes", 2048),
        **{k: cfg[k] for k in keys if k in cfg},
    }


def _train(model: torch.nn.Module, opt: Any, rank: int, step: int, cfg: dict[str, Any]) -> float:
    micro = cfg.get("micro", 1)
    loss = torch.zeros(())
    for m in range(micro):  # gradient accumulation: all but the last backward inside no_sync()
        tokens, targets = batch(step * micro + m, rank)
        loss = loss_of(model, tokens, targets) / micro
        if m < micro - 1:
            with opt.no_sync():
                opt.backward(loss)
        else:
            opt.backward(loss)
    if cfg.get("clip") is not None:
        opt.clip_grad_norm_(cfg["clip"])
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _values(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal_to_stage_2(models: list[torch.nn.Module], opts: list[ZeroOptimizer]) -> bool:
    """Whether the stage-3 model (``models[0]``, gathered) holds exactly the stage-2 model's values."""
    with opts[0].gathered_params():
        values3 = _values(models[0])
    opts[1].wait_for_params()
    return all(torch.equal(a, b) for a, b in zip(values3, _values(models[1]), strict=True))


def against_stage_2_and_torch(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Stage 3 and stage 2 trained side by side on the same data, and the unsharded torch optimizer.

    Returns whether stage 3 equals stage 2 bit for bit, its largest relative error against torch's
    AdamW on fp32 masters, its traffic against the plan's, and what it holds between steps.
    """
    steps = cfg.get("steps", 3)
    model3, model2, ref_model = _model(cfg), _model(cfg), _model(cfg)
    opt3 = make_optimizer(model3, **_settings(cfg, 3))
    opt3.attach(model3)
    opt2 = make_optimizer(model2, **_settings(cfg, 2))
    inner = OPTIMIZERS[cfg.get("optimizer", "adamw")]
    reference = Reference(ref_model, inner.cls, **inner.hyper)
    sharded_between_steps = []
    for step in range(steps):
        _train(model3, opt3, rank, step, cfg)
        _train(model2, opt2, rank, step, cfg)
        sharded_between_steps.append(all(type(p) is ShardedParameter for p in model3.parameters()))
        if cfg.get("micro", 1) == 1:
            reference.step(world, step, clip=cfg.get("clip"))
    with opt3.gathered_params():
        values3 = _values(model3)
    opt2.wait_for_params()
    values2 = _values(model2)
    plan = opt3.memory_report().ranks[rank]
    measured = opt3.measured_memory()
    outside = None
    try:
        model3.head.weight.sum()
    except StepOrderError as exc:
        outside = str(exc)
    return {
        "equal_to_stage_2": all(torch.equal(a, b) for a, b in zip(values3, values2, strict=True)),
        "vs_stage_2": max(rel_err(a, b) for a, b in zip(values3, values2, strict=True)),
        "vs_torch": max(rel_err(a, b) for a, b in zip(values3, _values(ref_model), strict=True)),
        "sharded_between_steps": sharded_between_steps,
        "comm": sorted((c.group, str(c.collective), c.calls, c.bytes) for c in opt3.last_step_comm()),
        "planned_comm": sorted((c.group, str(c.collective), c.calls, c.bytes) for c in plan.comm),
        "measured": (measured.params_bytes, measured.grads_bytes, measured.master_bytes),
        "planned": (plan.params_bytes, plan.grads_bytes, plan.master_bytes),
        "optimizer_state": (measured.optimizer_state_bytes, plan.optimizer_state_bytes),
        "outside": outside,
        "blocks": len(opt3.plan.partition.spaces[0].blocks),
    }


def across_stages(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Save at one stage and world, load at another: values and state bit-exact, training continues alike."""
    save_stage, load_stage = cfg["save_stage"], cfg["load_stage"]
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    model = make_model(dtype=dtype)
    opt = make_optimizer(model, stage=save_stage, shard=cfg.get("save_shard"))
    opt.attach(model)
    for step in range(2):
        _train(model, opt, rank, step, {})
    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    checkpoint.save(opt, root[0])
    expected_state = opt.consolidated_state_dict(None)
    with opt.gathered_params():
        expected_values = _values(model)
    other_model = make_model(dtype=dtype, seed=7)
    other = make_optimizer(other_model, stage=load_stage, shard=cfg.get("load_shard"))
    other.attach(other_model)
    checkpoint.load(other, root[0])
    state = other.consolidated_state_dict(None)
    with other.gathered_params():
        values_equal = all(
            torch.equal(a, b) for a, b in zip(expected_values, _values(other_model), strict=True)
        )
    state_equal = all(
        torch.equal(a, state["state"][p][k])
        for p in expected_state["state"]
        for k, a in expected_state["state"][p].items()
        if torch.is_tensor(a)
    )
    for m, o in ((model, opt), (other_model, other)):
        _train(m, o, rank, 5, {})
    with opt.gathered_params(), other.gathered_params():
        after = max(
            float((a.float() - b.float()).abs().max())
            for a, b in zip(_values(model), _values(other_model), strict=True)
        )
    return {"values_equal": values_equal, "state_equal": state_equal, "after_step_diff": after}


def misuse(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """What raises at stage 3 instead of training silently wrong: no attach, moving or replacing weights."""
    model = _model(cfg)
    opt = make_optimizer(model, stage=3)
    tokens, targets = batch(0, rank)
    errors: dict[str, str | None] = {}

    def error(fn: Any) -> str | None:
        try:
            fn()
        except StepOrderError as exc:
            return str(exc)
        return None

    errors["forward_without_attach"] = error(lambda: loss_of(model, tokens, targets))
    errors["to_device"] = error(lambda: model.to("cpu:0"))
    param = model.blocks[0].fc.weight
    errors["replace_data"] = error(lambda: setattr(param, "data", torch.zeros(param.shape)))
    outside = model.state_dict()  # the rank's pieces ([Note: stage-3 model dicts])
    try:
        outside["blocks.0.fc.weight"].sum()
        refused = None
    except TypeError as exc:  # arithmetic on a tensor this rank holds some of
        refused = str(exc)
    opt.attach(model)
    loss = loss_of(model, tokens, targets)  # attached: the forward gathers
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    with opt.gathered_params():
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    return {
        "errors": errors,
        "pieces": sorted({type(v).__name__ for v in outside.values()}),
        "pieces_refuse": refused,
        "saved_keys": sorted(saved) == sorted(k for k, _ in model.named_parameters()),
        "sharded": all(type(p) is ShardedParameter for p in model.parameters()),
    }


class _Checkpointed(torch.nn.Module):
    """A tiny GPT whose blocks run under activation checkpointing, plus a head nobody uses."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner = make_model()
        torch.manual_seed(1)  # the same values in every instance
        self.unused = torch.nn.Linear(3, 3)  # trainable, never used: its block must not stay gathered
        self.reentrant = reentrant
        for block in self.inner.blocks:
            forward = block.forward
            block.forward = lambda x, f=forward: torch.utils.checkpoint.checkpoint(
                f, x, use_reentrant=self.reentrant
            )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens)


def edge_cases(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Stage 3 next to stage 2 through what users do besides a plain forward (the review's cases)."""
    models = [_Checkpointed(cfg["reentrant"]) for _ in range(2)]
    opts = [make_optimizer(m, stage=s, collectives="min_bytes") for m, s in zip(models, (3, 2), strict=True)]
    for m, o in zip(models, opts, strict=True):
        o.attach(m)
    held_after_backward = []
    for step in range(3):
        tokens, targets = batch(step, rank)
        for m, o in zip(models, opts, strict=True):
            loss = loss_of(m, tokens, targets)
            loss.backward()
            if o.plan.stage == 3:
                held_after_backward.append(o.installed.residency.held_bytes())
            o.step()
            o.zero_grad()
    # A submodule called on its own (outside the root's forward), with a backward, then a step.
    for m, o in zip(models, opts, strict=True):
        x = torch.randn(2, 24, generator=torch.Generator().manual_seed(rank))
        m.inner.blocks[0].fc(x).square().sum().backward()
        o.step()
        o.zero_grad()
    # A state dict kept beyond gathered_params(): its values stay readable (and right).
    with opts[0].gathered_params():
        kept = models[0].state_dict()
        snapshot = {k: v.clone() for k, v in kept.items()}
        evaluated = float(loss_of(models[0], *batch(9, rank)).detach())  # a forward inside: nothing freed
        after_eval = {k: v.clone() for k, v in models[0].state_dict().items()}
    opts[1].wait_for_params()
    same_eval = evaluated == float(loss_of(models[1], *batch(9, rank)).detach())
    tokens, targets = batch(7, rank)
    for m, o in zip(models, opts, strict=True):  # one more step: the kept tensors do not detach anything
        loss_of(m, tokens, targets).backward()
        o.step()
        o.zero_grad()
    kept_intact = all(torch.equal(kept[k], snapshot[k]) and torch.equal(kept[k], after_eval[k]) for k in kept)
    return {
        "equal_to_stage_2": _equal_to_stage_2(models, opts),
        "held_after_backward": held_after_backward,
        "kept_intact": kept_intact,
        "same_eval": same_eval,
    }


def replanning(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Freeze a parameter, re-plan, unfreeze, add a param group: stage 3 next to stage 2."""
    models = [_model({}) for _ in range(2)]
    opts = [make_optimizer(m, stage=s, collectives="min_bytes") for m, s in zip(models, (3, 2), strict=True)]
    for m, o in zip(models, opts, strict=True):
        o.attach(m)
    ones = torch.ones(2, 3)
    for step in range(4):
        for m, o in zip(models, opts, strict=True):
            if step == 1:
                m.blocks[0].fc.weight.requires_grad_(False)
                o.refresh_trainable()
            if step == 2:
                m.blocks[0].fc.weight.requires_grad_(True)
                o.refresh_trainable()
                torch.manual_seed(2)
                m.adapter = torch.nn.Linear(3, 3)  # a module added later, called on its own
                o.add_param_group({"params": list(m.adapter.parameters()), "lr": 0.1})
                o.attach(m)  # hook the new module too
            loss = loss_of(m, *batch(step, rank))
            if step >= 2:
                loss = loss + m.adapter(ones).square().sum()
            loss.backward()
            o.step()
            o.zero_grad()
    return {"equal_to_stage_2": _equal_to_stage_2(models, opts)}


def held_while_prefetched(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A block prefetched but never used, whose buffer someone else still holds when the forward ends.

    The head's pre-hook prefetches the next block in buffer order, the ``unused`` layer's, which no
    forward uses: it is still gathering (its parameters ``ShardedParameter``) when the forward ends and
    every block is freed. A hook holds an alias of that buffer (as a backend releasing a collective's
    tensors late does), so freeing moves the parameters to storage of their own ([Note: stage 3]).
    """
    models = [_Checkpointed(reentrant=False) for _ in range(2)]
    opts = [make_optimizer(m, stage=s, collectives="min_bytes") for m, s in zip(models, (3, 2), strict=True)]
    for m, o in zip(models, opts, strict=True):
        o.attach(m)
    held: list[torch.Tensor] = []
    unused = models[0].unused.weight

    def hold(module: torch.nn.Module, args: Any, output: Any) -> None:
        with torch._C.DisableTorchFunctionSubclass():  # a plain alias of the buffer; reads nothing
            held.append(unused.detach())

    handle = models[0].inner.head.register_forward_hook(hold)
    moved = []
    for step in range(3):
        tokens, targets = batch(step, rank)
        for m, o in zip(models, opts, strict=True):
            loss = loss_of(m, tokens, targets)
            if o.plan.stage == 3:
                with torch._C.DisableTorchFunctionSubclass():
                    moved.append(unused.untyped_storage().data_ptr() != held[-1].untyped_storage().data_ptr())
                sharded = type(unused) is ShardedParameter
            loss.backward()
            o.step()
            o.zero_grad()
    handle.remove()
    return {
        "equal_to_stage_2": _equal_to_stage_2(models, opts),
        "moved": moved,
        "sharded_after_forward": sharded,
    }


def shared_with_numpy(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Parameters shared with numpy inside ``gathered_params()`` (issue 40 item 7), next to stage 2.

    ``p.detach().numpy()`` marks the block's storage as not resizable for good: freeing the block used to
    raise "Trying to resize storage that is not resizable". Half the arrays are kept (they must keep the
    values they were taken with), half dropped at once; then training goes on, and a re-plan (freezing
    a parameter) lets go of the old blocks.
    """
    models = [_model({}) for _ in range(2)]
    opts = [make_optimizer(m, stage=s, collectives="min_bytes") for m, s in zip(models, (3, 2), strict=True)]
    for m, o in zip(models, opts, strict=True):
        o.attach(m)
    for m, o in zip(models, opts, strict=True):
        _train(m, o, rank, 0, {})
    with opts[0].gathered_params():
        arrays = [p.detach().numpy() for p in models[0].parameters()]
        taken = [a.copy() for a in arrays]
        kept = arrays[::2]
        del arrays
    for step in (1, 2):
        for m, o in zip(models, opts, strict=True):
            _train(m, o, rank, step, {})
    with opts[0].gathered_params():
        more = [p.detach().numpy() for p in models[0].parameters()]
        del more
    for m, o in zip(models, opts, strict=True):
        m.blocks[0].fc.weight.requires_grad_(False)
        o.refresh_trainable()
        _train(m, o, rank, 3, {})
    return {
        "equal_to_stage_2": _equal_to_stage_2(models, opts),
        "kept_intact": all((a == b).all() for a, b in zip(kept, taken[::2], strict=True)),
        "sharded": all(type(p) is ShardedParameter for p in models[0].parameters() if p.requires_grad),
    }


def plain_tensor_refused(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A trainable plain tensor (no ``nn.Parameter``) at stage 3: refused at construction and by
    ``add_param_group``, nothing changed; stage 2 takes it (its forward used to read freed memory)."""
    model = _model({})
    temp = torch.full((4,), 2.0, requires_grad=True)  # a learnable temperature kept as a tensor
    before = _values(model)
    errors: dict[str, str | None] = {}
    try:
        make_optimizer([*model.parameters(), temp], stage=3)
        errors["construction"] = None
    except ConfigError as exc:
        errors["construction"] = str(exc)
    unchanged = all(type(p) is torch.nn.Parameter for p in model.parameters()) and all(
        torch.equal(a, b) for a, b in zip(before, _values(model), strict=True)
    )
    opt = make_optimizer(model, stage=3)
    opt.attach(model)
    try:
        opt.add_param_group({"params": [temp]})
        errors["add_param_group"] = None
    except ConfigError as exc:
        errors["add_param_group"] = str(exc)
    _train(model, opt, rank, 0, {})  # the refused group changed nothing: training goes on
    stage_2 = make_optimizer([*_model({}).parameters(), temp], stage=2)
    return {
        "errors": errors,
        "unchanged": unchanged,
        "groups_after": len(opt.param_groups),
        "stage_2_params": sum(len(g["params"]) for g in stage_2.param_groups),
        "params": len(before) + 1,
    }


def two_optimizers_refused(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Two stage-3 optimizers over one model (matrices in one, the rest in the other, as Muon with
    AdamW): the second attach is refused, on the model or one of its modules; the first stays hooked."""
    model = _model({})
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    first, second = make_optimizer(mats, stage=3), make_optimizer(rest, stage=3)
    first.attach(model)
    errors: dict[str, str | None] = {}
    for name, target in (("model", model), ("submodule", model.blocks[0])):
        try:
            second.attach(target)
            errors[name] = None
        except ConfigError as exc:
            errors[name] = str(exc)
    first.attach(model)  # its own model again: an attach replaces its earlier one
    refused_unchanged = not second.installed.residency.attached and second.domains[0].attached is None
    torch.manual_seed(3)
    extra = torch.nn.Linear(2, 2)
    try:  # a re-plan settles the new residency on the attached model: none, for a refused attach
        second.add_param_group({"params": list(extra.parameters())})
        replan_error = None
    except ConfigError as exc:
        replan_error = str(exc)
    return {
        "errors": errors,
        "first_attached": first.installed.residency.attached,
        "second_unchanged": refused_unchanged,
        "second_groups": len(second.param_groups),
        "replan_error": replan_error,
    }


def eval_then_load(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """An evaluation forward under ``no_grad`` between steps, then ``model.load_state_dict``: with
    ``reshard_after_forward=False`` too, the loaded weights train on (its blocks used to stay gathered
    after the forward and take the load, which the next step overwrote with the old masters)."""
    models = [_model({}) for _ in range(3)]
    settings = [{"stage": 3, "reshard_after_forward": False}, {"stage": 3}, {"stage": 2}]
    opts = [make_optimizer(m, collectives="min_bytes", **s) for m, s in zip(models, settings, strict=True)]
    for m, o in zip(models, opts, strict=True):
        o.attach(m)
    loaded = _model({}, seed=1).state_dict()
    held_after_eval = []
    for m, o in zip(models, opts, strict=True):
        _train(m, o, rank, 0, {})
        with torch.no_grad():
            m.eval()
            loss_of(m, *batch(5, rank))
            m.train()
        if o.plan.stage == 3:
            held_after_eval.append(o.installed.residency.held_bytes())
        m.load_state_dict(loaded)
        _train(m, o, rank, 1, {})
    with opts[0].gathered_params():
        kept = _values(models[0])
    with opts[1].gathered_params():
        resharded = _values(models[1])
    opts[2].wait_for_params()
    return {
        "held_after_eval": held_after_eval,
        "equal_to_resharded": all(torch.equal(a, b) for a, b in zip(kept, resharded, strict=True)),
        "equal_to_stage_2": all(torch.equal(a, b) for a, b in zip(kept, _values(models[2]), strict=True)),
    }
