"""Calibration: the temporaries each ``torch.optim`` step allocates, measured, against zeroplan's model.

Not a test (``tests/facade/test_inner_temporaries.py`` is): run it and read the table::

    python benchmarks/optimizer_temporaries.py               # every optimizer, implementation, variant
    python benchmarks/optimizer_temporaries.py --only AdamW Rprop

For every optimizer of ``zeroplan.core.known_optimizers()`` that ``torch.optim`` has, every
implementation torch runs on CPU (for-loop, ``foreach=True``, ``fused=True`` where the class takes
it) and every hyper-parameter variant that changes what the step allocates, it

1. measures the step's temporaries: parameters and gradients are created, ``--warmup`` steps are
   taken (so that the state exists and every optimizer is in its steady state: RAdam's rectified
   update starts at step 6 with the default betas), then one ``step()`` runs inside
   ``torch.distributed._tools.mem_tracker.MemTracker``. The parameters, gradients and optimizer
   state are registered first (``track_external``): MemTracker counts every tensor an operator
   *returns*, so without them ``param.add_(...)`` (which returns ``param``) would count the
   parameter as a new allocation. The temporaries are the tracker's peak minus its total on entry.
2. fits ``a * sum(numel) + b * max(numel) + carried * previous numel + c`` (``a``, ``b``,
   ``carried``: elements of the parameters' dtype, plus bytes where a term does not scale with the
   dtype, e.g. bool masks; ``c``: bytes of scalars) from 1-d probes in float32 and float64. The
   for-loop also holds some temporaries of the previous tensor while stepping the next one
   (``carried``), so its peak depends on the order of the tensors.
3. checks, on two sets of shapes, the measurement against the fit and against zeroplan's model
   (``describe_optimizer(..., device="cpu")``). ``fit`` and ``model`` columns show the difference
   in bytes (``=``: exact).

Adafactor and Muon depend on shapes: their fit uses 1-d probes (Adafactor's unfactored path) and
(32, n/32) matrices (Muon: its 32 x 32 Gram matrices then land in ``c``); zeroplan models rows, columns
and Gram matrices, see [Note: step temporaries] in ``zeroplan.core.optim.temporaries``.
"""

from __future__ import annotations

import argparse
import inspect
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zeroplan.core import describe_optimizer, known_optimizers
from zeroplan.facade.diagnostics.meter import step_temporaries

#: Hyper-parameter variants that change the step's temporaries (the others only change numbers).
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "SGD": [
        {},
        {"momentum": 0.9},
        {"momentum": 0.9, "nesterov": True},
        {"weight_decay": 0.1},
        {"maximize": True},
        {"momentum": 0.9, "maximize": True},
        {"weight_decay": 0.1, "maximize": True},
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "maximize": True},
    ],
    "Adam": [
        {},
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
        {"amsgrad": True},
        {"maximize": True},
        {"weight_decay": 0.1, "amsgrad": True, "maximize": True},
    ],
    "AdamW": [{}, {"amsgrad": True}, {"maximize": True}],
    "RMSprop": [
        {},
        {"momentum": 0.9, "centered": True},
        {"weight_decay": 0.1},
        {"maximize": True},
        {"weight_decay": 0.1, "maximize": True, "momentum": 0.9, "centered": True},
    ],
    "Adagrad": [{}, {"weight_decay": 0.1}, {"maximize": True}, {"weight_decay": 0.1, "maximize": True}],
    "Adamax": [{}, {"weight_decay": 0.1}, {"maximize": True}],
    "NAdam": [
        {},
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
        {"maximize": True},
    ],
    "RAdam": [
        {},
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
        {"maximize": True},
    ],
    "Adadelta": [{}, {"weight_decay": 0.1}, {"maximize": True}, {"weight_decay": 0.1, "maximize": True}],
    "Rprop": [{}, {"maximize": True}],
    # t0=0: the averaging branch (after t0 steps, 1e6 by default), the largest step of a run.
    "ASGD": [{"t0": 0.0}, {"t0": 0.0, "weight_decay": 0.1}, {"t0": 0.0, "maximize": True}, {}],
    "Adafactor": [{}, {"maximize": True}, {"weight_decay": 0.1}],
    "Muon": [{}, {"nesterov": False}, {"ns_steps": 0}],
}

#: Implementations as torch spells them.
IMPLEMENTATIONS = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}

#: The shape sets each case is checked on (Muon takes matrices only).
SHAPES = [(64, 48), (33,), (128, 16), (7, 5)]
SHAPES_CHECK = [(17, 257), (100,), (31, 3), (40, 40), (5,)]


