"""A training step's peak memory per rank, measured by torch's ``MemTracker``, against the plan.

For each configuration, ``world`` gloo processes on CPU (one thread each) build a
Linear stack inside a ``MemTracker`` (so it sees every storage of the rank) and
train it with ``ZeroOptimizer``; the tracker is re-entered around each whole step
(forward, backward, ``step()``, ``zero_grad()``), which restarts its peak. The
table shows the third step's peak next to the plan's ``total_bytes`` (what the
optimizer holds between steps, its staging arena included) and ``peak_bytes``. The
activations of the stack are under 1% of its parameters.

Usage::

    python benchmarks/peak_memory.py                  # the configurations of docs/benchmarks.md
    python benchmarks/peak_memory.py --json out.json  # also write the rows
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.diagnostics.meter import step_peaks

WIDTH, DEPTH, BATCH = 512, 8, 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INNER = {
    "adamw-foreach": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01, "foreach": True}),
    "adamw-fused": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01, "fused": True}),
    "adamw-for-loop": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01, "foreach": False}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}
#: (world, shard size, stage, dtype, inner optimizer)
CONFIGS = [
    (2, None, 1, "fp32", "adamw-foreach"),
    (2, None, 1, "bf16", "adamw-foreach"),
    (2, None, 2, "bf16", "adamw-foreach"),
    (2, None, 2, "bf16", "adamw-fused"),
    (2, None, 2, "fp32", "adamw-fused"),
    (1, None, 2, "bf16", "adamw-foreach"),
    (2, None, 2, "fp16", "adamw-for-loop"),
    (4, 2, 2, "bf16", "adamw-foreach"),
    (4, 2, 1, "fp32", "sgd"),
]


def _worker(rank: int, world: int, port: int, config: tuple[Any, ...], results: Any) -> None:
    _, shard, stage, dtype_name, inner_name = config
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dtype = DTYPES[dtype_name]
    inner, hyper = INNER[inner_name]
    tracker = MemTracker()
    with tracker:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))).to(dtype)
        opt = ZeroOptimizer(
            model.parameters(),
            inner,
            stage=stage,
            shard_group_size=shard,
            bucket_bytes=WIDTH * WIDTH,  # a quarter of an fp32 layer: weights span buckets
            loss_scale="dynamic" if dtype == torch.float16 else None,
            **hyper,
        )
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank)).to(dtype)

    def step() -> None:
        opt.backward(model(x).float().square().mean())
        opt.step()
        opt.zero_grad()

    peaks = step_peaks(tracker, step, 3)
    report = opt.memory_report().ranks[rank]
    results.put(
        {
            "rank": rank,
            "measured": peaks[-1],
            "total": report.total_bytes,
            "peak": report.peak_bytes,
            "phase": report.peak_phase.value,
        }
    )
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(config: tuple[Any, ...]) -> dict[str, Any]:
    """Run one configuration; the row of its fullest rank."""
    world = config[0]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, config, results)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    row = max(rows, key=lambda r: r["measured"])
    world, shard, stage, dtype, inner = config
    return {"world": world, "shard": shard or world, "stage": stage, "dtype": dtype, "inner": inner, **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from rich.console import Console
    from rich.table import Table

    rows = [measure(c) for c in CONFIGS]
    table = Table(title=f"step peak per rank, MemTracker vs plan ({DEPTH} x Linear({WIDTH}, {WIDTH}))")
    for column in ("world", "shard", "stage", "dtype", "inner", "measured MiB", "total", "peak", "at"):
        table.add_column(column, justify="right")
    table.add_column("measured / peak", justify="right")
    for r in rows:
        table.add_row(
            str(r["world"]),
            str(r["shard"]),
            str(r["stage"]),
            r["dtype"],
            r["inner"],
            f"{r['measured'] / 2**20:.3f}",
            f"{r['total'] / 2**20:.3f}",
            f"{r['peak'] / 2**20:.3f}",
            r["phase"],
            f"{r['measured'] / r['peak']:.4f}",
        )
    Console(width=150).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"width": WIDTH, "depth": DEPTH, "batch": BATCH, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
