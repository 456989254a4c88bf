# zeroplan.core — pure planning: no torch, no I/O.
# Stable digests: the same value gives the same string on every machine and run.
"""Stable fingerprints of plan values (sha256 over a canonical text form)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["Rendered", "digest", "render"]


class Rendered(NamedTuple):
    """Parts already written as :func:`digest` writes them: ``"\\x1f" + repr(part)`` for each, joined.

    For values with millions of parts (a stage-3 plan's fragments) whose text
    can be written faster than part by part; the digest is the same.

    Example:
        >>> digest("x", [1, Rendered.of([(2, 3), "a"])]) == digest("x", [1, (2, 3), "a"])
        True
    """

    text: str

    @classmethod
    def of(cls, parts: Iterable[object]) -> Rendered:
        """The text of ``parts``, each written as :func:`digest` would."""
        return cls("".join(["\x1f" + repr(part) for part in parts]))


def render(value: object) -> str:
    """``repr(value)``, written without a ``repr`` per item for tuples of one repeated int.

    For long tuples only (a block of thousands of equal pieces is one such
    tuple); a short one is slower to render than to ``repr``.

    Example:
        >>> render((("a", (4, 4, 4)), (5,), ())) == repr((("a", (4, 4, 4)), (5,), ()))
        True
    """
    if type(value) is not tuple or not value:
        return repr(value)
    types = set(map(type, value))
    if types == {int}:
        first = value[0]
        if len(value) > 1 and value.count(first) == len(value):
            return "(" + ", ".join([repr(first)] * len(value)) + ")"
        return repr(value)
    if tuple in types:
        texts: dict[int, str] = {}  # an item repeated as one object (equal blocks) is written once

        def once(item: object) -> str:
            text = texts.get(id(item))
            if text is None:
                text = texts[id(item)] = render(item)
            return text

        return "(" + ", ".join(map(once, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def digest(kind: str, parts: Iterable[object]) -> str:
    """Hex sha256 of ``kind`` and the ``repr`` of each part, in order.

    Only ints, strings, bools, ``None`` and tuples of those may be passed, so
    the text form (and the digest) does not depend on the Python run
    (no ``hash()``, no object ids, no set ordering); a :class:`Rendered` part
    stands for the parts whose text it holds.

    Example:
        >>> digest("x", [1, "a", (2, 3)]) == digest("x", [1, "a", (2, 3)])
        True
        >>> len(digest("x", []))
        16
    """
    h = hashlib.sha256(kind.encode())
    for part in parts:
        if type(part) is Rendered:
            h.update(part.text.encode())
            continue
        h.update(b"\x1f")
        h.update(repr(part).encode())
    return h.hexdigest()[:16]
