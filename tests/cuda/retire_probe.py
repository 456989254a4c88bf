"""How long ``Pending.finish()`` holds the host on CUDA ([Note: retiring a collective]).

    python tests/cuda/retire_probe.py PORT      # prints one JSON line

``finish()`` waits, after ``work.wait()``, until the backend dropped its references to the
tensors it was given. gloo's worker thread does so microseconds after the work completed; if
NCCL's watchdog kept them until it next looks at the work, each finish would hold the host for
that long. Times, per backend on one GPU (world 1, where NCCL and gloo still run the collective),
the blocking all-reduce of ``collectives`` against ``dist.all_reduce`` itself, on 1 MiB.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from zeroplan.facade.mechanisms import collectives

CALLS = 50


def _times(call: object) -> dict[str, float]:
    samples = []
    for _ in range(CALLS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()  # type: ignore[operator]
        samples.append(1e3 * (time.perf_counter() - start))
    torch.cuda.synchronize()
    return {"median_ms": statistics.median(samples), "max_ms": max(samples)}


def main(port: int) -> dict[str, object]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}", device_id=device
    )
    gloo = dist.new_group([0], backend="gloo")
    value = torch.ones(1 << 18, device=device)  # 1 MiB of fp32
    out: dict[str, object] = {}
    for name, group in (("nccl", dist.group.WORLD), ("gloo", gloo)):
        out[name] = {
            "zeroplan": _times(lambda g=group: collectives.all_reduce(value, dist.ReduceOp.SUM, g)),
            "torch": _times(lambda g=group: dist.all_reduce(value, group=g)),
        }
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
