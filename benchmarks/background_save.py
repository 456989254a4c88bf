"""How long a save stops training: ``checkpoint.save`` blocking, with ``blocking=False``, and DCP.

Each round spawns fresh gloo processes (``--world``), trains the model of ``--model`` (a GPT, or
``wide``: twelve ``Linear(4096, 4096)``, 201M parameters, 1.13 GiB of files per rank at world 2) with
a stage-2 ``ZeroOptimizer`` (AdamW, fp32) for two steps, then, in an order rotated every round:

* **blocking**: ``checkpoint.save(opt, root)``: the time the call takes (the slowest rank);
* **background**: ``checkpoint.save(opt, root, blocking=False)``: the time until it returns (what
  stops training: the snapshot's agreement and the copy into the host staging buffer), then the
  training steps run while the thread writes, and the time until ``wait()`` returns (committed).
  A second background save follows with the staging buffer warm (allocated and touched by the
  first), and **copy**: one in-memory copy of the staged state into buffers as warm, the least
  staging can cost;
* **steps**: the median step time with no save in flight, and with a background write in flight
  (on this 2-core machine the writer thread and the step share the cores, so the step slows down;
  beside a GPU the step's work is on the device);
* **dcp**: ``dcp.save`` of ``interchange.model_state_dict`` and ``get_optimizer_state_dict`` (the
  same state), ``dcp.load`` of it with ``set_optimizer_state_dict`` / ``load_model_state_dict``, and
  ``checkpoint.load`` of zeroplan's own snapshot.

Every save fsyncs its files (page cache warm). Nothing here asserts a time.

Usage::

    python benchmarks/background_save.py                  # 3 rounds, 34M parameters, world 2
    python benchmarks/background_save.py --model wide     # >= 1 GiB of state per rank
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

import torch.distributed.checkpoint as dcp
from _gpt import GPT, GPT_7M, GPT_34M, lm_loss, make_batch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from zeroplan.core import memory_report
from zeroplan.facade import ZeroOptimizer, checkpoint
from zeroplan.facade.checkpoint import background, interchange

MODELS = {"7m": GPT_7M, "34m": GPT_34M, "wide": None}
WIDE = (4096, 12)  # width, layers of the ``wide`` model


def _model(name: str) -> torch.nn.Module:
    if name != "wide":
        return GPT(MODELS[name])
    width, layers = WIDE
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _loss(name: str, model: torch.nn.Module, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if name != "wide":
        tokens, targets = make_batch(MODELS[name], 4, seed)
        return lm_loss(model(tokens), targets)
    x = torch.randn(8, WIDE[0], generator=gen)
    return model(x).square().mean()


def _dcp_state(model: torch.nn.Module, opt: ZeroOptimizer) -> dict[str, Any]:
    """The state DCP saves and loads: the model's masters and the optimizer's state, as pieces."""
    return {"model": interchange.model_state_dict(model, opt), "optim": get_optimizer_state_dict(model, opt)}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, order: list[str], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = _model(args.model)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, stage=2)

    def step(i: int) -> float:
        started = time.perf_counter()
        opt.backward(_loss(args.model, model, rank + 100 * i))
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
            dist.barrier()
            started = time.perf_counter()
            handle = checkpoint.save(opt, root, blocking=False)
            result["returned_warm_s"] = time.perf_counter() - started
            handle.wait()
            staged = background.staging_buffers(opt)
            copies = [torch.zeros_like(t) for t in staged]
            started = time.perf_counter()
            for dst, src in zip(copies, staged, strict=True):
                dst.copy_(src)
            result["copy_s"] = time.perf_counter() - started
            result["staged_bytes"] = background.staging_bytes(opt)
            del copies
        elif name == "dcp":
            if not (root / "latest").exists():
                checkpoint.save(opt, root)
            dist.barrier()
            started = time.perf_counter()
            checkpoint.load(opt, root)
            result["load_s"] = time.perf_counter() - started
            where = str(Path(out) / "dcp")
            dist.barrier()
            started = time.perf_counter()
            state = _dcp_state(model, opt)
            dcp.save(state, checkpoint_id=where)
            result["dcp_save_s"] = time.perf_counter() - started
            dist.barrier()
            started = time.perf_counter()
            state = _dcp_state(model, opt)
            dcp.load(state, checkpoint_id=where)
            interchange.load_model_state_dict(model, opt, state["model"])
            set_optimizer_state_dict(model, opt, state["optim"])
            result["dcp_load_s"] = time.perf_counter() - started
            del state
            shutil.rmtree(where, ignore_errors=True)
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
    configs = ["blocking", "background", "steps", "dcp"]
    rounds = []
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        out = tempfile.mkdtemp(prefix="zeroplan-bg-")
        try:
            mp.spawn(_worker, args=(args.world, _port(), args, order, out), nprocs=args.world, join=True)
            rounds.append(json.loads(Path(out, "result.json").read_text()))
        finally:
            shutil.rmtree(out, ignore_errors=True)
    keys = [
        "blocking_s", "returned_s", "returned_warm_s", "copy_s", "committed_s", "step_s", "step_during_s",
        "load_s", "dcp_save_s", "dcp_load_s",
    ]  # fmt: skip
    print(f"{args.model} at world {args.world}, stage 2 fp32 AdamW, {args.rounds} rounds (median [min, max])")
    summary = {}
    for key in keys:
        values = [r[key] for r in rounds if key in r]
        if values:
            summary[key] = statistics.median(values)
            print(f"  {key:14s} {summary[key]:8.3f} s  [{min(values):.3f}, {max(values):.3f}]")
    blocked = summary["blocking_s"] / summary["returned_s"]
    print(f"  a save stops training {blocked:.1f}x less with blocking=False (first)")
    warm = statistics.median(r["returned_warm_s"] / r["copy_s"] for r in rounds)
    print(f"  a warm background save stops training {warm:.2f}x one in-memory copy (target <= 1.5x),")
    share = statistics.median(r["returned_warm_s"] / r["blocking_s"] for r in rounds)
    print(f"  {100 * share:.1f}% of a blocking save (target <= 10% where it writes >= 10 copies' time)")
    copies = statistics.median(r["blocking_s"] / r["copy_s"] for r in rounds)
    print(f"  a blocking save takes {copies:.1f} copies' time")
    print(f"  staged per rank: {rounds[0]['staged_bytes'] / 2**30:.3f} GiB")
    print(f"  staging planned for rank 0: {rounds[0]['staging_planned_bytes'] / 2**20:.1f} MiB (host)")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "median": summary}, indent=2))


if __name__ == "__main__":
    main()
