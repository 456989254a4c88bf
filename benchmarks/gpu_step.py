"""Step time and memory on one GPU: ZeroOptimizer stage 2 vs AdamW(fused=True) vs FSDP2, world 1, NCCL.

One process, one GPU, ``init_process_group("nccl")`` at world 1, the demo GPT
(``zeroplan.facade.cli.demo.model``) at a size worth timing (``--size``):

* ``zero2 bf16``    ``ZeroOptimizer(AdamW(fused=True), stage=2)`` on a bf16 model (fp32 master shard)
* ``adamw bf16``    ``AdamW(fused=True)`` on fp32 master copies of a bf16 model, rounded back into it
                    after each step (the reference of ``tests/cuda/nccl_world1.py``)
* ``fsdp2 bf16``    ``fully_shard`` on every block and on the root,
                    ``MixedPrecisionPolicy(param_dtype=bf16)``: fp32 sharded parameters (the masters),
                    bf16 compute and gradient reduction, ``AdamW(fused=True)``
* ``zero2 fp32``, ``adamw fp32`` (plain ``AdamW(fused=True)`` on an fp32 model), ``fsdp2 fp32``
* with ``--only``: ``zero2 bf16 offload`` (``offload="optimizer"``: masters, state and gradient shard in
  pinned host memory, the fused CPU AdamW step bucket by bucket), ``zero2 bf16 offload half``
  (``offload_fraction=0.5``: half of each shard kept on the GPU and stepped there) and ``fsdp2 bf16
  offload`` (``CPUOffloadPolicy``), side by side with ``zero2 bf16`` and ``fsdp2 bf16`` (``docs/offload.md``)

At world 1 a ZeroOptimizer reduction is a copy, while FSDP2 still runs its
one-rank all-gathers and reduce-scatters: this measures each method's own
overhead around the same forward/backward, not communication.

A timed step is forward + backward + step + zero_grad on a fixed synthetic
batch, between two ``torch.cuda.synchronize()``. All configurations are built
side by side and, after warm-up steps, step in interleaved rounds (one step
each per round, the order rotated every round), so drifting clocks and load
hit them alike; the table gives the median step and, per configuration, the
median over rounds of its step divided by the baseline's step *in the same
round* (AdamW and FSDP2 in the same precision). Memory is measured first, one
configuration at a time: ``torch.cuda.max_memory_allocated()`` over training
steps after warm-up (peak statistics reset after it), minus what was allocated
before the configuration was built; and what stays allocated after
``zero_grad()``. Nothing here asserts a time.

Usage::

    python benchmarks/gpu_step.py                         # 163M parameters, batch 8 x 1024 tokens
    python benchmarks/gpu_step.py --size 406m --json out.json  # all six side by side: about 60 GB
    python benchmarks/gpu_step.py --only "zero2 bf16,adamw bf16" --rounds 50
    python benchmarks/gpu_step.py --profile prof.txt  # also: where each configuration's step goes

``--profile`` runs ``torch.profiler`` over ``PROFILED_STEPS`` further steps of each configuration
(after the timed rounds, so the profiler does not disturb them) and writes, per configuration, the
operators by self CPU and by self CUDA time and the kernels launched per step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _gpt import lm_loss, make_batch

from zeroplan.facade.cli.demo.model import GPTConfig, build_model

MIB = 2**20
HYPER = {"lr": 3e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "fused": True}
SIZES = {
    #: 163,109,376 parameters (GPT-2 small's shape, untied head).
    "163m": GPTConfig(vocab=50304, width=768, layers=12, heads=12, context=1024, qkv_bias=True),
    #: 406,382,592 parameters (GPT-2 medium's shape, untied head).
    "406m": GPTConfig(vocab=50304, width=1024, layers=24, heads=16, context=1024, qkv_bias=True),
    #: For smoke runs.
    "tiny": GPTConfig(vocab=256, width=64, layers=2, heads=2, context=32, qkv_bias=True),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROFILED_STEPS = 3


@dataclass(frozen=True)
class Variant:
    """One configuration: how the model is trained, and in which precision."""

    name: str
    kind: str  # "zero", "adamw" or "fsdp2"
    precision: str  # "bf16" or "fp32"
    note: str
    offload: bool = False  # CPU offload: ZeroOptimizer(offload="optimizer"), FSDP2's CPUOffloadPolicy
    fraction: float | None = None  # ZeroOptimizer(offload_fraction=...): the rest kept on the device


VARIANTS = (
    Variant("zero2 bf16", "zero", "bf16", "ZeroOptimizer stage 2, bf16 params, fp32 master shard"),
    Variant("adamw bf16", "adamw", "bf16", "AdamW on fp32 masters of bf16 params"),
    Variant("fsdp2 bf16", "fsdp2", "bf16", "fully_shard, fp32 params, bf16 compute and reduction"),
    Variant("zero2 fp32", "zero", "fp32", "ZeroOptimizer stage 2, fp32"),
    Variant("adamw fp32", "adamw", "fp32", "AdamW, fp32"),
    Variant("fsdp2 fp32", "fsdp2", "fp32", "fully_shard, fp32"),
)
#: CPU offload ([Note: offload, executed]): not in the default run (``--only``, or ``--offload``).
OFFLOAD_VARIANTS = (
    Variant("zero2 bf16 offload", "zero", "bf16", "stage 2, offload='optimizer': the step on the CPU", True),
    Variant(
        "zero2 bf16 offload half",
        "zero",
        "bf16",
        "stage 2, offload='optimizer', offload_fraction=0.5: half of the state kept on the GPU",
        True,
        0.5,
    ),
    Variant(
        "fsdp2 bf16 offload", "fsdp2", "bf16", "fully_shard + CPUOffloadPolicy (pinned), bf16 compute", True
    ),
)


class Runner:
    """One configuration's model and optimizer; :meth:`step` is the timed unit."""

    def __init__(self, variant: Variant, config: GPTConfig, device: torch.device, mesh: Any) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from zeroplan.facade import ZeroOptimizer

        self.variant = variant
        dtype = DTYPES[variant.precision]
        self.masters: list[torch.Tensor] = []
        if variant.kind == "fsdp2":
            self.model = build_model(config, seed=0, device=device)  # fp32: FSDP2 keeps the masters
            policy = MixedPrecisionPolicy(param_dtype=dtype if dtype != torch.float32 else None)
            pinned = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # pinning needs an accelerator
            offload = {"offload_policy": pinned} if variant.offload else {}
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy, **offload)
            fully_shard(self.model, mesh=mesh, mp_policy=policy, **offload)
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.model.parameters(), **HYPER)
            return
        self.model = build_model(config, seed=0, dtype=dtype, device=device)
        self.params = list(self.model.parameters())
        if variant.kind == "zero":
            offload = "optimizer" if variant.offload else None
            self.optimizer = ZeroOptimizer(
                self.params,
                torch.optim.AdamW,
                stage=2,
                offload=offload,
                offload_fraction=variant.fraction,
                **HYPER,
            )
        elif dtype == torch.float32:
            self.optimizer = torch.optim.AdamW(self.params, **HYPER)
        else:
            self.masters = [p.detach().float().clone() for p in self.params]
            self.optimizer = torch.optim.AdamW(self.masters, **HYPER)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, backward, optimizer step, ``zero_grad``; the loss (not synchronised)."""
        loss = lm_loss(self.model(tokens).float(), targets)
        loss.backward()
        if not self.masters:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return loss.detach()
        for master, p in zip(self.masters, self.params, strict=True):
            master.grad, p.grad = p.grad.float(), None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)
        return loss.detach()


@dataclass
class Options:
    size: str
    batch: int
    warmup: int
    rounds: int
    memory_steps: int
    variants: tuple[Variant, ...]
    device: str
    tf32: bool
    json: str | None
    profile: str | None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clean(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure_memory(opts: Options, device: torch.device, mesh: Any, batch: Any) -> dict[str, dict[str, int]]:
    """Per configuration, alone on the device: peak bytes of a training step and bytes kept between steps."""
    if device.type != "cuda":
        return {}
    config = SIZES[opts.size]
    result = {}
    for variant in opts.variants:
        _clean(device)
        base = torch.cuda.memory_allocated(device)
        runner = Runner(variant, config, device, mesh)
        for _ in range(opts.warmup):
            runner.step(*batch)
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(opts.memory_steps):
            runner.step(*batch)
        _sync(device)
        result[variant.name] = {
            "peak_bytes": torch.cuda.max_memory_allocated(device) - base,
            "resident_bytes": torch.cuda.memory_allocated(device) - base,
        }
        del runner
    _clean(device)
    return result


def time_steps(
    opts: Options, device: torch.device, mesh: Any, batch: Any
) -> tuple[dict[str, dict[str, Any]], int]:
    """Every configuration side by side: step times (ms) over interleaved rounds and the last loss; params."""
    config = SIZES[opts.size]
    runners = [Runner(v, config, device, mesh) for v in opts.variants]
    for runner in runners:
        for _ in range(opts.warmup):
            runner.step(*batch)
    k = len(runners)
    times: list[list[float]] = [[] for _ in runners]
    losses: list[float] = [float("nan")] * k
    for i in range(opts.rounds):
        for j in range(k):
            c = (i + j) % k  # rotate the order every round
            _sync(device)
            start = time.perf_counter()
            loss = runners[c].step(*batch)
            _sync(device)
            times[c].append(1e3 * (time.perf_counter() - start))
            losses[c] = float(loss)
    numel = sum(p.numel() for p in runners[0].model.parameters()) if runners else 0
    out = {
        v.name: {"step_ms": t, "loss": loss} for v, t, loss in zip(opts.variants, times, losses, strict=True)
    }
    if opts.profile:
        profile_steps(opts.profile, runners, device, batch)
    return out, numel


def profile_steps(path: str, runners: list[Runner], device: torch.device, batch: Any) -> None:
    """Each configuration's next steps under ``torch.profiler``: operator tables and kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with open(path, "w") as out:
        for runner in runners:
            _sync(device)
            with profile(activities=activities) as prof:
                for _ in range(PROFILED_STEPS):
                    runner.step(*batch)
                _sync(device)
            events = prof.key_averages()
            kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
            out.write(f"== {runner.variant.name}: {kernels / PROFILED_STEPS:.0f} kernels per step\n")
            for key in ("self_cpu_time_total", "self_device_time_total"):
                out.write(events.table(sort_by=key, row_limit=18, max_name_column_width=60) + "\n")


