"""The torch.optim contract and misuse that would otherwise train silently wrong (issue 10, items 7-12).

Every refused call must raise on every rank and leave parameters, fp32 masters,
optimizer state, the scaler and ``param_groups`` bit-identical.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from factory import make_optimizer
from models import Reference, batch, loss_of, make_model, rel_err
from torch import nn

from zeroplan.facade import ZeroOptimizer


def _error(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _everything(opt: ZeroOptimizer, model: nn.Module) -> list[Any]:
    """Clones of what a refused call must not change."""
    return [
        [p.detach().clone() for p in model.parameters()],
        [b.master.clone() for b in opt.buffers if b.master is not None],  # else: the parameters
        copy.deepcopy(opt.inner_optimizer.state_dict()["state"]),
        opt.scaler_state,
        copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]),
    ]


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def detached_parameters(rank: int, world: int, how: str, stage: int) -> dict[str, Any]:
    """Parameters whose ``.data`` was replaced (``model.to('cpu:0')`` copies) are refused at step()."""
    model = make_model(dtype=torch.bfloat16)
    opt = make_optimizer(model, stage=stage)
    opt.backward(loss_of(model, *batch(0, rank)))
    opt.step()
    opt.zero_grad()
    if how == "to_device":
        model.to("cpu:0")  # what transformers.Trainer does with device cpu:0
    elif rank == world - 1:  # one rank only
        model.blocks[0].fc.weight.data = model.blocks[0].fc.weight.data.clone()
    opt.backward(loss_of(model, *batch(1, rank)))
    before = _everything(opt, model)
    error = _error(opt.step)
    return {"error": error, "unchanged": _same(before, _everything(opt, model))}


def different_hyperparameters(rank: int, world: int) -> dict[str, str | None]:
    """Hyper-parameters given differently per rank are refused at construction, on every rank."""
    params = list(make_model().parameters())
    return {
        "lr": _error(lambda: make_optimizer(params, hyper={"lr": 0.1 * (rank + 1)})),
        "weight_decay": _error(
            lambda: make_optimizer(params, hyper={"lr": 0.1, "weight_decay": 0.01 if rank else 0.0})
        ),
        "group_lr": _error(
            lambda: make_optimizer(
                [{"params": params[:2], "lr": 0.5 + rank}, {"params": params[2:]}], hyper={"lr": 0.1}
            )
        ),
        "loss_scale": _error(lambda: make_optimizer(params, loss_scale=128.0 * (rank + 1))),
    }


def diverging_param_groups(rank: int, world: int) -> dict[str, Any]:
    """A hand edit of ``param_groups`` on one rank only is caught at step(), on every rank."""
    model = make_model()
    opt = make_optimizer(model)
    lr = opt.param_groups[0]["lr"]
    opt.backward(loss_of(model, *batch(0, rank)))
    if rank == world - 1:
        opt.param_groups[0]["lr"] = 0.5
    before = _everything(opt, model)
    error = _error(opt.step)
    unchanged = _same(before, _everything(opt, model))
    # edit undone on that rank: the refused step is retried with the gradients it kept, as an
    # optimizer that was never refused steps
    opt.param_groups[0]["lr"] = lr
    retried = _error(opt.step)
    plain_model = make_model()
    plain = make_optimizer(plain_model)
    plain.backward(loss_of(plain_model, *batch(0, rank)))
    plain.step()
    as_never_refused = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters(), strict=True)
    )
    opt.zero_grad()
    opt.param_groups[0]["lr"] = 0.5  # the same edit everywhere is fine
    opt.backward(loss_of(model, *batch(1, rank)))
    opt.step()
    return {
        "error": error,
        "unchanged": unchanged,
        "retried": retried,
        "as_never_refused": as_never_refused,
        "then": not opt.last_step_skipped,
    }


def no_sync_after_synchronised_backward(rank: int, world: int, stage: int, overlap: bool) -> dict[str, Any]:
    """The issue's example: w gets gradient 1 (synchronised) then 100 (no_sync) and would move by 1."""
    w = nn.Parameter(torch.zeros(4))
    opt = ZeroOptimizer([w], torch.optim.SGD, lr=1.0, stage=stage, overlap_grad_reduce=overlap)
    opt.backward(w.sum())
    before = w.detach().clone()
    with opt.no_sync():
        error = _error(lambda: opt.backward((100 * w).sum()))
    unchanged = torch.equal(before, w.detach())
    opt.zero_grad()
    with opt.no_sync():  # the right order: local passes first, the synchronised one last
        opt.backward((100 * w).sum())
    opt.backward(w.sum())
    opt.step()
    return {"error": error, "unchanged": unchanged, "moved": w.detach().tolist()}