def supported(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> bool:
    """Whether torch builds and steps ``cls(**kwargs)`` on CPU."""
    param = torch.zeros(4, 4, requires_grad=True)
    try:
        opt = cls([param], **kwargs)
        param.grad = torch.ones(4, 4)
        opt.step()
    except (TypeError, RuntimeError, ValueError):
        return False
    return True


Coefficients = tuple[int, int, int, int, int]  # a, b, carried, c, carried_c


def fit(run: Callable[[list[int]], int], n: int) -> Coefficients:
    """``a, b, carried, c, c_carried`` (bytes per element, bytes) from probes of 1, 2 and 3 tensors."""
    one, two = run([n]), run([2 * n])
    ab = (two - one) // n
    c = one - ab * n
    pair, triple = run([n, n]), run([n, n, n])
    a = (triple - pair) // n
    b = ab - a
    held_1 = pair - 2 * a * n - c - b * n
    held_2 = run([2 * n, 2 * n]) - 4 * a * n - c - 2 * b * n
    carried = (held_2 - held_1) // n
    return a, b, carried, c, held_1 - carried * n


def predict(coefficients: Coefficients, numels: Sequence[int]) -> int:
    a, b, carried, c, c_carried = coefficients
    return (
        a * sum(numels)
        + c
        + max(b * n + (carried * numels[i - 1] + c_carried if i else 0) for i, n in enumerate(numels))
    )


def per_dtype(v32: int, v64: int) -> str:
    """``v32`` (bytes at itemsize 4) and ``v64`` (at 8) as ``items + bytes``."""
    items = (v64 - v32) // 4
    rest = v32 - 4 * items
    if not items and not rest:
        return "0"
    return " + ".join(part for part in (f"{items}" if items else "", f"{rest}B" if rest else "") if part)


def difference(measured: int, predicted: int) -> str:
    return "=" if measured == predicted else f"{predicted - measured:+d}"


def main(argv: Sequence[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="*", help="optimizer names")
    parser.add_argument("--warmup", type=int, default=6, help="steps before the measured one")
    parser.add_argument("--probe", type=int, default=256, help="numel of the fitting probes")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")  # MemTracker's and Muon's user warnings
    torch.manual_seed(0)

    table = Table(title=f"optimizer step temporaries, torch {torch.__version__}, CPU (bytes)")
    for column in (
        "optimizer",
        "impl",
        "variant",
        "a (Σn)",
        "b (max n)",
        "carried",
        "c",
        "set 1",
        "fit",
        "model",
    ):
        table.add_column(column, justify="left" if column in ("optimizer", "impl", "variant") else "right")
    table.add_column("set 2", justify="right")
    table.add_column("fit", justify="right")
    table.add_column("model", justify="right")
    started = time.perf_counter()
    for name in known_optimizers():
        cls = getattr(torch.optim, name, None)
        if cls is None or (args.only and name not in args.only):
            continue
        matrices = name == "Muon"
        probe = (lambda n: (32, n // 32)) if matrices else (lambda n: (n,))
        sets = [
            [s for s in shapes if len(s) == 2] if matrices else shapes for shapes in (SHAPES, SHAPES_CHECK)
        ]
        for impl, flags in IMPLEMENTATIONS.items():
            if "foreach" not in inspect.signature(cls).parameters:  # Muon: the for-loop only
                flags = {} if impl == "for_loop" else flags
            for variant in VARIANTS[name]:
                kwargs = {**variant, **flags}
                if not supported(cls, kwargs):
                    continue
                fits = []
                for dtype in (torch.float32, torch.float64):

                    def run(numels, dtype=dtype, cls=cls, kwargs=kwargs, probe=probe):
                        shapes = [probe(n) for n in numels]
                        return step_temporaries(cls, kwargs, shapes, dtype=dtype, warmup=args.warmup)

                    fits.append(fit(run, 4 * args.probe if matrices else args.probe))
                coefficients = [per_dtype(v32, v64) for v32, v64 in zip(*fits, strict=True)]
                carried = coefficients[2] + (f" (+{coefficients[4]})" if coefficients[4] != "0" else "")
                spec = describe_optimizer(name, kwargs, device="cpu")
                row = [name, impl, ", ".join(f"{k}={v}" for k, v in variant.items()) or "-"]
                row += [coefficients[0], coefficients[1], carried, coefficients[3]]
                for shapes in sets:
                    measured = step_temporaries(cls, kwargs, shapes, warmup=args.warmup)
                    numels = [math.prod(s) for s in shapes]
                    row += [
                        str(measured),
                        difference(measured, predict(fits[0], numels)),
                        difference(measured, spec.step_temporary_bytes_of_shapes(shapes, 4)),
                    ]
                table.add_row(*row)
    Console(width=max(Console().width, 180)).print(table)
    elapsed = time.perf_counter() - started
    print(f"{elapsed:.0f} s; shapes: set 1 {SHAPES}, set 2 {SHAPES_CHECK} (Muon: matrices only)")


if __name__ == "__main__":
    main()
