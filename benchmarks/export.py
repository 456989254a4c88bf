"""``zeroplan export``: time and peak tensor memory, offline, for the demo model and a 34M GPT.

``world`` gloo processes train one step of AdamW (bf16 parameters, fp32 masters, stage 2) and
save a checkpoint; this process then exports it repeatedly (median wall time, page cache warm)
and once under torch's ``MemTracker``. The peak reported is what the export holds beyond the
memory-mapped checkpoint files, which ``MemTracker`` counts whole once touched (file pages the
kernel may drop, not memory the export allocates), next to the largest tensor and the model.

    python benchmarks/export.py --world 2 --repeats 5 [--model demo|34m]
"""

from __future__ import annotations

import argparse
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

from _gpt import GPT, GPT_34M, lm_loss, make_batch
from torch.distributed._tools.mem_tracker import MemTracker

from zeroplan.facade import ZeroOptimizer, checkpoint
from zeroplan.facade.checkpoint.export import Snapshot, export
from zeroplan.facade.cli.demo.model import GPTConfig, build_model
from zeroplan.facade.diagnostics.meter import tracked_bytes
from zeroplan.facade.runtime.dtypes import torch_dtype


def _model(name: str) -> torch.nn.Module:
    if name == "demo":
        return build_model(GPTConfig(), dtype=torch.bfloat16)
    torch.manual_seed(0)
    return GPT(GPT_34M).to(torch.bfloat16)


def _worker(rank: int, world: int, port: int, root: str, name: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(name)
    opt = ZeroOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-3, stage=2)
    config = GPTConfig() if name == "demo" else GPT_34M
    tokens, targets = make_batch(config, 4, rank)
    opt.backward(lm_loss(model(tokens).float(), targets))
    opt.step()
    checkpoint.save(opt, root)
    dist.destroy_process_group()


def _mapped_bytes(root: Path) -> int:
    snapshot, total = Snapshot(root), 0
    for listed in snapshot.manifest.files:
        file = snapshot.open(listed.name)
        for tensor in file.names():
            meta = file.meta(tensor)
            total += torch.Size(meta.shape).numel() * torch_dtype(meta.dtype).itemsize
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", choices=("demo", "34m"), default="demo")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="zeroplan-export-"))
    try:
        root = work / "ckpt"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(args.world, port, str(root), args.model), nprocs=args.world)
        times = []
        for i in range(args.repeats):
            start = time.perf_counter()
            result = export(root, work / f"out{i}")
            times.append(time.perf_counter() - start)
            shutil.rmtree(work / f"out{i}")
        for label, fp32 in (("bf16", False), ("fp32 masters", True)):
            tracker = MemTracker()
            with tracker:
                measured = export(root, work / f"peak-{fp32}", fp32=fp32)
                peak = tracked_bytes(tracker, "peak") - _mapped_bytes(root)
            print(
                f"{args.model}: {measured.tensors} tensors, {measured.nbytes / 2**20:.2f} MiB ({label}), "
                f"largest {measured.largest / 2**20:.2f} MiB; peak beyond the mapped files "
                f"{peak / 2**20:.2f} MiB"
            )
        median = statistics.median(times) * 1e3
        print(
            f"{args.model}: export {result.nbytes / 2**20:.2f} MiB in {median:.1f} ms "
            f"(median of {args.repeats}, world {args.world} checkpoint)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
