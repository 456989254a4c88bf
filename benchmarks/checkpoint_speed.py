"""Checkpoint save/load throughput: zeroplan.facade.checkpoint vs torch.save/torch.load.

The baseline saves what an unsharded job saves — ``{"model": model.state_dict(),
"optimizer": torch.optim.AdamW.state_dict()}`` — from one process and loads it
back. zeroplan saves the same content (parameters + optimizer state + fp32
masters where the model is low precision) from ``world`` gloo processes and
loads it, at the same and at another world size. Throughput is bytes on disk
per second of wall time (the slowest rank). Page cache is warm for both sides.

    python benchmarks/checkpoint_speed.py --worlds 2,4 --repeats 3
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _gpt import GPT, GPTConfig, lm_loss, make_batch

from zeroplan.facade import ZeroOptimizer, checkpoint

CONFIG = GPTConfig()  # about 7M parameters


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _trained_model(rank: int) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens, targets = make_batch(CONFIG, 4, rank)
    return model, tokens, targets


def baseline(root: Path, repeats: int) -> dict[str, float]:
    """torch.save / torch.load of the unsharded model + AdamW state in one process."""
    torch.set_num_threads(1)
    model, tokens, targets = _trained_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lm_loss(model(tokens), targets).backward()
    opt.step()
    path = root / "baseline.pt"
    saves, loads = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        with open(path, "rb+") as handle:  # zeroplan fsyncs its files; so does the baseline
            os.fsync(handle.fileno())
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        loaded = torch.load(path, weights_only=True)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        loads.append(time.perf_counter() - start)
    size = path.stat().st_size
    return {"bytes": size, "save_s": statistics.median(saves), "load_s": statistics.median(loads)}


def _worker(rank: int, world: int, port: int, root: str, repeats: int, phase: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, tokens, targets = _trained_model(rank)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    lm_loss(model(tokens), targets).backward()
    opt.step()
    opt.zero_grad()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if phase == "save":
            checkpoint.save(opt, root)
        else:
            checkpoint.load(opt, root)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": statistics.median(times)}))
    dist.destroy_process_group()


def _run(world: int, root: Path, repeats: int, phase: str) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = root / f"{phase}-{world}.json"
    mp.spawn(_worker, args=(world, port, str(root / "ckpt"), repeats, phase, str(out)), nprocs=world)
    return json.loads(out.read_text())["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    root = Path(tempfile.mkdtemp(prefix="zeroplan-ckpt-bench-"))
    try:
        base = baseline(root, args.repeats)
        rows = []
        for world in worlds:
            shutil.rmtree(root / "ckpt", ignore_errors=True)
            save_s = _run(world, root, args.repeats, "save")
            snapshot = root / "ckpt" / (root / "ckpt" / "latest").read_text().strip()
            size = _dir_bytes(snapshot)
            load_same = _run(world, root, args.repeats, "load")
            other = 1 if world != 1 else 2
            load_other = _run(other, root, args.repeats, "load")
            rows.append(
                {
                    "world": world,
                    "bytes": size,
                    "save_s": save_s,
                    "load_s": load_same,
                    "load_other_world": other,
                    "load_other_s": load_other,
                }
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def mbps(nbytes: int, seconds: float) -> float:
        return nbytes / seconds / 2**20

    base_save, base_load = mbps(base["bytes"], base["save_s"]), mbps(base["bytes"], base["load_s"])
    print(
        f"baseline torch.save/torch.load: {base['bytes'] / 2**20:.1f} MiB, "
        f"save {base_save:.0f} MiB/s, load {base_load:.0f} MiB/s"
    )
    print()
    print(
        "| world | MiB on disk | save MiB/s (vs torch.save) | load MiB/s same world (vs torch.load) "
        "| load MiB/s at other world |"
    )
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        save = mbps(r["bytes"], r["save_s"])
        load = mbps(r["bytes"], r["load_s"])
        other = mbps(r["bytes"], r["load_other_s"])
        print(
            f"| {r['world']} | {r['bytes'] / 2**20:.1f} | {save:.0f} ({save / base_save:.2f}x) "
            f"| {load:.0f} ({load / base_load:.2f}x) | {other:.0f} (world {r['load_other_world']}) |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": base, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
