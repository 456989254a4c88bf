"""Scenarios for ``test_mesh``: ``ZeroOptimizer(..., device_mesh=mesh)`` at world 4.

Pipeline: a mesh ``("pp", "dp")`` of 2 x 2; the model's first two layers are stage 0, the last two
stage 1; each stage has its own ``ZeroOptimizer`` over its data-parallel pair, and activations and
their gradients travel between the stages with ``send``/``recv``. Checked against one process
holding the whole model and stepping ``torch.optim.AdamW`` on both data-parallel batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from scenarios_safety import _error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import ScheduleGPipe

from zeroplan.core import ZeroplanError
from zeroplan.facade import ZeroOptimizer, checkpoint
from zeroplan.facade.pipelining import ZeroPipelineStage

WIDTH, LAYERS, LR = 8, 4, 0.01


def _full() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dp)
    return torch.randn(4, WIDTH, generator=gen), torch.randn(4, WIDTH, generator=gen)


def _stage(full: torch.nn.Sequential, s: int) -> torch.nn.Sequential:
    half = LAYERS // 2
    return torch.nn.Sequential(*[full[i] for i in range(s * half, (s + 1) * half)])


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(torch.tanh(out), target)


def pipeline_against_one_process(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: 3 steps of the 2-stage pipeline and of one process; parameters and norms compared.

    ``inf_at``: the step at which stage 1 alone gets an infinite gradient (its last bias): with a
    dynamic loss scale every rank of both stages skips that step.
    """
    rows = []
    for cfg in cases:
        mesh, s, d, peer = _pipeline_mesh(cfg)
        model, opt = _stage_optimizer(cfg, mesh, s)
        ref = _full()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        norms, ref_norms, skipped = [], [], []
        for step in range(3):
            x, target = _batch(step, d)
            poison = cfg.get("inf_at") == step
            if s == 0:
                h = model(x)
                dist.send(h.detach(), peer)
                grad = torch.empty_like(h)
                dist.recv(grad, peer)
                h.backward(grad * opt.backward_scale)  # stage 1 sent d(loss)/dh unscaled
            else:
                h = torch.empty(4, WIDTH)
                dist.recv(h, peer)
                h.requires_grad_(True)
                loss = _loss(model(h), target)
                if poison:
                    loss = loss + float("inf") * model[-1].bias.sum()
                opt.backward(loss)
                dist.send(h.grad / opt.backward_scale, peer)
            norms.append(float(opt.clip_grad_norm_(cfg["clip"], norm_type=cfg.get("norm_type", 2.0))))
            opt.step()
            skipped.append(opt.last_step_skipped)
            opt.zero_grad()
            # the reference: both data-parallel batches, one process
            ref_opt.zero_grad()
            total = sum(_loss(ref(_batch(step, q)[0]), _batch(step, q)[1]) for q in range(2)) / 2
            total.backward()
            if poison:
                ref_norms.append(float("nan"))
                continue  # skipped by the pipeline: the reference skips too
            ref_norms.append(
                float(
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["clip"], cfg.get("norm_type", 2.0))
                )
            )
            ref_opt.step()
        mine, theirs = _values(model, opt), [p.detach() for p in _stage(ref, s).parameters()]
        rows.append(
            {
                "param_err": max(
                    float((a - b).abs().max() / b.abs().max()) for a, b in zip(mine, theirs, strict=True)
                ),
                "norm_err": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True) if b == b),
                "skipped": skipped,
                "stage": s,
            }
        )
    return rows


def _stage_optimizer(cfg: dict[str, Any], mesh: Any, s: int) -> tuple[torch.nn.Module, ZeroOptimizer]:
    """Stage ``s`` of the model and its optimizer over ``mesh`` (attached at stage 3)."""
    model = _stage(_full(), s)
    settings = {k: cfg[k] for k in ("loss_scale", "deterministic") if k in cfg}
    opt = ZeroOptimizer(
        model.parameters(), torch.optim.AdamW, lr=LR, stage=cfg["stage"], device_mesh=mesh, **settings
    )
    if cfg["stage"] == 3:
        opt.attach(model)
    return model, opt


def _values(model: torch.nn.Module, opt: ZeroOptimizer) -> list[torch.Tensor]:
    """The stage's parameters, whole (gathered at stage 3)."""
    with opt.gathered_params():
        return [p.detach().clone() for p in model.parameters()]


