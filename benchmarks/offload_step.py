"""The offloaded step's CPU time against the memory-bandwidth bound of an AdamW step, and against AdamW.

``ZeroOptimizer(..., offload="optimizer")`` steps the fp32 masters in host memory on the CPU
([Note: offload, executed] in ``zeroplan.core.host_step``). On a CPU machine that is the same memory
as the parameters, so what is measured here is the host step itself: per unit (bucket) one call of
the inner optimizer, the cast of the updated masters into bf16 and their copy into the parameters.
It is compared with

* the **bound** the machine allows: the bytes the step must move over the memory bus, divided by
  the bandwidth measured in the same round by ``a.add_(b)`` on 256 MiB tensors (reads both, writes
  ``a`` in place, as the optimizer's updates do; a plain copy also pays the read of the lines it
  writes). An AdamW step reads the master, the gradient and both moments and writes the master and
  both moments: 28 bytes per element. ZeroOptimizer's step also divides the summed gradient (read
  and write, 8) and writes the masters into the bf16 parameters (read 4, write 2): 42 bytes; the
  offloaded step casts into host room, then copies it into the parameters (read 2, write 2 more):
  46 bytes per element; with ``offload_fraction=0.5`` the kept half casts straight into the
  parameters (42), so 44 on average;
* ``torch.optim.AdamW`` on the same number of fp32 elements, shaped as the model's parameters
  (for-loop, the CPU default, and ``fused=True``), gradients set, step alone;
* ``ZeroOptimizer`` without offload on the same bf16 model (on the CPU: the same memory);
* FSDP2 with ``CPUOffloadPolicy`` (unpinned: pinning needs an accelerator) and bf16 compute on the
  same layers: its ``AdamW`` steps the fp32 sharded parameters (DTensors) in host memory; its cast
  and copy to the device happen in the next forward's all-gather, outside the timed step (its bound
  is AdamW's 28 bytes per element).

Configurations (``CONFIGS``) run one after another in every round, in an order rotated every round,
each in a newly spawned process (world 1, gloo); a configuration's time is the median of
``--steps`` steps after ``--warmup``, and the table gives the median over rounds with min / max.
Only ``step()`` is timed (ZeroOptimizer: after a backward, so the gradients landed in the host
shard). Nothing here asserts a time.

Usage::

    python benchmarks/offload_step.py                     # 3 rounds, 33.6M elements: about 2 min
    python benchmarks/offload_step.py --rounds 5 --width 1024 --layers 16
    python benchmarks/offload_step.py --json offload.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from step_time import run_fresh

#: name -> what it times.
CONFIGS = {
    "bandwidth": "a.add_(b), 256 MiB fp32 each: the machine's bandwidth (2 reads, 1 write in place)",
    "adamw": "torch.optim.AdamW (for-loop, the CPU default) on fp32 tensors of the model's shapes",
    "adamw_fused": "torch.optim.AdamW(fused=True) on the same",
    "zero": "ZeroOptimizer(AdamW, stage=2) on the bf16 model, no offload",
    "zero_offload": "ZeroOptimizer(AdamW, stage=2, offload='optimizer') on the bf16 model",
    "zero_offload_fused": "the same with AdamW(fused=True) as the inner optimizer",
    "zero_offload_half": "the same with offload_fraction=0.5: half of each shard kept on the device",
    "fsdp2_offload": "FSDP2 per layer, CPUOffloadPolicy, bf16 compute (fp32 sharded params) + AdamW",
}
#: Bytes per element each configuration's step must move (see the module docstring).
BYTES = {"adamw": 28, "zero": 42, "zero_offload": 46, "zero_offload_half": 44, "fsdp2": 28}


def _model(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)]
    return torch.nn.Sequential(*layers).to(dtype)


def _time(fn: Any, before: Any, args: argparse.Namespace) -> list[float]:
    times = []
    for i in range(args.warmup + args.steps):
        before()
        start = time.perf_counter()
        fn()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, config: str, queue: Any) -> None:
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        numel = args.width * args.width * args.layers
        if config == "bandwidth":
            a, b = torch.ones(2**26), torch.ones(2**26)
            times = _time(lambda: a.add_(b), lambda: None, args)
            queue.put(
                {"median_s": statistics.median(times), "bandwidth": 3 * a.nbytes / statistics.median(times)}
            )
            return
        if config.startswith("adamw"):
            params = [p.requires_grad_() for p in _model(args, torch.float32).parameters()]
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            opt = torch.optim.AdamW(params, lr=1e-4, fused=config.endswith("fused") or None)
            times = _time(opt.step, lambda: None, args)
        elif config == "fsdp2_offload":
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

            model = _model(args, torch.float32)
            policies = {
                "offload_policy": CPUOffloadPolicy(pin_memory=False),  # pinning needs an accelerator
                "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            }
            for layer in model:
                fully_shard(layer, **policies)
            fully_shard(model, **policies)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            x = torch.randn(8, args.width)

            def backward() -> None:
                opt.zero_grad()
                model(x).float().square().mean().backward()

            times = _time(opt.step, backward, args)
        else:
            from zeroplan.facade import ZeroOptimizer

            model = _model(args, torch.bfloat16)
            offload = "optimizer" if "offload" in config else None
            fused = {"fused": True} if config.endswith("fused") else {}
            fraction = 0.5 if config.endswith("half") else None  # [Note: kept on the device]
            opt = ZeroOptimizer(
                model.parameters(),
                torch.optim.AdamW,
                lr=1e-4,
                stage=2,
                offload=offload,
                offload_fraction=fraction,
                **fused,
            )
            x = torch.randn(8, args.width, dtype=torch.bfloat16)

            def backward() -> None:
                opt.zero_grad()
                model(x).float().square().mean().backward()

            times = _time(opt.step, backward, args)
        queue.put({"median_s": statistics.median(times), "numel": numel})
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=max(1, torch.get_num_threads()))
    parser.add_argument("--only", default=",".join(CONFIGS))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    configs = [c for c in args.only.split(",") if c]
    if "bandwidth" not in configs:
        configs.insert(0, "bandwidth")  # the bound needs it, from the same rounds
    rounds = []
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        measured = {c: run_fresh(1, c, args, worker=_worker) for c in order}
        rounds.append(measured)
        line = ", ".join(f"{c} {m['median_s'] * 1e3:.1f}" for c, m in measured.items())
        print(f"round {r + 1}: {line} ms", file=sys.stderr)
    numel = args.width * args.width * args.layers
    bandwidths = [m["bandwidth"]["bandwidth"] for m in rounds]
    rows: dict[str, Any] = {}
    for c in configs:
        if c == "bandwidth":
            continue
        moved = next(
            b for prefix, b in sorted(BYTES.items(), key=lambda kv: -len(kv[0])) if c.startswith(prefix)
        )
        ms = [m[c]["median_s"] * 1e3 for m in rounds]
        bound = [numel * moved / bw * 1e3 for bw in bandwidths]
        ratio = [t / b for t, b in zip(ms, bound, strict=True)]
        to_adamw = [m[c]["median_s"] / m["adamw"]["median_s"] for m in rounds] if "adamw" in configs else []
        rows[c] = {
            "median_ms": statistics.median(ms),
            "min_ms": min(ms),
            "max_ms": max(ms),
            "bytes_per_element": moved,
            "bound_ms": statistics.median(bound),
            "over_bound": statistics.median(ratio),
            "to_adamw": statistics.median(to_adamw) if to_adamw else None,
        }
    bw = statistics.median(bandwidths)
    print(f"\n{numel / 1e6:.1f}M elements, {args.threads} threads, bandwidth {bw / 1e9:.2f} GB/s (median)")
    heads = ("step ms", "min-max", "B/elt", "bound ms", "x bound", "x AdamW")
    print(f"{'config':20} " + " ".join(f"{h:>9}" for h in heads))
    for c, row in rows.items():
        spread = f"{row['min_ms']:.0f}-{row['max_ms']:.0f}"
        to_adamw = f"{row['to_adamw']:.2f}" if row["to_adamw"] is not None else "-"
        print(
            f"{c:20} {row['median_ms']:9.1f} {spread:>9} {row['bytes_per_element']:9d} "
            f"{row['bound_ms']:9.1f} {row['over_bound']:9.2f} {to_adamw:>9}"
        )
    for c in rows:
        print(f"  {c}: {CONFIGS[c]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": numel, "bandwidth": bw, "rows": rows, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
