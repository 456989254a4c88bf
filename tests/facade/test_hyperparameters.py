"""Hyper-parameter comparison across ranks (construction agreement and the per-step digest), and the
settings passed between the user's param groups and the inner optimizer's (tensor learning rates)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from factory import make_optimizer
from models import batch, loss_of, make_model

from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.state.inner import (
    comparable_hyperparameters,
    hyperparameter_digest,
    sync_hyperparameters,
)


class _Opaque:
    """An object whose repr holds its address, which differs between processes."""


def test_digest_sees_values_not_objects():
    a = [{"params": [torch.zeros(1)], "lr": 0.1, "betas": (0.9, 0.99), "obj": _Opaque()}]
    b = [{"params": [torch.ones(3)], "lr": 0.1, "betas": (0.9, 0.99), "obj": _Opaque()}]
    assert hyperparameter_digest(a) == hyperparameter_digest(b)  # tensors in params and addresses ignored
    b[0]["lr"] = 0.2
    assert hyperparameter_digest(a) != hyperparameter_digest(b)
    b[0]["lr"] = 0.1
    b[0]["betas"] = [0.9, 0.99]  # a list is not a tuple
    assert hyperparameter_digest(a) != hyperparameter_digest(b)


def test_tensor_settings_compare_by_value():
    a = comparable_hyperparameters([{"params": [], "lr": torch.tensor(0.1)}])
    assert a == comparable_hyperparameters([{"params": [], "lr": torch.tensor(0.1)}])
    assert a != comparable_hyperparameters([{"params": [], "lr": torch.tensor(0.2)}])
    assert 0 <= hyperparameter_digest([{"params": [], "lr": 1.0}]) < 2**62


def test_the_users_lr_reaches_the_inner_optimizer_and_only_a_change_comes_back():
    own = torch.tensor(0.5)  # torchao's own tensor of the user's number
    user, inner = [{"params": [], "lr": 0.01}], [{"params": [], "lr": own}]
    sync_hyperparameters(user, inner)
    sync_hyperparameters(inner, user)
    assert inner[0]["lr"] is own and own.item() == pytest.approx(0.01)
    assert user[0]["lr"] == 0.01 and isinstance(user[0]["lr"], float)  # the number stays the user's
    for held in (own, 0.01):  # the inner optimizer holds its own tensor, or a number
        inner = [{"params": [], "lr": held}]
        user[0]["lr"] = mine = torch.tensor(0.1)
        sync_hyperparameters(user, inner)
        sync_hyperparameters(inner, user)
        assert inner[0]["lr"] is mine and user[0]["lr"] is mine and mine.item() == pytest.approx(0.1)
        inner[0]["lr"] = 0.2  # changed by the inner step: written into the user's tensor
        sync_hyperparameters(inner, user)
        assert user[0]["lr"] is mine and mine.item() == pytest.approx(0.2)
    loaded, user = [{"params": [], "lr": torch.tensor(1e-5)}], [{"params": [], "lr": 0.01}]
    sync_hyperparameters(loaded, user)
    assert user[0]["lr"] is loaded[0]["lr"]


# ---------------------------------------------------------------- tensor learning rates
# A tensor ``lr`` (torch.compile's advice; torch's LR schedulers then write into it in place) set by the
# user, loaded from a dict, or built in, steps the parameters exactly as plain torch.optim.AdamW does.
# Scenarios run on every rank of a pool (the workers import this module by its plain name); each rank
# trains on the same batches, so the averaged gradients are the reference's.


def _zero(model: torch.nn.Module, lr: float | torch.Tensor) -> ZeroOptimizer:
    return make_optimizer(model, hyper={"lr": lr, "weight_decay": 0.1}, stage=2)


def _steps(models: dict[str, torch.nn.Module], opts: dict[str, torch.optim.Optimizer], steps: range) -> None:
    for step in steps:
        tokens, targets = batch(step, 0)
        for name, opt in opts.items():
            loss = loss_of(models[name], tokens, targets)
            if isinstance(opt, ZeroOptimizer):
                opt.backward(loss)
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()


def _differ(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        (x.detach() - y.detach()).abs().max().item()
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def tensor_lr_assigned(rank: int, world: int) -> dict[str, object]:
    """A float-lr optimizer whose user sets ``lr = torch.tensor(0.1)`` after two steps."""
    models = {"torch": make_model(), "zero": make_model()}
    opts = {"torch": torch.optim.AdamW(models["torch"].parameters(), lr=0.01, weight_decay=0.1)}
    opts["zero"] = _zero(models["zero"], 0.01)
    _steps(models, opts, range(2))
    mine = opts["zero"].param_groups[0]["lr"] = torch.tensor(0.1)
    opts["torch"].param_groups[0]["lr"] = torch.tensor(0.1)
    _steps(models, opts, range(2, 5))
    return {
        "differ": _differ(models["torch"], models["zero"]),
        "mine": mine.item(),
        "kept": opts["zero"].param_groups[0]["lr"] is mine,
    }


def tensor_lr_loaded(rank: int, world: int) -> dict[str, object]:
    """A torch dict saved with a StepLR's ``lr=tensor(1e-4)``, loaded into ``ZeroOptimizer(lr=0.01)``."""
    source = make_model()
    opt = torch.optim.AdamW(source.parameters(), lr=torch.tensor(0.01), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.1)
    _steps({"torch": source}, {"torch": opt}, range(2))
    scheduler.step()
    scheduler.step()
    saved = opt.state_dict()
    models = {"torch": make_model(seed=1), "zero": make_model(seed=1)}
    for model in models.values():
        model.load_state_dict(source.state_dict())
    opts = {"torch": torch.optim.AdamW(models["torch"].parameters(), lr=0.01, weight_decay=0.1)}
    opts["zero"] = _zero(models["zero"], 0.01)
    for o in opts.values():
        o.load_state_dict(saved)
    _steps(models, opts, range(2, 5))
    return {
        "differ": _differ(models["torch"], models["zero"]),
        "lrs": [float(o.param_groups[0]["lr"]) for o in opts.values()],
    }


