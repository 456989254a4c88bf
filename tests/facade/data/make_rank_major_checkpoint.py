"""Write the rank-major checkpoint fixtures of ``test_old_checkpoints.py`` (run once; keep the output).

See [Note: old checkpoint fixtures] in ``tests/facade/scenarios_old_checkpoints.py``. These
fixtures were written with the rank-major buffer layout (each shard rank's region contiguous in the
full buffer), at commit f060ace. Running this script after the layout changed would write checkpoints
of the *new* layout, which is not what the test is for: it refuses to overwrite existing fixtures, and
the test pins their sha256 digests. To capture another layout, add fixtures under new names.

For each fixture in ``FIXTURES``, two gloo processes (one thread each) train ``MixedMLP`` for three
steps with ``ZeroOptimizer(AdamW)`` and then write:

* ``data/<name>/``: ``checkpoint.save(opt, ...)`` (the ``writer.lock`` the save leaves is removed: it
  only names the process that wrote);
* ``data/<name>_expected.pt``: right after saving, the model's ``state_dict()``, the
  ``consolidated_state_dict()``, the loss scale and scaler state, and where they came from.

Usage: ``python tests/facade/data/make_rank_major_checkpoint.py [--only NAME]``
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/facade

import scenarios_old_checkpoints as old

from zeroplan.facade import checkpoint

REPO = Path(__file__).resolve().parents[3]


def _provenance() -> dict[str, str]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    return {
        "layout": "rank-major",
        "zeroplan_commit": git("rev-parse", "HEAD"),
        "uncommitted_changes": git("status", "--porcelain", "--untracked-files=no") or "none",
        "torch": str(torch.__version__),  # TorchVersion would not load with weights_only
        "world_size": str(old.SAVED_WORLD),
        "generator": "tests/facade/data/make_rank_major_checkpoint.py",
    }


def _clone(tree: object) -> object:
    """Compact copies: ``torch.save`` of a view would store its whole flat buffer."""
    if torch.is_tensor(tree):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_clone(v) for v in tree)
    return tree


def _write(rank: int, world: int, port: int, name: str, provenance: dict[str, str]) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        model = old.build(name, seed=0)
        opt = old.make_optimizer(model, name)
        for step in range(old.STEPS_BEFORE_SAVE):
            opt.backward(old.loss_of(model, step, rank))
            opt.step()
            if opt.last_step_skipped:
                raise RuntimeError(f"{name}: step {step} overflowed; the fixture should hold applied steps")
            opt.zero_grad()
        checkpoint.save(opt, old.DATA / name, extra=old.EXTRA)
        consolidated = opt.consolidated_state_dict(to_rank=0)
        if rank == 0:
            buckets = len(opt.plan.buckets.buckets)
            expected = {
                "params": _clone(model.state_dict()),
                "consolidated": _clone(consolidated),
                "loss_scale": opt.loss_scale,
                "scaler": None if opt.scaler_state is None else opt.scaler_state.as_dict(),
                "provenance": {**provenance, "buckets": str(buckets)},
            }
            torch.save(expected, old.DATA / f"{name}_expected.pt")
            torch.load(old.DATA / f"{name}_expected.pt", weights_only=True)  # plain data only
            print(f"{name}: {buckets} buckets, loss scale {opt.loss_scale}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(old.FIXTURES), help="write this fixture only")
    args = parser.parse_args()
    names = [args.only] if args.only else list(old.FIXTURES)
    existing = [p for n in names for p in (old.DATA / n, old.DATA / f"{n}_expected.pt") if p.exists()]
    if existing:
        sys.exit(
            "refusing to overwrite " + ", ".join(map(str, existing)) + ": these fixtures were captured "
            "with the rank-major layout and must not be regenerated (see the module docstring)"
        )
    provenance = _provenance()
    for name in names:
        world = old.SAVED_WORLD
        mp.spawn(_write, args=(world, _free_port(), name, provenance), nprocs=world, join=True)
        (old.DATA / name / "writer.lock").unlink()
        size = sum(p.stat().st_size for p in old.fixture_files(name))
        print(f"{name}: {size} bytes in {len(old.fixture_files(name))} files")


if __name__ == "__main__":
    main()
