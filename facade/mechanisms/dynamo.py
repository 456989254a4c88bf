"""Importing ``torch._dynamo`` without keeping the caller's stack alive.

[Note: importing torch._dynamo here]
torch imports ``torch._dynamo`` the first time any ``torch.optim`` optimizer
is built (and ``torch.compiler.disable``, which zeroplan's hooks use, imports it
too), and one of the modules it loads keeps the frame that called it in a
reference cycle (``torch.fx.wrap`` holds ``inspect.currentframe()`` in a local).
That frame's ``f_back`` chain reaches whatever stack was running: when that is
``ZeroOptimizer.__init__`` (or a user's function that first touched
``zeroplan.facade.ZeroOptimizer``), everything those frames hold, the first
``ZeroOptimizer`` and its process groups included, outlives its last
reference until the cycle collector runs, often not before the interpreter
finalizes. A gloo group freed then lets its worker thread take the GIL during
finalization, and the process aborts ("terminate called without an active
exception") after its work is done. So every zeroplan module that needs
``torch._dynamo`` calls :func:`import_dynamo` first: it imports it once, then
collects that garbage cycle at once.
"""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

_F = TypeVar("_F", bound=Callable[..., Any])

#: Why dynamo skips zeroplan's hooks: it says so in every graph break, and in the error of
#: ``fullgraph=True`` (see [Note: hooks under torch.compile]).
BETWEEN_GRAPHS = (
    "zeroplan runs this between compiled graphs: it starts or waits for a collective on parameters. "
    "fullgraph=True cannot hold it: compile each block, then call opt.attach(model) "
    "(zeroplan docs/compile.md)"
)

__all__ = ["BETWEEN_GRAPHS", "between_graphs", "compiled_blocks", "hook_between_graphs", "import_dynamo"]


def import_dynamo() -> None:
    """Import ``torch._dynamo`` if nothing has, then free the frames it keeps in a cycle."""
    if "torch._dynamo" in sys.modules:
        return
    importlib.import_module("torch._dynamo")
    gc.collect()


def compiled_blocks(model: torch.nn.Module) -> tuple[list[torch.nn.Module], set[int]]:
    """The modules of ``model`` compiled on their own (``torch.compile(block)``), the root excepted,
    and the ids of every module inside them (see [Note: hooks under torch.compile])."""
    import_dynamo()
    compiled = importlib.import_module("torch._dynamo.eval_frame").OptimizedModule
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if module is model or id(module) in inside or not isinstance(module, compiled):
            continue
        blocks.append(module)
        inside.update(id(m) for m in module.modules() if m is not module)
    return blocks, inside


def between_graphs(fn: _F) -> _F:
    """``fn``, run as it is under ``torch.compile`` ([Note: hooks under torch.compile]), with the reason."""
    import_dynamo()
    return importlib.import_module("torch").compiler.disable(fn, recursive=True, reason=BETWEEN_GRAPHS)


def hook_between_graphs(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` as a hook called hundreds of times a step: eager, it is called as it is; under dynamo's
    trace, through :func:`between_graphs` (its graph break, with the reason).

    ``torch.compiler.disable``'s wrapper costs microseconds per call even when nothing compiles (it
    swaps the frame evaluation callback around every call); a check of ``is_compiling`` costs a
    tenth of one. Dynamo traces this function and constant-folds the check, so a compiled model
    meets the disabled wrapper exactly where it met it before ([Note: hooks under torch.compile]).
    """
    disabled = between_graphs(fn)
    is_compiling = importlib.import_module("torch").compiler.is_compiling

    def hook(*args: Any) -> None:
        if is_compiling():
            return disabled(*args)
        return fn(*args)

    return hook
