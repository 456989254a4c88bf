"""Bad input, disagreement between ranks and odd gradient patterns, run on every rank."""

from __future__ import annotations

import copy
from typing import Any

import torch
from factory import OPTIMIZERS, make_optimizer
from models import Reference, averaged_grads, batch, loss_of, make_model, rel_err
from torch import nn

from zeroplan.core import DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES, ZeroplanError
from zeroplan.facade import ZeroOptimizer  # directly where construction itself is under test


def _error(make: Any) -> str | None:
    try:
        make()
    except ZeroplanError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def bad_arguments(rank: int, world: int) -> dict[str, str | None]:
    """Every construction error of the issue's point 8, each raised on every rank."""
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    ptrs = [p.data_ptr() for p in model.parameters()]
    params = list(model.parameters())
    sparse = nn.Parameter(torch.zeros(4, 4).to_sparse())
    cases = {
        "empty": lambda: ZeroOptimizer([], lr=0.1),
        "duplicate": lambda: ZeroOptimizer([params[0], params[1], params[0]], lr=0.1),
        "duplicate_across_groups": lambda: ZeroOptimizer(
            [{"params": params[:2]}, {"params": params[1:3]}], lr=0.1
        ),
        "integer": lambda: ZeroOptimizer([torch.zeros(3, dtype=torch.int64)], lr=0.1),
        "sparse": lambda: ZeroOptimizer([sparse], lr=0.1),
        "devices": lambda: ZeroOptimizer([params[0], nn.Parameter(torch.zeros(3, device="meta"))], lr=0.1),
        "shard_size": lambda: ZeroOptimizer(params, lr=0.1, shard_group_size=world + 1),
        "stage_0": lambda: ZeroOptimizer(params, lr=0.1, stage=0),
        "non_leaf": lambda: ZeroOptimizer([params[0] * 2], lr=0.1),
        "single_tensor": lambda: ZeroOptimizer(params[0], lr=0.1),
        "bad_lr": lambda: ZeroOptimizer(params, lr=-1.0),
        "bad_loss_scale": lambda: ZeroOptimizer(params, lr=0.1, loss_scale="sometimes"),
        "unknown_strategy": lambda: ZeroOptimizer(params, lr=0.1, strategy="nope"),
        "splitting_non_elementwise": lambda: ZeroOptimizer(
            params, torch.optim.Adafactor, lr=0.1, strategy="flat_even", alignment=1
        ),
    }
    out = {name: _error(make) for name, make in cases.items()}
    out["untouched"] = all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    ) and ptrs == [p.data_ptr() for p in model.parameters()]
    valid = ZeroOptimizer(params, lr=0.1)  # after the check above: it moves the parameters
    out["deepcopy"] = _error(lambda: copy.deepcopy(valid))
    return out


def disagreeing_ranks(rank: int, world: int) -> dict[str, str | None]:
    """Ranks with different models, settings or one bad parameter: a clear error everywhere, no hang."""
    shapes = make_model(width=24 if rank == 0 else 32)
    order = list(make_model().parameters())
    if rank == 1:
        order = order[::-1]
    bad = list(make_model().parameters())
    if rank == world - 1:
        bad.append(torch.zeros(2, dtype=torch.int32))
    return {
        "shapes": _error(lambda: ZeroOptimizer(shapes.parameters(), lr=0.1)),
        "order": _error(lambda: ZeroOptimizer(order, lr=0.1)),
        "settings": _error(
            lambda: ZeroOptimizer(make_model().parameters(), lr=0.1, bucket_bytes=1024 * (rank + 1))
        ),
        # Settings the plan's fingerprint alone would not name: the error names the field.
        "reduce_dtype": _error(
            lambda: ZeroOptimizer(make_model().parameters(), lr=0.1, reduce_dtype="bf16" if rank else None)
        ),
        "wire_block": _error(
            lambda: ZeroOptimizer(
                make_model().parameters(), lr=0.1, reduce_dtype="int8", wire_block=64 if rank == 2 else 128
            )
        ),
        "reshard": _error(
            lambda: ZeroOptimizer(make_model().parameters(), lr=0.1, stage=3, reshard_after_forward=rank != 1)
        ),
        "one_bad_rank": _error(lambda: ZeroOptimizer(bad, lr=0.1)),
    }


