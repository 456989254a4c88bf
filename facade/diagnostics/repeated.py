"""A model's repeated blocks: found, cut short for a trace ([Note: repeated blocks traced once]).

The blocks are the children of one ``nn.ModuleList`` (a transformer's layers) of one class, with the
same parameters and buffers (names, shapes, dtypes, trainability) and the same submodules; the model
cut to ``k`` of them holds the first ``k`` in a new list in its place for a while, the rest of it
unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

__all__ = ["RepeatedBlocks", "repeated_blocks", "split_name"]


class RepeatedBlocks(NamedTuple):
    """The repeated blocks of a model: their list's name (``model.layers``) and how many."""

    prefix: str
    count: int

    @contextlib.contextmanager
    def cut_to(self, model: torch.nn.Module, k: int) -> Iterator[torch.nn.Module]:
        """Inside, ``model`` holds its first ``k`` blocks only (the same modules); then all again."""
        parent_name, _, attr = self.prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        blocks = getattr(parent, attr)
        if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) != self.count:
            raise TypeError(f"{self.prefix!r} of the model is not a ModuleList of {self.count}")
        setattr(parent, attr, torch.nn.ModuleList(list(blocks)[:k]))
        try:
            yield model
        finally:
            setattr(parent, attr, blocks)


def _signature(module: torch.nn.Module) -> tuple:
    return (
        type(module),
        tuple((n, type(m)) for n, m in module.named_modules()),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()),
    )


def repeated_blocks(model: torch.nn.Module, *, least: int) -> RepeatedBlocks | None:
    """The model's longest ``ModuleList`` of at least ``least`` blocks alike (the one holding the most
    parameters among equals), or ``None``. A block's parameters must be its own (none shared)."""
    shared = _shared_parameters(model)
    best: tuple[int, int, str] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < least or not name:
            continue
        first = _signature(module[0])
        if any(_signature(block) != first for block in module[1:]):
            continue
        if any(id(p) in shared for p in module.parameters()):
            continue
        numel = sum(p.numel() for p in module.parameters())
        if best is None or (len(module), numel) > best[:2]:
            best = (len(module), numel, name)
    return None if best is None else RepeatedBlocks(best[2], best[0])


def _shared_parameters(model: torch.nn.Module) -> set[int]:
    """Parameters reachable under two names (tied weights)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def split_name(prefix: str, name: str) -> tuple[int, str]:
    """``(block, rest)`` of a module's or parameter's name under ``prefix.<block>``; ``(-1, name)``
    outside the blocks (or without a ``prefix``).

    >>> split_name("model.layers", "model.layers.12.mlp.up_proj.weight")
    (12, '.mlp.up_proj.weight')
    >>> split_name("model.layers", "model.norm")
    (-1, 'model.norm')
    """
    if not prefix or not name.startswith(prefix + "."):
        return -1, name
    index, dot, rest = name[len(prefix) + 1 :].partition(".")
    if not index.isdigit():
        return -1, name
    return int(index), dot + rest
