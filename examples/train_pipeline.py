"""Train the demo GPT with pipeline x ZeRO data parallel over a DeviceMesh, launched with torchrun.

    torchrun --nproc-per-node 4 examples/train_pipeline.py --steps 100               # pp=2 x dp=2

What it shows:

* a ``("pp", "dp")`` mesh from ``init_device_mesh``; the demo GPT cut into two stages of whole
  blocks (embeddings and the first half of the blocks; the rest, the final norm and the head);
* one ``ZeroOptimizer`` per stage, over the stage's parameters and the whole mesh
  (``device_mesh=mesh``): it shards over ``dp`` and joins the gradient norm and the overflow verdict
  over ``pp``, so ``clip_grad_norm_`` clips the whole model;
* torch's ``ScheduleGPipe`` over a ``ZeroPipelineStage`` (torch's ``PipelineStage`` for a
  ``ZeroOptimizer``: every micro-batch's backward but the last accumulates without reducing), the
  loss of each micro-batch divided by their number and multiplied by the loss scale, as
  ``opt.backward`` would;
* each data-parallel rank reads its own part of the global batch (the stages of one dp rank the
  same); each stage saves into a directory of its own (``--ckpt-dir``/pp<k>), which loads at any dp
  size.

``train_gpt.py`` is the same loop without a pipeline, with the same losses (up to the sums' order).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import ScheduleGPipe
from train_gpt import DTYPES, Data, parse_args, resume, schedule, setup

from zeroplan.facade import ZeroOptimizer, checkpoint
from zeroplan.facade.cli.demo.model import IGNORE, DemoGPT, GPTConfig, SortTask, build_model
from zeroplan.facade.pipelining import ZeroPipelineStage

STAGES = 2


class FirstStage(nn.Module):
    """The embeddings and the first blocks of a ``DemoGPT`` (its own modules, shared)."""

    def __init__(self, model: DemoGPT, blocks: int) -> None:
        super().__init__()
        self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleList(model.blocks[:blocks])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """The other blocks, the final norm and the head of a ``DemoGPT``."""

    def __init__(self, model: DemoGPT, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[blocks:])
        self.ln, self.head = model.ln, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, description=__doc__.splitlines()[0])
    rank, world, device = setup(timedelta(seconds=args.timeout))
    try:
        train(args, rank, world, device)
    finally:
        gc.collect()
        dist.destroy_process_group()
    return 0


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> float:
    """Build the mesh, cut the model, train this rank's stage; returns the last logged loss."""
    if world % STAGES:
        raise SystemExit(f"world {world} is not a multiple of the {STAGES} pipeline stages")
    dp = world // STAGES
    if args.global_batch % (dp * args.micro_batches):
        raise SystemExit(
            f"--global-batch must be a multiple of dp {dp} x --micro-batches {args.micro_batches}"
        )
    mesh = init_device_mesh(device.type, (STAGES, dp), mesh_dim_names=("pp", "dp"))
    s, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    task = SortTask()
    config = GPTConfig(vocab=task.vocab, context=task.context)
    whole = build_model(config, seed=args.seed, dtype=DTYPES[args.dtype], device=device)
    half = config.layers // 2
    module = FirstStage(whole, half) if s == 0 else LastStage(whole, half)
    del whole  # the other stage's modules go with it
    opt = ZeroOptimizer(  # the recipe: the stage's parameters, the whole mesh
        module.parameters(),
        torch.optim.AdamW,
        stage=args.stage,
        device_mesh=mesh,
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
    )
    opt.attach(module)  # stage 3: the forward gathers the parameters it uses (a no-op at stages 1 and 2)
    scheduler = schedule(opt, args)
    stage = ZeroPipelineStage(module, s, STAGES, device, opt, group=mesh.get_group("pp"))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE
        )
        return loss / args.micro_batches * opt.backward_scale  # what opt.backward would backpropagate

    pipe = ScheduleGPipe(stage, n_microbatches=args.micro_batches, loss_fn=loss_fn, scale_grads=False)
    params = sum(p.numel() for p in module.parameters())
    mine = opt.memory_report(clipping=True).ranks[opt.process_groups.rank]
    logger = s == STAGES - 1 and d == 0  # the last stage knows the loss
    _log(
        logger,
        f"pp={STAGES} x dp={dp}, stage {args.stage}, {args.dtype}: the last pipeline stage holds "
        f"{params:,} parameters; its optimizer {mine.total_bytes / 2**20:.2f} MiB on dp rank 0",
    )
    root = None if args.ckpt_dir is None else Path(args.ckpt_dir) / f"pp{s}"
    start = resume(opt, scheduler, root if args.resume else None)
    if start:
        _log(logger, f"resumed from {args.ckpt_dir} at step {start}")
    data = Data(task, args.global_batch, args.micro_batches, d, dp, device)
    first = last = math.nan
    stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    for step in range(start, stop):
        sequences = torch.cat([data.micro_batch(step, m) for m in range(args.micro_batches)])
        tokens, targets = task.split(sequences)  # the schedule cuts them into the same micro-batches
        losses: list[torch.Tensor] = []
        if s == 0:
            pipe.step(tokens)
        else:
            pipe.step(target=targets, losses=losses)
        norm = opt.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler.step()
        done = step + 1
        if done % args.log_every == 0 or done == stop or step == start:
            total = torch.zeros((), device=device)
            if losses:
                total += sum(loss.detach().float() for loss in losses) / opt.backward_scale
            dist.all_reduce(total, group=mesh.get_group("dp"))  # the last stage's; zeros elsewhere
            last = float(total) / dp
            first = last if math.isnan(first) else first
            _log(logger, f"step {done:4d}/{args.steps} | loss {last:.4f} | grad norm {float(norm):.3f}")
        if root is not None and (done % args.ckpt_every == 0 or done == stop):
            checkpoint.save(opt, root, extra={"step": done, "scheduler": scheduler.state_dict()})
    _log(logger, f"done: loss {first:.4f} -> {last:.4f} (steps {start + 1}-{stop}); final {last!r}")
    return last


def _log(logger: bool, message: str) -> None:
    if logger:
        print(message, flush=True)


if __name__ == "__main__":
    sys.exit(main())