def more_ranks_than_params(rank: int, world: int, strategy: str, alignment: int) -> dict[str, Any]:
    """A 2-parameter model on 4 ranks: empty ranks still take part in every collective."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    ref_model = nn.Linear(3, 1)
    ref_model.load_state_dict(model.state_dict())
    opt = make_optimizer(
        model,
        hyper={"lr": 0.1},
        bucket_bytes=DEFAULT_BUCKET_BYTES,
        alignment=alignment,
        strategy=strategy,
        layout="rank_major",  # the expected ownership is rank-major's (interleaved: test_layout.py)
    )
    ref = Reference(ref_model, torch.optim.AdamW, lr=0.1)
    owned = [b.space.owned[opt.process_groups.shard_rank] for b in opt.buffers]
    errors = []
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(5, 3, generator=g)
        model(x).pow(2).mean().backward()
        grads = opt.averaged_gradients()
        opt.step()
        opt.zero_grad()
        ref.step(world, step, grad_fn=lambda m, w, s, g=grads: g)
        errors.append(
            max(rel_err(a, b) for a, b in zip(model.parameters(), ref.model.parameters(), strict=True))
        )
    return {"owned": owned, "errors": errors, "params": [p.detach().clone() for p in model.parameters()]}


class Branchy(nn.Module):
    """Layers whose use depends on the rank and step, so gradients arrive in different orders."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)
        self.unused = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, rank: int, step: int) -> torch.Tensor:
        if rank % 2 == 0:
            x = self.b(torch.tanh(self.a(x)))
        else:
            x = self.a(torch.tanh(self.b(x)))
        if (rank + step) % 3 != 0:  # c is unused on some ranks in some steps
            x = self.c(x)
        return x


def _branchy_grads(model: Branchy, world: int, step: int) -> list[torch.Tensor]:
    total = [torch.zeros_like(p) for p in model.parameters()]
    for r in range(world):
        model.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(100 * step + r)
        model(torch.randn(4, 6, generator=g), r, step).pow(2).mean().backward()
        for acc, p in zip(total, model.parameters(), strict=True):
            if p.grad is not None:
                acc += p.grad
    return [t / world for t in total]


