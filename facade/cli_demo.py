"""``zeroplan demo``: train a small GPT with ZeroOptimizer and with torch.optim.AdamW, and compare.

The work is in :mod:`zeroplan.facade.demo`; this module only declares the
arguments. Bad arguments raise ``ConfigError`` before any process starts.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register", "run"]


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser(
        "demo",
        help="train a small GPT sharded and unsharded, and compare",
        description=(
            "Start WORLD processes, train a small GPT on a sorting task with ZeroOptimizer(AdamW) and, "
            "in rank 0, the same model with torch.optim.AdamW on the same batches; print loss, "
            "parameter difference, step time, and memory and traffic per rank measured vs planned. "
            "Exit code 1 if the runs disagree or a measurement differs from the plan."
        ),
    )
    p.add_argument("--world", type=int, default=4, help="processes (default 4)")
    p.add_argument("--stage", type=int, default=2, help="1 or 2 (default 2)")
    p.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help="ranks per shard group (default 2 if it divides the world)",
    )
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="parameter dtype (default fp32)")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: NCCL, 1 GPU per rank"
    )
    p.add_argument("--bucket-mb", type=float, default=0.25, help="gradient bucket cap in MiB (default 0.25)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Execute ``zeroplan demo`` with parsed ``args``; returns the exit code."""
    from zeroplan.facade.demo_settings import make_settings

    settings = make_settings(
        world=args.world,
        stage=args.stage,
        shard_size=args.shard_size,
        steps=args.steps,
        dtype=args.dtype,
        device=args.device,
        bucket_mb=args.bucket_mb,
    )
    from zeroplan.facade import demo  # imports torch: only once the arguments are known to be good

    return demo.run(settings)