def _pipeline_mesh(cfg: dict[str, Any]) -> tuple[Any, int, int, int]:
    """A 2-stage mesh of 2 data-parallel ranks per stage (``"mics"``: as replicas of shard groups of 1);
    this rank's stage, data-parallel index and the other stage's rank of its data-parallel slice."""
    if cfg.get("mesh") == "mics":
        mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
        s, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp_replicate")
        return mesh, s, d, int(mesh.mesh[1 - s, d, 0].item())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    s, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    return mesh, s, d, int(mesh.mesh[1 - s, d].item())


def bad_meshes(rank: int, world: int) -> dict[str, str | None]:
    """Meshes zeroplan cannot use: every rank raises a ConfigError naming why, nothing hangs."""
    cases = {
        "no_names": lambda: init_device_mesh("cpu", (4,)),
        "no_dp": lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "stage")),
        "tp": lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp")),
    }
    model = torch.nn.Linear(4, 4)
    out = {
        name: _error(
            lambda build=build: ZeroOptimizer(model.parameters(), torch.optim.AdamW, device_mesh=build())
        )
        for name, build in cases.items()
    }
    # a tp dimension of one slice needs no DTensor: nothing is split
    single = init_device_mesh("cpu", (1, 4), mesh_dim_names=("tp", "dp"))
    out["tp_one"] = _error(lambda: ZeroOptimizer(model.parameters(), torch.optim.AdamW, device_mesh=single))
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    out["both"] = _error(
        lambda: ZeroOptimizer(
            model.parameters(), torch.optim.AdamW, device_mesh=mesh, process_group=dist.group.WORLD
        )
    )
    # rank 3 alone names another loss scale: disagreement, on every rank
    scale = None if rank < 3 else 128.0
    out["differ"] = _error(
        lambda: ZeroOptimizer(model.parameters(), torch.optim.AdamW, device_mesh=mesh, loss_scale=scale)
    )
    experts = [{"params": [model.weight]}, {"params": [model.bias], "process_group": dist.group.WORLD}]
    out["experts"] = _error(lambda: ZeroOptimizer(experts, torch.optim.AdamW, device_mesh=mesh))
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, device_mesh=mesh)
    opt.backward(model(torch.ones(2, 4)).sum())
    out["divisor"] = _error(lambda: opt.divide_gradients(0.0))
    opt.clip_grad_norm_(1.0)
    out["late"] = _error(lambda: opt.divide_gradients(2.0))  # averaged already
    return out


MICRO = 4


def schedule_against_one_process(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch's ``ScheduleGPipe`` over ``ZeroPipelineStage``s, 4 micro-batches a step, against one process.

    The loss is the mean over the micro-batches: ``loss_fn`` divides by their number, or (with
    ``scale_grads``) torch's schedule divides the gradients, which the stage hands to the optimizer.
    A second stage on the same optimizer is refused.
    """
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    s, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    rows = []
    for cfg in cases:
        model, opt = _stage_optimizer(cfg, mesh, s)
        stage = ZeroPipelineStage(model, s, 2, torch.device("cpu"), opt, group=mesh.get_group("pp"))
        scale = cfg.get("scale_grads", False)
        divide = 1 if scale else MICRO

        def loss_fn(
            out: torch.Tensor, target: torch.Tensor, opt: ZeroOptimizer = opt, k: int = divide
        ) -> torch.Tensor:
            return _loss(out, target) / k * opt.backward_scale  # scaled as opt.backward would

        schedule = ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=loss_fn, scale_grads=scale)
        ref = _full()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        norms, ref_norms = [], []
        for step in range(3):
            x, target = _wide_batch(step, d)
            if s == 0:
                schedule.step(x)
            else:
                schedule.step(target=target)
            norms.append(float(opt.clip_grad_norm_(cfg["clip"])))
            opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            total = sum(_loss(ref(_wide_batch(step, q)[0]), _wide_batch(step, q)[1]) for q in range(2)) / 2
            total.backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["clip"])))
            ref_opt.step()
        mine, theirs = _values(model, opt), [p.detach() for p in _stage(ref, s).parameters()]
        try:
            ZeroPipelineStage(model, s, 2, torch.device("cpu"), opt, group=mesh.get_group("pp"))
            second = None
        except ZeroplanError as exc:
            second = str(exc)
        rows.append(
            {
                "param_err": max(
                    float((a - b).abs().max() / b.abs().max()) for a, b in zip(mine, theirs, strict=True)
                ),
                "norm_err": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True)),
                "second_stage": second,
            }
        )
    return rows


def _wide_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``2 * MICRO`` rows: the schedule splits it into micro-batches of 2."""
    gen = torch.Generator().manual_seed(2000 * step + dp)
    return torch.randn(2 * MICRO, WIDTH, generator=gen), torch.randn(2 * MICRO, WIDTH, generator=gen)


def stage_checkpoints(rank: int, world: int, root: str) -> dict[str, bool]:
    """Each pipeline stage saves its optimizer (blocking, then in the background) into a root of its
    own, and a fresh optimizer of the stage loads it bit for bit."""
    cfg = {"stage": 2}
    mesh, s, d, peer = _pipeline_mesh(cfg)
    del d, peer
    model = _stage(_full(), s)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=2, device_mesh=mesh)
    for step in range(2):
        opt.backward(sum(p.square().sum() for p in model.parameters()) * (step + 1))
        opt.step()
        opt.zero_grad()
    where = f"{root}/stage{s}"
    out = {}
    for blocking in (True, False):
        saved = checkpoint.save(opt, where, blocking=blocking)
        if not blocking:
            saved.wait()
        torch.manual_seed(7)
        again = _stage(torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]), s)
        fresh = ZeroOptimizer(again.parameters(), torch.optim.AdamW, lr=LR, stage=2, device_mesh=mesh)
        checkpoint.load(fresh, where)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
        out["blocking" if blocking else "background"] = same
    return out


