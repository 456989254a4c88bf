"""Train a small GPT with ZeroOptimizer: the loop a real job runs, launched with torchrun.

    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 200
    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 200 --ckpt-dir ckpt --ckpt-every 50
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 200 --ckpt-dir ckpt --resume   # elastic

What it shows, in order of appearance in ``train``:

* ``torch.distributed.init_process_group`` from torchrun's environment: gloo on
  CPU, NCCL with one GPU per process on CUDA, and a collective timeout
  (``--timeout``, 300 s): a rank that fails without its process ending leaves
  the others waiting that long, not torch's default 30 minutes. The model is
  *not* wrapped in DDP: ``ZeroOptimizer`` reduces the gradients itself.
* bf16 parameters; ``ZeroOptimizer`` keeps fp32 master weights for its shard only.
* gradient accumulation: ``opt.no_sync()`` around every micro-batch but the last,
  whose backward reduces the accumulated sum, overlapped with the backward pass.
* ``opt.clip_grad_norm_(1.0)``: the norm of the whole model's gradient.
* a warmup + cosine learning-rate schedule from ``torch.optim.lr_scheduler``.
* ``--deterministic``: ``ZeroOptimizer(deterministic=True)`` with canonical
  micro-batches (the global batch cut into ``--canonical-micro-batches`` G, each
  rank running its contiguous G/W of them), so the run is bit-identical at any
  power-of-two world size, resumed elsewhere included; it ends by printing a
  sha256 of the parameters and the whole optimizer state.
* ``--offload optimizer`` (or ``all`` at ``--stage 3``): CPU offload, the step on
  the CPU bucket by bucket (docs/offload.md).
* periodic checkpoints (``--ckpt-dir``) with ``zeroplan.facade.checkpoint``, and
  ``--resume`` from the latest one at any world size: the global batch is fixed
  (``--global-batch`` sequences per step, each a function of the step and its
  index), so a job resumed on fewer or more processes continues the same run.

The model and the data are zeroplan's demo GPT and its sorting task; replace
``build`` (model, loss) for your own. ``train_hf_gpt2.py`` does so for a
Hugging Face GPT-2.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zeroplan.facade import ZeroOptimizer, checkpoint
from zeroplan.facade.cli.demo.model import GPTConfig, SortTask, build_model, loss_of

#: (model, batch -> loss): what ``train`` needs from a model family.
Build = Callable[[argparse.Namespace, torch.device, torch.dtype], tuple[torch.nn.Module, Callable[..., Any]]]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in the whole run (default 200)")
    p.add_argument("--global-batch", type=int, default=32, help="sequences per optimizer step (default 32)")
    p.add_argument("--micro-batches", type=int, default=2, help="gradient-accumulation steps (default 2)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup", type=int, default=10, help="linear warmup steps (default 10)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr (default 0.1)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (default 1.0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype (default bf16)")
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage, 1, 2 or 3 (default 2)")
    p.add_argument("--shard-size", type=int, default=None, help="ranks per shard group (default: all)")
    p.add_argument("--bucket-mb", type=float, default=0.25, help="gradient bucket cap in MiB (default 0.25)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial model (the same on every rank)")
    p.add_argument("--log-every", type=int, default=10, help="log every N steps (default 10)")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="checkpoint directory (default: none)")
    p.add_argument("--ckpt-every", type=int, default=50, help="save every N steps (default 50)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step, as if preempted")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a rank waits in a collective for the others before it fails (default 300)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="bit-identical results at any power-of-two world size (ZeroOptimizer(deterministic=True)); "
        "--micro-batches then follows from --canonical-micro-batches and the world",
    )
    p.add_argument(
        "--offload",
        choices=("none", "optimizer", "all"),
        default="none",
        help="CPU offload: masters, optimizer state and gradient shard in host memory, stepped on the CPU "
        "(optimizer); the parameter shards too (all, --stage 3) (default none)",
    )
    p.add_argument(
        "--canonical-micro-batches",
        type=int,
        default=8,
        metavar="G",
        help="with --deterministic: the global batch's fixed micro-batches, a power of two (default 8)",
    )
    args = p.parse_args(argv)
    for name in ("steps", "global_batch", "micro_batches", "ckpt_every", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.timeout > 0:
        p.error("--timeout must be > 0 seconds")
    if args.resume and args.ckpt_dir is None:
        p.error("--resume needs --ckpt-dir")
    return args


def setup(timeout: timedelta) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes; returns (rank, world, device).

    ``timeout`` bounds every wait in a collective (zeroplan's shard and replica
    groups get it too): when one rank fails and its process stays alive, the
    others raise after that long instead of torch's default 30 minutes.
    """
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def build_gpt(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """The demo GPT (same initialisation on every rank) and its loss on a batch."""
    task = SortTask()
    model = build_model(
        GPTConfig(vocab=task.vocab, context=task.context), seed=args.seed, dtype=dtype, device=device
    )

    def loss_fn(sequences: torch.Tensor) -> torch.Tensor:
        return loss_of(model, *task.split(sequences))

    return model, loss_fn


class Data(NamedTuple):
    """This rank's micro-batches of a step: sequence ``i`` of step ``s`` is the same at any world size."""

    task: SortTask
    global_batch: int
    micro_batches: int
    rank: int
    world: int
    device: torch.device

    def micro_batch(self, step: int, micro: int) -> torch.Tensor:
        per_rank = self.global_batch // self.world
        per_micro = per_rank // self.micro_batches
        first = self.rank * per_rank + micro * per_micro
        rows = [self.task.sequences(step=step, index=i, size=1) for i in range(first, first + per_micro)]
        return torch.cat(rows).to(self.device)


def schedule(opt: torch.optim.Optimizer, args: argparse.Namespace) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup from 1% of the peak, then cosine decay to ``min_lr_ratio`` of it."""
    warmup = min(args.warmup, args.steps - 1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=max(1, args.steps - warmup), eta_min=args.lr * args.min_lr_ratio
    )
    if warmup == 0:
        return cosine
    linear = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warmup)
    return torch.optim.lr_scheduler.SequentialLR(opt, [linear, cosine], milestones=[warmup])


def has_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a committed checkpoint to resume from."""
    return checkpoint.latest(directory) is not None


def resume(opt: torch.optim.Optimizer, scheduler: Any, root: Path | None) -> int:
    """Load the latest checkpoint in ``root`` (parameters, masters, optimizer state; any world size)
    and the scheduler it saved; returns the step to continue from (0: nothing to resume)."""
    if root is None or not has_checkpoint(root):
        return 0
    extra = checkpoint.load(opt, root)
    scheduler.load_state_dict(extra["scheduler"])
    for group, lr in zip(opt.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr  # schedulers compute the next rate from the current one
    return int(extra["step"])


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def train(args: argparse.Namespace, build: Build = build_gpt) -> float:
    """Join the process group and train; returns the last logged loss (on every rank)."""
    rank, world, device = setup(timedelta(seconds=args.timeout))
    if args.deterministic:  # canonical micro-batches: this rank runs its contiguous G/W of them
        # CPU kernels add in an order that depends on their thread count: keep it the same in every
        # run (torchrun sets OMP_NUM_THREADS=1 for several processes, not for one).
        torch.set_num_threads(1)
        if device.type == "cuda":  # deterministic kernels (cuBLAS reads its workspace setting on first use)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        canonical = args.canonical_micro_batches
        if canonical % world or canonical & (canonical - 1):
            raise SystemExit(
                f"--canonical-micro-batches {canonical} must be a power of two divisible by world {world}"
            )
        args.micro_batches = canonical // world
    if args.global_batch % (world * args.micro_batches):
        raise SystemExit(
            f"--global-batch {args.global_batch} must be a multiple of world {world} x --micro-batches "
            f"{args.micro_batches}"
        )
    model, loss_fn = build(args, device, DTYPES[args.dtype])
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        stage=args.stage,
        shard_group_size=args.shard_size,
        bucket_bytes=max(1, int(args.bucket_mb * 2**20)),
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        deterministic=args.deterministic,
        offload=args.offload,
    )
    opt.attach(model)  # stage 3: the forward gathers the parameters it uses (a no-op at stages 1 and 2)
    scheduler = schedule(opt, args)
    params = sum(p.numel() for p in model.parameters())
    mine = opt.memory_report(clipping=True).ranks[rank]
    log(
        rank,
        f"{params:,} parameters, {args.dtype}, world {world}, stage {args.stage}, shard groups of "
        f"{opt.plan.topology.shard_size}; rank 0 holds {mine.total_bytes / 2**20:.2f} MiB "
        f"(optimizer state {mine.optimizer_state_bytes / 2**20:.2f} MiB) and sends "
        f"{mine.comm_bytes_per_step / 2**20:.2f} MiB per step",
    )

    start = resume(opt, scheduler, args.ckpt_dir if args.resume else None)
    if start:
        log(rank, f"resumed from {args.ckpt_dir} at step {start}")
    elif args.resume:
        log(rank, f"no checkpoint in {args.ckpt_dir}: starting from step 0")

    data = Data(SortTask(), args.global_batch, args.micro_batches, rank, world, device)
    tokens_per_step = args.global_batch * SortTask().context
    first_loss = last_loss = math.nan
    last_saved = start
    window_started, window_steps = time.perf_counter(), 0
    stop = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    for step in range(start, stop):
        total = torch.zeros((), device=device)
        for micro in range(args.micro_batches):
            last = micro == args.micro_batches - 1
            with contextlib.nullcontext() if last else opt.no_sync():  # reduce only the summed gradient
                loss = loss_fn(data.micro_batch(step, micro)) / args.micro_batches
                opt.backward(loss)
            total += loss.detach().float()
        norm = opt.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler.step()
        window_steps += 1
        done = step + 1
        if done % args.log_every == 0 or done == stop or step == start:
            dist.all_reduce(total)  # for the log: the loss of the global batch
            last_loss = float(total) / world
            first_loss = last_loss if math.isnan(first_loss) else first_loss
            elapsed = time.perf_counter() - window_started
            log(
                rank,
                f"step {done:5d}/{args.steps} | loss {last_loss:.4f} | lr {scheduler.get_last_lr()[0]:.2e} | "
                f"grad norm {float(norm):.3f} | {1e3 * elapsed / window_steps:.1f} ms/step | "
                f"{tokens_per_step * window_steps / elapsed:,.0f} tokens/s",
            )
            window_started, window_steps = time.perf_counter(), 0
        if args.ckpt_dir is not None and (done % args.ckpt_every == 0 or done == stop) and done != last_saved:
            checkpoint.save(opt, args.ckpt_dir, extra={"step": done, "scheduler": scheduler.state_dict()})
            last_saved = done
            log(rank, f"saved step {done} to {args.ckpt_dir}")
    log(
        rank,
        f"done: loss {first_loss:.4f} -> {last_loss:.4f} (steps {start + 1}-{stop}); final {last_loss!r}",
    )
    if args.deterministic:
        log(rank, f"state sha256 {state_digest(opt, model)}")
    return last_loss


def state_digest(opt: ZeroOptimizer, model: torch.nn.Module) -> str:
    """sha256 of the parameters and of every tensor of the whole optimizer state (collective)."""
    with opt.gathered_params():  # stage 3: the whole parameters (a no-op at stages 1 and 2)
        tensors = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    state = opt.consolidated_state_dict(None)
    assert state is not None
    for index in sorted(state["state"]):
        entry = state["state"][index]
        tensors += [entry[k] for k in sorted(entry) if isinstance(entry[k], torch.Tensor)]
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.to("cpu", copy=True).reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run(args: argparse.Namespace, build: Build = build_gpt) -> None:
    """``train``, then leave the process group cleanly."""
    try:
        train(args, build)
    finally:
        # Free the optimizer, then the groups, while torch is fully alive: destroying a gloo group joins
        # its threads. Left to interpreter exit, a gloo thread still releasing this loop's own last
        # collective (the loss all-reduce) can abort the process; zeroplan's collectives are released
        # before they return ([Note: retiring a collective] in zeroplan.facade.mechanisms.collectives).
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