def readiness_order(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Different gradient order per rank and unused parameters: reduced gradients stay exact."""
    model = Branchy()
    sgd = OPTIMIZERS["sgd"]
    opt = make_optimizer(
        model,
        optimizer="sgd",
        hyper=sgd.plain,
        stage=stage,
        bucket_bytes=64,
        alignment=4,
        max_inflight_buckets=1,
    )
    ref = Reference(Branchy(), sgd.cls, **sgd.plain)
    grad_errors, errors = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randn(4, 6, generator=g), rank, step).pow(2).mean().backward()
        reduced = opt.averaged_gradients()
        opt.step()
        opt.zero_grad()
        expected = _branchy_grads(ref.model, world, step)
        grad_errors.append(
            max(rel_err(a, b) for a, b in zip(reduced, expected, strict=True) if b.abs().max() > 0)
        )
        unused = reduced[-2:]
        ref.step(world, step, grad_fn=lambda m, w, s, r=reduced: r)
        errors.append(
            max(rel_err(a, b) for a, b in zip(model.parameters(), ref.model.parameters(), strict=True))
        )
        assert all(t.abs().max() == 0 for t in unused)  # never-used parameters reduce to zero
    return {"grad_errors": grad_errors, "errors": errors}


def second_backward_is_refused(rank: int, world: int) -> str | None:
    """Two backward passes outside no_sync in one step: a clear error instead of silent corruption."""
    model = make_model()
    opt = make_optimizer(
        model, hyper={"lr": 0.1}, bucket_bytes=DEFAULT_BUCKET_BYTES, alignment=DEFAULT_ALIGNMENT
    )
    loss_of(model, *batch(0, rank)).backward()
    try:
        loss_of(model, *batch(1, rank)).backward()
    except ZeroplanError as exc:  # raised from the autograd hook
        message = str(exc)
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = None
    opt.zero_grad()
    loss_of(model, *batch(2, rank)).backward()  # the optimizer still works after zero_grad()
    opt.step()
    return message


def determinism(
    rank: int, world: int, overlap: bool, bucket_bytes: int, stage: int, collectives: str = "auto"
) -> dict[str, Any]:
    """Final parameters and clipped norms for one setting (compared across settings by the test)."""
    model = make_model()
    opt = make_optimizer(
        model,
        hyper={"lr": 1e-2},
        stage=stage,
        bucket_bytes=bucket_bytes,
        alignment=8,
        overlap_grad_reduce=overlap,
        collectives=collectives,
    )
    norms, grads = [], []
    for step in range(3):
        loss_of(model, *batch(step, rank)).backward()
        grads.append(opt.averaged_gradients())
        norms.append(float(opt.clip_grad_norm_(0.1)))
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms, "grads": grads[0]}


def grads_after_zero_grad(rank: int, world: int, stage: int) -> dict[str, Any]:
    """``zero_grad`` semantics per stage."""
    model = make_model()
    opt = make_optimizer(
        model, hyper={"lr": 0.1}, stage=stage, bucket_bytes=DEFAULT_BUCKET_BYTES, alignment=DEFAULT_ALIGNMENT
    )
    loss_of(model, *batch(0, rank)).backward()
    opt.step()
    after_step = [p.grad is None for p in model.parameters()]
    opt.zero_grad(set_to_none=False)
    kept = [p.grad is not None and bool((p.grad == 0).all()) for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    none = [p.grad is None for p in model.parameters()]
    loss_of(model, *batch(1, rank)).backward()
    opt.step()
    return {"after_step_none": after_step, "kept_zero": kept, "none": none}


def reference_grads(model: nn.Module, world: int, step: int) -> list[torch.Tensor]:
    return averaged_grads(model, world, step)


def start_from_rank_zero(rank: int, world: int) -> dict[str, Any]:
    """Ranks that initialise differently all start from rank 0's parameters (as DDP does)."""
    model = make_model(seed=rank, dtype=torch.bfloat16)
    model.pos.weight.requires_grad_(False)  # frozen parameters are synced too
    reference = [p.detach().clone() for p in make_model(seed=0, dtype=torch.bfloat16).parameters()]
    opt = make_optimizer(model, hyper={"lr": 1e-2}, shard=2, bucket_bytes=DEFAULT_BUCKET_BYTES, alignment=8)
    same = all(torch.equal(a, b) for a, b in zip(reference, model.parameters(), strict=True))
    masters = all(torch.equal(b.master[: b.extent], b.shard_values().float()) for b in opt.buffers)
    return {"same": same, "masters": masters}


def dropped_optimizer_stays_quiet(rank: int, world: int) -> dict[str, Any]:
    """An optimizer that was dropped must not react to later backward passes (nor stay alive)."""
    import gc
    import weakref

    model = make_model()
    first = make_optimizer(
        model, hyper={"lr": 1e-2}, bucket_bytes=DEFAULT_BUCKET_BYTES, alignment=DEFAULT_ALIGNMENT
    )
    alive = weakref.ref(first)
    del first
    gc.collect()
    # other buckets, other collectives
    second = make_optimizer(model, hyper={"lr": 1e-2}, bucket_bytes=512, alignment=DEFAULT_ALIGNMENT)
    loss_of(model, *batch(0, rank)).backward()
    second.step()
    applied = not second.last_step_skipped
    return {"collected": alive() is None, "applied": applied}


def exchanges_off_gloo(rank: int, world: int) -> dict[str, Any]:
    """collectives="gloo" where the backend reports NCCL: refused on every rank; parameters untouched."""
    from unittest import mock

    import torch.distributed as dist

    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with mock.patch.object(dist, "get_backend", return_value="nccl"):
        refused = _error(lambda: make_optimizer(model, stage=2, collectives="gloo"))
        rank_major = _error(lambda: make_optimizer(model, stage=1, layout="rank_major", collectives="gloo"))
    same = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    return {"refused": refused, "rank_major": rank_major, "unchanged": same}
