"""Scenarios for ``test_tensor_parallel``: DTensor parameters from torch's tensor parallel, world 4.

A mesh ``("dp", "tp")`` of 2 x 2. The model (a sequence-parallel LayerNorm, a column-split Linear,
tanh, a row-split Linear back to sequence shards, a second sequence-parallel LayerNorm) is placed on
``mesh["tp"]`` by ``parallelize_module``; each tp rank feeds its half of the sequence, each dp rank
its own batch. Checked against one process holding the plain model and stepping
``torch.optim.AdamW`` on both data-parallel batches whole.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from models import rel_err
from scenarios_safety import _error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from zeroplan.facade import ZeroOptimizer, checkpoint
from zeroplan.facade.checkpoint import interchange

WIDTH, SEQ, BATCH, LR = 8, 4, 2, 0.01


def _plain(hidden: int, width: int = WIDTH) -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, width),
        torch.nn.LayerNorm(width),
    )
    with torch.no_grad():  # norms that are not the identity, so their gradients matter
        for norm in (model[0], model[4]):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return model


def _parallel(mesh: Any, hidden: int, width: int = WIDTH) -> torch.nn.Sequential:
    """The plain model placed on ``mesh["tp"]``: sequence-parallel norms, column- then row-split."""
    uneven = hidden % mesh["tp"].size() != 0  # torch needs DTensor outputs for uneven local shards
    plan = {
        "0": SequenceParallel(),
        "1": ColwiseParallel(input_layouts=Shard(1), use_local_output=not uneven),
        "3": RowwiseParallel(output_layouts=Shard(1)),
        "4": SequenceParallel(),
    }
    return parallelize_module(_plain(hidden, width), mesh["tp"], plan)


def _batch(step: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + d)
    return torch.randn(BATCH, SEQ, WIDTH, generator=gen), torch.randn(BATCH, SEQ, WIDTH, generator=gen)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean over the whole sequence, of which ``out`` may hold a part (its sum over tp is the loss)."""
    return ((torch.tanh(out) - target) ** 2).sum() / (BATCH * SEQ * WIDTH)


