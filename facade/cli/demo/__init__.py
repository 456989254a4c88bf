"""``zeroplan demo``: train a small GPT with ZeroOptimizer and with torch.optim.AdamW, and compare.

This module only declares the arguments; the work is in
:mod:`~zeroplan.facade.cli.demo.supervisor` (the processes),
:mod:`~zeroplan.facade.cli.demo.train` (each rank) and
:mod:`~zeroplan.facade.cli.demo.report` (the tables). Bad arguments raise
``ConfigError`` before any process starts (and before torch is imported).
"""

from __future__ import annotations

import argparse
from typing import Any

from zeroplan.facade.cli.demo.settings import COLLECTIVES, DTYPES, DemoSettings, make_settings

__all__ = ["register", "run"]


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand to ``sub`` (an argparse subparsers object)."""
    d = DemoSettings()
    p = sub.add_parser(
        "demo",
        help="train a small GPT sharded and unsharded, and compare",
        description=(
            "Start WORLD processes, train a small GPT on a sorting task with ZeroOptimizer(AdamW) and, "
            "in rank 0, the same model with torch.optim.AdamW on the same batches; print the losses, "
            "the parameter difference, step times, and memory and traffic per rank measured vs "
            "planned. At stage 3 parameters are sharded between steps: the model is attached and read "
            "only inside gathered_params(). Exit code 1 if the runs disagree or a measurement differs "
            "from the plan."
        ),
    )
    p.add_argument("--world", type=int, help=f"processes (default {d.world})")
    p.add_argument("--stage", type=int, help=f"ZeRO stage, 1, 2 or 3 (default {d.stage})")
    p.add_argument("--shard-size", type=int, help="ranks per shard group (default 2 if it divides the world)")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        help="simulated ranks per node (default: one node); shard groups spanning whole nodes gather "
        "parameters in two hops, across nodes then inside each",
    )
    p.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        help="stage 3: free gathered parameters after the forward and gather them again in backward "
        "(default); --no-reshard-after-forward keeps them until their gradients arrived",
    )
    p.add_argument("--steps", type=int, help=f"training steps (default {d.steps})")
    p.add_argument("--dtype", choices=DTYPES, help=f"parameter dtype (default {d.dtype})")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), help="cpu: gloo (default); cuda: NCCL, one GPU per rank"
    )
    p.add_argument("--bucket-mb", type=float, help=f"gradient bucket cap in MiB (default {d.bucket_mb})")
    p.add_argument(
        "--collectives",
        choices=COLLECTIVES,
        help="auto (default: gloo on cpu, min_bytes on cuda), min_bytes (reduce-scatter, replica all-reduce, "
        "all-gather) or gloo (world all-reduce, broadcasts)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Execute ``zeroplan demo`` with parsed ``args``; returns the exit code."""
    settings = make_settings(
        world=args.world,
        stage=args.stage,
        shard_size=args.shard_size,
        ranks_per_node=args.ranks_per_node,
        steps=args.steps,
        dtype=args.dtype,
        device=args.device,
        bucket_mb=args.bucket_mb,
        collectives=args.collectives,
        reshard_after_forward=args.reshard_after_forward,
    )
    from zeroplan.facade.cli.demo import supervisor  # after the arguments are known to be good

    return supervisor.run(settings)
