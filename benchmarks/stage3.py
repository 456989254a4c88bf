"""Stage 3 vs PyTorch FSDP2, ZeroOptimizer stage 2 and DDP: step time and peak RSS growth (issue 13).

A 42M-parameter GPT (``GPT_42M``) at world 2 on gloo (CPU, one thread per
rank), measured in interleaved fresh rounds as ``step_time.py --fresh-rounds``
does (its ``Runner``, ``timed_steps`` and ``run_fresh`` are reused): each
round runs every configuration once, each in newly spawned processes, in an
order rotated every round; ratios to ``ddp`` are taken within a round and the
table reports their median (min-max) over rounds. Configurations:

* ``ddp``         DistributedDataParallel + ``torch.optim.AdamW(foreach=True)``
* ``fsdp2``       ``fully_shard`` (``torch.distributed.fsdp``) on each transformer
  block, then on the root, ``reshard_after_forward=True`` on every call, on a
  1-D ``init_device_mesh("cpu", (world,))``; ``AdamW(foreach=True)`` over the
  sharded (DTensor) parameters. Passing ``True`` explicitly also reshards the
  root after forward (torch's default, ``None``, keeps the root gathered).
* ``zero2``       ``ZeroOptimizer(AdamW, stage=2)``, no DDP, defaults
* ``zero3``       ``ZeroOptimizer(AdamW, stage=3)`` + ``opt.attach(model)``
* ``zero3-keep``  the same with ``reshard_after_forward=False``

A configuration whose construction raises (stage 3 before it is executed) is
reported as not available and left out of later rounds; the others still run.

Step time: forward + backward + ``step()`` + ``zero_grad()``, timed back to
back after warm-up (the last step up to ``wait_for_params()``), slowest rank,
median over the timed steps.

Peak RSS growth per rank: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (KiB on
Linux) after the timed steps minus the same value just before the model is
built. ``ru_maxrss`` is the process's lifetime high-water mark, so the baseline
is taken in the fresh process after imports (this module imports FSDP2 and
zeroplan's facade at its top) and process-group set-up, and the growth covers
everything after it: building the model, the optimizer (and its construction
transients), warm-up and the timed steps. It includes what any first steps cost
(about 50 MiB on the ``--quick`` model, where the model itself is negligible).
The table reports the larger of the ranks, median over rounds.

RSS also counts what glibc keeps after a free: once a large block is freed,
its dynamic mmap threshold rises (up to 32 MiB), later blocks below it come from
the heap and are not returned. That penalises configurations that gather and
free parameters every step: on the 42M model FSDP2's growth was about 930 MiB
by default and about 590 MiB with ``--mmap-threshold 1048576`` (DDP about 1050
MiB either way; three steps). ``--mmap-threshold BYTES`` sets
``MALLOC_MMAP_THRESHOLD_`` in the workers, so blocks above it are mapped and
unmapped (closer to live tensor bytes; it may change step times).

[Note: stage 3 traffic]
Per step, stage 3 sends 3Ψ (the ZeRO paper; Ψ = the parameters' bytes):
a reduce-scatter of the gradients (Ψ) and an all-gather of the parameters
twice, before forward and again in backward (Ψ each). With a ring cost model a
rank sends (N-1)/N of each, so 3Ψ(N-1)/N per rank, against 2Ψ(N-1)/N for
stage 2 and DDP. The report prints the plan of ``zeroplan.core``
(``plan(..., stage=3)`` + ``memory_report``) for this model next to the table:
with reduce-scatter / all-gather (``policy="min_bytes"``) it equals
3Ψ(N-1)/N exactly; the gloo policy (``collectives="auto"`` on gloo) sends the
same bytes as point-to-point exchanges where pieces are equal, and all-reduces
and broadcasts where they are not. The ``sent`` column is measured
(``last_step_comm()``) for ZeroOptimizer and computed for DDP (2Ψ(N-1)/N) and
FSDP2 (3Ψ(N-1)/N).

Usage::

    python benchmarks/stage3.py --quick               # smoke run, tiny model, one round (< 1 min)
    python benchmarks/stage3.py --rounds 3 --json stage3.json   # about 6 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _gpt import GPT, GPT_42M, GPT_TINY, GPTConfig, make_batch
from step_time import (
    LR,
    MB,
    WEIGHT_DECAY,
    Options,
    Runner,
    Variant,
    _join,
    _spread,
    leave,
    run_fresh,
    timed_steps,
)

from zeroplan.core import Topology, memory_report, plan, specs_from_module
from zeroplan.facade import ZeroOptimizer

__all__ = ["CONFIGS", "Config", "Stage3Runner", "main"]


@dataclass(frozen=True)
class Config(Variant):
    """A configuration: ``kind`` is ``"ddp"``, ``"fsdp2"`` or ``"zero"`` (``stage`` 2 or 3)."""

    reshard_after_forward: bool = True


CONFIGS = (
    Config("ddp", "ddp", note="DDP + AdamW(foreach)"),
    Config("fsdp2", "fsdp2", note="fully_shard per block + root, reshard_after_forward=True"),
    Config("zero2", "zero", stage=2, note="ZeroOptimizer stage 2, defaults"),
    Config("zero3", "zero", stage=3, note="ZeroOptimizer stage 3 + attach(model)"),
    Config(
        "zero3-keep",
        "zero",
        stage=3,
        reshard_after_forward=False,
        note="stage 3, reshard_after_forward=False",
    ),
)


def _fully_shard(model: torch.nn.Module, world: int) -> None:
    """FSDP2 on each block, then the root, resharding after forward."""
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


class Stage3Runner(Runner):
    """``step_time.Runner`` (``ddp``, stage 2), plus FSDP2 and ZeroOptimizer stage 3."""

    def __init__(self, config: Config, opts: Options, world: int) -> None:
        if config.kind == "ddp" or (config.kind == "zero" and config.stage < 3):
            super().__init__(config, opts, world)
            return
        self.variant = config
        self.world = world
        torch.manual_seed(opts.seed)
        self.model = GPT(opts.model)
        self.module = self.model
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        hyper: dict[str, Any] = {"lr": LR, "weight_decay": WEIGHT_DECAY, "foreach": True}
        self.zero = None
        if config.kind == "fsdp2":
            _fully_shard(self.model, world)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **hyper)
            return
        if not config.reshard_after_forward:
            hyper["reshard_after_forward"] = False  # a ZeroOptimizer keyword (default True)
        self.zero = ZeroOptimizer(
            self.model.parameters(),
            torch.optim.AdamW,
            stage=config.stage,
            bucket_bytes=int(opts.bucket_mb * MB),
            **hyper,
        )
        self.zero.attach(self.model)
        self.optimizer = self.zero

    def comm_bytes(self) -> tuple[int, bool]:
        """As ``Runner.comm_bytes``; FSDP2 computed as 3Ψ(N-1)/N."""
        if self.variant.kind == "fsdp2":
            return 3 * (self.world - 1) * self.param_bytes // self.world, False
        return super().comm_bytes()


def _peak_rss_kib() -> int:
    """This process's RSS high-water mark so far, KiB (Linux ``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _error(exc: BaseException) -> str:
    """The exception's type and first line."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def _short(why: str, limit: int = 60) -> str:
    """``why`` for a table cell: up to its first parenthesis, at most ``limit`` characters."""
    why = why.split(" (")[0]
    return why if len(why) <= limit else why[: limit - 1] + "…"


def _measure(rank: int, world: int, opts: Options, config: Config) -> dict[str, Any]:
    """Build, time and measure ``config`` on this rank; rank 0's return value is the result."""
    tokens, targets = make_batch(opts.model, opts.batch, rank)
    baseline = _peak_rss_kib()
    runner: Stage3Runner | None = None
    error = None
    try:
        runner = Stage3Runner(config, opts, world)
    except Exception as exc:
        error = _error(exc)
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)
    if runner is None or any(errors):
        return {"unavailable": next(e for e in errors if e)}
    times, cpu = timed_steps(runner, tokens, targets, opts)
    growth = _peak_rss_kib() - baseline
    comm, measured = runner.comm_bytes()
    loss = runner.loss(tokens, targets)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"times": times, "cpu": cpu, "rss_kib": growth})
    step_max = [max(ts) for ts in zip(*(g["times"] for g in gathered), strict=True)]
    return {
        "params": runner.numel,
        "param_bytes": runner.param_bytes,
        "step_ms": [1e3 * t for t in step_max],
        "median_ms": 1e3 * statistics.median(step_max),
        "cpu_ms_per_rank": 1e3 * statistics.fmean(g["cpu"] for g in gathered),
        "rss_growth_mib": [g["rss_kib"] / 1024 for g in gathered],
        "comm_bytes": comm,
        "comm_measured": measured,
        "loss": loss,
    }


