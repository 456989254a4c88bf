"""Host time per parameter: ZeroOptimizer stages 1-3 against AdamW, DDP and FSDP2 on many small parameters.

The model is a stack of ``--layers`` ``Linear(16, 16)`` (600 parameters by
default) on a batch of 8 rows: the arithmetic is negligible, so a step's time
is what each method spends per parameter and per call on the host. On a GPU
each tensor operation is also a kernel launch of several µs, which is why the
same code's GPU gap is larger than this CPU's.

Configurations (``CONFIGS``), each at world 1 and 2 on gloo, one thread per process:

* ``adamw``   the model and ``AdamW(foreach=True)``, no communication (the baseline)
* ``ddp``     ``DistributedDataParallel`` (C++ reducer) + ``AdamW(foreach=True)``
* ``fsdp2``   ``fully_shard`` on every layer and on the root + ``AdamW(foreach=True)``
* ``zero1``, ``zero2``, ``zero3``   ``ZeroOptimizer(AdamW, foreach=True, stage=...)``
  (stage 3 attached to the model)

Rounds: each round runs every configuration once, in an order rotated every
round, each in newly spawned processes that hold only it: ``--warmup`` steps,
then ``--steps`` steps, each forward + backward + step + zero_grad (and, for
ZeroOptimizer, the wait for its overlapped gathers), after a barrier; a step's
time is the slowest rank's and a round's the median over its steps. The table
gives, per configuration, the median over rounds of ``(t - t_adamw) / params``
with ``t_adamw`` from the *same round* (µs per parameter above plain AdamW),
and its min / max over rounds.

After the timed steps, one more step runs under a ``TorchDispatchMode`` that
counts the tensor operations it dispatches (forward, backward hooks, step and
zero_grad; on a GPU most of them are kernel launches): ``ops/param`` is that
count over the parameter count. Nothing here asserts a time.

Usage::

    python benchmarks/host_overhead.py                    # worlds 1 and 2, 5 rounds: about 4 min
    python benchmarks/host_overhead.py --rounds 3 --only zero2,ddp,adamw --worlds 2
    python benchmarks/host_overhead.py --json host.json
    python benchmarks/host_overhead.py --before /tmp/old   # also zeroplan from /tmp/old/zeroplan, interleaved
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_time import join_gloo, run_fresh

CONFIGS = ("adamw", "ddp", "fsdp2", "zero1", "zero2", "zero3")
HYPER = {"lr": 1e-3, "weight_decay": 0.01, "foreach": True}


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def build(config: str, layers: int, world: int) -> tuple[torch.nn.Module, Any, Any]:
    """The model (as called), the optimizer, and the ZeroOptimizer if any."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])
    if config == "adamw":
        return model, torch.optim.AdamW(model.parameters(), **HYPER), None
    if config == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(model.parameters(), **HYPER), None
    if config == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), **HYPER), None
    from zeroplan.facade import ZeroOptimizer

    stage = int(config.removeprefix("zero").removesuffix("@before"))
    zero = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, **HYPER)
    if stage == 3:
        zero.attach(model)
    return model, zero, zero


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, config: str, queue: Any) -> None:
    join_gloo(rank, world, port)
    if config.endswith("@before"):  # --before: zeroplan from another source tree
        sys.path.insert(0, args.before)
    try:
        model, opt, zero = build(config, args.layers, world)
        params = sum(1 for _ in model.parameters())
        torch.manual_seed(rank)
        x = torch.randn(8, 16)

        def step() -> None:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if zero is not None:
                zero.wait_for_params()

        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        dist.barrier()
        with OpCounter() as counter:
            step()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, times)
        if rank == 0:
            step_max = [max(ts) for ts in zip(*gathered, strict=True)]
            ops = counter.ops
            queue.put(
                {
                    "params": params,
                    "median_s": statistics.median(step_max),
                    "ops": sum(ops.values()),
                    "top_ops": ops.most_common(8),
                }
            )
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)


def run(world: int, config: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration once, in ``world`` fresh processes."""
    return run_fresh(world, config, args, worker=_worker)


def measure(world: int, args: argparse.Namespace) -> dict[str, Any]:
    configs = args.only
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        measured = {c: run(world, c, args) for c in configs[r % len(configs) :] + configs[: r % len(configs)]}
        rounds.append(measured)
        line = ", ".join(f"{c} {m['median_s'] * 1e3:.1f}" for c, m in measured.items())
        print(f"world {world} round {r + 1}: {line} ms", file=sys.stderr)
    rows = {}
    for c in configs:
        above = [(m[c]["median_s"] - m["adamw"]["median_s"]) / m[c]["params"] * 1e6 for m in rounds]
        first = rounds[0][c]
        rows[c] = {
            "median_ms": statistics.median(m[c]["median_s"] for m in rounds) * 1e3,
            "us_per_param_above_adamw": statistics.median(above),
            "min": min(above),
            "max": max(above),
            "ops_per_param": first["ops"] / first["params"],
            "top_ops": first["top_ops"],
            "params": first["params"],
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=300)
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configurations")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--before",
        help="a folder holding another zeroplan (zeroplan/core, zeroplan/facade): each zero configuration "
        "also runs from it, as NAME@before, in the same rounds",
    )
    args = parser.parse_args()
    args.only = [c for c in args.only.split(",") if c]
    if "adamw" not in args.only:
        args.only.insert(0, "adamw")
    unknown = set(args.only) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.before:
        args.only += [f"{c}@before" for c in args.only if c.startswith("zero")]
    results = {}
    for world in (int(w) for w in args.worlds.split(",")):
        rows = measure(world, args)
        results[world] = rows
        ddp = rows.get("ddp")
        print(f"\nworld {world}: {args.layers} x Linear(16, 16), {rows['adamw']['params']} parameters")
        head = ("config", "step ms", "µs/param above adamw", "(min..max)", "vs ddp", "ops/param")
        print(f"{head[0]:12} {head[1]:>8} {head[2]:>21} {head[3]:>14} {head[4]:>7} {head[5]:>9}")
        for c, row in rows.items():
            ratio = (
                f"{row['us_per_param_above_adamw'] / ddp['us_per_param_above_adamw']:.2f}"
                if ddp and c != "adamw" and ddp["us_per_param_above_adamw"] > 0
                else ""
            )
            print(
                f"{c:12} {row['median_ms']:8.1f} {row['us_per_param_above_adamw']:21.1f} "
                f"{row['min']:6.1f}..{row['max']:<6.1f} {ratio:>7} {row['ops_per_param']:9.1f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
