"""Stage 3's module hooks: a forward gathers the blocks each module uses and frees them after.

:class:`ForwardHooks` registers hooks on the attached model ([Note: stage 3] in ``params.sharded``)
and keeps the forward pass's state: which modules ran and run, which blocks were visited (for the
prefetch) or pinned (used outside their modules), and the saved-tensor hooks in force while the
forward is open. It moves blocks only through its ``Blocks`` table (``BlockTable``; a trace's
``TracedBlocks``); whether a block may be freed now
(``gathered_params`` holds them) and what a new pass resets beyond the forward are its residency's
(``may_free``, ``begin_pass``).

[Note: hooks under torch.compile]
A model compiled whole (``torch.compile(model)``) or per block still runs
zeroplan's module hooks and its parameters' first-use waits (``on_use`` of the
``DeferredParameter`` classes), but never inside a graph: they are wrapped in
``torch.compiler.disable``, so dynamo calls them as they are, between graphs.
The module hooks, hundreds of calls a step, reach that wrapper only while dynamo
traces them (``hook_between_graphs``): eager, its cost per call would be
several times the hook's own.
Traced, they would put the blocks' state (a Python enum per block) in the
guards, and each step's new state would recompile them, up to dynamo's
recompile limit, orders of magnitude slower than eager (measured in
docs/compile.md). What
compiling costs instead is a graph break at each hook: per module with
parameters at stage 3, and at stages 1-2 at the first use of a parameter whose
gather overlaps the forward (the compile tests count them, and check that
nothing is compiled again after the second step).

Blocks compiled on their own, then attached (``torch.compile`` each block,
then ``opt.attach(model)``, torchtitan's order with FSDP2), break nothing:
``attach`` hooks each compiled block as one module, outside its graph, for
every parameter inside it (``compiled_blocks``): at stage 3 its pre-hook
gathers them all, at stages 1-2 it waits for their gathers, so the graph only
ever sees whole, plain parameters. A model compiled whole keeps its breaks on
purpose: they split its graph where gathered blocks are first read, and the
backward of each piece hands its gradients to the reduction hooks before the
next piece runs, which is what keeps reductions overlapped with backward (as
``DDPOptimizer`` splits DDP's graph at bucket boundaries). One graph would
reduce nothing until the whole backward ended. Each skipped hook carries its
reason (``dynamo.BETWEEN_GRAPHS``), so ``fullgraph=True`` on a whole model
fails with what to do instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from zeroplan.facade.mechanisms.dynamo import compiled_blocks, hook_between_graphs
from zeroplan.facade.params.blocks import BlockKey, Blocks

__all__ = ["ForwardHooks", "in_backward"]


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


class ForwardHooks:
    """The attached model's forward hooks over one ``Blocks`` table (see the module docstring)."""

    def __init__(
        self,
        blocks: Blocks,
        *,
        reshard_after_forward: bool,
        may_free: Callable[[], bool],
        begin_pass: Callable[[], None],
        saved_tensor_hooks: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        self._blocks = blocks
        self.reshard_after_forward = reshard_after_forward
        self._may_free = may_free
        self._begin_pass = begin_pass
        self._saved_tensor_hooks = saved_tensor_hooks
        self._modules: dict[int, list[BlockKey]] = {}  # id(module) -> blocks of its own parameters
        self._users: dict[BlockKey, set[int]] = {}  # block -> modules holding its parameters
        self._handles: list[Any] = []
        self._depth = 0
        self._opened_by: list[int] = []  # modules that opened a forward of their own (called directly)
        self._saved: contextlib.ExitStack | None = None
        self._reset()

    def _reset(self) -> None:
        self._done: set[int] = set()
        self._running: dict[int, int] = {}
        self._waiting = {key: len(users) for key, users in self._users.items()}  # users not done yet
        self._visited: set[BlockKey] = set()
        self._pinned: set[BlockKey] = set()

    # ------------------------------------------------------------------ attaching
    def attach(self, model: torch.nn.Module) -> None:
        """Hook ``model``'s modules; replaces an earlier attachment."""
        self.detach()
        # [Note: hooks under torch.compile]: dynamo runs zeroplan's hooks as they are, never traced.
        begin, end = hook_between_graphs(self._begin), hook_between_graphs(self._end)
        enter, exit_ = hook_between_graphs(self._enter), hook_between_graphs(self._exit)
        self._handles.append(model.register_forward_pre_hook(begin, prepend=True))
        blocks, inside = compiled_blocks(model)
        for module in model.modules():
            if id(module) in inside:
                continue  # a compiled block's hooks gather everything it holds, outside its graph
            recurse = any(module is b for b in blocks)
            keys = sorted(
                {k for p in module.parameters(recurse=recurse) if (k := self._blocks.key_of(p)) is not None}
            )
            if not keys:
                continue
            self._modules[id(module)] = keys
            for key in keys:
                self._users.setdefault(key, set()).add(id(module))
            self._handles.append(module.register_forward_pre_hook(enter))
            self._handles.append(module.register_forward_hook(exit_, always_call=True))
        self._handles.append(model.register_forward_hook(end, always_call=True))

    def detach(self) -> None:
        """Remove the hooks of :meth:`attach`."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._modules = {}
        self._users = {}

    @property
    def attached(self) -> bool:
        """Whether a model is attached."""
        return bool(self._handles)

    @property
    def in_forward(self) -> bool:
        """Whether the attached forward (or a module called on its own) is running."""
        return self._depth > 0

    def pin(self, key: BlockKey) -> None:
        """Keep block ``key`` gathered until the forward ends (a parameter used outside its modules)."""
        self._pinned.add(key)

    # ------------------------------------------------------------------ the hooks
    def _begin(self, module: torch.nn.Module, args: Any) -> None:
        if self._depth == 0:
            self._reset()
            self._begin_pass()
            stack = contextlib.ExitStack()
            stack.enter_context(self._saved_tensor_hooks())
            self._saved = stack
        self._depth += 1

    def _end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._depth == 0:  # a pre-hook before ours raised: this forward never began
            return
        self._depth -= 1
        if self._depth:
            return
        if self._saved is not None:
            self._saved.close()
            self._saved = None
        # A forward that recorded no graph (under no_grad or inference_mode: evaluation) has no backward
        # to keep its blocks for: they are freed, so that a write before the next pass (a
        # ``load_state_dict``) goes into the shards and masters rather than blocks the next step drops.
        keep = not self.reshard_after_forward and torch.is_grad_enabled()
        if not keep and self._may_free() and not in_backward():
            self._blocks.shard_all()
        self._pinned = set()

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if self._depth == 0 and not in_backward():  # a submodule called on its own
            self._begin(module, args)
            self._opened_by.append(id(module))
        mid = id(module)
        keys = self._modules.get(mid, ())
        if keys:
            visited, blocks = self._visited, self._blocks
            for key in keys:
                visited.add(key)
                blocks.ensure(key)
            blocks.prefetch(keys[-1], 1, visited)
        self._running[mid] = self._running.get(mid, 0) + 1

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        mid = id(module)
        running = self._running[mid] = self._running.get(mid, 1) - 1
        keys = self._modules.get(mid, ())
        if mid not in self._done:
            self._done.add(mid)
            for key in keys:  # its first run in this forward: one user fewer to wait for
                self._waiting[key] = self._waiting.get(key, 1) - 1
        # In backward (activation checkpointing recomputes forwards) blocks wait for their gradients.
        if keys and self.reshard_after_forward and self._may_free() and not in_backward():
            self._free_finished(keys)
        if self._opened_by and self._opened_by[-1] == mid and running == 0:
            self._opened_by.pop()
            self._end(module, args, output)

    def _free_finished(self, keys: list[BlockKey]) -> None:
        """Free the blocks ``keys`` whose every module has run (and none runs now)."""
        for key in keys:
            if (
                self._waiting.get(key, 0) <= 0
                and key not in self._pinned
                and not any(self._running.get(u) for u in self._users.get(key, ()))
            ):
                self._blocks.free(key)