def _worst(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    """The largest relative difference of two lists of parameters."""
    return max(rel_err(a, b) for a, b in zip(mine, theirs, strict=True))


def _local(x: torch.Tensor, t: int, tp: int) -> torch.Tensor:
    """Tensor rank ``t``'s part of the sequence."""
    return x.chunk(tp, dim=1)[t]


def tensor_against_one_process(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: 3 steps at tp=2 x dp=2 (world 4; tp=2 x dp=1 at world 2, each rank both batches)
    and of one process; parameters and clip norms compared.

    ``inf_at``: the step at which tp rank 1 alone gets an infinite gradient (in its shard of the
    column-split weight): with a dynamic loss scale every rank skips that step.
    """
    rows = []
    for cfg in cases:
        if cfg.get("mesh") == "mics":  # shard groups of 1 replicated twice, inside each tp slice
            mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
            d = mesh.get_local_rank("dp_replicate")
        else:  # world 2: tp=2 x dp=1, both batches on each rank
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            d = mesh.get_local_rank("dp")
        batches = [d] if world == 4 else [0, 1]
        t = mesh.get_local_rank("tp")
        hidden = cfg.get("hidden", 6)
        model = _parallel(mesh, hidden)
        keys = ("loss_scale", "deterministic", "offload", "reshard_after_forward")
        settings = {k: cfg[k] for k in keys if k in cfg}
        params = list(model.parameters())
        first = params[:-2] if cfg.get("add_group") else params  # the last norm added as its own group
        opt = ZeroOptimizer(first, torch.optim.AdamW, lr=LR, stage=cfg["stage"], device_mesh=mesh, **settings)
        if cfg.get("add_group"):
            opt.add_param_group({"params": params[-2:]})
        # stage 3: the forward gathers its local shards ([Note: deferred DTensor parameters])
        opt.attach(model)
        ref = _plain(hidden)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        norm_type = cfg.get("norm_type", 2.0)
        norms, ref_norms, skipped = [], [], []
        for step in range(3):
            loss = 0.0
            for q in batches:
                x, target = _batch(step, q)
                if cfg.get("recompute"):  # activation checkpointing: the forward runs again in backward
                    out = torch.utils.checkpoint.checkpoint(model, _local(x, t, 2), use_reentrant=False)
                else:
                    out = model(_local(x, t, 2))
                out = out.to_local() if isinstance(out, DTensor) else out
                loss = loss + _loss(out, _local(target, t, 2)) / len(batches)
            poison = cfg.get("inf_at") == step
            if poison and t == 1:
                loss = loss + float("inf") * model[1].weight.to_local().sum()
            opt.backward(loss)
            norms.append(float(opt.clip_grad_norm_(cfg["clip"], norm_type=norm_type)))
            opt.step()
            skipped.append(opt.last_step_skipped)
            opt.zero_grad()
            ref_opt.zero_grad()
            total = sum(_loss(ref(_batch(step, q)[0]), _batch(step, q)[1]) for q in range(2)) / 2
            total.backward()
            if poison:
                ref_norms.append(float("nan"))
                continue
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["clip"], norm_type)))
            ref_opt.step()
        with opt.gathered_params():  # stage 3: the local shards whole
            mine = [p.detach().full_tensor() for p in model.parameters()]
            local_shapes = [tuple(p.to_local().shape) for p in model.parameters()]
        theirs = [p.detach() for p in ref.parameters()]
        rows.append(
            {
                "param_err": _worst(mine, theirs),
                "norm_err": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True) if b == b),
                "skipped": skipped,
                "local_shapes": local_shapes,
            }
        )
    return rows


def bad_tensor_parameters(rank: int, world: int) -> dict[str, str | None]:
    """DTensor parameters zeroplan cannot shard: every rank raises a ConfigError naming why."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = _parallel(mesh, 6)
    out = {
        "no_mesh": _error(lambda: ZeroOptimizer(model.parameters(), torch.optim.AdamW)),
        "other_mesh": _error(lambda: ZeroOptimizer(model.parameters(), torch.optim.AdamW, device_mesh=flat)),
    }
    from torch.distributed.tensor import Partial

    partial_param = torch.nn.Parameter(
        DTensor.from_local(torch.ones(2), mesh["tp"], [Partial()], run_check=False)
    )
    out["partial"] = _error(lambda: ZeroOptimizer([partial_param], torch.optim.AdamW, device_mesh=mesh))
    transposed = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))  # other ranks form each tp
    elsewhere = _parallel(transposed, 6)
    out["elsewhere"] = _error(
        lambda: ZeroOptimizer(elsewhere.parameters(), torch.optim.AdamW, device_mesh=mesh)
    )
    # one data-parallel group alone refuses (tp rank 1 passes a Partial parameter): all raise
    mine = [model[0].weight] if mesh.get_local_rank("tp") == 0 else [partial_param]
    out["alone"] = _error(lambda: ZeroOptimizer(mine, torch.optim.AdamW, device_mesh=mesh))
    placed = distribute_tensor(torch.ones(4, 4), mesh["tp"], [Shard(0)])
    out["plain_optimizer_ok"] = _error(
        lambda: ZeroOptimizer([torch.nn.Parameter(placed)], torch.optim.AdamW, device_mesh=mesh)
    )
    dist.barrier()
    return out


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, batches: list[int], t: int) -> None:
    """One step on the data-parallel batches ``batches`` (their mean loss), this rank's sequence part."""
    loss = 0.0
    for q in batches:
        x, target = _batch(step, q)
        out = model(_local(x, t, 2))
        loss = loss + _loss(out.to_local() if isinstance(out, DTensor) else out, _local(target, t, 2))
    loss = loss / len(batches)
    opt.backward(loss) if isinstance(opt, ZeroOptimizer) else loss.backward()  # type: ignore[union-attr]
    opt.step()
    opt.zero_grad()


def tensor_checkpoints(rank: int, world: int, root: str) -> dict[str, Any]:
    """At tp=2 x dp=2, stage 3: two steps, each tp slice saves into its own root, a fresh optimizer
    loads it bit for bit; a third step's parameters are kept for :func:`tensor_checkpoint_elsewhere`
    (which loads them at stage 1)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = _parallel(mesh, 6)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=3, device_mesh=mesh)
    opt.attach(model)
    for step in range(2):
        _step(model, opt, step, [d], t)
    checkpoint.save(opt, f"{root}/tp{t}")
    fresh_model = _parallel(mesh, 6)
    fresh = ZeroOptimizer(fresh_model.parameters(), torch.optim.AdamW, lr=LR, stage=3, device_mesh=mesh)
    checkpoint.load(fresh, f"{root}/tp{t}")
    with opt.gathered_params(), fresh.gathered_params():
        same = all(
            torch.equal(a.to_local(), b.to_local())
            for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True)
        )
    _step(model, opt, 2, [d], t)
    with opt.gathered_params():
        after = [p.detach().full_tensor() for p in model.parameters()]
    if rank == 0:
        torch.save(after, f"{root}/after.pt")
    dist.barrier()
    return {"same": same}


def tensor_checkpoint_elsewhere(rank: int, world: int, root: str) -> dict[str, Any]:
    """World 2, tp=2 x dp=1: each tp slice loads its root saved at dp=2 and runs the third step on both
    batches; the parameters equal the uninterrupted run's within the fp32 tolerance."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    t = mesh.get_local_rank("tp")
    model = _parallel(mesh, 6)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=1, device_mesh=mesh)
    checkpoint.load(opt, f"{root}/tp{t}")
    _step(model, opt, 2, [0, 1], t)
    mine = [p.detach().full_tensor() for p in model.parameters()]
    after = torch.load(f"{root}/after.pt")
    return {"param_err": _worst(mine, after)}


