"""The trace's meter: torch's ``MemTracker``, its peaks kept per stretch between two trace points.

[Note: the trace's meter]
``MemTracker`` updates, after every operator, the peak of every module it has
seen whose name is among the running modules: a loop over all the modules
seen so far, per operator, so a trace's cost grew with the square of the
model's depth (most of a Llama-7B trace's time: docs/benchmarks.md). :class:`StretchTracker` does the same
updates over the running modules alone (an index by name, rebuilt when a
module is first seen), with the same snapshots and the same order of
updates. It also keeps, for the stretch of the pass since the last trace
point, the meter's most (its ``"Total"`` on the traced device), the activation
bytes when the stretch first got there, and the modules whose peak snapshots
then hold that total (with the pass they belong to): what ``_finish`` reads
off the tracker after the pass, per stretch, so that a timeline replicated
from short traces ([Note: repeated blocks traced once] in
``zeroplan.core.sizing.repeat``) has the same peak, peak phase and peak module
as the full trace. The stretches add no arithmetic: they are readings.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModMemStats, _ModState, _State

__all__ = ["Stretch", "StretchTracker"]

#: The pass of a module's peak snapshots.
_PASSES = {_ModState.PEAK_FW: "forward", _ModState.PEAK_BW: "backward"}


class Stretch:
    """The meter's most over one stretch of the pass, as :class:`StretchTracker` read it."""

    __slots__ = ("activations", "modules", "total")

    def __init__(self, total: int, activations: int) -> None:
        self.total = total
        self.activations = activations
        self.modules: set[tuple[str, str]] = set()  # (module fqn, pass) with a peak snapshot of ``total``


class StretchTracker(MemTracker):
    """``MemTracker`` with its peaks updated over the running modules alone, and per stretch (see
    [Note: the trace's meter]).

    Args:
        device: the device whose figures the stretches read.
        activations: the activation bytes of one device's snapshot (the trace's reading).
    """

    def __init__(self, device: torch.device, activations: Callable[[dict[Any, int]], int]) -> None:
        super().__init__()
        self._device = device
        self._activations = activations
        self._by_fqn: dict[str, list[_ModMemStats]] = {}
        self._indexed = -1
        self.stretch: Stretch | None = None  # the open stretch (while entered)

    def _reindex(self) -> None:
        by_fqn: dict[str, list[_ModMemStats]] = {}
        for stats in self.memory_tracking.values():
            by_fqn.setdefault(stats.mod_fqn, []).append(stats)
        self._by_fqn, self._indexed = by_fqn, len(self.memory_tracking)

    def _running(self) -> list[_ModMemStats]:
        """The modules seen so far whose names are running (each updates its own peak: any order)."""
        if self._indexed != len(self.memory_tracking):
            self._reindex()
        by_fqn = self._by_fqn
        return [s for fqn in self._mod_tracker.parents for s in by_fqn.get(fqn, ()) if s.mod_fqn == fqn]

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        known = self.memory_tracking.get(module)
        before = None if known is None else known.mod_fqn
        snapshot = known is None or not self._mod_tracker.is_bw  # else a recomputation: no new snapshot
        super()._pre_fw_hook(module, inputs)
        if known is None or self.memory_tracking[module].mod_fqn != before:
            self._indexed = -1  # a module seen first, or under a new name
        if snapshot:
            self._entered(module, _ModState.PEAK_FW)

    def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        super()._pre_bw_hook(module, args)
        if module is not None:
            self._entered(module, _ModState.PEAK_BW)

    def _entered(self, module: torch.nn.Module, state: _State) -> None:
        """A module's entry snapshot holds the total now: a peak snapshot of the stretch's most?"""
        stats = self.memory_tracking.get(module)
        stretch = self.stretch
        if stats is None or stretch is None or not stats.snapshots.get(state):
            return
        if stats.snapshots[state][-1].get(self._device, {}).get(_TOTAL_KEY, 0) == stretch.total:
            stretch.modules.add((stats.mod_fqn, _PASSES[state]))

    def _update_peak_stats(self, peak_state: _State) -> None:
        # MemTracker's own updates, over the running modules only (the others are skipped there).
        curr_snap = self._curr_mem_snap
        running = self._running()
        for mod_stats in running:
            if peak_state in mod_stats.snapshots:
                for dev, dev_snap in curr_snap.items():
                    if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                        mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                        mod_stats.snapshots[peak_state][-1][dev] = deepcopy(dev_snap)
        for dev, dev_snap in curr_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(dev_snap)
        stretch = self.stretch
        if stretch is None:
            return
        snap = curr_snap.get(self._device, {})
        total = snap.get(_TOTAL_KEY, 0)
        if total > stretch.total:
            stretch.total, stretch.activations = total, self._activations(snap)
            stretch.modules = set()
        if total == stretch.total:
            state = _PASSES[peak_state]
            stretch.modules.update((s.mod_fqn, state) for s in running if peak_state in s.snapshots)

    def cut(self) -> Stretch:
        """Close the open stretch (at a trace point) and open the next; the closed one."""
        closed = self.stretch
        snap = self.get_tracker_snapshot("current").get(self._device, {})
        self.stretch = Stretch(snap.get(_TOTAL_KEY, 0), self._activations(snap))
        if closed is None:
            raise RuntimeError("StretchTracker.cut outside its context")
        return closed

    def __enter__(self) -> StretchTracker:
        super().__enter__()
        snap = self.get_tracker_snapshot("current").get(self._device, {})
        self.stretch = Stretch(snap.get(_TOTAL_KEY, 0), self._activations(snap))
        return self
