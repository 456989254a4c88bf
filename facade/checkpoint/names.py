"""Every name in a checkpoint: the root's files, a snapshot's files, the tensors inside its files.

[Note: checkpoint names]
A name is spelled here once and only here; the writer, the reader and the
checks ask this module for it (see [Note: checkpoint layout] for what each
file holds and [Note: checkpoint root] for the root's rules)::

    <root>/latest, <root>/writer.lock
    <root>/snapshot-<8 digits>[.partial]/manifest.json, frozen.pt,
        shard-<shard rank:05d>.pt, experts-<domain>-<world rank:05d>.pt

Inside a shard or expert file, tensors are named ``region/<dtype>``,
``master/<dtype>`` and ``state/<leaf path>`` (see [Note: state codec]);
frozen parameters are ``param/<index>``. The names are the on-disk format:
changing one makes earlier checkpoints unreadable.
"""

from __future__ import annotations

import re

__all__ = [
    "FROZEN",
    "LATEST",
    "LOCK",
    "MANIFEST",
    "PARTIAL",
    "TRAINER_DIR",
    "expert_file",
    "master_tensor",
    "param_tensor",
    "partial_number",
    "region_tensor",
    "shard_file",
    "snapshot_name",
    "snapshot_number",
    "state_tensor",
]

#: The root's pointer to its committed snapshot.
LATEST = "latest"
#: The root's writer lock (see [Note: checkpoint root]).
LOCK = "writer.lock"
#: The suffix of a snapshot directory being written.
PARTIAL = ".partial"
#: A snapshot's manifest (see [Note: manifest integrity]).
MANIFEST = "manifest.json"
#: A snapshot's file of the data domain's frozen parameters, whole.
FROZEN = "frozen.pt"
#: The checkpoint root ``ZeroTrainer`` writes inside each of ``Trainer``'s ``checkpoint-N`` folders.
TRAINER_DIR = "zeroplan"

_SNAPSHOT = re.compile(r"snapshot-(\d+)")
_PARTIAL_SNAPSHOT = re.compile(r"snapshot-(\d+)\.partial")


def snapshot_name(number: int) -> str:
    """The directory name of committed snapshot ``number``.

    Example:
        >>> snapshot_name(7)
        'snapshot-00000007'
    """
    return f"snapshot-{number:08d}"


def snapshot_number(name: str) -> int | None:
    """The number of a committed snapshot's directory name, ``None`` for any other name.

    Example:
        >>> snapshot_number("snapshot-00000012"), snapshot_number("snapshot-backup")
        (12, None)
    """
    match = _SNAPSHOT.fullmatch(name)
    return None if match is None else int(match.group(1))


def partial_number(name: str) -> int | None:
    """The number of an interrupted snapshot's directory name, ``None`` for any other name.

    Example:
        >>> partial_number("snapshot-00000012.partial"), partial_number("snapshot-00000012")
        (12, None)
    """
    match = _PARTIAL_SNAPSHOT.fullmatch(name)
    return None if match is None else int(match.group(1))


def shard_file(shard_rank: int) -> str:
    """The data domain's file of shard ``shard_rank``.

    Example:
        >>> shard_file(3)
        'shard-00003.pt'
    """
    return f"shard-{shard_rank:05d}.pt"


def expert_file(domain: str, rank: int) -> str:
    """The file of ``rank`` (in the saving world) in expert domain ``domain``.

    Example:
        >>> expert_file("experts", 3)
        'experts-experts-00003.pt'
    """
    return f"experts-{domain}-{rank:05d}.pt"


def region_tensor(dtype: str) -> str:
    """A shard file's region of the parameters of dtype space ``dtype``."""
    return f"region/{dtype}"


def master_tensor(dtype: str) -> str:
    """A shard file's fp32 masters of dtype space ``dtype``."""
    return f"master/{dtype}"


def state_tensor(leaf: str) -> str:
    """A shard file's tensor of state leaf ``leaf`` (see [Note: state codec])."""
    return f"state/{leaf}"


def param_tensor(index: int) -> str:
    """Frozen parameter ``index``, whole (in ``frozen.pt`` or an expert group's first file)."""
    return f"param/{index}"