def tensor_step_peak(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """MemTracker's peak of a whole step at tp=2 x dp=2 (entered before the model exists, re-entered
    around each step), next to the plan's ``peak_bytes`` of the local shards. A wide model, one short
    sequence: activations are under 1% of the parameters' bytes."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from zeroplan.facade.diagnostics.meter import step_peaks, tracked_bytes

    width, hidden = 256, 1024
    tracker = MemTracker()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    with tracker:
        model = _parallel(mesh, hidden, width)
        local_params = sum(p.to_local().numel() for p in model.parameters())
        opt = ZeroOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            lr=LR,
            stage=cfg["stage"],
            device_mesh=mesh,
            bucket_bytes=40_000,
        )
        if cfg["stage"] == 3:
            opt.attach(model)
        gen = torch.Generator().manual_seed(d)
        x = torch.randn(1, 2, width, generator=gen)  # this rank's half of a sequence of 4

    def step() -> None:
        out = model(x)
        loss = (out.to_local() if isinstance(out, DTensor) else out).square().mean()
        opt.backward(loss)
        del loss, out
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    peaks = step_peaks(tracker, step, 3)
    report = opt.memory_report(clipping=True).ranks[opt.process_groups.rank]
    return {
        "measured": peaks,
        "planned": report.peak_bytes,
        "persistent": tracked_bytes(tracker),
        "planned_persistent": report.total_bytes,
        "local_params": local_params,
        "tp": t,
    }


def against_fsdp2(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The same tensor-parallel model and data under FSDP2 (``fully_shard`` over ``mesh["dp"]``, as
    torchtitan composes it with tensor parallel) and under zeroplan: 3 steps, parameters compared."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    ours = _parallel(mesh, 6)
    opt = ZeroOptimizer(ours.parameters(), torch.optim.AdamW, lr=LR, stage=cfg["stage"], device_mesh=mesh)
    if cfg["stage"] == 3:
        opt.attach(ours)
    theirs = _parallel(mesh, 6)
    fully_shard(theirs, mesh=mesh["dp"])
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=LR)
    for step in range(3):
        _step(ours, opt, step, [d], t)
        x, target = _batch(step, d)
        out = theirs(_local(x, t, 2))
        _loss(out.to_local() if isinstance(out, DTensor) else out, _local(target, t, 2)).backward()
        their_opt.step()
        their_opt.zero_grad()
    with opt.gathered_params():
        mine = [p.detach().full_tensor() for p in ours.parameters()]
    other = [p.detach().full_tensor() for p in theirs.parameters()]
    return {
        "param_err": _worst(mine, other),
        "fsdp2_mesh": theirs[1].weight.device_mesh.mesh_dim_names,
    }


def tensor_checkpoint_resliced(rank: int, world: int, root: str) -> dict[str, Any]:
    """A plain model (tp=1) over dp=``world`` loads the tp=2 x dp=2 checkpoint from both slices' roots
    and runs the third step on both batches; the parameters equal the uninterrupted run's."""
    model = _plain(6)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=2)
    checkpoint.load(opt, [f"{root}/tp{k}" for k in range(2)])
    if world == 2:  # for tensor_checkpoint_sliced: the same state, saved plain (tp degree 1)
        checkpoint.save(opt, f"{root}/plain")
    mine_batches = [q for q in range(2) if q % world == rank]
    loss = sum(_loss(model(_batch(2, q)[0]), _batch(2, q)[1]) for q in mine_batches) / len(mine_batches)
    opt.backward(loss)
    opt.step()
    after = torch.load(f"{root}/after.pt")
    mine = [p.detach() for p in model.parameters()]
    return {"param_err": _worst(mine, after)}


