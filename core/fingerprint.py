# zeroplan.core — pure planning: no torch, no I/O.
# Stable digests: the same value gives the same string on every machine and run.
"""Stable fingerprints of plan values (sha256 over a canonical text form)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["digest"]


def digest(kind: str, parts: Iterable[object]) -> str:
    """Hex sha256 of ``kind`` and the ``repr`` of each part, in order.

    Only ints, strings, bools, ``None`` and tuples of those may be passed, so
    the text form (and the digest) does not depend on the Python run
    (no ``hash()``, no object ids, no set ordering).

    Example:
        >>> digest("x", [1, "a", (2, 3)]) == digest("x", [1, "a", (2, 3)])
        True
        >>> len(digest("x", []))
        16
    """
    h = hashlib.sha256(kind.encode())
    for part in parts:
        h.update(b"\x1f")
        h.update(repr(part).encode())
    return h.hexdigest()[:16]
