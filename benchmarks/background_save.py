"""How long a save stops training: ``checkpoint.save`` blocking, and with ``blocking=False``.

Each round spawns fresh gloo processes (``--world``), trains the GPT of ``--model`` with a stage-2
``ZeroOptimizer`` (AdamW, fp32) for two steps, then, in an order rotated every round:

* **blocking**: ``checkpoint.save(opt, root)``: the time the call takes (the slowest rank);
* **background**: ``checkpoint.save(opt, root, blocking=False)``: the time until it returns (what
  stops training: the snapshot's agreement and the copy into the host staging buffer), then the
  training steps run while the thread writes, and the time until ``wait()`` returns (committed);
* **steps**: the median step time with no save in flight, and with a background write in flight
  (on this 2-core machine the writer thread and the step share the cores, so the step slows down;
  beside a GPU the step's work is on the device).

Every save fsyncs its files (page cache warm). Nothing here asserts a time.

Usage::

    python benchmarks/background_save.py                  # 3 rounds, 34M parameters, world 2
    python benchmarks/background_save.py --rounds 5 --model 7m --json background.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _gpt import GPT, GPT_7M, GPT_34M, lm_loss, make_batch

from zeroplan.core import memory_report
from zeroplan.facade import ZeroOptimizer, checkpoint

MODELS = {"7m": GPT_7M, "34m": GPT_34M}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, order: list[str], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = MODELS[args.model]
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, stage=2)

    def step(i: int) -> float:
        tokens, targets = make_batch(cfg, 4, rank + 100 * i)
        started = time.perf_counter()
        opt.backward(lm_loss(model(tokens), targets))
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - started

    for i in range(2):
        step(i)
    root = Path(out) / "ckpt"
    result: dict[str, Any] = {}
    for name in order:
        dist.barrier()
        if name == "blocking":
            started = time.perf_counter()
            checkpoint.save(opt, root)
            result["blocking_s"] = time.perf_counter() - started
        elif name == "background":
            started = time.perf_counter()
            handle = checkpoint.save(opt, root, blocking=False)
            result["returned_s"] = time.perf_counter() - started
            # Every rank runs the same steps (they are collective), however far its write is.
            during = [(step(10 + i), handle.done()) for i in range(args.steps)]
            handle.wait()
            result["committed_s"] = time.perf_counter() - started
            writing = [t for t, done in during if not done]
            result["step_during_s"] = statistics.median(writing) if writing else None
            result["steps_during"] = len(writing)
        else:
            result["step_s"] = statistics.median(step(20 + i) for i in range(args.steps))
    times = [None] * world
    dist.all_gather_object(times, result)
    if rank == 0:
        merged = {
            k: max(r[k] for r in times if r.get(k) is not None) for k, v in result.items() if v is not None
        }
        merged["staging_planned_bytes"] = memory_report(opt.plan).ranks[0].save_staging_bytes
        Path(out, "result.json").write_text(json.dumps(merged))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="34m")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    configs = ["blocking", "background", "steps"]
    rounds = []
    for r in range(args.rounds):
        order = configs[r % 3 :] + configs[: r % 3]
        out = tempfile.mkdtemp(prefix="zeroplan-bg-")
        try:
            mp.spawn(_worker, args=(args.world, _port(), args, order, out), nprocs=args.world, join=True)
            rounds.append(json.loads(Path(out, "result.json").read_text()))
        finally:
            shutil.rmtree(out, ignore_errors=True)
    keys = ["blocking_s", "returned_s", "committed_s", "step_s", "step_during_s"]
    print(f"{args.model} at world {args.world}, stage 2 fp32 AdamW, {args.rounds} rounds (median [min, max])")
    summary = {}
    for key in keys:
        values = [r[key] for r in rounds if key in r]
        if values:
            summary[key] = statistics.median(values)
            print(f"  {key:14s} {summary[key]:8.3f} s  [{min(values):.3f}, {max(values):.3f}]")
    blocked = summary["blocking_s"] / summary["returned_s"]
    print(f"  a save stops training {blocked:.1f}x less with blocking=False")
    print(f"  staging planned for rank 0: {rounds[0]['staging_planned_bytes'] / 2**20:.1f} MiB (host)")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "median": summary}, indent=2))


if __name__ == "__main__":
    main()
