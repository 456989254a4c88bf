"""Checkpoint save/load throughput: zeroplan.facade.checkpoint vs torch.save/torch.load.

The baseline saves what an unsharded job saves — ``{"model": model.state_dict(),
"optimizer": torch.optim.AdamW.state_dict()}`` — from one process and loads it
back. zeroplan saves the same content (parameters + optimizer state) from
``world`` gloo processes and loads it, at the same and at another world size.
Throughput is bytes on disk per second of wall time (the slowest rank). Both
fsync what they write; the page cache is warm for both.

Machine noise is large on small shared machines, so the baseline runs inside
the same job, alternating with zeroplan round by round (rank 0 runs it while
the other ranks wait), and each ratio is the median over rounds of the ratio
measured in that round.

    python benchmarks/checkpoint_speed.py --worlds 2,4 --repeats 7 [--model 34m]
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

from _gpt import GPT, GPT_7M, GPT_34M, GPTConfig, lm_loss, make_batch

from zeroplan.facade import ZeroOptimizer, checkpoint

MODELS = {"7m": GPT_7M, "34m": GPT_34M}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _stepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, cfg: GPTConfig) -> None:
    tokens, targets = make_batch(cfg, 4, rank)
    lm_loss(model(tokens), targets).backward()
    optimizer.step()
    optimizer.zero_grad()


def _timed(fn: object) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    dist.barrier()
    return time.perf_counter() - start


def _worker(
    rank: int, world: int, port: int, root: str, repeats: int, out: str, baseline: bool, model_name: str
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    _stepped(model, opt, rank, cfg)
    ckpt = Path(root) / "ckpt"
    plain_path = Path(root) / "baseline.pt"
    plain_model = plain_opt = None
    if baseline and rank == 0:
        torch.manual_seed(0)
        plain_model = GPT(cfg)
        plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
        _stepped(plain_model, plain_opt, 0, cfg)

    def plain_save() -> None:
        if plain_model is not None:
            torch.save({"model": plain_model.state_dict(), "optimizer": plain_opt.state_dict()}, plain_path)
            with open(plain_path, "rb+") as handle:  # zeroplan fsyncs its files; so does the baseline
                os.fsync(handle.fileno())

    def plain_load() -> None:
        if plain_model is not None:
            loaded = torch.load(plain_path, weights_only=True)
            plain_model.load_state_dict(loaded["model"])
            plain_opt.load_state_dict(loaded["optimizer"])

    rounds = []
    for _ in range(repeats):
        row = {}
        if baseline:
            row["plain_save"] = _timed(plain_save)
            row["plain_load"] = _timed(plain_load)
            row["save"] = _timed(lambda: checkpoint.save(opt, ckpt))
        row["load"] = _timed(lambda: checkpoint.load(opt, ckpt))
        rounds.append(row)
    if rank == 0:
        sizes = {
            "plain_bytes": plain_path.stat().st_size if baseline else None,
            "bytes": _dir_bytes(checkpoint.latest(ckpt)),
        }
        Path(out).write_text(json.dumps({"rounds": rounds, **sizes}))
    dist.destroy_process_group()


def _run(world: int, root: Path, repeats: int, baseline: bool, model_name: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = root / f"result-{world}.json"
    mp.spawn(_worker, args=(world, port, str(root), repeats, str(out), baseline, model_name), nprocs=world)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", choices=sorted(MODELS), default="7m", help="GPT size (default 7m)")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    root = Path(tempfile.mkdtemp(prefix="zeroplan-ckpt-bench-"))
    rows = []
    try:
        for world in worlds:
            shutil.rmtree(root / "ckpt", ignore_errors=True)
            same = _run(world, root, args.repeats, baseline=True, model_name=args.model)
            other_world = 1 if world != 1 else 2
            other = _run(other_world, root, args.repeats, baseline=False, model_name=args.model)
            rows.append({"world": world, "same": same, "other_world": other_world, "other": other})
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def mbps(nbytes: int, seconds: float) -> float:
        return nbytes / seconds / 2**20

    print(
        "| world | MiB on disk (torch.save) | save MiB/s | vs torch.save | load MiB/s | vs torch.load "
        "| load MiB/s at other world |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        same, size, plain = row["same"], row["same"]["bytes"], row["same"]["plain_bytes"]
        rounds = same["rounds"]
        save = statistics.median(mbps(size, r["save"]) for r in rounds)
        load = statistics.median(mbps(size, r["load"]) for r in rounds)
        save_ratio = statistics.median(mbps(size, r["save"]) / mbps(plain, r["plain_save"]) for r in rounds)
        load_ratio = statistics.median(mbps(size, r["load"]) / mbps(plain, r["plain_load"]) for r in rounds)
        other = statistics.median(mbps(size, r["load"]) for r in row["other"]["rounds"])
        print(
            f"| {row['world']} | {size / 2**20:.1f} ({plain / 2**20:.1f}) | {save:.0f} | {save_ratio:.2f}x "
            f"| {load:.0f} | {load_ratio:.2f}x | {other:.0f} (world {row['other_world']}) |"
        )
    print(f"\nmedian over {args.repeats} rounds; ratios paired per round (the baseline runs in the same job)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