def add_group_starts_from_rank_zero(rank: int, world: int) -> dict[str, Any]:
    """Parameters added with add_param_group get rank 0's values, as the constructor's do."""
    model = make_model()
    params = list(model.parameters())
    extra = nn.Parameter(torch.full((5, 3), float(rank)))
    opt = make_optimizer(params)
    opt.add_param_group({"params": [extra], "lr": 0.1})
    values = extra.detach().clone()
    opt.backward(loss_of(model, *batch(0, rank)) + (extra**2).sum())
    opt.step()
    return {"values": values, "after": extra.detach().clone()}


class _Counting(torch.optim.SGD):
    """SGD that writes into its param groups while stepping (as D-Adaptation or Prodigy do) and
    takes a keyword in ``step``."""

    def step(self, closure: Any = None, *, boost: float = 1.0) -> Any:
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
            group["boost_seen"] = boost
        return super().step(closure)


def torch_optim_contract(rank: int, world: int) -> dict[str, Any]:
    """step(closure) returns the loss, kwargs reach the inner optimizer, keys it writes are visible."""
    model = make_model()
    ref = Reference(make_model(), _Counting, lr=0.1) if rank == 0 else None
    opt = ZeroOptimizer(model.parameters(), _Counting, lr=0.1, bucket_bytes=2048, alignment=16)

    def closure() -> torch.Tensor:
        loss = loss_of(model, *batch(0, rank))
        opt.backward(loss)
        return loss

    reduced: list[Any] = []

    def closure_keeping_grads() -> torch.Tensor:
        loss = closure()
        reduced[:] = opt.averaged_gradients()
        return loss

    returned = opt.step(closure_keeping_grads, boost=2.0)
    opt.zero_grad()
    errors = []
    if ref is not None:
        ref.step(world, 0, grad_fn=lambda m, w, s: reduced)
        errors = [rel_err(a, b) for a, b in zip(model.parameters(), ref.model.parameters(), strict=True)]
    opt.backward(loss_of(model, *batch(1, rank)))
    plain = opt.step()
    return {
        "returned": None if returned is None else float(returned),
        "expected": float(loss_of(make_model(), *batch(0, rank))),
        "plain": plain,
        "k": [g.get("k") for g in opt.param_groups],
        "boost": [g.get("boost_seen") for g in opt.param_groups],
        "errors": errors,
    }


def refused_constructions(rank: int, world: int) -> dict[str, str | None]:
    """Arguments torch.optim refuses with TypeError, and optimizers that cannot be sharded."""
    params = list(make_model().parameters())
    return {
        "typo": _error(lambda: ZeroOptimizer(params, torch.optim.AdamW, lr=0.1, weight_decya=0.5)),
        "single_tensor": _error(lambda: ZeroOptimizer(params[0], lr=0.1)),
        "not_iterable": _error(lambda: ZeroOptimizer(5, lr=0.1)),  # type: ignore[arg-type]
        "not_a_tensor": _error(lambda: ZeroOptimizer([params[0], "w"], lr=0.1)),
        "lbfgs": _error(lambda: ZeroOptimizer(params, torch.optim.LBFGS, lr=0.1)),
        "sparse_adam": _error(lambda: ZeroOptimizer(params, torch.optim.SparseAdam, lr=0.1)),
        "stage_true": _error(lambda: ZeroOptimizer(params, lr=0.1, stage=True)),  # type: ignore[arg-type]
        "group_extra_key": _error(lambda: ZeroOptimizer([{"params": params, "name": "all"}], lr=0.1)),
    }


class _SparseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6, sparse=True)
        self.head = nn.Linear(6, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens)).sum()