def tensor_checkpoint_bad_slices(rank: int, world: int, root: str) -> dict[str, Any]:
    """Slices given out of order, or one missing: a CheckpointError on every rank, nothing loaded."""
    model = _plain(6)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=2)
    before = [p.detach().clone() for p in model.parameters()]
    out = {
        "missing": _error(lambda: checkpoint.load(opt, [f"{root}/tp0"])),
        "reversed": _error(lambda: checkpoint.load(opt, [f"{root}/tp1", f"{root}/tp0"])),
        "one_slice": _error(lambda: checkpoint.load(opt, f"{root}/tp0")),  # a slice is not the model
    }
    out["unchanged"] = all(
        torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True)
    )
    return out


def tensor_checkpoint_sliced(rank: int, world: int, root: str) -> dict[str, Any]:
    """tp=2 x dp=2 loads the plain checkpoint (tp degree 1) as a one-slice list, runs the third step;
    the parameters equal the uninterrupted run's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = _parallel(mesh, 6)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=2, device_mesh=mesh)
    checkpoint.load(opt, [f"{root}/plain"])
    _step(model, opt, 2, [d], t)
    mine = [p.detach().full_tensor() for p in model.parameters()]
    after = torch.load(f"{root}/after.pt")
    return {"param_err": _worst(mine, after)}


def tensor_slices_commit_apart(rank: int, world: int, root: str) -> dict[str, Any]:
    """tp=2 x dp=2, each slice its own root ([Note: one save across slices]): the second save fails on
    tp slice 1 only (as a job killed between the slices' commits leaves them); loading each slice's
    latest is refused on every rank, nothing changes; the older snapshot both roots hold loads."""
    import zeroplan.facade.checkpoint as ckpt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = _parallel(mesh, 6)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=2, device_mesh=mesh)
    out: dict[str, Any] = {"rank": rank}
    for step in (1, 2):
        _step(model, opt, step, [d], t)
        real = ckpt.write_tensors
        if step == 2 and t == 1:

            def killed(path: Any, tensors: Any) -> int:
                raise OSError("killed before slice 1 committed")

            ckpt.write_tensors = killed
        try:
            out[f"save{step}"] = _error(
                lambda s=step: checkpoint.save(opt, f"{root}/tp{t}", extra={"step": s}, keep=2)
            )
        finally:
            ckpt.write_tensors = real
    fresh_model = _parallel(mesh, 6)
    fresh = ZeroOptimizer(fresh_model.parameters(), torch.optim.AdamW, lr=LR, stage=2, device_mesh=mesh)
    before = [p.detach().to_local().clone() for p in fresh_model.parameters()]
    stateful = len(fresh.state)
    out["latest"] = _error(lambda: checkpoint.load(fresh, f"{root}/tp{t}"))
    out["unchanged"] = all(
        torch.equal(a, b.detach().to_local()) for a, b in zip(before, fresh_model.parameters(), strict=True)
    )
    out["no_state"] = len(fresh.state) == stateful
    out["resliced"] = _error(lambda: checkpoint.load(fresh, [f"{root}/tp0", f"{root}/tp1"]))
    out["older"] = checkpoint.load(fresh, f"{root}/tp{t}/snapshot-00000001")
    return out


def _stage_module(mesh: Any, s: int, plain_last: bool = False) -> torch.nn.Sequential:
    """Pipeline stage ``s`` of a two-stage model: the tensor-parallel model of :func:`_parallel`, its
    initial values drawn for the stage. ``plain_last``: stage 0 splits its Linears alone (whole
    activations in and out, its norms plain), stage 1 is not parallelized at all (replicated over tp)."""
    torch.manual_seed(100 + s)
    plain = _plain(6)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if mesh is None or (plain_last and s == 1):
        return plain
    if plain_last:
        return parallelize_module(plain, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    plan = {
        "0": SequenceParallel(),
        "1": ColwiseParallel(input_layouts=Shard(1)),
        "3": RowwiseParallel(output_layouts=Shard(1)),
        "4": SequenceParallel(),
    }
    return parallelize_module(plain, mesh["tp"], plan)


def pipeline_with_tensor_parallel(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A ``("pp", "dp", "tp")`` mesh of 2 x 1 x 2: each stage's optimizer over its tp-placed module,
    activations (sequence shards) sent between the stages' ranks of one tp coordinate; 3 steps against
    one process holding both stages; the clip norm is the whole model's on every rank. ``plain_last``:
    stage 1 holds no DTensor (whole activations, the whole loss on every tp rank)."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    s, t = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    peer = int(mesh.mesh[1 - s, 0, t].item())
    plain_last = cfg.get("plain_last", False)
    part = (lambda v: v) if plain_last else (lambda v: _local(v, t, 2))  # what one tp rank feeds
    model = _stage_module(mesh, s, plain_last)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=cfg["stage"], device_mesh=mesh)
    if cfg["stage"] == 3:
        opt.attach(model)
    ref = torch.nn.Sequential(_stage_module(None, 0), _stage_module(None, 1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    norms, ref_norms = [], []
    for step in range(3):
        x, target = _batch(step, 0)
        if s == 0:
            out = model(part(x))
            h = out.to_local() if isinstance(out, DTensor) else out
            dist.send(h.detach().contiguous(), peer)
            grad = torch.empty_like(h)
            dist.recv(grad, peer)
            h.backward(grad)
        else:
            h = torch.empty(BATCH, SEQ if plain_last else SEQ // 2, WIDTH)
            dist.recv(h, peer)
            h.requires_grad_(True)
            out = model(h)
            loss = _loss(out.to_local() if isinstance(out, DTensor) else out, part(target))
            opt.backward(loss)
            dist.send(h.grad.contiguous(), peer)
        norms.append(float(opt.clip_grad_norm_(cfg["clip"])))
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _loss(ref(x), target).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["clip"])))
        ref_opt.step()
    with opt.gathered_params():
        mine = [
            p.detach().full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()
        ]
    theirs = [p.detach() for p in ref[s].parameters()]
    return {
        "placed": any(isinstance(p, DTensor) for p in model.parameters()),
        "param_err": _worst(mine, theirs),
        "norm_err": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True)),
    }


def low_precision_against_masters(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """bf16 or fp16 (``cfg["dtype"]``) DTensor parameters at tp=2 x dp=2 against the same tp model
    stepped by hand: its local gradients (in the model's dtype and their parameter's placement) summed
    over dp, ``torch.optim.AdamW`` on fp32 copies of the local tensors, cast back (what fp32 masters
    are). fp16 runs a dynamic loss scale: the hand-written side backpropagates the loss times the
    optimizer's scale of that step, divides by it in fp32, and skips a step whose gradients are not
    finite on any rank; at step 1 tp rank 1 alone overflows. 3 steps, parameters compared."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.get("dtype", "bf16")]
    scaled = dtype is torch.float16
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    ours = _parallel(mesh, 6).to(dtype)
    opt = ZeroOptimizer(
        ours.parameters(),
        torch.optim.AdamW,
        lr=LR,
        stage=cfg["stage"],
        device_mesh=mesh,
        loss_scale="dynamic" if scaled else None,
    )
    opt.attach(ours)  # stage 3: the forward gathers its local shards
    theirs = _parallel(mesh, 6).to(dtype)
    masters = [p.to_local().detach().float().clone() for p in theirs.parameters()]
    master_opt = torch.optim.AdamW(masters, lr=LR)
    dp = mesh.get_group("dp")
    skipped, theirs_skipped = [], []
    for step in range(3):
        x, target = _batch(step, d)
        scale = opt.loss_scale
        for model in (ours, theirs):
            out = model(_local(x, t, 2).to(dtype))
            loss = _loss((out.to_local() if isinstance(out, DTensor) else out).float(), _local(target, t, 2))
            if scaled and step == 1 and t == 1:
                loss = loss * float("inf")  # tp rank 1 alone
            opt.backward(loss) if model is ours else (loss * scale).backward()
        opt.step()
        skipped.append(opt.last_step_skipped)
        opt.zero_grad()
        grads = []
        for p in theirs.parameters():
            grad = p.grad.redistribute(p.device_mesh, p.placements).to_local()
            dist.all_reduce(grad, group=dp)
            grads.append(grad)
            p.grad = None
        bad = torch.tensor([float(not all(bool(g.isfinite().all()) for g in grads))])
        dist.all_reduce(bad, dist.ReduceOp.MAX)  # over the whole mesh
        theirs_skipped.append(bool(bad.item()))
        if bad.item():
            continue
        for grad, master in zip(grads, masters, strict=True):
            master.grad = grad.float() / (2 * scale)
        master_opt.step()
        with torch.no_grad():
            for p, master in zip(theirs.parameters(), masters, strict=True):
                p.to_local().copy_(master)
    with opt.gathered_params():
        pairs = [
            (a.to_local().clone(), b.to_local())
            for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
        ]
    return {
        "equal": [torch.equal(a, b) for a, b in pairs],
        "err": max(float((a.float() - b.float()).abs().max()) for a, b in pairs),
        "skipped": skipped,
        "theirs_skipped": theirs_skipped,
    }


def tensor_dcp_round_trip(rank: int, world: int, root: str, stage: int = 2) -> dict[str, Any]:
    """torch's DCP of a tp=2 x dp=2 zeroplan run at ``stage`` (the model's DTensors from torch's
    ``get_model_state_dict``, at stage 3 the rank's pieces of them in global coordinates; the
    optimizer's pieces in global coordinates from torch's ``get_optimizer_state_dict``) loads into a
    fresh zeroplan (stage 1 after stage 2, stage 3 after stage 3) and into FSDP2 with the same tp
    plan; each takes the third step, and their parameters equal the uninterrupted run's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")

    def states(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}

    model = _parallel(mesh, 6)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=stage, device_mesh=mesh)
    opt.attach(model)
    for step in range(2):
        _step(model, opt, step, [d], t)
    dcp.save(states(model, opt), checkpoint_id=f"{root}/dcp")
    _step(model, opt, 2, [d], t)
    with opt.gathered_params():
        after = [p.detach().full_tensor() for p in model.parameters()]
    errors = {}
    for name in ("zeroplan", "fsdp2"):
        fresh = _parallel(mesh, 6)
        gathered: Any = contextlib.nullcontext()
        if name == "zeroplan":
            fresh_opt: torch.optim.Optimizer = ZeroOptimizer(
                fresh.parameters(), torch.optim.AdamW, lr=LR, stage=1 if stage < 3 else 3, device_mesh=mesh
            )
            fresh_opt.attach(fresh)
            gathered = fresh_opt.gathered_params()
        else:
            fully_shard(fresh, mesh=mesh["dp"])
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
        state = states(fresh, fresh_opt)
        dcp.load(state, checkpoint_id=f"{root}/dcp")
        set_model_state_dict(fresh, state["model"])
        set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
        if name == "zeroplan":
            _step(fresh, fresh_opt, 2, [d], t)
        else:
            x, target = _batch(2, d)
            out = fresh(_local(x, t, 2))
            _loss(out.to_local() if isinstance(out, DTensor) else out, _local(target, t, 2)).backward()
            fresh_opt.step()
        with gathered:
            errors[name] = _worst([p.detach().full_tensor() for p in fresh.parameters()], after)
    return errors


def tensor_stage3_uses(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Stage 3 at tp=2 x dp=2 ([Note: deferred DTensor parameters]): between steps a rank holds no
    block and a read of a DTensor parameter's values raises (metadata reads as usual); the forward
    and backward free what they gathered; ``model.state_dict()`` gives the rank's pieces in global
    coordinates and ``load_state_dict`` of them keeps every value. Stage 2: after ``step()`` a
    DTensor's gather is in flight (its class says so) until its first use."""
    from zeroplan.core import StepOrderError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = _parallel(mesh, 6)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=3, device_mesh=mesh)
    opt.attach(model)
    residency = opt.installed.residency
    w = model[1].weight
    reads = {
        "to_local": w.to_local,
        "full_tensor": w.full_tensor,
        "redistribute": lambda: w.redistribute(w.device_mesh, w.placements),
        "add": lambda: w + 1,
        "repr": lambda: repr(w),
        "data": lambda: w.data,
    }
    raised = {}
    for name, read in reads.items():
        try:
            read()
            raised[name] = False
        except StepOrderError:
            raised[name] = True
    out: dict[str, Any] = {
        "raised": raised,
        "meta": (tuple(w.shape), tuple(w.placements) == (Shard(0),), w.grad is None, w.requires_grad),
        "held_at_rest": residency.held_bytes(),
    }
    x, target = _batch(0, d)
    y = model(_local(x, t, 2))
    out["held_after_forward"] = residency.held_bytes()
    opt.backward(_loss(y.to_local(), _local(target, t, 2)))
    out["held_after_backward"] = residency.held_bytes()
    opt.step()
    opt.zero_grad()
    pieces = model.state_dict()["1.weight"]
    out["dict"] = (type(pieces).__name__, tuple(pieces.shape) == tuple(w.shape))
    with opt.gathered_params():
        before = [p.detach().full_tensor() for p in model.parameters()]
    model.load_state_dict(model.state_dict())
    with opt.gathered_params():
        out["kept"] = all(
            torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, model.parameters(), strict=True)
        )
    # stage 2: a DTensor's gather overlaps what follows step(), its first use waits for it
    replicated = _parallel(mesh, 6)
    opt = ZeroOptimizer(replicated.parameters(), torch.optim.AdamW, lr=LR, stage=2, device_mesh=mesh)
    _step(replicated, opt, 0, [d], t)
    w = replicated[1].weight
    out["in_flight"] = type(w).__name__
    w.to_local()
    out["arrived"] = type(w).__name__
    return out


