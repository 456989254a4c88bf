"""Scenarios of stage 3 on a Hugging Face GPT-2 (tied ``lm_head``/``wte``), run by ``test_stage3_hf.py``.

Run on every rank of a worker pool (see dist_worker.py); each returns plain data.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from factory import OPTIMIZERS, make_optimizer
from hf_runs import LENGTH, VOCAB
from hf_runs import make_model as make_gpt2  # lm_head tied to wte, no dropout
from models import DTYPES, Reference, rel_err

from zeroplan.core import StepOrderError
from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.params.blocks import ShardedParameter

BUCKET_BYTES = 16384  # a handful of blocks for this model, several parameters in most


def tokens(step: int, rank: int) -> torch.Tensor:
    """Four arithmetic sequences modulo ``VOCAB`` for (step, rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (4, 1), generator=g)
    stride = torch.randint(1, 6, (4, 1), generator=g)
    return (start + stride * torch.arange(LENGTH)) % VOCAB


def _loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    ids = tokens(step, rank)
    return model(input_ids=ids, labels=ids).loss


def _train(model: torch.nn.Module, opt: ZeroOptimizer, rank: int, step: int) -> float:
    loss = _loss(model, step, rank)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _averaged_grads(model: torch.nn.Module, world: int, step: int) -> list[torch.Tensor]:
    total = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    for r in range(world):
        model.zero_grad(set_to_none=True)
        _loss(model, step, r).backward()
        for acc, p in zip(total, model.parameters(), strict=True):
            acc += p.grad.float()
    model.zero_grad(set_to_none=True)
    return [t / world for t in total]


def _values(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _optimizer(model: torch.nn.Module, stage: int, cfg: dict[str, Any]) -> ZeroOptimizer:
    extra = {k: cfg[k] for k in ("reshard_after_forward", "collectives") if k in cfg}
    opt = make_optimizer(model, stage=stage, bucket_bytes=BUCKET_BYTES, **extra)
    opt.attach(model)  # a no-op at stage 2
    return opt


def against_stage_2_and_torch(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 trained at stage 3 and stage 2 side by side on the same data, and by unsharded AdamW.

    Returns whether stage 3 equals stage 2 bit for bit (losses and weights), its largest relative
    error against ``torch.optim.AdamW`` on fp32 masters, its traffic against the plan's, and what it
    holds between steps.
    """
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    model3, model2, ref_model = make_gpt2(dtype=dtype), make_gpt2(dtype=dtype), make_gpt2(dtype=dtype)
    tied = model3.lm_head.weight is model3.transformer.wte.weight
    opt3, opt2 = _optimizer(model3, 3, cfg), _optimizer(model2, 2, cfg)
    adamw = OPTIMIZERS["adamw"]
    reference = Reference(ref_model, adamw.cls, **adamw.hyper)
    losses3, losses2, sharded = [], [], []
    for step in range(cfg.get("steps", 3)):
        losses3.append(_train(model3, opt3, rank, step))
        losses2.append(_train(model2, opt2, rank, step))
        sharded.append(all(type(p) is ShardedParameter for p in model3.parameters()))
        reference.step(world, step, grad_fn=_averaged_grads)
    with opt3.gathered_params():
        values3 = _values(model3)
    opt2.wait_for_params()
    values2 = _values(model2)
    outside = None
    try:
        model3.lm_head.weight.sum()
    except StepOrderError as exc:
        outside = str(exc)
    plan = opt3.memory_report().ranks[rank]
    return {
        "tied": tied,
        "losses_equal": losses3 == losses2,
        "equal_to_stage_2": all(torch.equal(a, b) for a, b in zip(values3, values2, strict=True)),
        "vs_torch": max(rel_err(a, b) for a, b in zip(values3, _values(ref_model), strict=True)),
        "sharded_between_steps": sharded,
        "outside": outside,
        "comm": sorted((c.group, str(c.collective), c.calls, c.bytes) for c in opt3.last_step_comm()),
        "planned_comm": sorted((c.group, str(c.collective), c.calls, c.bytes) for c in plan.comm),
        "blocks": len(opt3.plan.partition.spaces[0].blocks),
    }


def _masters_match(opt: ZeroOptimizer) -> bool:
    """Whether every master holds exactly this rank's shard of the parameters (cast up).

    A space stepped in place (``master is None``: fp32 at stage 2) has no master apart from them.
    """
    return all(
        buf.master is None or torch.equal(buf.master[: buf.extent], buf.shard_values().to(buf.master.dtype))
        for buf in opt.buffers
    )


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def writeback(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """``model.load_state_dict`` inside ``gathered_params()``: dropped, or kept with ``writeback=True``.

    At stages 2 and 3 side by side: train a step, load another model's weights with writeback,
    train another step. Returns per stage whether the masters held the parameters before and after
    the load, whether the loaded values are what the model then holds, and the final weights.
    """
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    new = make_gpt2(seed=1, dtype=dtype).state_dict()
    out: dict[str, Any] = {}
    for stage in (2, 3):
        model = make_gpt2(dtype=dtype)
        opt = _optimizer(model, stage, cfg)
        _train(model, opt, rank, 0)
        with opt.gathered_params():
            before = _state(model)
        masters_before = _masters_match(opt)
        if stage == 3:
            with opt.gathered_params():
                model.load_state_dict(new)
            with opt.gathered_params():
                out["dropped"] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        with opt.gathered_params(writeback=True):
            model.load_state_dict(new)
        with opt.gathered_params():
            loaded = all(torch.equal(v, new[k]) for k, v in model.state_dict().items())
        masters_after = _masters_match(opt)
        _train(model, opt, rank, 1)
        with opt.gathered_params():
            after = _values(model)
        out[stage] = {
            "masters_before": masters_before,
            "loaded": loaded,
            "masters_after": masters_after,
            "after": after,
        }
    two, three = out[2].pop("after"), out[3].pop("after")
    out["after_equal"] = all(torch.equal(a, b) for a, b in zip(two, three, strict=True))
    return out
