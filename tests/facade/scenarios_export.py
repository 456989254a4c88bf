"""Checkpoints to export offline, saved by ``test_export.py`` in the gloo worker pools.

Each scenario trains, saves a checkpoint and returns (rank 0) what the live run holds: the
parameters gathered whole and the fp32 masters gathered by ``consolidated_state_dict``, by name.
"""

from __future__ import annotations

from typing import Any

import moe
import torch
from factory import make_optimizer
from models import DTYPES, batch, loss_of, make_model
from scenarios_checkpoint_experts import _build as build_moe
from scenarios_checkpoint_experts import _train as train_moe

from zeroplan.core import DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES
from zeroplan.facade import ZeroOptimizer, checkpoint
from zeroplan.facade.state.dicts import MASTER_KEY


def _gathered(model: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    with opt.gathered_params():  # stage 3: whole values (a no-op at stages 1, 2)
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_and_save(rank: int, world: int, cfg: dict[str, Any], root: str) -> dict[str, Any] | None:
    """The test GPT trained 3 steps under ``cfg`` (stage, dtype, shard, layout, frozen) and saved.

    Returns, on rank 0, the gathered parameters and fp32 masters (``None`` where a parameter is its
    own master) by name; ``None`` on the others.
    """
    model = make_model(dtype=DTYPES[cfg.get("dtype", "fp32")])
    if cfg.get("frozen"):
        model.pos.weight.requires_grad_(False)
    settings = {k: cfg[k] for k in ("layout",) if k in cfg}
    opt = make_optimizer(
        list(model.named_parameters()), stage=cfg.get("stage", 2), shard=cfg.get("shard"), **settings
    )
    opt.attach(model)
    for step in range(3):
        opt.backward(loss_of(model, *batch(step, rank)))
        opt.step()
        opt.zero_grad()
    checkpoint.save(opt, root)
    params = _gathered(model, opt)
    consolidated = opt.consolidated_state_dict(to_rank=0)
    if rank != 0:
        return None
    names = [n for n, _ in model.named_parameters()]
    masters = {names[i]: m for i, m in consolidated.get(MASTER_KEY, {}).items()}
    return {"params": params, "masters": masters}


def experts_saved(rank: int, world: int, root: str) -> dict[str, Any]:
    """The MoE model at world 4 with expert groups, trained 2 steps and saved; every rank's parameters."""
    model, opt = build_moe(rank, world, {})
    train_moe(model, opt, rank, range(2))
    checkpoint.save(opt, root)
    with opt.gathered_params():
        dense = [p.detach().clone() for p in model.dense_parameters()]
        experts = [p.detach().clone() for p in model.expert_parameters()]
    return {"dense": dense, "experts": experts, "ep": moe.EP}


def tensor_slices_saved(rank: int, world: int, root: str) -> None:
    """tp=2 x dp=1 (world 2): a column- then row-split model, each tp slice saved into ``root/tp<t>``
    (the documented recipe), named as ``named_parameters()`` names them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    del rank, world
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = ZeroOptimizer(model.named_parameters(), torch.optim.AdamW, lr=0.1, stage=2, device_mesh=mesh)
    checkpoint.save(opt, f"{root}/tp{mesh.get_local_rank('tp')}")


def large_and_small(rank: int, world: int, root: str) -> None:
    """Eight 1M-element fp32 tensors (4 MB each, 32 MB in all) saved at world 2, stage 2."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(8)])
    opt = make_optimizer(
        list(model.named_parameters()),
        hyper={"lr": 1e-3},
        bucket_bytes=DEFAULT_BUCKET_BYTES,
        alignment=DEFAULT_ALIGNMENT,
    )
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    opt.zero_grad()
    checkpoint.save(opt, root)


#: ``large_fp32``'s layers: four 1024-in, 16384-out linear layers, a 64 MiB weight each (256 MiB in all).
LARGE_LAYERS, LARGE_IN, LARGE_OUT = 4, 1024, 16384


def large_fp32(rank: int, world: int, root: str) -> None:
    """Four 64 MiB fp32 weights and their biases (256 MiB), saved untrained at stage 2 with SGD.

    SGD without momentum keeps no state, so the checkpoint is the weights: a few hundred MiB that
    ``test_export_keeps_about_one_tensor_resident_above_the_import`` exports in a fresh interpreter.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(LARGE_IN, LARGE_OUT) for _ in range(LARGE_LAYERS)])
    opt = make_optimizer(
        list(model.named_parameters()),
        optimizer="sgd",
        hyper={"lr": 1e-3},
        bucket_bytes=DEFAULT_BUCKET_BYTES,
        alignment=DEFAULT_ALIGNMENT,
    )
    checkpoint.save(opt, root)
