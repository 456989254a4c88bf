"""torch.compile with ZeroOptimizer: step time compiled against eager, and against FSDP2 (issue 29).

The 7.4M-parameter GPT (``GPT_7M``) at world 2 on gloo (CPU, one thread per rank, inductor), in
interleaved fresh rounds as ``stage3.py`` runs them (``step_time.run_fresh``): each round runs every
configuration once, each in newly spawned processes, in an order rotated every round; ratios are
taken within a round, and the table reports their median (min-max) over rounds. Configurations:

* ``ddp``            DDP + ``AdamW(foreach=True)``, eager (the reference of every ratio)
* ``ddp-whole``      the same model compiled whole, then wrapped in DDP (DDPOptimizer splits it)
* ``fsdp2``          ``fully_shard`` per transformer block and on the root, eager
* ``fsdp2-block``    each transformer block compiled, then ``fully_shard`` per block and on the root
  (torchtitan's recipe)
* ``zero2``          ``ZeroOptimizer(AdamW, stage=2)``, eager
* ``zero2-block``    each block compiled, then ``opt.attach(model)`` (no graph break)
* ``zero2-whole``    ``torch.compile(model)`` (graph breaks where gathered blocks are first read)
* ``zero3``          stage 3 + ``attach``, eager
* ``zero3-block``    each block compiled, then ``attach``: its hooks gather outside the graphs

Step time: forward + backward + ``step()`` + ``zero_grad()`` after warm-up (the warm-up compiles),
slowest rank, median over the timed steps. ``compile_s``: the warm-up's wall time minus the eager
configuration's (what compiling costs once). Graph breaks: dynamo's count in the warm-up.

Usage::

    python benchmarks/compile.py --quick                 # smoke run, tiny model, one round
    python benchmarks/compile.py --rounds 3 --json compile.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _gpt import GPT, GPT_7M, GPT_TINY, lm_loss, make_batch
from stage3 import _fully_shard
from step_time import LR, MB, WEIGHT_DECAY, Options, Variant, _join, _spread, leave, run_fresh

from zeroplan.facade import ZeroOptimizer


@dataclass(frozen=True)
class Config(Variant):
    """``kind``: ``ddp``, ``fsdp2`` or ``zero``; ``compile``: ``None``, ``"block"`` or ``"whole"``."""

    compile: str | None = None


CONFIGS = (
    Config("ddp", "ddp", note="DDP + AdamW(foreach), eager"),
    Config("ddp-whole", "ddp", compile="whole", note="compiled whole, then DDP"),
    Config("fsdp2", "fsdp2", note="fully_shard per block and the root, eager"),
    Config("fsdp2-block", "fsdp2", compile="block", note="blocks compiled, then fully_shard"),
    Config("zero2", "zero", stage=2, note="ZeroOptimizer stage 2, eager"),
    Config("zero2-block", "zero", stage=2, compile="block", note="blocks compiled, then attach"),
    Config("zero2-whole", "zero", stage=2, compile="whole", note="compiled whole"),
    Config("zero3", "zero", stage=3, note="stage 3 + attach, eager"),
    Config("zero3-block", "zero", stage=3, compile="block", note="blocks compiled, then attach"),
)


def _compile_blocks(model: GPT) -> None:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block)


class CompileRunner:
    """One configuration's model, optimizer and step on this rank."""

    def __init__(self, config: Config, opts: Options, world: int) -> None:
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(opts.seed)
        self.model = GPT(opts.model)
        self.zero: ZeroOptimizer | None = None
        hyper: dict[str, Any] = {"lr": LR, "weight_decay": WEIGHT_DECAY, "foreach": True}
        if config.compile == "block":
            _compile_blocks(self.model)
        if config.kind == "ddp":
            inner = torch.compile(self.model) if config.compile == "whole" else self.model
            self.module: torch.nn.Module = DistributedDataParallel(inner, bucket_cap_mb=opts.bucket_mb)
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.model.parameters(), **hyper)
        elif config.kind == "fsdp2":
            _fully_shard(self.model, world)
            self.module = self.model
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **hyper)
        else:
            self.zero = ZeroOptimizer(
                self.model.parameters(),
                torch.optim.AdamW,
                stage=config.stage,
                bucket_bytes=int(opts.bucket_mb * MB),
                **hyper,
            )
            self.zero.attach(self.model)  # after compiling the blocks: hooks outside their graphs
            self.module = torch.compile(self.model) if config.compile == "whole" else self.model
            self.optimizer = self.zero

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        lm_loss(self.module(tokens), targets).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def wait(self) -> None:
        if self.zero is not None:
            self.zero.wait_for_params()


