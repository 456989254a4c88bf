"""Where the parameters' values live: one protocol, two implementations, chosen once per plan.

[Note: residency]
A domain's parameters are either *replicated* (stages 1 and 2: every rank
holds them whole, views of the flat buffer, gathered after each step and
overlapped with the next forward: :class:`~zeroplan.facade.params.gather.ParamGather`)
or *sharded* (stage 3: each rank holds its shard, blocks are gathered around
the modules that use them: :class:`~zeroplan.facade.params.sharded.ShardedParams`).
:func:`~zeroplan.facade.runtime.installed.install` picks one when it installs a
plan, and everything else speaks to it through :class:`Residency`: the step
(``start_param_sync``/``finish_param_sync``, ``keep_param_writes``), the
installation's life (``settle``, ``prepare_replan``, ``retire``), the user's
reads (``gathered``) and checks (``detached``). Nothing outside the factory
asks which one it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from zeroplan.facade.mechanisms.collectives import CommLog

__all__ = ["Residency"]


class Residency(Protocol):
    """What a domain asks of its parameters' residency ([Note: residency])."""

    def start_param_sync(self, log: CommLog, *, published: bool = False) -> None:
        """After the inner step: publish this rank's updated shard (gathers may stay in flight);
        ``published``: the step already wrote it into the parameters (a host step)."""

    def start_released(self, bucket: int, log: CommLog) -> None:
        """A host step stepped every unit up to bucket ``bucket``'s: start what that completes."""

    def finish_param_sync(self) -> None:
        """Complete what ``start_param_sync`` left in flight."""

    def keep_param_writes(self) -> None:
        """Before a step: keep what the user wrote into the parameters since the last one."""

    def forget(self) -> None:
        """Drop what is in flight without waiting (the process group is gone)."""

    def settle(self, model: torch.nn.Module | None) -> None:
        """Right after installation: take the resting state, hooked to ``model`` if one is attached."""

    def attach(self, model: torch.nn.Module) -> None:
        """Hook ``model`` so that its forward finds the parameters it uses."""

    def prepare_replan(self) -> None:
        """Before another plan is installed: make every parameter hold its whole value."""

    def retire(self) -> None:
        """After another plan was installed: let go of the parameters and of the model's hooks."""

    def gathered(self, *, writeback: bool) -> contextlib.AbstractContextManager[None]:
        """Whole parameter values inside; with ``writeback``, what was written inside is kept."""

    def detached(self, params: Sequence[torch.Tensor], links: Sequence[tuple[int, int]]) -> int | None:
        """The first trainable parameter whose values no longer live where this residency put them."""
