"""Scenarios of expert param groups ([Note: expert domains]): a mixture-of-experts model at world 4.

Expert-parallel groups of 2 (``moe.EP``) exchange tokens with ``all_to_all``; each expert's
gradient is averaged over its expert-data-parallel group (2 ranks) and its optimizer
state sharded over it; the dense parameters over the world. The reference, one
process with every expert, steps ``torch.optim`` on the gradients of the mean of the
4 ranks' losses, as one process training on the whole batch would.
"""

from __future__ import annotations

import contextlib
from typing import Any

import moe
import torch
from factory import make_optimizer
from models import DTYPES, batch, rel_err

from zeroplan.core import ZeroplanError
from zeroplan.facade.params.sharded import ShardedParams

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def _loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    tokens, targets = batch(step, rank, vocab=moe.VOCAB)
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, moe.VOCAB), targets.reshape(-1))


def _groups(model: moe.MoELM, ep_dp: Any, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    experts = {"params": model.expert_parameters(), "process_group": ep_dp}
    if "expert_lr" in cfg:
        experts["lr"] = cfg["expert_lr"]
    dense = {"params": model.dense_parameters()}
    return [experts, dense] if cfg.get("experts_first") else [dense, experts]


def _optimizer(model: moe.MoELM, ep_dp: Any, cfg: dict[str, Any]) -> Any:
    name = cfg.get("optimizer", "adamw")
    cls, hyper = OPTIMIZERS[name]
    keys = ("stage", "loss_scale", "shard", "collectives", "overlap_grad_reduce", "reshard_after_forward")
    keys += ("reduce_dtype", "gather_dtype", "offload", "offload_fraction")  # wires, offload: every domain's
    if "reduce_dtype" in cfg or "gather_dtype" in cfg:
        cfg = {**cfg, "wire_block": 16}  # dividing make_optimizer's alignment
        keys += ("wire_block",)
    settings = {k: cfg[k] for k in keys if k in cfg}
    opt = make_optimizer(_groups(model, ep_dp, cfg), optimizer=name, hyper=hyper, **settings)
    opt.attach(model)  # stage 3: every domain gathers its blocks in the model's forward
    return opt, cls, hyper


class _Reference:
    """Every expert in one process; fp32 masters stepped by ``torch.optim`` as the definition says."""

    def __init__(self, full: moe.MoELM, cls: type, hyper: dict[str, Any], cfg: dict[str, Any]) -> None:
        self.full = full
        self.dense = full.dense_parameters()
        self.experts = full.expert_parameters()
        self.master = {id(p): p.detach().float().clone() for p in full.parameters()}
        expert_hyper = {**hyper, **({"lr": cfg["expert_lr"]} if "expert_lr" in cfg else {})}
        groups = [
            {"params": [self.master[id(p)] for p in self.dense]},
            {"params": [self.master[id(p)] for p in self.experts], **expert_hyper},
        ]
        self.optimizer = cls(groups, **hyper)

    def step(self, step: int, world: int, clip: float | None, micro: int = 1) -> torch.Tensor:
        sums = {id(p): torch.zeros_like(p, dtype=torch.float32) for p in self.full.parameters()}
        for rank in range(world):
            for m in range(micro):  # accumulated micro-batches add up, as backward does
                self.full.zero_grad(set_to_none=True)
                _loss(self.full, step * micro + m, rank).backward()
                for p in self.full.parameters():
                    if p.grad is not None:
                        sums[id(p)] += p.grad.float()
        for p in self.full.parameters():  # the gradient of the mean loss over every rank's batch
            self.master[id(p)].grad = sums[id(p)] / world
        grads = [m for m in self.master.values()]
        norm = torch.nn.utils.clip_grad_norm_(grads, clip if clip is not None else 1e30)
        self.optimizer.step()
        with torch.no_grad():
            for p in self.full.parameters():
                p.copy_(self.master[id(p)])
        return norm


def _mine(full: moe.MoELM, rank: int) -> list[torch.Tensor]:
    """The reference's values of rank ``rank``'s parameters, in ``rank_model``'s order."""
    part = moe.rank_model(full, rank, None)  # type: ignore[arg-type]
    return [p.detach() for p in part.parameters()]


def matches_reference(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train the MoE model ``steps`` steps next to the reference; return the largest relative errors."""
    dtype = DTYPES[cfg.get("dtype", "fp32")]
    ep, ep_dp = moe.expert_groups(world)
    full = moe.full_model(dtype=dtype)
    model = moe.rank_model(full, rank, ep)
    opt, cls, hyper = _optimizer(model, ep_dp, cfg)
    reference = _Reference(moe.full_model(dtype=dtype), cls, hyper, cfg)
    clip, micro = cfg.get("clip"), cfg.get("micro", 1)
    schedules = []
    if cfg.get("scheduler"):  # one LambdaLR over every group, experts' included
        decay = lambda step: 0.5**step  # noqa: E731
        schedules = [torch.optim.lr_scheduler.LambdaLR(o, decay) for o in (opt, reference.optimizer)]
    param_err, norm_err, held_after_forward, saved = [], [], [], []
    for step in range(cfg.get("steps", 3)):
        for m in range(micro):  # all but the last micro-batch accumulate locally
            sync = opt.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with sync:
                loss = _loss(model, step * micro + m, rank)
                # stage 3: the bytes parameters hold between forward and backward (saved for backward)
                held_after_forward.append(sum(p.untyped_storage().nbytes() for p in model.parameters()))
                if isinstance(
                    opt.domains[0].installed.residency, ShardedParams
                ):  # every domain's saved views
                    saved.append([d.installed.residency.saved_views() for d in opt.domains])
                opt.backward(loss)
        norm = opt.clip_grad_norm_(clip) if clip is not None else opt.grad_norm()
        opt.step()
        opt.zero_grad()
        expected = reference.step(step, world, clip, micro)
        for schedule in schedules:
            schedule.step()
        norm_err.append(abs(float(norm) - float(expected)) / float(expected))
        with opt.gathered_params():
            mine = list(zip(model.parameters(), _mine(reference.full, rank), strict=True))
            param_err.append(max(rel_err(a, b) for a, b in mine))
    return {
        "param_err": param_err,
        "norm_err": norm_err,
        "domains": [d.name for d in opt.domains],
        "stepping": [type(d.installed.stepping).__name__ for d in opt.domains],
        "expert_world": opt.domains[1].settings.topology.world_size,
        "skipped": opt.last_step_skipped,
        "held_after_forward": max(held_after_forward),
        "saved_views": saved,
        "classes": sorted({type(p).__name__ for p in model.parameters()}),
        "comm": sorted({(c.group, c.collective.value) for c in opt.last_step_comm()}),
    }


def accounting(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Measured bytes next to the plans' (this rank's domains summed), after two steps."""
    ep, ep_dp = moe.expert_groups(world)
    model = moe.rank_model(moe.full_model(), rank, ep)
    opt, _, _ = _optimizer(model, ep_dp, cfg)
    for step in range(2):
        opt.backward(_loss(model, step, rank))
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    measured = opt.measured_memory()
    reports = opt.memory_reports()
    planned = reports.rank(opt.domain_positions())
    experts = reports.reports[1].ranks[opt.domains[1].groups.rank]
    expert_numel = sum(p.numel() for p in model.expert_parameters())
    try:
        opt.memory_report()
        single = None
    except ZeroplanError as exc:
        single = str(exc)
    return {
        "measured": (measured.master_bytes, measured.optimizer_state_bytes, measured.params_bytes),
        "planned": (planned.master_bytes, planned.optimizer_state_bytes, planned.params_bytes),
        "expert_state": experts.optimizer_state_bytes,
        "expert_unsharded_state": 2 * 4 * expert_numel,  # AdamW: exp_avg and exp_avg_sq, fp32
        "comm_groups": sorted({c.group for c in opt.last_step_comm()}),
        "comm": sorted(
            (c.group, c.collective.value, c.link.value, c.calls, c.bytes) for c in opt.last_step_comm()
        ),
        "planned_comm": sorted(
            (c.group, c.collective.value, c.link.value, c.calls, c.bytes) for c in planned.comm
        ),
        "single_report_error": single,
    }


def state_dict_round_trip(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Save after 2 steps, run 2 more; a fresh optimizer loading the dict runs the same 2 bit for bit."""
    ep, ep_dp = moe.expert_groups(world)
    full = moe.full_model()
    model = moe.rank_model(full, rank, ep)
    opt, _, _ = _optimizer(model, ep_dp, cfg)

    def train(m: moe.MoELM, o: Any, steps: range) -> None:
        for step in steps:
            o.backward(_loss(m, step, rank))
            o.clip_grad_norm_(1.0)
            o.step()
            o.zero_grad()

    train(model, opt, range(2))
    saved = opt.state_dict()
    values = [p.detach().clone() for p in model.parameters()]
    train(model, opt, range(2, 4))
    again = moe.rank_model(full, rank, ep)
    with torch.no_grad():
        for p, v in zip(again.parameters(), values, strict=True):
            p.copy_(v)
    fresh, _, _ = _optimizer(again, ep_dp, cfg)
    fresh.load_state_dict(saved)
    train(again, fresh, range(2, 4))
    errors = {}
    for what, call in (("shards", fresh.shards), ("consolidated", fresh.consolidated_state_dict)):
        try:
            call()
        except ZeroplanError as exc:
            errors[what] = str(exc)
    try:
        fresh.load_state_dict(fresh.inner_optimizer.state_dict())
    except ZeroplanError as exc:
        errors["plain"] = str(exc)
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)),
        "format": saved.get("format"),
        "domains": sorted(saved.get("domains", {})),
        "errors": errors,
    }


def overflow_on_one_expert(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """An expert gradient overflows on rank 3 only: every rank of every domain skips the step."""
    ep, ep_dp = moe.expert_groups(world)
    model = moe.rank_model(moe.full_model(), rank, ep)
    opt, _, _ = _optimizer(model, ep_dp, {**cfg, "loss_scale": "dynamic"})
    before = [p.detach().clone() for p in model.parameters()]
    scale = opt.loss_scale
    loss = _loss(model, 0, rank)
    if rank == 3:
        hook = model.experts[0].up.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    opt.backward(loss)
    if rank == 3:
        hook.remove()
    opt.step()
    return {
        "skipped": opt.last_step_skipped,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)),
        "scale": (scale, opt.loss_scale),
    }


def misuse(rank: int, world: int, case: str) -> str | None:
    """A wrong expert setup; returns this rank's error message (every rank must raise)."""
    ep, ep_dp = moe.expert_groups(world)
    model = moe.rank_model(moe.full_model(), rank, ep)
    groups = _groups(model, ep_dp, {})
    settings: dict[str, Any] = {}
    if case == "shapes":  # rank 2 holds bigger experts than its group's other rank (0)
        if rank == 2:
            groups[1]["params"] = [torch.nn.Parameter(torch.zeros(3, 3))]
    elif case == "lr":  # rank 3's experts train with another lr than rank 1's
        groups[1]["lr"] = 0.5 if rank == 3 else 0.1
    elif case == "not_a_group":  # on rank 1 only: the others learn of it and raise too
        if rank == 1:
            groups[1]["process_group"] = "ep_dp"
    elif case == "not_member":  # the expert-data-parallel group of the other position
        others = [torch.distributed.new_group(list(range(p, world, moe.EP))) for p in range(moe.EP)]
        groups[1]["process_group"] = others[(rank + 1) % moe.EP]
    elif case == "not_partition":  # {0,1}, {0,1}, {1,2}, {2,3}: rank 2's group is not rank 1's
        made = [torch.distributed.new_group(r) for r in ([0, 1], [1, 2], [2, 3])]
        groups[1]["process_group"] = made[max(0, rank - 1)]
    elif case == "twice":
        groups[1]["params"] = [*groups[1]["params"], model.head.weight]
    try:
        make_optimizer(groups, **settings)
    except ZeroplanError as exc:
        return str(exc)
    return None


def idle_experts_on_one_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's experts get no gradient in step 1 (no token reached them) while rank 2's, in its group, do.

    Trained twice, with and without overlapping the dense reduction: it must not hang, the copies
    of each expert must stay equal across their group, and both runs must agree bit for bit.
    """
    ep, ep_dp = moe.expert_groups(world)
    runs = []
    for overlap in (True, False):
        model = moe.rank_model(moe.full_model(), rank, ep)
        opt, _, _ = _optimizer(model, ep_dp, {**cfg, "overlap_grad_reduce": overlap})
        for step in range(3):
            for expert in model.experts:
                expert.idle = rank == 0 and step == 1
            opt.backward(_loss(model, step, rank))
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        with opt.gathered_params():
            runs.append([p.detach().clone() for p in model.parameters()])
            experts = torch.cat([p.detach().reshape(-1) for p in model.expert_parameters()])
        peers = [torch.empty_like(experts) for _ in range(world // moe.EP)]
        torch.distributed.all_gather(peers, experts, group=ep_dp)
    return {
        "same_in_group": all(torch.equal(peers[0], p) for p in peers),
        "overlap_equal": all(torch.equal(a, b) for a, b in zip(*runs, strict=True)),
    }


def replanning_with_experts(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Freeze the gate (refresh_trainable), then add an expert group (add_param_group); train in between."""
    ep, ep_dp = moe.expert_groups(world)
    model = moe.rank_model(moe.full_model(), rank, ep)
    opt, _, _ = _optimizer(model, ep_dp, cfg)
    extra = torch.nn.Parameter(torch.full((3,), 1.0 + rank % moe.EP))  # equal within an expert group

    def train(step: int) -> None:
        loss = _loss(model, step, rank) + 1e-3 * (extra * extra).sum()
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    train(0)
    model.gate.weight.requires_grad_(False)
    opt.refresh_trainable()
    with opt.gathered_params():
        gate = model.gate.weight.detach().clone()
    train(1)
    opt.add_param_group({"params": [extra], "process_group": ep_dp, "lr": 0.5})
    train(2)
    with opt.gathered_params():
        frozen = torch.equal(gate, model.gate.weight)
        values = extra.detach().clone()
    peers = [torch.empty_like(values) for _ in range(world // moe.EP)]
    torch.distributed.all_gather(peers, values, group=ep_dp)
    return {
        "frozen": frozen,
        "moved": not torch.equal(values, torch.full((3,), 1.0 + rank % moe.EP)),
        "same_in_group": all(torch.equal(peers[0], p) for p in peers),
        "groups": [(d.name, len(d.param_groups)) for d in opt.domains],
        "lr": opt.param_groups[-1]["lr"],
    }


def one_rank_misuses_replanning(rank: int, world: int, case: str) -> str | None:
    """Only rank 0 errs (an unknown process group, a bad state dict): every rank must raise, none hang."""
    ep, ep_dp = moe.expert_groups(world)
    model = moe.rank_model(moe.full_model(), rank, ep)
    opt, _, _ = _optimizer(model, ep_dp, {})
    opt.backward(_loss(model, 0, rank))
    opt.step()
    opt.zero_grad()
    try:
        if case == "unknown_group":
            stranger = torch.distributed.new_group(list(range(world)))  # the world's ranks, another object
            group = stranger if rank == 0 else ep_dp
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "process_group": group})
        elif case == "bad_state_dict":
            saved = opt.state_dict()
            opt.load_state_dict({"format": "something else"} if rank == 0 else saved)
        elif case == "expert_param_again":  # rank 0 lists one of its experts in a new data group
            experts = [q for g in opt.param_groups if "process_group" in g for q in g["params"]]
            again = experts[0] if rank == 0 else torch.nn.Parameter(torch.zeros_like(experts[0]))
            groups = len(opt.param_groups)
            try:
                opt.add_param_group({"params": [again]})
            finally:
                assert len(opt.param_groups) == groups  # nothing registered, on any rank
        elif case == "expert_group_only":  # a bad lr inside expert group {0, 2} only
            lr = "fast" if rank in (0, 2) else 0.1
            opt.add_param_group(
                {"params": [torch.nn.Parameter(torch.zeros(2))], "process_group": ep_dp, "lr": lr}
            )
    except ZeroplanError as exc:
        return str(exc)
    return None