def _paired(mine: list[float], base: list[float] | None) -> float | None:
    """Median over rounds of the ratio of two configurations' steps in the same round."""
    return None if base is None else statistics.median(a / b for a, b in zip(mine, base, strict=True))


def summarise(
    opts: Options, timed: dict[str, Any], memory: dict[str, dict[str, int]]
) -> list[dict[str, Any]]:
    rows = []
    for v in opts.variants:
        t = timed[v.name]["step_ms"]
        adamw = timed.get(f"adamw {v.precision}", {}).get("step_ms")
        fsdp2 = timed.get(f"fsdp2 {v.precision}", {}).get("step_ms")
        mem = memory.get(v.name, {})
        rows.append(
            {
                **asdict(v),
                "median_ms": statistics.median(t),
                "min_ms": min(t),
                "step_ms": t,
                "paired_ratio_to_adamw": _paired(t, adamw),
                "paired_ratio_to_fsdp2": _paired(t, fsdp2),
                "peak_bytes": mem.get("peak_bytes"),
                "resident_bytes": mem.get("resident_bytes"),
                "loss": timed[v.name]["loss"],
            }
        )
    return rows


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "—" if x is None else fmt.format(x)


def caption(opts: Options, device: torch.device, numel: int) -> str:
    m = SIZES[opts.size]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run, no memory)"
    return (
        f"demo GPT, {numel / 1e6:.1f}M parameters (vocab {m.vocab}, width {m.width}, {m.layers} layers, "
        f"{m.heads} heads), batch {opts.batch} x {m.context} tokens; {where}, world 1, torch "
        f"{torch.__version__}; AdamW(lr={HYPER['lr']}, weight_decay={HYPER['weight_decay']}, fused=True) "
        f"everywhere; TF32 {'on' if opts.tf32 else 'off (torch default)'}. Step = forward+backward+step+"
        f"zero_grad between CUDA synchronisations; warm-up {opts.warmup} steps, then {opts.rounds} "
        "interleaved rounds; paired ratio = median over rounds of the step divided by the baseline's step "
        "in the same round (same precision). Memory: each configuration alone, peak of "
        f"max_memory_allocated over {opts.memory_steps} steps after warm-up, and bytes kept after "
        "zero_grad, both above what was allocated before it was built."
    )