def tensor_deterministic(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Deterministic mode at tp=2 over ``world // 2`` data-parallel ranks: 3 steps over 4 canonical
    micro-batches, dp rank ``d`` running its share with ``no_sync()`` around all but its last backward
    (each loss divided by the share); the digest of the whole parameters and the clip norms."""
    from scenarios_deterministic import _digest

    dp = world // 2
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = _parallel(mesh, 6)
    opt = ZeroOptimizer(
        model.parameters(), torch.optim.AdamW, lr=LR, stage=cfg["stage"], device_mesh=mesh, deterministic=True
    )
    opt.attach(model)
    mine = 4 // dp
    norms = []
    for step in range(3):
        for k in range(d * mine, (d + 1) * mine):
            x, target = _batch(step, k)
            out = model(_local(x, t, 2))
            loss = _loss(out.to_local() if isinstance(out, DTensor) else out, _local(target, t, 2)) / mine
            with opt.no_sync() if k < (d + 1) * mine - 1 else contextlib.nullcontext():
                opt.backward(loss)
        norms.append(repr(opt.clip_grad_norm_(0.05).item()))
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        params = _digest([p.detach().full_tensor() for p in model.parameters()])
    return {"params": params, "norms": norms}


def tensor_whole_dicts(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Whole-tensor optimizer dicts of a tp=2 x dp=2 run at ``stage``
    (``interchange.get_optimizer_state_dict`` with ``full_state_dict=True``: each slice gathered over
    dp, the slices joined over tp) against FSDP2's with the same tp plan after the same 2 steps; and
    FSDP2's whole dict loaded into a fresh zeroplan by ``interchange.set_optimizer_state_dict``, whose
    third step equals the uninterrupted run's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    whole = StateDictOptions(full_state_dict=True)
    model = _parallel(mesh, 5)  # uneven: slices of 3 and 2 rows
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=stage, device_mesh=mesh)
    opt.attach(model)
    theirs = _parallel(mesh, 5)
    fully_shard(theirs, mesh=mesh["dp"])
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=LR)
    for step in range(2):
        _step(model, opt, step, [d], t)
        _step(theirs, their_opt, step, [d], t)
    mine = interchange.get_optimizer_state_dict(model, opt, options=whole)
    other = get_optimizer_state_dict(theirs, their_opt, options=whole)
    on_rank0 = interchange.get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    out: dict[str, Any] = {
        "keys": sorted(mine["state"]) == sorted(other["state"]),
        "state_err": max(
            float((mine["state"][k][n] - other["state"][k][n]).abs().max())
            for k in other["state"]
            for n in ("exp_avg", "exp_avg_sq")
        ),
        "shapes": sorted({tuple(e["exp_avg"].shape) for e in mine["state"].values()}),
        "plain": all(type(e["exp_avg"]) is torch.Tensor for e in mine["state"].values()),
        "rank0_only": bool(on_rank0) == (rank == 0),
    }
    _step(model, opt, 2, [d], t)
    with opt.gathered_params():
        after = [p.detach().full_tensor() for p in model.parameters()]
    fresh = _parallel(mesh, 5)
    with torch.no_grad():  # the parameters after step 2, from FSDP2 (the same: compared above)
        for p, q in zip(fresh.parameters(), theirs.parameters(), strict=True):
            p.to_local().copy_(distribute_tensor(q.full_tensor(), p.device_mesh, p.placements).to_local())
    fresh_opt = ZeroOptimizer(fresh.parameters(), torch.optim.AdamW, lr=LR, stage=stage, device_mesh=mesh)
    fresh_opt.attach(fresh)
    interchange.set_optimizer_state_dict(fresh, fresh_opt, other, options=whole)
    _step(fresh, fresh_opt, 2, [d], t)
    with fresh_opt.gathered_params():
        out["resumed_err"] = _worst([p.detach().full_tensor() for p in fresh.parameters()], after)
    # rank 0's whole dict alone, broadcast
    again = _parallel(mesh, 5)
    with torch.no_grad():
        for p, q in zip(again.parameters(), theirs.parameters(), strict=True):
            p.to_local().copy_(distribute_tensor(q.full_tensor(), p.device_mesh, p.placements).to_local())
    again_opt = ZeroOptimizer(again.parameters(), torch.optim.AdamW, lr=LR, stage=stage, device_mesh=mesh)
    again_opt.attach(again)
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    interchange.set_optimizer_state_dict(again, again_opt, other if rank == 0 else {}, options=from_rank0)
    _step(again, again_opt, 2, [d], t)
    with again_opt.gathered_params():
        out["broadcast_err"] = _worst([p.detach().full_tensor() for p in again.parameters()], after)
    # the last rank's dict names a param group too many: its tp slice's dp group cannot split it, and
    # the other slice hears of it too (no slice loads alone, nobody waits)
    before = interchange.get_optimizer_state_dict(fresh, fresh_opt, options=whole)
    broken = {"state": other["state"], "param_groups": other["param_groups"] * 2}
    given = broken if rank == world - 1 else other
    out["one_rank"] = _error(
        lambda: interchange.set_optimizer_state_dict(fresh, fresh_opt, given, options=whole)
    )
    now = interchange.get_optimizer_state_dict(fresh, fresh_opt, options=whole)
    out["unchanged"] = all(
        torch.equal(now["state"][k][n], e[n]) for k, e in before["state"].items() for n in e if n != "step"
    )
    return out


def tensor_consolidated_dicts(rank: int, world: int, root: str) -> dict[str, Any]:
    """``consolidated_state_dict()`` of a tp=2 x dp=2 run, the tp split even (slices of 3 and 3 rows,
    so one slice's local tensors fit the other's shapes): the whole model's tensors on rank 0 alone,
    equal to interchange's whole-tensor dict; rank 0's dict saved and loaded by every rank (fairscale's
    pattern) changes no slice's state; one slice's local tensors (what consolidation gave before the
    slices were joined) are refused on every rank, changing nothing."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = _parallel(mesh, 6)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=2, device_mesh=mesh)
    for step in range(2):
        _step(model, opt, step, [d], t)
    on_rank0 = opt.consolidated_state_dict(to_rank=0)
    everywhere = opt.consolidated_state_dict(to_rank=None)
    assert everywhere is not None
    theirs = interchange.get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out: dict[str, Any] = {
        "rank0_only": (on_rank0 is not None) == (rank == 0),
        "shapes": sorted({tuple(e["exp_avg"].shape) for e in everywhere["state"].values()}),
        "state_err": max(
            float((everywhere["state"][i][n] - theirs["state"][name][n]).abs().max())
            for i, name in enumerate(n for n, _ in model.named_parameters())
            for n in ("exp_avg", "exp_avg_sq")
        ),
    }
    if rank == 0:
        torch.save(on_rank0, f"{root}/optim.pt")
    dist.barrier()
    opt.load_state_dict(torch.load(f"{root}/optim.pt", weights_only=True))
    after = opt.consolidated_state_dict(to_rank=None)
    assert after is not None
    out["unchanged_by_load"] = all(
        torch.equal(after["state"][i][n], e[n]) for i, e in everywhere["state"].items() for n in e
    )
    # tp slice 0's local tensors under the global ids (zeroplan's consolidation before the fix), on the
    # last rank only: refused there, and on every other rank through the agreement
    split = {2: 0, 3: 0, 4: 1}  # column-split weight and bias, row-split weight: the split dimension
    sliced = {
        "state": {
            i: {n: v.narrow(split[i], 0, 3) if i in split and v.dim() else v for n, v in e.items()}
            for i, e in everywhere["state"].items()
        },
        "param_groups": everywhere["param_groups"],
    }
    out["one_slice"] = _error(lambda: opt.load_state_dict(sliced if rank == world - 1 else everywhere))
    again = opt.consolidated_state_dict(to_rank=None)
    assert again is not None
    out["unchanged_by_refusal"] = all(
        torch.equal(again["state"][i][n], e[n]) for i, e in everywhere["state"].items() for n in e
    )
    # tp slice 1's data-parallel group refuses (the last rank's dict has no param groups) while slice
    # 0's would take its dict (other moments) alone: every rank raises, no slice changes
    doubled = {
        "state": {
            i: {n: v * 2 if v.dim() else v for n, v in e.items()} for i, e in everywhere["state"].items()
        },
        "param_groups": everywhere["param_groups"],
    }
    broken = {"state": everywhere["state"], "param_groups": []}
    out["one_group"] = _error(lambda: opt.load_state_dict(broken if rank == world - 1 else doubled))
    last = opt.consolidated_state_dict(to_rank=None)
    assert last is not None
    out["unchanged_by_one_group"] = all(
        torch.equal(last["state"][i][n], e[n]) for i, e in everywhere["state"].items() for n in e
    )
    return out
