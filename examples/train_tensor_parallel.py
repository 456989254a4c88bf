"""Train the demo GPT with tensor parallel x ZeRO data parallel over a DeviceMesh, launched with torchrun.

    torchrun --nproc-per-node 4 examples/train_tensor_parallel.py --steps 100              # tp=2 x dp=2
    torchrun --nproc-per-node 2 examples/train_tensor_parallel.py --steps 100 --tensor-parallel 2  # dp=1

What it shows:

* a ``("dp", "tp")`` mesh from ``init_device_mesh``; torch's ``parallelize_module`` places the model
  on ``mesh["tp"]`` *before* the optimizer is built, as torchtitan does: the token embedding split by
  vocabulary (``RowwiseParallel``), every MLP column- then row-split (``ColwiseParallel``,
  ``RowwiseParallel``), the head split by vocabulary with its logits gathered. Attention and the
  norms stay replicated: the demo's fused q/k/v projection is not laid out head by head, so a
  column split would cut across heads (a model built for tensor parallelism splits them too);
* ``ZeroOptimizer(model.parameters(), AdamW, device_mesh=mesh)``: the two-line recipe. zeroplan
  shards each rank's local tensors over ``dp``, reduces their gradients over ``dp``, and counts the
  replicated parameters once in the gradient norm (``clip_grad_norm_`` is the whole model's). At
  ``--stage 3`` each local tensor is itself sharded over ``dp`` and gathered around its module's
  forward and backward (``opt.attach(model)``);
* each data-parallel rank reads its own part of the global batch; the tp ranks of one dp rank read
  the same one. Checkpoints: each tp slice saves into a directory of its own
  (``--ckpt-dir``/tp<k>) and loads at any dp size with the same tp degree.

``train_gpt.py`` is the same loop without tensor parallelism.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from train_gpt import DTYPES, Data, log, parse_args, resume, schedule, setup

from zeroplan.facade import ZeroOptimizer, checkpoint
from zeroplan.facade.cli.demo.model import GPTConfig, SortTask, build_model, loss_of


def tensor_plan(layers: int) -> dict[str, object]:
    """Where each module of the demo GPT goes on ``mesh["tp"]`` (modules not named stay replicated)."""
    plan: dict[str, object] = {
        "tok": RowwiseParallel(input_layouts=Replicate()),  # vocabulary-split embedding, summed over tp
        "head": ColwiseParallel(output_layouts=Replicate()),  # vocabulary-split logits, gathered
    }
    for i in range(layers):
        plan[f"blocks.{i}.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.out"] = RowwiseParallel()
    return plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tensor-parallel", type=int, default=2, help="ranks of the tp dimension (default 2)")
    known, rest = p.parse_known_args(argv)
    args = parse_args(rest, description=__doc__.splitlines()[0])
    rank, world, device = setup(timedelta(seconds=args.timeout))
    try:
        train(args, known.tensor_parallel, rank, world, device)
    finally:
        gc.collect()
        dist.destroy_process_group()
    return 0


def train(args: argparse.Namespace, tp: int, rank: int, world: int, device: torch.device) -> float:
    """Build the mesh, place the model, train; returns the last logged loss."""
    if world % tp:
        raise SystemExit(f"world {world} is not a multiple of --tensor-parallel {tp}")
    dp = world // tp
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    if args.global_batch % (dp * args.micro_batches):
        raise SystemExit(
            f"--global-batch must be a multiple of dp {dp} x --micro-batches {args.micro_batches}"
        )
    task = SortTask()
    config = GPTConfig(vocab=task.vocab, context=task.context)
    model = build_model(config, seed=args.seed, dtype=DTYPES[args.dtype], device=device)
    parallelize_module(model, mesh["tp"], tensor_plan(config.layers))
    local = sum((q.to_local() if hasattr(q, "to_local") else q).numel() for q in model.parameters())
    opt = ZeroOptimizer(  # the recipe: the mesh says which dimension to shard over
        model.parameters(),
        torch.optim.AdamW,
        stage=args.stage,
        device_mesh=mesh,
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
    )
    opt.attach(model)  # stage 3: the forward gathers the local shards it uses (a no-op at stages 1 and 2)
    scheduler = schedule(opt, args)
    mine = opt.memory_report(clipping=True).ranks[opt.process_groups.rank]
    log(
        rank,
        f"tp={tp} x dp={dp}, stage {args.stage}, {args.dtype}: each rank computes with {local:,} local "
        f"elements; rank 0's optimizer holds {mine.total_bytes / 2**20:.2f} MiB",
    )
    root = None if args.ckpt_dir is None else Path(args.ckpt_dir) / f"tp{t}"
    start = resume(opt, scheduler, root if args.resume else None)
    if start:
        log(rank, f"resumed from {args.ckpt_dir} at step {start}")
    data = Data(task, args.global_batch, args.micro_batches, d, dp, device)
    first = last = math.nan
    stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    for step in range(start, stop):
        total = torch.zeros((), device=device)
        for micro in range(args.micro_batches):
            final = micro == args.micro_batches - 1
            with contextlib.nullcontext() if final else opt.no_sync():
                loss = loss_of(model, *task.split(data.micro_batch(step, micro))) / args.micro_batches
                opt.backward(loss)
            total += loss.detach().float()
        norm = opt.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler.step()
        done = step + 1
        if done % args.log_every == 0 or done == stop or step == start:
            dist.all_reduce(total, group=mesh.get_group("dp"))
            last = float(total) / dp
            first = last if math.isnan(first) else first
            log(rank, f"step {done:4d}/{args.steps} | loss {last:.4f} | grad norm {float(norm):.3f}")
        if root is not None and (done % args.ckpt_every == 0 or done == stop):
            checkpoint.save(opt, root, extra={"step": done, "scheduler": scheduler.state_dict()})
    log(rank, f"done: loss {first:.4f} -> {last:.4f} (steps {start + 1}-{stop}); final {last!r}")
    return last


if __name__ == "__main__":
    sys.exit(main())
