"""Tensor parallel x data parallel: ZeroOptimizer stages 1-3 against FSDP2 with the same tp plan.

World 4 on gloo as a ``("dp", "tp")`` mesh of 2 x 2, one thread per process. The model: ``--layers``
pre-norm MLP blocks of width ``--width`` (hidden 4x), placed on ``mesh["tp"]`` by torch's
``parallelize_module`` as torchtitan places a transformer's MLP (a sequence-parallel LayerNorm, a
column-split then a row-split Linear back to sequence shards, the residual on sequence shards); each
dp rank feeds its own ``--batch`` x ``--seq`` tokens, each tp rank its half of the sequence.

Configurations (``CONFIGS``):

* ``fsdp2``   ``fully_shard`` of every block and of the root over ``mesh["dp"]`` + ``AdamW(foreach)``
  (torch's own 2-D composition: FSDP2 shards the tp-local tensors)
* ``zero1``, ``zero2``, ``zero3``   ``ZeroOptimizer(AdamW, foreach=True, stage=..., device_mesh=mesh)``
  (stage 3: ``opt.attach(model)``, the forward gathers each block's local shards)

Rounds: each round runs every configuration once, in an order rotated every round, each in newly
spawned processes holding only it: ``--warmup`` steps, then ``--steps`` timed steps (forward,
backward, step, zero_grad after a barrier; a step's time is the slowest rank's, a round's the median
of its steps). Then one step under torch's ``MemTracker`` (entered before the model is built): its
peak on rank 0, and the bytes held between steps. Parameters after the same steps from the same
initial model are compared with FSDP2's (``param_diff``: largest difference over the largest
value). The table gives medians over rounds and each configuration's time over FSDP2's of the same
round. Nothing here asserts a time.

Usage::

    python benchmarks/tensor_parallel.py                     # 3 rounds, about 3 minutes
    python benchmarks/tensor_parallel.py --rounds 5 --json tp.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_time import join_gloo, run_fresh

CONFIGS = ("fsdp2", "zero1", "zero2", "zero3")


class Block(nn.Module):
    """A pre-norm MLP block with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(nn.functional.gelu(self.fc(self.norm(x))))


def build(config: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The model placed on ``mesh["tp"]`` and its optimizer for ``config``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.width) for _ in range(args.layers)))
    plan: dict[str, Any] = {
        "0": PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Shard(1), use_local_output=False
        )
    }
    for i in range(args.layers):
        plan[f"{i}.norm"] = SequenceParallel()
        plan[f"{i}.fc"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"{i}.out"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    parallelize_module(model, mesh["tp"], plan)
    hyper = {"lr": 1e-3, "foreach": True}
    if config == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, torch.optim.AdamW(model.parameters(), **hyper), mesh
    from zeroplan.facade import ZeroOptimizer

    stage = int(config[-1])
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, device_mesh=mesh, **hyper)
    opt.attach(model)  # stage 3: the forward gathers what it uses (nothing to do at stages 1-2)
    return model, opt, mesh


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, config: str, queue: Any) -> None:
    join_gloo(rank, world, port)
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.tensor import DTensor

        tracker = MemTracker()
        with tracker:
            model, opt, mesh = build(config, args)
            d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
            gen = torch.Generator().manual_seed(d)
            x = torch.randn(args.batch, args.seq, args.width, generator=gen).chunk(2, dim=1)[t].contiguous()

        def step() -> None:
            out = model(x)
            (out.to_local() if isinstance(out, DTensor) else out).square().mean().backward()
            opt.step()
            opt.zero_grad()

        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, dist.ReduceOp.MAX)
            times.append(float(elapsed))
        tracker.reset_mod_stats()
        with tracker:
            step()
            peak = sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
        held = sum(s["Total"] for s in tracker.get_tracker_snapshot("current").values())
        gathered = getattr(opt, "gathered_params", contextlib.nullcontext)
        with gathered():  # stage 3 holds shards between steps
            params = [p.detach().full_tensor() for p in model.parameters()]
        if rank == 0:  # tensors travel by file: a queue's shared memory dies with the process
            torch.save(params, os.path.join(args.scratch, f"{config}.pt"))
            queue.put(
                {
                    "median_s": statistics.median(times),
                    "peak_bytes": peak,
                    "held_bytes": held,
                    "numel": sum(p.numel() for p in params),
                }
            )
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    args.scratch = tempfile.mkdtemp(prefix="zeroplan-tp-")
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        order = CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]
        measured = {c: run_fresh(4, c, args, worker=_worker) for c in order}
        rounds.append(measured)
        line = ", ".join(f"{c} {m['median_s'] * 1e3:.1f}" for c, m in measured.items())
        print(f"round {r + 1}: {line} ms", file=sys.stderr)
    first = rounds[-1]
    reference = torch.load(os.path.join(args.scratch, "fsdp2.pt"))
    rows = {}
    for c in CONFIGS:
        mine = torch.load(os.path.join(args.scratch, f"{c}.pt"))  # the last round's
        diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(mine, reference, strict=True))
        rows[c] = {
            "median_ms": statistics.median(m[c]["median_s"] for m in rounds) * 1e3,
            "vs_fsdp2": statistics.median(m[c]["median_s"] / m["fsdp2"]["median_s"] for m in rounds),
            "peak_mib": first[c]["peak_bytes"] / 2**20,
            "held_mib": first[c]["held_bytes"] / 2**20,
            "param_diff": diff,
        }
    numel = first["fsdp2"]["numel"]
    print(
        f"tp=2 x dp=2 on gloo, {args.layers} blocks of width {args.width} ({numel / 1e6:.1f}M parameters), "
        f"{args.batch}x{args.seq} tokens per dp rank, {args.rounds} rounds"
    )
    print(f"{'config':8} {'step ms':>8} {'vs fsdp2':>9} {'peak MiB':>9} {'held MiB':>9} {'param diff':>11}")
    for c, row in rows.items():
        print(
            f"{c:8} {row['median_ms']:8.1f} {row['vs_fsdp2']:8.2f}x {row['peak_mib']:9.2f} "
            f"{row['held_mib']:9.2f} {row['param_diff']:11.2e}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