def sparse_gradients(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Sparse embedding gradients train exactly as torch.optim.SGD with them (made dense by the hook)."""
    model, reference = _SparseModel(), _SparseModel()
    hyper = {"lr": 0.1, "momentum": 0.9}
    opt = make_optimizer(model, optimizer="sgd", hyper=hyper, stage=stage)
    ref = torch.optim.SGD(reference.parameters(), **hyper)
    for step in range(3):
        tokens = [torch.tensor([step, 3, 7 + r]) for r in range(world)]
        opt.backward(model(tokens[rank]))  # the reduction averages over ranks
        opt.step()
        opt.zero_grad()
        for t in tokens:  # the reference sums every rank's sparse gradient
            (reference(t) / world).backward()
        ref.step()
        ref.zero_grad()
    return {
        "errors": [rel_err(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True)]
    }


def wrapped_in_ddp(rank: int, world: int, stage: int) -> dict[str, Any]:
    """A model wrapped in DistributedDataParallel writes gradients back after the reduction took them: at
    stage 2 the step would ignore them (clipping too), at stage 1 they would overwrite the reduced shard in
    the gradient buffer; it refuses, on every rank."""
    model = make_model()
    opt = make_optimizer(model, stage=stage)
    wrapped = nn.parallel.DistributedDataParallel(model)
    loss_of(wrapped, *batch(0, rank)).backward()
    before = _everything(opt, model)
    error = _error(opt.step)
    return {"error": error, "unchanged": _same(before, _everything(opt, model))}


def grad_changed_by_hand(rank: int, world: int) -> dict[str, Any]:
    """Stage 1: ``torch.nn.utils.clip_grad_norm_`` on the parameters after backward scales ``.grad``,
    a view of the buffer holding the reduced shard; the step refuses, on every rank."""
    model = make_model()
    opt = make_optimizer(model, stage=1)
    loss_of(model, *batch(0, rank)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    before = _everything(opt, model)
    error = _error(opt.step)
    return {"error": error, "unchanged": _same(before, _everything(opt, model))}


class _OwnParameter(nn.Parameter):
    """A parameter class of the user's own (a tensor subclass ZeroOptimizer does not handle)."""


def tensor_subclass_params(rank: int, world: int, stage: int) -> dict[str, Any]:
    """A DTensor parameter without ``device_mesh=`` (naming the tp dimension it lies on) and a parameter
    subclass are refused at construction, on every rank, with the parameter's name, and the model is
    left as it was."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = make_model()
    fc = model.blocks[0].fc
    fc.weight = nn.Parameter(distribute_tensor(fc.weight.detach(), mesh, [Shard(0)]))
    before = [
        p.detach().clone() if type(p) is nn.Parameter else p.to_local().clone() for p in model.parameters()
    ]
    dtensor = _error(lambda: make_optimizer(model.named_parameters(), stage=stage))
    after = [
        p.detach().clone() if type(p) is nn.Parameter else p.to_local().clone() for p in model.parameters()
    ]
    other = make_model()
    other.head.weight = _OwnParameter(other.head.weight.detach())
    own = _error(lambda: make_optimizer(other.named_parameters(), stage=stage))
    return {
        "dtensor": dtensor,
        "own": own,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "plain_after": all(type(p) in (nn.Parameter, _OwnParameter) for p in other.parameters()),
    }


def state_dict_hooks(rank: int, world: int) -> dict[str, Any]:
    """The four state-dict hooks of ``torch.optim.Optimizer`` run as they run on ``torch.optim.AdamW``
    (order, arguments, a returned dict taking the place of the one given); a load pre-hook that
    raises on one rank refuses the load on every rank, changing nothing."""

    def hooked(opt: torch.optim.Optimizer, calls: list[str]) -> None:
        opt.register_state_dict_pre_hook(lambda o: calls.append("save_pre"))
        opt.register_state_dict_post_hook(lambda o, sd: calls.append("save_post") or {**sd, "mark": 1})
        opt.register_load_state_dict_pre_hook(
            lambda o, sd: (
                calls.append(f"load_pre:{sd.get('mark')}") or {k: v for k, v in sd.items() if k != "mark"}
            )
        )
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))

    out: dict[str, Any] = {}
    for name, make in (
        ("torch", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)),
        ("zero", lambda m: make_optimizer(m, hyper={"lr": 1e-2})),
    ):
        model = make_model()
        opt = make(model)
        loss_of(model, *batch(0, rank)).backward()
        opt.step()
        calls: list[str] = []
        hooked(opt, calls)
        state = opt.state_dict()
        opt.load_state_dict(state)
        out[name] = calls
        out[f"{name}_marked"] = state.get("mark")
    model = make_model()
    opt = make_optimizer(model, hyper={"lr": 1e-2})
    loss_of(model, *batch(0, rank)).backward()
    opt.step()
    state = opt.state_dict()
    if rank == world - 1:
        opt.register_load_state_dict_pre_hook(lambda o, sd: (_ for _ in ()).throw(ValueError("hook refuses")))
    before = _everything(opt, model)
    out["refused"] = _error(lambda: opt.load_state_dict(copy.deepcopy(state)))
    out["unchanged"] = _same(before, _everything(opt, model))
    return out
