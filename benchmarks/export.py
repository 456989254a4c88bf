"""``zeroplan export``: time, peak tensor memory and peak resident memory, offline.

``world`` gloo processes train one step of AdamW (bf16 parameters, fp32 masters, stage 2) on the
demo model or a 34M GPT and save a checkpoint, or save ``wide`` untrained: three fp32
``Linear(1024, 32768)`` layers (403 MB of weights, the largest tensor 134 MB) under SGD, which
keeps no state. This process then exports it repeatedly (median wall time, page cache warm) and
once under torch's ``MemTracker``. The tensor peak reported is what the export holds beyond the
memory-mapped checkpoint files, which ``MemTracker`` counts whole once touched. The resident peak
is that of a fresh interpreter running ``zeroplan export``, against one that only imports: the
mapped pages the export touches count there (see [Note: mapped pages]).

    python benchmarks/export.py --world 2 --repeats 5 [--model demo|34m|wide]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
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
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype

#: Runs its arguments as a command and prints the command's peak resident bytes (ru_maxrss is in KiB
#: on Linux). A child's ru_maxrss is at least its parent's peak (the kernel counts the memory it was
#: started from, the parent's, when it execs): the command starts from this small interpreter, not
#: from the large one measuring, whose peak would hide the import baseline.
_PEAK_OF = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""
#: Imports the CLI, then runs ``zeroplan export`` with its arguments if it has any.
_EXPORT = """
import sys
import zeroplan.facade.checkpoint.export
from zeroplan.facade.cli import main
sys.exit(main(["export", *sys.argv[1:]]) if sys.argv[1:] else 0)
"""


def _model(name: str) -> torch.nn.Module:
    if name == "wide":
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 32768) for _ in range(3)])
    if name == "demo":
        return build_model(GPTConfig(), dtype=torch.bfloat16)
    torch.manual_seed(0)
    return GPT(GPT_34M).to(torch.bfloat16)


def _worker(rank: int, world: int, port: int, root: str, name: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(name)
    if name == "wide":  # saved untrained, the weights only
        opt = ZeroOptimizer(model.named_parameters(), torch.optim.SGD, lr=1e-3, stage=2)
        checkpoint.save(opt, root)
        dist.destroy_process_group()
        return
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


def _peak_resident(*argv: str) -> int:
    """Peak resident bytes of a fresh interpreter that imports the CLI and runs ``export *argv``."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_OF, sys.executable, "-c", _EXPORT, *argv],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", choices=("demo", "34m", "wide"), default="demo")
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
        baseline = _peak_resident()
        peak = _peak_resident(str(root), str(work / "resident"))
        print(
            f"{args.model}: peak resident {peak / 1e6:.1f} MB exporting, {baseline / 1e6:.1f} MB importing: "
            f"{(peak - baseline) / 1e6:.1f} MB above the import, largest tensor {result.largest / 1e6:.1f} MB"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
