"""Micro-batch gradients added as a binary tree, not folded into ``.grad`` (deterministic mode).

See [Note: deterministic mode] in ``zeroplan.core.deterministic``: each backward
pass of a step is a micro-batch; the gradient hook hands each parameter's
gradient of it here (``.grad`` is then cleared, so autograd never adds), and a
stack of partial sums per parameter keeps the roots of complete subtrees. At
the step's reduction :meth:`MicroBatchSums.root` finishes the tree. A
parameter that got no gradient in a micro-batch contributes ``+0`` there: a
missing partial sum joined to one that exists adds zero to it, so a run that
materialises those zeros (another rank, a staged bucket) gets the same bits.
"""

from __future__ import annotations

import torch

from zeroplan.core.deterministic import is_power_of_two, merges_after

__all__ = ["BackwardPasses", "MicroBatchSums"]


class _Node:
    """The sum of ``size`` consecutive micro-batches of one parameter (``grad`` ``None``: all zero)."""

    __slots__ = ("grad", "size")

    def __init__(self, size: int, grad: torch.Tensor | None) -> None:
        self.size = size
        self.grad = grad


def _join(left: _Node, right: _Node) -> _Node:
    """``left + right`` in place in the left sum's memory (the one a lone sum keeps: plus ``+0``)."""
    if left.grad is None and right.grad is None:
        return _Node(left.size + right.size, None)
    if left.grad is None:
        assert right.grad is not None
        return _Node(left.size + right.size, right.grad.add_(0))  # 0 + x: -0 becomes +0, as a real zero would
    if right.grad is not None:
        left.grad.add_(right.grad)
    else:
        left.grad.add_(0)
    return _Node(left.size + right.size, left.grad)


class BackwardPasses:
    """Counts a step's backward passes: the micro-batch a gradient belongs to."""

    def __init__(self) -> None:
        self.done = 0
        self._running = False

    def reset(self) -> None:
        """A new step: no pass yet."""
        self.done = 0
        self._running = False

    def current(self) -> int:
        """The index of the running pass (called from a gradient hook, inside backward)."""
        if not self._running:  # its first gradient: count the pass when autograd finishes it
            self._running = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        return self.done

    @property
    def count(self) -> int:
        """Passes of this step so far, a running one included."""
        return self.done + int(self._running)

    def _end(self) -> None:
        self._running = False
        self.done += 1


class MicroBatchSums:
    """Per parameter, the partial sums of its micro-batch gradients of this step."""

    def __init__(self) -> None:
        self._stacks: dict[int, list[_Node]] = {}
        self._leaves: dict[int, int] = {}

    def reset(self) -> None:
        """Forget this step's partial sums (after the reduction, or when a step is abandoned)."""
        self._stacks.clear()
        self._leaves.clear()

    @property
    def held(self) -> list[torch.Tensor]:
        """The partial sums held now (for the memory meter)."""
        return [node.grad for stack in self._stacks.values() for node in stack if node.grad is not None]

    def add(self, index: int, grad: torch.Tensor | None, micro_batch: int) -> None:
        """Parameter ``index``'s gradient of micro-batch ``micro_batch`` (kept: the caller clears ``.grad``).

        Micro-batches of one parameter come in increasing order; one skipped contributes ``+0``.
        """
        self._fill(index, micro_batch)
        self._push(index, _Node(1, grad))

    def root(self, index: int, micro_batches: int) -> torch.Tensor | None:
        """The tree sum of parameter ``index``'s gradients over ``micro_batches`` (``None``: none came).

        Raises:
            ValueError: ``micro_batches`` is not a power of two (the caller reports it on every rank).
        """
        if not is_power_of_two(micro_batches):
            raise ValueError(micro_batches)
        self._fill(index, micro_batches)
        stack = self._stacks.pop(index, [])
        self._leaves.pop(index, None)
        if not stack:
            return None
        assert len(stack) == 1 and stack[0].size == micro_batches
        return stack[0].grad

    def _fill(self, index: int, upto: int) -> None:
        """Push ``+0`` leaves (``None``) for the micro-batches before ``upto`` that gave no gradient."""
        for _ in range(self._leaves.get(index, 0), upto):
            self._push(index, _Node(1, None))

    def _push(self, index: int, node: _Node) -> None:
        leaf = self._leaves.get(index, 0)
        stack = self._stacks.setdefault(index, [])
        stack.append(node)
        for _ in range(merges_after(leaf)):
            right = stack.pop()
            stack.append(_join(stack.pop(), right))
        self._leaves[index] = leaf + 1
