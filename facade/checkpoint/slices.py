"""The tensor-parallel slices and pipeline stages of one job load the same save, or none loads.

[Note: one save across slices]
Each tp slice and each pipeline stage keeps a checkpoint root of its own
(docs/parallel.md), and a save's agreements run over its data-parallel group
only: a job killed between one slice's commit and another's leaves the roots
at different ``latest`` snapshots. Loaded as they are, the model would be
stitched from two steps. So ``checkpoint.load`` ends with one more exchange
over the job (:func:`agree_across_slices`): every rank's verdict of its own
load, and the :class:`SaveIdentity` of the snapshot it read (its number: the
saves made into its root so far, equal across the roots of slices that save
together). The exchange runs over the tp group,
then over the pp group, and raises only after both, so every rank of the job
takes part in both whatever the others found and none waits in a collective
another left (a dp group's verdict is already the same on its ranks). If any
rank failed, or two slices read different saves, every rank raises before
anything is installed; the message names each slice's snapshot and the newest
snapshot number every root still holds, which loads by its directory. The
``extra`` saved with each snapshot is named in the message, not compared: a
slice may save its own (its RNG state). A reslicing load (every slice's root
given) checks the numbers on each rank before it reads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

from zeroplan.core import CheckpointError
from zeroplan.facade.checkpoint.names import snapshot_name
from zeroplan.facade.mechanisms.collectives import all_gather_objects

__all__ = ["SaveIdentity", "agree_across_slices", "identity_of"]


class SaveIdentity(NamedTuple):
    """What tells one save from another across the roots of one job's slices.

    Attributes:
        root: the checkpoint root this rank loaded from.
        snapshot: the name of the snapshot it read.
        number: that snapshot's number (saves made into the root so far).
        extra_text: the ``extra`` saved with it, shortened, for messages.
        held: the numbers of the snapshots its root holds.
    """

    root: str
    snapshot: str
    number: int
    extra_text: str
    held: tuple[int, ...]

    def same_save(self, other: SaveIdentity) -> bool:
        """Whether ``other`` names the same save: the same snapshot number."""
        return self.number == other.number


_Row = tuple[str, tuple[str, str] | None, SaveIdentity | None]  # (slice label, error, identity)

_DIFFERENT_SAVES = (
    "the slices of this job hold different saves: {listing}. A job stopped between one slice's commit and "
    "another's leaves this; loading them would assemble the model from different steps, so nothing was "
    "loaded. {remedy}"
)
_REMEDY_COMMON = (
    "Every root still holds snapshot number {number}: load it on every slice with "
    "checkpoint.load(opt, Path(root) / {name!r}) (a snapshot directory loads like a root), or start "
    "from scratch"
)
_REMEDY_NONE = (
    "No snapshot number is held by every root (save with keep=2 or more so they keep an earlier one); "
    "start from scratch, or load each root's snapshot of the same step by its directory"
)


def agree_across_slices(
    groups: Sequence[tuple[str, dist.ProcessGroup]],
    label: str,
    problem: Exception | None,
    identity: SaveIdentity | None,
) -> None:
    """Raise on every rank of the job unless every rank loaded and all read one save; collective.

    Args:
        groups: the groups joining this rank to the other tp slices and pipeline stages, in the
            order every rank uses (each rank of the job calls this with its own groups).
        label: this rank's slice, for messages ("tp slice 1", "pp stage 0, tp slice 1").
        problem: this rank's error of its own load (agreed over its dp group already), or ``None``.
        identity: the save this rank read (``None`` if it failed).

    Raises:
        ZeroplanError: ``problem`` on its own rank; on the others the first failing slice's error.
        CheckpointError: the slices read different saves ([Note: one save across slices]).
    """
    mine = None if problem is None else (type(problem).__name__, str(problem))
    rows: list[_Row] = [(label, mine, identity)]
    for _, group in groups:  # every rank enters every exchange; nothing raises in between
        gathered: list[list[_Row]] = all_gather_objects(rows, group)
        rows = _unique([row for part in gathered for row in part])
    if problem is not None:
        raise problem
    failed = next((row for row in rows if row[1] is not None), None)
    if failed is not None:
        name, message = failed[1] or ("", "")
        raise CheckpointError(f"{failed[0]} could not load its checkpoint: {name}: {message}")
    identities = [(row[0], row[2]) for row in rows if row[2] is not None]
    if identity is None or all(identity.same_save(other) for _, other in identities):
        return
    listing = "; ".join(
        f"{slice_label} has {ident.snapshot} of {ident.root!r} (extra {ident.extra_text})"
        for slice_label, ident in sorted(identities, key=lambda item: item[0])
    )
    common = set.intersection(*(set(ident.held) for _, ident in identities))
    if common:
        number = max(common)
        remedy = _REMEDY_COMMON.format(number=number, name=snapshot_name(number))
    else:
        remedy = _REMEDY_NONE
    raise CheckpointError(_DIFFERENT_SAVES.format(listing=listing, remedy=remedy))


def _unique(rows: list[_Row]) -> list[_Row]:
    """``rows`` without repeats of one slice (a dp group's ranks report the same), in first-seen order."""
    seen: dict[tuple[str, Any], _Row] = {}
    for row in rows:
        seen.setdefault((row[0], row[2]), row)
    return list(seen.values())


def identity_of(root: Path, snapshot: Path, number: int, extra: Any, held: tuple[int, ...]) -> SaveIdentity:
    """The :class:`SaveIdentity` of ``snapshot`` under ``root`` saved with encoded ``extra``."""
    text = json.dumps(extra, sort_keys=True, default=repr)
    short = text if len(text) <= 80 else text[:77] + "..."
    return SaveIdentity(
        root=str(root),
        snapshot=snapshot.name,
        number=number,
        extra_text=short,
        held=held,
    )
