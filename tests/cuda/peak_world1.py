"""One process, one GPU: a training step's peak from ``torch.cuda.max_memory_allocated`` against the plan.

    python tests/cuda/peak_world1.py PORT [--device cpu]    # prints one JSON line

A Linear stack (activations well under 1% of the parameters) trains with
``ZeroOptimizer`` at world 1 (gloo: at world 1 every reduction is a copy). The
baseline is what the allocator holds after a warm-up matmul (cuBLAS workspace)
(forward and backward) and before the model exists; the peak of each configuration's third step,
minus that baseline, is compared with the plan's ``peak_bytes``. Each CUDA
allocation is rounded up to 512 bytes, which the few hundred tensors here keep
far below the 1% tolerance. ``--device cpu`` runs the same code path with
torch's ``MemTracker`` as the meter (a check of the script where there is no GPU).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch import nn

from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.diagnostics.meter import tracked_bytes

WIDTH, DEPTH, BATCH = 2048, 8, 8
CONFIGS = [
    {"stage": 1, "dtype": "fp32", "hyper": {"lr": 1e-3, "fused": True}},
    {"stage": 2, "dtype": "fp32", "hyper": {"lr": 1e-3, "foreach": True}},
    {"stage": 2, "dtype": "bf16", "hyper": {"lr": 1e-3, "fused": True}},
    {"stage": 2, "dtype": "bf16", "hyper": {"lr": 1e-3, "foreach": True}},
    {"stage": 1, "dtype": "bf16", "hyper": {"lr": 1e-3, "foreach": True}},
    {"stage": 3, "dtype": "fp32", "hyper": {"lr": 1e-3, "foreach": True}},
    {"stage": 3, "dtype": "bf16", "hyper": {"lr": 1e-3, "fused": True}},
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class CudaMeter:
    """The caching allocator's own counters."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def baseline(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def step_peak(self, step: object) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        step()  # type: ignore[operator]
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def requested_peak(self) -> int:
        """The last step's peak in bytes asked for (before the allocator rounds each block up)."""
        return torch.cuda.memory_stats(self.device)["requested_bytes.all.peak"]

    def close(self) -> None:
        pass


class TrackerMeter:
    """torch's ``MemTracker`` on CPU: counts only what is created inside it, so it is entered early."""

    def __init__(self) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        self.tracker = MemTracker()
        self.tracker.__enter__()

    def baseline(self) -> int:
        return 0

    def close(self) -> None:
        self.tracker.__exit__(None, None, None)

    def step_peak(self, step: object) -> int:
        self.tracker.__exit__(None, None, None)  # the tracker restarts its peak when entered
        self.tracker.reset_mod_stats()
        with self.tracker:
            step()  # type: ignore[operator]
            peak = tracked_bytes(self.tracker, "peak")
        self.tracker.__enter__()  # entered between steps too, as it was while the model was built
        return peak


def measure(config: dict[str, object], device: torch.device) -> dict[str, object]:
    meter = CudaMeter(device) if device.type == "cuda" else TrackerMeter()
    dtype = DTYPES[str(config["dtype"])]
    # cuBLAS keeps a workspace per thread and stream (32 MiB on Hopper), allocated through the
    # caching allocator at a thread's first matmul: the forward's here, and the autograd engine's
    # own thread in backward. Both exist before the baseline, as in any job after its first step.
    warm = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
    (warm @ warm).sum().backward()
    del warm
    baseline = meter.baseline()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))).to(device=device, dtype=dtype)
    opt = ZeroOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        stage=int(config["stage"]),  # type: ignore[call-overload]
        bucket_bytes=WIDTH * WIDTH,
        **config["hyper"],  # type: ignore[arg-type]
    )
    if config["stage"] == 3:
        opt.attach(model)  # one block per Linear: the forward gathers each in turn
    x = torch.randn(BATCH, WIDTH, device=device, dtype=dtype)

    def step() -> None:
        opt.backward(model(x).float().square().mean())
        opt.step()
        opt.zero_grad()

    peaks, requested = [], []
    for _ in range(3):
        peaks.append(meter.step_peak(step) - baseline)
        if isinstance(meter, CudaMeter):
            requested.append(meter.requested_peak())
    meter.close()
    report = opt.memory_report().ranks[0]
    result = {**config, "measured": peaks, "planned": report.peak_bytes, "phase": report.peak_phase.value}
    if requested:  # absolute: the baseline in requested bytes is not subtracted
        result["requested_peak"] = requested
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{args.port}")
    try:
        rows = [measure(c, device) for c in CONFIGS]
    finally:
        dist.destroy_process_group()
    print(json.dumps({"device": str(device), "rows": rows}))


if __name__ == "__main__":
    main()