def tensor_lr_scheduled(rank: int, world: int) -> dict[str, object]:
    """Built with ``lr=torch.tensor(0.01)`` and torch's StepLR, then resumed from ``state_dict()`` into an
    optimizer built with a float lr (the loaded tensor rules) whose new StepLR loads the old one's state."""
    models = {"torch": make_model(), "zero": make_model()}
    opts = {"torch": torch.optim.AdamW(models["torch"].parameters(), lr=torch.tensor(0.01), weight_decay=0.1)}
    opts["zero"] = _zero(models["zero"], torch.tensor(0.01))
    schedulers = {k: torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for k, o in opts.items()}
    differ = []
    for step in range(3):
        _steps(models, opts, range(step, step + 1))
        for s in schedulers.values():
            s.step()
        differ.append(_differ(models["torch"], models["zero"]))
    saved = {k: (o.state_dict(), schedulers[k].state_dict()) for k, o in opts.items()}
    resumed = {k: make_model(seed=1) for k in models}
    for k, model in resumed.items():
        model.load_state_dict(models[k].state_dict())
    opts = {"torch": torch.optim.AdamW(resumed["torch"].parameters(), lr=0.01, weight_decay=0.1)}
    opts["zero"] = _zero(resumed["zero"], 0.01)
    for k, o in opts.items():
        o.load_state_dict(saved[k][0])
        schedulers[k] = torch.optim.lr_scheduler.StepLR(o, 1, 0.5)
        schedulers[k].load_state_dict(saved[k][1])
    for step in range(3, 6):
        _steps(resumed, opts, range(step, step + 1))
        for s in schedulers.values():
            s.step()
        differ.append(_differ(resumed["torch"], resumed["zero"]))
    return {"differ": differ, "lrs": [float(o.param_groups[0]["lr"]) for o in opts.values()]}


def _scenario(name: str) -> Callable[..., dict[str, object]]:
    import test_hyperparameters  # this file under its plain name, which the workers can import

    return getattr(test_hyperparameters, name)


@pytest.mark.parametrize("scenario", ["tensor_lr_assigned", "tensor_lr_loaded", "tensor_lr_scheduled"])
def test_a_tensor_lr_steps_as_torch(pools, scenario):
    for r in pools(2).run(_scenario(scenario)):
        differ = r["differ"] if isinstance(r["differ"], list) else [r["differ"]]
        assert max(differ) < 1e-6, r
        if scenario == "tensor_lr_assigned":
            assert r["kept"] and r["mine"] == pytest.approx(0.1), r  # stepped with, never overwritten
        else:
            torch_lr, zero_lr = r["lrs"]
            assert zero_lr == torch_lr, r