def stage_roots_apart(rank: int, world: int, root: str) -> dict[str, Any]:
    """pp=2 x dp=2, a root per stage: stage 1's second save fails (as a job killed between the stages'
    commits leaves them); loading each stage's latest is refused on every rank ([Note: one save across
    slices]), the parameters unchanged; the snapshot both roots hold loads."""
    import zeroplan.facade.checkpoint as ckpt

    mesh, s, d, peer = _pipeline_mesh({"stage": 2})
    del d, peer
    model = _stage(_full(), s)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=2, device_mesh=mesh)
    where = f"{root}/stage{s}"
    out: dict[str, Any] = {"stage": s}
    for step in (1, 2):
        opt.backward(sum(p.square().sum() for p in model.parameters()) * step)
        opt.step()
        opt.zero_grad()
        real = ckpt.write_tensors
        if step == 2 and s == 1:

            def killed(path: Any, tensors: Any) -> int:
                raise OSError("killed before stage 1 committed")

            ckpt.write_tensors = killed
        try:
            out[f"save{step}"] = _error(lambda n=step: checkpoint.save(opt, where, extra={"step": n}, keep=2))
        finally:
            ckpt.write_tensors = real
    torch.manual_seed(7)
    again = _stage(torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]), s)
    fresh = ZeroOptimizer(again.parameters(), torch.optim.AdamW, lr=LR, stage=2, device_mesh=mesh)
    before = [p.detach().clone() for p in again.parameters()]
    out["latest"] = _error(lambda: checkpoint.load(fresh, where))
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, again.parameters(), strict=True))
    out["older"] = checkpoint.load(fresh, f"{where}/snapshot-00000001")
    return out


def stage_consolidated_dicts(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each stage's ``consolidated_state_dict()`` (the two stages' parameters have the same ids and
    shapes) loads into its own stage and is refused, on every rank, by the other, changing nothing."""
    mesh, s, d, peer = _pipeline_mesh({"stage": 2})
    del peer
    model, opt = _stage_optimizer({"stage": 2}, mesh, s)
    for step in range(2):
        opt.backward(sum(p.square().sum() for p in model.parameters()) * (step + 1))
        opt.step()
        opt.zero_grad()
    mine = opt.consolidated_state_dict(to_rank=None)
    assert mine is not None
    if d == 0:
        torch.save(mine, f"{root}/stage{s}.pt")
    dist.barrier()
    opt.load_state_dict(torch.load(f"{root}/stage{s}.pt", weights_only=True))
    other = torch.load(f"{root}/stage{1 - s}.pt", weights_only=True)
    refused = _error(lambda: opt.load_state_dict(other))
    # stage 1 alone is given stage 0's dict; stage 0 its own with other moments: no stage loads alone
    doubled = {
        **mine,
        "state": {i: {n: v * 2 if v.dim() else v for n, v in e.items()} for i, e in mine["state"].items()},
    }
    one_stage = _error(lambda: opt.load_state_dict(other if s == 1 else doubled))
    after = opt.consolidated_state_dict(to_rank=None)
    assert after is not None
    same = all(torch.equal(after["state"][i][n], e[n]) for i, e in mine["state"].items() for n in e)
    recorded = mine["zeroplan_pipeline_stage"] == [s, 2]
    return {"recorded": recorded, "refused": refused, "one_stage": one_stage, "unchanged": same}