def print_table(rows: list[dict[str, Any]], text: str) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title="step time and memory per rank, one GPU", box=box.SIMPLE_HEAD, caption=text)
    table.add_column("configuration", no_wrap=True)
    for column in (
        "median step (ms)",
        "paired ratio to AdamW",
        "paired ratio to FSDP2",
        "peak (MiB)",
        "kept (MiB)",
        "loss",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["name"],
            f"{r['median_ms']:.1f}",
            _num(r["paired_ratio_to_adamw"]),
            _num(r["paired_ratio_to_fsdp2"]),
            _num(None if r["peak_bytes"] is None else r["peak_bytes"] / MIB, "{:.0f}"),
            _num(None if r["resident_bytes"] is None else r["resident_bytes"] / MIB, "{:.0f}"),
            f"{r['loss']:.4f}",
        )
    Console().print(table)


def parse(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="163m", help="model size (default 163m)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per configuration (default 3)")
    p.add_argument("--rounds", type=int, default=20, help="interleaved timed rounds (default 20)")
    p.add_argument("--memory-steps", type=int, default=2, help="steps of the memory measurement")
    p.add_argument("--only", default=None, help="comma-separated configuration names")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (fp32 configurations)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--profile", default=None, metavar="PATH", help="also profile each configuration")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    variants = VARIANTS
    every = VARIANTS + OFFLOAD_VARIANTS
    if a.only:
        wanted = [s.strip() for s in a.only.split(",")]
        unknown = sorted(set(wanted) - {v.name for v in every})
        if unknown:
            p.error(f"--only: unknown {unknown}; choose from {[v.name for v in every]}")
        variants = tuple(v for v in every if v.name in wanted)
    return Options(
        size=a.size,
        batch=a.batch,
        warmup=a.warmup,
        rounds=a.rounds,
        memory_steps=a.memory_steps,
        variants=variants,
        device=a.device,
        tf32=a.tf32,
        json=a.json,
        profile=a.profile,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if opts.device == "cuda" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        print("gpu_step.py: needs a CUDA GPU and NCCL; torch sees none, nothing was run", file=sys.stderr)
        return 2
    from torch.distributed.device_mesh import init_device_mesh

    if opts.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = opts.tf32
        torch.backends.cudnn.allow_tf32 = opts.tf32
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=0,
        world_size=1,
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        timeout=timedelta(seconds=300),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        mesh = init_device_mesh(device.type, (1,))
        batch = tuple(t.to(device) for t in make_batch(SIZES[opts.size], opts.batch, rank=0))
        start = time.perf_counter()
        memory = measure_memory(opts, device, mesh, batch)
        timed, numel = time_steps(opts, device, mesh, batch)
        rows = summarise(opts, timed, memory)
        text = caption(opts, device, numel)
        print_table(rows, text)
        print(f"total {time.perf_counter() - start:.0f} s", file=sys.stderr)
        if opts.json:
            payload = {
                "model": SIZES[opts.size]._asdict(),
                "params": numel,
                "options": {**asdict(opts), "variants": [v.name for v in opts.variants]},
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "results": rows,
                "caption": text,
            }
            with open(opts.json, "w") as f:
                json.dump(payload, f, indent=2)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
