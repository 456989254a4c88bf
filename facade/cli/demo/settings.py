"""Settings of ``zeroplan demo``, validated before any process starts (no torch import)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from zeroplan.core import ConfigError
from zeroplan.core.errors import check_config

__all__ = ["COLLECTIVES", "DTYPES", "MAX_WORLD", "DemoSettings", "make_settings"]

DTYPES = ("fp32", "bf16")
COLLECTIVES = ("auto", "min_bytes", "gloo")
MAX_WORLD = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoSettings:
    """Arguments of ``zeroplan demo``, validated on construction.

    Attributes:
        world: processes (data-parallel ranks).
        stage: 1, 2 or 3 (stage 3 shards the parameters too; the demo attaches the model).
        shard_size: ranks per shard group; default 2 when 2 divides ``world``, else ``world``.
        ranks_per_node: simulated ranks per node (``ZeroOptimizer(ranks_per_node=...)``);
            default: one node.
        steps: training steps.
        dtype: ``"fp32"`` or ``"bf16"`` parameters (bf16 keeps fp32 masters).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank).
        bucket_mb: gradient bucket cap in MiB.
        collectives: ZeroOptimizer's collective policy: ``"auto"`` (by backend),
            ``"min_bytes"`` (reduce-scatter, replica all-reduce, all-gather) or
            ``"gloo"`` (world all-reduce, broadcasts).
        batch_size: sequences per rank per step.
        lr: AdamW learning rate.
        reshard_after_forward: stage 3: free gathered parameters after the forward and gather
            them again in backward (``False``: keep them until their gradients arrived).

    Raises:
        ConfigError: a value is out of range; the message names the command-line flag.

    Example:
        >>> DemoSettings(world=6).shard_size, DemoSettings(world=3).shard_size
        (2, 3)
    """

    world: int = 4
    stage: int = 2
    shard_size: int | None = None
    ranks_per_node: int | None = None
    steps: int = 200
    dtype: str = "fp32"
    device: str = "cpu"
    bucket_mb: float = 0.25
    collectives: str = "auto"
    batch_size: int = 16
    lr: float = 1e-3
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        check_config(
            type(self.world) is int and 1 <= self.world <= MAX_WORLD,
            f"--world must be an integer from 1 to {MAX_WORLD}, got {self.world!r}",
        )
        check_config(
            type(self.stage) is int and self.stage in (1, 2, 3),
            f"--stage must be 1, 2 or 3, got {self.stage!r}",
        )
        check_config(
            type(self.reshard_after_forward) is bool,
            f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}",
        )
        check_config(
            self.reshard_after_forward or self.stage == 3,
            f"--no-reshard-after-forward applies to --stage 3 only, got --stage {self.stage}",
        )
        if self.shard_size is None:
            object.__setattr__(self, "shard_size", 2 if self.world % 2 == 0 else self.world)
        divisors = ", ".join(str(k) for k in range(1, self.world + 1) if self.world % k == 0)
        check_config(
            type(self.shard_size) is int and self.shard_size >= 1 and self.world % self.shard_size == 0,
            f"--shard-size must divide --world {self.world}, got {self.shard_size!r}; pick one of {divisors}",
        )
        check_config(
            self.ranks_per_node is None
            or (
                type(self.ranks_per_node) is int
                and self.ranks_per_node >= 1
                and self.world % self.ranks_per_node == 0
            ),
            f"--ranks-per-node must divide --world {self.world}, got {self.ranks_per_node!r}; "
            f"pick one of {divisors}",
        )
        check_config(
            type(self.steps) is int and self.steps >= 1,
            f"--steps must be an integer >= 1, got {self.steps!r}",
        )
        check_config(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_config(self.device in ("cpu", "cuda"), f"--device must be cpu or cuda, got {self.device!r}")
        check_config(
            isinstance(self.bucket_mb, (int, float)) and math.isfinite(self.bucket_mb) and self.bucket_mb > 0,
            f"--bucket-mb must be a finite number > 0, got {self.bucket_mb!r}",
        )
        check_config(
            self.collectives in COLLECTIVES,
            f"--collectives must be one of {', '.join(COLLECTIVES)}, got {self.collectives!r}",
        )
        check_config(
            type(self.batch_size) is int and self.batch_size >= 1,
            f"batch_size must be an integer >= 1, got {self.batch_size!r}",
        )
        check_config(
            isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0,
            f"lr must be a finite number > 0, got {self.lr!r}",
        )

    @property
    def bucket_bytes(self) -> int:
        """The bucket cap in bytes, as ``ZeroOptimizer`` takes it."""
        return max(1, int(self.bucket_mb * 2**20))


def make_settings(**kwargs: Any) -> DemoSettings:
    """``DemoSettings`` from keyword arguments, where ``None`` means the default.

    Raises:
        ConfigError: an unknown or invalid argument.
    """
    given = {key: value for key, value in kwargs.items() if value is not None}
    try:
        return DemoSettings(**given)
    except TypeError as exc:  # an unknown keyword
        raise ConfigError(str(exc)) from None
