"""The checkpoint root directory: snapshot names, the ``latest`` pointer and its one writer.

[Note: checkpoint root]
A checkpoint root holds committed snapshots ``snapshot-<digits>``, at most a
few interrupted ones ``snapshot-<digits>.partial``, the ``latest`` file and
``writer.lock``. Anything else (``snapshot-backup``, a copy named
``snapshot-00000003.old``) is not ours: it is never read, counted or deleted.

* Names are numbers: the next snapshot is one more than the largest number
  in use (committed or partial), and "newest" means the largest number, so
  ``snapshot-1000000000`` comes after ``snapshot-999999999``.
* ``latest`` holds exactly the name of a snapshot of its own directory; a
  path, ``..`` or a link out of the root is refused (:func:`resolve`), never
  followed. The snapshot ``latest`` names is never deleted.
* One writer per root. Rank 0 of a saving job takes ``writer.lock`` at its
  first save (:func:`claim`) and holds it until its process exits: an
  exclusive ``flock`` that the kernel releases when the holder dies, so a
  restarted job takes over at once while a second live job pointed at the
  same root is refused (``CheckpointError`` naming the holder) before it
  writes or deletes anything. On filesystems without ``flock`` the lock
  falls back to its record (host, pid, token): a record of this process, or
  of a process of this host that no longer runs, is taken over; a record of
  another host is honoured until someone deletes the file.
* Only the lock holder deletes, in the background after a commit: committed
  snapshots beyond ``keep`` (never ``latest``'s) and ``.partial`` directories,
  which under the lock are the holder's own failed saves or those of a writer
  that died.

The lock is held per process (``_HELD``), not per optimizer: the kernel
releases a ``flock`` only with its file descriptor, and a later optimizer of
the same process (a notebook, a re-built model) is the same job.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from zeroplan.core import CheckpointError
from zeroplan.facade.checkpoint.names import (
    LATEST,
    LOCK,
    MANIFEST,
    PARTIAL,
    partial_number,
    snapshot_name,
    snapshot_number,
)

__all__ = ["claim", "cleanup", "next_name", "point_latest", "resolve"]

#: This process, as written in the lock's record.
_ME = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}
#: Roots whose lock this process holds: resolved root -> the descriptor holding the flock.
_HELD: dict[str, int] = {}
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}

_ANOTHER_WRITER = (
    "another job writes checkpoints to {root!r} ({holder} holds {lock!r}): two jobs on one "
    "checkpoint directory would delete each other's snapshots. Give this job its own directory, or "
    "stop the other job first{stale}"
)


def _numbered(root: Path, number_of: Callable[[str], int | None]) -> list[tuple[int, Path]]:
    """Directories of ``root`` whose names ``number_of`` numbers, by increasing number."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        number = number_of(path.name)
        if number is not None and path.is_dir():
            found.append((number, path))
    return sorted(found)


def held_snapshots(root: Path) -> tuple[int, ...]:
    """The numbers of the committed snapshot directories in ``root``, increasing (none if not a root)."""
    return tuple(n for n, _ in _numbered(root, snapshot_number))


def next_name(root: Path) -> str:
    """The name of the next snapshot: one more than any committed or partial number in ``root``."""
    used = [n for n, _ in _numbered(root, snapshot_number) + _numbered(root, partial_number)]
    return snapshot_name(max(used, default=0) + 1)


def resolve(path: Path) -> Path:
    """The committed snapshot ``path`` refers to (a checkpoint root or a snapshot directory).

    Raises:
        CheckpointError: ``path`` is an interrupted save, holds no checkpoint,
            or its ``latest`` names anything but an existing snapshot of ``path``.
    """
    if path.name.endswith(PARTIAL):
        raise CheckpointError(f"{str(path)!r} is an interrupted save, not a checkpoint")
    pointer = path / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if snapshot_number(name) is None:
            raise CheckpointError(
                f"{str(pointer)!r} holds {name[:200]!r}, which is not the name of a snapshot of that "
                "directory (snapshot-<digits>; paths are not followed): write the name of one of its "
                "snapshot directories into it, or load a snapshot directory directly"
            )
        snapshot = path / name
        if not snapshot.is_dir():
            raise CheckpointError(f"{str(path)!r}: 'latest' names {name!r}, which does not exist")
        if snapshot.resolve().parent != path.resolve():
            raise CheckpointError(
                f"{str(snapshot)!r} is a link out of {str(path)!r}: 'latest' must name a snapshot of its "
                "own directory; copy the snapshot in instead of linking it"
            )
        return snapshot
    if (path / MANIFEST).is_file():
        return path
    raise CheckpointError(f"no zeroplan checkpoint at {str(path)!r} (no 'latest' and no manifest.json)")


