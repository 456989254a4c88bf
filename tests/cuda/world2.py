"""Two processes on one GPU, gloo, CUDA tensors: the launcher of the world-2 scenarios.

    python tests/cuda/world2.py train --stage 2 --dtype bf16    # prints one JSON line
    python tests/cuda/world2.py overlap

Both ranks use ``cuda:0`` and ``init_process_group("gloo")``: NCCL refuses two
ranks on one device, while gloo all-reduces and broadcasts CUDA tensors
(through pinned host memory), which is all the GLOO collective policy uses.
The scenarios are in ``world2_train.py`` and ``world2_overlap.py``; each returns
plain data per rank, printed as ``{"ranks": [rank 0's, rank 1's]}``.

Nothing here can hang: ``init_process_group`` and every collective have a
timeout, results are awaited with a deadline, and ranks still alive then are
killed. A hidden ``--device cpu`` runs the same scenarios on CPU tensors, to
check the code path on a machine without a GPU; the CUDA-only measurements are
then stand-ins (see ``world2_overlap.py``). Exit 2 without CUDA otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scenario(name: str) -> Any:
    sys.path.insert(0, HERE)
    if name == "train":
        from world2_train import train

        return train
    from world2_overlap import overlap

    return overlap


def _worker(rank: int, port: int, device_kind: str, name: str, cfg: dict, out: Any, timeout_s: float) -> None:
    try:
        if device_kind == "cuda":
            device = torch.device("cuda", 0)  # both ranks on the same GPU
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=WORLD,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=timeout_s),
        )
        out.put((rank, True, _scenario(name)(rank, WORLD, device, cfg)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run(name: str, cfg: dict[str, Any], *, device: str = "cuda", timeout_s: float = 240.0) -> list[Any]:
    """Run scenario ``name`` on two spawned ranks; their results in rank order.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message) or died without a result.
        TimeoutError: not every rank reported within ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, port, device, name, cfg, out, timeout_s / 2), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < WORLD:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(WORLD)) - set(results))} gave no result in time")
            try:
                rank, ok, payload = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead:
                    code = procs[dead[0]].exitcode
                    raise RuntimeError(f"rank {dead[0]} exited ({code}) without a result") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return [results[r] for r in range(WORLD)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=["train", "overlap"])
    p.add_argument("--stage", type=int, choices=[1, 2], default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for the whole run")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("world2.py: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    cfg = {"stage": a.stage, "dtype": a.dtype}
    print(json.dumps({"ranks": run(a.scenario, cfg, device=a.device, timeout_s=a.timeout)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