def _worker(rank: int, world: int, port: int, opts: Options, config: Config, queue: Any) -> None:
    """One configuration in fresh processes; rank 0 puts its result, or why there is none."""
    _join(rank, world, port, opts)
    try:
        result = _measure(rank, world, opts, config)
    except Exception as exc:  # a rank that fails (or lost its peer) still answers
        result = {"failed": _error(exc)}
    if rank == 0:
        queue.put(result)
    leave()


def run_rounds(world: int, opts: Options) -> dict[str, Any]:
    """``opts.fresh_rounds`` rounds of every available configuration, order rotated every round."""
    configs = opts.variants
    k = len(configs)
    missing: dict[str, tuple[str, str]] = {}  # name: ("not available" or "failed", why)
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(opts.fresh_rounds):
        t = time.perf_counter()
        measured: dict[str, dict[str, Any]] = {}
        for j in range(k):
            config = configs[(r + j) % k]
            if config.name in missing:
                continue
            m = run_fresh(world, config, opts, _worker)
            if "unavailable" in m:
                missing[config.name] = ("not available", m["unavailable"])
            elif "failed" in m:
                missing[config.name] = ("failed", m["failed"])
            else:
                measured[config.name] = m
        rounds.append(measured)
        line = ", ".join(f"{name} {m['median_ms']:.0f}" for name, m in measured.items())
        print(f"round {r + 1}: {line} ms ({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    rows = []
    for config in configs:
        row: dict[str, Any] = {"name": config.name, "note": config.note}
        per_round = [m[config.name] for m in rounds if config.name in m]
        if config.name in missing or not per_round:
            row["missing"], row["why"] = missing.get(config.name, ("not measured", ""))
            rows.append(row)
            continue
        paired = [m for m in rounds if config.name in m and "ddp" in m]
        row.update(
            median_ms=statistics.median(m["median_ms"] for m in per_round),
            round_ms=[m["median_ms"] for m in per_round],
            step_ms=[m["step_ms"] for m in per_round],
            ratio_to_ddp=(
                _spread([m[config.name]["median_ms"] / m["ddp"]["median_ms"] for m in paired])
                if paired
                else None
            ),
            rss_growth_mib=statistics.median(max(m["rss_growth_mib"]) for m in per_round),
            rss_growth_mib_rounds=[m["rss_growth_mib"] for m in per_round],
            comm_bytes=per_round[-1]["comm_bytes"],
            comm_measured=per_round[-1]["comm_measured"],
            cpu_ms_per_rank=statistics.median(m["cpu_ms_per_rank"] for m in per_round),
            loss=statistics.median(m["loss"] for m in per_round),
            wall_s=statistics.fmean(m["wall_s"] for m in per_round),
        )
        rows.append(row)
    return {"world": world, "configs": rows}


def planned_traffic(model: GPTConfig, world: int, bucket_mb: float) -> dict[str, Any]:
    """Stage 3 bytes per rank and step from ``zeroplan.core``, and 3Ψ(N-1)/N to compare."""
    with torch.device("meta"):
        specs = specs_from_module(GPT(model))
    psi = sum(s.numel for s in specs) * 4  # fp32
    out: dict[str, Any] = {"psi_bytes": psi, "three_psi_per_rank": 3 * psi * (world - 1) // world}
    for policy in ("min_bytes", "gloo"):
        for stage in (2, 3):
            zp = plan(
                specs,
                Topology(world_size=world),
                stage=stage,
                bucket_bytes=int(bucket_mb * MB),
                policy=policy,
            )
            rank0 = memory_report(zp).ranks[0]
            out[f"stage{stage}_{policy}"] = {
                "bytes": rank0.comm_bytes_per_step,
                "peak_bytes": rank0.peak_bytes,
                "comm": [
                    {"collective": c.collective.value, "calls": c.calls, "bytes": c.bytes} for c in rank0.comm
                ],
            }
    return out


def _mib(n: float) -> str:
    return f"{n / MB:.1f}"


def markdown(result: dict[str, Any], traffic: dict[str, Any], opts: Options) -> str:
    """The table, how it was measured, and the planned stage-3 traffic."""
    lines = [
        "| configuration | step ms | / DDP median (min-max) | peak RSS growth MiB per rank "
        "| sent MiB / step / rank |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in result["configs"]:
        if "missing" in row:
            lines.append(f"| {row['name']} | {row['missing']}: {_short(row['why'])} | | | |")
            continue
        ratio = row["ratio_to_ddp"]
        ratio_s = "—" if ratio is None else f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"
        sent = _mib(row["comm_bytes"]) + ("" if row["comm_measured"] else " (computed)")
        lines.append(
            f"| {row['name']} | {row['median_ms']:.0f} | {ratio_s} | {row['rss_growth_mib']:.0f} | {sent} |"
        )
    m, world = opts.model, result["world"]
    lines += [
        "",
        f"GPT {traffic['psi_bytes'] / 4 / 1e6:.2f}M parameters (vocab {m.vocab}, width {m.width}, "
        f"{m.layers} layers, {m.heads} heads, context {m.context}), fp32, batch {opts.batch}x{m.context} "
        f"tokens per rank; world {world}, gloo on CPU ({os.cpu_count()} cores), one thread per rank. "
        f"{opts.fresh_rounds} rounds, each running every configuration once in fresh processes, order "
        f"rotated per round; {opts.warmup} warm-up + {opts.steps} timed steps back to back, slowest rank, "
        "median; ratios within a round, median (min-max) over rounds. RSS: ru_maxrss after the timed "
        "steps minus ru_maxrss before the model is built, larger rank, median over rounds. "
        f"AdamW(lr={LR}, weight_decay={WEIGHT_DECAY}, foreach=True); buckets {opts.bucket_mb:g} MiB. "
        f"MALLOC_MMAP_THRESHOLD_ {os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}. "
        f"Load average at the end: {os.getloadavg()[0]:.1f}.",
        "",
    ]
    psi, want = traffic["psi_bytes"], traffic["three_psi_per_rank"]
    s3 = traffic["stage3_min_bytes"]
    parts = " + ".join(f"{c['collective']} {_mib(c['bytes'])} MiB ({c['calls']} calls)" for c in s3["comm"])
    agrees = "equal" if s3["bytes"] == want else f"x{s3['bytes'] / want:.3f}: alignment padding"
    lines.append(
        f"Stage 3 traffic (ZeRO's 3Ψ: gradients reduce-scattered once, parameters all-gathered for "
        f"forward and again for backward), Ψ = {_mib(psi)} MiB: the zero3 plan (zeroplan.core, "
        f"policy min_bytes) sends {parts} = {_mib(s3['bytes'])} MiB per rank per step; "
        f"3Ψ(N-1)/N = {_mib(want)} MiB ({agrees}). Stage 2: "
        f"{_mib(traffic['stage2_min_bytes']['bytes'])} MiB = 2Ψ(N-1)/N. With the gloo policy "
        f"(collectives='auto' on gloo): stage 3 {_mib(traffic['stage3_gloo']['bytes'])} MiB, stage 2 "
        f"{_mib(traffic['stage2_gloo']['bytes'])} MiB. Planned peak per rank (no activations): "
        f"stage 3 {_mib(s3['peak_bytes'])} MiB, "
        f"stage 2 {_mib(traffic['stage2_min_bytes']['peak_bytes'])} MiB."
    )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="fresh rounds (default 3)")
    p.add_argument("--quick", action="store_true", help="tiny model, one round (smoke run)")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per configuration")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb / ZeroOptimizer bucket")
    p.add_argument("--only", default=None, help="comma-separated configuration names")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="set MALLOC_MMAP_THRESHOLD_ in the workers (see the RSS note)",
    )
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    model, rounds, (steps, warmup, batch) = (
        (GPT_TINY, 1, (3, 1, 2)) if a.quick else (GPT_42M, a.rounds, (6, 2, 4))
    )
    configs: tuple[Variant, ...] = CONFIGS
    if a.only:
        wanted = {s.strip() for s in a.only.split(",")}
        configs = tuple(c for c in CONFIGS if c.name in wanted)
        if not configs:
            p.error(f"--only matched none of {[c.name for c in CONFIGS]}")
    return Options(
        worlds=(a.world,),
        steps=a.steps if a.steps is not None else steps,
        warmup=a.warmup if a.warmup is not None else warmup,
        bucket_mb=a.bucket_mb,
        batch=a.batch if a.batch is not None else batch,
        model=model,
        variants=configs,
        timeout_s=300.0,
        fresh_rounds=rounds,
        extra={"json": a.json, "mmap_threshold": a.mmap_threshold},
    )


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    threshold = opts.extra.get("mmap_threshold")
    if threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)  # read by glibc in the spawned workers
    start = time.perf_counter()
    (world,) = opts.worlds
    result = run_rounds(world, opts)
    traffic = planned_traffic(opts.model, world, opts.bucket_mb)
    table = markdown(result, traffic, opts)
    print(table, flush=True)
    print(f"\ntotal {time.perf_counter() - start:.0f} s", file=sys.stderr)
    path = opts.extra.get("json")
    if path:
        payload = {
            "model": opts.model._asdict(),
            "world": world,
            "rounds": opts.fresh_rounds,
            "batch": opts.batch,
            "steps": opts.steps,
            "warmup": opts.warmup,
            "bucket_mb": opts.bucket_mb,
            "malloc_mmap_threshold": threshold,
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
            "results": result,
            "planned_traffic": traffic,
            "table": table,
        }
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
