"""``zeroplan export CKPT OUT`` and ``zeroplan inspect CKPT``: a checkpoint read offline.

Both run in one process without a process group or a model (see [Note: offline
export] in :mod:`zeroplan.facade.checkpoint.export`). A bad or partial
checkpoint, or an ``OUT`` that is not an empty directory, is one line on
stderr and exit code 2. Torch is imported when a command runs, not when the
parser is built.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from zeroplan.core import CheckpointError, IncompatiblePlanError, PlanInvariantError

#: Failures that mean the checkpoint cannot be read as saved (a disk problem, or a manifest sealed
#: again after an edit that contradicts itself), reported as one line like any other bad checkpoint.
_UNREADABLE = (OSError, PlanInvariantError, IncompatiblePlanError)

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``export`` and ``inspect`` subcommands to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser(
        "export",
        help="write a checkpoint's weights as model.safetensors (offline, one process)",
        description=(
            "Write the model weights of a zeroplan checkpoint (any world, stage, layout, shard or expert "
            "groups) into OUT, one tensor at a time: model.safetensors, or model-0000k-of-0000n.safetensors "
            "with model.safetensors.index.json above --max-shard-size. A ZeroTrainer checkpoint folder's "
            "config.json is copied too, so that OUT loads with from_pretrained. A tensor-parallel slice's "
            "root is refused (it holds the slice's local tensors): load every slice's root into the model "
            "without tensor parallelism, save it, and export that root."
        ),
    )
    p.add_argument(
        "checkpoint", metavar="CKPT", help="checkpoint root, snapshot or Trainer checkpoint-N folder"
    )
    p.add_argument("out", metavar="OUT", help="output directory (must not exist, or be empty)")
    p.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        default="safetensors",
        help="safetensors (default) or torch (pytorch_model.bin, a plain state_dict by torch.save)",
    )
    p.add_argument(
        "--dtype",
        choices=("param", "fp32"),
        default="param",
        help="param: the parameters' dtype (default); fp32: the fp32 masters",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest output file, Hugging Face's convention (5GB = 5e9 bytes, 2GiB; default 5GB)",
    )
    p.set_defaults(run=run_export)

    q = sub.add_parser(
        "inspect",
        help="show what a checkpoint holds and verify its integrity",
        description=(
            "Print what a zeroplan checkpoint holds (format, world, stage, shard size, parameters, bytes, "
            "optimizer, step) after verifying its seal and every checksum; no model needed."
        ),
    )
    q.add_argument(
        "checkpoint", metavar="CKPT", help="checkpoint root, snapshot or Trainer checkpoint-N folder"
    )
    q.add_argument("--json", action="store_true", help="print the description as JSON")
    q.set_defaults(run=run_inspect)


def _reading(action: str, checkpoint: str) -> str:
    return f"cannot {action} {checkpoint!r}"


def run_export(args: argparse.Namespace) -> int:
    """Execute ``zeroplan export``; returns the exit code."""
    from zeroplan.facade.checkpoint.export import export
    from zeroplan.facade.checkpoint.weight_files import Format, parse_size

    cap = parse_size(args.max_shard_size)
    started = time.perf_counter()
    try:
        result = export(
            args.checkpoint, args.out, fmt=Format(args.format), fp32=args.dtype == "fp32", max_shard_bytes=cap
        )
    except _UNREADABLE as exc:
        raise CheckpointError(f"{_reading('export', args.checkpoint)} into {args.out!r}: {exc}") from None
    seconds = time.perf_counter() - started
    print(
        f"wrote {result.tensors} tensors, {result.nbytes:,} bytes (largest {result.largest:,}) to "
        f"{args.out} in {seconds:.2f} s: {', '.join(result.files)}"
    )
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    """Execute ``zeroplan inspect``; returns the exit code."""
    from zeroplan.facade.checkpoint.export import Snapshot

    try:
        snapshot = Snapshot(args.checkpoint)
        snapshot.cross_check()
        verified = snapshot.verify()
        described = snapshot.describe()
    except _UNREADABLE as exc:
        raise CheckpointError(f"{_reading('read', args.checkpoint)}: {exc}") from None
    described["verified_bytes"] = verified
    if args.json:
        json.dump(described, sys.stdout, indent=2)
        print()
        return 0
    print(_text(described))
    return 0


def _params_line(summary: dict[str, Any]) -> str:
    dtypes = ", ".join(f"{n:,} {d.removeprefix('torch.')}" for d, n in summary["elements_by_dtype"].items())
    return (
        f"{summary['count']} ({summary['trainable']} trainable, {summary['frozen']} frozen), "
        f"{summary['elements']:,} elements ({dtypes or 'none'})"
    )


def _text(d: dict[str, Any]) -> str:
    """The description as aligned lines."""
    masters = ", ".join(x.removeprefix("torch.") for x in d["separate_master"])
    rows = [
        ("checkpoint", d["snapshot"]),
        ("format", d["format"]),
        ("saved by", f"world {d['world_size']}, shard size {d['shard_size']}, stage {d['stage']}"),
        ("layout", f"{d['layout']} (strategy {d['strategy']})"),
        ("optimizer", f"{d['optimizer']}, step {'-' if d['step'] is None else d['step']}"),
        ("parameters", _params_line(d["parameters"])),
        ("fp32 masters", f"separate for {masters}" if masters else "none apart from the parameters"),
    ]
    for domain in d["expert_domains"]:
        groups = len(domain["groups"])
        rows.append((f"experts {domain['name']}", f"{groups} groups: {_params_line(domain['parameters'])}"))
    rows += [
        ("bytes", f"{d['bytes']:,} on disk in {len(d['files'])} data files and the manifest"),
        ("extra", ", ".join(d["extra"]) or "-"),
        ("integrity", f"sealed ({d['digest'][:19]}…); {d['verified_bytes']:,} bytes checksum-verified"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
