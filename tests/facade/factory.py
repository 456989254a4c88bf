"""The optimizer under test, built in one place: ``make_optimizer`` and the inner optimizers' table.

Scenarios name the inner optimizer (``"adamw"``, ``"sgd"``, ``"adafactor"``) and
give only the settings they care about; everything else is a small bucket and
alignment so that a tiny model still spans several buckets and padded shards.
Scenarios that test argument validation call ``ZeroOptimizer`` directly.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from zeroplan.facade import ZeroOptimizer


class Inner(NamedTuple):
    """An inner optimizer class with the two sets of hyper-parameters the scenarios use."""

    cls: type[torch.optim.Optimizer]
    hyper: dict[str, Any]
    """With weight decay (and Nesterov): what the equivalence tests train with."""
    plain: dict[str, Any]
    """The learning rate (and SGD's momentum) only: checkpoints, re-planning, accounting."""


OPTIMIZERS = {
    "adamw": Inner(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, {"lr": 1e-2}),
    "sgd": Inner(
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        {"lr": 0.1, "momentum": 0.9},
    ),
    "adafactor": Inner(torch.optim.Adafactor, {"lr": 1e-2}, {"lr": 1e-2}),
}

_NAMED_HERE = {"stage", "shard_group_size", "bucket_bytes", "alignment"}
_SETTINGS = {
    name
    for name, p in inspect.signature(ZeroOptimizer.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in _NAMED_HERE
}


def make_optimizer(
    model_or_params: nn.Module | Iterable[Any],
    *,
    optimizer: str = "adamw",
    hyper: dict[str, Any] | None = None,
    stage: int = 2,
    shard: int | None = None,
    bucket_bytes: int = 2048,
    alignment: int = 16,
    **settings: Any,
) -> ZeroOptimizer:
    """A ``ZeroOptimizer`` over a model's parameters (or a parameter list or param groups).

    Args:
        model_or_params: a module (its ``parameters()``), or what ``ZeroOptimizer`` takes.
        optimizer: a key of ``OPTIMIZERS``: the inner optimizer class.
        hyper: every hyper-parameter of the inner optimizer (those left out take torch's
            defaults); ``None`` takes ``OPTIMIZERS[optimizer].hyper``.
        stage, bucket_bytes, alignment: as in ``ZeroOptimizer``; small test-sized defaults.
            ``zeroplan.core.DEFAULT_BUCKET_BYTES`` and ``DEFAULT_ALIGNMENT`` are the library's.
        shard: ``ZeroOptimizer``'s ``shard_group_size``.
        **settings: any other ``ZeroOptimizer`` setting (``strategy``, ``loss_scale``, ``scaler``,
            ``collectives``, ``overlap_grad_reduce``, ``max_inflight_buckets``, ...).

    Raises:
        TypeError: a keyword that is no ``ZeroOptimizer`` setting (hyper-parameters go in ``hyper``).
    """
    unknown = sorted(settings.keys() - _SETTINGS)
    if unknown:
        raise TypeError(
            f"make_optimizer does not take {unknown}: hyper-parameters go in hyper={{...}}, the shard "
            "group size is shard=, and other keywords must be ZeroOptimizer settings"
        )
    inner = OPTIMIZERS[optimizer]
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    return ZeroOptimizer(
        params,
        inner.cls,
        stage=stage,
        shard_group_size=shard,
        bucket_bytes=bucket_bytes,
        alignment=alignment,
        **settings,
        **(inner.hyper if hyper is None else hyper),
    )