def point_latest(root: Path, name: str) -> None:
    """Atomically make ``root/latest`` name snapshot ``name``."""
    temporary = root / (LATEST + ".tmp")
    with open(temporary, "w") as handle:
        handle.write(name)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, root / LATEST)


# --------------------------------------------------------------------------- the writer lock
def _describe(record: dict[str, object] | None) -> str:
    if not record:
        return "a process that left no record"
    return f"process {record.get('pid')} on host {record.get('host')!r}"


def _read_record(lock: Path) -> dict[str, object] | None:
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(lock.read_text() or "null")
        return record if isinstance(record, dict) else None
    return None


def _alive(record: dict[str, object]) -> bool:
    """Whether the record's process may still run (another host's: assume it does)."""
    if record.get("host") != _ME["host"] or not isinstance(record.get("pid"), int):
        return True
    if record["pid"] == _ME["pid"]:  # our pid, not our token: an earlier process of that pid
        return False
    try:
        os.kill(record["pid"], 0)  # type: ignore[arg-type]
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _claim_by_record(root: Path, lock: Path) -> None:
    """The lock on a filesystem without ``flock``: its record says who holds it."""
    record = _read_record(lock)
    if record and record.get("token") != _ME["token"] and _alive(record):
        stale = f"; if that job has ended, delete {str(lock)!r}"
        raise CheckpointError(
            _ANOTHER_WRITER.format(root=str(root), holder=_describe(record), lock=str(lock), stale=stale)
        )
    temporary = lock.with_name(f"{LOCK}.{_ME['token']}")
    temporary.write_text(json.dumps(_ME))
    os.replace(temporary, lock)
    if _read_record(lock) != _ME:  # another job replaced it at the same moment
        raise CheckpointError(
            _ANOTHER_WRITER.format(
                root=str(root), holder=_describe(_read_record(lock)), lock=str(lock), stale=""
            )
        )


def claim(root: Path) -> None:
    """Make this process the one writer of ``root`` (see [Note: checkpoint root]); idempotent.

    Raises:
        CheckpointError: another live job holds the root's lock (the message names it).
        OSError: the lock file cannot be created.
    """
    lock = root / LOCK
    key = str(root.resolve())
    held = _HELD.get(key)
    if held is not None:
        with contextlib.suppress(OSError):
            if os.fstat(held).st_ino == os.stat(lock).st_ino:
                return
        # The lock file was deleted or replaced under us: take the one there now.
        os.close(held)
        del _HELD[key]
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _describe(_read_record(lock))
        raise CheckpointError(
            _ANOTHER_WRITER.format(root=str(root), holder=holder, lock=str(lock), stale="")
        ) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _NO_FLOCK:
            raise
        _claim_by_record(root, lock)
        return
    try:  # the record only names the holder in other jobs' errors; the flock is the lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_ME).encode(), 0)
        os.fsync(fd)
    except OSError:
        os.close(fd)  # releases the flock
        raise
    _HELD[key] = fd


# --------------------------------------------------------------------------- cleanup
def _remove(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def cleanup(root: Path, keep: int, committed: str) -> None:
    """Delete, in the background, snapshots beyond the newest ``keep`` and partial saves.

    Only the lock holder calls it, after committing ``committed`` (which is
    ``latest`` and never deleted); names that are not ours are left alone.
    """
    snapshots = [path for _, path in _numbered(root, snapshot_number)]
    doomed = [path for path in snapshots[:-keep] if path.name != committed]
    doomed += [path for _, path in _numbered(root, partial_number)]
    # They are no longer referenced: delete them without holding up training.
    threading.Thread(target=_remove, args=(doomed,), name="zeroplan-checkpoint-cleanup", daemon=True).start()