def _measure(rank: int, world: int, opts: Options, config: Config) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    tokens, targets = make_batch(opts.model, opts.batch, rank)
    runner = CompileRunner(config, opts, world)
    start = time.perf_counter()
    for _ in range(opts.warmup):
        runner.step(tokens, targets)
    runner.wait()
    warmup_s = time.perf_counter() - start
    breaks = sum(counters["graph_break"].values())
    dist.barrier()
    marks = [time.perf_counter()]
    for _ in range(opts.steps):
        runner.step(tokens, targets)
        marks.append(time.perf_counter())
    runner.wait()
    marks[-1] = time.perf_counter()
    times = [b - a for a, b in itertools.pairwise(marks)]
    whole = runner.zero.gathered_params() if runner.zero is not None else contextlib.nullcontext()
    with whole, torch.no_grad():
        loss = lm_loss(runner.model(tokens), targets).detach().reshape(1)
    dist.all_reduce(loss)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"times": times, "warmup_s": warmup_s, "breaks": breaks})
    step_max = [max(ts) for ts in zip(*(g["times"] for g in gathered), strict=True)]
    return {
        "median_ms": 1e3 * statistics.median(step_max),
        "warmup_s": max(g["warmup_s"] for g in gathered),
        "breaks": gathered[0]["breaks"],
        "loss": float(loss) / world,
    }


def _worker(rank: int, world: int, port: int, opts: Options, config: Config, queue: Any) -> None:
    _join(rank, world, port, opts)
    try:
        result = _measure(rank, world, opts, config)
    except Exception as exc:
        result = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    if rank == 0:
        queue.put(result)
    leave()


def run_rounds(world: int, opts: Options, configs: tuple[Config, ...]) -> list[dict[str, Any]]:
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(opts.fresh_rounds):
        measured: dict[str, dict[str, Any]] = {}
        for j in range(len(configs)):
            config = configs[(r + j) % len(configs)]
            measured[config.name] = run_fresh(world, config, opts, _worker)
        rounds.append(measured)
        line = ", ".join(f"{n} {m.get('median_ms', float('nan')):.0f}" for n, m in measured.items())
        print(f"round {r + 1}: {line} ms", file=sys.stderr, flush=True)
    rows = []
    for config in configs:
        ok = [m for m in rounds if "failed" not in m[config.name]]
        row: dict[str, Any] = {"name": config.name, "note": config.note}
        if not ok:
            row["failed"] = rounds[0][config.name]["failed"]
            rows.append(row)
            continue
        eager = config.name.split("-")[0]
        row.update(
            median_ms=statistics.median(m[config.name]["median_ms"] for m in ok),
            to_ddp=_spread([m[config.name]["median_ms"] / m["ddp"]["median_ms"] for m in ok]),
            to_eager=_spread([m[config.name]["median_ms"] / m[eager]["median_ms"] for m in ok])
            if config.compile and all("failed" not in m[eager] for m in ok)
            else None,
            compile_s=statistics.median(m[config.name]["warmup_s"] - m[eager]["warmup_s"] for m in ok)
            if config.compile
            else None,
            breaks=ok[-1][config.name]["breaks"],
            loss=statistics.median(m[config.name]["loss"] for m in ok),
        )
        rows.append(row)
    return rows


def _cell(spread: dict[str, Any] | None) -> str:
    if spread is None:
        return "-"
    return f"{spread['median']:.2f} ({spread['min']:.2f}-{spread['max']:.2f})"


def markdown(rows: list[dict[str, Any]], opts: Options, world: int) -> str:
    lines = [
        f"world {world}, {sum(p.numel() for p in GPT(opts.model).parameters()):,} parameters, batch "
        f"{opts.batch}, {opts.steps} timed steps after {opts.warmup} warm-up, {opts.fresh_rounds} rounds",
        "",
        "| config | step ms | / DDP eager | / its eager | compile s | graph breaks | loss | |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['name']} | failed: {r['failed'][:60]} | | | | | | {r['note']} |")
            continue
        compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        lines.append(
            f"| {r['name']} | {r['median_ms']:.1f} | {_cell(r['to_ddp'])} | {_cell(r['to_eager'])} | "
            f"{compile_s} | {r['breaks']} | {r['loss']:.4f} | {r['note']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, one round, few steps")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated configuration names (ddp always runs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    configs = CONFIGS
    if args.only:  # with DDP and the eager configuration each compiled one is compared with
        names = set(args.only.split(","))
        wanted = {"ddp"} | names | {n.split("-")[0] for n in names}
        configs = tuple(c for c in CONFIGS if c.name in wanted)
    opts = Options(
        worlds=(args.world,),
        steps=3 if args.quick else args.steps,
        warmup=2 if args.quick else args.warmup,
        bucket_mb=1.0 if args.quick else 25.0,
        batch=args.batch,
        model=GPT_TINY if args.quick else GPT_7M,
        variants=configs,
        fresh_rounds=1 if args.quick else args.rounds,
    )
    rows = run_rounds(args.world, opts, configs)
    print(markdown(rows, opts, args.world))
    if args.json:
        with open(args.json, "w") as handle:
            document = {"world": args.world, "rows": rows, "options": repr(replace(opts, variants=()))}
            json.dump(document, handle)


if __name__ == "__main__":
    main()
